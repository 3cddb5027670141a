// A model as a description: configuration, units with their parameters, the residual-stream
// values they read and write, and their costs. Nothing here computes; layers/ runs units, plan/
// and sim/ reason about them. Architecture files (gpt2.cc, llama.cc) only fill this in; no FLOP
// or byte formula lives outside model/.
//
// Dimension letters used throughout: B batch, T sequence, C channels (n_embd), NH query heads,
// NKV key/value heads, HS head size (C / NH), F MLP width (ffn_dim), L layers, V vocabulary
// (token ids), Vp padded vocabulary (rows of the embedding and of an untied head); mixture of
// experts: E experts, k experts per token (top_k), FE an expert's width (moe_ffn_dim), R routed
// rows of a micro-batch (at most B·T·k).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::model {

enum class Family { gpt2, llama, moe, dit };
const char* to_string(Family f);

struct ModelConfig {
  Family family = Family::gpt2;
  int64_t vocab_size = 50257;  // V
  int64_t n_layer = 6;         // L
  int64_t n_head = 6;          // NH
  int64_t n_kv_head = 6;       // NKV (GPT-2: NH)
  int64_t n_embd = 384;        // C
  int64_t ffn_dim = 1536;      // F (GPT-2: 4C)
  int64_t max_seq = 1024;      // the largest T (rows of wpe for GPT-2)
  double rope_theta = 10000;   // LLaMA
  // Llama 3.1's rescaled rotary frequencies (config.json "rope_scaling" of "rope_type" "llama3";
  // kernels/rope.h has the formula). factor 0: none, as LLaMA 1-3; LLaMA only.
  struct RopeScaling {
    double factor = 0;
    double low_freq_factor = 1, high_freq_factor = 4;
    int64_t original_max_seq = 8192;  // the context the model was first trained at
    bool operator==(const RopeScaling&) const = default;
  } rope_scaling;
  double norm_eps = 1e-5;      // LLaMA's RMSNorm (GPT-2's layer norm uses 1e-5 always)
  bool tie_embeddings = true;  // the head reuses the token embedding (GPT-2: always)
  // Attention masks the positions after a query's (the language models); false: every position
  // sees every other, with and without context parallelism (a diffusion transformer's blocks).
  bool causal = true;

  // Sparse mixture of experts (family moe only; 0 elsewhere). A MoE block replaces the SwiGLU MLP
  // of every moe_every-th block (blocks moe_every-1, 2·moe_every-1, ...; 1: every block, as
  // Mixtral) by a router over n_experts SwiGLU experts of width moe_ffn_dim, top_k per token.
  int64_t n_experts = 0;          // E
  int64_t top_k = 0;              // k
  int64_t moe_ffn_dim = 0;        // FE
  int64_t moe_every = 1;
  bool norm_topk = true;          // renormalise the k routing weights to sum 1 (Mixtral); false: Switch
  double capacity_factor = 0;     // 0: dropless; else an expert takes ceil(cf·tokens·k/E) of a group
  double aux_loss_coef = 0.01;    // Switch load-balancing loss (1 at perfect balance)
  double z_loss_coef = 0.001;     // ST-MoE router z-loss

  // Diffusion transformer (family dit only; 0 elsewhere): latents of `frames` x `height` x `width`
  // x `channels` (a still image is one frame), laid out channels first (C, F, H, W) as PyTorch's
  // Conv3d takes them, cut into patches of patch_f x patch_h x patch_w, one token each (max_seq is
  // their count); `num_classes` labels and one more class embedding row, the null class (label
  // num_classes) that classifier-free guidance samples with; `cond_drop` the probability a
  // training sample's label is replaced by it.
  int64_t frames = 0, height = 0, width = 0, channels = 0;
  int64_t patch_f = 0, patch_h = 0, patch_w = 0;
  int64_t num_classes = 0;
  double cond_drop = 0;

