// Every method of the CUDA backend against the CPU backend on the same random inputs. Built only
// with -DSHARDLM_CUDA=ON; skips (saying so) where no GPU is present. Each check prints one line,
// KERNEL <name> rel=<|got-ref|_2/|ref|_2> max_abs=<max |got-ref|> tol=<rel tolerance>, so a run
// on a GPU records the per-kernel errors.
//
// Tolerances (relative L2 error against the fp32 CPU kernels):
//  - GEMM-based (linear, dense, head gradients) with bf16 tensor-core GEMMs: 1e-2 (bf16 operands
//    carry 8 bits of mantissa, ~4e-3 per product); with fp32 GEMMs: 1e-5.
//  - norms, activations, rope (fp32 with expf vs the CPU's exp approximation and other summation
//    orders): 1e-5.
//  - attention: the cuBLAS path with fp32 GEMMs and the fp32 flash kernels (forced through
//    CudaOptions::attention): 1e-4; the cuBLAS path with bf16 GEMMs (scores from bf16 q, k) and the
//    tensor-core flash kernels (bf16 q, k, v, dout, probabilities): 2e-2.
//  - embedding, AdamW, scale, sum_squares: 1e-6; casts and int8 quantization: exact.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "model/model.h"

namespace {

using shardlm::Buffer;
using shardlm::MemCategory;
using shardlm::kernels::Backend;
using fvec = std::vector<float>;

fvec randv(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  fvec v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// A device copy of a host vector.
struct Dev {
  Buffer buf;
  int64_t n;
  Dev(const Backend& gpu, const fvec& host) : n(int64_t(host.size())) {
    buf = gpu.alloc(MemCategory::workspace, sizeof(float) * host.size(), Buffer::Fill::none);
    gpu.upload(buf.data(), host.data(), sizeof(float) * host.size());
  }
  float* p() const { return buf.f32(); }
  fvec get(const Backend& gpu) const {
    fvec h(n);
    gpu.download(h.data(), buf.data(), sizeof(float) * n);
    return h;
  }
};

// Relative L2 error and max abs difference; every element must be finite (outputs start as NaN).
void compare(const char* name, const fvec& got, const fvec& ref, double tol) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  double num = 0, den = 0, mx = 0;
  bool finite = true;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) finite = false;
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
    mx = std::max(mx, std::fabs(d));
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  std::printf("KERNEL %-34s rel=%.3e max_abs=%.3e tol=%.0e\n", name, rel, mx, tol);
  EXPECT_TRUE(finite) << name << ": a non-finite element (unwritten output?)";
  EXPECT_LE(rel, tol) << name;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!shardlm::kernels::cuda_device_present()) GTEST_SKIP() << "no CUDA device present: CUDA backend tests skipped";
    cpu_backend = shardlm::kernels::make_cpu_backend(memory);
    gpu_backend = shardlm::kernels::make_cuda_backend(memory, {.bf16_gemm = true});
    gpu32_backend = shardlm::kernels::make_cuda_backend(memory, {.bf16_gemm = false});
    using Attention = shardlm::kernels::CudaOptions::Attention;
    flash32_backend = shardlm::kernels::make_cuda_backend(memory, {.bf16_gemm = false, .attention = Attention::flash});
    cublas16_backend = shardlm::kernels::make_cuda_backend(memory, {.bf16_gemm = true, .attention = Attention::cublas});
    cpu = cpu_backend.get(), gpu = gpu_backend.get(), gpu32 = gpu32_backend.get(), flash32 = flash32_backend.get();
    cublas16 = cublas16_backend.get();
    cpu->init_compute(2);
    gpu->init_compute(1);
  }
  shardlm::MemoryPool memory;
  std::unique_ptr<Backend> cpu_backend, gpu_backend, gpu32_backend, flash32_backend, cublas16_backend;
  const Backend *cpu = nullptr, *gpu = nullptr, *gpu32 = nullptr, *flash32 = nullptr, *cublas16 = nullptr;
};

TEST_F(CudaBackendTest, Linear) {
  const int64_t N = 512, C = 384, OC = 1152;
  for (const Backend* g : {gpu, gpu32}) {
    const double tol = g == gpu ? 1e-2 : 1e-5;
    const std::string tag = g == gpu ? " bf16" : " fp32";
    fvec x = randv(N * C, 1), w = randv(C * OC, 2, -0.05f, 0.05f), b = randv(OC, 3), dout = randv(N * OC, 4);
    fvec out(N * OC);
    cpu->linear_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
    Dev dx(*g, x), dw(*g, w), db(*g, b), dout_d(*g, dout), dy(*g, fvec(N * OC, kNaN));
    g->linear_forward(dy.p(), dx.p(), dw.p(), db.p(), N, C, OC);
    compare(("linear_forward" + tag).c_str(), dy.get(*g), out, tol);
    fvec gi(N * C, 0.25f), gw(C * OC, 0.25f), gb(OC, 0.25f);
    Dev dgi(*g, gi), dgw(*g, gw), dgb(*g, gb);
    cpu->linear_backward(gi.data(), gw.data(), gb.data(), dout.data(), x.data(), w.data(), N, C, OC);
    g->linear_backward(dgi.p(), dgw.p(), dgb.p(), dout_d.p(), dx.p(), dw.p(), N, C, OC);
    compare(("linear_backward dinp" + tag).c_str(), dgi.get(*g), gi, tol);
    compare(("linear_backward dweight" + tag).c_str(), dgw.get(*g), gw, tol);
    compare(("linear_backward dbias" + tag).c_str(), dgb.get(*g), gb, 1e-5);
  }
}

