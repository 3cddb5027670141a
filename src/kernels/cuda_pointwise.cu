// CUDA backend: norms, activations, residual, embedding, rotary embedding, optimizer and
// utilities. fp32 storage and arithmetic throughout; reductions over rows use warp shuffles and
// reductions over columns run rows in a fixed order, so results do not depend on scheduling
// (except embedding_backward's token scatter, which adds with atomics).
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Column sums dst[c] += sum_n f(n, c) in two passes, so that every SM has work however few the
// columns: partial sums over slabs of rows (a block: 32 columns x one slab, 8 row phases), then
// the slabs added in order. The order of every addition is fixed: deterministic.
template <class F>
__global__ void colsum_partial_kernel(float* part, int64_t N, int64_t C, int64_t rows_per, F f) {
  __shared__ float sh[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per, r1 = min(N, r0 + rows_per);
  float acc = 0;
  if (c < C)
    for (int64_t n = r0 + threadIdx.y; n < r1; n += 8) acc += f(n, c);
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float s = 0;
    for (int k = 0; k < 8; ++k) s += sh[k][threadIdx.x];
    part[blockIdx.y * C + c] = s;
  }
}

__global__ void colsum_final_kernel(float* dst, const float* part, int64_t R, int64_t C) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float s = 0;
  for (int64_t r = 0; r < R; ++r) s += part[r * C + c];
  dst[c] += s;
}

template <class F>
void colsum(const Backend& backend, float* dst, int64_t N, int64_t C, F f) {
  if (N <= 0 || C <= 0) return;
  const int64_t col_blocks = (C + 31) / 32;
  const int64_t slabs = std::max<int64_t>(1, std::min((1056 + col_blocks - 1) / col_blocks, (N + 63) / 64));
  const int64_t rows_per = (N + slabs - 1) / slabs;
  Buffer part = device_scratch(backend, sizeof(float) * slabs * C);
  colsum_partial_kernel<<<dim3(unsigned(col_blocks), unsigned(slabs)), dim3(32, 8), 0, stream()>>>(part.f32(), N, C,
                                                                                                   rows_per, f);
  SHARDLM_CUDA_LAUNCHED();
  colsum_final_kernel<<<unsigned((C + 255) / 256), 256, 0, stream()>>>(dst, part.f32(), slabs, C);
  SHARDLM_CUDA_LAUNCHED();
}

__global__ void bias_rows_kernel(float* out, const float* bias, int64_t N, int64_t OC) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * OC; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bias[i % OC];
}