  bool is_moe_layer(int64_t l) const { return family == Family::moe && (l + 1) % moe_every == 0; }
  // Rows a routing group of `tokens` tokens sends to one expert at most (capacity mode), or
  // tokens when dropless.
  int64_t expert_capacity(int64_t tokens) const;
  // Routed rows of `tokens` tokens of a routing group of `group` tokens (0: the same; more when
  // context parallelism splits a group's sequences) at most: what the dispatch buffers are sized for.
  int64_t routed_rows_bound(int64_t tokens, int64_t group = 0) const;
  // Rows the E / ranks experts of one rank of an expert-parallel group of `ranks` can receive at
  // most from the group's ranks, each routing `tokens` tokens of a routing group of `group`.
  int64_t expert_rows_bound(int64_t tokens, int64_t ranks, int64_t group = 0) const;
  // The embedding (and an untied head) carry extra zero rows so the head's GEMM has a friendly
  // N; files that leave the program carry V rows only.
  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int64_t head_size() const { return n_embd / n_head; }
  // A DiT's tokens per sample (patches), values per patch (patch_f·patch_h·patch_w·channels) and
  // values per sample's latents (channels·frames·height·width).
  int64_t patch_tokens() const;
  int64_t patch_values() const { return patch_f * patch_h * patch_w * channels; }
  int64_t latent_values() const { return channels * frames * height * width; }
  // Throws std::invalid_argument naming the offending field.
  void validate() const;
  void validate_moe() const;
  void validate_rope_scaling() const;
  void validate_dit() const;
};

// The width of a DiT's sinusoidal timestep features, before the timestep MLP (the DiT paper's).
inline constexpr int64_t kDitTimeFeatures = 256;

// One training sample of a diffusion transformer as its batch holds it (the batch value is B of
// them, one after another): the clean latents x0 (fp32, ModelConfig's (C, F, H, W)), the noise
// (the same shape), the time t in (0, 1) (fp32) and the label (int32; num_classes: the null
// class). Byte offsets inside the sample, each part 64-byte aligned; `bytes` the sample's size.
struct DitSample {
  int64_t latents = 0, noise = 0, time = 0, label = 0, bytes = 0;
};
DitSample dit_sample(const ModelConfig& config);

// Presets. GPT-2: tiny, small, gpt2-124m; LLaMA: llama-tiny, llama-small; mixture of experts:
// moe-tiny, moe-small; diffusion transformer: dit-tiny (16x16x4 latents, patch 2); shapes for `explain` and the simulator only (too big to train here):
// llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b, llama3.1-8b, llama3.2-1b (Llama 3.1's
// rope scaling), gpt3-175b, mixtral-8x7b, mixtral-8x22b. `vocab_size` applies to presets whose vocabulary comes from the data
// (the trainable ones); the real shapes carry their own. Throws std::invalid_argument for an
// unknown name.
ModelConfig model_preset(const std::string& name, int64_t vocab_size = 50257);
bool preset_has_own_vocab(const std::string& name);

// How much of a block's forward is kept for its backward.
//  none:      everything the backward reads.
//  selective: GEMM outputs and attention statistics; norms and pointwise activations are
//             recomputed inside the backward.
//  full:      only the block's input (the previous unit's output); the whole forward reruns.
//  selective_op: torchtitan's op-level policy ("selective op"): attention's output and every
//             other weight GEMM's output, counting the GEMMs as a framework runs them apart (a
//             LLaMA block: wq, wk, wv, wo, w1, w3, w2); the others (wk, wo, w3) rerun with the
//             norms and activations. LLaMA blocks only, on one cp rank, without --act-quant.
enum class Recompute { none, selective, full, selective_op };
const char* to_string(Recompute r);
Recompute parse_recompute(const std::string& name);  // throws std::invalid_argument

// How attention runs over a sequence split among the ranks of the context-parallel axis (cp):
// key/value blocks passed around a ring, or an all-to-all from the sequence split to a split of
// the heads and back (DeepSpeed-Ulysses).
enum class ContextImpl { ring, all_to_all };
const char* to_string(ContextImpl c);  // "ring", "all-to-all"
ContextImpl parse_context_impl(const std::string& name);  // throws std::invalid_argument

