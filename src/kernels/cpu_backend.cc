// The CPU backend: forwards every method to kernels/cpu.h. As a device (tests), its buffers are
// guarded pages (kernels/guarded_pages.h) that each method opens for the pointers it is given.
#include <cstring>

#include "kernels/backend.h"
#include "kernels/cpu.h"
#include "kernels/guarded_pages.h"

namespace shardlm::kernels {

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(MemoryPool& memory, bool as_device)
      : Backend(memory), pages_(as_device ? std::make_unique<GuardedPages>() : nullptr) {}
  const char* name() const override { return pages_ ? "cpu-as-device" : "cpu"; }

  // A device's buffers are born zero (fresh pages), whatever `fill` says.
  Buffer alloc(MemCategory category, size_t bytes, Buffer::Fill fill) const override {
    if (pages_) return pages_->alloc(memory(), category, bytes);
    return Buffer(memory(), category, bytes, fill);
  }

  // An upload opens only its destination and a download only its source: host memory that is
  // really a device buffer faults in the memcpy, as the copy engine would refuse it.
  void upload(void* dst, const void* host_src, size_t bytes) const override {
    const auto open = touch(dst);
    move(dst, host_src, bytes);
  }
  void download(void* host_dst, const void* src, size_t bytes) const override {
    const auto open = touch(src);
    move(host_dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) const override {
    const auto open = touch(dst, src);
    move(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) const override {
    const auto open = touch(dst);
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) const override {
    const auto open = touch(dst, src);
#pragma omp parallel for schedule(static) if (rows * row_bytes > (1 << 16))
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(dst) + i * dst_pitch, static_cast<const char*>(src) + i * src_pitch, row_bytes);
  }
  void add_rows(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t width, int64_t rows) const override {
    const auto open = touch(dst, src);
#pragma omp parallel for schedule(static) if (rows * width > (1 << 14))
    for (int64_t i = 0; i < rows; ++i) {
      float* d = dst + i * dst_ld;
      const float* x = src + i * src_ld;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) d[j] += x[j];
    }
  }
  bool host_memory() const override { return pages_ == nullptr; }

