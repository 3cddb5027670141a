// The CUDA backend: allocator, cuBLAS GEMMs and the Backend table over this directory's kernels.
#include "kernels/cuda_backend.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/cpu.h"  // the scratch sizes, which the model's costs (and so the plan) are made of
#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels {

namespace cuda {

namespace {

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS: ") + what + " failed with status " + std::to_string(int(s)));
}

// The device this process uses: its local rank's, when launched by mpirun with several GPUs.
int device_index(int local_rank) {
  int count = 0;
  SHARDLM_CUDA_CHECK(cudaGetDeviceCount(&count));
  return local_rank % count;
}

}  // namespace

// Freed device blocks by rounded size, for reuse: cudaMalloc and cudaFree synchronise the device,
// and a step frees and asks again for the same sizes. Blocks are returned to CUDA only when a
// cudaMalloc fails (then every cached block is, and the cudaMalloc is tried once more) and when
// the backend that owns the cache goes (every buffer from it must be released by then).
class DeviceCache final : public Buffer::Owner {
 public:
  DeviceCache() = default;
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;
  ~DeviceCache() {
    (void)cudaStreamSynchronize(stream());
    for (auto& [r, p] : free_) (void)cudaFree(p);
  }
  static size_t rounded(size_t bytes) { return (bytes + 511) / 512 * 512; }
  void give_back(void* p, size_t bytes) override { give(p, bytes); }

  void* take(size_t bytes) {
    const size_t r = rounded(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(r);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      return p;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, r) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free out-of-memory error
      release_cached();
      SHARDLM_CUDA_CHECK(cudaMalloc(&p, r));
    }
    reserved_ += static_cast<int64_t>(r);
    return p;
  }
  void give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(rounded(bytes), p);
  }
  int64_t reserved() {
    std::lock_guard<std::mutex> lock(mu_);
    return reserved_;
  }

 private:
  void release_cached() {
    SHARDLM_CUDA_CHECK(cudaStreamSynchronize(stream()));
    for (auto& [r, p] : free_) {
      SHARDLM_CUDA_CHECK(cudaFree(p));
      reserved_ -= static_cast<int64_t>(r);
    }
    free_.clear();
  }
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  int64_t reserved_ = 0;
};

namespace {

// The device's stream, the cuBLAS handle and a few doubles of device scratch, made by the first
// backend and unchanged after (the mutex only serialises the handle's use). It stays one per
// process: every launcher of this directory's five .cu files issues on its stream, and handing it
// to each of them is left for the multi-stream work; a backend asking for another device or
// another launch check than the first one's is refused.
struct Context {
  int device = 0;
  bool sync_each_launch = false;
  cudaStream_t s = nullptr;
  cudaStream_t copy = nullptr;  // Backend::Lane::copy
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;  // for GEMMs with a bias epilogue
  void* lt_workspace = nullptr;
  static constexpr size_t kLtWorkspace = size_t(32) << 20;
  double* sums = nullptr;  // [0]: sum_squares, [1..1024]: its per-block partials, [1025]: the head's loss
  std::mutex blas_mu;      // a cuBLAS handle is not for concurrent use

