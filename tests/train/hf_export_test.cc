// Hugging Face export and import (ckpt/hf_export.h, ckpt/hf_import.h through train/checkpoint.h):
// the exported directory, read by the PyTorch references through its Hugging Face names
// (tests/reference/hf_export_check.py), gives shardlm's logits within 1e-5 (fp32, whole or in
// several files) or within bf16's rounding; importing an export gives back the parameters bit
// for bit; bad directories are refused in one line naming the file and tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <unistd.h>

#include "ckpt/hf_export.h"
#include "ckpt/safetensors.h"
#include "one_process_engine.h"
#include "train/checkpoint.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) ADD_FAILURE() << name << " is not set (run through ctest)";
  return v ? v : "";
}

// A fresh directory, removed when the test ends however it ends.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("shardlm_hf_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

struct Case {
  std::string name;
  model::ModelConfig mc;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// A model at its initialisation, its logits for one batch, and its whole checkpoint.
struct Model : testing::OneProcessEngine {
  static constexpr int64_t B = 2, T = 16;
  std::vector<int32_t> inputs;
  std::vector<float> logits;

  Model(const model::ModelConfig& mc, const fs::path& dir)
      : OneProcessEngine(mc, testing::plan_config(B, T, plan::PlanConfig::Mode::logits)) {
    ex.init_params(42);
    std::mt19937 rng(7);
    inputs.resize(B * T);
    for (auto& t : inputs) t = static_cast<int32_t>(rng() % mc.vocab_size);
    logits.resize(B * T * mc.vocab_size);
    run::StepInputs fwd;
    fwd.batch = [&](int, int32_t* in, int32_t* tg) {
      std::copy(inputs.begin(), inputs.end(), in);
      std::fill(tg, tg + B * T, 0);
    };
    fwd.logits = logits.data();
    fwd.all_logits = true;
    ex.run(plan, 0, fwd);
    ckpt::SafetensorsWriter batch, out;
    batch.add("inputs", ckpt::StDType::I32, {B, T}, inputs.data(), inputs.size() * 4);
    batch.write((dir / "batch.safetensors").string());
    out.add_f32("logits", {B, T, mc.vocab_size}, logits.data());
    out.write((dir / "logits.safetensors").string());
    save_checkpoint((dir / "ckpt").string(), desc, plan.layout, params(), nullptr, nullptr, [] { RunState st; st.seed = 42, st.tokenizer = "bytes"; return st; }(),
                    TrainConfig{});
  }
  const float* params() { return ex.whole(plan::State::params); }
};

// hf_export_check.py's verdict on `model_dir` at tolerance `tol` (and its line, for the log).
bool reference_agrees(const fs::path& tmp, const fs::path& model_dir, double tol, std::string* line) {
  const std::string cmd = env_or_fail("SHARDLM_PYTHON") + " " + env_or_fail("SHARDLM_SOURCE_DIR") +
                          "/tests/reference/hf_export_check.py --model-dir " + model_dir.string() + " --batch " +
                          (tmp / "batch.safetensors").string() + " --logits " + (tmp / "logits.safetensors").string() +
                          " --tol " + std::to_string(tol) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return false;
  char buf[4096];
  line->clear();
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) line->append(buf, n);
  std::cout << *line;  // the measured difference, for the log
  return pclose(p) == 0;
}

// Every parameter of an imported checkpoint, whole, and its moments (which must be zero).
std::vector<float> imported_params(const fs::path& dir, const model::ModelDesc& desc, const model::FlatLayout& layout) {
  std::vector<float> p(layout.total, 0.0f), m(layout.total, 1.0f), v(layout.total, 1.0f);
  load_checkpoint(dir.string(), desc, layout, p.data(), m.data(), v.data());
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& s : desc.units[u].params)
      for (int64_t i = 0; i < s.exported_numel(); ++i) {
        const int64_t at = layout.units[u].offset + s.offset + i;
        if (m[at] != 0.0f || v[at] != 0.0f) ADD_FAILURE() << s.name << ": moment not zero at " << i;
      }
  return p;
}

