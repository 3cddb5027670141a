// CPU fp32 kernels (llm.c style): plain functions over raw, row-major pointers.
//
// Shape comments use: B batch, T sequence, C channels, NH heads, HS head size (C = NH*HS),
// V vocabulary rows, Vp padded vocabulary rows, OC output channels, N = rows (often B*T).
//
// Conventions
//  - Forward kernels overwrite their outputs.
//  - Backward kernels ACCUMULATE (+=) into every gradient output (input grads and parameter
//    grads alike); callers zero them first. (Exception: rope_backward transforms its gradient
//    in place, like rope_forward.)
//  - Kernels parallelise with OpenMP over the calling thread's team size
//    (omp_get_max_threads()) or inside oneDNN's GEMM; they are never called from inside a
//    parallel region. Results are deterministic: same thread count + same input => bitwise
//    same output (most kernels are even independent of the thread count; see notes).
//  - No heap allocation inside kernels; a kernel that needs scratch takes `float* scratch`
//    and has a companion function returning the number of floats it needs.
//  - Kernels know nothing of ranks, models or tensors.
#pragma once

#include <cstdint>

#include "kernels/rope.h"
#include "kernels/seq_chunks.h"

namespace shardlm::kernels {

// ---------------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------------

// Sets up the calling process for compute: sets the OpenMP thread count to `threads` and
// turns on flush-to-zero + denormals-are-zero (MXCSR) on every thread of the OpenMP pool
// (including the calling thread). oneDNN uses the same OpenMP pool. Call once at start-up
// (and again from any other thread that will call kernels).
void init_compute(int threads);

// ---------------------------------------------------------------------------------------------
// GEMM and linear layers
// ---------------------------------------------------------------------------------------------

// Row-major GEMM through oneDNN's dnnl_sgemm: C (M,N) = alpha * op(A) * op(B) + beta * C.
// op(A) is (M,K), op(B) is (K,N). Throws std::runtime_error if oneDNN reports an error.
void matmul(bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha,
            const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
            int64_t ldc);

// out (N,OC) = inp (N,C) @ weight (C,OC) + bias (OC). bias may be null.
// weight is in the Hugging Face Conv1D layout (in x out).
void linear_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC);

// dinp (N,C) += dout (N,OC) @ weight^T ; dweight (C,OC) += inp^T @ dout ;
// dbias (OC) += sum over rows of dout. Any of dinp / dweight / dbias may be null (skipped).
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);

// ---------------------------------------------------------------------------------------------
// Normalisation, activations, residual, embedding
// ---------------------------------------------------------------------------------------------

// out (N,C) = (inp - mean) * rstd * weight (C) + bias (C), eps = 1e-5 (biased variance, as
// torch.nn.LayerNorm). Saves mean (N) and rstd (N) for the backward pass.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C);

// dinp (N,C) +=, dweight (C) +=, dbias (C) +=. dweight / dbias may be null.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C);

// GELU, tanh approximation (GPT-2; torch approximate='tanh'):
// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out may alias inp.
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp (n) += gelu'(inp) * dout.
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n);

// out (n) = a + b. out may alias a or b.
void residual_forward(float* out, const float* a, const float* b, int64_t n);

// out (B,T,C) = wte[tokens[b,t]] (V,C) + wpe[t] (T_max,C). tokens (B,T) int32 in [0,V).
// wpe may be null (no position embedding).
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C);
// dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t]. Either may be null.
// Deterministic and independent of the thread count (parallel over channels / positions).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C);