TEST_F(CudaBackendTest, Dense) {
  const int64_t N = 512, C = 384, OC = 1024;
  for (const Backend* g : {gpu, gpu32}) {
    const double tol = g == gpu ? 1e-2 : 1e-5;
    const std::string tag = g == gpu ? " bf16" : " fp32";
    fvec x = randv(N * C, 5), w = randv(OC * C, 6, -0.05f, 0.05f), dout = randv(N * OC, 7);
    fvec out(N * OC);
    cpu->dense_forward(out.data(), x.data(), w.data(), N, C, OC);
    Dev dx(*g, x), dw(*g, w), dout_d(*g, dout), dy(*g, fvec(N * OC, kNaN));
    g->dense_forward(dy.p(), dx.p(), dw.p(), N, C, OC);
    compare(("dense_forward" + tag).c_str(), dy.get(*g), out, tol);
    fvec gi(N * C, 0.25f), gw(OC * C, 0.25f);
    Dev dgi(*g, gi), dgw(*g, gw);
    cpu->dense_backward(gi.data(), gw.data(), dout.data(), x.data(), w.data(), N, C, OC);
    g->dense_backward(dgi.p(), dgw.p(), dout_d.p(), dx.p(), dw.p(), N, C, OC);
    compare(("dense_backward dinp" + tag).c_str(), dgi.get(*g), gi, tol);
    compare(("dense_backward dweight" + tag).c_str(), dgw.get(*g), gw, tol);
  }
}

TEST_F(CudaBackendTest, LayerNorm) {
  const int64_t N = 777, C = 384;
  fvec x = randv(N * C, 8, -2, 2), w = randv(C, 9), b = randv(C, 10), dout = randv(N * C, 11);
  fvec out(N * C), mean(N), rstd(N);
  cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  Dev dx(*gpu, x), dw(*gpu, w), db(*gpu, b), ddout(*gpu, dout);
  Dev dy(*gpu, fvec(N * C, kNaN)), dm(*gpu, fvec(N, kNaN)), dr(*gpu, fvec(N, kNaN));
  gpu->layernorm_forward(dy.p(), dm.p(), dr.p(), dx.p(), dw.p(), db.p(), N, C);
  compare("layernorm_forward out", dy.get(*gpu), out, 1e-5);
  compare("layernorm_forward mean", dm.get(*gpu), mean, 1e-5);
  compare("layernorm_forward rstd", dr.get(*gpu), rstd, 1e-5);
  fvec gi(N * C, 0.25f), gw(C, 0.25f), gb(C, 0.25f);
  Dev dgi(*gpu, gi), dgw(*gpu, gw), dgb(*gpu, gb);
  cpu->layernorm_backward(gi.data(), gw.data(), gb.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(),
                          N, C);
  gpu->layernorm_backward(dgi.p(), dgw.p(), dgb.p(), ddout.p(), dx.p(), dw.p(), dm.p(), dr.p(), N, C);
  compare("layernorm_backward dinp", dgi.get(*gpu), gi, 1e-5);
  compare("layernorm_backward dweight", dgw.get(*gpu), gw, 1e-5);
  compare("layernorm_backward dbias", dgb.get(*gpu), gb, 1e-5);
}

