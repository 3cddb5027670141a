// Reading a Hugging Face model directory (GPT-2 or LLaMA): config.json (hf_config.h) and the
// weights of model.safetensors, or of the files model.safetensors.index.json's weight_map names.
// Tensors may be F32, BF16 or F16 (widened to fp32). Names are the model's Hugging Face names;
// what transformers' save_pretrained adds is accepted too: GPT-2's "transformer." prefix, the
// tied lm_head.weight, attention-mask buffers (attn.bias, attn.masked_bias) and LLaMA's
// rotary_emb.inv_freq, which are ignored. Every error is one line naming the file and tensor.
#pragma once

#include <string>

#include "model/model.h"

namespace shardlm::ckpt {

struct HfModel {
  model::ModelConfig config;
  // config.json's shardlm_tokenizer; else "gpt2" where vocab.json and merges.txt are there or
  // the vocabulary is GPT-2's (50257, or 50304 padded), "bytes" for a vocabulary of 256,
  // "llama3" for 128256, else "unknown" (generate refuses the last two, naming them).
  std::string tokenizer;
};

// What a vocabulary's size says of its tokenizer where nothing else does: "bytes" (256), "gpt2"
// (50257, or nanoGPT's padded 50304), "llama3" (128256), else "unknown".
std::string tokenizer_of_vocabulary(int64_t vocab_size);

// DIR/config.json. Throws naming the file and field (an unknown model_type among them).
HfModel read_hf_model(const std::string& dir);

// Fills `params` (laid out by `layout`, padding zero) with the directory's weights for `desc`.
// Refuses a missing tensor, a wrong shape, a tensor the model does not have, a dtype other than
// F32/BF16/F16 and non-finite values.
void read_hf_weights(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     float* params);

}  // namespace shardlm::ckpt
