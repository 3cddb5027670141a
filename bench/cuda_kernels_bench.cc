// Per-method times of the CUDA backend at GPT-2 124M's shapes (B=16, T=1024), and their sum
// over one training step: where a step's time goes. Built with -DSHARDLM_CUDA=ON:
//   build-cuda/cuda_kernels_bench
// Each method: 2 untimed calls, then 10 timed, closed by a 4-byte download (which waits for the
// stream); the time per call is the mean (a ~20 us download included once per 10 calls).
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

namespace {

using shardlm::Buffer;
using shardlm::MemCategory;
using shardlm::kernels::Backend;

struct Bench {
  const Backend& be;
  double step_ms = 0;
  Buffer sync_buf;
  explicit Bench(const Backend& b) : be(b) { sync_buf = be.alloc(MemCategory::workspace, 4, Buffer::Fill::zero); }

  Buffer rand(int64_t n, float scale = 1.0f) {
    std::vector<float> h(n);
    std::mt19937 rng(n);
    std::uniform_real_distribution<float> u(-scale, scale);
    for (auto& x : h) x = u(rng);
    Buffer b = be.alloc(MemCategory::workspace, 4 * n, Buffer::Fill::none);
    be.upload(b.data(), h.data(), 4 * n);
    return b;
  }
  void sync() {
    float x;
    be.download(&x, sync_buf.data(), 4);
  }
  // Times fn; `per_step` is how often a training step runs it; `part` lines (inside another
  // method) are shown but not added to the step's sum.
  void time(const std::string& name, int per_step, const std::function<void()>& fn, bool part = false) {
    for (int i = 0; i < 2; ++i) fn();
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) fn();
    sync();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
    if (!part) step_ms += ms * per_step;
    std::printf("%-36s %8.3f ms  x%-3d = %8.2f ms/step\n", name.c_str(), ms, per_step, ms * per_step);
  }
};

}  // namespace