// Exported parameters (padding rows excluded) bitwise equal.
void expect_same_params(const model::ModelDesc& desc, const model::FlatLayout& layout, const float* want,
                        const float* got, const std::string& what) {
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& s : desc.units[u].params) {
      const int64_t at = layout.units[u].offset + s.offset;
      EXPECT_EQ(std::memcmp(want + at, got + at, 4 * s.exported_numel()), 0) << what << ": " << s.name;
    }
}

class HfExport : public ::testing::TestWithParam<Case> {};

TEST_P(HfExport, ReferenceReadsItImportGivesItBack) {
  const Case c = GetParam();
  TempDir tmp(c.name);
  Model m(c.mc, tmp.path);
  const std::string ck = (tmp.path / "ckpt").string();
  std::string line;

  ckpt::HfExportOptions fp32;
  const auto whole = export_hf(ck, (tmp.path / "fp32").string(), fp32);
  EXPECT_EQ(whole.files, 1);
  EXPECT_TRUE(fs::exists(tmp.path / "fp32" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp.path / "fp32" / "model.safetensors.index.json"));
  EXPECT_TRUE(reference_agrees(tmp.path, tmp.path / "fp32", 1e-5, &line)) << line;

  ckpt::HfExportOptions bf16;
  bf16.dtype = "bf16";
  export_hf(ck, (tmp.path / "bf16").string(), bf16);
  EXPECT_TRUE(reference_agrees(tmp.path, tmp.path / "bf16", 1e-2, &line)) << line;
  EXPECT_FALSE(reference_agrees(tmp.path, tmp.path / "bf16", 1e-5, &line)) << "bf16 rounding left no trace: " << line;

  // Several files: the tensors byte for byte those of the one file, each named by the index.
  ckpt::HfExportOptions split = fp32;
  split.max_shard_bytes = whole.total_size / 4;
  const auto parts = export_hf(ck, (tmp.path / "split").string(), split);
  EXPECT_GE(parts.files, 4);
  EXPECT_EQ(parts.total_size, whole.total_size);
  EXPECT_FALSE(fs::exists(tmp.path / "split" / "model.safetensors"));
  const json index = json::parse(std::ifstream(tmp.path / "split" / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], whole.total_size);
  const ckpt::SafetensorsFile one((tmp.path / "fp32" / "model.safetensors").string());
  EXPECT_EQ(index["weight_map"].size(), one.names().size());
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    files.insert(file.get<std::string>());
    const ckpt::SafetensorsFile part((tmp.path / "split" / file.get<std::string>()).string());
    ASSERT_EQ(part.info(name).shape, one.info(name).shape) << name;
    EXPECT_EQ(std::memcmp(part.data(name), one.data(name), one.info(name).bytes), 0) << name;
    EXPECT_EQ(part.metadata().at("format"), "pt") << file;
  }
  EXPECT_EQ(static_cast<int>(files.size()), parts.files);
  EXPECT_TRUE(files.count("model-00001-of-0000" + std::to_string(parts.files) + ".safetensors"));
  EXPECT_TRUE(reference_agrees(tmp.path, tmp.path / "split", 1e-5, &line)) << line;

  // Import of each gives back the parameters: fp32 bit for bit, bf16 as rounded.
  const model::FlatLayout& L = m.plan.layout;
  for (const char* from : {"fp32", "split"}) {
    const fs::path out = tmp.path / (std::string("imported_") + from);
    EXPECT_EQ(import_hf((tmp.path / from).string(), out.string()).n_layer, c.mc.n_layer);
    EXPECT_TRUE(fs::exists(out / "index.json"));
    expect_same_params(m.desc, L, m.params(), imported_params(out, m.desc, L).data(), from);
  }
  import_hf((tmp.path / "bf16").string(), (tmp.path / "imported_bf16").string());
  std::vector<float> rounded(m.params(), m.params() + L.total);
  for (float& x : rounded) {
    const uint32_t u = uint32_t(ckpt::to_bf16(x)) << 16;
    std::memcpy(&x, &u, 4);
  }
  expect_same_params(m.desc, L, rounded.data(), imported_params(tmp.path / "imported_bf16", m.desc, L).data(), "bf16");
}

