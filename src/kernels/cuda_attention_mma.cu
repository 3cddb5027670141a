// CUDA backend: causal grouped-query flash attention on the tensor cores (mma.sync m16n8k16, bf16
// operands, fp32 accumulation). q, k, v (and in the backward dout) are first rounded to bf16 copies
// in device scratch, so the kernels stream 16-byte cp.async tiles into shared memory, two stages
// deep. Each warp owns 16 rows of its block's tile (queries in the forward and dQ, keys in dK/dV);
// the scores of a (16, BN) tile stay in registers, where their accumulator layout is already the
// A-operand layout of the next product (P V, dS K, ...). Softmax is online in fp32 (base 2);
// tiles above the diagonal are skipped. The backward recomputes the probabilities from lse and
// splits into a dQ pass over keys and a dK/dV pass over queries (a shared key/value head sums its
// group's heads in one block), so nothing is added by atomics and results do not depend on
// scheduling. Head sizes with a kernel instantiation: mma_attention_supports().
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarps = 4;  // 16 rows each: 64 rows per block
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kWarps * 16;

// ---- PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, zero-filled when !valid (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 bf16 matrices; lane l gives the row address (shared space) of matrix l/8.
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c += a b: a (16x16, row), b (16x8, col), c (16x8) fp32.
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- tile products for one warp. Tiles in shared memory are row-major with pitch P elements.

// The lane's address (bytes) is computed once per product; the tile steps are immediates.
// acc (16 x N) += A (16 x K rows of `a`) * B^T, B (N x K) row-major: scores from rows of q and k.
template <int K, int N, int P>
__device__ __forceinline__ void mma_abt(float acc[][4], const bf16* a, const bf16* b, int lane) {
  const uint32_t a0 = smem_addr(a + (lane % 16) * P + (lane / 16) * 8);
  const uint32_t b0 = smem_addr(b + (lane % 8 + (lane / 16) * 8) * P + ((lane / 8) & 1) * 8);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a0 + kk * 32);
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
      uint32_t bfr[4];
      ldsm_x4(bfr, b0 + (nt * 8 * P + kk * 16) * 2);
      mma(acc[nt], af, bfr[0], bfr[1]);
      mma(acc[nt + 1], af, bfr[2], bfr[3]);
    }
  }
}

// acc (16 x N) += S (16 x K, accumulator layout, rounded to bf16) * B, B (K x N) row-major.
template <int K, int N, int P>
__device__ __forceinline__ void mma_sb(float acc[][4], const float s[][4], const bf16* b, int lane) {
  const uint32_t b0 = smem_addr(b + (lane % 8 + ((lane / 8) & 1) * 8) * P + (lane / 16) * 8);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t af[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                            pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
      uint32_t bfr[4];
      ldsm_x4_t(bfr, b0 + (kk * 16 * P + nt * 8) * 2);
      mma(acc[nt], af, bfr[0], bfr[1]);
      mma(acc[nt + 1], af, bfr[2], bfr[3]);
    }
  }
}

// Rows r0.. r0+ROWS-1 (zero past T) of a (T, D) bf16 matrix with row stride ld into dst (pitch P).
template <int ROWS, int D, int P>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t ld, int r0, int T) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, k = (c % kChunks) * 8, row = r0 + r;
    const bool ok = row < T;
    cp_async16(dst + r * P + k, src + int64_t(ok ? row : 0) * ld + k, ok);
  }
}

// Element (nt, e) of a warp's (16, BN) accumulator tile: row r = e / 2 of the lane's two rows
// (lane/4 and lane/4 + 8), column nt * 8 + 2 (lane % 4) + (e & 1).
__device__ __forceinline__ int tile_col(int nt, int e, int lane) { return nt * 8 + 2 * (lane % 4) + (e & 1); }

// Forward scores to base-2 logits (times scale log2 e), and their row maxima into mx. MASK (tiles
// on the diagonal or past T only): keys after the row, or past T, to -inf.
template <int BN, bool MASK>
__device__ __forceinline__ void logits_tile(float s[][4], float mx[2], float scale_log2, int j0, const int row[2],
                                            int T, int lane) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[nt][e] * scale_log2;
      if (MASK) {
        const int col = j0 + tile_col(nt, e, lane);
        if (col > row[e / 2] || col >= T) x = -INFINITY;
      }
      s[nt][e] = x;
      mx[e / 2] = fmaxf(mx[e / 2], x);
    }
}

