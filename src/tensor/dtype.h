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