// A sequence of `seq` positions split over `cp` ranks: for a ring, load-balanced for the causal
// mask (2·cp chunks, rank `index` holds chunks index and 2·cp−1−index, so every rank does the same
// attention work); for the all-to-all form, cp consecutive chunks, rank `index` holding chunk
// `index` (it attends over the whole sequence anyway). The first positions of the rank's chunks of
// context_chunk_rows each, in the order it holds them (one chunk, the whole sequence, at cp 1).
std::vector<int64_t> context_chunk_starts(int64_t seq, int cp, int index, ContextImpl impl);
int64_t context_chunk_rows(int64_t seq, int cp, ContextImpl impl);

// The ring's backward over cp = P ranks (layers/context.h), its stages in the order they run:
//   send_kept  (P ≥ 3) the key/value block the forward kept, to rank me − 1, which attends to it next;
//   compute t  for t = P … 1: this rank's part of block t's gradients: d q, and a fresh d k|v of the
//              block (rank me − (t − 1)'s; at t = 1 its own, into d q|k|v) while the next key/value
//              block travels;
//   fold t     for t = P − 1 … 2: the block's d k|v accumulated by ranks me + 1 … arrives and is
//              added to this rank's part, then sent on to rank me − 1 while the next block computes;
//   home       the rank's own block's d k|v from all the others added to its part, then q|k|v's
//              backward.
// The pass's stage numbers run down: send_kept 2P − 1, compute P 2P − 2, then compute t = 2t − 1
// and fold t = 2t − 2, home 0.
struct RingBackwardStage {
  enum class Role { send_kept, compute, fold, home } role;
  int block = 0;  // t: the forward stage whose key/value block it works on
};
int ring_backward_stage_count(int cp);
RingBackwardStage ring_backward_stage(int stage, int cp);

// Every kind of unit, declared once: X(name, place) with place embedding | block | head | state.
// A `state` unit has parameters but no tasks of its own: another unit borrows it (a MoE block
// borrows its experts, so the experts' state can be placed apart from the block's).
// layers/ builds its kernel table from this list: a kind without a `NAME_kind()` there does not
// compile.
#define SHARDLM_UNIT_KINDS(X) \
  X(gpt2_embedding, embedding) \
  X(gpt2_block, block)         \
  X(gpt2_head, head)           \
  X(llama_embedding, embedding) \
  X(llama_block, block)        \
  X(llama_head, head)          \
  X(moe_block, block)          \
  X(moe_experts, state)         \
  X(dit_embedding, embedding)   \
  X(dit_block, block)           \
  X(dit_head, head)

enum class UnitKind {
#define SHARDLM_UNIT_KIND_ENUM(name, place) name,
  SHARDLM_UNIT_KINDS(SHARDLM_UNIT_KIND_ENUM)
#undef SHARDLM_UNIT_KIND_ENUM
};
enum class UnitPlace { embedding, block, head, state };
struct UnitKindInfo {
  const char* name;
  UnitPlace place;
};
inline constexpr UnitKindInfo kUnitKinds[] = {
#define SHARDLM_UNIT_KIND_INFO(name, place) {#name, UnitPlace::place},
    SHARDLM_UNIT_KINDS(SHARDLM_UNIT_KIND_INFO)
#undef SHARDLM_UNIT_KIND_INFO
};
inline constexpr int kNumUnitKinds = static_cast<int>(sizeof(kUnitKinds) / sizeof(kUnitKinds[0]));
constexpr const char* to_string(UnitKind k) { return kUnitKinds[static_cast<int>(k)].name; }
constexpr bool is_block(UnitKind k) { return kUnitKinds[static_cast<int>(k)].place == UnitPlace::block; }
constexpr bool is_head(UnitKind k) { return kUnitKinds[static_cast<int>(k)].place == UnitPlace::head; }
constexpr bool is_embedding(UnitKind k) { return kUnitKinds[static_cast<int>(k)].place == UnitPlace::embedding; }
// No compute task of its own: only state, read and trained through the unit that borrows it.
constexpr bool is_state_only(UnitKind k) { return kUnitKinds[static_cast<int>(k)].place == UnitPlace::state; }