// dQ pass: s (scores) becomes dS = P (dP - D), P = 2^(s scale log2 e - lse log2 e) per row.
template <int BN, bool MASK>
__device__ __forceinline__ void dscores_rows(float s[][4], const float dp[][4], float scale_log2, const float lse2[2],
                                             const float Di[2], int j0, const int row[2], int T, int lane) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = exp2f(fmaf(s[nt][e], scale_log2, -lse2[e / 2]));
      if (MASK) {
        const int col = j0 + tile_col(nt, e, lane);
        if (col > row[e / 2] || col >= T) p = 0.0f;
      }
      s[nt][e] = p * (dp[nt][e] - Di[e / 2]);
    }
}

// dK/dV pass over transposed tiles (rows keys, columns queries q0..): st becomes P^T and dpt
// dS^T; lse and D are per column (lt, dt: the tile's, in shared memory).
template <int BN, bool MASK>
__device__ __forceinline__ void dscores_cols(float st[][4], float dpt[][4], float scale_log2, const float* lt,
                                             const float* dt, int q0, const int row[2], int T, int lane) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = tile_col(nt, e, lane);
      float p = exp2f(fmaf(st[nt][e], scale_log2, -lt[c] * kLog2e));
      if (MASK) {
        const int i = q0 + c;
        if (i < row[e / 2] || i >= T) p = 0.0f;
      }
      st[nt][e] = p;
      dpt[nt][e] = p * (dpt[nt][e] - dt[c]);
    }
}