// ---------------------------------------------------------------------------------------------
// Multi-head / grouped-query self-attention (flash-attention style: tiles + online softmax),
// causal or (causal = false: a diffusion transformer's) bidirectional
// ---------------------------------------------------------------------------------------------
//
// NH query heads, NKV key/value heads (NKV divides NH; NKV == NH is plain multi-head attention,
// NKV == 1 multi-query attention). qkv (B,T,(NH+2*NKV)*HS) holds [q | k | v] along the last
// dim: q in columns [0, NH*HS), k in [NH*HS, (NH+NKV)*HS), v in [(NH+NKV)*HS, (NH+2*NKV)*HS);
// query head h uses columns h*HS .. (h+1)*HS of q and key/value head h / (NH/NKV) of k and v.
// Scores are scaled by 1/sqrt(HS). No (T,T) matrix is ever stored. Both kernels throw
// std::invalid_argument unless NKV > 0 and NH % NKV == 0.

// Tile edge (queries per tile and keys per inner tile). The block routines below take at most
// kAttnTile query rows per call; key ranges may be of any length.
inline constexpr int64_t kAttnTile = 64;
// Largest head size attention_forward supports (its per-thread tiles live on the stack).
inline constexpr int64_t kAttnMaxHS = 256;

// out (B,T,NH*HS); lse (B,NH,T) = log-sum-exp of each query row's scaled scores (for
// backward). `causal`: a query sees the keys at or before its position; else every key.
// Independent of the thread count.
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t NH, int64_t NKV, int64_t HS, bool causal = true);

// Floats of scratch attention_backward needs when run with up to `threads` OpenMP threads
// (threads >= omp_get_max_threads() at the time of the call).
int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                   int threads);

// Recomputes the probabilities from qkv and lse. dqkv (B,T,(NH+2*NKV)*HS) +=. out is the
// forward output. The dK / dV rows of a shared key/value head receive the sum over its group's
// query heads. Parallel over (b, kv head) (B*NKV work units, the group's query heads inside
// each), so the result is independent of the thread count.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t HS, float* scratch, bool causal = true);

// Multi-head forms (NKV = NH, qkv (B,T,3C)): bitwise the same as the calls above with NKV = NH.
inline void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                              int64_t NH, int64_t HS) {
  attention_forward(out, lse, qkv, B, T, NH, NH, HS);
}
inline int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t HS,
                                          int threads) {
  return attention_backward_scratch(B, T, NH, NH, HS, threads);
}
inline void attention_backward(float* dqkv, const float* dout, const float* qkv,
                               const float* out, const float* lse, int64_t B, int64_t T,
                               int64_t NH, int64_t HS, float* scratch) {
  attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, HS, scratch);
}

// --- Block routines (one query tile against one key/value block), reusable for ring attention.
//
// A query tile is nq <= kAttnTile rows q (nq,HS) with row stride ldq, at absolute sequence
// positions q_pos0 .. q_pos0+nq-1. A key/value block is nk rows (any nk >= 0) k (nk,HS),
// v (nk,HS) with row strides ldk, ldv at absolute positions k_pos0 .. k_pos0+nk-1.
// If causal, key position p is visible to query position s only when p <= s.
//
// The running online-softmax state of a query tile is (m (nq) running max of scaled scores,
// l (nq) running sum of exp(score - m), acc (nq,HS) running sum of exp(score - m) * v, row
// stride HS). Start it with attention_state_init, feed it any number of key/value blocks in
// any order with attention_block_forward (each call merges: m' = max(m, rowmax),
// l' = l e^(m-m') + sum e^(s-m'), acc' = acc e^(m-m') + P v), and finish with
// attention_state_finalize. Two states of the same tile computed separately (e.g. on two
// ranks) can be merged with attention_state_merge.

// Floats of scratch one attention_block_forward call needs.
int64_t attention_block_forward_scratch(int64_t HS);
// m = -inf, l = 0, acc = 0.
void attention_state_init(float* m, float* l, float* acc, int64_t nq, int64_t HS);
void attention_block_forward(const float* q, int64_t ldq, int64_t nq, int64_t q_pos0,
                             const float* k, int64_t ldk, const float* v, int64_t ldv,
                             int64_t nk, int64_t k_pos0, int64_t HS, float scale, bool causal,
                             float* m, float* l, float* acc, float* scratch);
