// The pipelined optimizer (--pipeline-optimizer) with real runs: every unit updated speculatively
// during the backward, then kept, redone with clipped gradients or undone, gives bitwise the
// losses, norms and checkpoints of the optimizer that waits for the whole backward, whichever of
// the three happens (a norm that never clips, one that always does, a skipped step), on one
// process and under every strategy at 2 ranks and hybrid at 4, and with all state on disk; and the
// rollback copies are exactly the plan's memory.
#include <gtest/gtest.h>

#include <fstream>

#include "plan/plan.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::shardlm;

class PipelinedOptimizerSlow : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --save-every 5 --on-nonfinite skip";
    runs_.create("pipelined_optimizer");
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static inline testing::TinyRuns runs_;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// Per step: loss, gradient norm, whether the update was skipped.
std::vector<std::string> steps(const fs::path& metrics) {
  std::vector<std::string> out;
  for (const auto& row : testing::read_metrics(metrics))
    if (row.contains("loss")) out.push_back(row["loss"].dump() + " " + row["grad_norm"].dump() + " " + row["skipped_steps"].dump());
  return out;
}

// The same 5 steps of tiny with and without --pipeline-optimizer (under `env`, e.g. a fault):
// equal step records and step-5 checkpoints, byte for byte; the pipelined run's optimizer memory
// is its plan's, which holds the rollback copies.
// `layout`: the plan's flags (explain takes them too); `clip`: the run's --grad-clip.
void expect_bitwise(int ranks, const std::string& layout, const std::string& clip, const std::string& name,
                    const std::string& env = "") {
  SCOPED_TRACE(name);
  const auto& runs = PipelinedOptimizerSlow::runs_;
  auto run = [&](const std::string& out, const std::string& more) {
    const std::string a = runs.args(out, 5, 2) + " " + layout + " --grad-clip " + clip + more;
    if (env.empty()) return ranks == 1 ? shardlm(a) : mpirun(ranks, a);
    // mpirun's local ranks inherit its environment
    return testing::run_command(env + (ranks == 1 ? " " + testing::shardlm_binary() + " " + a
                                                  : " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun "
                                                    "--oversubscribe -np " + std::to_string(ranks) + " " +
                                                        testing::shardlm_binary() + " " + a));
  };
  const Result a = run(name + "_whole", "");
  ASSERT_EQ(a.code, 0) << a.out;
  const Result b = run(name + "_pipelined", " --pipeline-optimizer");
  ASSERT_EQ(b.code, 0) << b.out;
  const fs::path x = runs.out(name + "_whole"), y = runs.out(name + "_pipelined");
  const auto want = steps(x / "metrics.jsonl");
  ASSERT_EQ(want.size(), 5u);
  EXPECT_EQ(steps(y / "metrics.jsonl"), want);
  for (int r = 0; r < ranks; ++r) {
    char file[64];
    std::snprintf(file, sizeof file, "rank-%05d-of-%05d.safetensors", r, ranks);
    EXPECT_TRUE(slurp(x / "ckpt" / "step_5" / file) == slurp(y / "ckpt" / "step_5" / file)) << file << " differs";
  }
  const testing::Explained plan = testing::explained_memory(
      "explain --model tiny --vocab 256 --batch 2 --seq 32 --threads 1 --ranks " + std::to_string(ranks) + " " +
      layout + " --pipeline-optimizer");
  ASSERT_TRUE(plan.own_peak.count("optimizer"));
  const int64_t planned = plan.own_peak.at("optimizer");
  for (const auto& row : testing::read_metrics(y / "metrics.jsonl"))
    if (row.contains("loss")) { EXPECT_EQ(row["mem_max"]["optimizer"].get<int64_t>(), planned) << "step " << row["step"]; }
}

TEST_F(PipelinedOptimizerSlow, OneProcessIsBitwiseWhetherTheNormClipsOrNot) {
  expect_bitwise(1, "", "0", "never_clips");
  expect_bitwise(1, "", "0.05", "always_clips");
  expect_bitwise(1, "", "3", "sometimes_clips");
}

TEST_F(PipelinedOptimizerSlow, OneProcessUndoesASkippedStep) {
  expect_bitwise(1, "", "1", "skipped", "SHARDLM_FAULT_NAN_LOSS=0:3");
}

TEST_F(PipelinedOptimizerSlow, EveryStrategyAtTwoRanksIsBitwise) {
  for (const char* s : {"ddp", "zero1", "zero2", "fsdp"})
    expect_bitwise(2, std::string("--strategy ") + s + " --bucket-mb 0.05", "3", s);
}

// Rank 1's loss alone goes non-finite: rank 0 undoes updates its own values would have kept.
TEST_F(PipelinedOptimizerSlow, FsdpUndoesAStepOneRankSkips) {
  expect_bitwise(2, "--strategy fsdp", "3", "fsdp_skipped", "SHARDLM_FAULT_NAN_LOSS=1:3");
}

// Offloaded state: the sums of squares in the backward, the updates after it, through their windows.
TEST_F(PipelinedOptimizerSlow, WithAllStateOnDiskIsBitwise) {
  expect_bitwise(1, "--offload params,grads,optimizer", "0.05", "offloaded");
  expect_bitwise(2, "--strategy fsdp --offload params,grads,optimizer", "3", "offloaded_fsdp");
}

TEST_F(PipelinedOptimizerSlow, HybridAtFourRanksIsBitwise) {
  expect_bitwise(4, "--strategy hybrid --shard-group 2", "3", "hybrid");
}

}  // namespace
}  // namespace shardlm