// One warp per row: mean and biased variance in two passes over the (cached) row.
__global__ void layernorm_fwd_kernel(float* out, float* mean, float* rstd, const float* inp, const float* w,
                                     const float* b, int64_t N, int64_t C) {
  const int64_t row = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (row >= N) return;
  const float* x = inp + row * C;
  float s = 0;
  for (int64_t c = threadIdx.x; c < C; c += 32) s += x[c];
  const float mu = warp_sum(s) / C;
  float v = 0;
  for (int64_t c = threadIdx.x; c < C; c += 32) v += (x[c] - mu) * (x[c] - mu);
  const float r = rsqrtf(warp_sum(v) / C + 1e-5f);
  for (int64_t c = threadIdx.x; c < C; c += 32) out[row * C + c] = (x[c] - mu) * r * w[c] + b[c];
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

// dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = dout * weight.
__global__ void layernorm_bwd_kernel(float* dinp, const float* dout, const float* inp, const float* w,
                                     const float* mean, const float* rstd, int64_t N, int64_t C) {
  const int64_t row = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  const float mu = mean[row], r = rstd[row];
  float s1 = 0, s2 = 0;
  for (int64_t c = threadIdx.x; c < C; c += 32) {
    const float dn = dy[c] * w[c];
    s1 += dn;
    s2 += dn * (x[c] - mu) * r;
  }
  s1 = warp_sum(s1) / C;
  s2 = warp_sum(s2) / C;
  for (int64_t c = threadIdx.x; c < C; c += 32)
    dinp[row * C + c] += r * (dy[c] * w[c] - s1 - (x[c] - mu) * r * s2);
}

__global__ void rmsnorm_fwd_kernel(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C,
                                   float eps) {
  const int64_t row = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (row >= N) return;
  const float* x = inp + row * C;
  float s = 0;
  for (int64_t c = threadIdx.x; c < C; c += 32) s += x[c] * x[c];
  const float r = rsqrtf(warp_sum(s) / C + eps);
  for (int64_t c = threadIdx.x; c < C; c += 32) out[row * C + c] = x[c] * r * w[c];
  if (threadIdx.x == 0 && rstd) rstd[row] = r;
}

// y = x r w, r = (mean x^2 + eps)^-1/2: dx = r dn - r^3 x mean(dn x), dn = dy w.
__global__ void rmsnorm_bwd_kernel(float* dinp, const float* dout, const float* inp, const float* w,
                                   const float* rstd, int64_t N, int64_t C) {
  const int64_t row = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  const float r = rstd[row];
  float s = 0;
  for (int64_t c = threadIdx.x; c < C; c += 32) s += dy[c] * w[c] * x[c];
  s = warp_sum(s) / C;
  for (int64_t c = threadIdx.x; c < C; c += 32) dinp[row * C + c] += r * dy[c] * w[c] - r * r * r * x[c] * s;
}

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluK1 = 0.044715f;

__global__ void gelu_fwd_kernel(float* out, const float* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(kGeluK0 * (x + kGeluK1 * x * x * x)));
  }
}

__global__ void gelu_bwd_kernel(float* dinp, const float* dout, const float* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    const float t = tanhf(kGeluK0 * (x + kGeluK1 * x * x * x));
    const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
    dinp[i] += d * dout[i];
  }
}

__global__ void swiglu_fwd_kernel(float* out, const float* gu, int64_t N, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / F, f = i % F;
    const float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
    out[i] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void swiglu_bwd_kernel(float* dgu, const float* dout, const float* gu, int64_t N, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / F, f = i % F;
    const float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
    const float sig = 1.0f / (1.0f + expf(-g));
    dgu[n * 2 * F + f] += dout[i] * u * sig * (1.0f + g * (1.0f - sig));
    dgu[n * 2 * F + F + f] += dout[i] * g * sig;
  }
}

__global__ void residual_kernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void embedding_fwd_kernel(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                                     int64_t BT, int64_t T, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < BT * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bt = i / C, c = i % C;
    float v = wte[int64_t(tokens[bt]) * C + c];
    if (wpe) v += wpe[(bt % T) * C + c];
    out[i] = v;
  }
}

// Rows of the same token collide: atomics (the order of the adds varies between runs).
__global__ void embedding_wte_bwd_kernel(float* dwte, const float* dout, const int32_t* tokens, int64_t BT,
                                         int64_t C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < BT * C; i += int64_t(gridDim.x) * blockDim.x)
    atomicAdd(dwte + int64_t(tokens[i / C]) * C + i % C, dout[i]);
}

__global__ void embedding_wpe_bwd_kernel(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * C; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0;
    for (int64_t b = 0; b < B; ++b) s += dout[b * T * C + i];
    dwpe[i] += s;
  }
}

// As kernels/cpu.h: inv_freq from rope.h, the fp32 angle, cos/sin in double.
__global__ void rope_table_kernel(float* cs, int64_t T, int64_t HS, Rope rope) {
  const int64_t H2 = HS / 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H2; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H2, k = i % H2;
    const float inv = rope_inv_freq(k, HS, rope);
    const float ang = static_cast<float>(t) * inv;
    cs[t * HS + k] = static_cast<float>(cos(static_cast<double>(ang)));
    cs[t * HS + H2 + k] = static_cast<float>(sin(static_cast<double>(ang)));
  }
}

