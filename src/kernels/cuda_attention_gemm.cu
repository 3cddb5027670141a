// CUDA backend: causal grouped-query attention through cuBLAS. Per sequence, the scores of a set
// of heads are one strided-batched GEMM into a (heads, T, T) buffer, the causal softmax a row
// kernel, and the output (and in the backward dQ, dK, dV, recomputing the probabilities from lse)
// further batched GEMMs: the work runs on the tensor cores instead of cuda_attention.cu's fp32
// flash kernels, which remain for sizes whose score buffers would be too large.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float block_max(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, sh[w]);
  return v;
}
__device__ float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0;
  for (int w = 0; w < kThreads / 32; ++w) v += sh[w];
  return v;
}

// One block per score row (head j of the batch, query i): P = softmax over keys 0..i (zero past
// i), lse = log-sum-exp of the row. Scores are already scaled.
__global__ void causal_softmax_kernel(float* S, float* lse, int T, int64_t lse_head_stride) {
  __shared__ float sh[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int i = int(row % T), j = int(row / T);
  float* s = S + row * T;
  float m = -INFINITY;
  for (int k = threadIdx.x; k <= i; k += kThreads) m = fmaxf(m, s[k]);
  m = block_max(m, sh);
  float l = 0;
  for (int k = threadIdx.x; k <= i; k += kThreads) l += expf(s[k] - m);
  l = block_sum(l, sh);
  const float inv = 1.0f / l;
  for (int k = threadIdx.x; k < T; k += kThreads) s[k] = k <= i ? expf(s[k] - m) * inv : 0.0f;
  if (threadIdx.x == 0) lse[j * lse_head_stride + i] = m + logf(l);
}

// Backward, per score row: P = exp(S - lse) (recomputed), dS = P (dP - D) in dP's place.
__global__ void causal_dsoftmax_kernel(float* S, float* dP, const float* lse, const float* D, int T,
                                       int64_t head_stride) {
  const int64_t row = blockIdx.x;
  const int i = int(row % T), j = int(row / T);
  const float li = lse[j * head_stride + i], Di = D[j * head_stride + i];
  float *s = S + row * T, *dp = dP + row * T;
  for (int k = threadIdx.x; k < T; k += kThreads) {
    const float p = k <= i ? expf(s[k] - li) : 0.0f;
    s[k] = p;
    dp[k] = p * (dp[k] - Di);
  }
}

// D[b,h,i] = dout_i . out_i over all rows (warp per row).
__global__ void rowdot_kernel(float* D, const float* dout, const float* out, int64_t rows, int T, int NH, int HS) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;  // (b, i, h) in out's order
  if (r >= rows) return;
  float s = 0;
  for (int d = threadIdx.x; d < HS; d += 32) s += dout[r * HS + d] * out[r * HS + d];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int64_t h = r % NH, bi = r / NH, b = bi / T, i = bi % T;
  if (threadIdx.x == 0) D[(b * NH + h) * T + i] = s;
}

// The heads handled by one batch of GEMMs: with multi-head attention all NH at once (keys at
// stride HS), with grouped-query one key/value head's group (its key shared: stride 0).
struct HeadSet {
  int h0, count;
  int64_t kv_col;     // column of the key (value: + NKV HS) head of the set's first head
  int64_t kv_stride;  // between consecutive heads of the set
};

std::vector<HeadSet> head_sets(int NH, int NKV, int HS) {
  std::vector<HeadSet> sets;
  if (NKV == NH) return {HeadSet{0, NH, int64_t(NH) * HS, HS}};
  const int group = NH / NKV;
  for (int g = 0; g < NKV; ++g) sets.push_back(HeadSet{g * group, group, int64_t(NH + g) * HS, 0});
  return sets;
}

}  // namespace

bool attention_gemm_fits(int64_t T, int64_t NH, int64_t NKV) {
  const int64_t heads = NKV == NH ? NH : NH / NKV;
  return 2 * heads * T * T * int64_t(sizeof(float)) <= (int64_t(1) << 31);
}