int main() {
  if (!shardlm::kernels::cuda_device_present()) {
    std::printf("no CUDA device present: nothing to time\n");
    return 0;
  }
  shardlm::MemoryPool memory;
  const std::unique_ptr<Backend> backend = shardlm::kernels::make_cuda_backend(memory);
  const Backend& be = *backend;
  Bench b(be);
  const int64_t B = 16, T = 1024, N = B * T, C = 768, NH = 12, HS = 64, F = 4 * C, V = 50257, Vp = 50304, L = 12;
  Buffer x = b.rand(N * C), y = b.rand(N * C), dx = b.rand(N * C), h = b.rand(N * F), dh = b.rand(N * F);
  Buffer qkv = b.rand(N * 3 * C, 2), dqkv = b.rand(N * 3 * C);
  Buffer wqkv = b.rand(C * 3 * C, 0.02f), wfc = b.rand(C * F, 0.02f), wproj = b.rand(C * C, 0.02f), bias = b.rand(F);
  Buffer dw = b.rand(C * F), db = b.rand(F), mean = b.rand(N), rstd = b.rand(N, 1), lse = b.rand(B * NH * T);
  Buffer wte = b.rand(Vp * C, 0.02f), dwte = b.rand(Vp * C), wpe = b.rand(1024 * C);
  Buffer scratch = b.rand(be.head_scratch(256, Vp)), attn_scratch = b.rand(be.attention_backward_scratch(B, T, NH, NH, HS, 1));
  std::vector<int32_t> tok(N);
  for (int64_t i = 0; i < N; ++i) tok[i] = int32_t((i * 7919) % V);
  Buffer tokens = be.alloc(MemCategory::workspace, 4 * N, Buffer::Fill::none);
  be.upload(tokens.data(), tok.data(), 4 * N);
  const int32_t* tk = tokens.as<int32_t>();
  std::printf("GPT-2 124M shapes, B=%lld T=%lld, bf16 GEMMs (fp32 storage)\n", (long long)B, (long long)T);
  b.time("linear_forward qkv (768->2304)", L, [&] { be.linear_forward(qkv.f32(), x.f32(), wqkv.f32(), bias.f32(), N, C, 3 * C); });
  b.time("linear_forward proj (768->768)", L, [&] { be.linear_forward(y.f32(), x.f32(), wproj.f32(), bias.f32(), N, C, C); });
  b.time("linear_forward fc (768->3072)", L, [&] { be.linear_forward(h.f32(), x.f32(), wfc.f32(), bias.f32(), N, C, F); });
  b.time("linear_forward fcproj (3072->768)", L, [&] { be.linear_forward(y.f32(), h.f32(), wfc.f32(), bias.f32(), N, F, C); });
  b.time("linear_backward qkv", L, [&] { be.linear_backward(dx.f32(), dw.f32(), db.f32(), dqkv.f32(), x.f32(), wqkv.f32(), N, C, 3 * C); });
  b.time("linear_backward proj", L, [&] { be.linear_backward(dx.f32(), dw.f32(), db.f32(), y.f32(), x.f32(), wproj.f32(), N, C, C); });
  b.time("linear_backward fc", L, [&] { be.linear_backward(dx.f32(), dw.f32(), db.f32(), dh.f32(), x.f32(), wfc.f32(), N, C, F); });
  b.time("linear_backward fcproj", L, [&] { be.linear_backward(dh.f32(), dw.f32(), db.f32(), y.f32(), h.f32(), wfc.f32(), N, F, C); });
  b.time("linear_backward dbias only (3072)", 0, [&] { be.linear_backward(nullptr, nullptr, db.f32(), dh.f32(), nullptr, nullptr, N, C, F); });
  b.time("layernorm_forward", 2 * L + 1, [&] { be.layernorm_forward(y.f32(), mean.f32(), rstd.f32(), x.f32(), bias.f32(), bias.f32(), N, C); });
  b.time("layernorm_backward", 2 * L + 1, [&] { be.layernorm_backward(dx.f32(), dw.f32(), db.f32(), y.f32(), x.f32(), bias.f32(), mean.f32(), rstd.f32(), N, C); });
  b.time("gelu_forward", L, [&] { be.gelu_forward(dh.f32(), h.f32(), N * F); });
  b.time("gelu_backward", L, [&] { be.gelu_backward(dh.f32(), h.f32(), h.f32(), N * F); });
  b.time("residual_forward", 2 * L, [&] { be.residual_forward(y.f32(), x.f32(), dx.f32(), N * C); });
  b.time("zero (N x 3C)", 3 * L, [&] { be.zero(dqkv.data(), 4 * N * 3 * C); });
  b.time("attention_forward", L, [&] { be.attention_forward(y.f32(), lse.f32(), qkv.f32(), B, T, NH, NH, HS); });
  b.time("attention_backward", L, [&] { be.attention_backward(dqkv.f32(), x.f32(), qkv.f32(), y.f32(), lse.f32(), B, T, NH, NH, HS, attn_scratch.f32()); });
  {  // the cuBLAS attention path (SHARDLM_CUDA_ATTENTION=cublas) for comparison
    const auto cublas = shardlm::kernels::make_cuda_backend(
        memory, {.attention = shardlm::kernels::CudaOptions::Attention::cublas});
    const Backend& cb = *cublas;
    b.time("  attention_forward (cublas path)", L, [&] { cb.attention_forward(y.f32(), lse.f32(), qkv.f32(), B, T, NH, NH, HS); }, true);
    b.time("  attention_backward (cublas path)", L, [&] { cb.attention_backward(dqkv.f32(), x.f32(), qkv.f32(), y.f32(), lse.f32(), B, T, NH, NH, HS, attn_scratch.f32()); }, true);
  }
  b.time("embedding_forward", 1, [&] { be.embedding_forward(y.f32(), tk, wte.f32(), wpe.f32(), B, T, C); });
  b.time("embedding_backward", 1, [&] { be.embedding_backward(dwte.f32(), dw.f32(), x.f32(), tk, B, T, C); });
  b.time("lm_head_cross_entropy (train)", 1, [&] { be.lm_head_cross_entropy(dx.f32(), dwte.f32(), x.f32(), wte.f32(), tk, N, C, V, Vp, 1.0f / N, 256, scratch.f32(), nullptr); });
  {  // the head's parts for one 2048-row slab (8 per step): its three GEMMs through dense_*
    const int64_t S = 2048;
    Buffer logits = b.rand(S * Vp);
    b.time("  head GEMM logits (2048x768 @ 768x50257)", 8, [&] { be.dense_forward(logits.f32(), x.f32(), wte.f32(), S, C, V); }, true);
    b.time("  head GEMM dx (2048x50257 @ 50257x768)", 8, [&] { be.dense_backward(dx.f32(), nullptr, logits.f32(), x.f32(), wte.f32(), S, C, V); }, true);
    b.time("  head GEMM dwte (50257x2048 @ 2048x768)", 8, [&] { be.dense_backward(nullptr, dwte.f32(), logits.f32(), x.f32(), wte.f32(), S, C, V); }, true);
    b.time("  the same three at Vp = 50304 columns", 8, [&] {
      be.dense_forward(logits.f32(), x.f32(), wte.f32(), S, C, Vp);
      be.dense_backward(dx.f32(), dwte.f32(), logits.f32(), x.f32(), wte.f32(), S, C, Vp);
    }, true);
  }
  const int64_t P = 124475904;
  Buffer p = b.rand(P), g = b.rand(P), m = b.rand(P), v = b.rand(P, 0.01f);
  b.time("adamw_update (124M)", 1, [&] { be.adamw_update(p.f32(), g.f32(), m.f32(), v.f32(), P, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 3); });
  b.time("sum_squares (124M)", 1, [&] { be.sum_squares(g.f32(), P); });
  std::printf("sum over one step: %.1f ms\n", b.step_ms);
  return 0;
}
