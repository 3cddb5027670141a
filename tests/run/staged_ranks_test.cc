// The device path of several ranks without a GPU: SHARDLM_TEST_CPU_AS_DEVICE makes the CPU backend
// answer that its memory is not the host's, so the executor uploads and downloads state and every
// collective on state is staged (device -> host -> MPI -> device, comm/staged.h), as on a GPU shared
// by two ranks. Copies change no value: each strategy's losses equal the host-memory run's bit for
// bit, fp32 and bf16 collectives, buckets included.
#include <gtest/gtest.h>
#include <unistd.h>

#include "run/test_util.h"

namespace shardlm::testing {
namespace {

namespace fs = std::filesystem;

class StagedRanksSlow : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_staged_ranks_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    make_corpus(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<double> train(const std::string& flags, const std::string& name, bool staged) {
    const fs::path out = dir_ / name;
    const Result r = mpirun(2,
                            "train --model tiny --batch 2 --seq 32 --threads 1 --steps 3 --eval-windows 1 "
                            "--sample-tokens 0 --peak-gflops 100 --data " +
                                (dir_ / "tok").string() + " --out " + out.string() + " " + flags,
                            staged ? "-x SHARDLM_TEST_CPU_AS_DEVICE=1" : "");
    EXPECT_EQ(r.code, 0) << name << ": " << r.out;
    // The run says which path it took, so a lost environment variable cannot pass for staging.
    const std::string said = staged ? "kernels cpu-as-device, collectives mpi staged through host memory"
                                    : "kernels cpu, collectives mpi\n";
    EXPECT_NE(r.out.find(said), std::string::npos) << name << ": " << r.out;
    return step_losses(out / "metrics.jsonl");
  }
  fs::path dir_;
};

TEST_F(StagedRanksSlow, EveryStrategyGivesTheHostRunsLossesBitForBit) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ddp", "--strategy ddp --bucket-mb 0.01"},
      {"zero2", "--strategy zero2"},
      {"fsdp", "--strategy fsdp"},
      {"fsdp_bf16", "--strategy fsdp --param-dtype bf16 --reduce-dtype bf16 --gather-bucket-mb 0.05"},
      {"zero1_bf16", "--strategy zero1 --reduce-dtype bf16"},
  };
  for (const auto& [name, flags] : cases) {
    const std::vector<double> host = train(flags, name + "_host", false);
    const std::vector<double> staged = train(flags, name + "_staged", true);
    ASSERT_EQ(host.size(), 3u) << name;
    EXPECT_EQ(staged, host) << name;
  }
}

}  // namespace
}  // namespace shardlm::testing
