// llm.c's GPT-2 model file (ckpt/llmc_model.h): what is written reads back bit for bit (bf16:
// rounded to nearest even), and a file that is not one, or is damaged, is one line naming it and
// what is wrong. The layout itself is checked against an independent writer in cli_test.cc.
#include "ckpt/llmc_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "ckpt/hf_export.h"

namespace shardlm::ckpt {
namespace {

namespace fs = std::filesystem;

class LlmcModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_llmc_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    config_ = model::model_preset("tiny", 300);  // 300 ids, 384 rows with padding
    desc_ = model::describe(config_);
    layout_ = model::flat_layout(desc_);
    params_.assign(layout_.total, 0.0f);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0, 0.5f);
    for (size_t u = 0; u < desc_.units.size(); ++u)
      for (const auto& p : desc_.units[u].params)
        for (int64_t i = 0; i < p.exported_numel(); ++i) params_[layout_.units[u].offset + p.offset + i] = normal(rng);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string error_reading(const fs::path& p) {
    try {
      const model::ModelDesc d = model::describe(read_llmc_config(p.string()));
      std::vector<float> got(model::flat_layout(d).total);
      read_llmc_weights(p.string(), d, model::flat_layout(d), got.data());
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  }
  // A copy of `from` with the int32 at `index` set to `value`.
  fs::path with_int(const fs::path& from, int64_t index, int32_t value, const std::string& name) {
    const fs::path to = dir_ / name;
    fs::copy_file(from, to, fs::copy_options::overwrite_existing);
    std::fstream f(to, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(index * 4);
    f.write(reinterpret_cast<const char*>(&value), 4);
    return to;
  }

  fs::path dir_;
  model::ModelConfig config_;
  model::ModelDesc desc_;
  model::FlatLayout layout_;
  std::vector<float> params_;
};

TEST_F(LlmcModel, WhatIsWrittenReadsBackAsTheSameModel) {
  for (bool bf16 : {false, true}) {
    const fs::path p = dir_ / (bf16 ? "bf16.bin" : "fp32.bin");
    write_llmc_model(p.string(), desc_, layout_, params_.data(), bf16);
    EXPECT_TRUE(is_llmc_model(p.string()));
    const model::ModelConfig c = read_llmc_config(p.string());
    EXPECT_EQ(c.n_layer, config_.n_layer);
    EXPECT_EQ(c.n_embd, config_.n_embd);
    EXPECT_EQ(c.n_head, config_.n_head);
    EXPECT_EQ(c.max_seq, config_.max_seq);
    EXPECT_EQ(c.vocab_size, 300);
    EXPECT_EQ(fs::file_size(p), 1024 + (bf16 ? 2u : 4u) * static_cast<uint64_t>(layout_.total));  // 384 rows of wte
    std::vector<float> got(layout_.total, NAN);
    read_llmc_weights(p.string(), desc_, layout_, got.data());
    for (int64_t i = 0; i < layout_.total; ++i) {
      const float want = bf16 ? std::bit_cast<float>(uint32_t(to_bf16(params_[i])) << 16) : params_[i];
      ASSERT_EQ(got[i], want) << (bf16 ? "bf16" : "fp32") << " element " << i;
    }
  }
  EXPECT_FALSE(is_llmc_model(dir_.string()));
  EXPECT_FALSE(is_llmc_model((dir_ / "absent.bin").string()));
}

TEST_F(LlmcModel, AFileThatIsNotOneIsOneLineNamingIt) {
  const fs::path good = dir_ / "good.bin";
  write_llmc_model(good.string(), desc_, layout_, params_.data(), false);
  const std::string at = "llm.c model: " + (dir_ / "").string();
  EXPECT_EQ(error_reading(with_int(good, 0, 7, "magic.bin")),
            at + "magic.bin: is not an llm.c GPT-2 model file (magic 7, expected 20240326)");
  EXPECT_EQ(error_reading(with_int(good, 0, 20240327, "state.bin")),
            at + "state.bin: is llm.c's optimizer state file (magic 20240327), not its model file");
  EXPECT_EQ(error_reading(with_int(good, 1, 4, "version.bin")),
            at + "version.bin: header: version 4 (shardlm reads 3, fp32, and 5, bf16)");
  EXPECT_EQ(error_reading(with_int(good, 4, 0, "layers.bin")), at + "layers.bin: header: num_layers is 0, must be > 0");
  EXPECT_EQ(error_reading(with_int(good, 7, 256, "padded.bin")),
            at + "padded.bin: header: padded_vocab_size 256 is below vocab_size 300");
  EXPECT_NE(error_reading(with_int(good, 5, 5, "heads.bin")).find("heads.bin: header: model: n_embd (64) is not divisible"),
            std::string::npos);
  const fs::path cut = dir_ / "cut.bin";
  fs::copy_file(good, cut);
  fs::resize_file(cut, fs::file_size(good) - 4);
  EXPECT_NE(error_reading(cut).find("cut.bin: holds " + std::to_string(fs::file_size(cut)) + " bytes, but the model"),
            std::string::npos);
  std::ofstream(dir_ / "short.bin") << "llm.c";
  EXPECT_EQ(error_reading(dir_ / "short.bin"), at + "short.bin: is shorter than llm.c's header of 256 int32");
  // ln_f's weight is the file's last C values but C.
  const int64_t lnfw = static_cast<int64_t>(fs::file_size(good) / 4) - 2 * config_.n_embd;
  const float nan = NAN;
  EXPECT_EQ(error_reading(with_int(good, lnfw + 3, std::bit_cast<int32_t>(nan), "nan.bin")),
            at + "nan.bin: lnfw holds a non-finite value (nan at element 3)");
}

TEST_F(LlmcModel, OnlyGpt2ShapesAreWrittenAndNothingIsLeftOnRefusal) {
  const model::ModelDesc llama = model::describe(model::model_preset("llama-tiny", 300));
  std::vector<float> p(model::flat_layout(llama).total);
  const fs::path out = dir_ / "llama.bin";
  try {
    write_llmc_model(out.string(), llama, model::flat_layout(llama), p.data(), false);
    ADD_FAILURE() << "wrote a LLaMA as llm.c's GPT-2";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "llm.c model: " + out.string() + ": llm.c's model file holds GPT-2 models; this one is llama");
  }
  model::ModelConfig wide = config_;
  wide.ffn_dim = 3 * wide.n_embd;
  const model::ModelDesc d = model::describe(wide);
  EXPECT_THROW(write_llmc_model(out.string(), d, model::flat_layout(d), params_.data(), false), std::runtime_error);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 0);
}

}  // namespace
}  // namespace shardlm::ckpt
