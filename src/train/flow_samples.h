// A diffusion model's samples at the end of a run: `per_class` samples of every class drawn by
// sample_flow (evaluate.h), written by the lead rank into the run directory as DIR/samples.png (a
// grid: a row per class, the samples side by side, a sample's frames side by side; channels 0-2
// as RGB from [-1, 1]) and DIR/samples.bin (the latents as a latent set, data/latents.h, labelled
// by class). Collective: every rank samples alike. Returns the PNG's path (empty off the lead).
#pragma once

#include <string>

#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "train/evaluate.h"

namespace shardlm::train {

std::string write_flow_samples(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                               const std::string& dir, int64_t per_class, const FlowSampling& fs, bool lead);

}  // namespace shardlm::train
