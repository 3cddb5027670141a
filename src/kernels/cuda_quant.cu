// CUDA backend: int8 activation compression (--act-quant), bit for bit the CPU's
// (kernels/cpu_quant.cc): the same absmax scale, the same hash for stochastic rounding's draws, and
// the products and sums rounded alone (__fmul_rn, __fadd_rn), as the CPU computes them without
// fused multiply-adds, so neither rounding nor clipping can differ.
#include <cstdint>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kWarps = 8;  // groups per block, a warp each

__device__ uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ float uniform(uint64_t key, uint64_t i) { return static_cast<float>(mix(key ^ mix(i)) >> 40) * 0x1p-24f; }

__device__ int8_t clip127(float r) { return static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r)); }

// One warp per group: its absmax (the max is exact in any order) and whether it holds a NaN or an
// infinity (the sum of x·0, likewise), then each value scaled and rounded.
__global__ void quantize_kernel(int8_t* q, float* scales, const float* x, int64_t groups, int64_t group,
                                bool stochastic, uint64_t key) {
  const int64_t g = blockIdx.x * int64_t(kWarps) + threadIdx.y;
  if (g >= groups) return;
  const float* xg = x + g * group;
  int8_t* qg = q + g * group;
  float amax = 0.0f, sum = 0.0f;
  for (int64_t i = threadIdx.x; i < group; i += 32) {
    const float a = fabsf(xg[i]);
    amax = a > amax ? a : amax;
    sum += xg[i] * 0.0f;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, amax, o);
    amax = m > amax ? m : amax;
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  const float s = isfinite(sum) ? __fdiv_rn(amax, 127.0f) : __int_as_float(0x7fc00000);
  if (threadIdx.x == 0) scales[g] = s;
  if (!(s > 0.0f) || !isfinite(s)) {
    for (int64_t i = threadIdx.x; i < group; i += 32) qg[i] = 0;
    return;
  }
  const float inv = __fdiv_rn(127.0f, amax);
  for (int64_t i = threadIdx.x; i < group; i += 32) {
    const float v = __fmul_rn(xg[i], inv);
    qg[i] = clip127(stochastic ? floorf(__fadd_rn(v, uniform(key, static_cast<uint64_t>(g * group + i)))) : roundf(v));
  }
}

__global__ void dequantize_kernel(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __fmul_rn(static_cast<float>(q[i]), scales[i / group]);
}

}  // namespace

void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, bool stochastic, uint64_t key) {
  const int64_t groups = n / group;
  if (groups == 0) return;
  quantize_kernel<<<static_cast<unsigned>((groups + kWarps - 1) / kWarps), dim3(32, kWarps), 0, stream()>>>(
      q, scales, x, groups, group, stochastic, key);
  SHARDLM_CUDA_LAUNCHED();
}

void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) {
  if (n == 0) return;
  dequantize_kernel<<<blocks_for(n, 256), 256, 0, stream()>>>(x, q, scales, n, group);
  SHARDLM_CUDA_LAUNCHED();
}

}  // namespace shardlm::kernels::cuda
