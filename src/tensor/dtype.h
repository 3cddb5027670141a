// Element types a buffer can hold. Shards are element ranges, the same in every buffer of a
// unit whatever its dtype, so only the element size differs between them.
#pragma once

#include <cstdint>
#include <string>

namespace shardlm {

enum class DType { fp32, bf16, fp16, int8 };

inline int dtype_size(DType t) {
  switch (t) {
    case DType::fp32: return 4;
    case DType::bf16: return 2;
    case DType::fp16: return 2;
    case DType::int8: return 1;
  }
  return 0;
}

// The floating type of an element size the plan configures (param, activation, reduce bytes):
// 2 is bf16, otherwise fp32.
inline DType float_dtype(int bytes) { return bytes == 2 ? DType::bf16 : DType::fp32; }

inline const char* to_string(DType t) {
  switch (t) {
    case DType::fp32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::int8: return "int8";
  }
  return "?";
}

}  // namespace shardlm
