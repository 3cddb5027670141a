// LayerNorm, GELU, residual, embedding.
#include <cmath>

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"

namespace shardlm::kernels {

namespace {
constexpr float kLnEps = 1e-5f;
constexpr int64_t kColBlock = 64;  // column block width for deterministic column reductions
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; ++c) s += x[c];
    const float mu = s * inv_c;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int64_t c = 0; c < C; ++c) {
      const float d = x[c] - mu;
      v += d * d;
    }
    const float rs = 1.0f / std::sqrt(v * inv_c + kLnEps);
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - mu) * rs * weight[c] + bias[c];
    if (mean) mean[i] = mu;
    if (rstd) rstd[i] = rs;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = inp + i * C;
      const float* dy = dout + i * C;
      const float mu = mean[i], rs = rstd[i];
      float sa = 0.0f, sb = 0.0f;
#pragma omp simd reduction(+ : sa, sb)
      for (int64_t c = 0; c < C; ++c) {
        const float dn = dy[c] * weight[c];
        sa += dn;
        sb += dn * ((x[c] - mu) * rs);
      }
      const float a = sa * inv_c, b = sb * inv_c;
      float* dx = dinp + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float dn = dy[c] * weight[c];
        const float nrm = (x[c] - mu) * rs;
        dx[c] += (dn - a - nrm * b) * rs;
      }
    }
  }
  if (dweight || dbias) {
    // Parameter grads: column blocks, rows summed in order (deterministic, any thread count).
    const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < nblk; ++bk) {
      const int64_t c0 = bk * kColBlock;
      const int64_t w = (C - c0) < kColBlock ? (C - c0) : kColBlock;
      float aw[kColBlock] = {}, ab[kColBlock] = {};
      for (int64_t i = 0; i < N; ++i) {
        const float* x = inp + i * C + c0;
        const float* dy = dout + i * C + c0;
        const float mu = mean[i], rs = rstd[i];
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) {
          aw[c] += dy[c] * ((x[c] - mu) * rs);
          ab[c] += dy[c];
        }
      }
      for (int64_t c = 0; c < w; ++c) {
        if (dweight) dweight[c0 + c] += aw[c];
        if (dbias) dbias[c0 + c] += ab[c];
      }
    }
  }
}

namespace {
constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluK1 = 0.044715f;
}  // namespace

// 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = k0 (x + k1 x^3).
void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluK0 * (x + kGeluK1 * x * x * x);
    out[i] = x / (1.0f + detail::exp_fast(-2.0f * u));
  }
}

// d/dx = s + 2 x s (1 - s) k0 (1 + 3 k1 x^2), s = sigmoid(2u)
// (== 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k0 (1 + 3 k1 x^2)).
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float x2 = x * x;
    const float u = kGeluK0 * (x + kGeluK1 * x2 * x);
    const float s = 1.0f / (1.0f + detail::exp_fast(-2.0f * u));
    const float grad = s + 2.0f * x * s * (1.0f - s) * kGeluK0 * (1.0f + 3.0f * kGeluK1 * x2);
    dinp[i] += grad * dout[i];
  }
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* e = wte + static_cast<int64_t>(tokens[bt]) * C;
    float* o = out + bt * C;
    if (!wpe) {
      for (int64_t c = 0; c < C; ++c) o[c] = e[c];
      continue;
    }
    const float* p = wpe + (bt % T) * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C) {
  if (dwte) {
    // Each thread owns whole channel blocks of every row of dwte: repeated tokens are summed
    // in (b,t) order, no races.
    const int64_t nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < nblk; ++bk) {
      const int64_t c0 = bk * kColBlock;
      const int64_t w = (C - c0) < kColBlock ? (C - c0) : kColBlock;
      for (int64_t bt = 0; bt < B * T; ++bt) {
        float* d = dwte + static_cast<int64_t>(tokens[bt]) * C + c0;
        const float* g = dout + bt * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) d[c] += g[c];
      }
    }
  }
  if (dwpe) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* d = dwpe + t * C;
      for (int64_t b = 0; b < B; ++b) {
        const float* g = dout + (b * T + t) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) d[c] += g[c];
      }
    }
  }
}

}  // namespace shardlm::kernels
