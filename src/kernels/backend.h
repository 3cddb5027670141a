// The compute backend: an allocator plus a kernel table. run/ and layers/ reach kernels only
// through a Backend, so a second backend (CUDA) is a new subclass, not an edit of its callers.
//
// Contract
//  - Each kernel method has the argument list, semantics and determinism of the free function
//    of the same name in kernels/cpu.h (read the contracts there); shape comments here are only
//    reminders. Pointers are in the backend's memory: host memory for the CPU backend, device
//    memory for a CUDA backend (buffers from alloc()).
//  - The scratch-size queries (attention_backward_scratch, head_scratch, rope_table_floats)
//    give the floats the backend's kernels need; layers/ carves exactly that much.
//  - A Backend is made by the run's owner over the MemoryPool its buffers are charged to (the
//    CUDA backend also holds its device's caches). Its methods are const and may be called from
//    any thread that init_compute has set up.
//  - The table holds what run/ and layers/ call; tests and benchmarks may keep calling cpu.h's
//    free functions directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/rope.h"
#include "kernels/seq_chunks.h"
#include "tensor/memory.h"

namespace shardlm::kernels {

class Backend {
 public:
  explicit Backend(MemoryPool& memory) : memory_(memory) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual const char* name() const = 0;

  // What alloc() charges: the run's tracker is memory().tracker().
  MemoryPool& memory() const { return memory_; }

  // A buffer of `bytes` charged to `category`. The CPU backend returns host memory
  // (tensor/memory.h's Buffer); a CUDA backend will return device memory.
  virtual Buffer alloc(MemCategory category, size_t bytes, Buffer::Fill fill) const = 0;

