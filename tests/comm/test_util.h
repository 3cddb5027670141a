// Helpers shared by the comm tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "comm/reduce.h"
#include "tensor/dtype.h"
#include "tensor/memory.h"

namespace shardlm::comm::testing {

// Timeout for waits in tests: long enough for oversubscribed ranks, short enough that a broken
// collective fails the test instead of hanging it.
inline constexpr std::chrono::milliseconds kTestTimeout{60'000};

// What the tests' communicators stage in: one pool for the test binary, made before and gone
// after every communicator of it.
inline MemoryPool& test_memory() {
  static MemoryPool pool;
  return pool;
}

// The large count of the collective tests (a prime: no multiple of anything). Smaller under
// ThreadSanitizer, whose instrumented checking loops would otherwise dominate the run.
#if defined(__SANITIZE_THREAD__)
inline constexpr int64_t kLargeCount = 100003;
#else
inline constexpr int64_t kLargeCount = 1000003;
#endif

// A small integer (exact in fp32 and bf16, and so are sums of a few of them) for element i of
// rank r's buffer; `salt` varies it between buffers.
inline float small_int(int r, int64_t i, int salt = 0) {
  return static_cast<float>((r * 7 + i * 3 + salt * 5) % 17 - 8);
}

// n elements of `dtype` holding the given float values (bf16: rounded).
inline std::vector<uint8_t> encode(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::fp32) {
      reinterpret_cast<float*>(out.data())[i] = v[i];
    } else {
      reinterpret_cast<uint16_t*>(out.data())[i] = float_to_bf16(v[i]);
    }
  }
  return out;
}

inline std::vector<float> decode(const std::vector<uint8_t>& b, DType dtype) {
  const size_t n = b.size() / dtype_size(dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = dtype == DType::fp32 ? reinterpret_cast<const float*>(b.data())[i]
                                  : bf16_to_float(reinterpret_cast<const uint16_t*>(b.data())[i]);
  }
  return out;
}

}  // namespace shardlm::comm::testing
