// The functions behind the refusals of bad input (issue 9): TrainConfig::validate names the flag
// and the value, state.json's fields are range-checked, and a model that cannot fit the machine
// is refused from its configuration or its plan before anything is allocated.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <unistd.h>

#include "plan/plan.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/memory_check.h"
#include "train/trainer.h"

namespace shardlm::train {
namespace {

std::string validate_error(const std::function<void(TrainConfig&)>& edit) {
  TrainConfig c;
  c.data = "tok";
  edit(c);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(TrainConfigValidate, NamesTheFlagAndTheValue) {
  EXPECT_EQ(validate_error([](TrainConfig&) {}), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.batch = 0; }), "--batch: must be >= 1, got 0");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.batch = -1; }), "--batch: must be >= 1, got -1");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.n_layer = -2; }), "--n-layer: must be >= 0, got -2");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.seq = 0; }), "--seq: must be >= 1, got 0");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.eval_windows = 0; }), "--eval-windows: must be >= 1, got 0");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.lr = INFINITY; }), "--lr: must be finite, got inf");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.beta2 = 1; }), "--beta2: must be in [0, 1), got 1");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.eps = NAN; }), "--eps: must be > 0, got nan");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.out = ""; }), "--out: the run directory is an empty string");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.reduce_dtype = "fp8"; }), "--reduce-dtype: must be fp32 or bf16, got 'fp8'");
}

// Every strategy runs on CUDA (ranks stage their collectives through host memory), and context
// parallelism with staged exchanges; what the CUDA backend cannot run yet is refused with one line
// naming the flags.
TEST(TrainConfigValidate, CudaRunsEveryStrategyAndContextParallelismButNotExperts) {
  for (const char* strategy : {"ddp", "zero1", "zero2", "fsdp", "hybrid"})
    EXPECT_EQ(validate_error([&](TrainConfig& c) { c.device = "cuda", c.strategy = strategy; }), "") << strategy;
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.model = "moe-tiny", c.ep = 2; }),
            "--device cuda: --ep is not supported yet (no CUDA kernels for experts)");
  for (const char* impl : {"ring", "all-to-all"})
    EXPECT_EQ(validate_error([&](TrainConfig& c) { c.device = "cuda", c.cp = 2, c.cp_impl = impl, c.strategy = "fsdp"; }), "")
        << impl;
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.cp = 2, c.comm_backend = "nccl"; }),
            "--cp with --comm nccl: not supported yet (context parallelism's exchanges run staged through host "
            "memory: --comm auto)");
}

// --comm picks the collectives over GPU memory: NCCL needs the CUDA device; the CPU path is
// unchanged (auto and mpi are both MPI there).
TEST(TrainConfigValidate, CommNcclNeedsCuda) {
  for (const char* comm : {"auto", "mpi"})
    EXPECT_EQ(validate_error([&](TrainConfig& c) { c.comm_backend = comm; }), "") << comm;
  for (const char* strategy : {"ddp", "zero2", "fsdp", "hybrid"})
    EXPECT_EQ(validate_error([&](TrainConfig& c) { c.device = "cuda", c.comm_backend = "nccl", c.strategy = strategy; }), "")
        << strategy;
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.comm_backend = "nccl"; }),
            "--comm nccl: needs --device cuda (NCCL moves GPU memory; the CPU's collectives are MPI's)");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.comm_backend = "gloo"; }), "--comm: must be auto, mpi or nccl, got 'gloo'");
}

TEST(TrainConfigValidate, ModelOverridesAreChecked) {
  TrainConfig c;
  c.model = "llama-tiny";
  c.n_kv_head = 3;
  try {
    c.model_config(256);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head (3) does not divide n_head (4)"), std::string::npos) << e.what();
  }
  c.n_kv_head = 0;
  c.n_layer = 2000000;
  EXPECT_THROW(c.model_config(256), std::invalid_argument);  // above the layer limit
}

TEST(ReadCheckpointState, FieldsAreRangeChecked) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("state_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto error_of = [&](const std::string& json) {
    std::ofstream(dir / "state.json") << json;
    try {
      read_checkpoint_state(dir.string());
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error_of(R"({"step": 3, "tokenizer": "bytes", "rng": {"seed": 5}})"), "");
  const std::string path = (dir / "state.json").string();
  EXPECT_EQ(error_of(R"({"step": -7, "tokenizer": "bytes", "rng": {"seed": 5}})"),
            "checkpoint: " + path + ": field 'step' must be an integer >= 0, got -7");
  EXPECT_NE(error_of(R"({"step": "3", "tokenizer": "bytes", "rng": {"seed": 5}})").find("'step'"), std::string::npos);
  EXPECT_NE(error_of(R"({"step": 3, "tokenizer": "bytes", "rng": {"seed": -1}})").find("'seed'"), std::string::npos);
  EXPECT_NE(error_of(R"({"step": 3, "tokenizer": "bytes", "rng": 5})").find("'rng'"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(MemoryCheck, RefusesWhatCannotFitWithTheFigures) {
  const MachineMemory m = machine_memory();
  ASSERT_GT(m.physical, 0);
  EXPECT_GT(m.available, 0);
  EXPECT_LE(m.available, m.physical);
  model::ModelConfig c = model::model_preset("tiny", 256);
  EXPECT_NO_THROW(refuse_unless_state_fits(c, 16, 1, Machines{}));
  c.n_layer = 1000000;  // 5e10 parameters: 800 GB of training state
  try {
    refuse_unless_state_fits(c, 16, 1, Machines{});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("n_layer 1000000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
  }
  // Sharded over enough ranks the same state is no longer refused by the first check.
  EXPECT_NO_THROW(refuse_unless_state_fits(c, 16, 1 << 20, Machines{}));

  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 256));
  TrainConfig tc;
  tc.batch = 2;
  tc.seq = 32;
  EXPECT_NO_THROW(refuse_unless_plan_fits(plan::build_plan(desc, plan_config(tc, 1)), true, Machines{}));
  tc.batch = 8388607;  // 2^31 tokens: terabytes of activations
  tc.seq = 256;
  try {
    refuse_unless_plan_fits(plan::build_plan(desc, plan_config(tc, 1)), false, Machines{});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the plan needs"), std::string::npos) << msg;
    EXPECT_NE(msg.find("activations"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace shardlm::train
