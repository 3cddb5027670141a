// What the CUDA backend is told when it is made. The command line fills it from the environment
// (cli/environment.cc); a build without CUDA carries it unused.
#pragma once

#include <cstdint>

namespace shardlm::kernels {

struct CudaOptions {
  // GEMMs on bf16 tensor cores with fp32 accumulation (fp32 storage; cuBLAS's
  // CUBLAS_COMPUTE_32F_FAST_16BF); false: full fp32 GEMMs.
  bool bf16_gemm = true;
  // With bf16 GEMMs: operands rounded to bf16 copies before cuBLAS (its bf16 kernels, ~2-3x the
  // rate of fp32 operands under CUBLAS_COMPUTE_32F_FAST_16BF); SHARDLM_CUDA_GEMM_OPERANDS=fp32:
  // fp32 operands converted inside cuBLAS (the earlier path, for comparison).
  bool bf16_operands = true;
  // Which attention kernels run (SHARDLM_CUDA_ATTENTION=mma|cublas|flash; tests, comparisons):
  //  - mma (default): flash attention on the bf16 tensor cores where the head size has a kernel
  //    and the GEMMs are bf16; otherwise as cublas.
  //  - cublas: batched cuBLAS GEMMs over (heads, T, T) score buffers where they fit; else as flash.
  //  - flash: the fp32 tiled flash kernels (no tensor cores).
  enum class Attention { mma, cublas, flash };
  Attention attention = Attention::mma;
  // SHARDLM_CUDA_DEBUG=1: the stream is synchronised after every launch, so a fault is reported
  // at its own launch.
  bool sync_each_launch = false;
  // SHARDLM_CUDA_HEAD_ROWS: logits rows per head slab (2048 x 50304 floats = 412 MB).
  int64_t head_rows = 2048;
  // This rank's place among the ranks on its machine (train/machines.h): its GPU is that one,
  // modulo the device count.
  int local_rank = 0;
};

}  // namespace shardlm::kernels