void attention_gemm_forward(const Backend& backend, bool bf16, float* out, float* lse, const float* qkv, int64_t B,
                            int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t W = (NH + 2 * NKV) * HS, O = NH * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  const auto sets = head_sets(int(NH), int(NKV), int(HS));
  Buffer S = device_scratch(backend, sizeof(float) * sets[0].count * T * T);
  for (int64_t b = 0; b < B; ++b) {
    const float* base = qkv + b * T * W;
    for (const HeadSet& hs : sets) {
      const float *q = base + hs.h0 * HS, *k = base + hs.kv_col, *v = k + NKV * HS;
      gemm_strided_batched(bf16, false, true, T, T, HS, scale, q, W, HS, k, W, hs.kv_stride, 0.0f, S.f32(), T, T * T,
                           hs.count);
      causal_softmax_kernel<<<unsigned(hs.count * T), kThreads, 0, stream()>>>(S.f32(), lse + (b * NH + hs.h0) * T,
                                                                                int(T), T);
      SHARDLM_CUDA_LAUNCHED();
      gemm_strided_batched(bf16, false, false, T, HS, T, 1.0f, S.f32(), T, T * T, v, W, hs.kv_stride, 0.0f,
                           out + b * T * O + hs.h0 * HS, O, HS, hs.count);
    }
  }
}

void attention_gemm_backward(const Backend& backend, bool bf16, float* dqkv, const float* dout, const float* qkv,
                             const float* out, const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                             int64_t HS) {
  const int64_t W = (NH + 2 * NKV) * HS, O = NH * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  const auto sets = head_sets(int(NH), int(NKV), int(HS));
  const int64_t rows = B * T * NH;
  Buffer D = device_scratch(backend, sizeof(float) * rows);
  rowdot_kernel<<<unsigned((rows + 7) / 8), dim3(32, 8), 0, stream()>>>(D.f32(), dout, out, rows, int(T), int(NH),
                                                                        int(HS));
  SHARDLM_CUDA_LAUNCHED();
  const int64_t hmax = sets[0].count;
  Buffer P = device_scratch(backend, sizeof(float) * hmax * T * T);
  Buffer dS = device_scratch(backend, sizeof(float) * hmax * T * T);
  for (int64_t b = 0; b < B; ++b) {
    const float* base = qkv + b * T * W;
    float* dbase = dqkv + b * T * W;
    const float* dO = dout + b * T * O;
    for (const HeadSet& hs : sets) {
      const int64_t n = hs.count;
      const float *q = base + hs.h0 * HS, *k = base + hs.kv_col, *v = k + NKV * HS, *dOh = dO + hs.h0 * HS;
      float *dq = dbase + hs.h0 * HS, *dk = dbase + hs.kv_col, *dv = dk + NKV * HS;
      gemm_strided_batched(bf16, false, true, T, T, HS, scale, q, W, HS, k, W, hs.kv_stride, 0.0f, P.f32(), T, T * T, n);
      gemm_strided_batched(bf16, false, true, T, T, HS, 1.0f, dOh, O, HS, v, W, hs.kv_stride, 0.0f, dS.f32(), T, T * T,
                           n);
      causal_dsoftmax_kernel<<<unsigned(n * T), kThreads, 0, stream()>>>(
          P.f32(), dS.f32(), lse + (b * NH + hs.h0) * T, D.f32() + (b * NH + hs.h0) * T, int(T), T);
      SHARDLM_CUDA_LAUNCHED();
      gemm_strided_batched(bf16, false, false, T, HS, T, scale, dS.f32(), T, T * T, k, W, hs.kv_stride, 1.0f, dq, W, HS,
                           n);
      if (hs.kv_stride != 0) {  // one key/value head per query head: batched
        gemm_strided_batched(bf16, true, false, T, HS, T, scale, dS.f32(), T, T * T, q, W, HS, 1.0f, dk, W, HS, n);
        gemm_strided_batched(bf16, true, false, T, HS, T, 1.0f, P.f32(), T, T * T, dOh, O, HS, 1.0f, dv, W, HS, n);
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {  // a shared head sums over its group: one GEMM after another
        gemm_strided_batched(bf16, true, false, T, HS, T, scale, dS.f32() + j * T * T, T, 0, q + j * HS, W, 0, 1.0f,
                             dk, W, 0, 1);
        gemm_strided_batched(bf16, true, false, T, HS, T, 1.0f, P.f32() + j * T * T, T, 0, dOh + j * HS, O, 0, 1.0f,
                             dv, W, 0, 1);
      }
    }
  }
}

}  // namespace shardlm::kernels::cuda
