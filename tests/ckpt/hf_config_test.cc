// A Hugging Face config.json is read whole: GPT-2's layer_norm_epsilon 0.5 was
// ignored and written back as 1e-5, scale_attn_by_inverse_layer_idx: true dropped, unknown keys
// passed. Every key now maps to the model, holds the value shardlm implements, is one known not
// to change the model, or is refused in one line naming it and its value; what export writes
// reads back as the same model.
#include "ckpt/hf_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/hf_import.h"

namespace shardlm::ckpt {
namespace {

using nlohmann::json;

// The config.json files transformers writes for gpt2 and Meta-Llama-3-8B, as on the Hub.
json hub_gpt2() {
  return json::parse(R"({
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
    "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
    "vocab_size": 50257})");
}
json hub_llama() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 500000.0,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
    "use_cache": true, "vocab_size": 128256})");
}

std::string error_of(const json& j, HfConfigUse use = HfConfigUse::weights) {
  try {
    from_hf_config(j, "cfg.json", use);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

json with(json j, const std::string& key, const json& value) {
  j[key] = value;
  return j;
}

void expect_same(const model::ModelConfig& a, const model::ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_kv_head, b.n_kv_head);
  EXPECT_EQ(a.n_embd, b.n_embd);
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.max_seq, b.max_seq);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_TRUE(a.rope_scaling == b.rope_scaling);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
}

TEST(HfConfig, ExportReadsBackAsTheSameModelForTraining) {
  std::vector<model::ModelConfig> models = {model::model_preset("tiny", 300), model::model_preset("gpt2-124m"),
                                            model::model_preset("llama-small", 300), model::model_preset("llama3-8b"),
                                            model::model_preset("llama3.1-8b"), model::model_preset("llama3.2-1b")};
  models.push_back(model::model_preset("llama-tiny", 300));
  models.back().tie_embeddings = true;
  models.back().norm_eps = 1e-6;
  models.back().rope_theta = 123456.5;
  for (const auto& m : models) {
    const json written = to_hf_config(m);
    SCOPED_TRACE(written.dump());
    const model::ModelConfig back = from_hf_config(written, "cfg.json", HfConfigUse::training);
    expect_same(back, m);
    EXPECT_EQ(to_hf_config(back), written);
  }
}

// Mixtral's load-balancing loss is k at balance where shardlm's is 1: its router_aux_loss_coef c
// is --aux-loss-coef k·c here, both ways.
TEST(HfConfig, MixtralRouterAuxLossCoefIsScaledByTopK) {
  model::ModelConfig m = model::model_preset("moe-tiny", 300);
  m.aux_loss_coef = 0.02;
  const json written = to_hf_config(m);
  EXPECT_EQ(written["router_aux_loss_coef"].get<double>(), 0.02 / static_cast<double>(m.top_k));
  const model::ModelConfig back = from_hf_config(written, "cfg.json", HfConfigUse::training);
  EXPECT_EQ(back.aux_loss_coef, 0.02);
  EXPECT_EQ(to_hf_config(back), written);
  json hub = written;
  hub["router_aux_loss_coef"] = 0.001;
  hub["num_experts_per_tok"] = 2;
  EXPECT_EQ(from_hf_config(hub, "cfg.json").aux_loss_coef, 0.002);
}

