// A model as a Hugging Face directory, the layout `from_pretrained` loads as is:
//   config.json                        GPT2Config / LlamaConfig / MixtralConfig keys (hf_config.h),
//                                      torch_dtype
//   model.safetensors                  every tensor under its Hugging Face name, F32 or BF16,
//                                      "__metadata__": {"format": "pt"} — when all of them fit in
//                                      max_shard_bytes; otherwise
//   model-0000i-of-0000n.safetensors   the tensors in model order, a new file whenever the next
//                                      tensor would pass max_shard_bytes (a larger tensor gets a
//                                      file of its own), as huggingface_hub splits them, and
//   model.safetensors.index.json       {"metadata": {"total_size": tensor bytes},
//                                       "weight_map": {name: file}}
//   vocab.json, merges.txt             for the gpt2 tokenizer: its encoder.json and vocab.bpe,
//                                      the files GPT2Tokenizer reads under these names
//   tokenizer.json                     for any other tokenizer but bytes (llama3, mistral, ...): the
//                                      file it was read from
//   tokenizer_config.json,             GPT2Tokenizer and <|endoftext|> as bos/eos/unk; others:
//   special_tokens_map.json            PreTrainedTokenizerFast, bos and eos as HfExportOptions gives
//                                      them (the tokenizer's own)
// The directory is written atomically (write_dir_atomically): a good one is never replaced by a
// half-written one, and an existing one only when HfExportOptions::overwrite says so.
#pragma once

#include <cstdint>
#include <string>

#include "model/model.h"

namespace shardlm::ckpt {

struct HfExportOptions {
  std::string dtype = "fp32";                  // fp32 | bf16 (rounded to nearest even)
  uint64_t max_shard_bytes = 5'000'000'000;    // Hugging Face's default "5GB"
  // The checkpoint's tokenizer name; train::export_hf reads the checkpoint's own where it is "".
  std::string tokenizer;
  // The gpt2 tokenizer's files (data_dir/gpt2/encoder.json and vocab.bpe); only read when
  // `tokenizer` is gpt2.
  std::string encoder_json, vocab_bpe;
  // The tokenizer.json of any other tokenizer but bytes (the checkpoint's own, else
  // data_dir/NAME/tokenizer.json); only read when `tokenizer` is such a one.
  std::string tokenizer_json;
  // That tokenizer's first and end tokens (data::Tokenizer::bos() and end_tokens()[0], loaded by
  // the caller: ckpt does not read tokenizers), for tokenizer_config.json, special_tokens_map.json
  // and config.json's bos_token_id / eos_token_id; id -1: the tokenizer has none.
  struct SpecialToken {
    std::string text;
    int64_t id = -1;
  };
  SpecialToken bos, eos;
  // An existing non-empty out_dir is replaced (once the new one is complete) only when true;
  // otherwise the export fails and leaves it as it was.
  bool overwrite = false;
};

// Whether a checkpoint's tokenizer exports as a tokenizer.json (every named one but gpt2, which
// has vocab.json and merges.txt, and bytes and unknown, which have no Hugging Face files).
bool exports_tokenizer_json(const std::string& tokenizer);

// "5GB" (10^9), "500MB", "64KiB" (2^10), "1234" (bytes), as huggingface_hub parses
// max_shard_size. Throws std::invalid_argument "--max-shard-size: …" for anything else or 0.
uint64_t parse_size(const std::string& text);

// What write_hf_dir wrote, for the command's summary line.
struct HfExportSummary {
  int files = 1;             // safetensors files
  uint64_t total_size = 0;   // tensor bytes
  std::string tokenizer_files;  // the tokenizer's files written ("vocab.json, merges.txt"), "" for none
  std::string tokenizer_note;   // why no tokenizer files were written, where none were
};

// Writes `params` (flat buffers laid out by `layout`, as gather_full produces them) as a Hugging
// Face directory `out_dir`. A tokenizer whose files are missing is an error naming them; the bytes
// tokenizer has no Hugging Face files, which the summary notes. A
// mixture-of-experts model is Mixtral's names and layout (each expert's w1, w3, w2 a tensor of
// its own); one with dense blocks between its MoE blocks (moe_every > 1) has no Hugging Face
// model type and is refused before anything is written.
HfExportSummary write_hf_dir(const std::string& out_dir, const model::ModelDesc& desc,
                             const model::FlatLayout& layout, const float* params, const HfExportOptions& opt);

// Round to nearest even, as PyTorch's .to(torch.bfloat16) does; NaN stays NaN.
uint16_t to_bf16(float x);

}  // namespace shardlm::ckpt