TEST_F(CudaBackendTest, RmsNorm) {
  const int64_t N = 777, C = 384;
  fvec x = randv(N * C, 12, -2, 2), w = randv(C, 13), dout = randv(N * C, 14);
  fvec out(N * C), rstd(N);
  cpu->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  Dev dx(*gpu, x), dw(*gpu, w), ddout(*gpu, dout), dy(*gpu, fvec(N * C, kNaN)), dr(*gpu, fvec(N, kNaN));
  gpu->rmsnorm_forward(dy.p(), dr.p(), dx.p(), dw.p(), N, C, 1e-5f);
  compare("rmsnorm_forward out", dy.get(*gpu), out, 1e-5);
  compare("rmsnorm_forward rstd", dr.get(*gpu), rstd, 1e-5);
  fvec gi(N * C, 0.25f), gw(C, 0.25f);
  Dev dgi(*gpu, gi), dgw(*gpu, gw);
  cpu->rmsnorm_backward(gi.data(), gw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  gpu->rmsnorm_backward(dgi.p(), dgw.p(), ddout.p(), dx.p(), dw.p(), dr.p(), N, C);
  compare("rmsnorm_backward dinp", dgi.get(*gpu), gi, 1e-5);
  compare("rmsnorm_backward dweight", dgw.get(*gpu), gw, 1e-5);
}

TEST_F(CudaBackendTest, Pointwise) {
  const int64_t N = 300, F = 1024, n = N * F;
  fvec x = randv(n, 15, -4, 4), y = randv(n, 16), gu = randv(2 * n, 17, -4, 4), dout = randv(n, 18);
  Dev dx(*gpu, x), dyv(*gpu, y), dgu(*gpu, gu), ddout(*gpu, dout);
  fvec ref(n);
  cpu->gelu_forward(ref.data(), x.data(), n);
  Dev o1(*gpu, fvec(n, kNaN));
  gpu->gelu_forward(o1.p(), dx.p(), n);
  compare("gelu_forward", o1.get(*gpu), ref, 1e-5);
  fvec gref(n, 0.25f);
  Dev g1(*gpu, gref);
  cpu->gelu_backward(gref.data(), dout.data(), x.data(), n);
  gpu->gelu_backward(g1.p(), ddout.p(), dx.p(), n);
  compare("gelu_backward", g1.get(*gpu), gref, 1e-5);
  cpu->swiglu_forward(ref.data(), gu.data(), N, F);
  Dev o2(*gpu, fvec(n, kNaN));
  gpu->swiglu_forward(o2.p(), dgu.p(), N, F);
  compare("swiglu_forward", o2.get(*gpu), ref, 1e-5);
  fvec sref(2 * n, 0.25f);
  Dev g2(*gpu, sref);
  cpu->swiglu_backward(sref.data(), dout.data(), gu.data(), N, F);
  gpu->swiglu_backward(g2.p(), ddout.p(), dgu.p(), N, F);
  compare("swiglu_backward", g2.get(*gpu), sref, 1e-5);
  cpu->residual_forward(ref.data(), x.data(), y.data(), n);
  Dev o3(*gpu, fvec(n, kNaN));
  gpu->residual_forward(o3.p(), dx.p(), dyv.p(), n);
  compare("residual_forward", o3.get(*gpu), ref, 0);
  fvec sc = x;
  cpu->scale(sc.data(), n, 0.37f);
  gpu->scale(dx.p(), n, 0.37f);
  compare("scale", dx.get(*gpu), sc, 0);
}

TEST_F(CudaBackendTest, Embedding) {
  const int64_t B = 4, T = 128, C = 384, V = 500;
  std::vector<int32_t> tok(B * T);
  std::mt19937 rng(19);
  for (auto& t : tok) t = int32_t(rng() % V);
  fvec wte = randv(V * C, 20), wpe = randv(T * C, 21), dout = randv(B * T * C, 22);
  Buffer dtok = gpu->alloc(MemCategory::workspace, sizeof(int32_t) * tok.size(), Buffer::Fill::none);
  gpu->upload(dtok.data(), tok.data(), sizeof(int32_t) * tok.size());
  Dev dwte(*gpu, wte), dwpe(*gpu, wpe), ddout(*gpu, dout), out(*gpu, fvec(B * T * C, kNaN));
  fvec ref(B * T * C);
  for (const bool pos : {true, false}) {
    cpu->embedding_forward(ref.data(), tok.data(), wte.data(), pos ? wpe.data() : nullptr, B, T, C);
    gpu->embedding_forward(out.p(), dtok.as<int32_t>(), dwte.p(), pos ? dwpe.p() : nullptr, B, T, C);
    compare(pos ? "embedding_forward" : "embedding_forward (no wpe)", out.get(*gpu), ref, 0);
  }
  fvec gwte(V * C, 0.25f), gwpe(T * C, 0.25f);
  Dev dgwte(*gpu, gwte), dgwpe(*gpu, gwpe);
  cpu->embedding_backward(gwte.data(), gwpe.data(), dout.data(), tok.data(), B, T, C);
  gpu->embedding_backward(dgwte.p(), dgwpe.p(), ddout.p(), dtok.as<int32_t>(), B, T, C);
  compare("embedding_backward dwte", dgwte.get(*gpu), gwte, 1e-6);
  compare("embedding_backward dwpe", dgwpe.get(*gpu), gwpe, 1e-6);
}

TEST_F(CudaBackendTest, Rope) {
  const int64_t B = 2, T = 300, NH = 6, NKV = 2, HS = 64, stride = (NH + 2 * NKV) * HS;
  ASSERT_EQ(gpu->rope_table_floats(T, HS), cpu->rope_table_floats(T, HS));
  fvec table(cpu->rope_table_floats(T, HS));
  cpu->rope_table(table.data(), T, HS, {10000.0});
  Dev dtable(*gpu, fvec(table.size(), kNaN));
  gpu->rope_table(dtable.p(), T, HS, {10000.0});
  compare("rope_table", dtable.get(*gpu), table, 1e-6);
  const shardlm::kernels::Rope llama31{500000.0, 8, 1, 4, 64};  // an original context of 64: every band at HS 64
  fvec scaled(table.size());
  cpu->rope_table(scaled.data(), T, HS, llama31);
  Dev dscaled(*gpu, fvec(table.size(), kNaN));
  gpu->rope_table(dscaled.p(), T, HS, llama31);
  compare("rope_table, Llama 3.1's scaling", dscaled.get(*gpu), scaled, 1e-6);
  fvec x = randv(B * T * stride, 23);
  Dev dx(*gpu, x);
  cpu->rope_forward(x.data(), B, T, NH + NKV, HS, stride, table.data());
  gpu->rope_forward(dx.p(), B, T, NH + NKV, HS, stride, dtable.p());
  compare("rope_forward", dx.get(*gpu), x, 1e-6);
  cpu->rope_backward(x.data(), B, T, NH + NKV, HS, stride, table.data());
  gpu->rope_backward(dx.p(), B, T, NH + NKV, HS, stride, dtable.p());
  compare("rope_backward", dx.get(*gpu), x, 1e-6);
}

void attention_case(const Backend& cpu, const Backend& gpu, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                    int64_t HS, double tol, const std::string& path) {
  const std::string tag = " " + path + " B" + std::to_string(B) + " T" + std::to_string(T) + " NH" + std::to_string(NH) + " NKV" +
                          std::to_string(NKV) + " HS" + std::to_string(HS);
  const int64_t W = (NH + 2 * NKV) * HS;
  fvec qkv = randv(B * T * W, 24, -2, 2), dout = randv(B * T * NH * HS, 25);
  fvec out(B * T * NH * HS), lse(B * NH * T);
  cpu.attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HS);
  Dev dqkv(gpu, qkv), ddout(gpu, dout), dout_o(gpu, fvec(out.size(), kNaN)), dlse(gpu, fvec(lse.size(), kNaN));
  gpu.attention_forward(dout_o.p(), dlse.p(), dqkv.p(), B, T, NH, NKV, HS);
  compare(("attention_forward out" + tag).c_str(), dout_o.get(gpu), out, tol);
  compare(("attention_forward lse" + tag).c_str(), dlse.get(gpu), lse, tol / 10);
  // The plan sizes scratch by the CPU's formulas: the CUDA backend must ask for no more.
  EXPECT_EQ(gpu.attention_backward_scratch(B, T, NH, NKV, HS, 2), cpu.attention_backward_scratch(B, T, NH, NKV, HS, 2));
  fvec g(qkv.size(), 0.25f), scratch(cpu.attention_backward_scratch(B, T, NH, NKV, HS, 2));
  Dev dg(gpu, g), dscr(gpu, fvec(gpu.attention_backward_scratch(B, T, NH, NKV, HS, 1), kNaN));
  cpu.attention_backward(g.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV, HS, scratch.data());
  gpu.attention_backward(dg.p(), ddout.p(), dqkv.p(), dout_o.p(), dlse.p(), B, T, NH, NKV, HS, dscr.p());
  compare(("attention_backward dqkv" + tag).c_str(), dg.get(gpu), g, tol);
}

