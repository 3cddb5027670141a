// CUDA backend: causal grouped-query attention, flash style. Keys and values stream through
// shared memory in tiles of 32 rows; each warp owns one query row (forward, dQ) or one key row
// (dK/dV), a lane owns one key (or query) of the tile for the scores and HS/32 head dimensions
// of the accumulators. Softmax is online in fp32; no (T, T) matrix is stored. The backward
// recomputes the probabilities from lse and splits into a dQ pass over keys and a dK/dV pass
// over queries, so nothing is added by atomics and the result does not depend on scheduling.
#include <cmath>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kTile = 32;  // keys (queries) per shared-memory tile: one per lane
constexpr int kRows = 8;   // warps per block: query (key) rows per block

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The packed qkv layout: rows of (NH + 2 NKV) HS floats; and the shapes of a launch over it.
struct Layout {
  int T, NH, NKV, HS;
  __host__ __device__ int64_t stride() const { return int64_t(NH + 2 * NKV) * HS; }
  __device__ int64_t row(int b, int t) const { return (int64_t(b) * T + t) * stride(); }
  __device__ int q_col(int h) const { return h * HS; }
  __device__ int k_col(int g) const { return (NH + g) * HS; }
  __device__ int v_col(int g) const { return (NH + NKV + g) * HS; }
  // Blocks of kRows rows (queries or keys) of each of `heads` heads of each of B sequences.
  dim3 grid(int heads, int64_t B) const { return dim3((T + kRows - 1) / kRows, heads, unsigned(B)); }
  // Shared memory of a block: two tiles of kTile rows (pitch HS + 1), `row_buffers` buffers of
  // the block's kRows rows, and `extra` floats.
  size_t smem(int row_buffers, int extra = 0) const {
    return sizeof(float) * (2 * kTile * (HS + 1) + row_buffers * kRows * HS + extra);
  }
  float scale() const { return 1.0f / std::sqrt(float(HS)); }  // of the scores q.k
};

// Copies rows r0.. r0+31 (zeros past T) of columns [col, col+HS) into dst (pitch HS+1).
__device__ void load_tile(float* dst, const float* src, int64_t src_stride, int r0, int T, int HS) {
  const int P = HS + 1, tid = threadIdx.y * 32 + threadIdx.x;
  for (int idx = tid; idx < kTile * HS; idx += kRows * 32) {
    const int r = idx / HS, d = idx % HS;
    dst[r * P + d] = r0 + r < T ? src[int64_t(r0 + r) * src_stride + d] : 0.0f;
  }
}

__device__ float dot_row(const float* a, const float* b, int HS) {
  float s = 0;
  for (int d = 0; d < HS; ++d) s += a[d] * b[d];
  return s;
}

template <int DPL>
__global__ void attn_fwd_kernel(float* out, float* lse, const float* qkv, Layout L, float scale) {
  extern __shared__ float sm[];
  const int HS = L.HS, P = HS + 1;
  float *sK = sm, *sV = sK + kTile * P, *sQ = sV + kTile * P;
  const int b = blockIdx.z, h = blockIdx.y, lane = threadIdx.x, i0 = blockIdx.x * kRows;
  const int i = i0 + threadIdx.y, g = h / (L.NH / L.NKV);
  const bool valid = i < L.T;
  float* q = sQ + threadIdx.y * HS;
  if (valid)
    for (int d = lane; d < HS; d += 32) q[d] = qkv[L.row(b, i) + L.q_col(h) + d];
  float m = -INFINITY, l = 0, acc[DPL] = {};
  const int last = min(L.T - 1, i0 + kRows - 1);
  const float* base = qkv + L.row(b, 0);
  for (int j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();
    load_tile(sK, base + L.k_col(g), L.stride(), j0, L.T, HS);
    load_tile(sV, base + L.v_col(g), L.stride(), j0, L.T, HS);
    __syncthreads();
    if (!valid || j0 > i) continue;
    const int j = j0 + lane;
    const float s = j <= i ? dot_row(q, sK + lane * P, HS) * scale : -INFINITY;
    const float mn = fmaxf(m, warp_max(s));  // finite: key j0 <= i is visible
    const float p = j <= i ? expf(s - mn) : 0.0f, corr = expf(m - mn);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] *= corr;
    const int n = min(kTile, i - j0 + 1);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        if (lane + 32 * k < HS) acc[k] += pj * sV[jj * P + lane + 32 * k];
    }
    m = mn;
  }
  if (!valid) return;
  float* o = out + (int64_t(b) * L.T + i) * L.NH * HS + h * HS;
