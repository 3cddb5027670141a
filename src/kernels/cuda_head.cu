// CUDA backend: softmax cross-entropy over one chunk of logits rows (the GEMMs around it are
// cuBLAS calls in cuda_backend.cu). One block per row: max and sum of exponentials in one online
// pass, then the gradient written over the logits in place, or as the bf16 operand of the GEMMs
// after it (rounded as fp32_to_bf16 rounds: the same bits as a copy, without the fp32 pass).
#include <cuda_bf16.h>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kThreads = 512;

template <class Op>
__device__ float block_reduce(float v, float* sh, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) v = op(v, sh[w]);
  return v;
}

// Merges a running (max m, sum s of e^(x - m)) with one more value x.
__device__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

// One pass for the max and the sum of exponentials (online, 16-byte loads: rows start at
// multiples of ld = Vp floats), one pass writing the gradient.
__global__ void softmax_xent_kernel(float* logits, double* loss_rows, const int32_t* targets, int64_t V,
                                    int64_t ld, float grad_scale, bool grad, uint16_t* grad16) {
  __shared__ float sh[32];
  float* row = logits + blockIdx.x * ld;
  const int64_t V4 = (ld % 4 == 0) ? V / 4 : 0;
  float m = -INFINITY, s = 0;
  for (int64_t v = threadIdx.x; v < V4; v += blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(row)[v];
    online_add(m, s, x.x);
    online_add(m, s, x.y);
    online_add(m, s, x.z);
    online_add(m, s, x.w);
  }
  for (int64_t v = 4 * V4 + threadIdx.x; v < V; v += blockDim.x) online_add(m, s, row[v]);
  const float mx = block_reduce(m, sh, [](float a, float b) { return fmaxf(a, b); });
  s = block_reduce(m == -INFINITY ? 0.0f : s * expf(m - mx), sh, [](float a, float b) { return a + b; });
  const int32_t tgt = targets[blockIdx.x];
  if (threadIdx.x == 0)
    loss_rows[blockIdx.x] = tgt >= 0 ? double(logf(s)) + double(mx) - double(row[tgt]) : 0.0;
  __syncthreads();  // row[tgt] read before it is overwritten
  if (!grad) return;
  const float inv = 1.0f / s;
  uint16_t* row16 = grad16 ? grad16 + blockIdx.x * ld : nullptr;
  for (int64_t v = threadIdx.x; v < ld; v += blockDim.x) {  // padding columns [V, ld): zero gradient
    const float g = tgt < 0 || v >= V ? 0.0f : (expf(row[v] - mx) * inv - (v == tgt ? 1.0f : 0.0f)) * grad_scale;
    if (row16) row16[v] = __bfloat16_as_ushort(__float2bfloat16_rn(g));
    else row[v] = g;
  }
}

}  // namespace

void softmax_xent(float* logits, double* loss_rows, const int32_t* targets, int64_t n, int64_t V, int64_t ld,
                  float grad_scale, bool grad, uint16_t* grad16) {
  if (n <= 0) return;
  softmax_xent_kernel<<<unsigned(n), kThreads, 0, stream()>>>(logits, loss_rows, targets, V, ld, grad_scale, grad,
                                                              grad16);
  SHARDLM_CUDA_LAUNCHED();
}

}  // namespace shardlm::kernels::cuda
