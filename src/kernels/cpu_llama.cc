// LLaMA-family layers: RMSNorm, rotary position embedding, SwiGLU, nn.Linear-layout dense.
// (Grouped-query attention lives in cpu_attention.cc.)
#include <cmath>
#include <stdexcept>

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"

namespace shardlm::kernels {

namespace {
constexpr int64_t kColBlock = 64;  // column block width for deterministic column reductions
}  // namespace

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
  const float fc = static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
    const float rs = 1.0f / std::sqrt(ss / fc + eps);  // torch: pow(2).mean(-1), rsqrt
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = weight[c] * (x[c] * rs);
    if (rstd) rstd[i] = rs;
  }
}

// y = w * n, n = x r, r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C, so with dn = dy w:
// dx = r (dn - n * mean(dn * n)).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  if (dinp) {
#pragma omp parallel for schedule(static) if (N * C > 16384)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = inp + i * C;
      const float* dy = dout + i * C;
      const float rs = rstd[i];
      float sb = 0.0f;
#pragma omp simd reduction(+ : sb)
      for (int64_t c = 0; c < C; ++c) sb += (dy[c] * weight[c]) * (x[c] * rs);
      const float b = sb * inv_c;
      float* dx = dinp + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dx[c] += (dy[c] * weight[c] - (x[c] * rs) * b) * rs;
    }
  }
  if (dweight) {
    // Column blocks, rows summed in order: deterministic for any thread count.
    const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < nblk; ++bk) {
      const int64_t c0 = bk * kColBlock;
      const int64_t w = (C - c0) < kColBlock ? (C - c0) : kColBlock;
      float aw[kColBlock] = {};
      for (int64_t i = 0; i < N; ++i) {
        const float* x = inp + i * C + c0;
        const float* dy = dout + i * C + c0;
        const float rs = rstd[i];
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) aw[c] += dy[c] * (x[c] * rs);
      }
      for (int64_t c = 0; c < w; ++c) dweight[c0 + c] += aw[c];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding
// ---------------------------------------------------------------------------------------------

int64_t rope_table_floats(int64_t T, int64_t HS) { return T * HS; }

void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope) {
  if (HS <= 0 || HS % 2 != 0) throw std::invalid_argument("rope_table: HS must be even");
  if (T <= 0) return;
  const int64_t H2 = HS / 2;
  // The frequencies are kept in row 0's cos slots while rows 1..T-1 are filled (no heap
  // allocation); row 0 (angle 0) is written last.
  float* inv = cos_sin;
  for (int64_t i = 0; i < H2; ++i) inv[i] = rope_inv_freq(i, HS, rope);
#pragma omp parallel for schedule(static) if (T * H2 > 8192)
  for (int64_t t = 1; t < T; ++t) {
    float* c = cos_sin + t * HS;
    float* s = c + H2;
    const float pos = static_cast<float>(t);
    for (int64_t i = 0; i < H2; ++i) {
      const float ang = pos * inv[i];  // fp32 product, as HF
      c[i] = static_cast<float>(std::cos(static_cast<double>(ang)));
      s[i] = static_cast<float>(std::sin(static_cast<double>(ang)));
    }
  }
  for (int64_t i = 0; i < H2; ++i) {
    cos_sin[i] = 1.0f;
    cos_sin[H2 + i] = 0.0f;
  }
}

namespace {
// INVERSE = false: the rotation; true: its inverse (transpose).
template <bool INVERSE>
void rope_apply(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                const float* cos_sin) {
  if (HS <= 0 || HS % 2 != 0) throw std::invalid_argument("rope: HS must be even");
  if (row_stride < n_heads * HS) throw std::invalid_argument("rope: row_stride < n_heads*HS");
  const int64_t H2 = HS / 2;
#pragma omp parallel for schedule(static) if (B * T * n_heads * HS > 32768)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* c = cos_sin + (bt % T) * HS;
    const float* s = c + H2;
    float* row = x + bt * row_stride;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* a = row + h * HS;
      float* b = a + H2;
#pragma omp simd
      for (int64_t i = 0; i < H2; ++i) {
        const float x1 = a[i], x2 = b[i];
        if (INVERSE) {
          a[i] = x1 * c[i] + x2 * s[i];
          b[i] = x2 * c[i] - x1 * s[i];
        } else {
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  }
}
}  // namespace

void rope_forward(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS,
                  int64_t row_stride, const float* cos_sin) {
  rope_apply<false>(x, B, T, n_heads, HS, row_stride, cos_sin);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t n_heads, int64_t HS,
                   int64_t row_stride, const float* cos_sin) {
  rope_apply<true>(dx, B, T, n_heads, HS, row_stride, cos_sin);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------------------------

void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* g = gate_up + i * 2 * F;
    const float* u = g + F;
    float* o = out + i * F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const float x = g[j];
      o[j] = x / (1.0f + detail::exp_fast(-x)) * u[j];
    }
  }
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                     int64_t F) {
#pragma omp parallel for schedule(static) if (N * F > 16384)
  for (int64_t i = 0; i < N; ++i) {
    const float* g = gate_up + i * 2 * F;
    const float* u = g + F;
    const float* dy = dout + i * F;
    float* dg = dgate_up + i * 2 * F;
    float* du = dg + F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const float x = g[j];
      const float sg = 1.0f / (1.0f + detail::exp_fast(-x));
      const float silu = x * sg;
      dg[j] += dy[j] * u[j] * (sg * (1.0f + x * (1.0f - sg)));
      du[j] += dy[j] * silu;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dense (nn.Linear layout, no bias)
// ---------------------------------------------------------------------------------------------

void dense_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                   int64_t OC) {
  // (N,C) @ (OC,C)^T
  matmul(false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC);
}

void dense_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                    const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (dinp)  // (N,OC) @ (OC,C)
    matmul(false, false, N, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C);
  if (dweight)  // (N,OC)^T @ (N,C)
    matmul(true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
}

}  // namespace shardlm::kernels