TEST_F(CudaBackendTest, Attention) {
  const int64_t cases[5][5] = {
      {2, 256, 6, 6, 64},   // GPT-2 small's heads
      {2, 200, 6, 2, 64},   // grouped-query, T not a multiple of the tile
      {1, 130, 4, 1, 128},  // multi-query, HS 128
      {1, 70, 2, 2, 48},    // HS not a multiple of 32
      {1, 77, 3, 3, 40},    // a head size without a tensor-core kernel: the bf16 backend falls back
  };
  for (const auto& c : cases) {
    attention_case(*cpu, *gpu32, c[0], c[1], c[2], c[3], c[4], 1e-4, "gemm-fp32");
    attention_case(*cpu, *cublas16, c[0], c[1], c[2], c[3], c[4], 2e-2, "gemm-bf16");
    attention_case(*cpu, *flash32, c[0], c[1], c[2], c[3], c[4], 1e-4, "flash");
    attention_case(*cpu, *gpu, c[0], c[1], c[2], c[3], c[4], 2e-2, "mma-bf16");
  }
}

// The tensor-core flash kernels at long sequences (many tiles per row, GQA and MHA, HS 64 and 128).
TEST_F(CudaBackendTest, AttentionLong) {
  const int64_t cases[3][5] = {{1, 4096, 2, 1, 64}, {1, 2048, 2, 2, 128}, {2, 1024, 4, 2, 32}};
  for (const auto& c : cases) attention_case(*cpu, *gpu, c[0], c[1], c[2], c[3], c[4], 2e-2, "mma-bf16");
}

// Context parallelism's ring as one rank runs it: K ranks, each sequence cut into 2K chunks of
// `rows` positions, rank r holding chunks r and 2K-1-r; every rank's key/value block merged into
// (out, lse) in ring order (accumulating after the first), then the backward block by block. The
// GPU's chunk kernels against the CPU's at the same positions and pitches (q inside packed
// q|k|v rows, a block's keys and values in k|v rows, as the ring lays them out).
void ring_case(const Backend& cpu, const Backend& gpu, int64_t K, int64_t rows, int64_t B, int64_t NH, int64_t NKV,
               int64_t HS, int me) {
  using shardlm::kernels::SeqChunks;
  const std::string tag = " K" + std::to_string(K) + " rank" + std::to_string(me) + " rows" + std::to_string(rows) +
                          " B" + std::to_string(B) + " NH" + std::to_string(NH) + " NKV" + std::to_string(NKV) +
                          " HS" + std::to_string(HS);
  const int64_t W = (NH + 2 * NKV) * HS, KV = 2 * NKV * HS, T = 2 * rows, v_at = NKV * HS;
  std::vector<std::vector<int64_t>> pos(K);
  for (int64_t r = 0; r < K; ++r) pos[r] = {r * rows, (2 * K - 1 - r) * rows};
  const fvec qkv = randv(B * T * W, 31, -2, 2), dout = randv(B * T * NH * HS, 32);
  std::vector<fvec> kv;
  std::vector<Dev> dkv;
  for (int64_t r = 0; r < K; ++r) kv.push_back(randv(B * T * KV, 40 + uint32_t(r), -2, 2)), dkv.emplace_back(gpu, kv[r]);
  const SeqChunks qc{2, rows, pos[me].data()};
  fvec out(B * T * NH * HS), lse(B * NH * T);
  Dev dqkv(gpu, qkv), ddout(gpu, dout), dout_o(gpu, fvec(out.size(), kNaN)), dlse(gpu, fvec(lse.size(), kNaN));
  for (int64_t s = 0; s < K; ++s) {
    const int64_t r = (me - s + K) % K;
    const SeqChunks kc{2, rows, pos[r].data()};
    cpu.attention_chunked_forward(out.data(), lse.data(), qkv.data(), W, qc, kv[r].data(), kv[r].data() + v_at, KV, kc,
                                  B, NH, NKV, HS, s > 0);
    gpu.attention_chunked_forward(dout_o.p(), dlse.p(), dqkv.p(), W, qc, dkv[r].p(), dkv[r].p() + v_at, KV, kc, B, NH,
                                  NKV, HS, s > 0);
  }
  compare(("chunked_forward out" + tag).c_str(), dout_o.get(gpu), out, 1e-5);
  compare(("chunked_forward lse" + tag).c_str(), dlse.get(gpu), lse, 1e-6);
  EXPECT_EQ(gpu.attention_chunked_backward_scratch(HS, 2), cpu.attention_chunked_backward_scratch(HS, 2));
  fvec dq(qkv.size(), 0.25f), scratch(cpu.attention_chunked_backward_scratch(HS, 2));
  Dev ddq(gpu, dq), dscr(gpu, fvec(gpu.attention_chunked_backward_scratch(HS, 1), kNaN));
  for (int64_t s = 0; s < K; ++s) {
    const int64_t r = (me - s + K) % K;
    const SeqChunks kc{2, rows, pos[r].data()};
    fvec dk(B * T * KV, 0.25f);
    Dev ddk(gpu, dk);
    cpu.attention_chunked_backward(dq.data(), W, dk.data(), dk.data() + v_at, KV, dout.data(), qkv.data(), W,
                                   out.data(), lse.data(), qc, kv[r].data(), kv[r].data() + v_at, KV, kc, B, NH, NKV,
                                   HS, scratch.data());
    gpu.attention_chunked_backward(ddq.p(), W, ddk.p(), ddk.p() + v_at, KV, ddout.p(), dqkv.p(), W, dout_o.p(),
                                   dlse.p(), qc, dkv[r].p(), dkv[r].p() + v_at, KV, kc, B, NH, NKV, HS, dscr.p());
    compare(("chunked_backward dk|dv block " + std::to_string(r) + tag).c_str(), ddk.get(gpu), dk, 1e-5);
  }
  compare(("chunked_backward dq" + tag).c_str(), ddq.get(gpu), dq, 1e-5);
}

