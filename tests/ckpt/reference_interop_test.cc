// The workflow the layer tests will use: C++ writes a Hugging Face-style model directory and a
// batch as safetensors, the PyTorch reference (tests/reference/gpt2_reference.py) reads them and
// writes logits, loss and gradients, and C++ reads those back.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"

namespace fs = std::filesystem;
using shardlm::ckpt::SafetensorsFile;
using shardlm::ckpt::SafetensorsWriter;
using shardlm::ckpt::StDType;

namespace {

std::string source_dir() {
  if (const char* s = std::getenv("SHARDLM_SOURCE_DIR")) return s;
  return fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

std::string python() {
  if (const char* p = std::getenv("SHARDLM_PYTHON")) return p;
  return "/usr/bin/python3";
}

int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  out->clear();
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

TEST(ReferenceInterop, CppWritesModelPythonComputesCppReadsGrads) {
  const int64_t L = 2, C = 32, NH = 4, V = 97, MAXT = 16, B = 2, T = 8;
  std::string tmpl = (fs::temp_directory_path() / "shardlm_ref_XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<Param> params;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float constant, bool random) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    Param p{name, shape, std::vector<float>(size_t(n), constant)};
    if (random)
      for (auto& x : p.data) x = normal(rng);
    params.push_back(std::move(p));
  };
  add("wte.weight", {V, C}, 0, true);
  add("wpe.weight", {MAXT, C}, 0, true);
  for (int l = 0; l < L; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {C}, 1, false);
    add(h + "ln_1.bias", {C}, 0, false);
    add(h + "attn.c_attn.weight", {C, 3 * C}, 0, true);
    add(h + "attn.c_attn.bias", {3 * C}, 0, false);
    add(h + "attn.c_proj.weight", {C, C}, 0, true);
    add(h + "attn.c_proj.bias", {C}, 0, false);
    add(h + "ln_2.weight", {C}, 1, false);
    add(h + "ln_2.bias", {C}, 0, false);
    add(h + "mlp.c_fc.weight", {C, 4 * C}, 0, true);
    add(h + "mlp.c_fc.bias", {4 * C}, 0, false);
    add(h + "mlp.c_proj.weight", {4 * C, C}, 0, true);
    add(h + "mlp.c_proj.bias", {C}, 0, false);
  }
  add("ln_f.weight", {C}, 1, false);
  add("ln_f.bias", {C}, 0, false);

  const std::string model_dir = dir + "/model";
  shardlm::ckpt::write_dir_atomically(model_dir, [&](const std::string& tmp) {
    SafetensorsWriter w;
    for (const auto& p : params) w.add_f32(p.name, p.shape, p.data.data());
    w.set_metadata("format", "pt");
    w.write(tmp + "/model.safetensors");
    std::ofstream(tmp + "/config.json") << "{\"model_type\": \"gpt2\", \"n_layer\": " << L << ", \"n_head\": " << NH
                                        << ", \"n_embd\": " << C << ", \"vocab_size\": " << V
                                        << ", \"n_positions\": " << MAXT << "}\n";
  });

  std::vector<int32_t> inputs(B * T), targets(B * T);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V - 1));
  for (auto& x : inputs) x = tok(rng);
  for (auto& x : targets) x = tok(rng);
  {
    SafetensorsWriter w;
    w.add("inputs", "I32", {B, T}, inputs.data(), inputs.size() * 4);
    w.add("targets", StDType::I32, {B, T}, targets.data(), targets.size() * 4);
    w.write(dir + "/batch.safetensors");
  }

  const std::string out_path = dir + "/out.safetensors";
  const std::string cmd = python() + " " + source_dir() + "/tests/reference/gpt2_reference.py --model-dir " +
                          model_dir + " --batch " + dir + "/batch.safetensors --out " + out_path +
                          " --adam-steps 3 --lr 1e-3 --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1"
                          " --grad-clip 1.0";
  std::string log;
  ASSERT_EQ(run(cmd, &log), 0) << cmd << "\n" << log;

  SafetensorsFile out(out_path);
  EXPECT_EQ(out.info("logits").shape, (std::vector<int64_t>{B, T, V}));
  float loss = 0;
  out.read_f32("loss", &loss, 1);
  EXPECT_NEAR(loss, std::log(float(V)), 0.05);
  for (const auto& p : params) {
    ASSERT_TRUE(out.has("grad." + p.name)) << p.name;
    EXPECT_EQ(out.info("grad." + p.name).shape, p.shape) << p.name;
    std::vector<float> g(p.data.size());
    out.read_f32("grad." + p.name, g.data(), p.shape);
    double sq = 0;
    for (float x : g) {
      ASSERT_TRUE(std::isfinite(x)) << p.name;
      sq += double(x) * x;
    }
    EXPECT_GT(sq, 0.0) << p.name;
  }
  std::vector<float> losses(3);
  out.read_f32("adam_losses", losses.data(), 3);
  EXPECT_NEAR(losses[0], loss, 1e-5);
  EXPECT_LT(losses[2], losses[1]);
  EXPECT_LT(losses[1], losses[0]);

  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