// Forward: block = 64 queries of head h of sequence b; key tiles of BN stream through.
template <int D, int BN>
__global__ void __launch_bounds__(kThreads) fwd_kernel(float* out, float* lse, const bf16* qkv, int T, int NH,
                                                       int NKV, float scale_log2) {
  constexpr int P = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + kBlockRows * P;  // two stages
  bf16* sV = sK + 2 * BN * P;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, g = h / (NH / NKV);
  const int64_t W = int64_t(NH + 2 * NKV) * D;
  const bf16* base = qkv + int64_t(b) * T * W;
  const bf16 *kg = base + int64_t(NH + g) * D, *vg = base + int64_t(NH + NKV + g) * D;
  load_tile<kBlockRows, D, P>(sQ, base + int64_t(h) * D, W, i0, T);
  load_tile<BN, D, P>(sK, kg, W, 0, T);
  load_tile<BN, D, P>(sV, vg, W, 0, T);
  cp_commit();
  const int ntiles = (min(T - 1, i0 + kBlockRows - 1)) / BN + 1;
  const int wrow0 = i0 + warp * 16, row[2] = {wrow0 + lane / 4, wrow0 + lane / 4 + 8};
  float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
  for (int t = 0; t < ntiles; ++t) {
    if (t + 1 < ntiles) {
      const int s = (t + 1) & 1;
      load_tile<BN, D, P>(sK + s * BN * P, kg, W, (t + 1) * BN, T);
      load_tile<BN, D, P>(sV + s * BN * P, vg, W, (t + 1) * BN, T);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const int j0 = t * BN;
    if (j0 <= wrow0 + 15) {  // else every key of the tile is above this warp's diagonal
      float s[BN / 8][4] = {};
      mma_abt<D, BN, P>(s, sQ + warp * 16 * P, sK + (t & 1) * BN * P, lane);
      float mx[2] = {-INFINITY, -INFINITY};
      if (j0 + BN - 1 > wrow0 || j0 + BN > T)
        logits_tile<BN, true>(s, mx, scale_log2, j0, row, T, lane);
      else
        logits_tile<BN, false>(s, mx, scale_log2, j0, row, T, lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = fmaxf(m[r], mx[r]);
        const float base_r = mn == -INFINITY ? 0.0f : mn;  // a row that saw nothing yet
        const float corr = exp2f(m[r] - base_r);
        float sum = 0;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
          s[nt][2 * r] = exp2f(s[nt][2 * r] - base_r);
          s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - base_r);
          sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l[r] = l[r] * corr + sum;  // this thread's columns; the quad's sum is taken at the end
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          o[nt][2 * r] *= corr;
          o[nt][2 * r + 1] *= corr;
        }
        m[r] = mn;
      }
      mma_sb<BN, D, P>(o, s, sV + (t & 1) * BN * P, lane);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (row[r] >= T) continue;
    const float inv = 1.0f / l[r];
    float* orow = out + (int64_t(b) * T + row[r]) * NH * D + int64_t(h) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      *reinterpret_cast<float2*>(orow + nt * 8 + 2 * (lane % 4)) =
          make_float2(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    if (lane % 4 == 0) lse[(int64_t(b) * NH + h) * T + row[r]] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// dQ: block = 64 queries of head h; key tiles stream through.
// dQ_i += scale sum_j P_ij (dP_ij - D_i) k_j, P_ij = exp(scale q_i.k_j - lse_i), dP_ij = dout_i.v_j.
template <int D, int BN>
__global__ void __launch_bounds__(kThreads) dq_kernel(float* dqkv, const bf16* qkv, const bf16* dout,
                                                      const float* lse, const float* Drow, int T, int NH, int NKV,
                                                      float scale, float scale_log2) {
  constexpr int P = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sO = sQ + kBlockRows * P;
  bf16* sK = sO + kBlockRows * P;  // two stages
  bf16* sV = sK + 2 * BN * P;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;
  const int h = blockIdx.y, b = blockIdx.z, g = h / (NH / NKV);
  const int64_t W = int64_t(NH + 2 * NKV) * D, O = int64_t(NH) * D;
  const bf16* base = qkv + int64_t(b) * T * W;
  const bf16 *kg = base + int64_t(NH + g) * D, *vg = base + int64_t(NH + NKV + g) * D;
  load_tile<kBlockRows, D, P>(sQ, base + int64_t(h) * D, W, i0, T);
  load_tile<kBlockRows, D, P>(sO, dout + int64_t(b) * T * O + int64_t(h) * D, O, i0, T);
  load_tile<BN, D, P>(sK, kg, W, 0, T);
  load_tile<BN, D, P>(sV, vg, W, 0, T);
  cp_commit();
  const int ntiles = (min(T - 1, i0 + kBlockRows - 1)) / BN + 1;
  const int wrow0 = i0 + warp * 16, row[2] = {wrow0 + lane / 4, wrow0 + lane / 4 + 8};
  float lse2[2], Di[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t at = (int64_t(b) * NH + h) * T + row[r];
    lse2[r] = row[r] < T ? lse[at] * kLog2e : 0.0f;
    Di[r] = row[r] < T ? Drow[at] : 0.0f;
  }
  float dq[D / 8][4] = {};
  for (int t = 0; t < ntiles; ++t) {
    if (t + 1 < ntiles) {
      const int s = (t + 1) & 1;
      load_tile<BN, D, P>(sK + s * BN * P, kg, W, (t + 1) * BN, T);
      load_tile<BN, D, P>(sV + s * BN * P, vg, W, (t + 1) * BN, T);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const int j0 = t * BN;
    if (j0 <= wrow0 + 15) {
      const bf16 *k = sK + (t & 1) * BN * P, *v = sV + (t & 1) * BN * P;
      float s[BN / 8][4] = {}, dp[BN / 8][4] = {};
      mma_abt<D, BN, P>(s, sQ + warp * 16 * P, k, lane);
      mma_abt<D, BN, P>(dp, sO + warp * 16 * P, v, lane);
      if (j0 + BN - 1 > wrow0 || j0 + BN > T)
        dscores_rows<BN, true>(s, dp, scale_log2, lse2, Di, j0, row, T, lane);
      else
        dscores_rows<BN, false>(s, dp, scale_log2, lse2, Di, j0, row, T, lane);
      mma_sb<BN, D, P>(dq, s, k, lane);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= T) continue;
    float* dst = dqkv + (int64_t(b) * T + row[r]) * W + int64_t(h) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      float2* p2 = reinterpret_cast<float2*>(dst + nt * 8 + 2 * (lane % 4));
      float2 v = *p2;
      v.x += scale * dq[nt][2 * r];
      v.y += scale * dq[nt][2 * r + 1];
      *p2 = v;
    }
  }
}

// dK, dV: block = 64 keys of key/value head g; query tiles of every head of its group stream through.
// dV_j += sum_i P_ij dout_i ; dK_j += scale sum_i dS_ij q_i over queries i >= j.
template <int D, int BN>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 1) dkv_kernel(float* dqkv, const bf16* qkv, const bf16* dout,
                                                       const float* lse, const float* Drow, int T, int NH, int NKV,
                                                       float scale, float scale_log2) {
  constexpr int P = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + kBlockRows * P;
  bf16* sQ = sV + kBlockRows * P;  // two stages
  bf16* sO = sQ + 2 * BN * P;
  float* sL = reinterpret_cast<float*>(sO + 2 * BN * P);  // two stages of BN lse (base 2)
  float* sD = sL + 2 * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0b = blockIdx.x * kBlockRows;  // the longest (first) key blocks first
  const int g = blockIdx.y, b = blockIdx.z, group = NH / NKV;
  const int64_t W = int64_t(NH + 2 * NKV) * D, O = int64_t(NH) * D;
  const bf16* base = qkv + int64_t(b) * T * W;
  const bf16* dbase = dout + int64_t(b) * T * O;
  load_tile<kBlockRows, D, P>(sK, base + int64_t(NH + g) * D, W, j0b, T);
  load_tile<kBlockRows, D, P>(sV, base + int64_t(NH + NKV + g) * D, W, j0b, T);
  const int first = j0b / BN, per_head = (T + BN - 1) / BN - first, steps = group * per_head;
  // Step n: head g*group + n / per_head, query tile first + n % per_head, into stage n & 1.
  const auto load_step = [&](int n) {
    const int h = g * group + n / per_head, q0 = (first + n % per_head) * BN, s = n & 1;
    load_tile<BN, D, P>(sQ + s * BN * P, base + int64_t(h) * D, W, q0, T);
    load_tile<BN, D, P>(sO + s * BN * P, dbase + int64_t(h) * D, O, q0, T);
    const int64_t at = (int64_t(b) * NH + h) * T;
    for (int c = threadIdx.x; c < 2 * BN; c += kThreads) {
      const int i = q0 + c % BN;
      const bool ok = i < T;
      cp_async4(c < BN ? sL + s * BN + c : sD + s * BN + c - BN, (c < BN ? lse : Drow) + at + (ok ? i : 0), ok);
    }
  };
  load_step(0);
  cp_commit();
  const int wrow0 = j0b + warp * 16, row[2] = {wrow0 + lane / 4, wrow0 + lane / 4 + 8};
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int n = 0; n < steps; ++n) {
    if (n + 1 < steps) load_step(n + 1);
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const int q0 = (first + n % per_head) * BN, s_ = n & 1;
    if (q0 + BN - 1 >= wrow0) {  // else every query of the tile is before this warp's keys
      const bf16 *q = sQ + s_ * BN * P, *dO = sO + s_ * BN * P;
      const float *lt = sL + s_ * BN, *dt = sD + s_ * BN;
      float st[BN / 8][4] = {}, dpt[BN / 8][4] = {};
      mma_abt<D, BN, P>(st, sK + warp * 16 * P, q, lane);
      mma_abt<D, BN, P>(dpt, sV + warp * 16 * P, dO, lane);
      if (q0 < wrow0 + 15 || q0 + BN > T)
        dscores_cols<BN, true>(st, dpt, scale_log2, lt, dt, q0, row, T, lane);
      else
        dscores_cols<BN, false>(st, dpt, scale_log2, lt, dt, q0, row, T, lane);
      mma_sb<BN, D, P>(dv, st, dO, lane);
      mma_sb<BN, D, P>(dk, dpt, q, lane);
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= T) continue;
    float* kr = dqkv + (int64_t(b) * T + row[r]) * W + int64_t(NH + g) * D;
    float* vr = kr + int64_t(NKV) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const int c = nt * 8 + 2 * (lane % 4);
      float2 a = *reinterpret_cast<float2*>(kr + c), v = *reinterpret_cast<float2*>(vr + c);
      a.x += scale * dk[nt][2 * r];
      a.y += scale * dk[nt][2 * r + 1];
      v.x += dv[nt][2 * r];
      v.y += dv[nt][2 * r + 1];
      *reinterpret_cast<float2*>(kr + c) = a;
      *reinterpret_cast<float2*>(vr + c) = v;
    }
  }
}