// (m, l, acc) <- merge of (m, l, acc) and (m2, l2, acc2).
void attention_state_merge(float* m, float* l, float* acc, const float* m2, const float* l2,
                           const float* acc2, int64_t nq, int64_t HS);
// out (nq,HS) rows at stride ldo = acc / l; lse (nq) = m + log(l) (nullable).
// Rows that saw no key get out = 0 and lse = -inf.
void attention_state_finalize(float* out, int64_t ldo, float* lse, const float* m,
                              const float* l, const float* acc, int64_t nq, int64_t HS);

// Backward of one query tile against one key/value block, given the tile's final lse (nq)
// and Drow (nq) = rowsum(dout * out) (see attention_backward_rowdot). Accumulates:
// dq (nq,HS, stride lddq) +=, dk (nk,HS, stride lddk) +=, dv (nk,HS, stride lddv) +=.
// dout (nq,HS) has row stride lddo.
int64_t attention_block_backward_scratch(int64_t HS);
void attention_block_backward(const float* q, int64_t ldq, const float* dout, int64_t lddo,
                              const float* lse, const float* Drow, int64_t nq, int64_t q_pos0,
                              const float* k, int64_t ldk, const float* v, int64_t ldv,
                              int64_t nk, int64_t k_pos0, int64_t HS, float scale, bool causal,
                              float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv, float* scratch);
// Drow (nq) = sum_d dout[i,d] * out[i,d].
void attention_backward_rowdot(float* Drow, const float* dout, int64_t lddo, const float* out,
                               int64_t ldo, int64_t nq, int64_t HS);

// --- Attention over sequence chunks (context parallelism: ring steps, head-split all-to-all).
//
// Queries q (B, qc.total()) rows of stride ldq, query head h at columns h*HS; keys k and values
// v (B, kc.total()) rows of stride ldkv, key/value head g at columns g*HS of each. Masking is
// causal by the chunks' absolute positions (a chunk pair the mask empties is skipped, not
// computed), or with causal = false there is none: every query sees every key. out (B, qc.total(), NH*HS) and lse (B, NH, qc.total()) as attention_forward's.

// The attention of q over this key/value block. With `accumulate`, (out, lse) already hold the
// result over earlier blocks and receive the merge of both (a row that has seen no key yet has
// lse = -inf); else they are overwritten. Over all blocks of a sequence, in any order, it equals
// attention_forward to rounding. Independent of the thread count.
void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc,
                               const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B,
                               int64_t NH, int64_t NKV, int64_t HS, bool accumulate, bool causal = true);

// Floats of scratch attention_chunked_backward needs with up to `threads` OpenMP threads.
int64_t attention_chunked_backward_scratch(int64_t HS, int threads);

// This block's share of the backward, given the final out and lse over all blocks: dq (stride
// lddq) +=, dk and dv (stride lddkv, laid out as k and v) +=. dout and out (B, qc.total(),
// NH*HS). Parallel over (b, key/value head), so independent of the thread count.
void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv,
                                const float* dout, const float* q, int64_t ldq, const float* out,
                                const float* lse, SeqChunks qc, const float* k, const float* v,
                                int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                                int64_t HS, float* scratch, bool causal = true);

// ---------------------------------------------------------------------------------------------
// Language-model head fused with cross-entropy
// ---------------------------------------------------------------------------------------------
//
// x (N,C) final hidden states; wte (Vp,C) tied embedding (rows >= V are padding: they get no
// logits and their gradient rows are never touched); targets (N) int32, < 0 = ignored row.
// Processes `chunk` rows at a time and never materialises more than chunk x Vp logits.
// Returns sum over rows of -log softmax(x wte[:V]^T)[target] (double accumulation,
// deterministic). If dx != null or dwte != null: with dlogits = (softmax - onehot) *
// grad_scale (zero for ignored rows), dx (N,C) += dlogits @ wte[:V] and
// dwte[:V] (V,C) += dlogits^T @ x. If logits_out != null, the raw logits (N,V) are written
// there too (generation / tests).
int64_t head_scratch(int64_t chunk, int64_t Vp);
double lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte,
                             const int32_t* targets, int64_t N, int64_t C, int64_t V,
                             int64_t Vp, float grad_scale, int64_t chunk, float* scratch,
                             float* logits_out);

