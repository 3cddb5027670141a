// The CUDA backend (built only with -DSHARDLM_CUDA=ON): the Backend interface over device memory.
// Buffers come from the backend's caching allocator over cudaMalloc, charged per category to its
// MemoryPool's tracker; GEMMs are cuBLAS calls, everything else this backend's kernels, all issued in
// order on one CUDA stream (the compute lane; the copy lane is a second stream, for the offload
// tier's transfers). Results that return to the host (sum_squares, the head's loss) and
// download() synchronise with that stream.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda_options.h"

namespace shardlm::kernels {

// A CUDA backend whose buffers are charged to `memory`, as `options` say (cuda_options.h). Its
// device blocks are cached for reuse until it goes: every buffer from it must be released first.
std::unique_ptr<Backend> make_cuda_backend(MemoryPool& memory, const CudaOptions& options = {});

// Whether a CUDA device can be used here (false where there is no GPU or driver).
bool cuda_device_present();

// Bytes the caching allocator of `cuda` (a backend make_cuda_backend made) holds from cudaMalloc:
// in use plus cached for reuse.
int64_t cuda_reserved_bytes(const Backend& cuda);

// The most bytes of the scratch region (Backend::use_scratch) `cuda`'s calls held at once since
// the last call of this (tests: each kernel's scratch against model::KernelScratch's figure).
int64_t cuda_scratch_high_water(const Backend& cuda);

}  // namespace shardlm::kernels