// D[b,h,i] = dout_i . out_i over all rows (warp per row, fp32), and dout's bf16 copy on the way.
__global__ void rowdot_kernel(float* D, bf16* dout16, const float* dout, const float* out, int64_t rows, int T, int NH,
                              int HS) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;  // (b, i, h) in out's order
  if (r >= rows) return;
  float s = 0;
  for (int d = threadIdx.x; d < HS; d += 32) {
    const float x = dout[r * HS + d];
    s += x * out[r * HS + d];
    dout16[r * HS + d] = __float2bfloat16_rn(x);
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int64_t h = r % NH, bi = r / NH, b = bi / T, i = bi % T;
  if (threadIdx.x == 0) D[(b * NH + h) * T + i] = s;
}

template <class K, class... Args>
void launch(K kernel, dim3 grid, size_t smem, Args... args) {
  if (smem > 48 * 1024)
    SHARDLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, kThreads, smem, stream()>>>(args...);
  SHARDLM_CUDA_LAUNCHED();
}

// Key (query) tile width of each head size: registers hold two (16, BN) score tiles and the
// (16, D) accumulators of a warp.
template <int D>
constexpr int fwd_tile() { return 64; }
template <int D>
constexpr int bwd_tile() { return D > 64 ? 32 : 64; }

template <int D>
void forward(float* out, float* lse, const bf16* qkv, int64_t B, int T, int NH, int NKV) {
  constexpr int BN = fwd_tile<D>(), P = D + 8;
  const dim3 grid(unsigned((T + kBlockRows - 1) / kBlockRows), unsigned(NH), unsigned(B));
  const size_t smem = sizeof(bf16) * (kBlockRows + 4 * BN) * P;
  launch(fwd_kernel<D, BN>, grid, smem, out, lse, qkv, T, NH, NKV, kLog2e / std::sqrt(float(D)));
}