  static Context*& made() {
    static Context* c = nullptr;  // never destroyed: the device's handles live as long as the process
    return c;
  }
  static Context& get() {
    if (!made()) throw std::logic_error("CUDA: a kernel ran before any CUDA backend was made");
    return *made();
  }
  static Context& open(const CudaOptions& o) {
    static std::once_flag once;
    std::call_once(once, [&] { made() = make(o); });
    Context& c = *made();
    if (c.device != device_index(o.local_rank) || c.sync_each_launch != o.sync_each_launch)
      throw std::invalid_argument("CUDA backend: local_rank and sync_each_launch must be the first backend's");
    return c;
  }
  static Context* make(const CudaOptions& o) {
    auto* c = new Context;
    c->device = device_index(o.local_rank);
    c->sync_each_launch = o.sync_each_launch;
    SHARDLM_CUDA_CHECK(cudaSetDevice(c->device));
    SHARDLM_CUDA_CHECK(cudaStreamCreateWithFlags(&c->s, cudaStreamNonBlocking));
    SHARDLM_CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
    check_cublas(cublasCreate(&c->blas), "cublasCreate");
    check_cublas(cublasSetStream(c->blas, c->s), "cublasSetStream");
    check_cublas(cublasLtCreate(&c->lt), "cublasLtCreate");
    SHARDLM_CUDA_CHECK(cudaMalloc(&c->lt_workspace, kLtWorkspace));
    SHARDLM_CUDA_CHECK(cudaMalloc(&c->sums, sizeof(double) * 1026));
    return c;
  }
};

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace

cudaStream_t stream() { return Context::get().s; }
cudaStream_t copy_stream() { return Context::get().copy; }

void after_launch(const char* file, int line) {
  check(cudaGetLastError(), "kernel launch", file, line);
  if (Context::get().sync_each_launch) check(cudaStreamSynchronize(stream()), "kernel (sync_each_launch)", file, line);
}

void gemm_strided_batched(bool bf16, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, int64_t sA, const float* B, int64_t ldb, int64_t sB, float beta, float* C,
                          int64_t ldc, int64_t sC, int64_t batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  Context& ctx = Context::get();
  std::lock_guard<std::mutex> lock(ctx.blas_mu);
  check_cublas(cublasGemmStridedBatchedEx(ctx.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                          int(N), int(M), int(K), &alpha, B, CUDA_R_32F, int(ldb), sB, A, CUDA_R_32F,
                                          int(lda), sA, &beta, C, CUDA_R_32F, int(ldc), sC, int(batch),
                                          bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

// A failed copy or memset names its pointers, their kind of memory and the byte count.
void check_memop(cudaError_t e, const char* what, const void* dst, const void* src, size_t bytes) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  auto kind = [](const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1;
    }
    return int(a.type);
  };
  char msg[256];
  std::snprintf(msg, sizeof msg, "CUDA: %s(dst %p [type %d], src %p [type %d], %zu bytes): %s", what, dst, kind(dst),
                src, src ? kind(src) : -1, bytes, cudaGetErrorString(e));
  throw std::runtime_error(msg);
}

}  // namespace cuda

// The region a plan sized for the kernels' scratch (Backend::use_scratch), handed out in pieces
// of 512 bytes and up (model::KernelScratch counts them so) and taken back last in, first out: a
// piece dropped before the ones above it is reused once they are gone too. Only the compute lane's
// calls take scratch; the mutex keeps a stray caller from corrupting the stack all the same.
class ScratchStack final : public Buffer::Owner {
 public:
  void reset(void* base, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pieces_.empty()) throw std::logic_error("CUDA backend: the scratch region changed under a live piece");
    base_ = static_cast<char*>(base);
    size_ = base ? bytes : 0;
    top_ = high_ = 0;
  }
  bool active() {
    std::lock_guard<std::mutex> lock(mu_);
    return base_ != nullptr;
  }
  // Null where no region is given or the piece does not fit what is left of it.
  void* take(size_t bytes) {
    const size_t r = cuda::DeviceCache::rounded(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (!base_ || top_ + r > size_) return nullptr;
    pieces_.push_back({top_, false});
    void* p = base_ + top_;
    top_ += r;
    high_ = std::max(high_, top_);
    return p;
  }
  void give_back(void* p, size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t at = static_cast<size_t>(static_cast<char*>(p) - base_);
    for (auto it = pieces_.rbegin(); it != pieces_.rend(); ++it)
      if (it->at == at && !it->dropped) {
        it->dropped = true;
        break;
      }
    while (!pieces_.empty() && pieces_.back().dropped) {
      top_ = pieces_.back().at;
      pieces_.pop_back();
    }
  }
  // The most bytes held at once since the last call (tests: against model::KernelScratch).
  int64_t take_high_water() {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t h = high_;
    high_ = top_;
    return static_cast<int64_t>(h);
  }

 private:
  struct Piece {
    size_t at;
    bool dropped;
  };
  std::mutex mu_;
  char* base_ = nullptr;
  size_t size_ = 0, top_ = 0, high_ = 0;
  std::vector<Piece> pieces_;
};

namespace {

using cuda::Context;

class CudaBackend final : public Backend {
 public:
  CudaBackend(MemoryPool& memory, const CudaOptions& options)
      : Backend(memory), options_(options), bf16_(options.bf16_gemm) {
    Context::open(options);
  }
  const char* name() const override { return bf16_ ? "cuda" : "cuda-fp32"; }
  int64_t reserved_bytes() const { return cache_.reserved(); }
  int64_t scratch_high_water() const { return scratch_.take_high_water(); }

