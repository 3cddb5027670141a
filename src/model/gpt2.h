// The GPT-2 model as a description: configuration, units and their parameters, FLOP and
// activation counts. Nothing here computes; layers/ runs units, plan/ and sim/ reason about them.
//
// Dimension letters used throughout: B batch, T sequence, C channels (n_embd), NH heads,
// HS head size (C / NH), L layers, V vocabulary (token ids), Vp padded vocabulary (rows of wte).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::model {

struct ModelConfig {
  int64_t vocab_size = 50257;  // V
  int64_t n_layer = 6;         // L
  int64_t n_head = 6;          // NH
  int64_t n_embd = 384;        // C
  int64_t max_seq = 1024;      // rows of wpe; the largest T

  // wte carries extra zero rows so the head's GEMM has a friendly N; files that leave the
  // program carry V rows only.
  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int64_t head_size() const { return n_embd / n_head; }
  // Throws std::invalid_argument naming the offending field.
  void validate() const;
};

// Presets: "tiny" (smoke tests), "small" (6 x 384, 6 heads), "gpt2-124m" (12 x 768, 12 heads).
// Throws std::invalid_argument for an unknown name.
ModelConfig model_preset(const std::string& name, int64_t vocab_size = 50257);

enum class UnitKind { embedding, block, final_norm };

// How a parameter starts: normal(0, std) when std > 0, else the constant `value`.
struct ParamInit {
  float std = 0.0f;
  float value = 0.0f;
};

struct ParamSpec {
  std::string name;            // Hugging Face GPT-2 name, e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // as stored in this engine (wte has Vp rows)
  int64_t offset = 0;          // element offset inside the unit's flat buffer
  int64_t numel = 0;
  bool decay = false;          // AdamW weight decay applies (matrices and embeddings only)
  ParamInit init;
};

// The granule of sharding: all its parameters live in one flat buffer, in `params` order.
struct UnitDesc {
  UnitKind kind = UnitKind::block;
  int layer = -1;  // block index, -1 for embedding / final_norm
  std::string name;
  std::vector<ParamSpec> params;
  int64_t numel = 0;
  const ParamSpec& param(const std::string& suffix) const;  // by name suffix, e.g. "ln_1.weight"
};

struct ModelDesc {
  ModelConfig config;
  std::vector<UnitDesc> units;  // embedding, h.0 … h.{L-1}, final_norm

  int64_t num_params() const;  // every element of every unit, padded vocab rows included
  // Parameters a checkpoint holds (V rows of wte): the figure to quote for the model size.
  int64_t num_params_exported() const;
  // Training FLOPs (forward + backward) for B×T tokens: 6 × (matmul params) × tokens, where
  // the matmul params are all but wpe and the tied head counts its V rows once, plus causal
  // attention 6 × L × T × C × tokens (QK^T and AV, each 2 FLOPs a multiply-add, x3 for backward,
  // halved for the mask).
  double train_flops(int64_t B, int64_t T) const;
  // Bytes of forward activations kept for the backward (fp32), as layers/ stores them.
  int64_t activation_bytes(int64_t B, int64_t T) const;
};

ModelDesc describe(const ModelConfig& config);

// Where each unit sits in the model-wide flat buffers (params, grads, AdamW moments: the same
// layout for all). Each unit is padded to a multiple of `shard_multiple` elements so it splits
// into equal, aligned shards; padding elements are zero and never trained.
struct UnitSpan {
  int64_t offset = 0;  // start of the unit in the flat buffer
  int64_t numel = 0;   // real elements
  int64_t padded = 0;  // numel rounded up
};

struct FlatLayout {
  std::vector<UnitSpan> units;
  int64_t total = 0;  // sum of padded sizes
};

// world_size ranks; every unit is padded to a multiple of 16 × world_size elements (64-byte
// aligned shards).
FlatLayout flat_layout(const ModelDesc& desc, int64_t world_size = 1);

}  // namespace shardlm::model
