#include "ckpt/hf_config.h"

#include <fstream>
#include <stdexcept>
#include <type_traits>

namespace shardlm::ckpt {

using nlohmann::json;

json to_hf_config(const model::ModelConfig& c) {
  if (c.family == model::Family::gpt2) {
    return {{"model_type", "gpt2"},       {"architectures", {"GPT2LMHeadModel"}},
            {"n_layer", c.n_layer},       {"n_head", c.n_head},
            {"n_embd", c.n_embd},         {"n_inner", c.ffn_dim},
            {"vocab_size", c.vocab_size}, {"n_positions", c.max_seq},
            {"n_ctx", c.max_seq},         {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", 1e-5}, {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},          {"attn_pdrop", 0.0},
            {"tie_word_embeddings", true}, {"torch_dtype", "float32"}};
  }
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.n_embd},
          {"intermediate_size", c.ffn_dim},
          {"num_hidden_layers", c.n_layer},
          {"num_attention_heads", c.n_head},
          {"num_key_value_heads", c.n_kv_head},
          {"rms_norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", nullptr},
          {"max_position_embeddings", c.max_seq},
          {"tie_word_embeddings", c.tie_embeddings},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"torch_dtype", "float32"}};
}

namespace {

template <class T>
T field(const json& j, const char* key, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) throw std::runtime_error(path + ": no field '" + key + "'");
  // nlohmann would truncate 2.5 (or 1e8 written as a float) to an integer without a word.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    if (!j[key].is_number_integer())
      throw std::runtime_error(path + ": field '" + key + "' must be an integer, got " + j[key].dump());
  try {
    return j.at(key).get<T>();
  } catch (const std::exception&) {
    throw std::runtime_error(path + ": field '" + key + "' has the wrong type");
  }
}

template <class T>
T field_or(const json& j, const char* key, T fallback, const std::string& path) {
  return j.contains(key) && !j[key].is_null() ? field<T>(j, key, path) : fallback;
}

}  // namespace

model::ModelConfig from_hf_config(const json& j, const std::string& path) {
  if (!j.is_object()) throw std::runtime_error(path + ": not a JSON object");
  const std::string type = field<std::string>(j, "model_type", path);
  model::ModelConfig c;
  if (type == "gpt2") {
    c.family = model::Family::gpt2;
    c.n_layer = field<int64_t>(j, "n_layer", path);
    c.n_head = c.n_kv_head = field<int64_t>(j, "n_head", path);
    c.n_embd = field<int64_t>(j, "n_embd", path);
    c.ffn_dim = field_or<int64_t>(j, "n_inner", 4 * c.n_embd, path);
    c.vocab_size = field<int64_t>(j, "vocab_size", path);
    c.max_seq = field<int64_t>(j, "n_positions", path);
    const std::string act = field_or<std::string>(j, "activation_function", "gelu_new", path);
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      throw std::runtime_error(path + ": field 'activation_function' is '" + act + "'; shardlm implements gelu_new");
  } else if (type == "llama") {
    c.family = model::Family::llama;
    c.n_layer = field<int64_t>(j, "num_hidden_layers", path);
    c.n_head = field<int64_t>(j, "num_attention_heads", path);
    c.n_kv_head = field_or<int64_t>(j, "num_key_value_heads", c.n_head, path);
    c.n_embd = field<int64_t>(j, "hidden_size", path);
    c.ffn_dim = field<int64_t>(j, "intermediate_size", path);
    c.vocab_size = field<int64_t>(j, "vocab_size", path);
    c.max_seq = field<int64_t>(j, "max_position_embeddings", path);
    c.norm_eps = field_or<double>(j, "rms_norm_eps", 1e-6, path);
    c.rope_theta = field_or<double>(j, "rope_theta", 10000.0, path);
    c.tie_embeddings = field_or<bool>(j, "tie_word_embeddings", false, path);
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      throw std::runtime_error(path + ": field 'rope_scaling' is set; shardlm implements unscaled rotary embeddings");
    for (const char* bias : {"attention_bias", "mlp_bias"})
      if (field_or<bool>(j, bias, false, path))
        throw std::runtime_error(path + ": field '" + bias + "' is true; shardlm's llama has no biases");
    const std::string act = field_or<std::string>(j, "hidden_act", "silu", path);
    if (act != "silu") throw std::runtime_error(path + ": field 'hidden_act' is '" + act + "'; shardlm implements silu");
  } else {
    throw std::runtime_error(path + ": field 'model_type' is '" + type + "' (expected gpt2 or llama)");
  }
  try {
    c.validate();
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return c;
}

model::ModelConfig read_hf_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(path + ": cannot read");
  json j;
  try {
    j = json::parse(f);
  } catch (const std::exception&) {
    throw std::runtime_error(path + ": not valid JSON");
  }
  return from_hf_config(j, path);
}

}  // namespace shardlm::ckpt
