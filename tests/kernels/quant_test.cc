// int8 activation compression against a plain reference: per-group absmax scales, the round trip
// within half a scale step (nearest), stochastic rounding unbiased and reproducible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu.h"

namespace shardlm::kernels {
namespace {

std::vector<float> sample(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  // Groups of very different magnitudes, so a shared scale would fail the bound.
  for (int64_t i = 0; i < n; ++i) x[i] = nd(rng) * std::pow(10.0f, static_cast<float>((i / 64) % 7) - 3.0f);
  return x;
}

TEST(QuantTest, ScalesAreGroupAbsmaxAndNearestRoundTripWithinHalfAStep) {
  for (int64_t group : {64, 32, 128}) {
    const int64_t n = 64 * 1024 + 0;  // several parallel chunks
    const std::vector<float> x = sample(n, 7);
    std::vector<int8_t> q(n);
    std::vector<float> s(n / group), y(n);
    quantize_int8(q.data(), s.data(), x.data(), n, group, {});
    dequantize_int8(y.data(), q.data(), s.data(), n, group);
    for (int64_t g = 0; g < n / group; ++g) {
      float amax = 0;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[g * group + i]));
      ASSERT_FLOAT_EQ(s[g], amax / 127.0f) << "group " << g;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        ASSERT_GE(q[i], -127);
        // The reference: x / s rounded to nearest; the kernel may differ by a rounding tie only.
        ASSERT_NEAR(q[i], std::round(x[i] / s[g]), 1) << i;
        ASSERT_LE(std::fabs(x[i] - y[i]), s[g] / 2 * (1 + 1e-5f)) << "element " << i << " group " << group;
      }
    }
  }
}

// A value exactly half-way between two steps goes away from zero, as std::round takes it (the
// vectorized rounding keeps the scalar loop's bits): with a group's largest magnitude 127 a step
// is 1, and k + 0.5 becomes k + 1 above zero and k below it.
TEST(QuantTest, NearestRoundsTiesAwayFromZero) {
  const int64_t group = 64, n = 4 * group;
  std::vector<float> x(n);
  for (int64_t g = 0; g < n / group; ++g) {
    x[g * group] = 127.0f;
    for (int64_t i = 1; i < group; ++i) x[g * group + i] = static_cast<float>((g * 63 + i) % 253 - 126) + 0.5f;
  }
  std::vector<int8_t> q(n);
  std::vector<float> s(n / group);
  quantize_int8(q.data(), s.data(), x.data(), n, group, {});
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], static_cast<int8_t>(std::round(x[i]))) << x[i];
  EXPECT_EQ(q[1], static_cast<int8_t>(-125));  // -124.5: away from zero (ties to even: -124)
  EXPECT_EQ(q[2], static_cast<int8_t>(-124));  // -123.5
}

TEST(QuantTest, ZeroGroupAndNonFiniteInput) {
  std::vector<float> x(128, 0.0f);
  x[64 + 3] = std::nanf("");
  std::vector<int8_t> q(128, 5);
  std::vector<float> s(2), y(128);
  quantize_int8(q.data(), s.data(), x.data(), 128, 64, {});
  dequantize_int8(y.data(), q.data(), s.data(), 128, 64);
  EXPECT_EQ(s[0], 0.0f);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(y[i], 0.0f);
  EXPECT_TRUE(std::isnan(s[1]));  // not hidden: the backward sees the NaN
  EXPECT_TRUE(std::isnan(y[64]));
  x[3] = INFINITY;
  quantize_int8(q.data(), s.data(), x.data(), 128, 64, {});
  EXPECT_FALSE(std::isfinite(s[0]));
}

TEST(QuantTest, RefusesGroupsThatDoNotDivide) {
  std::vector<float> x(100);
  std::vector<int8_t> q(100);
  std::vector<float> s(2);
  EXPECT_THROW(quantize_int8(q.data(), s.data(), x.data(), 100, 64, {}), std::invalid_argument);
  EXPECT_THROW(dequantize_int8(x.data(), q.data(), s.data(), 100, 64), std::invalid_argument);
}

TEST(QuantTest, StochasticRoundingIsUnbiasedAndReproducible) {
  const int64_t n = 256, group = 64, draws = 4000;
  const std::vector<float> x = sample(n, 11);
  std::vector<int8_t> q(n), q2(n);
  std::vector<float> s(n / group), y(n);
  std::vector<double> mean(n, 0.0);
  for (int64_t d = 0; d < draws; ++d) {
    quantize_int8(q.data(), s.data(), x.data(), n, group, {true, 0x1234u + static_cast<uint64_t>(d) * 7919u});
    dequantize_int8(y.data(), q.data(), s.data(), n, group);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_LT(std::fabs(x[i] - y[i]), s[i / group]) << "a draw lands on one of the two neighbours";
      mean[i] += y[i] / draws;
    }
  }
  // Each draw's error is within one step, so its spread is at most s/2; the mean of `draws`
  // independent draws is within 5 standard errors of x (and nearest rounding is not: its bias
  // is up to s/2, far above that for most elements).
  int biased_if_nearest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double step = s[i / group], se = step / 2 / std::sqrt(static_cast<double>(draws));
    EXPECT_NEAR(mean[i], x[i], 5 * se + 1e-12) << "element " << i;
    const double nearest = std::round(x[i] / step) * step;
    if (std::fabs(nearest - x[i]) > 5 * se) ++biased_if_nearest;
  }
  EXPECT_GT(biased_if_nearest, n / 2) << "the test would not tell nearest from stochastic";
  // The same key gives the same values; another key, others.
  quantize_int8(q.data(), s.data(), x.data(), n, group, {true, 99});
  quantize_int8(q2.data(), s.data(), x.data(), n, group, {true, 99});
  EXPECT_EQ(q, q2);
  quantize_int8(q2.data(), s.data(), x.data(), n, group, {true, 100});
  EXPECT_NE(q, q2);
}

TEST(QuantTest, StochasticDrawsDoNotDependOnThreadCount) {
  const int64_t n = 64 * 4096;
  const std::vector<float> x = sample(n, 3);
  std::vector<int8_t> a(n), b(n);
  std::vector<float> s(n / 64);
  init_compute(1);
  quantize_int8(a.data(), s.data(), x.data(), n, 64, {true, 5});
  init_compute(2);
  quantize_int8(b.data(), s.data(), x.data(), n, 64, {true, 5});
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace shardlm::kernels
