#include "ckpt/hf_config.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <type_traits>

#include "ckpt/json_no_duplicates.h"

namespace shardlm::ckpt {

using nlohmann::json;

namespace {

// What shardlm's models are beyond their shapes, as the keys of GPT2Config / LlamaConfig say it.
constexpr double kGpt2LayerNormEps = 1e-5;  // kernels/'s layer norm constant
constexpr double kInitializerRange = 0.02;  // model/'s N(0, 0.02) initialisation

// Keys of PretrainedConfig and the model configs that change neither the model's function nor
// how shardlm trains it: bookkeeping, generation and inference defaults, token ids, heads of
// other tasks (GPT-2's summary_* serve GPT2DoubleHeadsModel only), which attention kernel
// transformers picks. They pass unread.
const std::set<std::string> kNoEffect = {
    "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "_commit_hash",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "chunk_size_feed_forward", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "id2label", "label2id", "num_labels",
    "problem_type", "tokenizer_class", "prefix", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout"};

// Reads config.json's keys one by one and remembers which it read, so that finish() can refuse
// the keys no one read: every key either maps to the model, holds the value shardlm implements,
// is known not to matter (kNoEffect), or is refused.
class Fields {
 public:
  Fields(const json& j, std::string path, HfConfigUse use, std::string prefix = "")
      : j_(j), path_(std::move(path)), use_(use), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw std::runtime_error(path_ + ": field '" + prefix_ + key + "' " + what);
  }
  bool has(const char* key) {
    seen_.insert(key);
    return j_.contains(key) && !j_[key].is_null();
  }

  template <class T>
  T get(const char* key) {
    if (!has(key)) throw std::runtime_error(path_ + ": no field '" + prefix_ + key + "'");
    const json& v = j_[key];
    // nlohmann would truncate 2.5 (or 1e8 written as a float) to an integer without a word.
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      if (!v.is_number_integer()) fail(key, "must be an integer, got " + v.dump());
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) fail(key, "must be true or false, got " + v.dump());
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) fail(key, "must be a number, got " + v.dump());
    } else {
      if (!v.is_string()) fail(key, "must be a string, got " + v.dump());
    }
    return v.get<T>();
  }
  template <class T>
  T get_or(const char* key, T fallback) {
    return has(key) ? get<T>(key) : fallback;
  }
  // A finite number > 0 (an epsilon, a rotary base).
  double positive(const char* key, double fallback) {
    const double v = get_or<double>(key, fallback);
    if (!std::isfinite(v) || v <= 0) fail(key, "must be a finite number > 0, got " + j_[key].dump());
    return v;
  }
  // A finite number >= 0 (a loss coefficient).
  double non_negative(const char* key, double fallback) {
    const double v = get_or<double>(key, fallback);
    if (!std::isfinite(v) || v < 0) fail(key, "must be a finite number >= 0, got " + j_[key].dump());
    return v;
  }
  // The value as the file writes it (a number as its shortest round-trip text), for errors.
  std::string written(const char* key) const { return j_.at(key).dump(); }
  // A setting shardlm has one value of: absent, null or that value.
  template <class T>
  void must_be(const char* key, T implemented, const std::string& why) {
    if (has(key) && get<T>(key) != implemented) fail(key, "is " + j_[key].dump() + "; " + why);
  }
  // The fields of an object-valued key (present and not null), named KEY.FIELD in errors.
  Fields object(const char* key) {
    if (!has(key) || !j_[key].is_object()) fail(key, "must be an object or null, got " + j_[key].dump());
    return Fields(j_[key], path_, use_, prefix_ + key + ".");
  }
  // An alias transformers maps onto another key (GPT2Config's hidden_size is n_embd): it must
  // say the same.
  void same_as(const char* alias, const char* key, int64_t value) {
    if (has(alias) && get<int64_t>(alias) != value)
      fail(alias, "is " + j_[alias].dump() + " but '" + key + "' is " + std::to_string(value));
  }

  // Settings that change how a model trains, not what it is: dropout, the initialisation's
  // scale. Weights read with the file only need them valid; a model trained from the file must
  // train as the file says, so they must be shardlm's (no dropout, N(0, 0.02)).
  void dropout(const char* key) {
    const double p = get_or<double>(key, 0.0);
    if (!(p >= 0 && p <= 1)) fail(key, "must be a probability in [0, 1], got " + j_[key].dump());
    if (use_ == HfConfigUse::training && p != 0)
      fail(key, "is " + j_[key].dump() + "; shardlm trains without dropout (0), and this file defines the model to train");
  }
  void initializer_range() {
    const double r = get_or<double>("initializer_range", kInitializerRange);
    if (!std::isfinite(r) || r < 0) fail("initializer_range", "must be a finite number >= 0, got " + j_["initializer_range"].dump());
    if (use_ == HfConfigUse::training && r != kInitializerRange)
      fail("initializer_range", "is " + j_["initializer_range"].dump() +
                                    "; shardlm initialises N(0, 0.02), and this file defines the model to train");
  }
  // PretrainedConfig's settings of encoder-decoder and pruned models: shardlm's are decoders.
  void plain_decoder() {
    must_be("is_encoder_decoder", false, "shardlm's models are decoder-only");
    must_be("add_cross_attention", false, "shardlm's models have no cross-attention");
    must_be("tie_encoder_decoder", false, "shardlm's models are decoder-only");
    if (has("cross_attention_hidden_size")) fail("cross_attention_hidden_size", "is set; shardlm's models have no cross-attention");
    if (has("pruned_heads") && !(j_["pruned_heads"].is_object() && j_["pruned_heads"].empty()))
      fail("pruned_heads", "is " + j_["pruned_heads"].dump() + "; shardlm's models have every head");
    get_or<bool>("is_decoder", true);  // a causal LM is one either way: it only adds cross-attention's use
    if (has("shardlm_tokenizer") && get<std::string>("shardlm_tokenizer").empty())
      fail("shardlm_tokenizer", "is empty");
  }
  // Refuses the first key nothing read and kNoEffect does not name.
  void finish(const std::string& model_type) const {
    for (const auto& [key, value] : j_.items())
      if (!seen_.count(key) && !kNoEffect.count(key))
        throw std::runtime_error(path_ + ": field '" + prefix_ + key + "' (" + value.dump() +
                                 ") is not a setting shardlm implements for model_type " + model_type +
                                 " (nor one known not to change the model)");
  }

 private:
  const json& j_;
  std::string path_;
  HfConfigUse use_;
  std::string prefix_;  // "KEY." inside an object-valued key
  std::set<std::string> seen_;
};