// ---------------------------------------------------------------------------------------------
// LLaMA-family layers: RMSNorm, rotary position embedding, SwiGLU, nn.Linear-layout dense
// ---------------------------------------------------------------------------------------------
//
// F is the MLP's intermediate size. (GQA attention: see attention_forward above.)

// RMSNorm as Hugging Face LlamaRMSNorm in fp32: rstd (N) = 1/sqrt(mean(x^2) + eps),
// out (N,C) = x * rstd * weight (C). rstd may be null (inference). Independent of the thread
// count.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps);
// dinp (N,C) +=, dweight (C) += (null: skipped). rstd as saved by rmsnorm_forward.
// Deterministic and independent of the thread count (dweight: column blocks, rows in order).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);

// Rotary position embedding, Hugging Face `rotate_half` convention. For a head vector x of
// even size HS and i in [0, HS/2), with angle = pos * inv_freq_i (kernels/rope.h: theta^(-2i/HS),
// rescaled as Llama 3.1's where the Rope says so):
//   y[i] = x[i] cos - x[i+HS/2] sin,   y[i+HS/2] = x[i+HS/2] cos + x[i] sin.
//
// Table layout: cos_sin (T, HS) holds, for position t, the row
//   [cos(t f_0) .. cos(t f_{HS/2-1}) | sin(t f_0) .. sin(t f_{HS/2-1})],
// i.e. a (T, HS/2) cos table and a (T, HS/2) sin table, interleaved per position with row
// stride HS. A position offset p0 (e.g. a sequence shard starting at p0) is therefore just
// cos_sin + p0 * HS, with the table built for at least p0 + T positions.
//
// Angles are computed in fp32 exactly as HF's fp32 LlamaRotaryEmbedding does: inv_freq_i =
// 1.0f / float(theta^e_i) with e_i = float(2i) / float(HS) in fp32 (then rescaled, rope.h), and
// angle = float(t) * inv_freq_i rounded to fp32, so the rotation of each position is the one
// HF models were trained with (the fp32 rounding of the angle grows with t: ~1e-4 rad at
// t ~ 2000, and matching it matters more than removing it). theta^e_i and cos / sin of the
// fp32 angle are evaluated in double and rounded once to fp32 (correctly rounded, libm- and
// vector-width-independent; within 1 ulp of torch's fp32 pow / cos / sin).
int64_t rope_table_floats(int64_t T, int64_t HS);
// Fills cos_sin (rope_table_floats(T, HS) floats) for positions 0..T-1. HS must be even
// (std::invalid_argument otherwise).
void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope);
// Rotates in place the first n_heads*HS columns (n_heads heads of HS) of every (b,t) row of
// x; rows are at stride row_stride (>= n_heads*HS) and row (b,t) is at position t (table row
// t). Other columns are not touched: with the packed GQA qkv (row_stride = (NH+2*NKV)*HS),
// n_heads = NH + NKV rotates q and k in one call and leaves v alone.
void rope_forward(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS,
                  int64_t row_stride, const float* cos_sin);
// Backward: the gradient w.r.t. the pre-rotation input is the inverse (transpose) rotation
// of the gradient w.r.t. the output. Applied IN PLACE on dx (same layout as rope_forward):
// dx is overwritten, not accumulated into.
void rope_backward(float* dx, int64_t B, int64_t T, int64_t n_heads, int64_t HS,
                   int64_t row_stride, const float* cos_sin);

