// What the CUDA backend is told when it is made. The command line fills it from the environment
// (cli/environment.cc); a build without CUDA carries it unused.
#pragma once

#include <cstdint>

namespace shardlm::kernels {

struct CudaOptions {
  // GEMMs on bf16 tensor cores with fp32 accumulation (fp32 storage; cuBLAS's
  // CUBLAS_COMPUTE_32F_FAST_16BF); false: full fp32 GEMMs.
  bool bf16_gemm = true;
  // SHARDLM_CUDA_ATTENTION=flash: the tiled flash kernels even where the cuBLAS path fits (tests,
  // comparisons).
  bool flash_attention = false;
  // SHARDLM_CUDA_DEBUG=1: the stream is synchronised after every launch, so a fault is reported
  // at its own launch.
  bool sync_each_launch = false;
  // SHARDLM_CUDA_HEAD_ROWS: logits rows per head slab (2048 x 50304 floats = 412 MB).
  int64_t head_rows = 2048;
  // OMPI_COMM_WORLD_LOCAL_RANK: this process's GPU is the local rank's (modulo the device count).
  int local_rank = 0;
};

}  // namespace shardlm::kernels