#pragma unroll
  for (int k = 0; k < DPL; ++k)
    if (lane + 32 * k < HS) o[lane + 32 * k] = acc[k] / l;
  if (lane == 0) lse[(int64_t(b) * L.NH + h) * L.T + i] = m + logf(l);
}

// D[b,h,i] = dout_i . out_i (one warp per row).
__global__ void attn_rowdot_kernel(float* D, const float* dout, const float* out, int64_t rows, int T, int NH,
                                   int HS) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;  // r = (b, i, h) in out's order
  if (r >= rows) return;
  float s = 0;
  for (int d = threadIdx.x; d < HS; d += 32) s += dout[r * HS + d] * out[r * HS + d];
  s = warp_sum(s);
  const int64_t h = r % NH, bi = r / NH, b = bi / T, i = bi % T;
  if (threadIdx.x == 0) D[(b * NH + h) * T + i] = s;
}

// dQ_i += scale sum_j P_ij (dP_ij - D_i) k_j, P_ij = exp(scale q_i.k_j - lse_i), dP_ij = dout_i.v_j.
template <int DPL>
__global__ void attn_dq_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* D,
                               Layout L, float scale) {
  extern __shared__ float sm[];
  const int HS = L.HS, P = HS + 1;
  float *sK = sm, *sV = sK + kTile * P, *sQ = sV + kTile * P, *sO = sQ + kRows * HS;
  const int b = blockIdx.z, h = blockIdx.y, lane = threadIdx.x, i0 = blockIdx.x * kRows;
  const int i = i0 + threadIdx.y, g = h / (L.NH / L.NKV);
  const bool valid = i < L.T;
  float *q = sQ + threadIdx.y * HS, *dO = sO + threadIdx.y * HS;
  const int64_t orow = (int64_t(b) * L.T + i) * L.NH * HS + h * HS;
  if (valid)
    for (int d = lane; d < HS; d += 32) {
      q[d] = qkv[L.row(b, i) + L.q_col(h) + d];
      dO[d] = dout[orow + d];
    }
  const float li = valid ? lse[(int64_t(b) * L.NH + h) * L.T + i] : 0.0f;
  const float Di = valid ? D[(int64_t(b) * L.NH + h) * L.T + i] : 0.0f;
  float acc[DPL] = {};
  const int last = min(L.T - 1, i0 + kRows - 1);
  const float* base = qkv + L.row(b, 0);
  for (int j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();
    load_tile(sK, base + L.k_col(g), L.stride(), j0, L.T, HS);
    load_tile(sV, base + L.v_col(g), L.stride(), j0, L.T, HS);
    __syncthreads();
    if (!valid || j0 > i) continue;
    const int j = j0 + lane;
    float ds = 0;
    if (j <= i) {
      const float p = expf(dot_row(q, sK + lane * P, HS) * scale - li);
      ds = p * (dot_row(dO, sV + lane * P, HS) - Di);
    }
    const int n = min(kTile, i - j0 + 1);
    for (int jj = 0; jj < n; ++jj) {
      const float dj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        if (lane + 32 * k < HS) acc[k] += dj * sK[jj * P + lane + 32 * k];
    }
  }
  if (!valid) return;
  float* dq = dqkv + L.row(b, i) + L.q_col(h);
#pragma unroll
  for (int k = 0; k < DPL; ++k)
    if (lane + 32 * k < HS) dq[lane + 32 * k] += scale * acc[k];
}

