// Internals shared by the CUDA backend's translation units: error checks, the backend's one
// stream, and the launchers each .cu file defines. Not part of the kernels/ interface.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tensor/memory.h"

namespace shardlm::kernels::cuda {

// Every CUDA call's status is checked; a failure names the call and where it was made.
inline void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA: ") + what + " failed at " + file + ":" + std::to_string(line) +
                             ": " + cudaGetErrorString(e));
}
#define SHARDLM_CUDA_CHECK(call) ::shardlm::kernels::cuda::check((call), #call, __FILE__, __LINE__)
// After each launch: a bad configuration shows up only as the last error. With the backend's
// CudaOptions::sync_each_launch the stream is also synchronised, so a fault is reported at its own
// launch.
void after_launch(const char* file, int line);
#define SHARDLM_CUDA_LAUNCHED() ::shardlm::kernels::cuda::after_launch(__FILE__, __LINE__)

// The one stream every kernel, copy and GEMM of the backend is issued on: in-order, so a block
// freed by the host and handed out again is only touched after the work that used it.
cudaStream_t stream();
// The copy lane's stream (Backend::Lane::copy): the offload tier's transfers.
cudaStream_t copy_stream();

// Device scratch for one call of `backend` (a CUDA backend): carved from the region the plan sized
// (Backend::use_scratch) while one is given and the piece fits, else from its caching allocator
// (a workspace buffer, counted as an overflow when a region was given).
Buffer device_scratch(const Backend& backend, size_t bytes);

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? b : 65535 * 32);
}

// ---- cuda_pointwise.cu
void add_bias_rows(float* out, const float* bias, int64_t N, int64_t OC);  // out[n,:] = bias
void bias_grad(const Backend& backend, float* dbias, const float* dout, int64_t N, int64_t OC);  // dbias += column sums
// The same sums (same order), and dout's bf16 copy (N, OC) written on the way.
void bias_grad_and_bf16(const Backend& backend, float* dbias, uint16_t* dout16, const float* dout, int64_t N,
                        int64_t OC);
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C);
void layernorm_backward(const Backend& backend, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd, int64_t N,
                        int64_t C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                     float eps);
void rmsnorm_backward(const Backend& backend, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n);
void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F);
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t F);
void residual_forward(float* out, const float* a, const float* b, int64_t n);
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C);
void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope);
void rope_apply(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                const float* cos_sin, bool inverse);
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay, float w1, bool lerp_low,
                  float beta2, float w2, float bc2_sqrt, float eps, float neg_step);
// Sum of squares in double into *out_dev (one double on the device); partials: 1024 doubles.
void sum_squares(double* out_dev, double* partials, const float* x, int64_t n);
void scale(float* x, int64_t n, float s);
void fp32_to_bf16(uint16_t* out, const float* in, int64_t n);
void bf16_to_fp32(float* out, const uint16_t* in, int64_t n);

// ---- cuda_attention.cu
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t HS);
// scratch: B*NH*T floats (the rows' dout . out).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, float* scratch);
// The same over sequence chunks (kernels/cpu.h's attention_chunked_*); at most 8 chunks a side.
void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc, const float* k,
                               const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                               int64_t HS, bool accumulate);
// scratch: B*NH*qc.total() floats (the rows' dout . out).
void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, const float* dout,
                                const float* q, int64_t ldq, const float* out, const float* lse, SeqChunks qc,
                                const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH,
                                int64_t NKV, int64_t HS, float* scratch);

// ---- cuda_attention_gemm.cu: the same through cuBLAS, scores in device scratch
bool attention_gemm_fits(int64_t T, int64_t NH, int64_t NKV);
void attention_gemm_forward(const Backend& backend, bool bf16, float* out, float* lse, const float* qkv, int64_t B,
                            int64_t T, int64_t NH, int64_t NKV, int64_t HS);
void attention_gemm_backward(const Backend& backend, bool bf16, float* dqkv, const float* dout, const float* qkv,
                             const float* out, const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                             int64_t HS);

// ---- cuda_attention_mma.cu: flash attention on the bf16 tensor cores, for the head sizes it supports
bool mma_attention_supports(int64_t HS);
void mma_attention_forward(const Backend& backend, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t HS);
void mma_attention_backward(const Backend& backend, float* dqkv, const float* dout, const float* qkv,
                            const float* out, const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t HS);

// ---- cuda_backend.cu: row-major strided-batched GEMM on the backend's cuBLAS handle, for i < batch
// C_i (M,N) = alpha op(A_i) op(B_i) + beta C_i with X_i = X + i * sX (bf16: tensor-core bf16 inputs).
void gemm_strided_batched(bool bf16, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, int64_t sA, const float* B, int64_t ldb, int64_t sB, float beta, float* C,
                          int64_t ldc, int64_t sC, int64_t batch);

// ---- cuda_quant.cu: kernels/cpu.h's quantize_int8 / dequantize_int8, bit for bit (n a multiple of group)
void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, bool stochastic, uint64_t key);
void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group);

// ---- cuda_head.cu
// Over logits (n, ld): row losses into loss_rows (double, n), and with `grad` the rows' gradient
// (softmax - onehot) * grad_scale (zero for ignored rows and padding columns), written over the
// logits, or with grad16 as bf16 into grad16 (n, ld) and the logits left as they were.
void softmax_xent(float* logits, double* loss_rows, const int32_t* targets, int64_t n, int64_t V, int64_t ld,
                  float grad_scale, bool grad, uint16_t* grad16 = nullptr);
// *acc += sum of rows (in order: deterministic).
void accumulate_sum(double* acc, const double* rows, int64_t n);

}  // namespace shardlm::kernels::cuda
