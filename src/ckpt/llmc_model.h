// llm.c's GPT-2 model file (gpt2_124M.bin, and the model_NNNNNNNN.bin its training writes), read
// and written so that a model moves between llm.c and shardlm either way.
//
// The format (llm.c's train_gpt2.py write_model, train_gpt2.cu gpt2_build_from_checkpoint): a
// header of 256 int32 — magic 20240326, version 3 (fp32 parameters) or 5 (bf16), max_seq_len,
// vocab_size, num_layers, num_heads, channels, padded_vocab_size, the rest 0 — then every
// parameter, each kind for all layers at once, little-endian, in the order
//   wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C),
//   attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C),
//   fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C)
// with matrices (out, in) as nn.Linear holds them (shardlm's GPT-2 holds Conv1D's (in, out), as
// Hugging Face's does: they are transposed on the way). wte's rows past vocab_size are padding
// the model never reads: written as zeros, read as zeros whatever the file holds.
#pragma once

#include <string>

#include "model/model.h"

namespace shardlm::ckpt {

// Whether `path` is a regular file that starts as an llm.c model file does (its magic).
bool is_llmc_model(const std::string& path);

// The GPT-2 model the header describes (ffn 4C, tied head). Throws std::runtime_error with one
// line naming the file: not llm.c's magic, another version, header values out of range, or a
// file size other than the header's model needs.
model::ModelConfig read_llmc_config(const std::string& path);

// Fills `params` (laid out by `layout`, padding zero) with the file's weights for `desc`, which
// must be the model read_llmc_config describes. Non-finite values are refused naming the tensor.
void read_llmc_weights(const std::string& path, const model::ModelDesc& desc, const model::FlatLayout& layout,
                       float* params);

// Writes `params` as an llm.c model file at `path` (version 3 fp32, or 5 with bf16 = true),
// atomically: a temporary file beside it renamed over it once complete and synced. Only GPT-2
// models with ffn 4C have llm.c's layout; another is refused before anything is written.
void write_llmc_model(const std::string& path, const model::ModelDesc& desc, const model::FlatLayout& layout,
                      const float* params, bool bf16);

}  // namespace shardlm::ckpt
