// Google Benchmark timings of the CPU kernels at the `small` model shapes
// (6 layers, C=384, NH=6, HS=64, V=50257 padded to 50304, B=4, T=256 => N=1024 rows).
// Threads: SHARDLM_THREADS (default: omp_get_max_threads()).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/cpu.h"

namespace k = shardlm::kernels;

namespace {

std::vector<float> randv(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// C (M,N) = op(A) op(B); args: M, N, K, transA, transB.
void BM_Matmul(benchmark::State& st) {
  const int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  const bool ta = st.range(3) != 0, tb = st.range(4) != 0;
  auto A = randv(M * K, 1), B = randv(K * N, 2);
  std::vector<float> C(M * N, 0.0f);
  for (auto _ : st) {
    k::matmul(ta, tb, M, N, K, 1.0f, A.data(), ta ? M : K, B.data(), tb ? K : N, 0.0f, C.data(), N);
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * M * N * K * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
// Forward (NN), dinp (NT) and dweight (TN) GEMMs of the small model's linear layers.
BENCHMARK(BM_Matmul)
    ->ArgNames({"M", "N", "K", "tA", "tB"})
    ->Args({1024, 1536, 384, 0, 0})   // fc:   (1024x384) x (384x1536)
    ->Args({1024, 1152, 384, 0, 0})   // qkv
    ->Args({1024, 384, 384, 0, 0})    // attn proj
    ->Args({1024, 384, 1536, 0, 0})   // fc proj
    ->Args({1024, 384, 1536, 0, 1})   // fc dinp:  dout (1024x1536) x W^T
    ->Args({384, 1536, 1024, 1, 0})   // fc dweight: inp^T x dout
    ->Args({256, 50257, 384, 0, 1})   // lm head logits chunk
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

struct AttnData {
  int64_t B, T, NH, HS, C;
  std::vector<float> qkv, out, lse, dout, dqkv, scratch;
  AttnData(int64_t b, int64_t t, int64_t nh, int64_t hs)
      : B(b), T(t), NH(nh), HS(hs), C(nh * hs), qkv(randv(b * t * 3 * nh * hs, 3, -2.f, 2.f)),
        out(b * t * nh * hs), lse(b * nh * t), dout(randv(b * t * nh * hs, 4)),
        dqkv(b * t * 3 * nh * hs),
        scratch(k::attention_backward_scratch(b, t, nh, hs, omp_get_max_threads())) {}
};

// Causal attention FLOPs (QK^T and PV, half the square): forward 4*B*NH*T*T*HS/2,
// backward 2.5x that.
double attn_fwd_flops(const AttnData& d) { return 2.0 * d.B * d.NH * double(d.T) * d.T * d.HS; }

void BM_AttentionForward(benchmark::State& st) {
  AttnData d(st.range(0), st.range(1), st.range(2), st.range(3));
  for (auto _ : st) {
    k::attention_forward(d.out.data(), d.lse.data(), d.qkv.data(), d.B, d.T, d.NH, d.HS);
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(attn_fwd_flops(d) * st.iterations() / 1e9, benchmark::Counter::kIsRate);
}
void BM_AttentionBackward(benchmark::State& st) {
  AttnData d(st.range(0), st.range(1), st.range(2), st.range(3));
  k::attention_forward(d.out.data(), d.lse.data(), d.qkv.data(), d.B, d.T, d.NH, d.HS);
  for (auto _ : st) {
    k::attention_backward(d.dqkv.data(), d.dout.data(), d.qkv.data(), d.out.data(), d.lse.data(),
                          d.B, d.T, d.NH, d.HS, d.scratch.data());
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2.5 * attn_fwd_flops(d) * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
void BM_AttentionForwardBackward(benchmark::State& st) {
  AttnData d(st.range(0), st.range(1), st.range(2), st.range(3));
  for (auto _ : st) {
    k::attention_forward(d.out.data(), d.lse.data(), d.qkv.data(), d.B, d.T, d.NH, d.HS);
    k::attention_backward(d.dqkv.data(), d.dout.data(), d.qkv.data(), d.out.data(), d.lse.data(),
                          d.B, d.T, d.NH, d.HS, d.scratch.data());
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter(3.5 * attn_fwd_flops(d) * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
#define ATTN_ARGS                                                                   \
  ArgNames({"B", "T", "NH", "HS"})->Args({4, 256, 6, 64})->Args({1, 1024, 6, 64}) \
      ->Unit(benchmark::kMillisecond)->UseRealTime()
BENCHMARK(BM_AttentionForward)->ATTN_ARGS;
BENCHMARK(BM_AttentionBackward)->ATTN_ARGS;
BENCHMARK(BM_AttentionForwardBackward)->ATTN_ARGS;

// LM head + cross-entropy, forward and backward; args: N, C, V, Vp, chunk, train.
void BM_LmHead(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1), V = st.range(2), Vp = st.range(3),
                chunk = st.range(4);
  const bool train = st.range(5) != 0;
  auto x = randv(N * C, 5), wte = randv(Vp * C, 6, -0.1f, 0.1f);
  std::vector<float> dx(N * C), dwte(Vp * C), scratch(k::head_scratch(chunk, Vp));
  std::vector<int32_t> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[i] = static_cast<int32_t>((i * 7919) % V);
  double loss = 0.0;
  for (auto _ : st) {
    loss = k::lm_head_cross_entropy(train ? dx.data() : nullptr, train ? dwte.data() : nullptr,
                                    x.data(), wte.data(), tg.data(), N, C, V, Vp, 1.0f / N, chunk,
                                    scratch.data(), nullptr);
    benchmark::DoNotOptimize(loss);
  }
  st.counters["GFLOP/s"] = benchmark::Counter((train ? 6.0 : 2.0) * N * C * V * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_LmHead)
    ->ArgNames({"N", "C", "V", "Vp", "chunk", "train"})
    ->Args({1024, 384, 50257, 50304, 256, 1})
    ->Args({1024, 384, 50257, 50304, 1024, 1})
    ->Args({1024, 384, 50257, 50304, 256, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_LayerNormFwdBwd(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, 7), w = randv(C, 8), b = randv(C, 9), dout = randv(N * C, 10);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C), dw(C), db(C);
  for (auto _ : st) {
    k::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    k::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_LayerNormFwdBwd)->Args({1024, 384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_GeluFwdBwd(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto x = randv(n, 11, -4.f, 4.f), dout = randv(n, 12);
  std::vector<float> y(n), dx(n);
  for (auto _ : st) {
    k::gelu_forward(y.data(), x.data(), n);
    k::gelu_backward(dx.data(), dout.data(), x.data(), n);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_GeluFwdBwd)->Arg(1024 * 1536)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_EmbeddingFwdBwd(benchmark::State& st) {
  const int64_t B = 4, T = 256, C = 384, V = 50304;
  auto wte = randv(V * C, 13), wpe = randv(T * C, 14), dout = randv(B * T * C, 15);
  std::vector<float> out(B * T * C), dwte(V * C), dwpe(T * C);
  std::vector<int32_t> tok(B * T);
  for (int64_t i = 0; i < B * T; ++i) tok[i] = static_cast<int32_t>((i * 104729) % 50257);
  for (auto _ : st) {
    k::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    k::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_EmbeddingFwdBwd)->Unit(benchmark::kMicrosecond)->UseRealTime();

// AdamW over n parameters (the small model has about 30M).
void BM_AdamW(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto p = randv(n, 16), g = randv(n, 17);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  int64_t t = 0;
  for (auto _ : st) {
    k::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, ++t);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = benchmark::Counter(28.0 * n * st.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AdamW)->Arg(30'000'000)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  int threads = omp_get_max_threads();
  if (const char* s = std::getenv("SHARDLM_THREADS")) threads = std::atoi(s);
  k::init_compute(threads);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
