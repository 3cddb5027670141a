// The Backend methods a backend may lack: they refuse, naming it, or fall back on the ones every
// backend has.
#include <stdexcept>
#include <string>

#include "kernels/backend.h"

namespace shardlm::kernels {

namespace {
[[noreturn]] void missing(const Backend& b, const char* what, const char* feature = "mixture of experts") {
  throw std::logic_error(std::string("backend ") + b.name() + " has no " + what + " (" + feature +
                         " runs on the cpu backend)");
}
}  // namespace

void Backend::copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                        int64_t rows) const {
  for (int64_t i = 0; i < rows; ++i)
    copy(static_cast<char*>(dst) + i * dst_pitch, static_cast<const char*>(src) + i * src_pitch, row_bytes);
}

void Backend::add_rows(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t width, int64_t rows) const {
  for (int64_t i = 0; i < rows; ++i) residual_forward(dst + i * dst_ld, dst + i * dst_ld, src + i * src_ld, width);
}

void Backend::grouped_dense_forward(float* out, const float* inp, const float* const* weight, const int64_t* first,
                                    int64_t groups, int64_t C, int64_t OC) const {
  for (int64_t g = 0; g < groups; ++g)
    if (const int64_t n = first[g + 1] - first[g]; n > 0)
      dense_forward(out + first[g] * OC, inp + first[g] * C, weight[g], n, C, OC);
}

void Backend::grouped_dense_backward(float* dinp, float* const* dweight, const float* dout, const float* inp,
                                     const float* const* weight, const int64_t* first, int64_t groups, int64_t C,
                                     int64_t OC) const {
  for (int64_t g = 0; g < groups; ++g)
    if (const int64_t n = first[g + 1] - first[g]; n > 0)
      dense_backward(dinp ? dinp + first[g] * C : nullptr, dweight[g], dout + first[g] * OC, inp + first[g] * C,
                     weight[g], n, C, OC);
}

void Backend::attention_chunked_forward(float*, float*, const float*, int64_t, SeqChunks, const float*, const float*,
                                        int64_t, SeqChunks, int64_t, int64_t, int64_t, int64_t, bool, bool) const {
  missing(*this, "attention_chunked_forward", "context parallelism");
}
int64_t Backend::attention_chunked_backward_scratch(int64_t, int) const {
  missing(*this, "attention_chunked_backward_scratch", "context parallelism");
}
void Backend::attention_chunked_backward(float*, int64_t, float*, float*, int64_t, const float*, const float*, int64_t,
                                         const float*, const float*, SeqChunks, const float*, const float*, int64_t,
                                         SeqChunks, int64_t, int64_t, int64_t, int64_t, float*, bool) const {
  missing(*this, "attention_chunked_backward", "context parallelism");
}

void Backend::quantize_int8(int8_t*, float*, const float*, int64_t, int64_t, bool, uint64_t) const {
  missing(*this, "quantize_int8", "--act-quant");
}
void Backend::dequantize_int8(float*, const int8_t*, const float*, int64_t, int64_t) const {
  missing(*this, "dequantize_int8", "--act-quant");
}

void Backend::moe_router_probs(float*, float*, const float*, int64_t, int64_t) const { missing(*this, "moe_router_probs"); }
void Backend::moe_router_forward(float*, float*, int32_t*, float*, const float*, int64_t, int64_t, int64_t, bool) const {
  missing(*this, "moe_router_forward");
}
int64_t Backend::moe_dispatch(int32_t*, int32_t*, int32_t*, int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                              int64_t, const int32_t*, int64_t) const {
  missing(*this, "moe_dispatch");
}
void Backend::moe_gather_rows(float*, const float*, const int32_t*, int64_t, int64_t) const { missing(*this, "moe_gather_rows"); }
void Backend::moe_gather_rows_backward(float*, const float*, const int32_t*, int64_t, int64_t, int64_t) const {
  missing(*this, "moe_gather_rows_backward");
}
void Backend::moe_combine(float*, const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                          int64_t) const {
  missing(*this, "moe_combine");
}
void Backend::moe_combine_backward(float*, float*, const float*, const float*, const float*, const int32_t*, int64_t,
                                   int64_t, int64_t) const {
  missing(*this, "moe_combine_backward");
}
void Backend::moe_router_losses(double*, double*, const float*, const float*, const int32_t*, int64_t, int64_t,
                                int64_t, int64_t) const {
  missing(*this, "moe_router_losses");
}
void Backend::moe_router_backward(float*, const float*, const float*, const float*, const int32_t*, const float*,
                                  const int32_t*, int64_t, int64_t, int64_t, int64_t, bool, float, float) const {
  missing(*this, "moe_router_backward");
}

}  // namespace shardlm::kernels