// The router's settings are refused naming the field and its value as the file writes it: a
// router_aux_loss_coef of -0.5 read "aux_loss_coef ... got -1.000000" (the value times top_k,
// named by the flag), 1e308 "got inf". A capacity factor of any size is dropless past the
// group's tokens (1e30 dropped every token).
TEST(HfConfig, MixtralRouterSettingsAreRefusedAsWritten) {
  const json moe = to_hf_config(model::model_preset("moe-tiny", 300));
  const auto refused_as = [&](const std::string& key, const json& value, const std::string& written) {
    const std::string what = error_of(with(moe, key, value));
    EXPECT_NE(what.find("cfg.json: field '" + key + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(written), std::string::npos) << what;
    EXPECT_EQ(what.find("inf"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  };
  refused_as("router_aux_loss_coef", -0.5, "got -0.5");
  refused_as("router_aux_loss_coef", 1e308, "1e+308");
  refused_as("router_aux_loss_coef", -1e-300, "got -1e-300");
  refused_as("shardlm_z_loss_coef", -0.25, "got -0.25");
  refused_as("shardlm_z_loss_coef", 1.5e308 * -1, "got -1.5e+308");
  refused_as("shardlm_capacity_factor", -1.25, "got -1.25");
  refused_as("shardlm_capacity_factor", "1.25", "\"1.25\"");
  for (const double factor : {1e18, 1e30, 1.7e308}) {
    const model::ModelConfig wide = from_hf_config(with(moe, "shardlm_capacity_factor", factor), "cfg.json");
    EXPECT_EQ(wide.capacity_factor, factor);
    EXPECT_EQ(wide.expert_capacity(64), 64) << factor;
  }
}

TEST(HfConfig, HubFilesDescribeTheirModels) {
  const model::ModelConfig gpt2 = from_hf_config(hub_gpt2(), "cfg.json");
  expect_same(gpt2, model::model_preset("gpt2-124m"));
  const model::ModelConfig llama = from_hf_config(hub_llama(), "cfg.json");
  expect_same(llama, model::model_preset("llama3-8b"));
  // A model trained from the file trains as the file says: GPT-2's dropout 0.1 is not shardlm's.
  EXPECT_EQ(error_of(hub_gpt2(), HfConfigUse::training),
            "cfg.json: field 'resid_pdrop' is 0.1; shardlm trains without dropout (0), and this file defines the model to train");
  EXPECT_EQ(error_of(hub_llama(), HfConfigUse::training), "");
  EXPECT_NE(error_of(with(hub_llama(), "initializer_range", 0.01), HfConfigUse::training).find("'initializer_range' is 0.01"),
            std::string::npos);
}

// Mistral 7B v0.1's config.json, as on the Hub: LLaMA's keys and a sliding window of 4096.
json hub_mistral() {
  return json::parse(R"({
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})");
}

// Mistral (model_type mistral) is read as the LLaMA it is, its sliding window bounding the
// sequence: within the window the attention is full causal attention, shardlm's, so max_seq is at
// most the window. Mixtral's window the same (it was refused).
TEST(HfConfig, MistralsSlidingWindowBoundsTheSequence) {
  const model::ModelConfig m = from_hf_config(hub_mistral(), "cfg.json", HfConfigUse::training);
  EXPECT_EQ(m.family, model::Family::llama);
  EXPECT_EQ(m.n_layer, 32);
  EXPECT_EQ(m.n_head, 32);
  EXPECT_EQ(m.n_kv_head, 8);
  EXPECT_EQ(m.n_embd, 4096);
  EXPECT_EQ(m.ffn_dim, 14336);
  EXPECT_EQ(m.vocab_size, 32000);
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_EQ(m.max_seq, 4096);
  expect_same(m, model::model_preset("mistral-7b"));
  EXPECT_EQ(from_hf_config(with(hub_mistral(), "sliding_window", nullptr), "cfg.json").max_seq, 32768);  // v0.2, v0.3
  EXPECT_EQ(from_hf_config(with(hub_mistral(), "sliding_window", 65536), "cfg.json").max_seq, 32768);
  for (const json& bad : {json(0), json(-4096)})
    EXPECT_EQ(error_of(with(hub_mistral(), "sliding_window", bad)).rfind("cfg.json: field 'sliding_window' must be", 0), 0u)
        << error_of(with(hub_mistral(), "sliding_window", bad));
  json mixtral = to_hf_config(model::model_preset("moe-tiny", 300));
  mixtral["sliding_window"] = mixtral["max_position_embeddings"].get<int64_t>() / 2;
  EXPECT_EQ(from_hf_config(mixtral, "cfg.json").max_seq, mixtral["sliding_window"].get<int64_t>());
  EXPECT_NE(error_of(with(hub_mistral(), "model_type", "qwen2")).find("expected gpt2, llama, mistral or mixtral"),
            std::string::npos);
}

struct Refused {
  std::string key;
  json value;
  std::string needle;
};

void expect_refused(const json& base, const std::vector<Refused>& cases) {
  for (const auto& c : cases) {
    const std::string e = error_of(with(base, c.key, c.value));
    SCOPED_TRACE(c.key + " = " + c.value.dump());
    EXPECT_EQ(e.rfind("cfg.json: field '" + c.key + "'", 0), 0u) << e;
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(HfConfig, Gpt2SettingsShardlmDoesNotImplementAreRefusedNamingFieldAndValue) {
  expect_refused(hub_gpt2(), {{"layer_norm_epsilon", 0.5, "is 0.5; shardlm's GPT-2 layer norm uses 1e-05"},
                              {"layer_norm_epsilon", -1, "must be a finite number > 0, got -1"},
                              {"layer_norm_epsilon", 1e300, "is 1e+300"},
                              {"layer_norm_epsilon", "small", "must be a number"},
                              {"scale_attn_by_inverse_layer_idx", true, "is true"},
                              {"scale_attn_weights", false, "is false"},
                              {"activation_function", "gelu", "'gelu'"},
                              {"tie_word_embeddings", false, "is false"},
                              {"n_ctx", 512, "is 512 but 'n_positions' is 1024"},
                              {"hidden_size", 1024, "is 1024 but 'n_embd' is 768"},
                              {"num_hidden_layers", 6, "is 6 but 'n_layer' is 12"},
                              {"resid_pdrop", 1.5, "must be a probability in [0, 1], got 1.5"},
                              {"attn_pdrop", -0.1, "got -0.1"},
                              {"initializer_range", -1, "got -1"},
                              {"add_cross_attention", true, "cross-attention"},
                              {"is_encoder_decoder", true, "decoder-only"},
                              {"pruned_heads", {{"0", {1}}}, "every head"},
                              {"n_inner", 3.5, "must be an integer, got 3.5"},
                              {"quantization_config", {{"quant_method", "gptq"}}, "is not a setting shardlm implements"},
                              {"scale_attn_weightz", true, "(true) is not a setting shardlm implements for model_type gpt2"}});
}

TEST(HfConfig, LlamaSettingsShardlmDoesNotImplementAreRefusedNamingFieldAndValue) {
  expect_refused(hub_llama(), {{"rms_norm_eps", 0, "must be a finite number > 0, got 0"},
                               {"rms_norm_eps", -1e-5, "got -1e-05"},
                               {"rope_theta", 0, "got 0"},
                               {"head_dim", 64, "is 64; shardlm's heads are hidden_size / num_attention_heads = 128 wide"},
                               {"attention_bias", true, "no biases"},
                               {"mlp_bias", true, "no biases"},
                               {"hidden_act", "gelu", "'gelu'"},
                               {"pretraining_tp", 0, ">= 1"},
                               {"attention_dropout", 2, "got 2"},
                               {"tie_word_embeddings", "yes", "must be true or false"},
                               {"rope_scaling", 8, "must be an object or null, got 8"}});
  // What is mapped and valid holds; head_dim equal to the real width passes.
  EXPECT_EQ(error_of(with(hub_llama(), "head_dim", 128)), "");
  EXPECT_EQ(from_hf_config(with(hub_llama(), "rms_norm_eps", 1e-6), "cfg.json").norm_eps, 1e-6);
}

// Llama 3.1 and later rescale the rotary frequencies for long context: config.json says so in
// "rope_scaling" (transformers 4) or "rope_parameters" (transformers 5, rope_theta inside); a
// scaling shardlm does not implement, or a description missing a field, is one line naming it.
TEST(HfConfig, Llama31RopeScalingIsReadInBothLayouts) {
  json hub31 = hub_llama();
  hub31["max_position_embeddings"] = 131072;
  hub31["eos_token_id"] = {128001, 128008, 128009};
  hub31["rope_scaling"] = {{"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 8192}, {"rope_type", "llama3"}};
  expect_same(from_hf_config(hub31, "cfg.json"), model::model_preset("llama3.1-8b"));
  json v5 = hub31;
  v5.erase("rope_scaling"), v5.erase("rope_theta");
  v5["rope_parameters"] = hub31["rope_scaling"];
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  expect_same(from_hf_config(v5, "cfg.json"), model::model_preset("llama3.1-8b"));
  json old_key = hub31;  // the key transformers read before "rope_type"
  old_key["rope_scaling"].erase("rope_type"), old_key["rope_scaling"]["type"] = "llama3";
  expect_same(from_hf_config(old_key, "cfg.json"), model::model_preset("llama3.1-8b"));
  json plain_v5 = hub_llama();
  plain_v5.erase("rope_theta"), plain_v5.erase("rope_scaling");
  plain_v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  expect_same(from_hf_config(plain_v5, "cfg.json"), model::model_preset("llama3-8b"));

  const auto refused = [&](json j, const std::string& want) {
    const std::string e = error_of(j);
    EXPECT_EQ(e, want);
  };
  json linear = hub_llama();
  linear["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  refused(linear, "cfg.json: field 'rope_scaling.type' is 'linear'; shardlm implements unscaled rotary embeddings "
                  "(\"default\") and Llama 3.1's (\"llama3\")");
  json missing = hub31;
  missing["rope_scaling"].erase("low_freq_factor");
  refused(missing, "cfg.json: no field 'rope_scaling.low_freq_factor'");
  json extra = hub31;
  extra["rope_scaling"]["attention_factor"] = 1.0;
  refused(extra, "cfg.json: field 'rope_scaling.attention_factor' (1.0) is not a setting shardlm implements for "
                 "model_type llama (nor one known not to change the model)");
  json theta = v5;
  theta["rope_theta"] = 10000.0;
  refused(theta, "cfg.json: field 'rope_parameters.rope_theta' is 500000.000000 but 'rope_theta' is 10000.000000");
  json inverted = hub31;
  inverted["rope_scaling"]["high_freq_factor"] = 0.5;
  refused(inverted, "cfg.json: model: rope_scaling needs 0 < low_freq_factor < high_freq_factor, got 1.000000 and 0.500000");
  json mixtral = to_hf_config(model::model_preset("moe-tiny", 300));
  mixtral["rope_scaling"] = hub31["rope_scaling"];
  refused(mixtral, "cfg.json: model: rope_scaling is LLaMA's (Llama 3.1); moe has none");
}

// train --model FILE: the file whole, a duplicated key refused (nlohmann kept the last).
TEST(HfConfig, ReadRefusesADuplicatedKey) {
  const auto p = std::filesystem::temp_directory_path() / ("shardlm_hf_config_" + std::to_string(::getpid()) + ".json");
  std::string text = to_hf_config(model::model_preset("tiny", 300)).dump();
  std::ofstream(p) << text.substr(0, text.size() - 1) << ", \"n_layer\": 200}";
  try {
    read_hf_config(p.string());
    ADD_FAILURE() << "read a config.json naming n_layer twice";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), p.string() + ": key 'n_layer' appears twice");
  }
  std::filesystem::remove(p);
}

// The tokenizer of a model directory without shardlm's field: GPT-2's where its files are there
// or the vocabulary is GPT-2's, bytes for 256 ids, LLaMA 3's for 128256, LLaMA 2's for a LLaMA's
// 32000 and Mistral's for a Mixtral's, else unknown (a LLaMA 2 model's 32000 SentencePiece ids were
// once taken for GPT-2's, and generate printed them as its text).
TEST(HfConfig, TheTokenizerIsWhatTheDirectorySays) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("shardlm_hf_tok_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto tokenizer_with = [&](json config) {
    std::ofstream(dir / "config.json") << config.dump();
    return read_hf_model(dir.string()).tokenizer;
  };
  json llama = hub_llama();
  EXPECT_EQ(tokenizer_with(llama), "llama3");
  llama["vocab_size"] = 32000;
  EXPECT_EQ(tokenizer_with(llama), "llama2");
  llama["vocab_size"] = 32001;
  EXPECT_EQ(tokenizer_with(llama), "unknown");
  json mixtral = llama;
  mixtral["model_type"] = "mixtral";
  mixtral["vocab_size"] = 32000;
  mixtral["num_local_experts"] = 8;
  mixtral["num_experts_per_tok"] = 2;
  EXPECT_EQ(tokenizer_with(mixtral), "mistral");
  EXPECT_EQ(tokenizer_with(hub_mistral()), "mistral");
  llama["vocab_size"] = 256;
  EXPECT_EQ(tokenizer_with(llama), "bytes");
  EXPECT_EQ(tokenizer_with(hub_gpt2()), "gpt2");
  llama["vocab_size"] = 32000;
  std::ofstream(dir / "vocab.json") << "{}";
  std::ofstream(dir / "merges.txt") << "";
  EXPECT_EQ(tokenizer_with(llama), "gpt2");  // GPT-2's BPE files are there
  llama["shardlm_tokenizer"] = "bytes";
  EXPECT_EQ(tokenizer_with(llama), "bytes");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardlm::ckpt
