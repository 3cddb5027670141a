// CPU fp32 kernels (llm.c style): plain functions over raw, row-major pointers.
//
// Shape comments use: B batch, T sequence, C channels, NH heads, HS head size (C = NH*HS),
// V vocabulary rows, Vp padded vocabulary rows, OC output channels, N = rows (often B*T).
//
// Conventions
//  - Forward kernels overwrite their outputs.
//  - Backward kernels ACCUMULATE (+=) into every gradient output (input grads and parameter
//    grads alike); callers zero them first.
//  - Kernels parallelise with OpenMP over the calling thread's team size
//    (omp_get_max_threads()) or inside oneDNN's GEMM; they are never called from inside a
//    parallel region. Results are deterministic: same thread count + same input => bitwise
//    same output (most kernels are even independent of the thread count; see notes).
//  - No heap allocation inside kernels; a kernel that needs scratch takes `float* scratch`
//    and has a companion function returning the number of floats it needs.
//  - Kernels know nothing of ranks, models or tensors.
#pragma once

#include <cstdint>

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
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C);
// dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t]. Either may be null.
// Deterministic and independent of the thread count (parallel over channels / positions).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C);

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention (flash-attention style: tiles + online softmax)
// ---------------------------------------------------------------------------------------------
//
// qkv (B,T,3C) holds [q | k | v] along the last dim; head h uses columns h*HS .. (h+1)*HS of
// each part. Scores are scaled by 1/sqrt(HS). No (T,T) matrix is ever stored.

// Tile edge (queries per tile and keys per inner tile). The block routines below take at most
// kAttnTile query rows per call; key ranges may be of any length.
inline constexpr int64_t kAttnTile = 64;
// Largest head size attention_forward supports (its per-thread tiles live on the stack).
inline constexpr int64_t kAttnMaxHS = 256;

// out (B,T,C); lse (B,NH,T) = log-sum-exp of each query row's scaled scores (for backward).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t NH, int64_t HS);

// Floats of scratch attention_backward needs when run with up to `threads` OpenMP threads
// (threads >= omp_get_max_threads() at the time of the call).
int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t HS, int threads);

// Recomputes the probabilities from qkv and lse. dqkv (B,T,3C) +=. out is the forward output.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t HS,
                        float* scratch);

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

}  // namespace shardlm::kernels