// The chunk kernels are fp32 in every compute mode: both backends, fp32 tolerances.
TEST_F(CudaBackendTest, AttentionChunks) {
  const int64_t cases[6][7] = {
      // K, rows, B, NH, NKV, HS, rank
      {2, 40, 2, 4, 2, 64, 0}, {2, 33, 1, 4, 4, 32, 1}, {3, 50, 1, 6, 2, 48, 1},
      {4, 64, 1, 2, 1, 128, 3}, {4, 20, 2, 4, 4, 64, 0}, {3, 96, 1, 3, 3, 64, 2},
  };
  for (const auto& c : cases) {
    ring_case(*cpu, *gpu, c[0], c[1], c[2], c[3], c[4], c[5], int(c[6]));
    ring_case(*cpu, *gpu32, c[0], c[1], c[2], c[3], c[4], c[5], int(c[6]));
  }
}

TEST_F(CudaBackendTest, Head) {
  const int64_t N = 256, C = 384, V = 1000, Vp = 1024, chunk = 96;
  std::vector<int32_t> tgt(N);
  std::mt19937 rng(26);
  for (auto& t : tgt) t = int32_t(rng() % V);
  tgt[5] = -1;  // an ignored row
  fvec x = randv(N * C, 27), wte = randv(Vp * C, 28, -0.1f, 0.1f);
  Buffer dtgt = gpu->alloc(MemCategory::workspace, sizeof(int32_t) * N, Buffer::Fill::none);
  gpu->upload(dtgt.data(), tgt.data(), sizeof(int32_t) * N);
  EXPECT_EQ(gpu->head_scratch(chunk, Vp), cpu->head_scratch(chunk, Vp));  // as the plan sizes it
  for (const Backend* g : {gpu, gpu32}) {
    const double tol = g == gpu ? 1e-2 : 1e-5;
    const std::string tag = g == gpu ? " bf16" : " fp32";
    Dev dx_in(*g, x), dwte(*g, wte);
    fvec gx(N * C, 0.25f), gw(Vp * C, 0.25f), logits(N * V), scr(cpu->head_scratch(chunk, Vp));
    Dev dgx(*g, gx), dgw(*g, gw), dlog(*g, fvec(N * V, kNaN)), dscr(*g, fvec(g->head_scratch(chunk, Vp), kNaN));
    const double ref = cpu->lm_head_cross_entropy(gx.data(), gw.data(), x.data(), wte.data(), tgt.data(), N, C, V, Vp,
                                                  1.0f / N, chunk, scr.data(), logits.data());
    const double got = g->lm_head_cross_entropy(dgx.p(), dgw.p(), dx_in.p(), dwte.p(), dtgt.as<int32_t>(), N, C, V,
                                                Vp, 1.0f / N, chunk, dscr.p(), dlog.p());
    compare(("lm_head_cross_entropy loss" + tag).c_str(), fvec{float(got)}, fvec{float(ref)}, g == gpu ? 1e-3 : 1e-6);
    compare(("lm_head_cross_entropy logits" + tag).c_str(), dlog.get(*g), logits, tol);
    compare(("lm_head_cross_entropy dx" + tag).c_str(), dgx.get(*g), gx, tol);
    compare(("lm_head_cross_entropy dwte" + tag).c_str(), dgw.get(*g), gw, tol);
    // One host row, host target and host logits: the generation path.
    const int32_t ignore = -1;
    fvec l1(V), l2(V);
    cpu->lm_head_cross_entropy(nullptr, nullptr, x.data(), wte.data(), &ignore, 1, C, V, Vp, 0, 1, scr.data(),
                               l1.data());
    g->lm_head_cross_entropy(nullptr, nullptr, dx_in.p(), dwte.p(), &ignore, 1, C, V, Vp, 0, 1, dscr.p(), l2.data());
    compare(("lm_head logits to host" + tag).c_str(), l2, l1, tol);
  }
}

