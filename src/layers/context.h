// Internal to layers/: a block's attention over a sequence split among the cp ranks, shared by every
// block kind (GPT-2, LLaMA, MoE). In the all-to-all form (DeepSpeed-Ulysses) the block's pass runs as three
// stages with two exchanges over cp between them:
//   stage 0  norm, q|k|v (rotated where the model rotates)   send: each rank its heads' q|k|v
//   stage 1  attention over the whole sequence, NH/cp heads   send: each rank its rows' outputs
//   stage 2  the attention output (all heads, own rows), projection, MLP
// and the backward in reverse. A rank holds `T` consecutive positions of each sequence (rank i:
// i·T ..), so after the first exchange its rows are the sequence in order. Exchange buffers are
// model::Exchange's: a header of one int64 per rank (the payload's bytes), then the payloads.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/backend.h"
#include "layers/layers.h"

namespace shardlm::layers::context {

// The positions of this rank's rows of a sequence: model::context_chunk_starts as kernels take it.
struct Positions {
  std::vector<int64_t> starts;
  int64_t rows = 0;
  kernels::SeqChunks chunks() const { return {static_cast<int64_t>(starts.size()), rows, starts.data()}; }
};
Positions positions(const UnitArgs& a);

// The model's rotary frequencies as the kernels take them.
kernels::Rope rope_of(const model::ModelConfig& c);

// Rotates (back: rotates back) q and k of this rank's rows of qkv (B, T, width, the q and k heads
// first, `heads` of them) at their positions in the sequence; `table` holds every position.
void rotate(const kernels::Backend& be, float* qkv, const UnitArgs& a, int64_t width, int64_t heads, int64_t HS,
            const float* table, bool back);

struct Split {
  int P = 1, me = 0;                 // cp ranks, this one's index
  int64_t B = 0, T = 0;              // sequences, rows of each this rank holds (T·P positions)
  int64_t NH = 0, NKV = 0, HS = 0;   // heads of the whole model
  bool causal = true;                // model::ModelConfig::causal
  int64_t heads() const { return NH / P; }                  // query heads a rank attends with
  int64_t kv_heads() const { return NKV / P; }
  int64_t qkv() const { return (NH + 2 * NKV) * HS; }       // q|k|v row width, all heads
  int64_t qkv_split() const { return qkv() / P; }           // q|k|v row width, a rank's heads
  int64_t out_split() const { return heads() * HS; }        // attention output width, a rank's heads
};
Split split_of(const UnitArgs& a);

// Forward. Stage 0: this rank's rows of q|k|v (B, T, qkv) to every rank, its heads' columns.
void send_qkv(const kernels::Backend& be, char* send, const float* qkv, const Split& s);
// Stage 1: q|k|v of the whole sequence for this rank's heads (B, T·P, qkv_split), its attention
// output (B, T·P, out_split) and lse (B, heads, T·P); the output back to the ranks holding its rows.
void attention_forward(const kernels::Backend& be, float* qkv_split, float* out_split, float* lse, const char* recv,
                       char* send, const Split& s);
// Stage 2: the attention output of this rank's rows, all heads (B, T, NH·HS).
void take_outputs(const kernels::Backend& be, float* out, const char* recv, const Split& s);

// Backward. Stage 2: d attention output (B, T, NH·HS) to every rank, its heads' columns.
void send_output_grads(const kernels::Backend& be, char* send, const float* dout, const Split& s);
// Stage 1: the head split's d q|k|v (B, T·P, qkv_split, zeroed here) back to the ranks holding its
// rows; dout_split (B, T·P, out_split) is scratch, scratch the backend's attention scratch.
void attention_backward(const kernels::Backend& be, float* dqkv_split, float* dout_split, const float* qkv_split,
                        const float* out_split, const float* lse, const char* recv, char* send, float* scratch,
                        const Split& s);
// Stage 0: d q|k|v of this rank's rows, all heads (B, T, qkv).
void take_qkv_grads(const kernels::Backend& be, float* dqkv, const char* recv, const Split& s);

// ---- The ring form (load-balanced ring attention)
//
// A rank holds chunks `me` and 2P−1−me of each sequence (model::context_chunk_starts). Its block's
// forward runs as P + 1 stages: stage 0 is the norm and q|k|v, and stage s ≥ 1 attends this rank's
// queries to the key/value block of rank me − (s − 1) (its own at s = 1), partial outputs merged by
// their log-sum-exp, while the ring brings the next block (rank me + 1 gets what this rank had).
// The backward attends to the same blocks in reverse, from the one the forward attended last (kept)
// down to the rank's own. Keys and values and the blocks' gradient accumulators travel to rank
// me − 1 on two chains, each step beside a computing stage (model::ring_backward_stage). Ring
// buffers hold B·T rows of k|v or of d k|v.
struct Ring {
  int P = 1, me = 0;
  int64_t B = 0, T = 0;                      // sequences, rows of each this rank holds
  int64_t NH = 0, NKV = 0, HS = 0;           // heads of the whole model
  std::vector<std::vector<int64_t>> starts;  // per rank: its chunks' first positions
  int64_t rows = 0;                          // positions in a chunk
  bool causal = true;                        // model::ModelConfig::causal
  int64_t kv() const { return 2 * NKV * HS; }
  int64_t qkv() const { return (NH + 2 * NKV) * HS; }
  int block(int stage) const { return (me - (stage - 1) + P) % P; }  // whose key/values stage ≥ 1 uses
  kernels::SeqChunks chunks(int rank) const { return {static_cast<int64_t>(starts[rank].size()), rows, starts[rank].data()}; }
};
Ring ring_of(const UnitArgs& a);

// Forward stage `stage` ≥ 1 (stage 0, q|k|v, is the block's): out (B, T, NH·HS) and lse (B, NH, T)
// of this rank's queries in qkv (B, T, qkv, rotated) over the blocks so far. Stage 1 attends to its
// own key/values; later stages to the block in `recv`, and the last keeps it in kv_last (B, T, kv).
void ring_forward(const kernels::Backend& be, float* out, float* lse, const float* qkv, const char* recv,
                  float* kv_last, int stage, const Ring& r);
// Stage 0's part: this rank's own k|v rows into `send`, the ring's first block.
void ring_send_own(const kernels::Backend& be, char* send, const float* qkv, const Ring& r);
// The backward, stage by stage (model::ring_backward_stage):
// send_kept: the key/value block the forward kept (B, T, kv) into `send`, for rank me − 1.
void ring_send_kept(const kernels::Backend& be, char* send, const float* kv_last, const Ring& r);
// compute t: d q (dqkv's q columns, (B, T, qkv); zeroed first at t = P) += this rank's queries'
// share over block t, and the block's d k|v: fresh rows (B, T, kv) in `send` for t ≥ 2, or, at
// t = 1, into dqkv's k|v columns. Block t's keys and values: the kept block at t = P, `recv` for
// 1 < t < P, this rank's own at t = 1. dout (B, T, NH·HS); scratch the backend's attention scratch.
void ring_backward_block(const kernels::Backend& be, float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, const float* kv_last, const char* recv, char* send, float* scratch, int t,
                         const Ring& r);
// fold: `send` (this rank's d k|v of the block) += `recv` (the other ranks' so far).
void ring_backward_fold(const kernels::Backend& be, char* send, const char* recv, const Ring& r);
// home: dqkv's k|v columns += `recv`, the other ranks' d k|v of this rank's own block.
void ring_backward_home(const kernels::Backend& be, float* dqkv, const char* recv, const Ring& r);
// Backward stage a.stage of a block whose attention output is `out` (its gradient `dout`), the
// pieces above in their order; `mlp` (the block's part after the attention, which writes dout)
// runs first at compute P, `qkv` (q|k|v's backward, reading dqkv) after home.
void ring_backward_stage(const UnitArgs& a, float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, const float* kv_last, float* scratch, const std::function<void()>& mlp,
                         const std::function<void()>& qkv_backward);
// The same for a block that keeps q|k|v and its attention output as `Kept` (--act-quant): compressed,
// `mlp` leaves the attention output dequantized in `out_scratch` (as the block's o backward reads
// it) and q|k|v is dequantized into `qkv_scratch` after it, both read there by every later block
// (the backward scratch lives until the pass's last stage).
void ring_backward_stage(const UnitArgs& a, float* dqkv, const float* dout, const Kept& qkv, const Kept& out,
                         float* qkv_scratch, const float* out_scratch, const float* lse, const float* kv_last,
                         float* scratch, const std::function<void()>& mlp, const std::function<void()>& qkv_backward);

// ---- A block's attention stages over cp, in either form, written once for every block kind
//
// A kind's pass over cp > 1 ranks is its own computation before the attention (norm and q|k|v) and
// after it (projection, MLP, routing), around the stages above. These run the stage a.stage of that
// pass; the kind supplies its buffers and its parts before and after.
struct SplitAttention {
  Kept qkv;                    // q|k|v kept for the backward (ring: this rank's rows; heads split: its heads')
  Kept atty;                   // (B, T, NH·HS) attention output of this rank's rows, all heads
  float* lse = nullptr;        // ring (B, NH, T); heads split (B, NH / P, T·P)
  float* out_split = nullptr;  // heads split: this rank's heads' attention output (B, T·P, NH·HS / P)
  float* kv_last = nullptr;    // ring: the last key/value block the forward attended to (B, T, kv)
  float* qkv_rows = nullptr;   // heads split: stage 0's q|k|v of this rank's rows (forward scratch)
};
// The forward stages that run the attention: stage 0 calls `qkv(dst)` (the kind's norm and q|k|v,
// rotated where the model rotates, into dst (B, T, qkv)), and the last calls `rest` once the
// attention output is in atty.f (fp32) and q|k|v is stored; `rest` stores atty as it keeps it.
void split_forward(const UnitArgs& a, const SplitAttention& s, const std::function<void(float*)>& qkv,
                   const std::function<void()>& rest);

struct SplitAttentionGrads {
  float* dqkv = nullptr;        // (B, T, qkv) d q|k|v of this rank's rows, read by `qkv_backward`
  float* datty = nullptr;       // (B, T, NH·HS) d attention output, written by `after`
  float* dout_split = nullptr;  // heads split: scratch for the head split's d output
  float* dqkv_split = nullptr;  // heads split: scratch for the head split's d q|k|v
  float* wide = nullptr;        // --act-quant: where q|k|v is dequantized
  float* narrow = nullptr;      // --act-quant: where `after` leaves the attention output dequantized
  float* scratch = nullptr;     // the backend's attention scratch
};
// The backward stage a.stage of the attention: `after` (the kind's backward from d out to
// d attention output, in datty) runs at the first, `qkv_backward` (from d q|k|v to d in) at the last.
void split_backward(const UnitArgs& a, const SplitAttention& s, const SplitAttentionGrads& w,
                    const std::function<void()>& after, const std::function<void()>& qkv_backward);

}  // namespace shardlm::layers::context