// How a parameter starts: normal(0, std) when std > 0, else the constant `value`.
struct ParamInit {
  float std = 0.0f;
  float value = 0.0f;
};

struct ParamSpec {
  std::string name;            // Hugging Face name, e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // as stored in this engine (vocabulary rows padded to Vp)
  int64_t offset = 0;          // element offset inside the unit's flat buffer
  int64_t numel = 0;
  int64_t exported_rows = -1;  // rows a file holds (V for vocabulary matrices; -1: all)
  bool decay = false;          // AdamW weight decay applies (matrices and embeddings only)
  ParamInit init;
  std::vector<int64_t> exported_shape() const;
  int64_t exported_numel() const;
};

// Activation compression (--act-quant int8): the values a unit keeps from its forward for its
// backward that are the inputs of a GEMM (a weight GEMM's input, or q|k|v and the attention
// output, the operands of attention's two) are stored as int8, one fp32 scale per `group`
// consecutive values along the feature axis, and dequantized in the backward. Only what is kept
// is compressed: what a recompute mode rebuilds is rebuilt in fp32 and never stored, so under
// selective recompute only the saved buffer's GEMM inputs are int8 and under full none are.
struct ActQuant {
  int64_t group = 0;        // values per scale; 0: off (everything fp32)
  bool stochastic = false;  // rounding: stochastic (layers/ keys it by seed, step, tensor) or nearest
  bool on() const { return group > 0; }
  bool saved_int8(Recompute mode) const { return on() && mode != Recompute::full; }
  bool recomputable_int8(Recompute mode) const { return on() && mode == Recompute::none; }
};
const char* to_string_act_quant(const ActQuant& q);  // "none" or "int8"
// Throws std::invalid_argument naming the field (act_quant_group, --act-quant-group) when the group
// does not divide a width it splits (n_embd, the q|k|v row, ffn_dim of a dense MLP, moe_ffn_dim of
// an expert; split over cp ranks by heads, a rank's part of the q|k|v row).
void validate_act_quant(const ModelConfig& c, const ActQuant& q, int cp, ContextImpl impl);

// The scratch a device backend's kernels take of their own, beyond the plan's buffers: the CUDA
// backend (kernels/cuda_backend.cu) rounds GEMM operands and attention's inputs into bf16 copies,
// sums columns through partial rows and runs the head's logits in slabs of `head_rows` rows. The
// figures mirror those allocations, each rounded up to the device allocator's 512 bytes and
// counted while the call holds it (cuda_tests checks them call by call). The CPU's kernels take
// none (their scratch is the plan's buffers): with `cuda` false every figure is 0.
struct KernelScratch {
  bool cuda = false;
  bool bf16_gemm = true;       // tensor-core GEMMs (CudaOptions::bf16_gemm)
  bool bf16_operands = true;   // with them, operands copied to bf16 first (CudaOptions::bf16_operands)
  bool mma_attention = true;   // CudaOptions::attention: mma (the tensor-core kernels where they apply)
  bool gemm_attention = true;  // ... not flash (cuBLAS over score buffers where those fit)
  int64_t head_rows = 2048;    // CudaOptions::head_rows
  // Bytes one call holds at most:
  int64_t linear_forward(int64_t N, int64_t C, int64_t OC, bool bias) const;
  int64_t linear_backward(int64_t N, int64_t C, int64_t OC, bool bias) const;  // dinp, dweight (and dbias)
  int64_t dense_forward(int64_t N, int64_t C, int64_t OC) const;
  int64_t dense_backward(int64_t N, int64_t C, int64_t OC) const;  // dinp and dweight
  int64_t column_sums(int64_t N, int64_t C) const;  // a norm's weight gradient, a bias gradient
  int64_t attention_forward(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) const;
  int64_t attention_backward(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) const;
  int64_t attention_chunked_backward(int64_t B, int64_t NH, int64_t rows) const;
  // The fused head over N rows with the plan's `chunk`; `train`: with dx / dwte; `host_targets`:
  // targets in host memory (generation), copied to the device first.
  int64_t head(int64_t N, int64_t C, int64_t Vp, int64_t chunk, bool train, bool host_targets) const;
};

