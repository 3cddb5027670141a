// The single-process training loop and the things built on a trained model: evaluation and
// generation. Metrics go to DIR/metrics.jsonl and, at a glance, to the console.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "data/shard.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "data/tokenizer.h"
#include "train/config.h"
#include "train/model_state.h"

namespace shardlm::train {

struct TrainSummary {
  int64_t steps_done = 0;
  double final_loss = 0;       // training loss of the last step
  double final_val_loss = 0;   // nats per token
  double val_unigram_entropy = 0;  // nats per token, of the validation tokens
  std::vector<int32_t> sample;  // tokens generated at the end (none when sample_tokens == 0)
};

// Trains on every rank of `world` (a world of one is a single process); rank 0 writes metrics,
// checkpoints and the trace. Collective: every rank calls it with the same configuration.
TrainSummary run_training(const TrainConfig& cfg, comm::Communicator& world);
plan::PlanConfig plan_config(const TrainConfig& cfg, int world_size);

// The tokenizer a token file was made with, from PREFIX_meta.json beside it (written by
// `shardlm tokenize`); files without one are taken to be GPT-2 BPE, as llm.c's are.
struct DataMeta {
  std::string tokenizer = "gpt2";
  int64_t vocab_size = 50257;
};
DataMeta read_data_meta(const std::string& prefix);
void write_data_meta(const std::string& prefix, const DataMeta& meta);

// Mean cross-entropy (nats) over the windows i = 0 … n−1, n = ⌊(tokens − 1) / T⌋, taking
// every stride-th window when max_windows limits them (0: all), B windows per forward.
double evaluate(ModelState& model, const data::TokenShard& shard, int64_t B, int64_t T, int64_t max_windows);

// Entropy (nats) of the token distribution of a shard: the loss of the best unigram model.
double unigram_entropy(const data::TokenShard& shard);

struct SampleConfig {
  int64_t tokens = 64;
  float temperature = 1.0f;
  int64_t top_k = 40;  // 0: all
  uint64_t seed = 1337;
};
// Continues `prompt` (token ids; may be empty: starts from end-of-text) by cfg.tokens tokens.
std::vector<int32_t> generate(ModelState& model, const std::vector<int32_t>& prompt, int32_t start_token,
                              const SampleConfig& cfg);

// GFLOP/s of an fp32 GEMM on this machine's current thread count: the MFU denominator.
double measure_gemm_gflops();

// Directory names under a run: DIR/ckpt/step_N.
std::string checkpoint_dir(const std::string& out, int64_t step);

}  // namespace shardlm::train
