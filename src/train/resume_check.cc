#include "train/resume_check.h"

#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdexcept>
#include <vector>

#include "ckpt/hf_config.h"
#include "plan/plan.h"
#include "train/trainer.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

// The identity's settings whose values are fp32 in TrainConfig: printed as floats, so that a
// saved 1e-3 reads "0.001", not its double widening.
bool is_float_setting(const std::string& name) {
  for (const char* f : {"lr", "min-lr", "weight-decay", "beta1", "beta2", "eps", "grad-clip"})
    if (name == f) return true;
  return false;
}

std::string shown(const std::string& name, const json& v) {
  if (v.is_number_float() && is_float_setting(name)) return fmt::format("{}", static_cast<float>(v.get<double>()));
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

// Flag spelling: "min_lr" and "min-lr" both name --min-lr.
std::string flag_name(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

// A routing setting of a mixture-of-experts model, by its flag, as config.json records it.
struct Routing {
  const char* name;
  bool of_weights;  // what the weights compute with (compared on --init-from too), not a loss's
  std::string (*shown)(const model::ModelConfig&);
};

std::string number(double v) { return fmt::format("{}", v); }

const std::vector<Routing>& routing_settings() {
  static const std::vector<Routing> settings = {
      {"top-k", true, [](const model::ModelConfig& c) { return std::to_string(c.top_k); }},
      {"no-norm-topk", true, [](const model::ModelConfig& c) { return std::string(c.norm_topk ? "false" : "true"); }},
      {"capacity-factor", true,
       [](const model::ModelConfig& c) { return c.capacity_factor > 0 ? number(c.capacity_factor) : "dropless"; }},
      {"aux-loss-coef", false, [](const model::ModelConfig& c) { return number(c.aux_loss_coef); }},
      {"z-loss-coef", false, [](const model::ModelConfig& c) { return number(c.z_loss_coef); }},
  };
  return settings;
}

bool is_weights_routing(const std::string& name) {
  for (const Routing& r : routing_settings())
    if (r.of_weights && name == r.name) return true;
  return false;
}

std::vector<std::string> known_settings() {
  std::vector<std::string> names;
  const json identity = run_identity(TrainConfig{}, 1);
  for (const auto& [k, v] : identity.items()) names.push_back(k);
  for (const Routing& r : routing_settings()) names.push_back(r.name);
  return names;
}

bool overridden(const TrainConfig& cfg, const std::string& name) {
  return std::any_of(cfg.resume_override.begin(), cfg.resume_override.end(),
                     [&](const std::string& raw) { return flag_name(raw) == name; });
}

// The ranks that read different sequences, as the mesh's data axes say: a cp group's share theirs.
int data_parallel_ranks(const TrainConfig& c, int world_size) {
  const plan::Mesh mesh = plan::plan_mesh(plan_config(c, world_size));
  return mesh.group_size(mesh.data_axes());
}

}  // namespace

json run_identity(const TrainConfig& c, int world_size) {
  std::error_code ec;
  const auto data = std::filesystem::weakly_canonical(std::filesystem::absolute(c.data, ec), ec);
  return {
      {"steps", c.steps},
      {"lr", c.lr},
      {"min-lr", c.min_lr},
      {"warmup", c.warmup},
      {"lr-decay", c.lr_decay},
      {"decay-fraction", c.decay_fraction},
      {"global-batch", static_cast<int64_t>(data_parallel_ranks(c, world_size)) * c.batch * c.grad_accum},
      {"seq", c.seq},
      {"data", ec ? c.data : data.string()},
      {"seed", c.seed},
      {"weight-decay", c.weight_decay},
      {"beta1", c.beta1},
      {"beta2", c.beta2},
      {"eps", c.eps},
      {"grad-clip", c.grad_clip},
  };
}

void check_resume_override_use(const TrainConfig& cfg) {
  const auto known = known_settings();
  for (const auto& raw : cfg.resume_override) {
    if (std::find(known.begin(), known.end(), flag_name(raw)) == known.end())
      throw std::invalid_argument(fmt::format("--resume-override: '{}' is not a setting that defines a run (one of: {})",
                                              raw, fmt::join(known, ", ")));
  }
  if (cfg.resume_override.empty() || !cfg.resume.empty()) return;
  if (cfg.init_from.empty())
    throw std::invalid_argument("--resume-override is for --resume: a new run has no saved settings to differ from");
  for (const auto& raw : cfg.resume_override)
    if (!is_weights_routing(flag_name(raw)))
      throw std::invalid_argument(fmt::format("--resume-override: '{}' with --init-from: a new run from a checkpoint's "
                                              "weights may differ from it only in their routing (top-k, no-norm-topk, "
                                              "capacity-factor)",
                                              raw));
}

std::vector<std::string> check_routing_matches(const TrainConfig& cfg, const model::ModelConfig& run,
                                               const model::ModelConfig& saved, const std::string& config_path) {
  if (run.family != model::Family::moe || saved.family != model::Family::moe) return {};
  check_resume_override_use(cfg);
  // This run's settings as its checkpoint's config.json will hold them (the load-balancing
  // coefficient as Mixtral's, a k-th of it): a saved 0.01 at k = 3 reads back as itself.
  const model::ModelConfig recorded = ckpt::from_hf_config(ckpt::to_hf_config(run), config_path);
  const bool resuming = !cfg.resume.empty();
  std::vector<std::string> changes, names, said;
  for (const Routing& r : routing_settings()) {
    if (!resuming && !r.of_weights) continue;
    const std::string now = r.shown(recorded), was = r.shown(saved);
    if (now == was) continue;
    if (overridden(cfg, r.name)) {
      said.push_back(fmt::format("--resume-override {}: {} changed from {} to {}", r.name, r.name, was, now));
      continue;
    }
    changes.push_back(fmt::format("{} is {} (saved {})", r.name, now, was));
    names.push_back(r.name);
  }
  if (changes.empty()) return said;
  throw std::runtime_error(fmt::format("{}: this run routes its experts otherwise than the checkpoint: {}; "
                                       "--resume-override {} if that is meant",
                                       config_path, fmt::join(changes, ", "), fmt::join(names, ",")));
}

void check_resume_matches(const TrainConfig& cfg, int world_size, const json& saved_run, const std::string& state_path) {
  check_resume_override_use(cfg);
  std::vector<std::string> allowed;
  for (const auto& raw : cfg.resume_override) allowed.push_back(flag_name(raw));
  const json now = run_identity(cfg, world_size);
  std::vector<std::string> changes, names;
  for (const auto& [name, value] : now.items()) {
    if (!saved_run.contains(name) || saved_run[name] == value) continue;
    if (std::find(allowed.begin(), allowed.end(), name) != allowed.end()) continue;
    std::string change = fmt::format("{} is {} (saved {})", name, shown(name, value), shown(name, saved_run[name]));
    if (name == "global-batch")
      change += fmt::format(" [data-parallel ranks x batch x grad-accum = {} x {} x {}]",
                            data_parallel_ranks(cfg, world_size), cfg.batch, cfg.grad_accum);
    changes.push_back(change);
    names.push_back(name);
  }
  if (changes.empty()) return;
  throw std::runtime_error(fmt::format("{}: this run is not the saved run: {}; --resume-override {} if that is meant",
                                       state_path, fmt::join(changes, ", "), fmt::join(names, ",")));
}

void check_resume_has_steps_left(const TrainConfig& cfg, int64_t saved_step, const std::string& state_path) {
  if (saved_step <= cfg.steps) return;
  throw std::runtime_error(fmt::format("{}: field 'step' is {}, beyond --steps {}: the schedule ends before the "
                                       "checkpoint (raise --steps, with --resume-override steps, to train on)",
                                       state_path, saved_step, cfg.steps));
}

}  // namespace shardlm::train
