// Helpers shared by the kernel tests: random data, double conversion, NaN-filled scratch,
// tolerance comparison, central finite differences, the accumulate-fill convention.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

namespace kernel_test {

using dvec = std::vector<double>;
using fvec = std::vector<float>;

inline fvec randv(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  fvec v(n);
  for (auto& x : v) x = u(rng);
  return v;
}
inline dvec tod(const fvec& v) { return dvec(v.begin(), v.end()); }
// Scratch starts as NaN: reading scratch that was never written (or writing results from
// the unused padding part of it) shows up as NaN in the outputs.
inline fvec nan_scratch(int64_t n) { return fvec(n, std::numeric_limits<float>::quiet_NaN()); }

// Checks |got - ref| <= atol + rtol * max|ref| elementwise; reports the worst element.
template <typename A, typename R>
void expect_close(const A& got, const R& ref, double rtol, double atol, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 0.0;
  for (auto x : ref) scale = std::max(scale, std::fabs(static_cast<double>(x)));
  const double tol = atol + rtol * scale;
  double worst = 0.0;
  size_t wi = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    if (!(d <= worst)) {
      worst = d;
      wi = i;
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst |diff| at " << wi << " got " << got[wi] << " ref "
                        << ref[wi] << " (max|ref| " << scale << ")";
}

// Central finite differences of a scalar function of x (in double).
inline dvec fd_grad(const std::function<double(const dvec&)>& f, dvec x, double eps = 1e-6) {
  dvec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + eps;
    const double fp = f(x);
    x[i] = x0 - eps;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

inline double dot(const dvec& a, const dvec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Backward kernels accumulate: start grads from this known fill and subtract it afterwards.
constexpr float kFill = 0.25f;
inline dvec minus_fill(const fvec& g) {
  dvec r(g.size());
  for (size_t i = 0; i < g.size(); ++i) r[i] = static_cast<double>(g[i]) - kFill;
  return r;
}

}  // namespace kernel_test
