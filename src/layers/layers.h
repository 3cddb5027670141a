// Forward, backward and recompute of each kind of unit, composed from the kernels of a
// kernels::Backend: a table keyed by model::UnitKind. A unit's parameters (and, in the same
// layout, its gradients) are one flat buffer; its activations and scratch are the plan's
// buffers, which each kind carves into named slices (64-byte aligned) exactly as large as the
// model's costs say. Backward passes accumulate (+=) into gradient buffers, so gradient
// accumulation and a tied head need no special cases.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "model/model.h"

namespace shardlm::layers {

// What a step's mixture-of-experts layers report, summed over this rank's routing groups
// (micro-batches) and MoE layers. The losses are weighted by UnitArgs::group_weight, so summed over
// the data-parallel ranks they are the step's mean over routing groups (of the sum over layers).
struct MoeStats {
  double aux_loss = 0;  // load-balancing loss, before its coefficient
  double z_loss = 0;    // router z-loss, before its coefficient
  int64_t routed = 0;   // (token, slot) assignments
  int64_t dropped = 0;  // of them, over an expert's capacity
  int64_t min_load = -1, max_load = -1;  // tokens one expert took in one group (-1: no MoE layer ran)
  // Per routing (one MoE block's forward over one group): its busiest expert's tokens over the
  // mean, Σ over routings, and how many (the figure --moe-imbalance takes from a run is their mean).
  double imbalance_sum = 0;
  int64_t routings = 0;
  void add(const MoeStats& o);
};

// What one task of a unit reads and writes, resolved by the executor from the plan's buffers.
// Pointers a task does not use are null.
struct UnitArgs {
  const kernels::Backend* backend = nullptr;  // every kernel call goes through it
  const model::ModelDesc* desc = nullptr;
  const model::UnitDesc* unit = nullptr;
  int64_t B = 0, T = 0;  // T: the rows of each sequence this rank holds (the sequence is T · cp long)
  // Ranks each sequence is split over (model::Shape::cp), this rank's place among them and how the
  // attention runs over the split: which positions the rank's rows hold
  // (model::context_chunk_starts). A block's pass over cp > 1 ranks runs as stages.
  int cp = 1, cp_index = 0;
  model::ContextImpl cp_impl = model::ContextImpl::ring;
  int threads = 1;
  const float* params = nullptr;           // the unit's whole parameters
  float* grads = nullptr;                  // the unit's whole gradients
  const float* borrowed_params = nullptr;  // the unit it borrows (the tied head: the embedding)
  float* borrowed_grads = nullptr;
  const int32_t* tokens = nullptr;   // (B, T)
  const int32_t* targets = nullptr;  // (B, T), < 0: ignored
  const char* batch = nullptr;       // the batch value's bytes (a model laying out samples, model::DitSample, reads these)
  const float* in = nullptr;         // (B, T, C) residual stream in
  float* out = nullptr;              // (B, T, C) residual stream out
  char* saved = nullptr;
  char* recomputable = nullptr;
  char* forward_ws = nullptr;
  char* backward_ws = nullptr;
  float* dx = nullptr;  // (B, T, C): d(out) on entry to a backward, d(in) on return
  float grad_scale = 1.0f;
  // A staged unit (model::UnitCosts::exchanges): the stage this task runs (-1: the whole pass),
  // the routed rows it reads (what the exchange before it delivered) and writes (for the exchange
  // after it; a header of byte counts per rank, model::exchange_header_bytes, then the payloads),
  // and the ranks its exchanges span: `peers` of them, this one at index `peer`.
  int stage = -1;
  const char* recv = nullptr;
  char* send = nullptr;
  int peers = 1, peer = 0;
  // 1 / the routing groups of the step (data-parallel ranks × micro-steps): the weight of one
  // micro-batch's MoE auxiliary losses in the step's objective.
  float group_weight = 1.0f;
  MoeStats* moe = nullptr;  // a forward of a MoE block adds its routing's figures (null: not kept)
  float* logits = nullptr;  // (V): logits of the last position of sequence 0 (Op::logits),
  bool all_logits = false;  // or with all_logits (B, T, V): every row's
  // Activation compression (model::ActQuant) under the plan's recompute mode, which decides what
  // is kept (so compressed). quant_key: stochastic rounding's key for this unit's pass, a hash of
  // (seed, step, micro-step, unit) from the executor; each tensor mixes its name in.
  model::ActQuant act_quant{};
  model::Recompute recompute = model::Recompute::none;
  uint64_t quant_key = 0;
};

enum class HeadMode { train, loss, logits };

// A head's vocabulary half, after its final norm wrote `normed` (B·T, C): by `mode`, the logits
// (into args.logits: every row with args.all_logits, else the last), the summed loss, or in training
// the loss with d normed into `dnormed` (zeroed here) and weight's gradient into `dweight`. The
// weight is (Vp, C), `logits_ws` the backend's head_scratch(model::detail::head_chunk_rows(B·T)).
double vocabulary_pass(const UnitArgs& a, HeadMode mode, const float* normed, const float* weight, float* dweight,
                       float* dnormed, float* logits_ws);

// Bytes a kind carves from each of its buffers for one micro-batch; must equal model's costs.
struct Carved {
  int64_t saved = 0, recomputable = 0, forward_ws = 0, backward_ws = 0;
};

struct LayerKind {
  // Writes args.out and fills saved + recomputable (both allocated).
  void (*forward)(const UnitArgs&) = nullptr;
  // Rebuilds what `mode` dropped: recomputable (selective) or saved + recomputable (full).
  void (*recompute)(const UnitArgs&, model::Recompute mode) = nullptr;
  // Consumes args.dx (d out) and leaves d in there; accumulates into grads.
  void (*backward)(const UnitArgs&) = nullptr;
  // Heads: forward + loss (+ backward into dx and grads when training); returns the summed loss.
  double (*head)(const UnitArgs&, HeadMode mode) = nullptr;
  // What it carves when its kernels run on `backend` (scratch sizes are the backend's).
  Carved (*carved)(const kernels::Backend& backend, const model::ModelDesc&, const model::UnitDesc&,
                   const model::Shape&) = nullptr;
};

const LayerKind& layer(model::UnitKind kind);

// Initialises elements [begin, end) of a unit's flat buffer into dst (dst[0] is element begin).
// Each value depends on (seed, parameter name, element index) alone, so any sharding of the
// flat buffer, on any number of ranks, yields the same model. Rows past the real vocabulary and
// the unit's tail padding stay zero.
void init_unit(const model::UnitDesc& u, uint64_t seed, float* dst, int64_t begin, int64_t end);

// Hands out consecutive, 64-byte aligned slices of one buffer; with a null base it only measures.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <class T>
  T* take(int64_t n) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (n * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    return p;
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

// A GEMM input kept from the forward for the backward: fp32 in its buffer (f), or under
// --act-quant int8 values and their scales in the buffer while its fp32 form lives in scratch
// (f, pointed there by the kind) only as long as the pass that writes or reads it needs it.
struct Kept {
  float* f = nullptr;
  int8_t* q = nullptr;
  float* scales = nullptr;
  int64_t n = 0, group = 0;  // group 0: fp32
  bool quantized() const { return group > 0; }
};
// Carves n values, as model::detail::kept_input sizes them.
Kept take_kept(Carver& cv, int64_t n, int64_t group);
// The first n values of k (whole groups: n a multiple of its group), as a Kept of their own: a
// buffer sized for a bound whose rows in use vary (a MoE expert side's received rows).
Kept first_values(const Kept& k, int64_t n);
// The forward's fp32 values (k.f) into their int8 form; nothing when k is fp32. `name` keys the
// stochastic draws apart from the unit's other tensors.
void store(const UnitArgs& a, const Kept& k, const char* name);
// The fp32 values for the backward: k.f itself, or dequantized into `scratch` (n floats).
const float* load(const UnitArgs& a, const Kept& k, float* scratch);

// The architecture files' tables.
LayerKind gpt2_embedding_kind();
LayerKind gpt2_block_kind();
LayerKind gpt2_head_kind();
LayerKind llama_embedding_kind();
LayerKind llama_block_kind();
LayerKind llama_head_kind();
LayerKind moe_block_kind();
LayerKind moe_experts_kind();
LayerKind dit_embedding_kind();
LayerKind dit_block_kind();
LayerKind dit_head_kind();

}  // namespace shardlm::layers
