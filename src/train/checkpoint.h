// The single-process checkpoint: a Hugging Face-style directory written atomically.
//   model.safetensors      GPT-2 tensor names, Conv1D layout, fp32, wte with V rows
//   optimizer.safetensors  AdamW moments: exp_avg.<name>, exp_avg_sq.<name>
//   config.json            Hugging Face GPT-2 keys (n_layer, n_head, n_embd, vocab_size, n_positions)
//   state.json             step, data position, RNG, schedule, tokenizer
#pragma once

#include <cstdint>
#include <string>

#include "model/gpt2.h"
#include "train/config.h"
#include "train/model_state.h"

namespace shardlm::train {

struct RunState {
  int64_t step = 0;  // steps completed; the next step to run
  uint64_t seed = 0;
  std::string tokenizer = "gpt2";
};

void save_checkpoint(const std::string& dir, const ModelState& model, const RunState& state, const TrainConfig& cfg);

// Reads config.json (throws std::runtime_error naming the file and field when absent or bad).
model::ModelConfig read_checkpoint_config(const std::string& dir);
RunState read_checkpoint_state(const std::string& dir);
// Loads parameters and, when the model has them and with_optimizer is set, AdamW moments.
// Every tensor must exist with its exact shape; errors name the file and tensor.
void load_checkpoint(const std::string& dir, ModelState& model, bool with_optimizer);

}  // namespace shardlm::train
