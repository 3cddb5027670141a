// The mixture-of-experts model against an independent PyTorch MoE (tests/reference/
// moe_reference.py, float64) from the same weights, through the executor — the path training
// uses: language loss, load-balancing and z-losses, and every gradient of one step (with the
// auxiliary losses in the objective), dropless and with capacity drops, over one and two routing
// groups; and an expert that receives no token: zero gradient, nothing non-finite. Under
// --act-quant int8 the losses are the reference's (the forward is uncompressed) and every gradient
// tracks it within the int8 error (relative L2 <= 2%, nearest rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "ckpt/safetensors.h"
#include "kernels/cpu.h"
#include "relative_error.h"
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
  int64_t groups;      // micro-steps of the step: routing groups
  bool idle_experts;   // router weights zero: every token ties and picks experts 0..k-1
  int64_t act_quant_group = 0;  // --act-quant int8 with this group (0: fp32)
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

using Engine = testing::OneProcessEngine;

constexpr int64_t B = 2, T = 16;

// The int8 error of --act-quant: relative L2 within 2% (reference_parity_test's bound).
void check_relative_l2(const std::string& what, const float* got, const float* want, int64_t n) {
  EXPECT_LE(testing::relative_l2(got, want, n), 0.02) << what << ": relative L2 error against PyTorch under int8";
}

void check_close(const std::string& what, const float* got, const float* want, int64_t n, double rel = 1e-5) {
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "]";
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LE(max_diff, rel * max_ref) << what << ": max |diff| " << max_diff << ", max |ref| " << max_ref;
}

class MoeParity : public ::testing::TestWithParam<Case> {};