TEST_F(CudaBackendTest, OptimizerAndUtilities) {
  const int64_t n = 1000003;
  fvec p = randv(n, 29), g = randv(n, 30), m = randv(n, 31, -0.1f, 0.1f), v = randv(n, 32, 0, 0.01f);
  Dev dp(*gpu, p), dg(*gpu, g), dm(*gpu, m), dv(*gpu, v);
  for (int64_t t = 1; t <= 3; ++t) {
    cpu->adamw_update(p.data(), g.data(), m.data(), v.data(), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    gpu->adamw_update(dp.p(), dg.p(), dm.p(), dv.p(), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  compare("adamw_update p", dp.get(*gpu), p, 1e-6);
  compare("adamw_update m", dm.get(*gpu), m, 1e-6);
  compare("adamw_update v", dv.get(*gpu), v, 1e-6);
  const double ss_ref = cpu->sum_squares(g.data(), n), ss = gpu->sum_squares(dg.p(), n);
  std::printf("KERNEL %-34s rel=%.3e\n", "sum_squares", std::fabs(ss - ss_ref) / ss_ref);
  EXPECT_NEAR(ss, ss_ref, 1e-12 * ss_ref);
  std::vector<uint16_t> h16(n), d16(n);
  cpu->fp32_to_bf16(h16.data(), g.data(), n);
  Buffer b16 = gpu->alloc(MemCategory::workspace, 2 * n, Buffer::Fill::none);
  gpu->fp32_to_bf16(b16.as<uint16_t>(), dg.p(), n);
  gpu->download(d16.data(), b16.data(), 2 * n);
  EXPECT_EQ(h16, d16) << "fp32_to_bf16";
  fvec back(n);
  cpu->bf16_to_fp32(back.data(), h16.data(), n);
  gpu->bf16_to_fp32(dg.p(), b16.as<uint16_t>(), n);
  compare("fp32_to_bf16 + bf16_to_fp32", dg.get(*gpu), back, 0);
}

// --act-quant's kernels: scales and int8 values bit for bit the CPU's, nearest and stochastic
// rounding, over groups of magnitudes 1e-3 to 1e3, a group holding a NaN (scale NaN, values 0) and
// a group of zeros; the dequantized values too (NaN where the CPU's are, whatever its bits).
TEST_F(CudaBackendTest, QuantizeInt8IsTheCpusBitForBit) {
  const int64_t group = 64, n = group * 4099;
  fvec x = randv(n, 41);
  for (int64_t i = 0; i < n; ++i) x[i] *= std::pow(10.0f, static_cast<float>((i / group) % 7) - 3.0f);
  x[5 * group + 3] = kNaN;
  std::fill(x.begin() + 7 * group, x.begin() + 8 * group, 0.0f);
  const Dev dx(*gpu, x);
  for (bool stochastic : {false, true}) {
    std::vector<int8_t> qc(n), qg(n);
    fvec sc(n / group), yc(n);
    cpu->quantize_int8(qc.data(), sc.data(), x.data(), n, group, stochastic, 0x5eedull);
    cpu->dequantize_int8(yc.data(), qc.data(), sc.data(), n, group);
    Buffer q = gpu->alloc(MemCategory::workspace, n, Buffer::Fill::none);
    const Dev ds(*gpu, fvec(n / group, 1.0f)), dy(*gpu, fvec(n, 1.0f));
    gpu->quantize_int8(q.as<int8_t>(), ds.p(), dx.p(), n, group, stochastic, 0x5eedull);
    gpu->dequantize_int8(dy.p(), q.as<int8_t>(), ds.p(), n, group);
    gpu->download(qg.data(), q.data(), n);
    const fvec sg = ds.get(*gpu), yg = dy.get(*gpu);
    int64_t q_diff = 0, s_diff = 0, y_diff = 0;
    for (int64_t i = 0; i < n; ++i) q_diff += qg[i] != qc[i];
    for (size_t g = 0; g < sc.size(); ++g) s_diff += std::memcmp(&sg[g], &sc[g], 4) != 0;
    for (int64_t i = 0; i < n; ++i) y_diff += std::isnan(yc[i]) ? !std::isnan(yg[i]) : std::memcmp(&yg[i], &yc[i], 4) != 0;
    std::printf("KERNEL %-34s values differing %lld, scales %lld, dequantized %lld\n",
                stochastic ? "quantize_int8 stochastic" : "quantize_int8 nearest", static_cast<long long>(q_diff),
                static_cast<long long>(s_diff), static_cast<long long>(y_diff));
    EXPECT_EQ(q_diff, 0) << "stochastic " << stochastic;
    EXPECT_EQ(s_diff, 0) << "stochastic " << stochastic;
    EXPECT_EQ(y_diff, 0) << "stochastic " << stochastic;
    EXPECT_TRUE(std::isnan(sg[5])) << "a group holding a NaN has a NaN scale";
  }
}

TEST_F(CudaBackendTest, AllocatorAccounting) {
  const shardlm::MemoryTracker& tracker = memory.tracker();
  const int64_t before = tracker.live()[MemCategory::activations];
  {
    Buffer a = gpu->alloc(MemCategory::activations, 1000, Buffer::Fill::zero);
    EXPECT_EQ(tracker.live()[MemCategory::activations], before + 1000);
    std::vector<char> h(1000, 1);
    gpu->download(h.data(), a.data(), 1000);
    EXPECT_EQ(std::count(h.begin(), h.end(), 0), 1000) << "Fill::zero";
    EXPECT_GE(shardlm::kernels::cuda_reserved_bytes(*gpu), 1000);
  }
  EXPECT_EQ(tracker.live()[MemCategory::activations], before);
  const int64_t reserved = shardlm::kernels::cuda_reserved_bytes(*gpu);
  Buffer b = gpu->alloc(MemCategory::activations, 1000, Buffer::Fill::none);  // from the cache
  EXPECT_EQ(shardlm::kernels::cuda_reserved_bytes(*gpu), reserved);
}

// What calibrate --device cuda reads of the backend: the device's name and memory, the GEMMs'
// dtype, and synchronize(), which returns once the work queued on the stream is done (the clock is
// read after it).
TEST_F(CudaBackendTest, DeviceInfoAndSynchronize) {
  const Backend::DeviceInfo info = gpu->device_info();
  std::printf("DEVICE %s, %.1f GiB\n", info.name.c_str(), info.memory_bytes / 1073741824.0);
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.memory_bytes, int64_t{1} << 30);
  EXPECT_EQ(info.gemm_dtype, "bf16");
  EXPECT_EQ(gpu32->device_info().gemm_dtype, "fp32");
  EXPECT_EQ(cpu->device_info().gemm_dtype, "fp32");
  EXPECT_EQ(cpu->device_info().memory_bytes, 0);
  const size_t bytes = size_t{256} << 20;
  Buffer a = gpu->alloc(MemCategory::workspace, bytes, Buffer::Fill::none);
  for (int i = 0; i < 16; ++i) gpu->zero(a.data(), bytes);  // a few ms of work queued
  gpu->synchronize();
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(gpu->stream_handle())), cudaSuccess);
}

