#include "train/checkpoint.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "ckpt/hf_config.h"
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

// Every exported tensor: its spec and where its elements start in the flat layout.
template <class Fn>
void for_each_tensor(const model::ModelDesc& desc, const model::FlatLayout& layout, Fn&& fn) {
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& p : desc.units[u].params) fn(p, layout.units[u].offset + p.offset);
}

// A model trained into NaN or infinity is no model: evaluating or resuming it would only carry
// the poison on, so loading refuses it naming the tensor.
void check_finite(const std::string& file, const std::string& tensor, const float* x, const model::ParamSpec& p) {
  for (int64_t i = 0, n = p.exported_numel(); i < n; ++i)
    if (!std::isfinite(x[i]))
      throw std::runtime_error("checkpoint: " + file + ": tensor '" + tensor + "' holds a non-finite value (" +
                               std::to_string(x[i]) + " at element " + std::to_string(i) + ")");
}

}  // namespace

void save_checkpoint(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     const float* params, const float* exp_avg, const float* exp_avg_sq, const RunState& state,
                     const TrainConfig& cfg) {
  std::filesystem::create_directories(std::filesystem::path(dir).parent_path());
  ckpt::write_dir_atomically(dir, [&](const std::string& tmp) {
    ckpt::SafetensorsWriter weights, moments;
    for_each_tensor(desc, layout, [&](const model::ParamSpec& p, int64_t at) {
      weights.add_f32(p.name, p.exported_shape(), params + at);
      if (exp_avg) {
        moments.add_f32("exp_avg." + p.name, p.exported_shape(), exp_avg + at);
        moments.add_f32("exp_avg_sq." + p.name, p.exported_shape(), exp_avg_sq + at);
      }
    });
    weights.set_metadata("format", "pt");
    weights.write(tmp + "/model.safetensors");
    if (exp_avg) moments.write(tmp + "/optimizer.safetensors");

    json config = ckpt::to_hf_config(desc.config);
    config["shardlm_tokenizer"] = state.tokenizer;
    write_json(tmp + "/config.json", config);
    write_json(tmp + "/state.json",
               {{"step", state.step},
                {"optimizer", {{"adamw_step", state.adam_step}}},
                {"tokenizer", state.tokenizer},
                // Batches are a pure function of (seed, step), so the step is the data position.
                {"data", {{"sampler", "hash(seed, step, micro_step, sequence)"}, {"next_step", state.step}}},
                {"rng", {{"seed", state.seed}}},
                {"run", state.run},
                {"schedule",
                 {{"lr", cfg.lr},
                  {"min_lr", cfg.min_lr},
                  {"warmup_steps", cfg.warmup},
                  {"total_steps", cfg.steps}}}});
  });
}

model::ModelConfig read_checkpoint_config(const std::string& dir) {
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error("checkpoint: " + dir + " is not a directory");
  const std::string path = dir + "/config.json";
  try {
    return ckpt::from_hf_config(read_json(path), path);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(what.rfind("checkpoint: ", 0) == 0 ? what : "checkpoint: " + what);
  }
}

RunState read_checkpoint_state(const std::string& dir) {
  const std::string path = dir + "/state.json";
  const json j = read_json(path);
  RunState s;
  s.step = field<int64_t>(j, "step", path);
  // Checkpoints from before skipped steps existed applied an update at every step.
  s.adam_step = j.contains("optimizer") ? field<int64_t>(j["optimizer"], "adamw_step", path) : s.step;
  s.tokenizer = field<std::string>(j, "tokenizer", path);
  if (!j.contains("rng")) throw std::runtime_error("checkpoint: " + path + " has no field 'rng'");
  s.seed = field<uint64_t>(j["rng"], "seed", path);
  if (j.contains("run") && j["run"].is_object()) {
    s.run = j["run"];
  } else {
    s.run = {{"seed", s.seed}};
    if (j.contains("schedule") && j["schedule"].is_object()) {
      const json& sch = j["schedule"];
      for (const auto& [from, to] :
           {std::pair{"lr", "lr"}, {"min_lr", "min-lr"}, {"warmup_steps", "warmup"}, {"total_steps", "steps"}})
        if (sch.contains(from)) s.run[to] = sch[from];
    }
  }
  return s;
}

void load_checkpoint(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     float* params, float* exp_avg, float* exp_avg_sq) {
  {
    ckpt::SafetensorsFile f(dir + "/model.safetensors");
    for_each_tensor(desc, layout, [&](const model::ParamSpec& p, int64_t at) {
      f.read_f32(p.name, params + at, p.exported_shape());
      check_finite(dir + "/model.safetensors", p.name, params + at, p);
    });
  }
  if (exp_avg) {
    const std::string path = dir + "/optimizer.safetensors";
    ckpt::SafetensorsFile f(path);
    for_each_tensor(desc, layout, [&](const model::ParamSpec& p, int64_t at) {
      f.read_f32("exp_avg." + p.name, exp_avg + at, p.exported_shape());
      f.read_f32("exp_avg_sq." + p.name, exp_avg_sq + at, p.exported_shape());
      check_finite(path, "exp_avg." + p.name, exp_avg + at, p);
      check_finite(path, "exp_avg_sq." + p.name, exp_avg_sq + at, p);
    });
  }
}

}  // namespace shardlm::train
