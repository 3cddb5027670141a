// How far one float array is from another, as the numerics tests bound it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace shardlm::testing {

// ||a - b|| / ||b|| over the columns [first, first + width) of (rows, cols) matrices; where b is
// all zeros, huge unless a is too (a gradient where the reference has none fails any bound). NaN
// where a holds a NaN, so a bound on it fails.
inline double relative_l2(const float* a, const float* b, int64_t rows, int64_t cols, int64_t first, int64_t width) {
  double num = 0, den = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = r * cols + first; i < r * cols + first + width; ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The same over all n values.
inline double relative_l2(const float* a, const float* b, int64_t n) { return relative_l2(a, b, 1, n, 0, n); }

}  // namespace shardlm::testing
