// dit-tiny against an independent PyTorch DiT (tests/reference/dit_reference.py, float64) from the
// same weights, latents, noise, times and labels, run through the executor — the path training
// uses: the loss and every parameter's gradient of one training step, and the predicted velocity
// of a forward-only plan, each within 1e-5 relative.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "ckpt/safetensors.h"
#include "one_process_engine.h"
#include "relative_error.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) ADD_FAILURE() << name << " is not set (run through ctest)";
  return v ? v : "";
}

// B samples as the batch holds them (model::DitSample) and as the reference reads them.
struct Batch {
  int64_t B = 0, L = 0;
  std::vector<float> x0, noise, t;
  std::vector<int32_t> y;
  void fill(const model::ModelConfig& c, char* dst, int64_t bytes) const {
    const model::DitSample s = model::dit_sample(c);
    ASSERT_EQ(bytes, B * s.bytes);
    for (int64_t b = 0; b < B; ++b) {
      char* at = dst + b * s.bytes;
      std::memcpy(at + s.latents, &x0[b * L], sizeof(float) * L);
      std::memcpy(at + s.noise, &noise[b * L], sizeof(float) * L);
      std::memcpy(at + s.time, &t[b], sizeof(float));
      std::memcpy(at + s.label, &y[b], sizeof(int32_t));
    }
  }
};

// dit-tiny (one frame, 2 x 2 patches), and latent video: 4 frames of 8 x 6 in 2 x 2 x 3 patches.
model::ModelConfig video() {
  model::ModelConfig c = model::model_preset("dit-tiny");
  c.frames = 4, c.height = 8, c.width = 6, c.channels = 3;
  c.patch_f = 2, c.patch_h = 2, c.patch_w = 3;
  c.max_seq = c.patch_tokens();
  return c;
}

class DitParity : public ::testing::TestWithParam<model::ModelConfig> {};

TEST_P(DitParity, LossGradientsAndVelocityMatchPyTorch) {
  const model::ModelConfig mc = GetParam();
  const int64_t B = 3, T = mc.patch_tokens(), L = mc.latent_values();
  const fs::path dir = fs::temp_directory_path() / ("shardlm_dit_parity_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  testing::OneProcessEngine e(mc, testing::plan_config(B, T, plan::PlanConfig::Mode::train));

  // Every parameter random (the zero-initialised adaLN and final linears too, so that no
  // gradient is zero by construction), padding zero.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> full(e.plan.layout.total, 0.0f);
  ckpt::SafetensorsWriter weights;
  for (size_t u = 0; u < e.desc.units.size(); ++u)
    for (const auto& p : e.desc.units[u].params) {
      float* at = full.data() + e.plan.layout.units[u].offset + p.offset;
      for (int64_t i = 0; i < p.numel; ++i) at[i] = 0.05f * normal(rng);
      weights.add_f32(p.name, p.shape, at);
    }
  weights.write((dir / "weights.safetensors").string());
  e.ex.load_full(plan::State::params, full.data());

  Batch batch;
  batch.B = B, batch.L = L;
  for (int64_t i = 0; i < B * L; ++i) batch.x0.push_back(normal(rng)), batch.noise.push_back(normal(rng));
  for (int64_t b = 0; b < B; ++b) batch.t.push_back(1.0f / (1.0f + std::exp(-normal(rng))));
  batch.y = {3, static_cast<int32_t>(mc.num_classes), 7};  // one sample of the null class
  const std::vector<int64_t> shape{B, mc.channels, mc.frames, mc.height, mc.width};
  ckpt::SafetensorsWriter bw;
  bw.add_f32("x0", shape, batch.x0.data());
  bw.add_f32("noise", shape, batch.noise.data());
  bw.add_f32("t", {B}, batch.t.data());
  bw.add("y", ckpt::StDType::I32, {B}, batch.y.data(), batch.y.size() * 4);
  bw.write((dir / "batch.safetensors").string());

  const std::string cmd =
      env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") + "/tests/reference/dit_reference.py" +
      " --weights " + (dir / "weights.safetensors").string() + " --batch " + (dir / "batch.safetensors").string() +
      " --out " + (dir / "ref.safetensors").string() + " --layers " + std::to_string(mc.n_layer) + " --heads " +
      std::to_string(mc.n_head) + " --width " + std::to_string(mc.n_embd) + " --frames " + std::to_string(mc.frames) +
      " --height " + std::to_string(mc.height) + " --width-px " + std::to_string(mc.width) + " --channels " +
      std::to_string(mc.channels) + " --patch " + std::to_string(mc.patch_f) + "," + std::to_string(mc.patch_h) + "," +
      std::to_string(mc.patch_w) + " --classes " + std::to_string(mc.num_classes);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ckpt::SafetensorsFile ref((dir / "ref.safetensors").string());
  const auto fill = [&](int64_t, char* dst, int64_t bytes) { batch.fill(mc, dst, bytes); };

  // The predicted velocity: a forward-only plan over the same state.
  std::vector<float> pred(B * L), ref_pred(B * L);
  run::StepInputs fwd;
  fwd.samples = fill;
  fwd.logits = pred.data();
  fwd.all_logits = true;
  e.ex.run(plan::build_plan(e.desc, testing::plan_config(B, T, plan::PlanConfig::Mode::logits)), 0, fwd);
  ref.read_f32("pred", ref_pred.data(), shape);
  const double pred_error = testing::relative_l2(pred.data(), ref_pred.data(), B * L);
  EXPECT_LE(pred_error, 1e-5) << "predicted velocity";

  // One training step that changes nothing (lr 0): its loss and gradients.
  run::StepInputs in;
  in.samples = fill;
  in.grad_scale = 1.0f / static_cast<float>(B * T);
  in.opt = {0.0f, 0.9f, 0.95f, 1e-8f, 0.0f};
  const double loss = e.ex.step(0, in).loss_sum * in.grad_scale;
  float ref_loss;
  ref.read_f32("loss", &ref_loss, 1);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));
  const float* grads = e.ex.whole(plan::State::grads);
  int checked = 0;
  double worst = 0;
  std::string worst_name;
  for (size_t u = 0; u < e.desc.units.size(); ++u)
    for (const auto& p : e.desc.units[u].params) {
      std::vector<float> want(p.numel);
      ref.read_f32("grad." + p.name, want.data(), p.shape);
      const float* got = grads + e.plan.layout.units[u].offset + p.offset;
      double norm = 0;
      for (float v : want) norm += static_cast<double>(v) * v;
      EXPECT_GT(norm, 0) << p.name << ": the reference's gradient is zero, so the comparison proves nothing";
      const double error = testing::relative_l2(got, want.data(), p.numel);
      EXPECT_LE(error, 1e-5) << "grad." << p.name;
      if (error > worst) worst = error, worst_name = p.name;
      ++checked;
    }
  int ref_grads = 0;
  for (const auto& name : ref.names()) ref_grads += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, ref_grads);  // every parameter the reference has, and no other
  std::printf("dit %s against PyTorch: loss %.6f (relative error %.2e), velocity %.2e, worst gradient %.2e (%s)\n",
              mc.frames == 1 ? "image" : "video", loss, std::fabs(loss - ref_loss) / std::fabs(ref_loss), pred_error, worst, worst_name.c_str());
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DitParity, ::testing::Values(model::model_preset("dit-tiny"), video()),
                         [](const auto& info) { return info.param.frames == 1 ? std::string("Image") : std::string("Video"); });

}  // namespace
}  // namespace shardlm::train