// The size of one micro-batch as the costs see it: element size of activations (4 for fp32,
// 2 for bf16) and the threads a kernel's per-thread scratch is sized for.
struct Shape {
  int64_t B = 1, T = 1;
  int elem = 4;
  int threads = 1;
  int ep = 1;  // ranks a unit's expert-parallel exchanges span (the mesh's ep axis)
  // Rows the busiest expert takes over the mean (a run's max/mean expert load; 1: balanced
  // routing). The costs price the busiest rank of an expert-parallel group from it (the group
  // waits for that rank): the hottest expert and its rank's other E/ep − 1 at the mean, at most
  // every row on one rank; moot at ep 1, where one rank runs every row.
  double expert_load = 1;
  // Ranks each sequence is split over (the mesh's cp axis): T is the rows of a sequence one rank
  // holds, the sequence T·cp positions long.
  int cp = 1;
  ContextImpl cp_impl = ContextImpl::ring;
  // Activation compression and the recompute mode it depends on (which buffers are kept, hence
  // compressed); with act_quant off the figures do not depend on `recompute`.
  ActQuant act_quant{};
  Recompute recompute = Recompute::none;
  // The kernels that run it, for the scratch they take of their own (UnitCosts::*_kernel_scratch).
  KernelScratch kernels{};
};


// One weight GEMM of a unit's forward for one micro-batch: M rows (B·T) of K inputs to N outputs.
// Its backward is two GEMMs of the same FLOPs each (the input's gradient and the weight's).
struct GemmShape {
  int64_t M = 0, K = 0, N = 0;
  double flops() const { return 2.0 * static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(N); }
};

// The ranks an exchange travels between, or a unit's compute is sliced over, by what they split:
// a MoE layer's experts (expert parallel) or a sequence's positions (context parallel). The plan's
// mesh holds the axis of each (plan::role_of).
enum class Split { none, experts, sequence };

// Between two compute stages of a unit's pass, its routed rows travel over a mesh axis, in one
// of these routes:
// - all_to_all: per-rank sizes known only at run time. The send and receive buffers are planned
//   at `bound_bytes` each: a header of one int64 per rank of the axis (the payload bytes for that
//   rank, or from it), padded to 64 bytes, then the payloads packed rank after rank.
// - ring_next / ring_prev: a ring step; every rank sends its whole buffer (bound_bytes, no header)
//   to the next rank of the axis (index + 1) or the previous one, and receives the same size from
//   the other side.
// - none: nothing travels; the next stage follows on this rank (a stage that needs no exchange).
// Each direction of the pass (forward, backward) has its own exchanges: UnitCosts::exchanges, and
// the backward's in reverse (UnitCosts::backward_exchanges, or the same ones).
struct Exchange {
  enum class Route { all_to_all, ring_next, ring_prev, none };
  Split over = Split::none;    // the ranks it travels between
  int64_t bound_bytes = 0;     // each buffer's size, header included
  // What the busiest rank sends or receives at the shape's expert_load (balanced: each routed row
  // once); the simulator's figure, at most bound_bytes.
  int64_t expected_bytes = 0;
  Route route = Route::all_to_all;
  // Which stage starts it, counted back from the stage it feeds: 1 the stage just before (which
  // writes its send), 2 the one before that (a prefetch: it runs beside the stage just before), ...
  int after = 1;
  // Where its send is first written, counted back the same way (0: at `after`): every stage from
  // there to `after` writes it (a block one stage computes and the next adds to).
  int written_from = 0;
  // k > 0: it has no send of its own but sends on what the exchange k stages back received, once
  // that exchange is done and the `after` stage too; that block then lives until this exchange's
  // stage.
  int forwards = 0;
  const char* carries = nullptr;  // what travels, in words for `explain` (null: routed rows or a ring block)
};