  // Scratch of one call: a piece of the plan's region, charged to the backend's own pool (the
  // region is charged to the run's), or where none fits a workspace buffer of the cache.
  Buffer scratch(size_t bytes) const {
    if (bytes == 0) return Buffer();
    if (void* p = scratch_.take(bytes)) return Buffer::adopt(scratch_pool_, MemCategory::workspace, p, bytes, scratch_);
    if (scratch_.active()) overflows_.fetch_add(1);
    return alloc(MemCategory::workspace, bytes, Buffer::Fill::none);
  }
  void use_scratch(void* region, size_t bytes) const override { scratch_.reset(region, bytes); }
  int64_t scratch_overflows() const override { return overflows_.load(); }

  Mark mark(Lane lane) const override {
    cudaEvent_t e = nullptr;
    SHARDLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    SHARDLM_CUDA_CHECK(cudaEventRecord(e, lane_stream(lane)));
    return Mark(static_cast<void*>(e), [](void* p) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  }
  void wait(Lane lane, const Mark& m) const override {
    if (m) SHARDLM_CUDA_CHECK(cudaStreamWaitEvent(lane_stream(lane), static_cast<cudaEvent_t>(m.get()), 0));
  }
  void upload_on(Lane lane, void* dst, const void* src, size_t bytes) const override {
    if (bytes)
      cuda::check_memop(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, lane_stream(lane)), "upload", dst, src,
                        bytes);
  }
  void download_on(Lane lane, void* dst, const void* src, size_t bytes) const override {
    if (!bytes) return;
    cuda::check_memop(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, lane_stream(lane)), "download", dst, src,
                      bytes);
    SHARDLM_CUDA_CHECK(cudaStreamSynchronize(lane_stream(lane)));
  }

