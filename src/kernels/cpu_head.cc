// Language-model head (tied embedding) fused with softmax cross-entropy, in row chunks.
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"

namespace shardlm::kernels {

// (chunk, Vp) logits + one double (two floats) of loss per row.
int64_t head_scratch(int64_t chunk, int64_t Vp) { return chunk * Vp + 2 * chunk; }

double lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte,
                             const int32_t* targets, int64_t N, int64_t C, int64_t V,
                             int64_t Vp, float grad_scale, int64_t chunk, float* scratch,
                             float* logits_out) {
  if (chunk <= 0 || chunk > N) chunk = N;
  if (N <= 0) return 0.0;
  if (targets)
    for (int64_t i = 0; i < N; ++i)
      if (targets[i] >= V)
        throw std::out_of_range("lm_head_cross_entropy: target " + std::to_string(targets[i]) +
                                " >= V at row " + std::to_string(i));
  const bool grad = (dx != nullptr || dwte != nullptr) && targets != nullptr;
  float* logits = scratch;                   // (chunk, Vp), only the first V columns used
  float* rowloss = scratch + chunk * Vp;     // (chunk) doubles, stored bytewise
  double total = 0.0;

  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = (N - r0) < chunk ? (N - r0) : chunk;
    const float* xc = x + r0 * C;
    // logits (n, V) = x_chunk (n, C) @ wte[:V]^T
    matmul(false, true, n, V, C, 1.0f, xc, C, wte, C, 0.0f, logits, Vp);

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* z = logits + r * Vp;
      if (logits_out) std::memcpy(logits_out + (r0 + r) * V, z, sizeof(float) * V);
      const int32_t t = targets ? targets[r0 + r] : -1;
      float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < V; ++j) mx = z[j] > mx ? z[j] : mx;
      const float zt = t >= 0 ? z[t] : 0.0f;
      float s = 0.0f;
      if (grad) {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < V; ++j) {
          const float e = detail::exp_fast(z[j] - mx);
          z[j] = e;
          s += e;
        }
      } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < V; ++j) s += detail::exp_fast(z[j] - mx);
      }
      const double loss =
          t >= 0 ? static_cast<double>(mx) + std::log(static_cast<double>(s)) - zt : 0.0;
      std::memcpy(rowloss + 2 * r, &loss, sizeof loss);
      if (grad) {
        if (t < 0) {
          std::memset(z, 0, sizeof(float) * V);
        } else {
          // dlogits = (softmax - onehot) * grad_scale, in place
          const float f = grad_scale / s;
#pragma omp simd
          for (int64_t j = 0; j < V; ++j) z[j] *= f;
          z[t] -= grad_scale;
        }
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      double loss;
      std::memcpy(&loss, rowloss + 2 * r, sizeof loss);
      total += loss;
    }
    if (grad) {
      // dx (n, C) += dlogits (n, V) @ wte[:V] (V, C)
      if (dx) matmul(false, false, n, C, V, 1.0f, logits, Vp, wte, C, 1.0f, dx + r0 * C, C);
      // dwte[:V] (V, C) += dlogits^T (V, n) @ x_chunk (n, C)
      if (dwte) matmul(true, false, V, C, n, 1.0f, logits, Vp, xc, C, 1.0f, dwte, C);
    }
  }
  return total;
}

}  // namespace shardlm::kernels