inline int64_t exchange_header_bytes(int64_t ranks) { return (8 * ranks + 63) / 64 * 64; }

// What one unit costs for one micro-batch. Activation bytes are exactly what layers/ allocates
// (each slice rounded up to 64 bytes); a test per unit kind holds the two together.
struct UnitCosts {
  double forward_flops = 0;
  double backward_flops = 0;
  double selective_recompute_flops = 0;  // norms and pointwise activations
  double op_recompute_flops = 0;         // selective_op: its weight GEMMs (op_rebuilt_gemms) and the above
  int64_t pointwise_bytes = 0;           // bytes the forward's non-GEMM kernels read and write
  int64_t output_bytes = 0;              // the residual-stream value it writes
  int64_t saved_bytes = 0;               // kept for the backward unless recompute is full
  int64_t recomputable_bytes = 0;        // kept for the backward only when recompute is none
  int64_t forward_workspace = 0;         // scratch alive inside one forward (or recompute) task
  int64_t backward_workspace = 0;        // scratch alive inside one backward task
  // The backend's own scratch (Shape::kernels): the most one kernel call of a forward (recompute,
  // loss, logits) task, and of a backward (training head) task, holds. 0 on the CPU. The plan puts
  // it before the layers' part of the task's workspace buffer; the executor hands it to the backend.
  int64_t forward_kernel_scratch = 0, backward_kernel_scratch = 0;
  // The forward's weight GEMMs (their FLOPs are part of forward_flops; the head's is its vocabulary
  // projection), for a cost model that prices GEMMs by shape.
  std::vector<GemmShape> gemms;
  std::vector<GemmShape> op_rebuilt_gemms;  // the weight GEMMs selective_op reruns (of `gemms`' FLOPs, sliced)
  double attention_flops = 0;  // causal attention's forward FLOPs (part of forward_flops; backward 2×)
  // A pass of exchanges.size() + 1 compute stages with an exchange between each two (empty: one
  // stage). stage_share[s]: the fraction of the unit's work (FLOPs, pointwise bytes) stage s does.
  std::vector<Exchange> exchanges;
  std::vector<Exchange> backward_exchanges;  // the backward's, where they differ (empty: `exchanges`)
  std::vector<double> stage_share;
  // stage_load[s]: the busiest rank's work in stage s over its balanced share (Shape::expert_load
  // on an expert side; empty: 1 everywhere). The plan's tasks carry balanced work; the simulator
  // scales by this, as the step waits for the busiest rank.
  std::vector<double> stage_load;
  int stages(bool backward = false) const { return static_cast<int>(exchanges_of(backward).size()) + 1; }
  const std::vector<Exchange>& exchanges_of(bool backward) const {
    return backward && !backward_exchanges.empty() ? backward_exchanges : exchanges;
  }
  // The backward's stage shares where its stages differ from the forward's (empty: stage_share).
  std::vector<double> backward_stage_share;
  double share(int stage, bool backward = false) const {
    const std::vector<double>& v = backward && !backward_stage_share.empty() ? backward_stage_share : stage_share;
    return v.empty() ? 1.0 : v[stage];
  }
  std::vector<double> backward_stage_load;  // the backward's, where its stages differ (empty: stage_load)
  double load(int stage, bool backward = false) const {
    const std::vector<double>& v = backward && !backward_stage_load.empty() ? backward_stage_load : stage_load;
    return v.empty() ? 1.0 : v[stage];
  }
  // Activation bytes kept from the forward to the backward under `mode`.
  int64_t kept_bytes(Recompute mode) const;
  double recompute_flops(Recompute mode) const;
};