void read_gpt2(Fields& f, model::ModelConfig& c) {
  c.family = model::Family::gpt2;
  c.n_layer = f.get<int64_t>("n_layer");
  c.n_head = c.n_kv_head = f.get<int64_t>("n_head");
  c.n_embd = f.get<int64_t>("n_embd");
  c.ffn_dim = f.get_or<int64_t>("n_inner", 4 * c.n_embd);
  c.vocab_size = f.get<int64_t>("vocab_size");
  c.max_seq = f.get<int64_t>("n_positions");
  f.same_as("n_ctx", "n_positions", c.max_seq);  // older files' name for it
  f.same_as("hidden_size", "n_embd", c.n_embd);  // GPT2Config.attribute_map
  f.same_as("num_attention_heads", "n_head", c.n_head);
  f.same_as("num_hidden_layers", "n_layer", c.n_layer);
  f.same_as("max_position_embeddings", "n_positions", c.max_seq);
  const std::string act = f.get_or<std::string>("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    f.fail("activation_function", "is '" + act + "'; shardlm implements gelu_new (tanh approximation)");
  // Mapped, and model::ModelConfig::validate holds a GPT-2 to the one epsilon its kernels have.
  c.norm_eps = f.positive("layer_norm_epsilon", kGpt2LayerNormEps);
  f.must_be("layer_norm_epsilon", kGpt2LayerNormEps, "shardlm's GPT-2 layer norm uses 1e-05");
  f.must_be("tie_word_embeddings", true, "shardlm's GPT-2 head is the token embedding");
  f.must_be("scale_attn_weights", true, "shardlm's GPT-2 attention scales by 1/sqrt(head size)");
  f.must_be("scale_attn_by_inverse_layer_idx", false, "shardlm's GPT-2 attention does not scale by the layer index");
  // Upcasting the attention to fp32 changes nothing where it is computed in fp32, as here.
  f.get_or<bool>("reorder_and_upcast_attn", false);
  for (const char* p : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) f.dropout(p);
}

// The rotary embedding as transformers 4 writes it (rope_theta, and rope_scaling for Llama 3.1's
// rescaling) or transformers 5 (rope_parameters, holding rope_theta too).
void read_rope(Fields& f, model::ModelConfig& c) {
  c.rope_theta = f.positive("rope_theta", 10000.0);
  const bool top_theta = f.has("rope_theta");
  bool scaling_read = false;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!f.has(key)) continue;
    Fields r = f.object(key);
    if (r.has("rope_theta")) {
      const double theta = r.positive("rope_theta", c.rope_theta);
      if (top_theta && theta != c.rope_theta)
        r.fail("rope_theta", "is " + std::to_string(theta) + " but 'rope_theta' is " + std::to_string(c.rope_theta));
      c.rope_theta = theta;
    }
    const std::string type = r.get_or<std::string>("rope_type", r.get_or<std::string>("type", "default"));
    if (r.has("type") && r.get<std::string>("type") != type)
      r.fail("type", "is '" + r.get<std::string>("type") + "' but 'rope_type' is '" + type + "'");
    model::ModelConfig::RopeScaling s;
    if (type == "llama3") {
      s.factor = r.get<double>("factor");
      s.low_freq_factor = r.get<double>("low_freq_factor");
      s.high_freq_factor = r.get<double>("high_freq_factor");
      s.original_max_seq = r.get<int64_t>("original_max_position_embeddings");
    } else if (type != "default") {
      r.fail(r.has("rope_type") ? "rope_type" : "type",
             "is '" + type + "'; shardlm implements unscaled rotary embeddings (\"default\") and Llama 3.1's (\"llama3\")");
    }
    if (scaling_read && !(s == c.rope_scaling))
      f.fail(key, "describes another rope scaling than 'rope_scaling'");
    c.rope_scaling = s, scaling_read = true;
    r.finish("llama");
  }
}

