// Hugging Face config.json for the model families shardlm trains: GPT2Config (model_type
// "gpt2") and LlamaConfig (model_type "llama"), written with the keys transformers writes and
// read back, so a checkpoint directory is what `from_pretrained` expects and a config.json from
// the Hub describes a model here.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"

namespace shardlm::ckpt {

nlohmann::json to_hf_config(const model::ModelConfig& c);

// Throws std::runtime_error "PATH: field 'KEY' …" for a missing or bad key, an unknown
// model_type, or a setting shardlm does not implement (rope_scaling, biases, other activations).
model::ModelConfig from_hf_config(const nlohmann::json& j, const std::string& path);
model::ModelConfig read_hf_config(const std::string& path);

}  // namespace shardlm::ckpt