// SwiGLU: gate_up (N, 2F) holds [gate | up] per row; out (N,F) = silu(gate) * up with
// silu(x) = x * sigmoid(x) = x / (1 + e^-x) (torch's formula; e^x via detail::exp_fast,
// ~1 ulp).
void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F);
// dgate_up (N, 2F) +=: d gate = dout * up * sigmoid(g) (1 + g (1 - sigmoid(g))),
// d up = dout * silu(g).
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                     int64_t F);

// Linear without bias, weight in the PyTorch nn.Linear layout (OC, C) (out x in):
// out (N,OC) = inp (N,C) @ weight^T. Through kernels::matmul (oneDNN sgemm).
void dense_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                   int64_t OC);
// dinp (N,C) += dout (N,OC) @ weight ; dweight (OC,C) += dout^T @ inp. Either may be null.
void dense_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                    const float* weight, int64_t N, int64_t C, int64_t OC);

// ---------------------------------------------------------------------------------------------
// Mixture-of-experts routing (N tokens, E experts, k slots per token)
// ---------------------------------------------------------------------------------------------
//
// A token's k slots hold its chosen experts in order of decreasing probability (ties: the lower
// expert index first). A routing sends slot (t, s) to dispatch row slot_row[t·k + s] (-1: dropped
// by capacity); rows are grouped by expert (expert e's rows are [offsets[e], offsets[e+1])) and,
// within an expert, in token order. Deterministic and independent of the thread count.

// probs (N,E) = softmax(logits (N,E)) in fp32; lse (N) = log-sum-exp of each row.
void moe_router_probs(float* probs, float* lse, const float* logits, int64_t N, int64_t E);
// moe_router_probs, then each token's top k: expert (N,k) int32 and weight (N,k), the softmax
// probabilities, renormalised to sum 1 over the k when norm_topk.
void moe_router_forward(float* probs, float* lse, int32_t* expert, float* weight, const float* logits, int64_t N,
                        int64_t E, int64_t k, bool norm_topk);
// The dispatch of a routing: assigned (E) counts every slot choosing e; expert e keeps the first
// `capacity` of them in token order (capacity >= N: all). Writes offsets (E+1), slot_row (N·k) and
// row_token (rows): the token of each row. Returns the rows (offsets[E]).
// When the routing group is wider than these N tokens (a sequence split over context-parallel
// ranks), `taken` (null: none) holds, for each segment of `segment` consecutive tokens here, the
// E counts of the group's slots before that segment in the group's token order: a slot is kept
// while those and the segment's earlier slots for its expert stay under `capacity`.
int64_t moe_dispatch(int32_t* offsets, int32_t* assigned, int32_t* slot_row, int32_t* row_token,
                     const int32_t* expert, int64_t N, int64_t E, int64_t k, int64_t capacity,
                     const int32_t* taken = nullptr, int64_t segment = 0);
// xs (rows,C) = x[row_token[r]] (N,C).
void moe_gather_rows(float* xs, const float* x, const int32_t* row_token, int64_t rows, int64_t C);
// dx (N,C) += sum over token t's kept slots of dxs[slot_row] (the gather's backward).
void moe_gather_rows_backward(float* dx, const float* dxs, const int32_t* slot_row, int64_t N, int64_t k, int64_t C);
// out (N,C) = res (N,C) + sum over t's kept slots s of weight[t,s] · ys[slot_row[t,s]] (rows,C).
// out may alias res.
void moe_combine(float* out, const float* res, const float* ys, const float* weight, const int32_t* slot_row,
                 int64_t N, int64_t k, int64_t C);
// dys[row of (t,s)] += weight[t,s] · dout[t]; dweight[t,s] += dout[t] · ys[row] (kept slots only).
void moe_combine_backward(float* dys, float* dweight, const float* dout, const float* ys, const float* weight,
                          const int32_t* slot_row, int64_t N, int64_t k, int64_t C);