void read_llama(Fields& f, model::ModelConfig& c) {
  c.family = model::Family::llama;
  c.n_layer = f.get<int64_t>("num_hidden_layers");
  c.n_head = f.get<int64_t>("num_attention_heads");
  c.n_kv_head = f.get_or<int64_t>("num_key_value_heads", c.n_head);
  c.n_embd = f.get<int64_t>("hidden_size");
  c.ffn_dim = f.get<int64_t>("intermediate_size");
  c.vocab_size = f.get<int64_t>("vocab_size");
  c.max_seq = f.get<int64_t>("max_position_embeddings");
  c.norm_eps = f.positive("rms_norm_eps", 1e-6);
  read_rope(f, c);
  c.tie_embeddings = f.get_or<bool>("tie_word_embeddings", false);
  if (f.has("head_dim") && f.get<int64_t>("head_dim") * c.n_head != c.n_embd)
    f.fail("head_dim", "is " + std::to_string(f.get<int64_t>("head_dim")) +
                           "; shardlm's heads are hidden_size / num_attention_heads = " +
                           std::to_string(c.n_head > 0 ? c.n_embd / c.n_head : 0) + " wide");
  f.must_be("attention_bias", false, "shardlm's llama has no biases");
  f.must_be("mlp_bias", false, "shardlm's llama has no biases");
  const std::string act = f.get_or<std::string>("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "is '" + act + "'; shardlm implements silu");
  // Splitting the GEMMs into pretraining_tp slices changes only the order of fp32 sums.
  if (f.get_or<int64_t>("pretraining_tp", 1) < 1) f.fail("pretraining_tp", "must be an integer >= 1");
  f.dropout("attention_dropout");
}

// Mistral's and Mixtral's sliding window: a position attends to the last `sliding_window`
// positions, itself included, which for sequences of at most that many is full causal attention,
// shardlm's. The model is read with max_seq at most the window, so every sequence it runs is exact
// (Mistral 7B v0.1: 4096 of max_position_embeddings 32768).
void read_sliding_window(Fields& f, model::ModelConfig& c) {
  if (!f.has("sliding_window")) return;
  const int64_t window = f.get<int64_t>("sliding_window");
  if (window < 1) f.fail("sliding_window", "must be a positive number of positions, got " + std::to_string(window));
  c.max_seq = std::min(c.max_seq, window);
}

// Mistral: LLaMA's keys and its sliding window (the weights have LLaMA's names and layout).
void read_mistral(Fields& f, model::ModelConfig& c) {
  read_llama(f, c);
  read_sliding_window(f, c);
}

// Mixtral: LLaMA's keys with intermediate_size the experts' width, and the router's. Settings
// Mixtral lacks (dense blocks between MoE blocks, capacity, Switch weights, z-loss) are
// shardlm_-prefixed keys.
void read_mixtral(Fields& f, model::ModelConfig& c) {
  read_llama(f, c);
  c.family = model::Family::moe;
  c.moe_ffn_dim = c.ffn_dim;
  c.ffn_dim = f.get_or<int64_t>("shardlm_dense_intermediate_size", c.moe_ffn_dim);
  c.n_experts = f.get<int64_t>("num_local_experts");
  c.top_k = f.get<int64_t>("num_experts_per_tok");
  // Hugging Face's load-balancing loss is k at balance where shardlm's is 1 (docs/parallelism.md): the same
  // objective takes k times its coefficient here.
  // Each refused here as the file writes it: validate() would name the flag and the scaled value.
  if (f.has("router_aux_loss_coef")) {
    c.aux_loss_coef = f.non_negative("router_aux_loss_coef", 0.0) * static_cast<double>(c.top_k);
    if (!std::isfinite(c.aux_loss_coef))
      f.fail("router_aux_loss_coef", "is " + f.written("router_aux_loss_coef") + "; times num_experts_per_tok = " +
                                         std::to_string(c.top_k) + " (shardlm's --aux-loss-coef) it must be finite");
  } else {
    c.aux_loss_coef = 0.01;
  }
  c.z_loss_coef = f.non_negative("shardlm_z_loss_coef", 0.001);
  c.capacity_factor = f.get_or<double>("shardlm_capacity_factor", 0.0);
  if (!std::isfinite(c.capacity_factor) || c.capacity_factor < 0)
    f.fail("shardlm_capacity_factor", "must be a finite number > 0 (absent or 0: dropless routing), got " +
                                          f.written("shardlm_capacity_factor"));
  c.norm_topk = f.get_or<bool>("shardlm_norm_topk", true);
  c.moe_every = f.get_or<int64_t>("shardlm_moe_every", 1);
  f.get_or<bool>("output_router_logits", false);  // whether HF adds the aux loss: shardlm always does
  read_sliding_window(f, c);
  f.must_be("router_jitter_noise", 0.0, "shardlm's router adds no noise");
}

json rope_scaling_json(const model::ModelConfig::RopeScaling& s) {
  if (s == model::ModelConfig::RopeScaling{}) return nullptr;
  return {{"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_seq}};
}

}  // namespace

json to_hf_config(const model::ModelConfig& c) {
  if (c.family == model::Family::gpt2) {
    return {{"model_type", "gpt2"},
            {"architectures", {"GPT2LMHeadModel"}},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_embd", c.n_embd},
            {"n_inner", c.ffn_dim},
            {"vocab_size", c.vocab_size},
            {"n_positions", c.max_seq},
            {"n_ctx", c.max_seq},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", c.norm_eps},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"initializer_range", kInitializerRange},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"tie_word_embeddings", true},
            {"torch_dtype", "float32"}};
  }
  if (c.family == model::Family::moe) {
    json j = to_hf_config([&] {
      model::ModelConfig l = c;
      l.family = model::Family::llama, l.ffn_dim = c.moe_ffn_dim;
      l.n_experts = l.top_k = l.moe_ffn_dim = 0, l.moe_every = 1, l.capacity_factor = 0;
      return l;
    }());
    j["model_type"] = "mixtral";
    j["architectures"] = {"MixtralForCausalLM"};
    for (const char* k : {"head_dim", "mlp_bias", "pretraining_tp", "rope_scaling"}) j.erase(k);
    j["num_local_experts"] = c.n_experts;
    j["num_experts_per_tok"] = c.top_k;
    j["router_aux_loss_coef"] = c.aux_loss_coef / static_cast<double>(c.top_k);
    j["router_jitter_noise"] = 0.0;
    j["output_router_logits"] = true;
    j["sliding_window"] = nullptr;
    j["shardlm_z_loss_coef"] = c.z_loss_coef;
    if (c.capacity_factor > 0) j["shardlm_capacity_factor"] = c.capacity_factor;
    if (!c.norm_topk) j["shardlm_norm_topk"] = false;
    if (c.moe_every != 1) j["shardlm_moe_every"] = c.moe_every, j["shardlm_dense_intermediate_size"] = c.ffn_dim;
    return j;
  }
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.n_embd},
          {"intermediate_size", c.ffn_dim},
          {"num_hidden_layers", c.n_layer},
          {"num_attention_heads", c.n_head},
          {"num_key_value_heads", c.n_kv_head},
          {"head_dim", c.head_size()},
          {"rms_norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", rope_scaling_json(c.rope_scaling)},
          {"max_position_embeddings", c.max_seq},
          {"tie_word_embeddings", c.tie_embeddings},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", 0.0},
          {"initializer_range", kInitializerRange},
          {"pretraining_tp", 1},
          {"torch_dtype", "float32"}};
}

model::ModelConfig from_hf_config(const json& j, const std::string& path, HfConfigUse use) {
  if (!j.is_object()) throw std::runtime_error(path + ": not a JSON object");
  Fields f(j, path, use);
  const std::string type = f.get<std::string>("model_type");
  model::ModelConfig c;
  if (type == "gpt2") read_gpt2(f, c);
  else if (type == "llama") read_llama(f, c);
  else if (type == "mistral") read_mistral(f, c);
  else if (type == "mixtral") read_mixtral(f, c);
  else f.fail("model_type", "is '" + type + "' (expected gpt2, llama, mistral or mixtral)");
  f.plain_decoder();
  f.initializer_range();
  f.finish(type);
  try {
    c.validate();
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return c;
}

model::ModelConfig read_hf_config(const std::string& path) {
  return from_hf_config(read_json_no_duplicates(path), path, HfConfigUse::training);
}

}  // namespace shardlm::ckpt