// The granule of sharding: all its parameters live in one flat buffer, in `params` order.
struct UnitDesc {
  UnitKind kind = UnitKind::gpt2_block;
  int layer = -1;  // block index, -1 for others
  std::string name;
  std::vector<ParamSpec> params;
  int64_t numel = 0;
  // Residual-stream values (indices into ModelDesc::values) read and written.
  std::vector<int> reads;
  int writes = -1;  // -1: none (the head ends the stream with the loss)
  // A unit whose parameters this one also reads (and whose gradients it adds to): the tied head
  // borrows the embedding, a MoE block its experts (a state-only unit right after it). -1: none.
  int borrows = -1;
  bool backward_reads_params = true;  // an embedding's backward is a scatter-add of its output's gradient
  // The ranks that each compute with their own equal, contiguous slice of this unit (a MoE block's
  // experts over the expert axis: rank i of K holds experts i·E/K ..); none: every rank uses all of it.
  Split sliced_over = Split::none;
  const ParamSpec& param(const std::string& suffix) const;  // by name suffix, e.g. "ln_1.weight"
  bool has_param(const std::string& suffix) const;
};

// A value passed between units: the micro-batch's token ids and targets, or a hidden state.
struct ValueDesc {
  std::string name;
  bool tokens = false;  // the batch: int32 inputs and targets (B, T) each; else a (B, T, C) hidden state
  // A batch of samples the model lays out (B of this many bytes each, a DiT's DitSample) in place
  // of token ids; 0: token ids and targets.
  int64_t sample_bytes = 0;
  int64_t bytes(const Shape& s, int64_t C) const;
};

struct ModelDesc {
  ModelConfig config;
  std::vector<UnitDesc> units;    // in forward order
  std::vector<ValueDesc> values;  // values[0] is the batch

  int64_t num_params() const;           // every element of every unit, padded rows included
  int64_t num_params_exported() const;  // what a checkpoint holds: the figure to quote
  UnitCosts costs(int unit, const Shape& s) const;
  // Forward + backward FLOPs of the whole model for one micro-batch (the MFU numerator).
  double train_flops(int64_t B, int64_t T) const;
  // Bytes of the gradient of the residual stream, alive through one backward.
  int64_t grad_stream_bytes(const Shape& s) const { return s.B * s.T * config.n_embd * s.elem; }
};

// Throws std::invalid_argument (via validate) for a bad configuration.
ModelDesc describe(const ModelConfig& config);


// Where each unit sits in the model-wide flat buffers (params, grads, AdamW moments: the same
// layout for all). Each unit is padded to a multiple of 16 × shard_size elements so it splits
// into equal, 64-byte aligned shards; padding elements are zero and never trained.
struct UnitSpan {
  int64_t offset = 0;  // start of the unit in the flat buffer
  int64_t numel = 0;   // real elements
  int64_t padded = 0;  // numel rounded up
};

struct FlatLayout {
  std::vector<UnitSpan> units;
  int64_t total = 0;  // sum of padded sizes
};

FlatLayout flat_layout(const ModelDesc& desc, int64_t shard_size = 1);

