// The CUDA backend (built only with -DSHARDLM_CUDA=ON): the Backend interface over device memory.
// Buffers come from a caching allocator over cudaMalloc, charged per category to the process's
// MemoryTracker; GEMMs are cuBLAS calls, everything else this backend's kernels, all issued in
// order on one CUDA stream. Results that return to the host (sum_squares, the head's loss) and
// download() synchronise with that stream.
#pragma once

#include <cstdint>

#include "kernels/backend.h"

namespace shardlm::kernels {

// bf16_gemm: GEMMs on bf16 tensor cores with fp32 accumulation (fp32 storage; cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_16BF); false: full fp32 GEMMs. Two process-wide instances.
const Backend& cuda_backend(bool bf16_gemm = true);

// Whether a CUDA device can be used here (false where there is no GPU or driver).
bool cuda_device_present();

// Bytes the caching allocator holds from cudaMalloc: in use plus cached for reuse.
int64_t cuda_reserved_bytes();

}  // namespace shardlm::kernels
