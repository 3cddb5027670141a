// Google Benchmark timings of the CPU kernels at the `small` model shapes
// (6 layers, C=384, NH=6, HS=64, V=50257 padded to 50304, B=4, T=256 => N=1024 rows), and of
// the LLaMA-family kernels at LLaMA-small shapes (same B, T, C, NH; NKV=2, F=1024).
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
    ->Args({256, 384, 50257, 0, 0})   // lm head dx chunk:    dlogits (256xV) x wte
    ->Args({50257, 384, 256, 1, 0})   // lm head dwte chunk:  dlogits^T x x
    ->Args({1024, 384, 50257, 0, 0})  // lm head dx, all rows
    ->Args({50257, 384, 1024, 1, 0})  // lm head dwte, all rows
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

// ---------------------------------------------------------------------------------------------
// LLaMA-family kernels at LLaMA-small shapes: B=4, T=256 (N=1024 rows), C=384, NH=6, NKV=2,
// HS=64, F=1024.
// ---------------------------------------------------------------------------------------------

// GB/s counters count the bytes each kernel must move at least (every input read once, every
// output written once, += outputs read and written), 4 bytes a float.
benchmark::Counter gbps(double floats, int64_t iters) {
  return benchmark::Counter(4.0 * floats * iters / 1e9, benchmark::Counter::kIsRate);
}

