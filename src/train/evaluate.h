// Evaluation and sampling: forward-only plans run on the executor that trains, over its state
// and under its strategy, so they exercise the compute path training uses and allocate only
// what their plans account for.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "data/corpus.h"
#include "data/latents.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"

namespace shardlm::train {

// Mean cross-entropy (nats) over the windows i = 0 … n−1, n = ⌊(tokens − 1) / T⌋, taking every
// stride-th window when max_windows limits them (0: all). Each forward takes N·B windows for N
// data-parallel coordinates, world rank `rank` the B of its coordinate. Collective: every rank of
// `training`'s plan calls it alike.
double evaluate(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                const data::TokenCorpus& shard, int64_t B, int64_t T, int64_t max_windows, int rank);

// A diffusion model's batch (model::DitSample each): samples j = first … first + B − 1 of step
// `step`, each a record of `set` (data::latent_record; at step −1, evaluation's, record j mod the
// records, its label kept), its noise, time and label drop drawn by data::flow_draw.
void fill_flow_samples(const model::ModelConfig& mc, const data::LatentSet& set, uint64_t seed, int64_t step,
                       int64_t first, int64_t B, char* batch, int64_t bytes);

// A diffusion model's mean squared error of the velocity over the validation records 0 … n − 1
// (n: the records, at most max_records when > 0, rounded up to whole batches of every
// data-parallel coordinate), their noise and times drawn at step −1 (the same every evaluation).
// Collective, as evaluate.
double evaluate_flow(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                     const data::LatentSet& set, int64_t B, uint64_t seed, int64_t max_records, int rank);

// Latents of `labels` (one sample each) drawn from a diffusion model by Euler steps of its flow
// from t = 1 (noise, drawn from `seed`) to t = 0, each step's velocity guided from the null
// class's: v = v_null + cfg·(v_label − v_null) (cfg 1: the label's alone). A forward-only plan of
// twice the samples (labelled, then null) per step, whose samples hold x_t as both latents and
// noise (so the model's x_t is x_t). Returns (labels, C, F, H, W). Every rank draws the same
// samples. Collective.
struct FlowSampling {
  int64_t steps = 50;
  float cfg = 4.0f;
  uint64_t seed = 1337;
};
std::vector<float> sample_flow(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                               const std::vector<int32_t>& labels, const FlowSampling& fs);

// Entropy (nats) of the token distribution of a shard: the loss of the best unigram model.
double unigram_entropy(const data::TokenCorpus& shard);

struct SampleConfig {
  int64_t tokens = 64;
  float temperature = 1.0f;
  int64_t top_k = 40;  // 0: all
  float top_p = 1.0f;  // of the top k, the likeliest whose probabilities sum to at least top_p (1: all)
  uint64_t seed = 1337;
  int64_t vocab_limit = 0;  // draw only ids below it (the tokenizer's size when the model's is larger; 0: all)
  std::vector<int32_t> stop_tokens;  // drawing one of them ends the continuation, without it
};
// Continues `prompt` (token ids; may be empty: starts from `start_token`) by cfg.tokens tokens, or
// fewer where one of cfg.stop_tokens is drawn, handing each to `on_token` as soon as it is drawn
// (generate prints them as they come).
// Every rank draws the same tokens (same logits, same seed). Collective.
std::vector<int32_t> generate(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                              const std::vector<int32_t>& prompt, int32_t start_token, const SampleConfig& cfg,
                              const std::function<void(int32_t)>& on_token = {});

}  // namespace shardlm::train
