#include "comm/reduce.h"

#include <stdexcept>

namespace shardlm::comm {

namespace {

void sum_n_f32(float* out, const float* const* in, int n, int64_t count) {
  // Blocks of fp32 accumulated on the stack: each block reads every input before writing `out`,
  // so `out` may alias any input, and the order is left to right: (((in0 + in1) + in2) + …).
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t m = count - base < kBlock ? count - base : kBlock;
    const float* a = in[0] + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = a[i];
    for (int k = 1; k < n; ++k) {
      const float* b = in[k] + base;
      for (int64_t i = 0; i < m; ++i) acc[i] += b[i];
    }
    std::memcpy(out + base, acc, m * sizeof(float));
  }
}

void sum_n_bf16(uint16_t* out, const uint16_t* const* in, int n, int64_t count) {
  // Accumulate blocks of fp32 on the stack so the sum is rounded once, without a heap buffer.
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t m = count - base < kBlock ? count - base : kBlock;
    const uint16_t* a = in[0] + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = bf16_to_float(a[i]);
    for (int k = 1; k < n; ++k) {
      const uint16_t* b = in[k] + base;
      for (int64_t i = 0; i < m; ++i) acc[i] += bf16_to_float(b[i]);
    }
    uint16_t* o = out + base;
    for (int64_t i = 0; i < m; ++i) o[i] = float_to_bf16(acc[i]);
  }
}

}  // namespace

void sum_n(DType dtype, void* out, const void* const* in, int n, int64_t count) {
  switch (dtype) {
    case DType::fp32:
      sum_n_f32(static_cast<float*>(out), reinterpret_cast<const float* const*>(in), n, count);
      return;
    case DType::bf16:
      sum_n_bf16(static_cast<uint16_t*>(out), reinterpret_cast<const uint16_t* const*>(in), n,
                 count);
      return;
    default:
      throw std::invalid_argument(std::string("comm: no sum for dtype ") + to_string(dtype));
  }
}

void sum_into(DType dtype, void* inout, const void* in, int64_t count) {
  const void* ins[2] = {in, inout};
  sum_n(dtype, inout, ins, 2, count);
}

}  // namespace shardlm::comm