__global__ void rope_kernel(float* x, int64_t B, int64_t T, int64_t NHd, int64_t HS, int64_t stride,
                            const float* cs, float sign) {
  const int64_t H2 = HS / 2, n = B * T * NHd * H2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i % H2, h = (i / H2) % NHd, bt = i / (H2 * NHd), t = bt % T;
    float* v = x + bt * stride + h * HS;
    const float c = cs[t * HS + k], s = sign * cs[t * HS + H2 + k];
    const float a = v[k], b = v[k + H2];
    v[k] = a * c - b * s;
    v[k + H2] = b * c + a * s;
  }
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float decay, float w1,
                             bool lerp_low, float beta2, float w2, float bc2_sqrt, float eps, float neg_step) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i], m0 = m[i];
    const float mi = lerp_low ? m0 + w1 * (gi - m0) : gi - (gi - m0) * (1.0f - w1);
    const float vi = v[i] * beta2 + w2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay + neg_step * mi / (sqrtf(vi) / bc2_sqrt + eps);
  }
}

constexpr int kSumBlocks = 1024;

__device__ double block_sum(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  return sh[0];
}

__global__ void sumsq_partial_kernel(double* partials, const float* x, int64_t n) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += double(x[i]) * double(x[i]);
  const double b = block_sum(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = b;
}

__global__ void sum_final_kernel(double* out, const double* partials, int64_t n, bool accumulate) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  const double b = block_sum(s, sh);
  if (threadIdx.x == 0) *out = accumulate ? *out + b : b;
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

__global__ void to_bf16_kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

__device__ uint32_t bf16_pair(float lo, float hi) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}

// Four at a time (16-byte loads, 8-byte stores): n4 = n / 4 groups, in and out aligned to them.
__global__ void to_bf16_x4_kernel(uint2* out, const float4* in, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    out[i] = make_uint2(bf16_pair(v.x, v.y), bf16_pair(v.z, v.w));
  }
}

__global__ void from_bf16_kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __uint_as_float(uint32_t(in[i]) << 16);
}

// Grid for a grid-stride loop over n elements.
unsigned grid(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 8192 ? (b > 0 ? b : 1) : 8192);
}

// Row kernels: 8 warps per block, one row each.
constexpr int kRowsPerBlock = 8;
unsigned row_blocks(int64_t N) { return static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock); }

}  // namespace

#define LAUNCH(kernel, n, ...)                                        \
  do {                                                                \
    if ((n) > 0) {                                                    \
      kernel<<<grid(n), kThreads, 0, stream()>>>(__VA_ARGS__);        \
      SHARDLM_CUDA_LAUNCHED();                                        \
    }                                                                 \
  } while (0)
#define LAUNCH_ROWS(kernel, N, ...)                                                  \
  do {                                                                               \
    if ((N) > 0) {                                                                   \
      kernel<<<row_blocks(N), dim3(32, kRowsPerBlock), 0, stream()>>>(__VA_ARGS__);  \
      SHARDLM_CUDA_LAUNCHED();                                                       \
    }                                                                                \
  } while (0)

void add_bias_rows(float* out, const float* bias, int64_t N, int64_t OC) {
  LAUNCH(bias_rows_kernel, N * OC, out, bias, N, OC);
}

void bias_grad(const Backend& backend, float* dbias, const float* dout, int64_t N, int64_t OC) {
  colsum(backend, dbias, N, OC, [=] __device__(int64_t n, int64_t c) { return dout[n * OC + c]; });
}
void bias_grad_and_bf16(const Backend& backend, float* dbias, uint16_t* dout16, const float* dout, int64_t N,
                        int64_t OC) {
  colsum(backend, dbias, N, OC, [=] __device__(int64_t n, int64_t c) {
    const float x = dout[n * OC + c];
    dout16[n * OC + c] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    return x;
  });
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C) {
  LAUNCH_ROWS(layernorm_fwd_kernel, N, out, mean, rstd, inp, weight, bias, N, C);
}