// A copy of DIR's model.safetensors into OUT (with DIR's config.json) after `edit` changed the
// tensors: {name: (dtype, shape, bytes)}.
struct Raw {
  ckpt::StDType dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};
void rewrite(const fs::path& dir, const fs::path& out, const std::function<void(std::map<std::string, Raw>&)>& edit) {
  std::map<std::string, Raw> t;
  {
    const ckpt::SafetensorsFile f((dir / "model.safetensors").string());
    for (const auto& n : f.names()) {
      const auto* d = static_cast<const char*>(f.data(n));
      t[n] = {f.info(n).dtype, f.info(n).shape, std::vector<char>(d, d + f.info(n).bytes)};
    }
  }
  edit(t);
  fs::create_directories(out);
  fs::copy_file(dir / "config.json", out / "config.json", fs::copy_options::overwrite_existing);
  ckpt::SafetensorsWriter w;
  for (const auto& [n, r] : t) w.add(n, r.dtype, r.shape, r.bytes.data(), r.bytes.size());
  w.set_metadata("format", "pt");
  w.write((out / "model.safetensors").string());
}

std::string import_error(const fs::path& in, const fs::path& out) {
  try {
    import_hf(in.string(), out.string());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Each bad directory: one line naming the file and the tensor (or field); nothing written.
TEST(HfImport, RefusesBadDirectoriesAcceptsSavePretrainedNames) {
  TempDir tmp("bad");
  Model m(model::model_preset("tiny", 300), tmp.path);
  const fs::path good = tmp.path / "good", bad = tmp.path / "bad", out = tmp.path / "out";
  export_hf((tmp.path / "ckpt").string(), good.string(), {});
  auto expect_refused = [&](const std::string& what, const std::string& file, const std::string& name) {
    const std::string e = import_error(bad, out);
    EXPECT_NE(e.find(file), std::string::npos) << what << ": " << e;
    EXPECT_NE(e.find(name), std::string::npos) << what << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << what << ": " << e;
    EXPECT_FALSE(fs::exists(out)) << what;
    std::cout << what << ": " << e << "\n";
    fs::remove_all(bad);
  };
  const std::string st = (bad / "model.safetensors").string();
  rewrite(good, bad, [](auto& t) { t.erase("h.1.ln_2.bias"); });
  expect_refused("missing", st, "h.1.ln_2.bias");
  rewrite(good, bad, [](auto& t) { std::swap(t["h.0.attn.c_attn.weight"].shape[0], t["h.0.attn.c_attn.weight"].shape[1]); });
  expect_refused("shape", st, "h.0.attn.c_attn.weight");
  rewrite(good, bad, [](auto& t) { t["h.0.attn.c_extra.weight"] = t["ln_f.bias"]; });
  expect_refused("unknown tensor", st, "h.0.attn.c_extra.weight");
  rewrite(good, bad, [](auto& t) { t["ln_f.weight"].dtype = ckpt::StDType::I32; });
  expect_refused("dtype", st, "ln_f.weight");
  rewrite(good, bad, [](auto& t) {
    const float nan = std::nanf("");
    std::memcpy(t["wpe.weight"].bytes.data() + 40, &nan, 4);
  });
  expect_refused("NaN", st, "wpe.weight");
  rewrite(good, bad, [](auto&) {});
  json config = json::parse(std::ifstream(bad / "config.json"));
  config["model_type"] = "bert";
  std::ofstream(bad / "config.json") << config.dump();
  expect_refused("model_type", (bad / "config.json").string(), "model_type");
  // A sharded index naming a file that is not there.
  rewrite(good, bad, [](auto&) {});
  fs::rename(bad / "model.safetensors", bad / "model-00001-of-00002.safetensors");
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (const auto& n : ckpt::SafetensorsFile((bad / "model-00001-of-00002.safetensors").string()).names())
    index["weight_map"][n] = n == "ln_f.bias" ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  std::ofstream(bad / "model.safetensors.index.json") << index.dump();
  expect_refused("missing file", "model-00002-of-00002.safetensors", "");

  // What transformers' GPT2LMHeadModel.save_pretrained writes: "transformer." names, the tied
  // head, the causal-mask buffers. Read as the same parameters.
  rewrite(good, bad, [](auto& t) {
    std::map<std::string, Raw> hf;
    for (auto& [n, r] : t) hf["transformer." + n] = r;
    hf["lm_head.weight"] = t["wte.weight"];
    hf["transformer.h.0.attn.bias"] = t["ln_f.bias"];
    t = hf;
  });
  import_hf(bad.string(), out.string());
  expect_same_params(m.desc, m.plan.layout, m.params(), imported_params(out, m.desc, m.plan.layout).data(),
                     "save_pretrained names");
}

// A Mixtral directory whose expert tensors are missing or misshaped: one line naming the file
// and the tensor; nothing written.
TEST(HfImport, RefusesMissingOrMisshapedExperts) {
  TempDir tmp("bad_moe");
  const model::ModelConfig mc = model::model_preset("moe-tiny", 300);
  Model m(mc, tmp.path);
  const fs::path good = tmp.path / "good", bad = tmp.path / "bad", out = tmp.path / "out";
  export_hf((tmp.path / "ckpt").string(), good.string(), {});
  const std::string st = (bad / "model.safetensors").string();
  const std::string e1 = "model.layers.1.block_sparse_moe.experts.1.", e0 = "model.layers.0.block_sparse_moe.experts.0.";
  auto expect_refused = [&](const std::string& what, const std::string& name) {
    const std::string e = import_error(bad, out);
    EXPECT_NE(e.find(st), std::string::npos) << what << ": " << e;
    EXPECT_NE(e.find(name), std::string::npos) << what << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << what << ": " << e;
    EXPECT_FALSE(fs::exists(out)) << what;
    std::cout << what << ": " << e << "\n";
    fs::remove_all(bad);
  };
  rewrite(good, bad, [&](auto& t) { t.erase(e1 + "w2.weight"); });
  expect_refused("missing w2", e1 + "w2.weight");
  rewrite(good, bad, [&](auto& t) { std::swap(t[e0 + "w1.weight"].shape[0], t[e0 + "w1.weight"].shape[1]); });
  expect_refused("w1 transposed", e0 + "w1.weight");
  rewrite(good, bad, [&](auto& t) {
    Raw& w3 = t[e1 + "w3.weight"];
    w3.shape[0] /= 2;
    w3.bytes.resize(w3.bytes.size() / 2);
  });
  expect_refused("w3 half its rows", e1 + "w3.weight");
  rewrite(good, bad, [&](auto& t) { t.erase("model.layers.0.block_sparse_moe.gate.weight"); });
  expect_refused("missing router", "model.layers.0.block_sparse_moe.gate.weight");
  rewrite(good, bad, [&](auto& t) { t["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = t[e0 + "w1.weight"]; });
  expect_refused("a fifth expert", "experts.4.w1.weight");
  // A dense LLaMA MLP in place of a block's experts.
  rewrite(good, bad, [&](auto& t) { t["model.layers.0.mlp.gate_proj.weight"] = t[e0 + "w1.weight"]; });
  expect_refused("a dense MLP", "model.layers.0.mlp.gate_proj.weight");
}

// The weights' files are exactly what they say: bytes after the last tensor, and a
// tensor in a file the index places in another, were imported without a word.
TEST(HfImport, SafetensorsLayoutAndWeightMapAreExact) {
  TempDir tmp("exact");
  Model m(model::model_preset("tiny", 300), tmp.path);
  const fs::path good = tmp.path / "good", bad = tmp.path / "bad", out = tmp.path / "out";
  export_hf((tmp.path / "ckpt").string(), good.string(), {});
  rewrite(good, bad, [](auto&) {});
  std::ofstream(bad / "model.safetensors", std::ios::app | std::ios::binary) << "tail";
  std::string e = import_error(bad, out);
  EXPECT_NE(e.find((bad / "model.safetensors").string() + ": 4 bytes after the last tensor"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
  fs::remove_all(bad);

  // Two files, each holding every tensor; the index places ln_f.bias in the second only.
  rewrite(good, bad, [](auto&) {});
  fs::copy_file(bad / "model.safetensors", bad / "model-00002-of-00002.safetensors");
  fs::rename(bad / "model.safetensors", bad / "model-00001-of-00002.safetensors");
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (const auto& n : ckpt::SafetensorsFile((bad / "model-00001-of-00002.safetensors").string()).names())
    index["weight_map"][n] = n == "ln_f.bias" ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  std::ofstream(bad / "model.safetensors.index.json") << index.dump();
  e = import_error(bad, out);
  EXPECT_NE(e.find("model-00001-of-00002.safetensors: holds tensor 'ln_f.bias', which"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
}

// An export that fails half-way (the gpt2 tokenizer's files are missing) leaves the directory it
// would have replaced as it was, and nothing beside it.
TEST(HfExportAtomic, FailedExportLeavesTheOldDirectory) {
  TempDir tmp("atomic");
  Model m(model::model_preset("tiny", 300), tmp.path);
  const fs::path out = tmp.path / "hf";
  export_hf((tmp.path / "ckpt").string(), out.string(), {});
  const auto before = fs::file_size(out / "model.safetensors");
  ckpt::HfExportOptions opt;
  opt.dtype = "bf16";
  opt.overwrite = true;
  opt.tokenizer = "gpt2";  // export_hf takes the checkpoint's (bytes): write_hf_dir directly
  opt.encoder_json = (tmp.path / "none" / "encoder.json").string();
  opt.vocab_bpe = (tmp.path / "none" / "vocab.bpe").string();
  try {
    ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
    ADD_FAILURE() << "exported without the tokenizer's files";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("encoder.json"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fs::file_size(out / "model.safetensors"), before);  // still fp32
  EXPECT_EQ(json::parse(std::ifstream(out / "config.json"))["torch_dtype"], "float32");
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(tmp.path)) ++entries;
  EXPECT_EQ(entries, 4);  // batch, logits, ckpt, hf

  // With the files there: vocab.json and merges.txt are them byte for byte.
  fs::create_directories(tmp.path / "gpt2");
  std::ofstream(opt.encoder_json = (tmp.path / "gpt2" / "encoder.json").string()) << "{\"a\": 0}";
  std::ofstream(opt.vocab_bpe = (tmp.path / "gpt2" / "vocab.bpe").string()) << "#version: 0.2\n";
  ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
  EXPECT_EQ(fs::file_size(out / "vocab.json"), 8u);
  EXPECT_EQ(fs::file_size(out / "merges.txt"), 14u);
  const json tc = json::parse(std::ifstream(out / "tokenizer_config.json"));
  EXPECT_EQ(tc["tokenizer_class"], "GPT2Tokenizer");
  EXPECT_EQ(tc["eos_token"], "<|endoftext|>");

  // A llama3 tokenizer: its tokenizer.json byte for byte, LLaMA 3's special tokens; missing, named.
  opt.tokenizer = "llama3";
  opt.tokenizer_json = (tmp.path / "llama3" / "tokenizer.json").string();
  try {
    ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
    ADD_FAILURE() << "exported without the tokenizer's file";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(opt.tokenizer_json + " is missing (run scripts/fetch_data.sh --llama"),
              std::string::npos) << e.what();
  }
  fs::create_directories(tmp.path / "llama3");
  const std::string llama3_json =
      R"({"added_tokens": [{"id": 128000, "content": "<|begin_of_text|>"}, {"id": 128001, "content": "<|end_of_text|>"}]})";
  std::ofstream(opt.tokenizer_json) << llama3_json;
  opt.bos = {"<|begin_of_text|>", 128000}, opt.eos = {"<|end_of_text|>", 128001};  // as the caller reads them
  const ckpt::HfExportSummary l3 = ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
  EXPECT_EQ(l3.tokenizer_files, "tokenizer.json");
  EXPECT_EQ(fs::file_size(out / "tokenizer.json"), llama3_json.size());
  EXPECT_FALSE(fs::exists(out / "vocab.json"));
  json config = json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(config["bos_token_id"], 128000);
  EXPECT_EQ(config["eos_token_id"], 128001);
  EXPECT_EQ(json::parse(std::ifstream(out / "tokenizer_config.json"))["eos_token"], "<|end_of_text|>");
  // A SentencePiece one (Mistral's): <s> and </s>.
  opt.tokenizer = "mistral";
  opt.bos = {"<s>", 1}, opt.eos = {"</s>", 2};
  ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
  config = json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(config["bos_token_id"], 1);
  EXPECT_EQ(config["eos_token_id"], 2);
  EXPECT_EQ(config["shardlm_tokenizer"], "mistral");
  EXPECT_EQ(json::parse(std::ifstream(out / "special_tokens_map.json"))["bos_token"], "<s>");
  EXPECT_EQ(json::parse(std::ifstream(out / "tokenizer_config.json"))["tokenizer_class"], "PreTrainedTokenizerFast");
  // A tokenizer without a first token: none is named.
  opt.bos = {};
  ckpt::write_hf_dir(out.string(), m.desc, m.plan.layout, m.params(), opt);
  config = json::parse(std::ifstream(out / "config.json"));
  EXPECT_FALSE(config.contains("bos_token_id"));
  EXPECT_EQ(config["eos_token_id"], 2);
  EXPECT_FALSE(json::parse(std::ifstream(out / "special_tokens_map.json")).contains("bos_token"));
}

// A mixture-of-experts model exports as Hugging Face Mixtral: MixtralConfig's keys, the router
// block_sparse_moe.gate (E, C) and each expert's w1 (F, C) gate, w3 (F, C) up and w2 (C, F) down
// as tensors of their own, each the checkpoint's values bit for bit (the reference reads them by
// these names in HfExport.ReferenceReadsItImportGivesItBack/moe).
TEST(HfExportMixtral, NamesLayoutAndConfigAreMixtrals) {
  TempDir tmp("mixtral");
  const model::ModelConfig mc = model::model_preset("moe-tiny", 300);
  Model m(mc, tmp.path);
  const fs::path out = tmp.path / "hf";
  export_hf((tmp.path / "ckpt").string(), out.string(), {});
  const json config = json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(config["model_type"], "mixtral");
  EXPECT_EQ(config["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(config["num_local_experts"], mc.n_experts);
  EXPECT_EQ(config["num_experts_per_tok"], mc.top_k);
  EXPECT_EQ(config["intermediate_size"], mc.moe_ffn_dim);
  EXPECT_FALSE(config.contains("shardlm_moe_every"));
  const ckpt::SafetensorsFile f((out / "model.safetensors").string());
  const int64_t C = mc.n_embd, E = mc.n_experts, F = mc.moe_ffn_dim;
  std::map<std::string, std::vector<int64_t>> want;
  for (int l = 0; l < mc.n_layer; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".block_sparse_moe.";
    want[p + "gate.weight"] = {E, C};
    for (int j = 0; j < E; ++j) {
      const std::string e = p + "experts." + std::to_string(j) + ".";
      want[e + "w1.weight"] = {F, C}, want[e + "w3.weight"] = {F, C}, want[e + "w2.weight"] = {C, F};
    }
    EXPECT_FALSE(f.has("model.layers." + std::to_string(l) + ".mlp.gate_proj.weight"));
  }
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(f.has(name)) << name;
    EXPECT_EQ(f.info(name).shape, shape) << name;
  }
  int64_t tensors = 0;
  for (size_t u = 0; u < m.desc.units.size(); ++u)
    for (const auto& p : m.desc.units[u].params) {
      ++tensors;
      ASSERT_TRUE(f.has(p.name)) << p.name;
      const float* at = m.params() + m.plan.layout.units[u].offset + p.offset;
      EXPECT_EQ(std::memcmp(f.data(p.name), at, 4 * p.exported_numel()), 0) << p.name;
    }
  EXPECT_EQ(static_cast<int64_t>(f.names().size()), tensors);
}

// Dense blocks between the MoE blocks (--moe-every 2) are no Hugging Face model: the export is
// refused in one line before anything is written.
TEST(HfExportMixtral, MoeEveryAboveOneIsRefused) {
  TempDir tmp("moe_every");
  model::ModelConfig mc = model::model_preset("moe-tiny", 300);
  mc.moe_every = 2;
  Model m(mc, tmp.path);
  const fs::path out = tmp.path / "sub" / "hf";
  try {
    export_hf((tmp.path / "ckpt").string(), out.string(), {});
    ADD_FAILURE() << "exported a model with moe_every 2";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("moe_every = 2"), std::string::npos) << what;
    EXPECT_NE(what.find("no Hugging Face model type"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(tmp.path / "sub"));
}

// Hugging Face's Mixtral renormalises the k routing weights and drops no token: a model trained
// with --no-norm-topk or a capacity computes another function there from the same weights (it
// exported as MixtralForCausalLM), so its export is refused in one line, writing nothing.
TEST(HfExportMixtral, RoutingMixtralLacksIsRefused) {
  struct Routing {
    const char* name;
    bool norm_topk;
    double capacity_factor;
    std::vector<std::string> named;
  };
  for (const Routing& r : {Routing{"no_norm_topk", false, 0.0, {"norm_topk = false", "--no-norm-topk", "renormalises"}},
                           Routing{"capacity", true, 1.25, {"capacity_factor = 1.25", "--capacity-factor", "drops no token"}}}) {
    SCOPED_TRACE(r.name);
    TempDir tmp(r.name);
    model::ModelConfig mc = model::model_preset("moe-tiny", 300);
    mc.norm_topk = r.norm_topk, mc.capacity_factor = r.capacity_factor;
    Model m(mc, tmp.path);
    const fs::path out = tmp.path / "sub" / "hf";
    try {
      export_hf((tmp.path / "ckpt").string(), out.string(), {});
      ADD_FAILURE() << "exported a model Mixtral does not compute";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      for (const std::string& needle : r.named) EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_NE(what.find("Mixtral"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
    EXPECT_FALSE(fs::exists(tmp.path / "sub"));
  }
}

model::ModelConfig llama(bool tied) {
  model::ModelConfig m = model::model_preset("llama-tiny", 300);
  m.tie_embeddings = tied;
  return m;
}

INSTANTIATE_TEST_SUITE_P(Models, HfExport,
                         ::testing::Values(Case{"gpt2", model::model_preset("tiny", 300)}, Case{"llama", llama(false)},
                                           Case{"llama_tied", llama(true)},
                                           Case{"moe", model::model_preset("moe-tiny", 300)}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace shardlm::train