// A pinned host buffer (the offload tier's, run/host_store.h) round-trips through device memory:
// the upload from it may run after it returns, the download lands in it; the CPU pins nothing.
TEST_F(CudaBackendTest, PinnedHostBufferRoundTrips) {
  const size_t n = size_t{8} << 20;
  Buffer host(memory, MemCategory::staging, sizeof(float) * n, Buffer::Fill::none);
  for (size_t i = 0; i < n; ++i) host.f32()[i] = float(i % 9973) * 0.5f;
  EXPECT_FALSE(cpu->pin_host(host.data(), host.bytes()));
  ASSERT_TRUE(gpu->pin_host(host.data(), host.bytes()));
  Buffer dev = gpu->alloc(MemCategory::workspace, host.bytes(), Buffer::Fill::none);
  gpu->upload(dev.data(), host.data(), host.bytes());
  gpu->scale(dev.f32(), int64_t(n), 2.0f);
  gpu->download(host.data(), dev.data(), host.bytes());
  gpu->synchronize();
  gpu->unpin_host(host.data());
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += host.f32()[i] != float(i % 9973);
  EXPECT_EQ(wrong, 0u);
}

// Each call's own scratch (carved from the region a plan gives, Backend::use_scratch) is exactly
// what model::KernelScratch says it holds, for every backend option that changes it: bf16 operand
// copies or none, the tensor-core, cuBLAS and fp32 flash attention, the head's slab.
TEST_F(CudaBackendTest, EachCallsScratchIsTheFigureThePlanReserves) {
  using Attention = shardlm::kernels::CudaOptions::Attention;
  const auto figures = [](bool bf16, Attention a) {
    shardlm::model::KernelScratch k;
    k.cuda = true;
    k.bf16_gemm = bf16;
    k.mma_attention = a == Attention::mma;
    k.gemm_attention = a != Attention::flash;
    return k;
  };
  struct Case {
    const Backend* be;
    shardlm::model::KernelScratch k;
    const char* name;
  };
  const Case cases[] = {{gpu, figures(true, Attention::mma), "mma-bf16"},
                        {gpu32, figures(false, Attention::mma), "fp32"},
                        {cublas16, figures(true, Attention::cublas), "gemm-bf16"},
                        {flash32, figures(false, Attention::flash), "flash"}};
  Buffer region = gpu->alloc(MemCategory::workspace, size_t{256} << 20, Buffer::Fill::none);
  const int64_t N = 300, C = 96, OC = 288, V = 1000, Vp = 1024;
  const Dev x(*gpu, randv(N * OC, 40)), w(*gpu, randv(OC * OC, 41, -0.05f, 0.05f)), b(*gpu, randv(OC, 42));
  const Dev dout(*gpu, randv(N * OC, 43)), gi(*gpu, fvec(N * OC, 0)), gw(*gpu, fvec(OC * OC, 0)), gb(*gpu, fvec(OC, 0));
  const Dev y(*gpu, fvec(N * OC, 0)), mean(*gpu, randv(N, 44)), rstd(*gpu, randv(N, 45, 0.5f, 1.5f));
  std::vector<int32_t> tgt(N);
  for (int64_t i = 0; i < N; ++i) tgt[i] = int32_t(i * 7 % V);
  Buffer dtgt = gpu->alloc(MemCategory::workspace, sizeof(int32_t) * N, Buffer::Fill::none);
  gpu->upload(dtgt.data(), tgt.data(), sizeof(int32_t) * N);
  const Dev wte(*gpu, randv(Vp * C, 46, -0.1f, 0.1f)), dwte(*gpu, fvec(Vp * C, 0)), hscr(*gpu, fvec(cpu->head_scratch(96, Vp), 0));
  for (const Case& c : cases) {
    const Backend& g = *c.be;
    g.use_scratch(region.data(), region.bytes());
    const auto check = [&](const std::string& what, int64_t figure, const auto& call) {
      shardlm::kernels::cuda_scratch_high_water(g);  // from here
      call();
      g.synchronize();
      const int64_t held = shardlm::kernels::cuda_scratch_high_water(g);
      std::printf("SCRATCH %-10s %-34s held %10lld figure %10lld\n", c.name, what.c_str(), (long long)held, (long long)figure);
      EXPECT_EQ(held, figure) << c.name << " " << what;
    };
    check("linear_forward", c.k.linear_forward(N, C, OC, true), [&] { g.linear_forward(y.p(), x.p(), w.p(), b.p(), N, C, OC); });
    check("linear_backward", c.k.linear_backward(N, C, OC, true),
          [&] { g.linear_backward(gi.p(), gw.p(), gb.p(), dout.p(), x.p(), w.p(), N, C, OC); });
    check("dense_forward", c.k.dense_forward(N, C, OC), [&] { g.dense_forward(y.p(), x.p(), w.p(), N, C, OC); });
    check("dense_backward", c.k.dense_backward(N, C, OC),
          [&] { g.dense_backward(gi.p(), gw.p(), dout.p(), x.p(), w.p(), N, C, OC); });
    check("layernorm_backward", c.k.column_sums(N, OC), [&] {
      g.layernorm_backward(gi.p(), gw.p(), gb.p(), dout.p(), x.p(), w.p(), mean.p(), rstd.p(), N, OC);
    });
    check("rmsnorm_backward", c.k.column_sums(N, OC),
          [&] { g.rmsnorm_backward(gi.p(), gw.p(), dout.p(), x.p(), w.p(), rstd.p(), N, OC); });
    for (const auto& a : {std::array<int64_t, 5>{2, 128, 6, 6, 64}, std::array<int64_t, 5>{1, 100, 6, 2, 64},
                          std::array<int64_t, 5>{1, 77, 3, 3, 40}}) {
      const int64_t B = a[0], T = a[1], NH = a[2], NKV = a[3], HS = a[4], W = (NH + 2 * NKV) * HS;
      const Dev qkv(g, randv(B * T * W, 47)), out(g, fvec(B * T * NH * HS, 0)), lse(g, fvec(B * NH * T, 0));
      const Dev d(g, randv(B * T * NH * HS, 48)), dqkv(g, fvec(B * T * W, 0));
      const std::string shape = " T" + std::to_string(T) + " NKV" + std::to_string(NKV) + " HS" + std::to_string(HS);
      check("attention_forward" + shape, c.k.attention_forward(B, T, NH, NKV, HS),
            [&] { g.attention_forward(out.p(), lse.p(), qkv.p(), B, T, NH, NKV, HS); });
      check("attention_backward" + shape, c.k.attention_backward(B, T, NH, NKV, HS),
            [&] { g.attention_backward(dqkv.p(), d.p(), qkv.p(), out.p(), lse.p(), B, T, NH, NKV, HS, nullptr); });
    }
    check("head train", c.k.head(N, C, Vp, 96, true, false), [&] {
      g.lm_head_cross_entropy(gi.p(), dwte.p(), x.p(), wte.p(), dtgt.as<int32_t>(), N, C, V, Vp, 1.0f / N, 96, hscr.p(), nullptr);
    });
    check("head loss", c.k.head(N, C, Vp, 96, false, false), [&] {
      g.lm_head_cross_entropy(nullptr, nullptr, x.p(), wte.p(), dtgt.as<int32_t>(), N, C, V, Vp, 0, 96, hscr.p(), nullptr);
    });
    const int32_t ignore = -1;
    fvec logits(V);
    check("head, one row, host target", c.k.head(1, C, Vp, 1, false, true), [&] {
      g.lm_head_cross_entropy(nullptr, nullptr, x.p(), wte.p(), &ignore, 1, C, V, Vp, 0, 1, hscr.p(), logits.data());
    });
    EXPECT_EQ(g.scratch_overflows(), 0) << c.name;
    g.use_scratch(nullptr, 0);
  }
  // A call whose scratch does not fit the region takes it apart and is counted.
  gpu->use_scratch(region.data(), 512);
  gpu->linear_forward(y.p(), x.p(), w.p(), b.p(), N, C, OC);
  gpu->synchronize();
  EXPECT_EQ(gpu->scratch_overflows(), 2);  // x's copy and the weight's
  gpu->use_scratch(nullptr, 0);
}

