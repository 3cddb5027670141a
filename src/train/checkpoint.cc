#include "train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "ckpt/safetensors.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

void write_json(const std::string& path, const json& j) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) throw std::runtime_error("checkpoint: cannot write " + path);
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("checkpoint: cannot read " + path);
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint: " + path + " is not valid JSON");
  }
}

template <class T>
T field(const json& j, const char* key, const std::string& path) {
  if (!j.contains(key)) throw std::runtime_error("checkpoint: " + path + " has no field '" + key + "'");
  try {
    return j.at(key).get<T>();
  } catch (const std::exception&) {
    throw std::runtime_error("checkpoint: " + path + ": field '" + key + "' has the wrong type");
  }
}

}  // namespace

void save_checkpoint(const std::string& dir, const ModelState& model, const RunState& state, const TrainConfig& cfg) {
  std::filesystem::create_directories(std::filesystem::path(dir).parent_path());
  ckpt::write_dir_atomically(dir, [&](const std::string& tmp) {
    const auto tensors = model.tensors();
    ckpt::SafetensorsWriter weights, moments;
    for (const auto& t : tensors) {
      weights.add_f32(t.spec->name, t.shape, model.params_flat() + t.flat_offset);
      if (model.exp_avg_flat()) {
        moments.add_f32("exp_avg." + t.spec->name, t.shape, model.exp_avg_flat() + t.flat_offset);
        moments.add_f32("exp_avg_sq." + t.spec->name, t.shape, model.exp_avg_sq_flat() + t.flat_offset);
      }
    }
    weights.set_metadata("format", "pt");
    weights.write(tmp + "/model.safetensors");
    if (model.exp_avg_flat()) moments.write(tmp + "/optimizer.safetensors");

    const auto& c = model.config();
    write_json(tmp + "/config.json",
               {{"model_type", "gpt2"},
                {"architectures", {"GPT2LMHeadModel"}},
                {"n_layer", c.n_layer},
                {"n_head", c.n_head},
                {"n_embd", c.n_embd},
                {"vocab_size", c.vocab_size},
                {"n_positions", c.max_seq},
                {"n_ctx", c.max_seq},
                {"activation_function", "gelu_new"},
                {"layer_norm_epsilon", 1e-5},
                {"resid_pdrop", 0.0},
                {"embd_pdrop", 0.0},
                {"attn_pdrop", 0.0},
                {"tie_word_embeddings", true},
                {"shardlm_tokenizer", state.tokenizer}});
    write_json(tmp + "/state.json",
               {{"step", state.step},
                {"tokenizer", state.tokenizer},
                // Batches are a pure function of (seed, step), so the step is the data position.
                {"data", {{"sampler", "hash(seed, step, micro_step, sequence)"}, {"next_step", state.step}}},
                {"rng", {{"seed", state.seed}}},
                {"schedule",
                 {{"lr", cfg.lr},
                  {"min_lr", cfg.min_lr},
                  {"warmup_steps", cfg.warmup},
                  {"total_steps", cfg.steps}}}});
  });
}

model::ModelConfig read_checkpoint_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error("checkpoint: " + dir + " is not a directory");
  const json j = read_json(path);
  model::ModelConfig c;
  c.n_layer = field<int64_t>(j, "n_layer", path);
  c.n_head = field<int64_t>(j, "n_head", path);
  c.n_embd = field<int64_t>(j, "n_embd", path);
  c.vocab_size = field<int64_t>(j, "vocab_size", path);
  c.max_seq = field<int64_t>(j, "n_positions", path);
  try {
    c.validate();
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint: " + path + ": " + e.what());
  }
  return c;
}

RunState read_checkpoint_state(const std::string& dir) {
  const std::string path = dir + "/state.json";
  const json j = read_json(path);
  RunState s;
  s.step = field<int64_t>(j, "step", path);
  s.tokenizer = field<std::string>(j, "tokenizer", path);
  if (!j.contains("rng")) throw std::runtime_error("checkpoint: " + path + " has no field 'rng'");
  s.seed = field<uint64_t>(j["rng"], "seed", path);
  return s;
}

void load_checkpoint(const std::string& dir, ModelState& model, bool with_optimizer) {
  const auto tensors = model.tensors();
  {
    ckpt::SafetensorsFile f(dir + "/model.safetensors");
    for (const auto& t : tensors) f.read_f32(t.spec->name, model.params_flat() + t.flat_offset, t.shape);
  }
  if (with_optimizer && model.exp_avg_flat()) {
    ckpt::SafetensorsFile f(dir + "/optimizer.safetensors");
    for (const auto& t : tensors) {
      f.read_f32("exp_avg." + t.spec->name, model.exp_avg_flat() + t.flat_offset, t.shape);
      f.read_f32("exp_avg_sq." + t.spec->name, model.exp_avg_sq_flat() + t.flat_offset, t.shape);
    }
  }
}

}  // namespace shardlm::train
