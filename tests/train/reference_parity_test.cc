// The engine against independent PyTorch references (tests/reference/gpt2_reference.py,
// llama_reference.py) loaded with the same weights by their Hugging Face names, run through the
// executor — the path training uses: logits, loss and every gradient for one batch, and the
// losses of ten AdamW steps with clipping and weight decay.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "ckpt/safetensors.h"
#include "kernels/cpu.h"
#include "relative_error.h"
#include "train/checkpoint.h"
#include "one_process_engine.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) ADD_FAILURE() << name << " is not set (run through ctest)";
  return v ? v : "";
}

struct Case {
  std::string name;
  model::ModelConfig mc;
  int64_t B, T;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// One process: a training plan and its executor over a single-rank communicator.
using Engine = testing::OneProcessEngine;

plan::PlanConfig plan_config(const Case& c, plan::PlanConfig::Mode mode = plan::PlanConfig::Mode::train) {
  plan::PlanConfig pc;
  pc.batch = c.B;
  pc.seq = c.T;
  pc.threads = 2;
  pc.mode = mode;
  return pc;
}

void check_close(const std::string& what, const float* got, const float* want, int64_t n) {
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LE(max_diff, 1e-4 * max_ref) << what << ": max |diff| " << max_diff << ", max |ref| " << max_ref;
}

class ReferenceParity : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceParity, LogitsLossGradientsAndAdamW) {
  const Case c = GetParam();
  kernels::init_compute(2);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_parity_" + std::to_string(::getpid()) + "_" + c.name);
  fs::remove_all(dir);
  fs::create_directories(dir);

  Engine e(c.mc, plan_config(c));
  e.ex.init_params(42);
  save_checkpoint((dir / "ckpt").string(), e.desc, e.plan.layout, e.ex.whole(plan::State::params), nullptr,
                  nullptr, [] { RunState st; st.seed = 42, st.tokenizer = "gpt2"; return st; }(), TrainConfig{});

  std::mt19937 rng(7);
  std::vector<int32_t> inputs(c.B * c.T), targets(c.B * c.T);
  for (auto& t : inputs) t = static_cast<int32_t>(rng() % c.mc.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % c.mc.vocab_size);
  ckpt::SafetensorsWriter batch;
  batch.add("inputs", ckpt::StDType::I32, {c.B, c.T}, inputs.data(), inputs.size() * 4);
  batch.add("targets", ckpt::StDType::I32, {c.B, c.T}, targets.data(), targets.size() * 4);
  batch.write((dir / "batch.safetensors").string());

  const float lr = 1e-3f, wd = 0.1f, clip = 1.0f;
  const int steps = 10;
  const char* script = c.mc.family == model::Family::gpt2 ? "gpt2_reference.py" : "llama_reference.py";
  const std::string cmd = env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") + "/tests/reference/" +
                          script + " --model-dir " + (dir / "ckpt").string() + " --batch " +
                          (dir / "batch.safetensors").string() + " --out " + (dir / "ref.safetensors").string() +
                          " --adam-steps " + std::to_string(steps) + " --lr 1e-3 --beta1 0.9 --beta2 0.95 --eps 1e-8" +
                          " --weight-decay 0.1 --grad-clip 1.0";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ckpt::SafetensorsFile ref((dir / "ref.safetensors").string());

  auto fill = [&](int, int32_t* in, int32_t* tg) {
    std::copy(inputs.begin(), inputs.end(), in);
    std::copy(targets.begin(), targets.end(), tg);
  };
  const float scale = 1.0f / static_cast<float>(c.B * c.T);

  // Logits: a forward-only plan over the same state.
  const int64_t V = c.mc.vocab_size, N = c.B * c.T;
  std::vector<float> logits(N * V), ref_logits(N * V);
  run::StepInputs fwd;
  fwd.batch = fill;
  fwd.logits = logits.data();
  fwd.all_logits = true;
  e.ex.run(plan::build_plan(e.desc, plan_config(c, plan::PlanConfig::Mode::logits)), 0, fwd);
  ref.read_f32("logits", ref_logits.data(), N * V);
  check_close("logits", logits.data(), ref_logits.data(), N * V);

  // Loss and gradients: a training step that changes nothing (lr 0, no clipping).
  run::StepInputs in;
  in.batch = fill;
  in.grad_scale = scale;
  in.opt = {0.0f, 0.9f, 0.95f, 1e-8f, 0.0f};
  const double loss = e.ex.step(0, in).loss_sum * scale;
  float ref_loss;
  ref.read_f32("loss", &ref_loss, 1);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));
  int checked = 0;
  const float* grads = e.ex.whole(plan::State::grads);
  for (size_t u = 0; u < e.desc.units.size(); ++u)
    for (const auto& p : e.desc.units[u].params) {
      std::vector<float> want(p.exported_numel());
      ref.read_f32("grad." + p.name, want.data(), p.exported_shape());
      check_close("grad." + p.name, grads + e.plan.layout.units[u].offset + p.offset, want.data(), p.exported_numel());
      ++checked;
    }
  int ref_grads = 0;
  for (const auto& name : ref.names()) ref_grads += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, ref_grads);  // every parameter the reference has, and no other

  // Ten AdamW steps from the same start.
  Engine fresh(c.mc, plan_config(c));
  fresh.ex.init_params(42);
  std::vector<float> ref_losses(steps);
  ref.read_f32("adam_losses", ref_losses.data(), steps);
  for (int s = 0; s < steps; ++s) {
    run::StepInputs st = in;
    st.grad_clip = clip;
    st.opt = {lr, 0.9f, 0.95f, 1e-8f, wd};
    st.adam_t = s + 1;
    const double l = fresh.ex.step(s, st).loss_sum * scale;
    EXPECT_NEAR(l, ref_losses[s], 1e-5 * std::fabs(ref_losses[s])) << "AdamW step " << s;
  }
  fs::remove_all(dir);
}

