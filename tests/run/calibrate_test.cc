#include "run/calibrate.h"

#include <gtest/gtest.h>

namespace shardlm::run {
namespace {

TEST(Calibrate, FitRecoversAlphaAndBusBandwidth) {
  std::vector<double> x, t;
  for (double S = 4096; S <= 64 << 20; S *= 4) x.push_back(S), t.push_back(25e-6 + S / 3.5e9);
  const LineFit f = fit_alpha_beta(x, t);
  EXPECT_NEAR(f.alpha, 25e-6, 1e-9);
  EXPECT_NEAR(f.bw, 3.5e9, 1e3);
}

// Ten per cent of noise on the 256 MiB point (77 ms) must not move the 25 µs latency far, as an
// unweighted fit would (to 0 or to 290 µs).
TEST(Calibrate, FitKeepsTheLatencyWhenTheLargestSizeIsNoisy) {
  for (double noise : {0.9, 1.1}) {
    std::vector<double> x, t;
    for (double S = 4096; S <= 256 << 20; S *= 4) x.push_back(S), t.push_back(25e-6 + S / 3.5e9);
    t.back() *= noise;
    const LineFit f = fit_alpha_beta(x, t);
    EXPECT_NEAR(f.alpha, 25e-6, 1e-6) << noise;
    EXPECT_NEAR(f.bw, 3.5e9, 0.05 * 3.5e9) << noise;
  }
}

// Noise that would put the intercept below zero: no negative latency, the line through the origin.
TEST(Calibrate, FitNeverGivesANegativeLatency) {
  const LineFit f = fit_alpha_beta({1e3, 1e6, 1e7}, {0, 0.9e-3, 1.0e-2});
  EXPECT_EQ(f.alpha, 0);
  EXPECT_GT(f.bw, 0);
}

}  // namespace
}  // namespace shardlm::run
