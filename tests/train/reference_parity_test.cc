// The engine against an independent PyTorch GPT-2 (tests/reference/gpt2_reference.py) loaded with
// the same weights: logits, loss and every gradient for one batch, and the losses of ten AdamW
// steps with clipping and weight decay.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "ckpt/safetensors.h"
#include "kernels/cpu.h"
#include "train/checkpoint.h"
#include "train/model_state.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) ADD_FAILURE() << name << " is not set (run through ctest)";
  return v ? v : "";
}

struct Case {
  model::ModelConfig mc;
  int64_t B, T;
};

void PrintTo(const Case& c, std::ostream* os) { *os << "B=" << c.B << " T=" << c.T; }

class ReferenceParity : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceParity, LogitsLossGradientsAndAdamW) {
  const Case c = GetParam();
  kernels::init_compute(2);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_parity_" + std::to_string(::getpid()) + "_" +
                                                    std::to_string(c.T));
  fs::remove_all(dir);
  fs::create_directories(dir);

  ModelState model(c.mc, 42, true);
  TrainConfig tc;
  save_checkpoint((dir / "ckpt").string(), model, RunState{0, 42, "gpt2"}, tc);

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
  const std::string cmd = env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") +
                          "/tests/reference/gpt2_reference.py --model-dir " + (dir / "ckpt").string() + " --batch " +
                          (dir / "batch.safetensors").string() + " --out " + (dir / "ref.safetensors").string() +
                          " --adam-steps " + std::to_string(steps) + " --lr 1e-3 --beta1 0.9 --beta2 0.95 --eps 1e-8" +
                          " --weight-decay 0.1 --grad-clip 1.0";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ckpt::SafetensorsFile ref((dir / "ref.safetensors").string());

  layers::Activations acts(model.desc(), c.B, c.T);
  layers::BackwardWorkspace ws(model.desc(), c.B, c.T, 2);
  std::copy(inputs.begin(), inputs.end(), acts.inputs);
  std::copy(targets.begin(), targets.end(), acts.targets);
  const float scale = 1.0f / static_cast<float>(c.B * c.T);
  model.zero_grads();
  const double loss = model.run_batch(acts, ws, true, scale) * scale;

  // Logits, from the final norm's output the forward left behind.
  const int64_t V = c.mc.vocab_size, N = c.B * c.T;
  std::vector<float> logits(N * V), ref_logits(N * V), scratch(kernels::head_scratch(N, c.mc.padded_vocab()));
  std::vector<int32_t> ignore(N, -1);
  kernels::lm_head_cross_entropy(nullptr, nullptr, acts.lnf, model.params(0), ignore.data(), N, c.mc.n_embd, V,
                                 c.mc.padded_vocab(), 0.0f, N, scratch.data(), logits.data());
  ref.read_f32("logits", ref_logits.data(), N * V);
  auto check_close = [](const std::string& what, const float* got, const float* want, int64_t n) {
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < n; ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    }
    EXPECT_LE(max_diff, 1e-4 * max_ref) << what << ": max |diff| " << max_diff << ", max |ref| " << max_ref;
  };
  check_close("logits", logits.data(), ref_logits.data(), N * V);

  float ref_loss;
  ref.read_f32("loss", &ref_loss, 1);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));

  int checked = 0;
  for (const auto& t : model.tensors()) {
    std::vector<float> want(t.numel);
    ref.read_f32("grad." + t.spec->name, want.data(), t.shape);
    check_close("grad." + t.spec->name, model.grads_flat() + t.flat_offset, want.data(), t.numel);
    ++checked;
  }
  EXPECT_EQ(checked, 2 + 12 * c.mc.n_layer + 2);

  std::vector<float> ref_losses(steps);
  ref.read_f32("adam_losses", ref_losses.data(), steps);
  for (int s = 0; s < steps; ++s) {
    if (s > 0) {  // step 0's forward and backward already ran above
      model.zero_grads();
      const double l = model.run_batch(acts, ws, true, scale) * scale;
      EXPECT_NEAR(l, ref_losses[s], 1e-5 * std::fabs(ref_losses[s])) << "AdamW step " << s;
    } else {
      EXPECT_NEAR(loss, ref_losses[0], 1e-5 * std::fabs(ref_losses[0]));
    }
    const double norm = model.grad_norm();
    if (norm > clip) model.scale_grads(static_cast<float>(clip / norm));
    model.adamw_step({lr, 0.9f, 0.95f, 1e-8f, wd}, s + 1);
  }
  fs::remove_all(dir);
}

model::ModelConfig small_config(int64_t T_max) {
  model::ModelConfig m;
  m.vocab_size = 300;  // padded to 384: the padding rows must stay out of the softmax
  m.n_layer = 2;
  m.n_head = 4;
  m.n_embd = 64;
  m.max_seq = T_max;
  return m;
}

// T = 16 fits one attention block; T = 80 spans two with a ragged tail.
INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceParity,
                         ::testing::Values(Case{small_config(32), 2, 16}, Case{small_config(96), 2, 80}),
                         [](const auto& info) { return "T" + std::to_string(info.param.T); });

}  // namespace
}  // namespace shardlm::train