// The copy lane (the offload tier's transfers) runs beside the kernels: a mark orders one lane's
// work after the other's without the host waiting. A download on the copy lane after a mark of
// the kernels sees all they wrote; kernels after a mark of the copy lane see what it uploaded.
TEST_F(CudaBackendTest, TheCopyLaneIsOrderedOnlyByMarks) {
  using Lane = Backend::Lane;
  EXPECT_EQ(cpu->mark(Lane::copy), nullptr);
  const size_t n = size_t{64} << 20;  // 256 MB: the kernels below take a while
  Buffer host(memory, MemCategory::staging, sizeof(float) * n, Buffer::Fill::none);
  ASSERT_TRUE(gpu->pin_host(host.data(), host.bytes()));
  Buffer dev = gpu->alloc(MemCategory::workspace, host.bytes(), Buffer::Fill::none);
  std::fill_n(host.f32(), n, 1.0f);
  gpu->upload(dev.data(), host.data(), host.bytes());
  for (int i = 0; i < 8; ++i) gpu->scale(dev.f32(), int64_t(n), 2.0f);
  gpu->wait(Lane::copy, gpu->mark(Lane::compute));
  gpu->download_on(Lane::copy, host.data(), dev.data(), host.bytes());
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += host.f32()[i] != 256.0f;
  EXPECT_EQ(wrong, 0u) << "the copy lane read before the kernels it waited for had finished";
  std::fill_n(host.f32(), n, 3.0f);
  gpu->upload_on(Lane::copy, dev.data(), host.data(), host.bytes());
  gpu->wait(Lane::compute, gpu->mark(Lane::copy));
  gpu->scale(dev.f32(), int64_t(n), 2.0f);
  std::vector<float> back(n);
  gpu->download(back.data(), dev.data(), host.bytes());
  wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += back[i] != 6.0f;
  EXPECT_EQ(wrong, 0u) << "the kernels ran before the copy lane's upload they waited for";
  gpu->synchronize();
  gpu->unpin_host(host.data());
}

}  // namespace
