// The device path of several ranks without a GPU: SHARDLM_TEST_CPU_AS_DEVICE makes the CPU backend
// answer that its memory is not the host's (and keeps it out of the host code's reach:
// kernels/guarded_pages.h), so the executor uploads and downloads state and every collective on
// state is staged (device -> host -> MPI -> device, comm/staged.h), as on a GPU shared by two
// ranks. Copies change no value: each strategy's losses equal the host-memory run's bit for bit,
// fp32 and bf16 collectives, buckets included; so do context parallelism's exchanges (the ring's
// sends and receives, the head split's all-to-all with its sizes header) and expert parallelism's,
// staged alike, the offload tier, which for a device is host memory (run/host_store.h) instead of
// the disk, and --act-quant int8's quantize and dequantize kernels.
#include <gtest/gtest.h>
#include <unistd.h>

#include <tuple>

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

  std::vector<double> train(const std::string& flags, const std::string& name, bool staged,
                            const std::string& model = "tiny") {
    const fs::path out = dir_ / name;
    const Result r = mpirun(2,
                            "train --model " + model + " --batch 2 --seq 32 --threads 1 --steps 3 --eval-windows 1 "
                            "--sample-tokens 0 --peak-gflops 100 --data " +
                                (dir_ / "tok").string() + " --out " + out.string() + " " + flags,
                            staged ? "-x SHARDLM_TEST_CPU_AS_DEVICE=1" : "");
    EXPECT_EQ(r.code, 0) << name << ": " << r.out;
    // The run says which path it took, so a lost environment variable cannot pass for staging.
    const std::string said = staged ? "kernels cpu-as-device, collectives mpi staged through host memory"
                                    : "kernels cpu, collectives mpi\n";
    EXPECT_NE(r.out.find(said), std::string::npos) << name << ": " << r.out;
    last_out_ = r.out;
    return step_losses(out / "metrics.jsonl");
  }
  fs::path dir_;
  std::string last_out_;  // the last run's output
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

TEST_F(StagedRanksSlow, ContextParallelExchangesGiveTheHostRunsLossesBitForBit) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"cp_ring", "--cp 2 --cp-impl ring --strategy fsdp"},
      {"cp_a2a", "--cp 2 --cp-impl all-to-all --strategy ddp"},
      {"cp_ring_zero2", "--cp 2 --cp-impl ring --strategy zero2"},
  };
  for (const std::string model : {"tiny", "llama-tiny"})
    for (const auto& [name, flags] : cases) {
      const std::vector<double> host = train(flags, model + "_" + name + "_host", false, model);
      const std::vector<double> staged = train(flags, model + "_" + name + "_staged", true, model);
      ASSERT_EQ(host.size(), 3u) << model << " " << name;
      EXPECT_EQ(staged, host) << model << " " << name;
    }
}

// Expert parallelism's exchanges (the sizes, then the routed rows) staged alike: the MoE block's
// device path (router, dispatch, experts, combine on the backend's buffers) reaches device memory
// only through the backend, which the strict CPU-as-device backend holds it to.
TEST_F(StagedRanksSlow, ExpertParallelExchangesGiveTheHostRunsLossesBitForBit) {
  for (const std::string strategy : {"fsdp", "ddp"}) {
    const std::string flags = "--ep 2 --strategy " + strategy;
    const std::vector<double> host = train(flags, "moe_" + strategy + "_host", false, "moe-tiny");
    const std::vector<double> staged = train(flags, "moe_" + strategy + "_staged", true, "moe-tiny");
    ASSERT_EQ(host.size(), 3u) << strategy;
    EXPECT_EQ(staged, host) << strategy;
  }
}

// --act-quant int8 on a device: the blocks' kept inputs are quantized and dequantized by the
// backend's kernels in device memory (a strict one: kernels/guarded_pages.h), bit for bit the
// host run's, nearest and stochastic, under recompute and context parallelism's stages too.
TEST_F(StagedRanksSlow, ActivationCompressionGivesTheHostRunsLossesBitForBit) {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"tiny", "int8_nearest", "--strategy fsdp --act-quant int8"},
      {"tiny", "int8_stochastic_recompute", "--strategy ddp --act-quant int8 --act-quant-rounding stochastic --recompute selective"},
      {"llama-tiny", "int8_cp_ring", "--strategy fsdp --cp 2 --cp-impl ring --act-quant int8 --act-quant-group 32 --act-quant-rounding stochastic"},
  };
  for (const auto& [model, name, flags] : cases) {
    const std::vector<double> host = train(flags, model + "_" + name + "_host", false, model);
    const std::vector<double> staged = train(flags, model + "_" + name + "_staged", true, model);
    ASSERT_EQ(host.size(), 3u) << name;
    EXPECT_EQ(staged, host) << name;
  }
}

TEST_F(StagedRanksSlow, TheDevicesOffloadTierIsHostMemoryAndChangesNoLoss) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"offload_act", "--strategy fsdp --offload activations"},
      {"offload_state", "--strategy fsdp --offload params,grads,optimizer"},
  };
  for (const auto& [name, flags] : cases) {
    const std::vector<double> host = train(flags, name + "_host", false);
    EXPECT_NE(last_out_.find(" on disk under "), std::string::npos) << name << ": " << last_out_;
    const std::vector<double> staged = train(flags, name + "_staged", true);
    EXPECT_NE(last_out_.find(" in host memory ("), std::string::npos) << name << ": " << last_out_;
    ASSERT_EQ(host.size(), 3u) << name;
    EXPECT_EQ(staged, host) << name;
  }
}

}  // namespace
}  // namespace shardlm::testing
