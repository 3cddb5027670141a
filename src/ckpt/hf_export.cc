#include "ckpt/hf_export.h"

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "ckpt/hf_config.h"
#include "ckpt/safetensors.h"

namespace shardlm::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

uint64_t parse_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::pair<const char*, uint64_t> units[] = {
      {"", 1},           {"B", 1},
      {"KB", 1000},      {"MB", 1000'000},       {"GB", 1000'000'000},       {"TB", 1000'000'000'000},
      {"KIB", 1ull << 10}, {"MIB", 1ull << 20}, {"GIB", 1ull << 30}, {"TIB", 1ull << 40}};
  const auto bad = [&] {
    return std::invalid_argument("--max-shard-size: '" + text + "' is not a size (bytes, or N with KB, MB, GB, KiB, MiB, GiB)");
  };
  if (digits == 0 || digits > 15) throw bad();
  const uint64_t n = std::stoull(text.substr(0, digits));
  for (const auto& [name, scale] : units)
    if (unit == name) {
      if (n == 0) throw std::invalid_argument("--max-shard-size: must be > 0, got '" + text + "'");
      if (n > UINT64_MAX / scale) throw bad();
      return n * scale;
    }
  throw bad();
}

namespace {

void write_json(const std::string& path, const json& j) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) throw std::runtime_error("ckpt export: cannot write " + path);
}

void copy_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec))
    throw std::runtime_error("ckpt export: cannot copy " + from + " to " + to + ": " + ec.message());
}

struct Tensor {
  const model::ParamSpec* spec;
  const float* data;
  uint64_t bytes;  // as written
};

// huggingface_hub's split: in model order, a new file when the next tensor would pass the limit;
// a tensor above the limit alone in a file of its own.
std::vector<std::vector<Tensor>> split_into_files(const std::vector<Tensor>& tensors, uint64_t max_bytes) {
  std::vector<std::vector<Tensor>> files;
  std::vector<Tensor> current;
  uint64_t current_bytes = 0;
  for (const Tensor& t : tensors) {
    if (t.bytes > max_bytes) {
      files.push_back({t});
      continue;
    }
    if (current_bytes + t.bytes > max_bytes) {
      files.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(t);
    current_bytes += t.bytes;
  }
  if (!current.empty()) files.push_back(std::move(current));
  return files;
}

std::string shard_name(size_t i, size_t n) {
  char s[64];
  std::snprintf(s, sizeof s, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return s;
}

// vocab.json and merges.txt are byte for byte OpenAI's encoder.json and vocab.bpe, which the
// gpt2 tokenizer here reads (data/tokenizer.cc).
void check_tokenizer_files(const HfExportOptions& opt, const std::vector<std::string>& files, const char* fetch) {
  for (const auto& f : files)
    if (!fs::is_regular_file(f))
      throw std::runtime_error("ckpt export: the checkpoint's tokenizer is " + opt.tokenizer + " but " + f +
                               " is missing (run scripts/fetch_data.sh" + fetch + ", or pass --data-dir)");
}

void write_gpt2_tokenizer(const std::string& dir, const model::ModelConfig& c, const HfExportOptions& opt) {
  check_tokenizer_files(opt, {opt.encoder_json, opt.vocab_bpe}, "");
  copy_file(opt.encoder_json, dir + "/vocab.json");
  copy_file(opt.vocab_bpe, dir + "/merges.txt");
  const std::string eot = "<|endoftext|>";
  write_json(dir + "/special_tokens_map.json", {{"bos_token", eot}, {"eos_token", eot}, {"unk_token", eot}});
  write_json(dir + "/tokenizer_config.json", {{"tokenizer_class", "GPT2Tokenizer"},
                                              {"bos_token", eot},
                                              {"eos_token", eot},
                                              {"unk_token", eot},
                                              {"add_prefix_space", false},
                                              {"model_max_length", c.max_seq}});
}

// tokenizer.json is the file the tokenizer here reads; PreTrainedTokenizerFast loads it. Its first
// and end tokens are the ones the caller read from it (ids into config.json).
void write_tokenizer_json(const std::string& dir, const model::ModelConfig& c, const HfExportOptions& opt,
                          json& config) {
  check_tokenizer_files(opt, {opt.tokenizer_json}, " --llama");
  copy_file(opt.tokenizer_json, dir + "/tokenizer.json");
  json tokenizer_config = {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"model_max_length", c.max_seq}};
  json special = json::object();
  for (const auto& [role, token] : {std::pair{"bos", &opt.bos}, std::pair{"eos", &opt.eos}}) {
    if (token->id < 0) continue;
    tokenizer_config[std::string(role) + "_token"] = special[std::string(role) + "_token"] = token->text;
    config[std::string(role) + "_token_id"] = token->id;
  }
  write_json(dir + "/special_tokens_map.json", special);
  write_json(dir + "/tokenizer_config.json", tokenizer_config);
}

}  // namespace