// dV_j += sum_i P_ij dout_i ; dK_j += scale sum_i dS_ij q_i, over queries i >= j of every query
// head of key/value head g.
template <int DPL>
__global__ void attn_dkv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* D,
                                Layout L, float scale) {
  extern __shared__ float sm[];
  const int HS = L.HS, P = HS + 1;
  float *sQ = sm, *sO = sQ + kTile * P, *sKr = sO + kTile * P, *sVr = sKr + kRows * HS;
  float *sL = sVr + kRows * HS, *sD = sL + kTile;
  const int b = blockIdx.z, g = blockIdx.y, lane = threadIdx.x, j0b = blockIdx.x * kRows;
  const int j = j0b + threadIdx.y, group = L.NH / L.NKV;
  const bool valid = j < L.T;
  float *kj = sKr + threadIdx.y * HS, *vj = sVr + threadIdx.y * HS;
  if (valid)
    for (int d = lane; d < HS; d += 32) {
      kj[d] = qkv[L.row(b, j) + L.k_col(g) + d];
      vj[d] = qkv[L.row(b, j) + L.v_col(g) + d];
    }
  float dk[DPL] = {}, dv[DPL] = {};
  const int64_t ostride = int64_t(L.NH) * HS;
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const float* lse_h = lse + (int64_t(b) * L.NH + h) * L.T;
    const float* D_h = D + (int64_t(b) * L.NH + h) * L.T;
    for (int i0 = j0b / kTile * kTile; i0 < L.T; i0 += kTile) {
      __syncthreads();
      load_tile(sQ, qkv + L.row(b, 0) + L.q_col(h), L.stride(), i0, L.T, HS);
      load_tile(sO, dout + int64_t(b) * L.T * ostride + h * HS, ostride, i0, L.T, HS);
      const int tid = threadIdx.y * 32 + lane;
      if (tid < kTile) {
        sL[tid] = i0 + tid < L.T ? lse_h[i0 + tid] : 0.0f;
        sD[tid] = i0 + tid < L.T ? D_h[i0 + tid] : 0.0f;
      }
      __syncthreads();
      if (!valid || i0 + kTile - 1 < j) continue;
      const int i = i0 + lane;
      float p = 0, ds = 0;
      if (i >= j && i < L.T) {
        p = expf(dot_row(sQ + lane * P, kj, HS) * scale - sL[lane]);
        ds = p * (dot_row(sO + lane * P, vj, HS) - sD[lane]);
      }
      for (int ii = max(0, j - i0); ii < kTile; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii), di = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
        for (int k = 0; k < DPL; ++k)
          if (lane + 32 * k < HS) {
            dv[k] += pi * sO[ii * P + lane + 32 * k];
            dk[k] += di * sQ[ii * P + lane + 32 * k];
          }
      }
    }
  }
  if (!valid) return;
  float *dK = dqkv + L.row(b, j) + L.k_col(g), *dV = dqkv + L.row(b, j) + L.v_col(g);
#pragma unroll
  for (int k = 0; k < DPL; ++k)
    if (lane + 32 * k < HS) {
      dK[lane + 32 * k] += scale * dk[k];
      dV[lane + 32 * k] += dv[k];
    }
}

// kernel<<<grid, (32, kRows), smem>>>(args...) on the stream, above the default 48 KiB of
// dynamic shared memory where `smem` needs it.
template <class K, class... Args>
void launch(K kernel, dim3 grid, size_t smem, Args... args) {
  if (smem > 48 * 1024)
    SHARDLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, dim3(32, kRows), smem, stream()>>>(args...);
  SHARDLM_CUDA_LAUNCHED();
}

Layout layout(int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  if (NKV <= 0 || NH % NKV != 0) throw std::invalid_argument("attention: NKV must divide NH");
  if (HS <= 0 || HS > 256) throw std::invalid_argument("attention: head size must be in 1..256");
  return Layout{int(T), int(NH), int(NKV), int(HS)};
}

// Picks the instantiation whose accumulators hold HS (HS/32 dims per lane, rounded up).
#define SHARDLM_BY_DPL(HS, KERNEL, ...)                    \
  do {                                                      \
    const int dpl_ = int((HS + 31) / 32);                   \
    if (dpl_ <= 1) KERNEL<1>(__VA_ARGS__);                  \
    else if (dpl_ <= 2) KERNEL<2>(__VA_ARGS__);             \
    else if (dpl_ <= 4) KERNEL<4>(__VA_ARGS__);             \
    else KERNEL<8>(__VA_ARGS__);                            \
  } while (0)

template <int DPL>
void fwd(float* out, float* lse, const float* qkv, int64_t B, Layout L) {
  launch(attn_fwd_kernel<DPL>, L.grid(L.NH, B), L.smem(1), out, lse, qkv, L, L.scale());
}

template <int DPL>
void bwd(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* D, int64_t B, Layout L) {
  launch(attn_dq_kernel<DPL>, L.grid(L.NH, B), L.smem(2), dqkv, dout, qkv, lse, D, L, L.scale());
  launch(attn_dkv_kernel<DPL>, L.grid(L.NKV, B), L.smem(2, 2 * kTile), dqkv, dout, qkv, lse, D, L, L.scale());
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t HS) {
  const Layout L = layout(T, NH, NKV, HS);
  if (B * T == 0) return;
  SHARDLM_BY_DPL(HS, fwd, out, lse, qkv, B, L);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, float* scratch) {
  const Layout L = layout(T, NH, NKV, HS);
  if (B * T == 0) return;
  const int64_t rows = B * T * NH;
  attn_rowdot_kernel<<<unsigned((rows + kRows - 1) / kRows), dim3(32, kRows), 0, stream()>>>(scratch, dout, out, rows,
                                                                                           int(T), int(NH), int(HS));
  SHARDLM_CUDA_LAUNCHED();
  SHARDLM_BY_DPL(HS, bwd, dqkv, dout, qkv, lse, scratch, B, L);
}

}  // namespace shardlm::kernels::cuda