  Buffer alloc(MemCategory category, size_t bytes, Buffer::Fill fill) const override {
    if (bytes == 0) return Buffer();
    void* p = cache_.take(bytes);
    Buffer b = Buffer::adopt(memory(), category, p, bytes, cache_);
    if (fill == Buffer::Fill::zero) zero(p, cuda::DeviceCache::rounded(bytes));
    return b;
  }
  void upload(void* dst, const void* src, size_t bytes) const override { upload_on(Lane::compute, dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) const override { download_on(Lane::compute, dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) const override {
    if (bytes && dst != src)
      cuda::check_memop(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::stream()), "copy", dst, src,
                        bytes);
  }
  // One strided copy for all rows (the base class's would issue one per row).
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) const override {
    if (row_bytes && rows > 0)
      cuda::check_memop(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, static_cast<size_t>(rows),
                                          cudaMemcpyDeviceToDevice, cuda::stream()),
                        "copy_rows", dst, src, row_bytes * static_cast<size_t>(rows));
  }
  void zero(void* dst, size_t bytes) const override {
    if (bytes) cuda::check_memop(cudaMemsetAsync(dst, 0, bytes, cuda::stream()), "zero", dst, nullptr, bytes);
  }
  bool host_memory() const override { return false; }
  void* stream_handle() const override { return cuda::stream(); }
  void synchronize() const override {
    SHARDLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
    SHARDLM_CUDA_CHECK(cudaStreamSynchronize(cuda::copy_stream()));
  }
  // A refusal (a memlock limit, an unaligned buffer) leaves the buffer pageable: slower, still right.
  bool pin_host(void* p, size_t bytes) const override {
    if (p == nullptr || bytes == 0) return false;
    if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
    cudaGetLastError();  // clear the refusal, so the next launch check does not report it
    return false;
  }
  void unpin_host(void* p) const override {
    if (p) SHARDLM_CUDA_CHECK(cudaHostUnregister(p));
  }
  DeviceInfo device_info() const override {
    cudaDeviceProp p{};
    SHARDLM_CUDA_CHECK(cudaGetDeviceProperties(&p, Context::get().device));
    return {p.name, static_cast<int64_t>(p.totalGlobalMem), bf16_ ? "bf16" : "fp32"};
  }
  void init_compute(int) const override { SHARDLM_CUDA_CHECK(cudaSetDevice(Context::get().device)); }

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                      int64_t OC) const override {
    const Operand x = operand(inp, N, C, C), w = operand(weight, C, OC, OC);
    if (bias && x.bf16 && gemm_bias(N, OC, C, x, w, bias, out)) return;
    if (bias) cuda::add_bias_rows(out, bias, N, OC);
    gemm(false, false, N, OC, C, x, w, bias ? 1.0f : 0.0f, out, OC);
  }
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int64_t C, int64_t OC) const override {
    // With bf16 operands the bias gradient's pass over dout also writes dout's bf16 copy.
    const bool fused = dbias && (dinp || dweight) && bf16_ && options_.bf16_operands && N > 0 && OC > 0;
    if (dinp || dweight) {
      const Operand d = fused ? operand_and_bias_grad(dout, N, OC, dbias) : operand(dout, N, OC, OC);
      if (dinp) gemm(false, true, N, C, OC, d, operand(weight, C, OC, OC), 1.0f, dinp, C);
      if (dweight) gemm(true, false, C, OC, N, operand(inp, N, C, C), d, 1.0f, dweight, OC);
    }
    if (dbias && !fused) cuda::bias_grad(*this, dbias, dout, N, OC);
  }
  void dense_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                     int64_t OC) const override {
    gemm(false, true, N, OC, C, operand(inp, N, C, C), operand(weight, OC, C, C), 0.0f, out, OC);
  }
  void dense_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      int64_t N, int64_t C, int64_t OC) const override {
    if (!dinp && !dweight) return;
    const Operand d = operand(dout, N, OC, OC);
    if (dinp) gemm(false, false, N, C, OC, d, operand(weight, OC, C, C), 1.0f, dinp, C);
    if (dweight) gemm(true, false, OC, C, N, d, operand(inp, N, C, C), 1.0f, dweight, C);
  }

  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int64_t N, int64_t C) const override {
    cuda::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N,
                          int64_t C) const override {
    cuda::layernorm_backward(*this, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                       float eps) const override {
    cuda::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                        const float* rstd, int64_t N, int64_t C) const override {
    cuda::rmsnorm_backward(*this, dinp, dweight, dout, inp, weight, rstd, N, C);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) const override { cuda::gelu_forward(out, inp, n); }
  void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) const override {
    cuda::gelu_backward(dinp, dout, inp, n);
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F) const override {
    cuda::swiglu_forward(out, gate_up, N, F);
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                       int64_t F) const override {
    cuda::swiglu_backward(dgate_up, dout, gate_up, N, F);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) const override {
    cuda::residual_forward(out, a, b, n);
  }
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                         int64_t T, int64_t C) const override {
    cuda::embedding_forward(out, tokens, wte, wpe, B, T, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C) const override {
    cuda::embedding_backward(dwte, dwpe, dout, tokens, B, T, C);
  }

  int64_t rope_table_floats(int64_t T, int64_t HS) const override { return T * HS; }
  void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope) const override {
    if (HS <= 0 || HS % 2 != 0) throw std::invalid_argument("rope_table: HS must be even");
    cuda::rope_table(cos_sin, T, HS, rope);
  }
  void rope_forward(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                    const float* cos_sin) const override {
    cuda::rope_apply(x, B, T, n_heads, HS, row_stride, cos_sin, false);
  }
  void rope_backward(float* dx, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                     const float* cos_sin) const override {
    cuda::rope_apply(dx, B, T, n_heads, HS, row_stride, cos_sin, true);
  }

  void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                         int64_t HS, bool causal = true) const override {
    causal_only(causal, "attention_forward");
    if (B * T == 0) return;
    if (NKV <= 0 || NH % NKV != 0) throw std::invalid_argument("attention: NKV must divide NH");
    if (use_attention_mma(HS)) return cuda::mma_attention_forward(*this, out, lse, qkv, B, T, NH, NKV, HS);
    if (use_attention_gemm(T, NH, NKV))
      return cuda::attention_gemm_forward(*this, bf16_, out, lse, qkv, B, T, NH, NKV, HS);
    cuda::attention_forward(out, lse, qkv, B, T, NH, NKV, HS);
  }
  // The plan sizes scratch by the CPU kernels' formulas (model/'s costs), so the queries answer those.
  // The backward's own scratch, one float per query row (B NH T: dout . out), does not fit them:
  // it is a workspace buffer of its own (charged to the tracker, outside the plan's figure).
  int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                     int threads) const override {
    return kernels::attention_backward_scratch(B, T, NH, NKV, HS, threads);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, float*,
                          bool causal = true) const override {
    causal_only(causal, "attention_backward");
    if (B * T == 0) return;
    if (NKV <= 0 || NH % NKV != 0) throw std::invalid_argument("attention: NKV must divide NH");
    if (use_attention_mma(HS))
      return cuda::mma_attention_backward(*this, dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS);
    if (use_attention_gemm(T, NH, NKV))
      return cuda::attention_gemm_backward(*this, bf16_, dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS);
    Buffer rows = scratch(sizeof(float) * B * NH * T);
    cuda::attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS, rows.f32());
  }

  // Context parallelism's attention over chunks: the fp32 flash kernels at the chunks' positions,
  // in every compute mode. The backward's one float per query row is a workspace buffer, as above.
  void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc, const float* k,
                                 const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                                 int64_t HS, bool accumulate, bool causal = true) const override {
    causal_only(causal, "attention_chunked_forward");
    cuda::attention_chunked_forward(out, lse, q, ldq, qc, k, v, ldkv, kc, B, NH, NKV, HS, accumulate);
  }
  int64_t attention_chunked_backward_scratch(int64_t HS, int threads) const override {
    return kernels::attention_chunked_backward_scratch(HS, threads);
  }
  void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, const float* dout,
                                  const float* q, int64_t ldq, const float* out, const float* lse, SeqChunks qc,
                                  const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH,
                                  int64_t NKV, int64_t HS, float*, bool causal = true) const override {
    causal_only(causal, "attention_chunked_backward");
    Buffer rows = scratch(sizeof(float) * std::max<int64_t>(1, B * NH * qc.total()));
    cuda::attention_chunked_backward(dq, lddq, dk, dv, lddkv, dout, q, ldq, out, lse, qc, k, v, ldkv, kc, B, NH, NKV,
                                     HS, rows.f32());
  }

  // Scratch (the CPU's size): chunk x Vp logits, then the chunk's row losses in double.
  int64_t head_scratch(int64_t chunk, int64_t Vp) const override { return kernels::head_scratch(chunk, Vp); }
  double lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte, const int32_t* targets,
                               int64_t N, int64_t C, int64_t V, int64_t Vp, float grad_scale, int64_t chunk,
                               float* scratch, float* logits_out) const override;

  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                    float eps, float weight_decay, int64_t t) const override {
    // Scalars as kernels/cpu.h computes them (torch's Python doubles, used as float).
    const double lr_d = lr, b1 = beta1, b2 = beta2;
    const float decay = static_cast<float>(1.0 - lr_d * static_cast<double>(weight_decay));
    const float w1 = static_cast<float>(1.0 - b1), w2 = static_cast<float>(1.0 - b2);
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t)), bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
    cuda::adamw_update(p, g, m, v, n, decay, w1, std::fabs(w1) < 0.5f, beta2, w2, static_cast<float>(std::sqrt(bc2)),
                       eps, static_cast<float>(-(lr_d / bc1)));
  }
  double sum_squares(const float* x, int64_t n) const override {
    double* sums = Context::get().sums;
    cuda::sum_squares(sums, sums + 1, x, n);
    double r = 0;
    download(&r, sums, sizeof(double));
    return r;
  }
  void scale(float* x, int64_t n, float s) const override { cuda::scale(x, n, s); }
  void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, bool stochastic,
                     uint64_t key) const override {
    check_groups("quantize_int8", n, group);
    cuda::quantize_int8(q, scales, x, n, group, stochastic, key);
  }
  void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) const override {
    check_groups("dequantize_int8", n, group);
    cuda::dequantize_int8(x, q, scales, n, group);
  }
  void fp32_to_bf16(uint16_t* out, const float* in, int64_t n) const override { cuda::fp32_to_bf16(out, in, n); }
  void bf16_to_fp32(float* out, const uint16_t* in, int64_t n) const override { cuda::bf16_to_fp32(out, in, n); }

 private:
  static void check_groups(const char* op, int64_t n, int64_t group) {
    if (group <= 0 || n % group != 0)
      throw std::invalid_argument(std::string(op) + ": " + std::to_string(n) + " values do not split into groups of " +
                                  std::to_string(group));
  }
  // The CUDA attention kernels mask causally; the bidirectional form runs on the CPU backend.
  static void causal_only(bool causal, const char* op) {
    if (!causal)
      throw std::logic_error(std::string("cuda backend: ") + op + " without the causal mask is not implemented (run --device cpu)");
  }
  // bf16 tensor-core attention only with bf16 GEMMs: fp32 mode stays within fp32 rounding of the CPU.
  bool use_attention_mma(int64_t HS) const {
    return bf16_ && options_.attention == CudaOptions::Attention::mma && cuda::mma_attention_supports(HS);
  }
  bool use_attention_gemm(int64_t T, int64_t NH, int64_t NKV) const {
    return options_.attention != CudaOptions::Attention::flash && cuda::attention_gemm_fits(T, NH, NKV);
  }
  // A GEMM operand, a row-major (rows, cols) matrix with leading dimension ld: with bf16 GEMMs a
  // bf16 copy (rounded once, however many GEMMs read it), so cuBLAS runs its bf16 kernels at full
  // tensor-core rate; with fp32 GEMMs the fp32 matrix itself.
  struct Operand {
    const void* data;
    int64_t ld;
    bool bf16;
    Buffer copy;  // owns the bf16 copy
  };
  Operand operand(const float* x, int64_t rows, int64_t cols, int64_t ld) const {
    if (!bf16_ || !options_.bf16_operands) return Operand{x, ld, false, Buffer()};
    const int64_t n = rows > 0 && cols > 0 ? (rows - 1) * ld + cols : 0;
    Buffer copy = scratch(sizeof(uint16_t) * static_cast<size_t>(n));
    if (n > 0) cuda::fp32_to_bf16(copy.as<uint16_t>(), x, n);
    return Operand{copy.data(), ld, true, std::move(copy)};
  }
  // Row-major out (M,N) = A (M,K) B (K,N) + bias (N) over bf16 operands, the bias added by
  // cublasLt's epilogue as the tiles are written (instead of a pass writing it into out and the
  // GEMM reading it back: two fewer passes over out). False where cublasLt offers no algorithm.
  bool gemm_bias(int64_t M, int64_t N, int64_t K, const Operand& A, const Operand& B, const float* bias,
                 float* out) const {
    if (M == 0 || N == 0 || K == 0) return false;
    Context& ctx = Context::get();
    std::lock_guard<std::mutex> lock(ctx.blas_mu);
    // Column-major: out^T (N, M) = B^T (N, K) A^T (K, M), the bias one value per row of out^T.
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t lb = nullptr, la = nullptr, lo = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    const auto release = [&] {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (lo) cublasLtMatrixLayoutDestroy(lo);
      if (la) cublasLtMatrixLayoutDestroy(la);
      if (lb) cublasLtMatrixLayoutDestroy(lb);
      if (desc) cublasLtMatmulDescDestroy(desc);
    };
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_32F;
    const size_t ws = Context::kLtWorkspace;
    bool ok = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                             sizeof bias_type) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, uint64_t(N), uint64_t(K), B.ld) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, uint64_t(K), uint64_t(M), A.ld) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate(&lo, CUDA_R_32F, uint64_t(N), uint64_t(M), N) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
                  CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    ok = ok && cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc, lb, la, lo, lo, pref, 1, &heuristic, &found) ==
                   CUBLAS_STATUS_SUCCESS &&
         found > 0;
    if (ok) {
      const float alpha = 1.0f, beta = 0.0f;
      const cublasStatus_t st = cublasLtMatmul(ctx.lt, desc, &alpha, B.data, lb, A.data, la, &beta, out, lo, out, lo,
                                               &heuristic.algo, ctx.lt_workspace, ws, cuda::stream());
      release();
      cuda::check_cublas(st, "cublasLtMatmul");
      return true;
    }
    release();
    return false;
  }
  // Row-major C (M,N) = op(A) (M,K) op(B) (K,N) + beta C, as kernels::matmul: cuBLAS is
  // column-major, so it computes C^T = op(B)^T op(A)^T with the operands swapped.
  // operand(dout, N, OC, OC) with dbias += dout's column sums taken in the same pass.
  Operand operand_and_bias_grad(const float* dout, int64_t N, int64_t OC, float* dbias) const {
    Buffer copy = scratch(sizeof(uint16_t) * static_cast<size_t>(N * OC));
    cuda::bias_grad_and_bf16(*this, dbias, copy.as<uint16_t>(), dout, N, OC);
    return Operand{copy.data(), OC, true, std::move(copy)};
  }
  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const Operand& A, const Operand& B, float beta,
            float* C, int64_t ldc) const {
    if (M == 0 || N == 0) return;
    Context& ctx = Context::get();
    const float alpha = 1.0f;
    const bool both16 = A.bf16 && B.bf16;
    const cudaDataType_t ta_type = A.bf16 ? CUDA_R_16BF : CUDA_R_32F, tb_type = B.bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute =
        both16 ? CUBLAS_COMPUTE_32F : (bf16_ ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F);
    std::lock_guard<std::mutex> lock(ctx.blas_mu);
    cuda::check_cublas(cublasGemmEx(ctx.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(N),
                                    int(M), int(K), &alpha, B.data, tb_type, int(B.ld), A.data, ta_type, int(A.ld),
                                    &beta, C, CUDA_R_32F, int(ldc), compute, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
  }
  static cudaStream_t lane_stream(Lane lane) { return lane == Lane::copy ? cuda::copy_stream() : cuda::stream(); }
  const CudaOptions options_;
  const bool bf16_;
  mutable cuda::DeviceCache cache_;  // the device blocks of this backend's buffers
  mutable MemoryPool scratch_pool_;  // what the region's pieces are charged to (the region is the run's)
  mutable ScratchStack scratch_;
  mutable std::atomic<int64_t> overflows_{0};
};

double CudaBackend::lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte,
                                          const int32_t* targets, int64_t N, int64_t C, int64_t V, int64_t Vp,
                                          float grad_scale, int64_t chunk, float* scratch, float* logits_out) const {
  if (chunk <= 0 || chunk > N) chunk = N;
  if (Vp % 2 != 0) throw std::invalid_argument("lm_head_cross_entropy: Vp must be even (double row losses)");
  // The plan's scratch holds `chunk` rows (256 in training): so thin a slab leaves the GEMMs slow
  // and re-reads dwte once per slab. Larger slabs come from scratch of their own (workspace).
  Buffer slab;
  if (const int64_t big = std::min<int64_t>(N, options_.head_rows); big > chunk) {
    slab = this->scratch(sizeof(float) * static_cast<size_t>(kernels::head_scratch(big, Vp)));
    chunk = big;
    scratch = slab.f32();
  }
  float* logits = scratch;
  double* rows = reinterpret_cast<double*>(scratch + chunk * Vp);
  double* acc = Context::get().sums + 1025;
  // Generation passes a host target (-1); the tensors themselves are device buffers.
  Buffer staged;
  if (N > 0 && !cuda::is_device_pointer(targets)) {
    staged = this->scratch(sizeof(int32_t) * N);
    upload(staged.data(), targets, sizeof(int32_t) * N);
    targets = staged.as<int32_t>();
  }
  const bool logits_on_host = logits_out && !cuda::is_device_pointer(logits_out);
  zero(acc, sizeof(double));
  const Operand w = operand(wte, Vp, C, C), xs = operand(x, N, C, C);  // rounded once for every slab
  const auto rows_of = [&](const Operand& o, int64_t r0) {
    return Operand{static_cast<const char*>(o.data) + r0 * o.ld * (o.bf16 ? 2 : 4), o.ld, o.bf16, Buffer()};
  };
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    // The GEMMs run over all Vp rows of wte: with V = 50257 (odd) cuBLAS ran the three 2.4x slower
    // than at Vp = 50304 (H100). Columns >= V are ignored by the softmax and get zero gradients,
    // so dx is unchanged and dwte's padding rows receive += 0 (their values stay as they were).
    gemm(false, true, n, Vp, C, rows_of(xs, r0), w, 0.0f, logits, Vp);
    if (logits_out) {
      SHARDLM_CUDA_CHECK(cudaMemcpy2DAsync(logits_out + r0 * V, V * sizeof(float), logits, Vp * sizeof(float),
                                           V * sizeof(float), n, cudaMemcpyDefault, cuda::stream()));
      if (logits_on_host) SHARDLM_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
    }
    // With bf16 operands the softmax writes the gradient as the GEMMs' operand itself.
    const bool grad = dx || dwte, grad16 = grad && bf16_ && options_.bf16_operands;
    Buffer g16 = grad16 ? this->scratch(sizeof(uint16_t) * static_cast<size_t>(n * Vp)) : Buffer();
    cuda::softmax_xent(logits, rows, targets + r0, n, V, Vp, grad_scale, grad, g16.as<uint16_t>());
    cuda::accumulate_sum(acc, rows, n);
    if (!grad) continue;
    const Operand d = grad16 ? Operand{g16.data(), Vp, true, std::move(g16)} : operand(logits, n, Vp, Vp);
    if (dx) gemm(false, false, n, C, Vp, d, w, 1.0f, dx + r0 * C, C);
    if (dwte) gemm(true, false, Vp, C, n, d, rows_of(xs, r0), 1.0f, dwte, C);
  }
  double loss = 0;
  download(&loss, acc, sizeof(double));
  return loss;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(MemoryPool& memory, const CudaOptions& options) {
  return std::make_unique<CudaBackend>(memory, options);
}

bool cuda_device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

int64_t cuda_reserved_bytes(const Backend& cuda) { return dynamic_cast<const CudaBackend&>(cuda).reserved_bytes(); }

int64_t cuda_scratch_high_water(const Backend& cuda) {
  return dynamic_cast<const CudaBackend&>(cuda).scratch_high_water();
}

namespace cuda {
Buffer device_scratch(const Backend& backend, size_t bytes) {
  return dynamic_cast<const CudaBackend&>(backend).scratch(bytes);
}
}  // namespace cuda

}  // namespace shardlm::kernels