// The group's load-balancing loss aux = E Σ_e f_e P_e, f_e = assigned[e] / (G k), P_e the mean
// of probs[:, e] over the group's G tokens (1 at perfect balance), and router z-loss z = mean over
// the group's tokens of lse². These N tokens are the group's (G = N) or a part of it (a sequence
// split over context-parallel ranks, `assigned` then the group's counts): both losses are sums
// over tokens, so the parts' figures add up to the group's. Double accumulation.
void moe_router_losses(double* aux, double* z, const float* probs, const float* lse, const int32_t* assigned,
                       int64_t N, int64_t E, int64_t k, int64_t G);
// dlogits (N,E) += the gradient through the softmax of: dweight (N,k) through the top-k weights
// (renormalised when norm_topk), aux_scale times d aux / d probs, and z_scale times d z / d logits,
// the losses those of a group of G tokens holding these N (moe_router_losses).
void moe_router_backward(float* dlogits, const float* dweight, const float* probs, const float* lse,
                         const int32_t* expert, const float* weight, const int32_t* assigned, int64_t N, int64_t E,
                         int64_t k, int64_t G, bool norm_topk, float aux_scale, float z_scale);

// The experts' GEMMs, every group at once (group g: rows [first[g], first[g+1]) of inp and out,
// its nn.Linear weight (OC, C) at weight[g]): out rows = inp rows @ weight[g]^T. One parallel
// region over (group, block of rows) tasks, each a one-thread GEMM, instead of a parallel GEMM
// per group: the fork/join of each small GEMM, not its arithmetic, dominated the experts.
// Deterministic and independent of the thread count.
void grouped_dense_forward(float* out, const float* inp, const float* const* weight, const int64_t* first,
                           int64_t groups, int64_t C, int64_t OC);
// dinp rows += dout rows @ weight[g]; dweight[g] (OC, C) += dout rows^T @ inp rows (tasks: blocks of
// rows for dinp, blocks of dweight's rows, each summing over all the group's rows in one GEMM).
// dweight[g] may be null for no weight gradient. Deterministic and independent of the thread count.
void grouped_dense_backward(float* dinp, float* const* dweight, const float* dout, const float* inp,
                            const float* const* weight, const int64_t* first, int64_t groups, int64_t C, int64_t OC);

// ---------------------------------------------------------------------------------------------
// Optimizer and utilities
// ---------------------------------------------------------------------------------------------

// AdamW on a contiguous range, formula order of torch.optim.AdamW (single-tensor path):
// p *= 1 - lr*wd; m = lerp(m, g, 1-beta1); v = v*beta2 + (1-beta2)*g*g;
// bc1 = 1-beta1^t, bc2 = 1-beta2^t; denom = sqrt(v)/sqrt(bc2) + eps;
// p += (-lr/bc1) * m / denom. t is the 1-based step.
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t);

// Sum of squares with double accumulation; deterministic and independent of thread count.
double sum_squares(const float* x, int64_t n);
// x *= s.
void scale(float* x, int64_t n, float s);

// bf16 <-> fp32 (round to nearest even; NaN stays NaN).
void fp32_to_bf16(uint16_t* out, const float* in, int64_t n);
void bf16_to_fp32(float* out, const uint16_t* in, int64_t n);

// Activation compression (--act-quant int8). x holds n values in groups of `group` consecutive
// ones (n a multiple of group; a group lies along the feature axis of a row-major activation);
// each group gets one scale s = max|x| / 127 (0 for an all-zero group) and values
// q = round(x / s) in [-127, 127]. Nearest rounding (half away from zero) keeps |x - q s| <= s / 2.
// Stochastic rounding takes q = floor(x / s + u) with u uniform in [0, 1) drawn from (key, element
// index) alone: unbiased (E[q s] = x), reproducible, and the
// same on any thread count. Non-finite inputs give a non-finite scale, so they are not hidden.
struct QuantRounding {
  bool stochastic = false;
  uint64_t key = 0;  // stochastic: the draw of element i is a hash of (key, i)
};
void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, QuantRounding rounding);
// x = q · scale of its group.
void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group);

}  // namespace shardlm::kernels