TEST_P(MoeParity, LossAuxLossesAndEveryGradient) {
  const Case c = GetParam();
  const model::ModelConfig& mc = c.mc;
  kernels::init_compute(2);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_moe_parity_" + std::to_string(::getpid()) + "_" + c.name);
  fs::remove_all(dir);
  fs::create_directories(dir);

  plan::PlanConfig pc;
  pc.batch = B, pc.seq = T, pc.threads = 2, pc.grad_accum = c.groups;
  pc.act_quant.group = c.act_quant_group;
  Engine e(mc, pc);
  e.ex.init_params(42);
  float* params = e.ex.whole(plan::State::params);
  ckpt::SafetensorsWriter weights;
  for (size_t u = 0; u < e.desc.units.size(); ++u)
    for (const auto& p : e.desc.units[u].params) {
      float* at = params + e.plan.layout.units[u].offset + p.offset;
      if (c.idle_experts && p.name.find("block_sparse_moe.gate") != std::string::npos) std::fill(at, at + p.numel, 0.0f);
      weights.add_f32(p.name, p.exported_shape(), at);
    }
  weights.write((dir / "model.safetensors").string());

  std::mt19937 rng(7);
  std::vector<int32_t> inputs(c.groups * B * T), targets(c.groups * B * T);
  for (auto& t : inputs) t = static_cast<int32_t>(rng() % mc.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % mc.vocab_size);
  ckpt::SafetensorsWriter batch;
  batch.add("inputs", ckpt::StDType::I32, {c.groups, B, T}, inputs.data(), inputs.size() * 4);
  batch.add("targets", ckpt::StDType::I32, {c.groups, B, T}, targets.data(), targets.size() * 4);
  batch.write((dir / "batch.safetensors").string());

  std::string cmd = env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") +
                    "/tests/reference/moe_reference.py --weights " + (dir / "model.safetensors").string() +
                    " --batch " + (dir / "batch.safetensors").string() + " --out " + (dir / "ref.safetensors").string();
  auto arg = [&](const char* flag, auto v) { cmd += std::string(" ") + flag + " " + std::to_string(v); };
  arg("--layers", mc.n_layer), arg("--heads", mc.n_head), arg("--kv-heads", mc.n_kv_head), arg("--vocab", mc.vocab_size);
  arg("--experts", mc.n_experts), arg("--top-k", mc.top_k), arg("--moe-every", mc.moe_every);
  arg("--theta", mc.rope_theta), arg("--eps", mc.norm_eps), arg("--capacity-factor", mc.capacity_factor);
  arg("--aux-coef", mc.aux_loss_coef), arg("--z-coef", mc.z_loss_coef);
  if (!mc.norm_topk) cmd += " --no-norm-topk";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ckpt::SafetensorsFile ref((dir / "ref.safetensors").string());

  run::StepInputs in;
  in.batch = [&](int64_t micro, int32_t* in, int32_t* tg) {
    std::copy_n(inputs.begin() + micro * B * T, B * T, in);
    std::copy_n(targets.begin() + micro * B * T, B * T, tg);
  };
  in.grad_scale = 1.0f / static_cast<float>(c.groups * B * T);
  in.opt = {0.0f, 0.9f, 0.95f, 1e-8f, 0.0f};  // lr 0: the step leaves the gradients to read
  const run::StepResult r = e.ex.step(0, in);
  float want[3];
  ref.read_f32("loss", &want[0], 1), ref.read_f32("aux", &want[1], 1), ref.read_f32("z", &want[2], 1);
  EXPECT_NEAR(r.loss_sum * in.grad_scale, want[0], 1e-5 * std::fabs(want[0]));
  EXPECT_NEAR(r.moe.aux_loss, want[1], 1e-5 * std::fabs(want[1]));
  EXPECT_NEAR(r.moe.z_loss, want[2], 1e-5 * std::fabs(want[2]) + 1e-9);
  if (mc.capacity_factor > 0) {
    EXPECT_GT(r.moe.dropped, 0) << "capacity mode should drop some tokens here";
  } else {
    EXPECT_EQ(r.moe.dropped, 0);
  }
  if (c.idle_experts) {
    EXPECT_EQ(r.moe.min_load, 0);
  }

  int checked = 0;
  const float* grads = e.ex.whole(plan::State::grads);
  for (size_t u = 0; u < e.desc.units.size(); ++u)
    for (const auto& p : e.desc.units[u].params) {
      std::vector<float> ref_grad(p.exported_numel());
      ref.read_f32("grad." + p.name, ref_grad.data(), p.exported_shape());
      const float* g = grads + e.plan.layout.units[u].offset + p.offset;
      if (c.act_quant_group > 0) check_relative_l2("grad." + p.name, g, ref_grad.data(), p.exported_numel());
      else check_close("grad." + p.name, g, ref_grad.data(), p.exported_numel());
      ++checked;
      const bool idle = c.idle_experts && p.name.find(".experts.") != std::string::npos &&
                        p.name.find(".experts.0.") == std::string::npos &&
                        (mc.top_k < 2 || p.name.find(".experts.1.") == std::string::npos);
      if (idle) {
        for (int64_t i = 0; i < p.numel; ++i) ASSERT_EQ(g[i], 0.0f) << p.name << " of an idle expert";
      }
    }
  int ref_grads = 0;
  for (const auto& name : ref.names()) ref_grads += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, ref_grads);
  fs::remove_all(dir);
}

model::ModelConfig moe_config(double capacity, int64_t k = 2, bool norm_topk = true, int64_t every = 1) {
  model::ModelConfig m = model::model_preset("moe-tiny", 300);
  m.capacity_factor = capacity, m.top_k = k, m.norm_topk = norm_topk, m.moe_every = every;
  m.rope_theta = 500.0;
  // Coefficients large enough that their gradients show against the language loss's.
  m.aux_loss_coef = 0.1, m.z_loss_coef = 0.01;
  return m;
}

INSTANTIATE_TEST_SUITE_P(Models, MoeParity,
                         ::testing::Values(Case{"dropless", moe_config(0), 1, false},
                                           Case{"dropless_two_groups", moe_config(0), 2, false},
                                           Case{"capacity_two_groups", moe_config(0.75), 2, false},
                                           Case{"switch_top1_every2", moe_config(1.0, 1, false, 2), 1, false},
                                           Case{"idle_experts", moe_config(0), 1, true},
                                           Case{"act_quant_dropless", moe_config(0), 1, false, 32},
                                           Case{"act_quant_capacity_top1_every2", moe_config(0.75, 1, false, 2), 2,
                                                false, 32}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace shardlm::train