void layernorm_backward(const Backend& backend, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd, int64_t N,
                        int64_t C) {
  if (dinp) LAUNCH_ROWS(layernorm_bwd_kernel, N, dinp, dout, inp, weight, mean, rstd, N, C);
  if (dweight)
    colsum(backend, dweight, N, C,
           [=] __device__(int64_t n, int64_t c) { return dout[n * C + c] * (inp[n * C + c] - mean[n]) * rstd[n]; });
  if (dbias) bias_grad(backend, dbias, dout, N, C);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                     float eps) {
  LAUNCH_ROWS(rmsnorm_fwd_kernel, N, out, rstd, inp, weight, N, C, eps);
}

void rmsnorm_backward(const Backend& backend, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  if (dinp) LAUNCH_ROWS(rmsnorm_bwd_kernel, N, dinp, dout, inp, weight, rstd, N, C);
  if (dweight)
    colsum(backend, dweight, N, C,
           [=] __device__(int64_t n, int64_t c) { return dout[n * C + c] * inp[n * C + c] * rstd[n]; });
}

void gelu_forward(float* out, const float* inp, int64_t n) { LAUNCH(gelu_fwd_kernel, n, out, inp, n); }
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
  LAUNCH(gelu_bwd_kernel, n, dinp, dout, inp, n);
}
void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t F) {
  LAUNCH(swiglu_fwd_kernel, N * F, out, gate_up, N, F);
}
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t F) {
  LAUNCH(swiglu_bwd_kernel, N * F, dgate_up, dout, gate_up, N, F);
}
void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  LAUNCH(residual_kernel, n, out, a, b, n);
}
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C) {
  LAUNCH(embedding_fwd_kernel, B * T * C, out, tokens, wte, wpe, B * T, T, C);
}
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C) {
  if (dwte) LAUNCH(embedding_wte_bwd_kernel, B * T * C, dwte, dout, tokens, B * T, C);
  if (dwpe) LAUNCH(embedding_wpe_bwd_kernel, T * C, dwpe, dout, B, T, C);
}
void rope_table(float* cos_sin, int64_t T, int64_t HS, const Rope& rope) {
  LAUNCH(rope_table_kernel, T * (HS / 2), cos_sin, T, HS, rope);
}
void rope_apply(float* x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t row_stride,
                const float* cos_sin, bool inverse) {
  LAUNCH(rope_kernel, B * T * n_heads * (HS / 2), x, B, T, n_heads, HS, row_stride, cos_sin, inverse ? -1.0f : 1.0f);
}
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay, float w1, bool lerp_low,
                  float beta2, float w2, float bc2_sqrt, float eps, float neg_step) {
  LAUNCH(adamw_kernel, n, p, g, m, v, n, decay, w1, lerp_low, beta2, w2, bc2_sqrt, eps, neg_step);
}
void sum_squares(double* out_dev, double* partials, const float* x, int64_t n) {
  sumsq_partial_kernel<<<kSumBlocks, kThreads, 0, stream()>>>(partials, x, n);
  SHARDLM_CUDA_LAUNCHED();
  sum_final_kernel<<<1, kThreads, 0, stream()>>>(out_dev, partials, kSumBlocks, false);
  SHARDLM_CUDA_LAUNCHED();
}
void accumulate_sum(double* acc, const double* rows, int64_t n) {
  sum_final_kernel<<<1, kThreads, 0, stream()>>>(acc, rows, n, true);
  SHARDLM_CUDA_LAUNCHED();
}
void scale(float* x, int64_t n, float s) { LAUNCH(scale_kernel, n, x, n, s); }
void fp32_to_bf16(uint16_t* out, const float* in, int64_t n) {
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0) {
    const int64_t n4 = n / 4;
    LAUNCH(to_bf16_x4_kernel, n4, reinterpret_cast<uint2*>(out), reinterpret_cast<const float4*>(in), n4);
    return;
  }
  LAUNCH(to_bf16_kernel, n, out, in, n);
}
void bf16_to_fp32(float* out, const uint16_t* in, int64_t n) { LAUNCH(from_bf16_kernel, n, out, in, n); }

}  // namespace shardlm::kernels::cuda
