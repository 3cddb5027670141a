#include "ckpt/hf_import.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "ckpt/hf_config.h"
#include "ckpt/json_no_duplicates.h"
#include "ckpt/safetensors.h"

namespace shardlm::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("ckpt import: " + path + ": " + what);
}

json read_json(const std::string& path) {
  try {
    return read_json_no_duplicates(path);  // "PATH: …"
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("ckpt import: ") + e.what());
  }
}

// A name in a file as the model here calls it; "" for what save_pretrained adds that holds no
// parameter (buffers, the head a tied model shares with its embedding).
std::string canonical(const std::string& name, const model::ModelConfig& c) {
  if (c.family == model::Family::gpt2) {
    const std::string n = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
    if (n == "lm_head.weight" || n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")) return "";
    return n;
  }
  if (name.ends_with(".rotary_emb.inv_freq") || (c.tie_embeddings && name == "lm_head.weight")) return "";
  return name;
}

// Which file holds which tensor (by the file's own name): model.safetensors' header, or the
// sharded index's weight_map.
std::map<std::string, std::string> weight_files(const std::string& dir, std::string* holder) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> where;
  if (fs::exists(index_path)) {
    *holder = index_path;
    const json j = read_json(index_path);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index_path, "has no 'weight_map' object");
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        fail(index_path, "weight_map entry '" + name + "' must name a file in " + dir);
      where[name] = dir + "/" + file.get<std::string>();
    }
    for (const auto& [name, file] : where)
      if (!fs::is_regular_file(file)) fail(file, "is missing (" + index_path + " places '" + name + "' in it)");
    return where;
  }
  const std::string single = dir + "/model.safetensors";
  if (!fs::exists(single))
    fail(dir, "holds neither model.safetensors nor model.safetensors.index.json (pytorch_model.bin is not read)");
  *holder = single;
  for (const auto& name : SafetensorsFile(single).names()) where[name] = single;
  return where;
}

}  // namespace

// A LLaMA 2 model (32000 ids, SentencePiece) was taken for GPT-2's, and generate printed its ids
// as GPT-2 text.
std::string tokenizer_of_vocabulary(int64_t vocab_size) {
  if (vocab_size == 256) return "bytes";
  if (vocab_size == 50257 || vocab_size == 50304) return "gpt2";  // 50304: padded, as nanoGPT saves it
  if (vocab_size == 128256) return "llama3";
  return "unknown";
}

HfModel read_hf_model(const std::string& dir) {
  if (!fs::is_directory(dir)) fail(dir, "is not a directory");
  const std::string path = dir + "/config.json";
  const json j = read_json(path);
  HfModel m;
  m.config = from_hf_config(j, path);
  if (j.contains("shardlm_tokenizer") && j["shardlm_tokenizer"].is_string() && !j["shardlm_tokenizer"].get<std::string>().empty())
    m.tokenizer = j["shardlm_tokenizer"].get<std::string>();
  else if (fs::exists(dir + "/vocab.json") && fs::exists(dir + "/merges.txt"))
    m.tokenizer = "gpt2";
  else
    m.tokenizer = tokenizer_of_vocabulary(m.config.vocab_size);
  // 32000 SentencePiece ids: Mistral 7B's and Mixtral 8x7B's are Mistral's; a LLaMA's, LLaMA 2's
  // (TinyLlama's, Vicuna's). generate reads the directory's own tokenizer.json either way.
  if (m.tokenizer == "unknown" && m.config.vocab_size == 32000)
    m.tokenizer = j["model_type"] == "llama" ? "llama2" : "mistral";
  return m;
}

void read_hf_weights(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     float* params) {
  std::string holder;
  const std::map<std::string, std::string> in_files = weight_files(dir, &holder);
  // model name -> (file, name in the file)
  std::map<std::string, std::pair<std::string, std::string>> found;
  std::set<std::string> wanted;
  for (const auto& u : desc.units)
    for (const auto& p : u.params) wanted.insert(p.name);
  for (const auto& [name, file] : in_files) {
    const std::string c = canonical(name, desc.config);
    if (c.empty()) continue;
    if (!wanted.count(c))
      fail(file, "tensor '" + name + "' is not a parameter of the " + model::to_string(desc.config.family) +
                     " model config.json describes");
    if (found.count(c)) fail(file, "tensor '" + name + "' is there twice (also as '" + found[c].second + "')");
    found[c] = {file, name};
  }

  std::fill(params, params + layout.total, 0.0f);  // padding
  std::map<std::string, SafetensorsFile> open;
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& p : desc.units[u].params) {
      const auto it = found.find(p.name);
      if (it == found.end()) fail(holder, "has no tensor '" + p.name + "', which config.json implies");
      const auto& [file, name] = it->second;
      auto f = open.find(file);
      if (f == open.end()) {
        f = open.emplace(file, SafetensorsFile(file)).first;
        // Every tensor of a file is where the index says: a copy the index does not name (a
        // tensor twice, in two files) is refused, not silently passed over.
        for (const auto& held : f->second.names())
          if (in_files.count(held) == 0 || in_files.at(held) != file)
            fail(file, "holds tensor '" + held + "', which " + holder + " does not place in this file");
      }
      float* dst = params + layout.units[u].offset + p.offset;
      f->second.read_f32(name, dst, p.exported_shape());  // names file and tensor on a bad shape or dtype
      for (int64_t i = 0, n = p.exported_numel(); i < n; ++i)
        if (!std::isfinite(dst[i]))
          fail(file, "tensor '" + name + "' holds a non-finite value (" + std::to_string(dst[i]) + " at element " +
                         std::to_string(i) + ")");
    }
}

}  // namespace shardlm::ckpt
