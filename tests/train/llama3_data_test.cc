// llm.c's LLaMA 3 token files (uint32 ids, magic 20240801): a run trains on them as on the same ids
// in GPT-2's uint16 layout, loss for loss; without a meta file their ids are LLaMA 3's (128256 of
// them), and the final sample is printed as ids where no LLaMA 3 tokenizer.json is at hand.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/shard.h"
#include "run/test_util.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

// `ids` at PATH in llm.c's llama-3 layout: 256 int32 (magic 20240801, version 7, count), uint32 ids.
void write_uint32_file(const std::string& path, const std::vector<int32_t>& ids) {
  std::vector<int32_t> header(256, 0);
  header[0] = data::kShardMagicU32;
  header[1] = data::kShardVersionU32;
  header[2] = static_cast<int32_t>(ids.size());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
}

// The suite's corpus at PREFIX as uint32 files, each id mapped by `map`.
void as_uint32(const std::string& from, const std::string& to, int32_t (*map)(int32_t)) {
  for (const char* split : {"_train.bin", "_val.bin"}) {
    const data::TokenShard shard(from + split);
    std::vector<int32_t> ids = shard.read(0, shard.size());
    for (int32_t& id : ids) id = map(id);
    write_uint32_file(to + split, ids);
  }
}

TEST(Llama3Data, Uint32IdsTrainAsTheSameUint16Ones) {
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("llama3_data").code, 0);
  const std::string wide = (runs.dir / "wide").string();
  as_uint32(runs.data(), wide, [](int32_t id) { return id; });
  fs::copy_file(runs.data() + "_meta.json", wide + "_meta.json");
  const testing::Result a = testing::shardlm(runs.args("narrow", 4));
  const testing::Result b = testing::shardlm(runs.args("wide", 4) + " --data " + wide);
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  const auto losses = testing::step_losses(runs.out("narrow") / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_EQ(testing::step_losses(runs.out("wide") / "metrics.jsonl"), losses);

  // No meta file: LLaMA 3's vocabulary, ids past 65535 trained on, the sample as ids.
  const std::string l3 = (runs.dir / "l3").string();
  as_uint32(runs.data(), l3, [](int32_t id) { return id * 500; });  // up to 127500
  runs.sample_tokens = 4;
  const testing::Result c = testing::shardlm(runs.args("l3", 1) + " --data " + l3 + " --no-report --data-dir " +
                                             (runs.dir / "no_tokenizers").string());
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("--- sample, token ids (tokenizer 'llama3': no "), std::string::npos) << c.out;
  const auto first = testing::step_losses(runs.out("l3") / "metrics.jsonl");
  ASSERT_EQ(first.size(), 1u);
  EXPECT_GT(first[0], 11.0);  // about ln 128256 = 11.76 at initialisation, where ln 256 is 5.55
  runs.remove();
}

// Text tokenized with LLaMA 3's tokenizer (data/llama3/tokenizer.json) is written in the uint32
// layout with its meta, trains a LLaMA model of its 128256 ids, and the final sample and
// `generate` from the checkpoint print text. The same with Mistral's SentencePiece tokenizer
// (data/mistral/tokenizer.json): 32000 ids in the uint16 layout.
struct TokenizerCase {
  const char* name;
  int token_bytes;
  double first_loss_above;  // about ln(vocabulary size)
  int bos, eos;             // its first and end tokens' ids
};

void PrintTo(const TokenizerCase& c, std::ostream* os) { *os << c.name; }

class TokenizedText : public ::testing::TestWithParam<TokenizerCase> {};

