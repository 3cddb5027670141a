// All-gather buckets change how parameters travel, never what is computed: 2-rank FSDP and
// 4-rank hybrid runs (shard group 2), fp32 and bf16 gathers, with --gather-bucket-mb give the
// same losses bit for bit as one all_gather per unit, and their traces hold fewer all_gathers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "run/test_util.h"

namespace shardlm::testing {
namespace {

namespace fs = std::filesystem;

// The run directory's losses and the number of all_gather slices in rank 0's trace.
struct RunResult {
  std::vector<double> losses;
  int gathers = 0;
};

RunResult train(const fs::path& dir, int ranks, const std::string& flags, const std::string& name) {
  const fs::path out = dir / name, trace = dir / (name + ".trace.json");
  const Result r = mpirun(ranks, "train --model tiny --batch 2 --seq 32 --threads 1 --grad-accum 2 --steps 2 "
                                 "--eval-windows 1 --sample-tokens 0 --peak-gflops 100 --quiet --data " +
                                     (dir / "tok").string() + " --out " + out.string() + " --trace " + trace.string() +
                                     " " + flags);
  EXPECT_EQ(r.code, 0) << name << ": " << r.out;
  RunResult run;
  run.losses = step_losses(out / "metrics.jsonl");
  std::ifstream f(trace);
  if (!f) return run;
  const nlohmann::json trace_json = nlohmann::json::parse(f);
  for (const auto& e : trace_json["traceEvents"])
    if (e["ph"] == "X" && e["pid"] == 0 && e["name"].get<std::string>().rfind("all_gather", 0) == 0) ++run.gathers;
  return run;
}

class GatherBucketsSlow : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_gather_bucket_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    make_corpus(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(GatherBucketsSlow, SameLossesAsOneGatherPerUnitAndFewerGathers) {
  struct Case {
    int ranks;
    std::string flags, name;
  };
  const std::vector<Case> cases = {
      {2, "--strategy fsdp", "fsdp_fp32"},
      {2, "--strategy fsdp --param-dtype bf16", "fsdp_bf16"},
      {4, "--strategy hybrid --shard-group 2", "hybrid_fp32"},
      {4, "--strategy hybrid --shard-group 2 --param-dtype bf16", "hybrid_bf16"},
  };
  for (const Case& c : cases) {
    const RunResult per_unit = train(dir_, c.ranks, c.flags, c.name);
    // 0.4 MiB: the two blocks of tiny (0.19 MiB each in fp32) share a gather; in bf16 the head too.
    const RunResult bucketed = train(dir_, c.ranks, c.flags + " --gather-bucket-mb 0.4", c.name + "_bucketed");
    ASSERT_EQ(per_unit.losses.size(), 2u) << c.name;
    EXPECT_EQ(bucketed.losses, per_unit.losses) << c.name;
    EXPECT_GT(per_unit.gathers, 0) << c.name;
    EXPECT_LT(bucketed.gathers, per_unit.gathers) << c.name;
  }
}

}  // namespace
}  // namespace shardlm::testing