template <int D>
void backward(float* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* Drow, int64_t B, int T,
              int NH, int NKV) {
  constexpr int BN = bwd_tile<D>(), P = D + 8;
  const float scale = 1.0f / std::sqrt(float(D)), scale_log2 = scale * kLog2e;
  const unsigned blocks = unsigned((T + kBlockRows - 1) / kBlockRows);
  const size_t smem = sizeof(bf16) * (2 * kBlockRows + 4 * BN) * P;
  launch(dq_kernel<D, BN>, dim3(blocks, NH, unsigned(B)), smem, dqkv, qkv, dout, lse, Drow, T, NH, NKV, scale,
         scale_log2);
  launch(dkv_kernel<D, BN>, dim3(blocks, NKV, unsigned(B)), smem + sizeof(float) * 4 * BN, dqkv, qkv, dout, lse,
         Drow, T, NH, NKV, scale, scale_log2);
}

// The instantiation for HS (mma_attention_supports(HS) holds).
#define SHARDLM_BY_HEAD_SIZE(HS, FN, ...)    \
  do {                                       \
    if (HS == 64) FN<64>(__VA_ARGS__);       \
    else if (HS == 128) FN<128>(__VA_ARGS__); \
    else if (HS == 32) FN<32>(__VA_ARGS__);   \
    else FN<48>(__VA_ARGS__);                 \
  } while (0)

Buffer to_bf16(const Backend& backend, const float* x, int64_t n) {
  Buffer h = device_scratch(backend, sizeof(bf16) * n);
  fp32_to_bf16(static_cast<uint16_t*>(h.data()), x, n);
  return h;
}

}  // namespace

bool mma_attention_supports(int64_t HS) { return HS == 32 || HS == 48 || HS == 64 || HS == 128; }

void mma_attention_forward(const Backend& backend, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t HS) {
  const Buffer qkv16 = to_bf16(backend, qkv, B * T * (NH + 2 * NKV) * HS);
  const auto* q = static_cast<const bf16*>(qkv16.data());
  SHARDLM_BY_HEAD_SIZE(HS, forward, out, lse, q, B, int(T), int(NH), int(NKV));
}

void mma_attention_backward(const Backend& backend, float* dqkv, const float* dout, const float* qkv,
                            const float* out, const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t HS) {
  const int64_t rows = B * T * NH;
  Buffer Drow = device_scratch(backend, sizeof(float) * rows);
  Buffer dout16 = device_scratch(backend, sizeof(bf16) * rows * HS);
  rowdot_kernel<<<unsigned((rows + 7) / 8), dim3(32, 8), 0, stream()>>>(
      Drow.f32(), static_cast<bf16*>(dout16.data()), dout, out, rows, int(T), int(NH), int(HS));
  SHARDLM_CUDA_LAUNCHED();
  const Buffer qkv16 = to_bf16(backend, qkv, B * T * (NH + 2 * NKV) * HS);
  const auto *q = static_cast<const bf16*>(qkv16.data()), *d = static_cast<const bf16*>(dout16.data());
  SHARDLM_BY_HEAD_SIZE(HS, backward, dqkv, q, d, lse, Drow.f32(), B, int(T), int(NH), int(NKV));
}

}  // namespace shardlm::kernels::cuda