TEST_P(TokenizedText, TrainsAndPrintsText) {
  const TokenizerCase tc = GetParam();
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create(std::string(tc.name) + "_text").code, 0);
  std::string text;
  for (int i = 0; i < 400; ++i) text += testing::kGenesisLine + std::string(i % 7 == 0 ? "\n" : "");
  std::ofstream(runs.dir / "text.txt") << text;
  const std::string prefix = (runs.dir / "l3tok").string();
  const testing::Result tok = testing::shardlm(std::string("tokenize --tokenizer ") + tc.name + " --in " +
                                               (runs.dir / "text.txt").string() + " --out " + prefix);
  ASSERT_EQ(tok.code, 0) << tok.out;
  EXPECT_EQ(data::TokenShard(prefix + "_train.bin").token_bytes(), tc.token_bytes);
  runs.sample_tokens = 6;
  const testing::Result run = testing::shardlm(runs.args("l3text", 2, 2, "llama-tiny") + " --data " + prefix +
                                               " --save-every 2 --no-report");
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_GT(testing::step_losses(runs.out("l3text") / "metrics.jsonl").at(0), tc.first_loss_above);
  EXPECT_NE(run.out.find("--- sample ---"), std::string::npos) << run.out;
  const testing::Result gen = testing::shardlm("generate --ckpt " + (runs.out("l3text") / "ckpt" / "step_2").string() +
                                               " --prompt 'In the beginning' --tokens 4 --threads 1");
  ASSERT_EQ(gen.code, 0) << gen.out;
  EXPECT_EQ(gen.out.rfind("In the beginning", 0), 0u) << gen.out;
  // Its Hugging Face export generates the same text with its own tokenizer.json, no DATA needed.
  const std::string hf = (runs.dir / "l3hf").string();
  const testing::Result x = testing::shardlm("ckpt export --format hf --ckpt " + (runs.out("l3text") / "ckpt" / "step_2").string() +
                                             " --out " + hf);
  ASSERT_EQ(x.code, 0) << x.out;
  // Its first and end tokens are the tokenizer's own: LLaMA 3's <|begin_of_text|> and
  // <|end_of_text|>, SentencePiece's <s> and </s>.
  const nlohmann::json exported = nlohmann::json::parse(std::ifstream(hf + "/config.json"));
  EXPECT_EQ(exported["bos_token_id"], tc.bos);
  EXPECT_EQ(exported["eos_token_id"], tc.eos);
  const testing::Result own = testing::shardlm("generate --ckpt " + hf + " --prompt 'In the beginning' --tokens 4 --threads 1" +
                                               " --data-dir " + (runs.dir / "no_tokenizers").string());
  ASSERT_EQ(own.code, 0) << own.out;
  EXPECT_EQ(own.out, gen.out);
  if (std::string(tc.name) == "mistral") {  // the same weights as Mistral's config.json names them
    nlohmann::json config = nlohmann::json::parse(std::ifstream(hf + "/config.json"));
    config["model_type"] = "mistral";
    config["architectures"] = {"MistralForCausalLM"};
    config["sliding_window"] = 4096;
    std::ofstream(hf + "/config.json") << config.dump();
    const testing::Result as_mistral = testing::shardlm("generate --ckpt " + hf + " --prompt 'In the beginning' --tokens 4" +
                                                        " --threads 1 --data-dir " + (runs.dir / "no_tokenizers").string());
    ASSERT_EQ(as_mistral.code, 0) << as_mistral.out;
    EXPECT_EQ(as_mistral.out, gen.out);
  }
  // Its import keeps that tokenizer.json beside the weights: the same again.
  const std::string imported = (runs.dir / "l3imported").string();
  const testing::Result i = testing::shardlm("ckpt import --format hf --in " + hf + " --out " + imported);
  ASSERT_EQ(i.code, 0) << i.out;
  const testing::Result again = testing::shardlm("generate --ckpt " + imported + " --prompt 'In the beginning' --tokens 4" +
                                                 " --threads 1 --data-dir " + (runs.dir / "no_tokenizers").string());
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_EQ(again.out, gen.out);
  runs.remove();
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizedText,
                         ::testing::Values(TokenizerCase{"llama3", 4, 11.0, 128000, 128001},  // ln 128256 = 11.76
                                           TokenizerCase{"mistral", 2, 9.8, 1, 2}),          // ln 32000 = 10.37
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace shardlm::train