  void init_compute(int threads) const override { kernels::init_compute(threads); }

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                      int64_t OC) const override {
    const auto open = touch(out, inp, weight, bias, N, C, OC);
    kernels::linear_forward(out, inp, weight, bias, N, C, OC);
  }
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int64_t C, int64_t OC) const override {
    const auto open = touch(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
    kernels::linear_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void dense_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                     int64_t OC) const override {
    const auto open = touch(out, inp, weight, N, C, OC);
    kernels::dense_forward(out, inp, weight, N, C, OC);
  }
  void dense_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      int64_t N, int64_t C, int64_t OC) const override {
    const auto open = touch(dinp, dweight, dout, inp, weight, N, C, OC);
    kernels::dense_backward(dinp, dweight, dout, inp, weight, N, C, OC);
  }

  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int64_t N, int64_t C) const override {
    const auto open = touch(out, mean, rstd, inp, weight, bias, N, C);
    kernels::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N,
                          int64_t C) const override {
    const auto open = touch(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    kernels::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                       float eps) const override {
    const auto open = touch(out, rstd, inp, weight, N, C, eps);
    kernels::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                        const float* rstd, int64_t N, int64_t C) const override {
    const auto open = touch(dinp, dweight, dout, inp, weight, rstd, N, C);
    kernels::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) const override {
    const auto open = touch(out, inp);
    kernels::gelu_forward(out, inp, n);
  }
  void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) const override {
    const auto open = touch(dinp, dout, inp, n);
    kernels::gelu_backward(dinp, dout, inp, n);
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F) const override {
    const auto open = touch(out, gate_up, N, F);
    kernels::swiglu_forward(out, gate_up, N, F);
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                       int64_t F) const override {
    const auto open = touch(dgate_up, dout, gate_up, N, F);
    kernels::swiglu_backward(dgate_up, dout, gate_up, N, F);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) const override {
    const auto open = touch(out, a, b, n);
    kernels::residual_forward(out, a, b, n);
  }
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                         int64_t T, int64_t C) const override {
    const auto open = touch(out, tokens, wte, wpe, B, T, C);
    kernels::embedding_forward(out, tokens, wte, wpe, B, T, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C) const override {
    const auto open = touch(dwte, dwpe, dout, tokens, B, T, C);
    kernels::embedding_backward(dwte, dwpe, dout, tokens, B, T, C);
  }

  int64_t rope_table_floats(int64_t T, int64_t HS) const override { return kernels::rope_table_floats(T, HS); }
  void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope) const override {
    const auto open = touch(cos_sin, T, HS, rope);
    kernels::rope_table(cos_sin, T, HS, rope);
  }
  void rope_forward(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                    const float* cos_sin) const override {
    const auto open = touch(x, B, T, n_heads, HS, row_stride, cos_sin);
    kernels::rope_forward(x, B, T, n_heads, HS, row_stride, cos_sin);
  }
  void rope_backward(float* dx, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                     const float* cos_sin) const override {
    const auto open = touch(dx, B, T, n_heads, HS, row_stride, cos_sin);
    kernels::rope_backward(dx, B, T, n_heads, HS, row_stride, cos_sin);
  }

  void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                         int64_t HS, bool causal = true) const override {
    const auto open = touch(out, lse, qkv, B, T, NH, NKV, HS, causal);
    kernels::attention_forward(out, lse, qkv, B, T, NH, NKV, HS, causal);
  }
  int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                     int threads) const override {
    return kernels::attention_backward_scratch(B, T, NH, NKV, HS, threads);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                          float* scratch, bool causal = true) const override {
    const auto open = touch(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS, scratch, causal);
    kernels::attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS, scratch, causal);
  }

  void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc, const float* k,
                                 const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                                 int64_t HS, bool accumulate, bool causal = true) const override {
    const auto open = touch(out, lse, q, ldq, qc, k, v, ldkv, kc, B, NH, NKV, HS, accumulate, causal);
    kernels::attention_chunked_forward(out, lse, q, ldq, qc, k, v, ldkv, kc, B, NH, NKV, HS, accumulate, causal);
  }
  int64_t attention_chunked_backward_scratch(int64_t HS, int threads) const override {
    return kernels::attention_chunked_backward_scratch(HS, threads);
  }
  void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, const float* dout,
                                  const float* q, int64_t ldq, const float* out, const float* lse, SeqChunks qc,
                                  const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH,
                                  int64_t NKV, int64_t HS, float* scratch, bool causal = true) const override {
    const auto open = touch(dq, lddq, dk, dv, lddkv, dout, q, ldq, out, lse, qc, k, v, ldkv, kc, B, NH, NKV, HS, scratch, causal);
    kernels::attention_chunked_backward(dq, lddq, dk, dv, lddkv, dout, q, ldq, out, lse, qc, k, v, ldkv, kc, B, NH,
                                        NKV, HS, scratch, causal);
  }

  int64_t head_scratch(int64_t chunk, int64_t Vp) const override { return kernels::head_scratch(chunk, Vp); }
  double lm_head_cross_entropy(float* dx, float* dwte, const float* x, const float* wte, const int32_t* targets,
                               int64_t N, int64_t C, int64_t V, int64_t Vp, float grad_scale, int64_t chunk,
                               float* scratch, float* logits_out) const override {
    const auto open = touch(dx, dwte, x, wte, targets, N, C, V, Vp, grad_scale, chunk, scratch, logits_out);
    return kernels::lm_head_cross_entropy(dx, dwte, x, wte, targets, N, C, V, Vp, grad_scale, chunk, scratch,
                                          logits_out);
  }

  void grouped_dense_forward(float* out, const float* inp, const float* const* weight, const int64_t* first,
                             int64_t groups, int64_t C, int64_t OC) const override {
    const auto open = touch(out, inp), open_weights = touch_each(weight, groups);
    kernels::grouped_dense_forward(out, inp, weight, first, groups, C, OC);
  }
  void grouped_dense_backward(float* dinp, float* const* dweight, const float* dout, const float* inp,
                              const float* const* weight, const int64_t* first, int64_t groups, int64_t C,
                              int64_t OC) const override {
    const auto open = touch(dinp, dout, inp), open_weights = touch_each(weight, groups),
               open_grads = touch_each(dweight, groups);
    kernels::grouped_dense_backward(dinp, dweight, dout, inp, weight, first, groups, C, OC);
  }
  void moe_router_probs(float* probs, float* lse, const float* logits, int64_t N, int64_t E) const override {
    const auto open = touch(probs, lse, logits, N, E);
    kernels::moe_router_probs(probs, lse, logits, N, E);
  }
  void moe_router_forward(float* probs, float* lse, int32_t* expert, float* weight, const float* logits, int64_t N,
                          int64_t E, int64_t k, bool norm_topk) const override {
    const auto open = touch(probs, lse, expert, weight, logits, N, E, k, norm_topk);
    kernels::moe_router_forward(probs, lse, expert, weight, logits, N, E, k, norm_topk);
  }
  int64_t moe_dispatch(int32_t* offsets, int32_t* assigned, int32_t* slot_row, int32_t* row_token,
                       const int32_t* expert, int64_t N, int64_t E, int64_t k, int64_t capacity,
                       const int32_t* taken, int64_t segment) const override {
    const auto open = touch(offsets, assigned, slot_row, row_token, expert, N, E, k, capacity, taken, segment);
    return kernels::moe_dispatch(offsets, assigned, slot_row, row_token, expert, N, E, k, capacity, taken, segment);
  }
  void moe_gather_rows(float* xs, const float* x, const int32_t* row_token, int64_t rows, int64_t C) const override {
    const auto open = touch(xs, x, row_token, rows, C);
    kernels::moe_gather_rows(xs, x, row_token, rows, C);
  }
  void moe_gather_rows_backward(float* dx, const float* dxs, const int32_t* slot_row, int64_t N, int64_t k,
                                int64_t C) const override {
    const auto open = touch(dx, dxs, slot_row, N, k, C);
    kernels::moe_gather_rows_backward(dx, dxs, slot_row, N, k, C);
  }
  void moe_combine(float* out, const float* res, const float* ys, const float* weight, const int32_t* slot_row,
                   int64_t N, int64_t k, int64_t C) const override {
    const auto open = touch(out, res, ys, weight, slot_row, N, k, C);
    kernels::moe_combine(out, res, ys, weight, slot_row, N, k, C);
  }
  void moe_combine_backward(float* dys, float* dweight, const float* dout, const float* ys, const float* weight,
                            const int32_t* slot_row, int64_t N, int64_t k, int64_t C) const override {
    const auto open = touch(dys, dweight, dout, ys, weight, slot_row, N, k, C);
    kernels::moe_combine_backward(dys, dweight, dout, ys, weight, slot_row, N, k, C);
  }
  void moe_router_losses(double* aux, double* z, const float* probs, const float* lse, const int32_t* assigned,
                         int64_t N, int64_t E, int64_t k, int64_t G) const override {
    const auto open = touch(aux, z, probs, lse, assigned, N, E, k, G);
    kernels::moe_router_losses(aux, z, probs, lse, assigned, N, E, k, G);
  }
  void moe_router_backward(float* dlogits, const float* dweight, const float* probs, const float* lse,
                           const int32_t* expert, const float* weight, const int32_t* assigned, int64_t N, int64_t E,
                           int64_t k, int64_t G, bool norm_topk, float aux_scale, float z_scale) const override {
    const auto open = touch(dlogits, dweight, probs, lse, expert, weight, assigned, N, E, k, G, norm_topk, aux_scale, z_scale);
    kernels::moe_router_backward(dlogits, dweight, probs, lse, expert, weight, assigned, N, E, k, G, norm_topk,
                                 aux_scale, z_scale);
  }

  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                    float eps, float weight_decay, int64_t t) const override {
    const auto open = touch(p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
    kernels::adamw_update(p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  double sum_squares(const float* x, int64_t n) const override {
    const auto open = touch(x);
    return kernels::sum_squares(x, n);
  }
  void scale(float* x, int64_t n, float s) const override {
    const auto open = touch(x);
    kernels::scale(x, n, s);
  }
  void quantize_int8(int8_t* q, float* scales, const float* x, int64_t n, int64_t group, bool stochastic,
                     uint64_t key) const override {
    const auto open = touch(q, scales, x, n, group);
    kernels::quantize_int8(q, scales, x, n, group, {stochastic, key});
  }
  void dequantize_int8(float* x, const int8_t* q, const float* scales, int64_t n, int64_t group) const override {
    const auto open = touch(x, q, scales, n, group);
    kernels::dequantize_int8(x, q, scales, n, group);
  }
  void fp32_to_bf16(uint16_t* out, const float* in, int64_t n) const override {
    const auto open = touch(out, in, n);
    kernels::fp32_to_bf16(out, in, n);
  }
  void bf16_to_fp32(float* out, const uint16_t* in, int64_t n) const override {
    const auto open = touch(out, in, n);
    kernels::bf16_to_fp32(out, in, n);
  }

 private:
  static void move(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  }
  // The guarded buffers the call's pointer arguments fall in, open until it returns (nothing on
  // the host backend).
  template <class... A>
  GuardedPages::Open touch(const A&... args) const {
    return pages_ ? pages_->open(args...) : GuardedPages::Open();
  }
  template <class T>
  GuardedPages::Open touch_each(T* const* ptrs, int64_t n) const {
    return pages_ ? pages_->open_each(ptrs, n) : GuardedPages::Open();
  }

  std::unique_ptr<GuardedPages> pages_;  // as a device: where its buffers live
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(MemoryPool& memory, bool as_device) {
  return std::make_unique<CpuBackend>(memory, as_device);
}

}  // namespace shardlm::kernels
