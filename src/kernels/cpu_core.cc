// Set-up, GEMM, linear layers, optimizer and small utilities.
#include <omp.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include <dnnl.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"

namespace shardlm::kernels {

void init_compute(int threads) {
  if (threads < 1) threads = 1;
  omp_set_num_threads(threads);
#pragma omp parallel num_threads(threads)
  {
#if defined(__x86_64__) || defined(__i386__)
    // FTZ (bit 15) + DAZ (bit 6).
    _mm_setcsr(_mm_getcsr() | 0x8040u);
#endif
  }
  // The calling thread is the master of the region above, but set it explicitly anyway.
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(_mm_getcsr() | 0x8040u);
#endif
}

void matmul(bool transA, bool transB, int64_t M, int64_t N, int64_t K, float alpha,
            const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
            int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta * C (oneDNN may reject K = 0)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(transA ? 'T' : 'N', transB ? 'T' : 'N', M, N, K, alpha, A,
                                      lda, B, ldb, beta, C, ldc);
  if (st != dnnl_success)
    throw std::runtime_error("kernels::matmul: dnnl_sgemm failed with status " +
                             std::to_string(static_cast<int>(st)));
}

void linear_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC) {
  float beta = 0.0f;
  if (bias) {
    // Broadcast the bias into out, then let the GEMM accumulate on top of it.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* o = out + i * OC;
#pragma omp simd
      for (int64_t j = 0; j < OC; ++j) o[j] = bias[j];
    }
    beta = 1.0f;
  }
  matmul(false, false, N, OC, C, 1.0f, inp, C, weight, OC, beta, out, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (dinp)  // (N,OC) @ (C,OC)^T
    matmul(false, true, N, C, OC, 1.0f, dout, OC, weight, OC, 1.0f, dinp, C);
  if (dweight)  // (N,C)^T @ (N,OC)
    matmul(true, false, C, OC, N, 1.0f, inp, C, dout, OC, 1.0f, dweight, OC);
  if (dbias) {
    // Column blocks, rows summed in order: deterministic and thread-count independent.
    constexpr int64_t W = 64;
    const int64_t nblk = (OC + W - 1) / W;
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < nblk; ++bk) {
      const int64_t j0 = bk * W, w = (OC - j0) < W ? (OC - j0) : W;
      float acc[W] = {};
      for (int64_t i = 0; i < N; ++i) {
        const float* d = dout + i * OC + j0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) acc[j] += d[j];
      }
      for (int64_t j = 0; j < w; ++j) dbias[j0 + j] += acc[j];
    }
  }
}

namespace {
// One contiguous piece of the AdamW update. GCC does not vectorise a loop containing sqrt
// unless -fno-math-errno is given (the project's flags do not), so the AVX-512 path spells
// the sqrt out; the arithmetic (and its order) is the same in both paths.
void adamw_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, int64_t n, float decay, float w1, bool lerp_low,
                 float beta2, float w2, float bc2_sqrt, float eps, float neg_step) {
  int64_t i = 0;
#if defined(__AVX512F__)
  using detail::v16;
  for (; i + 16 <= n; i += 16) {
    const v16 gi = detail::vload(g + i);
    const v16 pi = detail::vload(p + i) * decay;
    const v16 m0 = detail::vload(m + i);
    const v16 mi = lerp_low ? m0 + w1 * (gi - m0) : gi - (gi - m0) * (1.0f - w1);
    const v16 vi = detail::vload(v + i) * beta2 + w2 * gi * gi;
    const v16 denom = v16(_mm512_mask_sqrt_ps(__m512(vi), 0xFFFF, __m512(vi))) / bc2_sqrt + eps;
    detail::vstore(m + i, mi);
    detail::vstore(v + i, vi);
    detail::vstore(p + i, pi + neg_step * mi / denom);
  }
#endif
  for (; i < n; ++i) {
    const float gi = g[i];
    const float pi = p[i] * decay;
    const float m0 = m[i];
    const float mi = lerp_low ? m0 + w1 * (gi - m0) : gi - (gi - m0) * (1.0f - w1);
    const float vi = v[i] * beta2 + w2 * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi + neg_step * mi / denom;
  }
}
}  // namespace

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  // Scalars as torch computes them (Python doubles), then used as float in the fp32 kernels.
  const double lr_d = lr, b1 = beta1, b2 = beta2;
  const float decay = static_cast<float>(1.0 - lr_d * static_cast<double>(weight_decay));
  const float w1 = static_cast<float>(1.0 - b1);  // lerp weight
  const float w2 = static_cast<float>(1.0 - b2);  // addcmul value
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  const float neg_step = static_cast<float>(-(lr_d / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const bool lerp_low = std::fabs(w1) < 0.5f;  // torch's lerp picks the formula by |weight|
  constexpr int64_t kBlk = 16384;
  const int64_t nblk = (n + kBlk - 1) / kBlk;
#pragma omp parallel for schedule(static) if (nblk > 1)
  for (int64_t bk = 0; bk < nblk; ++bk) {
    const int64_t lo = bk * kBlk, len = (n - lo) < kBlk ? (n - lo) : kBlk;
    adamw_range(p + lo, g + lo, m + lo, v + lo, len, decay, w1, lerp_low, beta2, w2, bc2_sqrt,
                eps, neg_step);
  }
}

double sum_squares(const float* x, int64_t n) {
  // Fixed chunking that depends on n only; each chunk summed in double in a fixed order,
  // chunk sums added in order.
  constexpr int64_t kChunks = 64;
  double part[kChunks];
  const int64_t per = (n + kChunks - 1) / kChunks;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t c = 0; c < kChunks; ++c) {
    const int64_t lo = c * per < n ? c * per : n;
    const int64_t hi = lo + per < n ? lo + per : n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) {
      const double d = x[i];
      s += d * d;
    }
    part[c] = s;
  }
  double total = 0.0;
  for (int64_t c = 0; c < kChunks; ++c) total += part[c];
  return total;
}

void scale(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void fp32_to_bf16(uint16_t* out, const float* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(detail::float_to_bits(in[i]));
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

void bf16_to_fp32(float* out, const uint16_t* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i)
    out[i] = detail::bits_to_float(static_cast<int32_t>(static_cast<uint32_t>(in[i]) << 16));
}

}  // namespace shardlm::kernels
