// A resumed run is the run that was saved. The settings that define a run — its learning-rate
// schedule (lr, min-lr, warmup, lr-decay, decay-fraction, and steps, which sets its length), the
// global batch (data-parallel ranks × batch × grad-accum: the ranks of a cp group read one batch),
// seq, data, seed and the optimizer's hyperparameters — are recorded in the checkpoint's state.json ("run"), and a resume that changes one is refused,
// naming it, unless --resume-override names it. The model is checked against config.json
// (trainer.cc; a mixture of experts' routing here, overridable the same way). What may change freely: the rank count, per-rank batch, grad-accum and strategy
// as long as the global batch holds, threads, and every plan or output setting.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/model.h"
#include "train/config.h"

namespace shardlm::train {

// {"lr": 0.0006, "global-batch": 8, …}: the run-defining settings, keyed by their flag names (the
// names --resume-override takes). The data prefix is recorded as an absolute path.
nlohmann::json run_identity(const TrainConfig& cfg, int world_size);

// Throws std::runtime_error, one line naming every differing setting, unless `cfg` on
// `world_size` ranks is the run whose identity `saved_run` is (RunState::run of the checkpoint's
// state.json at `state_path`) but for the settings cfg.resume_override names. Settings the saved
// record lacks (state files older than it hold only the schedule and seed) are not compared.
// Also throws for an unknown --resume-override name.
void check_resume_matches(const TrainConfig& cfg, int world_size, const nlohmann::json& saved_run,
                          const std::string& state_path);
// Throws std::runtime_error naming `state_path` and its step when the saved step is beyond
// --steps: the schedule would end before the checkpoint. At --steps the saved run is complete
// and resuming it trains nothing (a restart after the last save still exits 0).
void check_resume_has_steps_left(const TrainConfig& cfg, int64_t saved_step, const std::string& state_path);
// --resume-override names known settings, and only with --resume; with --init-from, only the
// routing the weights compute with (check_routing_matches).
void check_resume_override_use(const TrainConfig& cfg);

// A mixture-of-experts checkpoint's routing: --top-k, --no-norm-topk and --capacity-factor, which
// its weights compute with, and on --resume also the losses' --aux-loss-coef and --z-loss-coef
// (with --init-from they are the new run's own). Throws std::runtime_error, one line naming
// `config_path` and every difference between `run` (this run's model) and `saved` (the
// checkpoint's config.json), unless cfg.resume_override names it; returns one line for each
// difference it names ("--resume-override top-k: top-k changed from 2 to 1"), to be said.
std::vector<std::string> check_routing_matches(const TrainConfig& cfg, const model::ModelConfig& run,
                                               const model::ModelConfig& saved, const std::string& config_path);

}  // namespace shardlm::train
