#include "train/resume_check.h"

#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdexcept>
#include <vector>

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

std::vector<std::string> known_settings() {
  std::vector<std::string> names;
  const json identity = run_identity(TrainConfig{}, 1);
  for (const auto& [k, v] : identity.items()) names.push_back(k);
  return names;
}

// The ranks that read different sequences, as the mesh's data axes say: a cp group's share theirs.
int data_parallel_ranks(const TrainConfig& c, int world_size) {
  const plan::Mesh mesh = plan::plan_mesh(plan_config(c, world_size));
  return mesh.group_size(plan::data_axes(mesh));
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
  if (!cfg.resume_override.empty() && cfg.resume.empty())
    throw std::invalid_argument("--resume-override is for --resume: a new run has no saved settings to differ from");
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
