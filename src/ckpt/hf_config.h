// Hugging Face config.json for the model families shardlm trains: GPT2Config (model_type
// "gpt2") and LlamaConfig (model_type "llama"), written with the keys transformers writes and
// read back, so a checkpoint directory is what `from_pretrained` expects and a config.json from
// the Hub describes a model here.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"

namespace shardlm::ckpt {

// The keys transformers writes for the model, each with the value shardlm implements (no
// dropout, N(0, 0.02) initialisation, GPT-2's eps 1e-5, …): from_hf_config reads it back as the
// same model.
nlohmann::json to_hf_config(const model::ModelConfig& c);

// What a config.json is read for, which decides what its training-only settings (dropout,
// initializer_range) must be.
enum class HfConfigUse {
  weights,   // it describes weights read with it (import, --init-from, a checkpoint): valid values pass
  training,  // it defines the model `train --model` builds and trains: they must be shardlm's
};

// Reads the whole file: every key maps to the model, holds the value shardlm implements, or is
// one known not to change the model (architectures, torch_dtype, token ids, generation
// defaults, …); anything else — an unknown key, a rope scaling other than Llama 3.1's, biases,
// another activation or epsilon, scale_attn_by_inverse_layer_idx — throws std::runtime_error
// "PATH: field 'KEY' …", one line naming the value.
model::ModelConfig from_hf_config(const nlohmann::json& j, const std::string& path,
                                  HfConfigUse use = HfConfigUse::weights);
// A config.json given as `train --model`: read whole (a duplicated key refused), for training.
model::ModelConfig read_hf_config(const std::string& path);

}  // namespace shardlm::ckpt
