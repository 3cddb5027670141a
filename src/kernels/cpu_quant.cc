// int8 activation compression: per-group absmax scales, nearest or stochastic rounding.
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu.h"

namespace shardlm::kernels {

namespace {
// splitmix64's finaliser: a stateless hash, so element i's draw depends on (key, i) only and
// neither on the thread that quantizes it nor on what was drawn before.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1) from the top 24 bits (a float holds them exactly, so u < 1 always).
inline float uniform(uint64_t key, uint64_t i) { return static_cast<float>(mix(key ^ mix(i)) >> 40) * 0x1p-24f; }
// std::round's and std::floor's results from std::nearbyint (ties to even), the one rounding GCC
// vectorized here (std::round, std::floor and std::trunc it left scalar); v - nearbyint(v) is
// exact. Equal to them on every float in [-130, 130] (checked exhaustively when written).
inline float round_half_away(float v) {
  const float n = std::nearbyint(v);
  return std::fabs(v - n) == 0.5f && std::fabs(n) < std::fabs(v) ? n + std::copysign(1.0f, v) : n;
}
inline float round_down(float v) {
  const float n = std::nearbyint(v);
  return n > v ? n - 1.0f : n;
}
}  // namespace

// The loops over a group are written for the compiler to vectorize (omp simd: the max and the
// sum are reductions it may reorder, which changes neither): a scalar loop with std::round and
// the rounding mode tested per value ran at 11 ns a value, about 15% of a step's time under int8.
// The bits are those of that loop.
void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, QuantRounding rounding) {
  if (group <= 0 || n % group != 0)
    throw std::invalid_argument("quantize_int8: " + std::to_string(n) + " values do not split into groups of " +
                                std::to_string(group));
  const int64_t groups = n / group;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * group;
    int8_t* qg = q + g * group;
    // A NaN or infinity anywhere in the group makes the scale non-finite (the max may drop a NaN,
    // the sum of x·0 keeps it): the backward then sees it rather than a silently clipped value.
    float amax = 0.0f, sum = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
    for (int64_t i = 0; i < group; ++i) {
      const float a = std::fabs(xg[i]);
      amax = a > amax ? a : amax;
      sum += xg[i] * 0.0f;
    }
    const float s = std::isfinite(sum) ? amax / 127.0f : std::nanf("");
    scales[g] = s;
    if (!(s > 0.0f) || !std::isfinite(s)) {
      for (int64_t i = 0; i < group; ++i) qg[i] = 0;
      continue;
    }
    const float inv = 127.0f / amax;  // |x · inv| <= 127
    if (rounding.stochastic) {
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) {
        const float r = round_down(xg[i] * inv + uniform(rounding.key, static_cast<uint64_t>(g * group + i)));
        qg[i] = static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) {
        const float r = round_half_away(xg[i] * inv);
        qg[i] = static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
      }
    }
  }
}

void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) {
  if (group <= 0 || n % group != 0)
    throw std::invalid_argument("dequantize_int8: " + std::to_string(n) + " values do not split into groups of " +
                                std::to_string(group));
  const int64_t groups = n / group;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const float s = scales[g];
#pragma omp simd
    for (int64_t i = g * group; i < (g + 1) * group; ++i) x[i] = static_cast<float>(q[i]) * s;
  }
}

}  // namespace shardlm::kernels