bool exports_tokenizer_json(const std::string& tokenizer) {
  return !tokenizer.empty() && tokenizer != "gpt2" && tokenizer != "bytes" && tokenizer != "unknown";
}

HfExportSummary write_hf_dir(const std::string& out_dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                             const float* params, const HfExportOptions& opt) {
  if (opt.dtype != "fp32" && opt.dtype != "bf16")
    throw std::runtime_error("ckpt export: --dtype must be fp32 or bf16, got '" + opt.dtype + "'");
  if (opt.max_shard_bytes == 0) throw std::runtime_error("ckpt export: --max-shard-size must be > 0");
  const model::ModelConfig& c = desc.config;
  if (c.family == model::Family::moe && c.moe_every != 1)
    throw std::runtime_error("ckpt export: a mixture-of-experts model with moe_every = " + std::to_string(c.moe_every) +
                             " (dense blocks between MoE blocks) has no Hugging Face model type: Mixtral has MoE in "
                             "every block (--moe-every 1)");
  // Mixtral's reader renormalises the k routing weights and drops no token: these weights would
  // compute another model there.
  if (c.family == model::Family::moe && !c.norm_topk)
    throw std::runtime_error("ckpt export: a mixture-of-experts model with norm_topk = false (--no-norm-topk) has no "
                             "Hugging Face model type: Mixtral renormalises the k routing weights to sum 1");
  if (c.family == model::Family::moe && c.capacity_factor > 0)
    throw std::runtime_error("ckpt export: a mixture-of-experts model with capacity_factor = " +
                             json(c.capacity_factor).dump() +
                             " (--capacity-factor) has no Hugging Face model type: Mixtral drops no token");
  const bool bf16 = opt.dtype == "bf16";
  std::vector<uint16_t> half(bf16 ? layout.total : 0);
  for (size_t i = 0; i < half.size(); ++i) half[i] = to_bf16(params[i]);

  std::vector<Tensor> tensors;
  HfExportSummary summary;
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& p : desc.units[u].params) {
      const int64_t at = layout.units[u].offset + p.offset;
      const uint64_t bytes = static_cast<uint64_t>(p.exported_numel()) * (bf16 ? 2 : 4);
      tensors.push_back({&p, bf16 ? reinterpret_cast<const float*>(half.data() + at) : params + at, bytes});
      summary.total_size += bytes;
    }
  const auto files = split_into_files(tensors, opt.max_shard_bytes);
  summary.files = static_cast<int>(files.size());

  const fs::path parent = fs::path(out_dir).parent_path();
  fs::create_directories(parent.empty() ? fs::path(".") : parent);
  write_dir_atomically(out_dir, [&](const std::string& tmp) {
    json weight_map = json::object();
    for (size_t i = 0; i < files.size(); ++i) {
      const std::string name = files.size() == 1 ? "model.safetensors" : shard_name(i, files.size());
      SafetensorsWriter w;
      for (const Tensor& t : files[i]) {
        w.add(t.spec->name, bf16 ? StDType::BF16 : StDType::F32, t.spec->exported_shape(), t.data, t.bytes);
        weight_map[t.spec->name] = name;
      }
      w.set_metadata("format", "pt");
      w.write(tmp + "/" + name);
    }
    if (files.size() > 1)
      write_json(tmp + "/model.safetensors.index.json",
                 {{"metadata", {{"total_size", summary.total_size}}}, {"weight_map", weight_map}});

    json config = to_hf_config(desc.config);
    config["shardlm_tokenizer"] = opt.tokenizer;
    config["torch_dtype"] = bf16 ? "bfloat16" : "float32";
    if (opt.tokenizer == "gpt2") {
      config["bos_token_id"] = config["eos_token_id"] = 50256;
      write_gpt2_tokenizer(tmp, desc.config, opt);
      summary.tokenizer_files = "vocab.json, merges.txt";
    } else if (exports_tokenizer_json(opt.tokenizer)) {
      write_tokenizer_json(tmp, desc.config, opt, config);
      summary.tokenizer_files = "tokenizer.json";
    } else {
      summary.tokenizer_note = "tokenizer '" + opt.tokenizer + "' has no Hugging Face tokenizer files";
    }
    write_json(tmp + "/config.json", config);
  }, opt.overwrite ? OnExisting::replace : OnExisting::refuse);
  return summary;
}

}  // namespace shardlm::ckpt
