// The Backend methods a backend may lack: they refuse, naming it.
#include <stdexcept>
#include <string>

#include "kernels/backend.h"

namespace shardlm::kernels {

namespace {
[[noreturn]] void missing(const Backend& b, const char* what) {
  throw std::logic_error(std::string("backend ") + b.name() + " has no " + what + " (mixture of experts runs on the cpu backend)");
}
}  // namespace

void Backend::moe_router_probs(float*, float*, const float*, int64_t, int64_t) const { missing(*this, "moe_router_probs"); }
void Backend::moe_router_forward(float*, float*, int32_t*, float*, const float*, int64_t, int64_t, int64_t, bool) const {
  missing(*this, "moe_router_forward");
}
int64_t Backend::moe_dispatch(int32_t*, int32_t*, int32_t*, int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                              int64_t) const {
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
                                int64_t) const {
  missing(*this, "moe_router_losses");
}
void Backend::moe_router_backward(float*, const float*, const float*, const float*, const int32_t*, const float*,
                                  const int32_t*, int64_t, int64_t, int64_t, bool, float, float) const {
  missing(*this, "moe_router_backward");
}

}  // namespace shardlm::kernels