// Forward: reads x (N,C), writes out (N,C). Backward: dinp pass reads dout, x, dinp and writes
// dinp; dweight pass reads dout, x. Args: N, C.
void BM_RmsNormForward(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, 20), w = randv(C, 21);
  std::vector<float> out(N * C), rstd(N);
  for (auto _ : st) {
    k::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = gbps(2.0 * N * C, st.iterations());
}
void BM_RmsNormFwdBwd(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, 20), w = randv(C, 21), dout = randv(N * C, 22);
  std::vector<float> out(N * C), rstd(N), dx(N * C), dw(C);
  for (auto _ : st) {
    k::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    k::rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = gbps(8.0 * N * C, st.iterations());
}
BENCHMARK(BM_RmsNormForward)->ArgNames({"N", "C"})->Args({1024, 384})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_RmsNormFwdBwd)->ArgNames({"N", "C"})->Args({1024, 384})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Rotates q and k of the packed GQA qkv in place (n_heads = NH + NKV of the NH + 2 NKV heads
// of a row): reads and writes B*T*n_heads*HS floats, reads the (T,HS) table.
// Args: B, T, n_heads, HS, heads per row; mode 0 forward, 1 backward.
void BM_Rope(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), nh = st.range(2), HS = st.range(3),
                W = st.range(4) * HS;
  const bool bwd = st.range(5) != 0;
  auto x = randv(B * T * W, 23);
  std::vector<float> tab(k::rope_table_floats(T, HS));
  k::rope_table(tab.data(), T, HS, {10000.0});
  for (auto _ : st) {
    if (bwd)
      k::rope_backward(x.data(), B, T, nh, HS, W, tab.data());
    else
      k::rope_forward(x.data(), B, T, nh, HS, W, tab.data());
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = gbps(2.0 * B * T * nh * HS + T * HS, st.iterations());
}
BENCHMARK(BM_Rope)
    ->ArgNames({"B", "T", "heads", "HS", "row_heads", "bwd"})
    ->Args({4, 256, 8, 64, 10, 0})
    ->Args({4, 256, 8, 64, 10, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_RopeTable(benchmark::State& st) {
  const int64_t T = st.range(0), HS = st.range(1);
  std::vector<float> tab(k::rope_table_floats(T, HS));
  for (auto _ : st) {
    k::rope_table(tab.data(), T, HS, {10000.0});
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_RopeTable)->ArgNames({"T", "HS"})->Args({256, 64})->Args({4096, 128})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Forward: reads gate_up (N,2F), writes out (N,F). Backward: reads gate_up, dout (N,F),
// reads and writes dgate_up (N,2F). Args: N, F.
void BM_SwigluForward(benchmark::State& st) {
  const int64_t N = st.range(0), F = st.range(1);
  auto gu = randv(N * 2 * F, 24, -4.f, 4.f);
  std::vector<float> out(N * F);
  for (auto _ : st) {
    k::swiglu_forward(out.data(), gu.data(), N, F);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = gbps(3.0 * N * F, st.iterations());
}
void BM_SwigluFwdBwd(benchmark::State& st) {
  const int64_t N = st.range(0), F = st.range(1);
  auto gu = randv(N * 2 * F, 24, -4.f, 4.f), dout = randv(N * F, 25);
  std::vector<float> out(N * F), dgu(N * 2 * F);
  for (auto _ : st) {
    k::swiglu_forward(out.data(), gu.data(), N, F);
    k::swiglu_backward(dgu.data(), dout.data(), gu.data(), N, F);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = gbps(10.0 * N * F, st.iterations());
}
BENCHMARK(BM_SwigluForward)->ArgNames({"N", "F"})->Args({1024, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_SwigluFwdBwd)->ArgNames({"N", "F"})->Args({1024, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Grouped-query attention; FLOPs counted as for BM_Attention* (per query head).
// Args: B, T, NH, NKV, HS.
struct GqaData {
  int64_t B, T, NH, NKV, HS;
  std::vector<float> qkv, out, lse, dout, dqkv, scratch;
  explicit GqaData(const benchmark::State& st)
      : B(st.range(0)), T(st.range(1)), NH(st.range(2)), NKV(st.range(3)), HS(st.range(4)),
        qkv(randv(B * T * (NH + 2 * NKV) * HS, 26, -2.f, 2.f)), out(B * T * NH * HS),
        lse(B * NH * T), dout(randv(B * T * NH * HS, 27)), dqkv(qkv.size()),
        scratch(k::attention_backward_scratch(B, T, NH, NKV, HS, omp_get_max_threads())) {}
  double fwd_flops() const { return 2.0 * B * NH * double(T) * T * HS; }
  void forward() {
    k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HS);
  }
  void backward() {
    k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T,
                          NH, NKV, HS, scratch.data());
  }
};
void BM_GqaAttentionForward(benchmark::State& st) {
  GqaData d(st);
  for (auto _ : st) {
    d.forward();
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(d.fwd_flops() * st.iterations() / 1e9, benchmark::Counter::kIsRate);
}
void BM_GqaAttentionBackward(benchmark::State& st) {
  GqaData d(st);
  d.forward();
  for (auto _ : st) {
    d.backward();
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2.5 * d.fwd_flops() * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
void BM_GqaAttentionForwardBackward(benchmark::State& st) {
  GqaData d(st);
  for (auto _ : st) {
    d.forward();
    d.backward();
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter(3.5 * d.fwd_flops() * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
#define GQA_ARGS                                                                            \
  ArgNames({"B", "T", "NH", "NKV", "HS"})->Args({4, 256, 6, 2, 64})->Args({4, 256, 6, 1, 64}) \
      ->Args({1, 1024, 6, 2, 64})->Unit(benchmark::kMillisecond)->UseRealTime()
BENCHMARK(BM_GqaAttentionForward)->GQA_ARGS;
BENCHMARK(BM_GqaAttentionBackward)->GQA_ARGS;
BENCHMARK(BM_GqaAttentionForwardBackward)->GQA_ARGS;

// nn.Linear-layout dense layers of the LLaMA-small MLP / attention, forward + backward
// (dinp and dweight): 6*N*C*OC FLOPs. Args: N, C, OC.
void BM_DenseFwdBwd(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1), OC = st.range(2);
  auto x = randv(N * C, 28), w = randv(OC * C, 29), dout = randv(N * OC, 30);
  std::vector<float> out(N * OC), dx(N * C), dw(OC * C);
  for (auto _ : st) {
    k::dense_forward(out.data(), x.data(), w.data(), N, C, OC);
    k::dense_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), N, C, OC);
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(6.0 * N * C * OC * st.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DenseFwdBwd)
    ->ArgNames({"N", "C", "OC"})
    ->Args({1024, 384, 2048})   // gate_up
    ->Args({1024, 1024, 384})   // down
    ->Args({1024, 384, 640})    // qkv (NH + 2 NKV = 10 heads of 64)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

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

// The experts' grouped GEMMs at moe-small's shapes (B4 T256, top-2: 2048 routed rows over 8
// experts); args: rows per expert, experts, C, OC, backward.
void BM_GroupedDense(benchmark::State& st) {
  const int64_t R = st.range(0), G = st.range(1), C = st.range(2), OC = st.range(3);
  const bool backward = st.range(4) != 0;
  auto inp = randv(R * G * C, 11), dout = randv(R * G * OC, 12);
  std::vector<float> out(R * G * OC), dinp(R * G * C);
  std::vector<std::vector<float>> w(G), dw(G);
  std::vector<const float*> wp(G);
  std::vector<float*> dwp(G);
  std::vector<int64_t> first(G + 1);
  for (int64_t g = 0; g < G; ++g) {
    w[g] = randv(OC * C, 13 + g), dw[g].assign(OC * C, 0.0f);
    wp[g] = w[g].data(), dwp[g] = dw[g].data(), first[g + 1] = (g + 1) * R;
  }
  for (auto _ : st) {
    if (backward)
      k::grouped_dense_backward(dinp.data(), dwp.data(), dout.data(), inp.data(), wp.data(), first.data(), G, C, OC);
    else
      k::grouped_dense_forward(out.data(), inp.data(), wp.data(), first.data(), G, C, OC);
    benchmark::ClobberMemory();
  }
  st.counters["GFLOP/s"] = benchmark::Counter((backward ? 4.0 : 2.0) * R * G * C * OC * st.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_GroupedDense)
    ->ArgNames({"rows", "experts", "C", "OC", "bwd"})
    ->Args({256, 8, 384, 1024, 0})  // gate|up
    ->Args({256, 8, 512, 384, 0})   // down
    ->Args({256, 8, 384, 1024, 1})
    ->Args({256, 8, 512, 384, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