// Architecture files.
ModelDesc describe_gpt2(const ModelConfig& config);
ModelDesc describe_llama(const ModelConfig& config);
ModelDesc describe_moe(const ModelConfig& config);
UnitCosts gpt2_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s);
UnitCosts llama_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s);
UnitCosts moe_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s);
ModelDesc describe_dit(const ModelConfig& config);
UnitCosts dit_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s);
// Bytes of each buffer of a MoE block's exchanges (routing groups of `tokens` tokens, an expert
// group of `ranks`): the header, every expert's row count, and the most rows one rank receives.
int64_t moe_exchange_bound(const ModelDesc& desc, int64_t tokens, int64_t ranks, int64_t group = 0);
// Under context parallelism a MoE block's routing group spans the cp ranks: each sends the others
// how many of its slots chose each expert, per sequence and chunk of it the rank holds (int32,
// sequence-major, then chunk, then expert), so every rank counts the group's load and, with a
// capacity, the group's slots ahead of its own. The bytes of one rank's counts.
int64_t moe_count_bytes(const ModelDesc& desc, const Shape& s);
// The LLaMA units (embedding, dense block, head) the MoE family shares.
void add_llama_embedding(ModelDesc& d);
void add_llama_block(ModelDesc& d, int layer);
void add_llama_head(ModelDesc& d);
// A LLaMA block's parameters up to its MLP: input_layernorm, self_attn.{q,k,v,o}_proj (q, k, v
// adjacent: one (out, in) matrix, one GEMM) and post_attention_layernorm, under `prefix`
// ("model.layers.N."). Dense and MoE blocks add their MLP or router after them.
void add_llama_attention(UnitDesc& block, const ModelConfig& config, const std::string& prefix);

// Helpers shared by the architecture files.
namespace detail {
// Bytes of n elements of `elem` bytes, rounded up to 64 as layers/ carves them.
inline int64_t slice(int64_t n, int elem) { return (n * elem + 63) / 64 * 64; }
// A kept GEMM input of n values: fp32-or-`elem` slice, or under act-quant (`group` > 0) int8
// values then one fp32 scale per group, as layers/ carves them.
inline int64_t kept_input(int64_t n, int elem, int64_t group) {
  return group > 0 ? slice(n, 1) + slice(n / group, 4) : slice(n, elem);
}
void add_param(UnitDesc& u, std::string name, std::vector<int64_t> shape, bool decay, ParamInit init,
               int64_t exported_rows = -1);
// Floats of per-thread scratch the tiled attention backward needs (kernels/ owns the algorithm;
// the layers test checks this against kernels::attention_backward_scratch).
int64_t attention_backward_scratch_floats(int64_t HS, int threads);
// Floats of the fused head's logits chunk (rows of 256).
int64_t head_chunk_rows(int64_t BT);
// The unit's *_kernel_scratch from s.kernels (model/kernel_scratch.cc), after its architecture
// file filled the rest (its GEMMs among them).
void add_kernel_scratch(const ModelDesc& desc, const UnitDesc& unit, const Shape& s, UnitCosts& costs);
// A block's attention over a sequence split among s.cp > 1 ranks in the all-to-all form: its pass
// becomes three stages (norm and q|k|v, rotated where the model rotates; attention over the whole
// sequence for this rank's NH / cp heads; the rest) with q|k|v, then the attention output, sent
// from the sequence split to the head split and back over cp. Adds the exchanges and stage shares,
// and what the split keeps and needs besides the plain block: the head split's attention output
// (kept), this rank's q|k|v before its exchange (forward), the head split's d output and d q|k|v
// (backward). `qkv` is the q|k|v row width, `qkv_flops` its GEMM's.
void split_attention_over_context(UnitCosts& k, const Shape& s, int64_t qkv, int64_t C, double qkv_flops);
// The same block in the ring form: cp + 1 stages. Stage 0 is the norm and q|k|v; stage s ≥ 1
// attends this rank's queries to the key/value block of rank index − (s − 1) (its own at stage 1)
// while the next block travels: cp − 1 ring steps to the next rank, each ahead by one stage (stage
// s + 1's block moves during stage s). The last stage goes on to the rest of the block. The
// backward passes each block with its gradient accumulator to the previous rank (cp − 1 steps of
// twice the bytes, after the stage that adds to it), from the block the forward attended last
// (kept, saved) down to the rank's own, whose accumulator is then home. `kv` is the key/value row
// width (2·NKV·HS).
void ring_attention_over_context(UnitCosts& k, const Shape& s, int64_t kv, double qkv_flops);
}  // namespace detail

}  // namespace shardlm::model
