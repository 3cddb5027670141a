// Forward and backward of each kind of GPT-2 unit, composed from kernels. A unit's parameters
// (and, in the same layout, its gradients) are one flat buffer; the functions here take views
// into it. Backward passes accumulate (+=) into gradient buffers, so gradient accumulation and
// the tied embedding/head need no special cases.
#pragma once

#include <cstdint>

#include "model/gpt2.h"
#include "tensor/memory.h"

namespace shardlm::layers {

struct Dims {
  int64_t B, T, C, NH, V, Vp;
  int64_t BT() const { return B * T; }
};
Dims dims_of(const model::ModelConfig& c, int64_t B, int64_t T);

// Named views into a unit's flat buffer (parameters or gradients, identical layout).
struct EmbeddingView {
  float* wte;  // (Vp, C)
  float* wpe;  // (maxT, C)
};
struct BlockView {
  float *ln1_w, *ln1_b;      // (C)
  float *qkv_w, *qkv_b;      // (C, 3C), (3C)
  float *proj_w, *proj_b;    // (C, C), (C)
  float *ln2_w, *ln2_b;      // (C)
  float *fc_w, *fc_b;        // (C, 4C), (4C)
  float *fcproj_w, *fcproj_b;  // (4C, C), (C)
};
struct FinalNormView {
  float *lnf_w, *lnf_b;  // (C)
};
EmbeddingView embedding_view(const model::UnitDesc& u, float* flat);
BlockView block_view(const model::UnitDesc& u, float* flat);
FinalNormView final_norm_view(const model::UnitDesc& u, float* flat);

// What one block's forward keeps for its backward. `out` is the block's output (the next
// block's input).
struct BlockActivations {
  float* ln1;                   // (B, T, C)
  float *ln1_mean, *ln1_rstd;   // (B, T)
  float* qkv;                   // (B, T, 3C)
  float* atty;                  // (B, T, C) attention output before the projection
  float* lse;                   // (B, NH, T)
  float* res1;                  // (B, T, C) residual after attention
  float* ln2;                   // (B, T, C)
  float *ln2_mean, *ln2_rstd;   // (B, T)
  float* fch;                   // (B, T, 4C) before GELU
  float* fch_gelu;              // (B, T, 4C)
  float* out;                   // (B, T, C) residual after the MLP
};

// Every forward activation of the whole model for one (B, T), in one buffer charged to
// `activations`. Sized exactly by ModelDesc::activation_bytes.
class Activations {
 public:
  Activations(const model::ModelDesc& desc, int64_t B, int64_t T);
  int32_t* inputs;   // (B, T)
  int32_t* targets;  // (B, T)
  float* embedded;   // (B, T, C)
  BlockActivations& block(int l) { return blocks_[l]; }
  float* lnf;                  // (B, T, C)
  float *lnf_mean, *lnf_rstd;  // (B, T)
  int64_t B, T;

 private:
  Buffer buffer_;
  std::vector<BlockActivations> blocks_;
};

// Scratch for the backward of one block at a time, plus the fused head's logits chunk: charged
// to `workspace`. `dresidual` carries the gradient of the residual stream between units.
class BackwardWorkspace {
 public:
  BackwardWorkspace(const model::ModelDesc& desc, int64_t B, int64_t T, int threads);
  float* dresidual;  // (B, T, C)
  float* dln;        // (B, T, C)
  float* datty;      // (B, T, C)
  float* dqkv;       // (B, T, 3C)
  float* dfch;       // (B, T, 4C)
  float* dfch_gelu;  // (B, T, 4C)
  float* attention_scratch;
  float* head_scratch;
  int64_t head_chunk;

 private:
  Buffer buffer_;
};

void embedding_forward(const EmbeddingView& p, const int32_t* tokens, float* out, const Dims& d);
void embedding_backward(const EmbeddingView& g, const int32_t* tokens, const float* dout, const Dims& d);

void block_forward(const BlockView& p, const float* in, BlockActivations& a, const Dims& d);
// dresidual: gradient w.r.t. the block's output on entry, w.r.t. its input on return.
void block_backward(const BlockView& p, const BlockView& g, const float* in, const BlockActivations& a,
                    BackwardWorkspace& ws, const Dims& d);

void final_norm_forward(const FinalNormView& p, const float* in, Activations& acts, const Dims& d);
// The head tied to wte, fused with the loss: returns the summed cross-entropy of the batch.
// With grads (training), writes d(loss * grad_scale)/d(final norm input) into ws.dresidual
// (overwriting it) and accumulates the final norm's and wte's gradients.
double head_loss(const FinalNormView& p, const EmbeddingView& emb, const float* in, Activations& acts,
                 const Dims& d, BackwardWorkspace& ws, const FinalNormView* g, const EmbeddingView* emb_g,
                 float grad_scale);

// Initialises elements [begin, end) of a unit's flat buffer into dst (dst[0] is element begin).
// Each value depends on (seed, parameter name, element index) alone, so any sharding of the
// flat buffer, on any number of ranks, yields the same model. Padding vocab rows and the
// unit's tail padding stay zero.
void init_unit(const model::UnitDesc& u, const model::ModelConfig& cfg, uint64_t seed, float* dst,
               int64_t begin, int64_t end);

}  // namespace shardlm::layers
