#include "train/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "ckpt/hf_config.h"
#include "ckpt/hf_import.h"
#include "ckpt/json_no_duplicates.h"
#include "ckpt/llmc_model.h"
#include "ckpt/safetensors.h"
#include "ckpt/sharded.h"
#include "data/tokenizer.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

void write_json(const std::string& path, const json& j) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) throw std::runtime_error("checkpoint: cannot write " + path);
}

json read_json(const std::string& path) {
  try {
    return ckpt::read_json_no_duplicates(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("checkpoint: ") + e.what());
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

namespace {

struct TensorCount {
  int64_t tensors = 0, elements = 0;
};

TensorCount exported(const model::ModelDesc& desc) {
  TensorCount n;
  for (const auto& u : desc.units)
    for (const auto& p : u.params) n.tensors += 1, n.elements += p.exported_numel();
  return n;
}

TensorCount in_file(const ckpt::SafetensorsFile& f) {
  TensorCount n;
  for (const auto& name : f.names()) n.tensors += 1, n.elements += f.info(name).numel();
  return n;
}

// config.json against model.safetensors' own header, before anything the config sizes is
// allocated: a config.json claiming more layers than the file holds tensors is refused before
// it is described. Otherwise the file must hold exactly the tensors the config implies (blocks
// need not be alike: a MoE model with --moe-every > 1 alternates dense and MoE blocks), then each
// with its shape.
void check_config_against_tensors(const model::ModelConfig& c, const std::string& dir) {
  const std::string config = dir + "/config.json";
  const bool sharded = ckpt::is_sharded(dir);
  ckpt::SafetensorsFile f;
  json index;
  TensorCount have;
  if (sharded) {
    index = ckpt::read_index(dir);
    const auto [tensors, elements] = ckpt::index_tensor_count(index);
    have = {tensors, elements};
  } else {
    f.open(dir + "/model.safetensors");
    have = in_file(f);
  }
  const std::string holder = sharded ? dir + "/index.json" : f.path();
  // Every layer holds at least one tensor, so more layers than the file's tensors cannot match.
  const bool too_many = c.n_layer - 1 > have.tensors;
  const TensorCount want = too_many ? TensorCount{} : exported(model::describe(c));
  if (too_many || want.tensors != have.tensors || want.elements != have.elements)
    throw std::runtime_error(fmt::format(
        "checkpoint: {}: n_layer {}, n_embd {}, ffn_dim {}, vocab_size {} {}but {} holds {} tensors of {} elements",
        config, c.n_layer, c.n_embd, c.ffn_dim, c.vocab_size,
        too_many ? "" : fmt::format("give {} tensors of {} elements ", want.tensors, want.elements), holder,
        have.tensors, have.elements));
  for (const auto& u : model::describe(c).units)
    for (const auto& p : u.params) {
      if (sharded && !index["tensors"].contains(p.name))
        throw std::runtime_error("checkpoint: " + holder + " has no tensor " + p.name + ", which " + config + " implies");
      // f.info throws naming file and tensor when absent
      const auto shape = sharded ? index["tensors"][p.name]["shape"].get<std::vector<int64_t>>() : f.info(p.name).shape;
      if (shape != p.exported_shape())
        throw std::runtime_error(fmt::format("checkpoint: {}: tensor {} has shape [{}] in {} but the config gives [{}]",
                                             config, p.name, fmt::join(shape, ", "), holder,
                                             fmt::join(p.exported_shape(), ", ")));
    }
}

// A sharded checkpoint states its model twice, config.json for Hugging Face's readers and
// index.json's "config" for its own; both are written from one object, so any difference is
// damage (or an edit) and neither can be trusted.
void check_config_is_the_index_config(const json& config, const std::string& dir) {
  const json index = ckpt::read_index(dir);
  const json empty = json::object();
  const json& saved = index.contains("config") && index["config"].is_object() ? index["config"] : empty;
  if (!config.is_object() || saved == config) return;
  std::string key;
  for (const json* obj : {&config, &saved})
    for (const auto& [k, v] : obj->items())
      if (key.empty() && (!saved.contains(k) || !config.contains(k) || saved[k] != config[k])) key = k;
  throw std::runtime_error(fmt::format("checkpoint: {}/config.json: field '{}' is {} but index.json's 'config' has {}", dir, key,
                                       config.contains(key) ? config[key].dump() : "missing",
                                       saved.contains(key) ? saved[key].dump() : "none"));
}

}  // namespace

model::ModelConfig read_checkpoint_config(const std::string& dir) {
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error("checkpoint: " + dir + " is not a directory");
  const std::string path = dir + "/config.json";
  const json config = read_json(path);
  model::ModelConfig c;
  try {
    c = ckpt::from_hf_config(config, path);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(what.rfind("checkpoint: ", 0) == 0 ? what : "checkpoint: " + what);
  }
  check_config_against_tensors(c, dir);
  // After the tensors, so that a config.json whose shapes are wrong says which tensor.
  if (ckpt::is_sharded(dir)) check_config_is_the_index_config(config, dir);
  return c;
}

RunState read_model_state(const std::string& dir) {
  if (ckpt::is_sharded(dir) || std::filesystem::exists(dir + "/state.json")) return read_checkpoint_state(dir);
  // An exported Hugging Face directory: weights and config.json, no run.
  const std::string path = dir + "/config.json";
  RunState s;
  s.tokenizer = read_json(path).value("shardlm_tokenizer", "gpt2");
  if (s.tokenizer.empty()) throw std::runtime_error("checkpoint: " + path + ": field 'shardlm_tokenizer' is empty");
  return s;
}

namespace {

// The run state's fields (state.json; in a sharded checkpoint's index.json beside the fields
// ckpt::read_index checks); anything else in the file is refused, not ignored.
const std::set<std::string> kStateFields = {"step", "optimizer", "tokenizer", "data", "rng", "run", "schedule"};
const std::set<std::string> kIndexFields = {"format", "world_size", "files", "tensors", "layout", "strategy", "config", "imported_from"};
// Batches are a pure function of (seed, step): the data position is the step.
constexpr const char* kSampler = "hash(seed, step, micro_step, sequence)";
// schedule's keys (the older record of the run) and the run identity's keys they equal.
constexpr std::pair<const char*, const char*> kScheduleInRun[] = {
    {"lr", "lr"}, {"min_lr", "min-lr"}, {"warmup_steps", "warmup"}, {"total_steps", "steps"}};

// Reads one checkpoint's run state, each field checked alone and against the others; every
// error is "checkpoint: PATH: field 'KEY' [(in 'OBJECT')] …".
class StateFields {
 public:
  StateFields(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& parent, const std::string& what) const {
    throw std::runtime_error(fmt::format("checkpoint: {}: field '{}'{} {}", path_, key,
                                         parent.empty() ? "" : " (in '" + parent + "')", what));
  }
  // j_[parent] (or j_ itself), which must be an object.
  const json& object(const std::string& parent) const {
    if (parent.empty()) return j_;
    if (!j_.contains(parent) || !j_[parent].is_object())
      throw std::runtime_error("checkpoint: " + path_ + " has no field '" + parent + "' holding an object");
    return j_[parent];
  }
  const json& value(const std::string& key, const std::string& parent = "") const {
    const json& obj = object(parent);
    if (!obj.contains(key))
      throw std::runtime_error("checkpoint: " + path_ + " has no field '" + key + "'" +
                               (parent.empty() ? "" : " in '" + parent + "'"));
    return obj[key];
  }
  // An integer >= 0: nlohmann would turn 2.5 into 2, -1 into 2^64 - 1 and 2^63 into a negative
  // int64 without a word.
  uint64_t natural(const std::string& key, const std::string& parent = "") const {
    const json& v = value(key, parent);
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      fail(key, parent, "must be an integer >= 0, got " + v.dump());
    return v.get<uint64_t>();
  }
  int64_t count(const std::string& key, const std::string& parent = "") const {
    const uint64_t n = natural(key, parent);
    if (n > static_cast<uint64_t>(INT64_MAX)) fail(key, parent, "is too large, got " + std::to_string(n));
    return static_cast<int64_t>(n);
  }
  std::string text(const std::string& key, const std::string& parent = "") const {
    const json& v = value(key, parent);
    if (!v.is_string() || v.get<std::string>().empty()) fail(key, parent, "must be a non-empty string, got " + v.dump());
    return v.get<std::string>();
  }

 private:
  const json& j_;
  std::string path_;
};

// The run's identity: "run", or for files older than it what "schedule" and "rng" hold. Where
// both are there they must agree, and the step cannot pass the run's length.
json run_record(const json& j, const StateFields& f, int64_t step, uint64_t seed) {
  json run;
  if (j.contains("run") && !j["run"].is_null()) {
    run = j["run"];
    if (!run.is_object()) f.fail("run", "", "must be an object, got " + run.dump());
    if (run.contains("seed") && run["seed"] != seed)
      f.fail("seed", "run", "is " + run["seed"].dump() + " but 'seed' (in 'rng') is " + std::to_string(seed));
  }
  if (j.contains("schedule")) {
    const json& sch = f.object("schedule");
    for (const auto& [from, to] : kScheduleInRun) {
      if (!sch.contains(from)) continue;
      if (!sch[from].is_number()) f.fail(from, "schedule", "must be a number, got " + sch[from].dump());
      if (run.is_object() && run.contains(to) && run[to] != sch[from])
        f.fail(from, "schedule", "is " + sch[from].dump() + " but '" + to + "' (in 'run') is " + run[to].dump());
    }
    if (!run.is_object()) {
      run = {{"seed", seed}};
      for (const auto& [from, to] : kScheduleInRun)
        if (sch.contains(from)) run[to] = sch[from];
    }
  }
  if (!run.is_object()) run = {{"seed", seed}};
  if (run.contains("steps")) {
    if (!run["steps"].is_number_integer() || run["steps"].get<int64_t>() < 0)
      f.fail("steps", "run", "must be an integer >= 0, got " + run["steps"].dump());
    if (step > run["steps"].get<int64_t>())
      f.fail("step", "", fmt::format("is {}, beyond the run's 'steps' {}", step, run["steps"].dump()));
  }
  return run;
}

// What only index.json holds besides ckpt::read_index's fields: the strategy that saved it and
// the model's config, whose tokenizer is the state's.
void check_index_fields(const json& j, const StateFields& f, const std::string& tokenizer) {
  const std::string strategy = f.text("strategy");
  if (strategy != "import") {
    try {
      plan::parse_strategy(strategy);
    } catch (const std::exception&) {
      f.fail("strategy", "", "is \"" + strategy + "\"; a checkpoint is saved by ddp, zero1, zero2, fsdp or hybrid, or made by import");
    }
  }
  const json& config = f.object("config");
  if (config.contains("shardlm_tokenizer") && config["shardlm_tokenizer"] != tokenizer)
    f.fail("shardlm_tokenizer", "config", "is " + config["shardlm_tokenizer"].dump() + " but 'tokenizer' is \"" + tokenizer + "\"");
  if (j.contains("imported_from") && !j["imported_from"].is_string())
    f.fail("imported_from", "", "must be a string, got " + j["imported_from"].dump());
}

}  // namespace

RunState read_checkpoint_state(const std::string& dir) {
  // A sharded checkpoint's index.json holds state.json's fields.
  const bool sharded = ckpt::is_sharded(dir);
  const std::string path = dir + (sharded ? "/index.json" : "/state.json");
  const json j = read_json(path);
  if (!j.is_object()) throw std::runtime_error("checkpoint: " + path + " is not a JSON object");
  const StateFields f(j, path);
  for (const auto& [key, v] : j.items())
    if (!kStateFields.count(key) && !(sharded && kIndexFields.count(key)))
      f.fail(key, "", "is not one shardlm writes (a checkpoint of another version or program?)");
  RunState s;
  s.step = f.count("step");
  // Checkpoints from before skipped steps existed applied an update at every step.
  s.adam_step = j.contains("optimizer") ? f.count("adamw_step", "optimizer") : s.step;
  if (s.adam_step > s.step)
    f.fail("adamw_step", "optimizer", fmt::format("is {}, more than 'step' {}: updates cannot outnumber steps", s.adam_step, s.step));
  if (sharded || j.contains("data")) {
    if (f.value("sampler", "data") != kSampler)
      f.fail("sampler", "data", "is " + f.value("sampler", "data").dump() + "; shardlm's sampler is \"" + kSampler + "\"");
    const int64_t next = f.count("next_step", "data");
    if (next != s.step)
      f.fail("next_step", "data", fmt::format("is {} but 'step' is {} (batches are a function of (seed, step))", next, s.step));
  }
  s.tokenizer = f.text("tokenizer");
  if (!j.contains("rng") || !j["rng"].is_object())
    throw std::runtime_error("checkpoint: " + path + " has no field 'rng' holding {\"seed\": n}");
  s.seed = f.natural("seed", "rng");
  s.run = run_record(j, f, s.step, s.seed);
  if (sharded) check_index_fields(j, f, s.tokenizer);
  return s;
}

void load_checkpoint(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     float* params, float* exp_avg, float* exp_avg_sq) {
  if (ckpt::is_sharded(dir)) {  // one process reads every file whole
    const json index = ckpt::read_index(dir);
    ckpt::verify_checkpoint(dir, index, desc, exp_avg != nullptr);
    ckpt::load_rank(dir, index, desc, ckpt::whole_layout(layout), 0, {params, exp_avg, exp_avg_sq});
    return;
  }
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

// Which rank holds and writes which part of each kind of each unit's state: the plan's placement;
// replicas (ddp, zero1's parameters, hybrid's replicate groups) write once, from the lowest rank
// holding a part.
ckpt::ShardedLayout sharded_layout(const plan::Plan& p, int world) {
  ckpt::ShardedLayout L;
  L.flat = p.layout;
  L.world = world;
  const plan::State kinds[ckpt::kNumKinds] = {plan::State::params, plan::State::optimizer,
                                                  plan::State::optimizer};
  for (int k = 0; k < ckpt::kNumKinds; ++k)
    for (int u = 0; u < static_cast<int>(p.layout.units.size()); ++u) {
      const plan::Placement& where = p.placed(kinds[k], u);
      if (where.parts == 0) throw std::logic_error("checkpoint: a plan that holds no " + std::string(plan::kind_name(kinds[k])));
      ckpt::UnitLayout K;
      K.parts = where.parts;
      K.at = p.held_offset(kinds[k], u);
      std::set<int> seen;
      for (int r = 0; r < world; ++r) {
        K.part_of.push_back(where.parts > 1 ? p.part_index(kinds[k], u, r) : 0);
        K.writes.push_back(seen.insert(K.part_of.back()).second);
      }
      L.kinds[k].push_back(std::move(K));
    }
  return L;
}

ckpt::HfExportSummary export_hf(const std::string& ckpt_dir, const std::string& out_dir, ckpt::HfExportOptions opt) {
  const model::ModelDesc desc = model::describe(read_checkpoint_config(ckpt_dir));
  if (opt.tokenizer.empty()) opt.tokenizer = read_model_state(ckpt_dir).tokenizer;
  const model::FlatLayout layout = model::flat_layout(desc);
  std::vector<float> params(layout.total);
  load_checkpoint(ckpt_dir, desc, layout, params.data(), nullptr, nullptr);
  return ckpt::write_hf_dir(out_dir, desc, layout, params.data(), opt);
}

namespace {

// Whether in_dir/name is there (a link counts, dangling or not); throws where it resolves outside
// in_dir: a link out of it would copy any file the user can read into the checkpoint.
bool tokenizer_file_present(const std::string& in_dir, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(in_dir) / name;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return false;
  const fs::path dir = fs::weakly_canonical(fs::absolute(in_dir, ec), ec);
  const fs::path real = fs::weakly_canonical(fs::absolute(path, ec), ec);
  const auto [dir_end, real_at] = std::mismatch(dir.begin(), dir.end(), real.begin(), real.end());
  if (ec || dir_end != dir.end() || real_at == real.end())
    throw std::runtime_error("ckpt import: " + path.string() + ": resolves to " + real.string() + ", outside --in " +
                             in_dir + "; copy the directory with its links resolved (cp -rL) to import it");
  return fs::is_regular_file(path, ec);
}

// The tokenizer files of Hugging Face directory `in_dir` an import copies into the checkpoint,
// where generate and export read them (data::make_model_tokenizer): tokenizer.json, and GPT-2's
// vocab.json with merges.txt (a pair: neither is read alone). Each is read first as that loader
// reads it, so a broken one is one line now rather than at the model's first use.
std::vector<std::string> checked_tokenizer_files(const std::string& in_dir, const std::string& tokenizer) {
  std::vector<std::string> names;
  const auto file = [&](const char* name) { return in_dir + "/" + name; };
  try {
    if (tokenizer_file_present(in_dir, "tokenizer.json")) {
      data::load_hf_tokenizer(file("tokenizer.json"), tokenizer);
      names.push_back("tokenizer.json");
    }
    const bool vocab = tokenizer_file_present(in_dir, "vocab.json"), merges = tokenizer_file_present(in_dir, "merges.txt");
    if (vocab && merges) {
      data::load_gpt2_tokenizer(file("vocab.json"), file("merges.txt"));
      names.insert(names.end(), {"vocab.json", "merges.txt"});
    }
  } catch (const std::runtime_error& e) {  // the loaders' "PATH: ...", said as import's
    const std::string what = e.what();
    throw std::runtime_error(what.starts_with("ckpt import: ") ? what : "ckpt import: " + what);
  }
  return names;
}

// An imported model as a checkpoint at step 0 with zero AdamW moments; index.json's run state
// records no updates and no run to continue ("run" empty), so the run that starts from it defines
// itself. The `tokenizer_files` of in_path come along: generate reads them from the checkpoint
// (data::make_model_tokenizer).
void write_imported(const model::ModelDesc& desc, const model::FlatLayout& layout, float* params,
                    const std::string& tokenizer, const std::string& in_path, const std::vector<std::string>& tokenizer_files,
                    const std::string& out_dir, bool overwrite) {
  namespace fs = std::filesystem;
  std::vector<float> zeros(layout.total, 0.0f);
  json config = ckpt::to_hf_config(desc.config);
  config["shardlm_tokenizer"] = tokenizer;
  const json meta = {{"format", ckpt::kIndexFormat},
                     {"step", 0},
                     {"optimizer", {{"adamw_step", 0}}},
                     {"tokenizer", tokenizer},
                     {"data", {{"sampler", "hash(seed, step, micro_step, sequence)"}, {"next_step", 0}}},
                     {"rng", {{"seed", 0}}},
                     {"run", json::object()},
                     {"strategy", "import"},
                     {"imported_from", std::filesystem::absolute(in_path).lexically_normal().string()},
                     {"config", config}};
  const std::filesystem::path parent = std::filesystem::path(out_dir).parent_path();
  std::filesystem::create_directories(parent.empty() ? std::filesystem::path(".") : parent);
  const ckpt::ShardedLayout whole = ckpt::whole_layout(layout);
  ckpt::write_dir_atomically(out_dir, [&](const std::string& tmp) {
    const ckpt::FileSummary file = ckpt::write_rank_file(tmp, desc, whole, 0, {params, zeros.data(), zeros.data()});
    write_json(tmp + "/index.json", ckpt::make_index(desc, whole, {file}, meta));
    write_json(tmp + "/config.json", config);
    for (const std::string& name : tokenizer_files) fs::copy_file(fs::path(in_path) / name, fs::path(tmp) / name);
  }, overwrite ? ckpt::OnExisting::replace : ckpt::OnExisting::refuse);
}

}  // namespace

model::ModelConfig import_hf(const std::string& in_dir, const std::string& out_dir, bool overwrite) {
  const ckpt::HfModel hf = ckpt::read_hf_model(in_dir);
  const std::vector<std::string> tokenizer_files = checked_tokenizer_files(in_dir, hf.tokenizer);
  const model::ModelDesc desc = model::describe(hf.config);
  const model::FlatLayout layout = model::flat_layout(desc);
  std::vector<float> params(layout.total);
  ckpt::read_hf_weights(in_dir, desc, layout, params.data());
  write_imported(desc, layout, params.data(), hf.tokenizer, in_dir, tokenizer_files, out_dir, overwrite);
  return hf.config;
}

model::ModelConfig import_llmc(const std::string& in_file, const std::string& out_dir, bool overwrite) {
  const model::ModelDesc desc = model::describe(ckpt::read_llmc_config(in_file));
  const model::FlatLayout layout = model::flat_layout(desc);
  std::vector<float> params(layout.total);
  ckpt::read_llmc_weights(in_file, desc, layout, params.data());
  write_imported(desc, layout, params.data(), ckpt::tokenizer_of_vocabulary(desc.config.vocab_size), in_file, {},
                 out_dir, overwrite);
  return desc.config;
}

void export_llmc(const std::string& ckpt_dir, const std::string& out_file, bool bf16) {
  const model::ModelDesc desc = model::describe(read_checkpoint_config(ckpt_dir));
  const model::FlatLayout layout = model::flat_layout(desc);
  std::vector<float> params(layout.total);
  load_checkpoint(ckpt_dir, desc, layout, params.data(), nullptr, nullptr);
  ckpt::write_llmc_model(out_file, desc, layout, params.data(), bf16);
}

std::string resolve_initial(const std::string& path) {
  const std::filesystem::path p(path);
  if (ckpt::is_llmc_model(path) ||
      std::filesystem::exists(p / "model.safetensors.index.json") ||
      (std::filesystem::exists(p / "model.safetensors") && !std::filesystem::exists(p / "index.json")))
    return path;
  return ckpt::resolve_checkpoint(path);
}

namespace {

// What a model source resolve_initial gave is: an llm.c model file, a shardlm checkpoint (sharded,
// or whole with its state.json), else a Hugging Face directory.
enum class SourceKind { llmc_file, checkpoint, hf_dir };
SourceKind kind_of(const std::string& source) {
  if (ckpt::is_llmc_model(source)) return SourceKind::llmc_file;
  if (ckpt::is_sharded(source) || std::filesystem::exists(source + "/state.json")) return SourceKind::checkpoint;
  return SourceKind::hf_dir;
}

}  // namespace

std::string read_initial_tokenizer(const std::string& source) {
  switch (kind_of(source)) {
    case SourceKind::llmc_file: return ckpt::tokenizer_of_vocabulary(ckpt::read_llmc_config(source).vocab_size);
    case SourceKind::checkpoint: return read_checkpoint_state(source).tokenizer;
    case SourceKind::hf_dir: break;
  }
  return ckpt::read_hf_model(source).tokenizer;
}

void read_initial_weights(const std::string& source, const model::ModelDesc& desc, const model::FlatLayout& layout,
                          float* params) {
  switch (kind_of(source)) {
    case SourceKind::llmc_file: return ckpt::read_llmc_weights(source, desc, layout, params);
    case SourceKind::checkpoint:
      std::fill(params, params + layout.total, 0.0f);
      return load_checkpoint(source, desc, layout, params, nullptr, nullptr);
    case SourceKind::hf_dir: break;
  }
  ckpt::read_hf_weights(source, desc, layout, params);
}

model::ModelConfig read_initial_config(const std::string& source) {
  switch (kind_of(source)) {
    case SourceKind::llmc_file: return ckpt::read_llmc_config(source);
    case SourceKind::checkpoint:
      read_checkpoint_state(source);  // only the weights are taken, but the index is checked whole as a resume checks it
      return read_checkpoint_config(source);
    case SourceKind::hf_dir: break;
  }
  return ckpt::read_hf_model(source).config;
}

}  // namespace shardlm::train
