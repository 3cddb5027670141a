// CUDA backend: softmax cross-entropy over one chunk of logits rows (the GEMMs around it are
// cuBLAS calls in cuda_backend.cu). One block per row: max and sum of exponentials in one online
// pass, then the gradient written over the logits in place.
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
                                    int64_t ld, float grad_scale, bool grad) {
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
  for (int64_t v = threadIdx.x; v < ld; v += blockDim.x)  // padding columns [V, ld): zero gradient
    row[v] = tgt < 0 || v >= V ? 0.0f : (expf(row[v] - mx) * inv - (v == tgt ? 1.0f : 0.0f)) * grad_scale;
}

}  // namespace

void softmax_xent(float* logits, double* loss_rows, const int32_t* targets, int64_t n, int64_t V, int64_t ld,
                  float grad_scale, bool grad) {
  if (n <= 0) return;
  softmax_xent_kernel<<<unsigned(n), kThreads, 0, stream()>>>(logits, loss_rows, targets, V, ld, grad_scale, grad);
  SHARDLM_CUDA_LAUNCHED();
}

}  // namespace shardlm::kernels::cuda
