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
}  // namespace

void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, QuantRounding rounding) {
  if (group <= 0 || n % group != 0)
    throw std::invalid_argument("quantize_int8: " + std::to_string(n) + " values do not split into groups of " +
                                std::to_string(group));
  const int64_t groups = n / group;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * group;
    int8_t* qg = q + g * group;
    float amax = 0.0f;
    for (int64_t i = 0; i < group; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
    // A NaN or infinity anywhere in the group makes the scale non-finite (fmax drops NaN, so
    // check the sum too): the backward then sees it rather than a silently clipped value.
    float sum = 0.0f;
    for (int64_t i = 0; i < group; ++i) sum += xg[i] * 0.0f;
    const float s = std::isfinite(sum) ? amax / 127.0f : std::nanf("");
    scales[g] = s;
    if (!(s > 0.0f) || !std::isfinite(s)) {
      for (int64_t i = 0; i < group; ++i) qg[i] = 0;
      continue;
    }
    const float inv = 127.0f / amax;
    for (int64_t i = 0; i < group; ++i) {
      const float v = xg[i] * inv;  // in [-127, 127]
      float r = rounding.stochastic ? std::floor(v + uniform(rounding.key, static_cast<uint64_t>(g * group + i)))
                                    : std::round(v);
      r = std::fmin(127.0f, std::fmax(-127.0f, r));
      qg[i] = static_cast<int8_t>(r);
    }
  }
}

void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) {
  if (group <= 0 || n % group != 0)
    throw std::invalid_argument("dequantize_int8: " + std::to_string(n) + " values do not split into groups of " +
                                std::to_string(group));
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(q[i]) * scales[i / group];
}

}  // namespace shardlm::kernels