  // What run/ and layers/ do to buffers besides kernels (memcpy / memset on the CPU): copies
  // between host memory and the backend's, within the backend's, and zeroing. download returns
  // once the bytes are on the host; the others may complete later, in order with the kernels
  // (upload's host source may be reused once it returns: the CUDA backend's is pageable memory,
  // which cudaMemcpyAsync consumes before returning).
  virtual void upload(void* dst, const void* host_src, size_t bytes) const = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) const = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) const = 0;
  virtual void zero(void* dst, size_t bytes) const = 0;
  // `rows` rows of `row_bytes` each from src (rows `src_pitch` bytes apart) to dst (`dst_pitch`
  // apart), within the backend's memory, in order with the kernels. By default one copy per row.
  virtual void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                         int64_t rows) const;
  // dst rows += src rows: `rows` rows of `width` floats, `dst_ld` / `src_ld` floats apart. By
  // default one residual_forward per row.
  virtual void add_rows(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t width, int64_t rows) const;
  // Whether the host may read and write the backend's buffers directly (true on the CPU).
  virtual bool host_memory() const = 0;
  // The native stream every kernel and copy of this backend is issued on, in order, as an opaque
  // handle (a cudaStream_t on CUDA): what a communicator over device memory orders its collectives
  // after (comm/nccl.h). Null where there is none (the CPU).
  virtual void* stream_handle() const { return nullptr; }
  // A device backend's queues: the kernels' (compute) and one for the offload tier's transfers
  // (copy), so those overlap the kernels instead of waiting in line behind them. Work on one lane
  // runs in the order it is issued; between lanes only marks order it: mark(lane) records what
  // the lane has been given so far, and wait(lane, mark) makes later work on `lane` wait for it
  // without the host waiting. On the CPU there is one lane, work has completed when it returns,
  // marks are null and waits do nothing.
  enum class Lane { compute, copy };
  using Mark = std::shared_ptr<void>;
  virtual Mark mark(Lane) const { return nullptr; }
  virtual void wait(Lane, const Mark&) const {}
  // upload / download on `lane` (same contracts: download_on returns once the bytes are on the
  // host, having waited for that lane's work before it, not the other's).
  virtual void upload_on(Lane, void* dst, const void* host_src, size_t bytes) const { upload(dst, host_src, bytes); }
  virtual void download_on(Lane, void* host_dst, const void* src, size_t bytes) const { download(host_dst, src, bytes); }
  // The region of the backend's memory its kernels carve their own scratch from (the head of a
  // unit task's workspace buffer, sized by model::UnitCosts::*_kernel_scratch; the executor gives
  // it for the task's layer), or none (null): then they allocate it, charged to `workspace`. A
  // call whose scratch does not fit what is left of the region allocates too, and is counted
  // (scratch_overflows): the plan's figure fell short of the kernels. The CPU's kernels take none.
  virtual void use_scratch(void* /*region*/, size_t /*bytes*/) const {}
  virtual int64_t scratch_overflows() const { return 0; }
  // Returns once every kernel and copy issued so far has completed: a host clock read after
  // work on a device times nothing unless the device's queue is drained first (calibrate). The
  // CPU's kernels have completed when they return: nothing to wait for.
  virtual void synchronize() const {}
  // Page-locks a host buffer (whole pages) so copies between it and the backend's memory run at
  // the link's speed and asynchronously, where the backend has such a thing; returns whether it
  // did. An upload from a pinned buffer may complete after it returns: its source must not change
  // before a later download or synchronize(). unpin_host (after synchronize()) undoes it.
  virtual bool pin_host(void*, size_t) const { return false; }
  virtual void unpin_host(void*) const {}
  // What the kernels run on, for a hardware profile's name and memory limit: a device's name
  // (cudaGetDeviceProperties) and bytes (0: host memory, no limit of the device's own), and the
  // dtype its GEMMs compute in ("fp32", or "bf16" for a CUDA backend's default tensor-core GEMMs).
  struct DeviceInfo {
    std::string name;
    int64_t memory_bytes = 0;
    std::string gemm_dtype = "fp32";
  };
  virtual DeviceInfo device_info() const { return {name(), 0, "fp32"}; }

  // Sets up the calling thread (and its pool) for compute with `threads` threads.
  virtual void init_compute(int threads) const = 0;

  // Linear layers: Conv1D layout (C, OC) with bias; nn.Linear layout (OC, C) without.
  virtual void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                              int64_t C, int64_t OC) const = 0;
  virtual void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, int64_t N, int64_t C, int64_t OC) const = 0;
  virtual void dense_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                             int64_t OC) const = 0;
  virtual void dense_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                              int64_t N, int64_t C, int64_t OC) const = 0;

  // Norms (N, C), pointwise ops, embedding (B, T, C).
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                 const float* bias, int64_t N, int64_t C) const = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  const float* weight, const float* mean, const float* rstd, int64_t N,
                                  int64_t C) const = 0;
  virtual void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                               float eps) const = 0;
  virtual void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                                const float* weight, const float* rstd, int64_t N, int64_t C) const = 0;
  virtual void gelu_forward(float* out, const float* inp, int64_t n) const = 0;
  virtual void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) const = 0;
  virtual void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F) const = 0;
  virtual void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                               int64_t F) const = 0;
  virtual void residual_forward(float* out, const float* a, const float* b, int64_t n) const = 0;
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                                 int64_t T, int64_t C) const = 0;
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                                  int64_t T, int64_t C) const = 0;

  // Rotary position embedding: table (T, HS), rotation in place of n_heads heads per row.
  virtual int64_t rope_table_floats(int64_t T, int64_t HS) const = 0;
  virtual void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope) const = 0;
  virtual void rope_forward(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                            const float* cos_sin) const = 0;
  virtual void rope_backward(float* dx, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                             const float* cos_sin) const = 0;

  // Grouped-query attention over qkv (B, T, (NH + 2 NKV) HS); NKV == NH: multi-head. `causal`: each
  // query sees the keys at or before its position (language models); false: every key (diffusion
  // transformers). Backends without the bidirectional form throw std::logic_error naming themselves.
  virtual void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                                 int64_t NKV, int64_t HS, bool causal = true) const = 0;
  virtual int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                             int threads) const = 0;
  virtual void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                  const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                  float* scratch, bool causal = true) const = 0;

  // Attention over sequence chunks (kernels/cpu.h's attention_chunked_*: context parallelism's
  // ring steps and head-split form), causal or not as above. Backends without them throw
  // std::logic_error naming themselves.
  virtual void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc,
                                         const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B,
                                         int64_t NH, int64_t NKV, int64_t HS, bool accumulate,
                                         bool causal = true) const;
  virtual int64_t attention_chunked_backward_scratch(int64_t HS, int threads) const;
  virtual void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv,
                                          const float* dout, const float* q, int64_t ldq, const float* out,
                                          const float* lse, SeqChunks qc, const float* k, const float* v,
                                          int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                                          int64_t HS, float* scratch, bool causal = true) const;

  // Language-model head fused with cross-entropy, `chunk` rows of logits at a time.
  virtual int64_t head_scratch(int64_t chunk, int64_t Vp) const = 0;
  virtual double lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte,
                                       const int32_t* targets, int64_t N, int64_t C, int64_t V, int64_t Vp,
                                       float grad_scale, int64_t chunk, float* scratch,
                                       float* logits_out) const = 0;

  // The experts' GEMMs over groups of contiguous rows (kernels/cpu.h's grouped_dense_*; weight,
  // dweight and first are host arrays of `groups` pointers / groups + 1 rows). By default one
  // dense_forward / dense_backward per non-empty group.
  virtual void grouped_dense_forward(float* out, const float* inp, const float* const* weight, const int64_t* first,
                                     int64_t groups, int64_t C, int64_t OC) const;
  virtual void grouped_dense_backward(float* dinp, float* const* dweight, const float* dout, const float* inp,
                                      const float* const* weight, const int64_t* first, int64_t groups, int64_t C,
                                      int64_t OC) const;

  // Mixture-of-experts routing (kernels/cpu.h's moe_*). Backends without them throw
  // std::logic_error naming themselves (the CUDA backend has none yet).
  virtual void moe_router_probs(float* probs, float* lse, const float* logits, int64_t N, int64_t E) const;
  virtual void moe_router_forward(float* probs, float* lse, int32_t* expert, float* weight, const float* logits,
                                  int64_t N, int64_t E, int64_t k, bool norm_topk) const;
  virtual int64_t moe_dispatch(int32_t* offsets, int32_t* assigned, int32_t* slot_row, int32_t* row_token,
                               const int32_t* expert, int64_t N, int64_t E, int64_t k, int64_t capacity,
                               const int32_t* taken, int64_t segment) const;
  virtual void moe_gather_rows(float* xs, const float* x, const int32_t* row_token, int64_t rows, int64_t C) const;
  virtual void moe_gather_rows_backward(float* dx, const float* dxs, const int32_t* slot_row, int64_t N, int64_t k,
                                        int64_t C) const;
  virtual void moe_combine(float* out, const float* res, const float* ys, const float* weight,
                           const int32_t* slot_row, int64_t N, int64_t k, int64_t C) const;
  virtual void moe_combine_backward(float* dys, float* dweight, const float* dout, const float* ys,
                                    const float* weight, const int32_t* slot_row, int64_t N, int64_t k,
                                    int64_t C) const;
  virtual void moe_router_losses(double* aux, double* z, const float* probs, const float* lse,
                                 const int32_t* assigned, int64_t N, int64_t E, int64_t k, int64_t G) const;
  virtual void moe_router_backward(float* dlogits, const float* dweight, const float* probs, const float* lse,
                                   const int32_t* expert, const float* weight, const int32_t* assigned, int64_t N,
                                   int64_t E, int64_t k, int64_t G, bool norm_topk, float aux_scale,
                                   float z_scale) const;

  // Activation compression (--act-quant; kernels/cpu.h's quantize_int8 / dequantize_int8: int8
  // values, one fp32 scale per `group` consecutive values). Backends without them throw
  // std::logic_error naming themselves (the CUDA backend has none yet).
  virtual void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, bool stochastic,
                             uint64_t key) const;
  virtual void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) const;

  // Optimizer and utilities over flat ranges.
  virtual void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                            float beta2, float eps, float weight_decay, int64_t t) const = 0;
  virtual double sum_squares(const float* x, int64_t n) const = 0;
  virtual void scale(float* x, int64_t n, float s) const = 0;
  virtual void fp32_to_bf16(uint16_t* out, const float* in, int64_t n) const = 0;
  virtual void bf16_to_fp32(float* out, const uint16_t* in, int64_t n) const = 0;

 private:
  MemoryPool& memory_;
};

// The CPU backend: host Buffers from `memory` and kernels/cpu.h's functions. `as_device` (tests):
// host_memory() answers false, so its callers take the paths meant for a GPU's memory (uploads,
// downloads, collectives staged through host buffers) and those paths run, and are checked against
// the host ones, on a machine without a GPU. The values computed are the same.
std::unique_ptr<Backend> make_cpu_backend(MemoryPool& memory, bool as_device = false);

}  // namespace shardlm::kernels
