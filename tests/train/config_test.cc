// The functions behind the refusals of bad input: TrainConfig::validate names the flag
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
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.lr_decay = "exp"; }),
            "--lr-decay: must be cosine, linear, sqrt or none, got 'exp'");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.decay_fraction = 0; }), "--decay-fraction: must be in (0, 1], got 0");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.decay_fraction = 1.5; }), "--decay-fraction: must be in (0, 1], got 1.5");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.offload_prefetch = 65; }),
            "--offload-prefetch: must be in [0, 64] or auto, got 65");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.offload_prefetch = -5; }),
            "--offload-prefetch: must be in [0, 64] or auto, got -5");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.offload_prefetch = 64; }), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.offload = ""; }),
            "--offload: is an empty string (none, or any of params,grads,optimizer,activations)");
}

// The default is nanoGPT's and llm.c's: warmup, then cosine to min_lr over every step left. A
// decay fraction holds lr until the decay's share of the steps is left (warmup-stable-decay), and
// each shape starts at lr and ends at min_lr.
TEST(LrSchedule, WarmupThenAStablePhaseThenTheDecay) {
  LrSchedule s;  // lr 6e-4, min 6e-5, warmup 100 of 1000 steps, cosine over all 900 after
  EXPECT_FLOAT_EQ(s.at(0), 6e-6f);
  EXPECT_FLOAT_EQ(s.at(99), 6e-4f);
  EXPECT_FLOAT_EQ(s.at(100), 6e-4f);
  EXPECT_NEAR(s.at(550), 3.3e-4f, 1e-9);  // half way: the mean of lr and min_lr
  EXPECT_FLOAT_EQ(s.at(1000), 6e-5f);
  EXPECT_EQ(s.decay_start(), 100);
  for (int64_t step = 0; step < 1000; ++step) {  // the formula it replaced, bit for bit
    const float old = step < 100 ? 6e-4f * static_cast<float>(step + 1) / 100.0f
                                 : static_cast<float>(6e-5f + 0.5 * (1.0 + std::cos(M_PI * (step - 100) / 900.0)) *
                                                                  (6e-4f - 6e-5f));
    ASSERT_EQ(s.at(step), old) << "step " << step;
  }

  s.decay_fraction = 0.2;  // the last 180 of the 900 steps
  EXPECT_EQ(s.decay_start(), 820);
  EXPECT_FLOAT_EQ(s.at(500), 6e-4f);
  EXPECT_FLOAT_EQ(s.at(820), 6e-4f);
  EXPECT_LT(s.at(821), 6e-4f);
  for (LrDecay d : {LrDecay::cosine, LrDecay::linear, LrDecay::sqrt}) {
    s.decay = d;
    SCOPED_TRACE(static_cast<int>(d));
    EXPECT_FLOAT_EQ(s.at(820), 6e-4f);
    EXPECT_NEAR(s.at(999), 6e-5f, 2e-5);
    for (int64_t step = 821; step < 1000; ++step) EXPECT_LT(s.at(step), s.at(step - 1)) << step;
  }
  s.decay = LrDecay::linear;
  EXPECT_NEAR(s.at(910), 3.3e-4f, 1e-9);  // half way through the decay
  s.decay = LrDecay::sqrt;
  EXPECT_NEAR(s.at(865), 6e-5f + (1 - std::sqrt(0.25)) * 5.4e-4f, 1e-9);
  s.decay = LrDecay::none;
  EXPECT_FLOAT_EQ(s.at(999), 6e-4f);
  EXPECT_FLOAT_EQ(s.at(5000), 6e-4f);
  EXPECT_EQ(parse_lr_decay("sqrt"), LrDecay::sqrt);
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

// A device run saves, snapshots, resumes and starts from given weights: its state moves through
// the backend's downloads and uploads (tests/run/device_checkpoint_test.cc); it compresses
// activations with the backend's int8 kernels.
TEST(TrainConfigValidate, CudaSavesSnapshotsResumesAndCompressesActivations) {
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.save_every = 2, c.async_save = true; }), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.snapshot_every = 1; }), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.resume = "runs/a"; }), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.init_from = "runs/a"; }), "");
  EXPECT_EQ(validate_error([](TrainConfig& c) { c.device = "cuda", c.act_quant = "int8"; }), "");
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