// --act-quant int8 against the same PyTorch reference (fp32 throughout): the loss is the
// reference's (the forward is uncompressed), and each gradient tracks PyTorch's within the int8
// error (relative L2 <= 2% for nearest rounding, 4% for stochastic, where the fp32 engine is within
// 1e-4 of the largest element above). The models are tiny (C = 64, 32 tokens): few values per
// gradient element, so the relative errors are larger than `small`'s (BENCHMARKS.md).
TEST_P(ReferenceParity, ActQuantGradientsTrackPyTorch) {
  const Case c = GetParam();
  kernels::init_compute(2);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_parity_aq_" + std::to_string(::getpid()) + "_" + c.name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::mt19937 rng(7);
  std::vector<int32_t> inputs(c.B * c.T), targets(c.B * c.T);
  for (auto& t : inputs) t = static_cast<int32_t>(rng() % c.mc.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % c.mc.vocab_size);
  for (bool stochastic : {false, true}) {
    plan::PlanConfig pc = plan_config(c);
    pc.act_quant = {32, stochastic};
    Engine e(c.mc, pc);
    e.ex.init_params(42);
    if (!stochastic) {
      save_checkpoint((dir / "ckpt").string(), e.desc, e.plan.layout, e.ex.whole(plan::State::params), nullptr,
                      nullptr, [] { RunState st; st.seed = 42, st.tokenizer = "gpt2"; return st; }(), TrainConfig{});
      ckpt::SafetensorsWriter batch;
      batch.add("inputs", ckpt::StDType::I32, {c.B, c.T}, inputs.data(), inputs.size() * 4);
      batch.add("targets", ckpt::StDType::I32, {c.B, c.T}, targets.data(), targets.size() * 4);
      batch.write((dir / "batch.safetensors").string());
      const char* script = c.mc.family == model::Family::gpt2 ? "gpt2_reference.py" : "llama_reference.py";
      const std::string cmd = env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") +
                              "/tests/reference/" + script + " --model-dir " + (dir / "ckpt").string() + " --batch " +
                              (dir / "batch.safetensors").string() + " --out " + (dir / "ref.safetensors").string();
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    ckpt::SafetensorsFile ref((dir / "ref.safetensors").string());
    const float scale = 1.0f / static_cast<float>(c.B * c.T);
    run::StepInputs in;
    in.batch = [&](int, int32_t* i, int32_t* t) {
      std::copy(inputs.begin(), inputs.end(), i);
      std::copy(targets.begin(), targets.end(), t);
    };
    in.grad_scale = scale;
    in.opt = {0.0f, 0.9f, 0.95f, 1e-8f, 0.0f};
    in.quant_seed = 3;
    const double loss = e.ex.step(0, in).loss_sum * scale;
    float ref_loss;
    ref.read_f32("loss", &ref_loss, 1);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));
    const float* grads = e.ex.whole(plan::State::grads);
    for (size_t u = 0; u < e.desc.units.size(); ++u)
      for (const auto& p : e.desc.units[u].params) {
        std::vector<float> want(p.exported_numel());
        ref.read_f32("grad." + p.name, want.data(), p.exported_shape());
        const float* got = grads + e.plan.layout.units[u].offset + p.offset;
        // Stochastic rounding trades bias for variance: its error per value is up to a step, not half.
        EXPECT_LE(testing::relative_l2(got, want.data(), p.exported_numel()), stochastic ? 0.04 : 0.02)
            << p.name << (stochastic ? " stochastic" : " nearest") << ": relative L2 error against PyTorch";
      }
  }
  fs::remove_all(dir);
}

model::ModelConfig gpt2_config(int64_t T_max) {
  model::ModelConfig m = model::model_preset("tiny", 300);  // padded to 384: padding rows stay out of the softmax
  m.max_seq = T_max;
  return m;
}

model::ModelConfig llama_config(bool tied) {
  model::ModelConfig m = model::model_preset("llama-tiny", 300);  // 4 heads, 2 key/value heads
  m.tie_embeddings = tied;
  m.rope_theta = 500.0;  // rotations large enough at T = 80 to matter
  return m;
}

// Llama 3.1's rope scaling, with an original context of 32 so that at head size 16 one frequency
// is kept, two are smoothed and five divided by the factor (wavelengths 6.3 .. 1188 against 8 and 32).
model::ModelConfig llama31_config() {
  model::ModelConfig m = llama_config(false);
  m.rope_scaling = {8, 1, 4, 32};
  return m;
}

// T = 16 fits one attention block; T = 80 spans two with a ragged tail.
INSTANTIATE_TEST_SUITE_P(Models, ReferenceParity,
                         ::testing::Values(Case{"gpt2_T16", gpt2_config(32), 2, 16},
                                           Case{"gpt2_T80", gpt2_config(96), 2, 80},
                                           Case{"llama_untied_T80", llama_config(false), 2, 80},
                                           Case{"llama_tied_T16", llama_config(true), 2, 16},
                                           Case{"llama31_rope_scaled_T80", llama31_config(), 2, 80}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace shardlm::train
