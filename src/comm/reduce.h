// Element-wise sums the backends use for reductions, and the bf16 <-> fp32 conversions they rest
// on. bf16 values are uint16 bit patterns: the upper 16 bits of an IEEE-754 binary32.
#pragma once

#include <cstdint>
#include <cstring>

#include "tensor/dtype.h"

namespace shardlm::comm {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even. NaN maps to a quiet NaN with the same sign; values beyond the
// largest bf16 round to ±inf, as IEEE rounding does.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// True for the dtypes reductions support (fp32, bf16).
inline bool reducible(DType t) { return t == DType::fp32 || t == DType::bf16; }

// out[i] = in[0][i] + in[1][i] + … + in[n−1][i], added left to right. fp32: in fp32. bf16: each
// value widened to fp32, the whole sum accumulated in fp32, rounded once to bf16. `out` may be
// one of the inputs. n ≥ 1.
void sum_n(DType dtype, void* out, const void* const* in, int n, int64_t count);

// inout[i] = in[i] + inout[i] (bf16: widened, added in fp32, rounded once). The order of the
// two operands is irrelevant (addition of two values is commutative); the MPI user-defined
// operation for bf16 is this function.
void sum_into(DType dtype, void* inout, const void* in, int64_t count);

}  // namespace shardlm::comm
