// Tests of the CPU fp32 kernels: every backward against central finite differences of a
// double-precision reference forward, forwards against double references, attention and the
// LM head against naive full references, AdamW against torch's formula, determinism, bf16.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"
#include "kernels/kernel_test_util.h"

namespace k = shardlm::kernels;
using namespace kernel_test;

namespace {

// ------------------------------------------------------------------------------------------
// Double-precision references
// ------------------------------------------------------------------------------------------

dvec ref_linear(const dvec& inp, const dvec& w, const dvec* bias, int64_t N, int64_t C,
                int64_t OC) {
  dvec out(N * OC);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t o = 0; o < OC; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) s += inp[i * C + c] * w[c * OC + o];
      out[i * OC + o] = s;
    }
  return out;
}

dvec ref_layernorm(const dvec& inp, const dvec& w, const dvec& b, int64_t N, int64_t C,
                   dvec* mean = nullptr, dvec* rstd = nullptr) {
  dvec out(N * C);
  if (mean) mean->resize(N);
  if (rstd) rstd->resize(N);
  for (int64_t i = 0; i < N; ++i) {
    double mu = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) mu += inp[i * C + c];
    mu /= C;
    for (int64_t c = 0; c < C; ++c) var += (inp[i * C + c] - mu) * (inp[i * C + c] - mu);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = (inp[i * C + c] - mu) * rs * w[c] + b[c];
    if (mean) (*mean)[i] = mu;
    if (rstd) (*rstd)[i] = rs;
  }
  return out;
}

double ref_gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

// qkv (B,T,3C) -> out (B,T,C), lse (B,NH,T); causal, scale 1/sqrt(HS).
dvec ref_attention(const dvec& qkv, int64_t B, int64_t T, int64_t NH, int64_t HS,
                   dvec* lse = nullptr, bool causal = true) {
  const int64_t C = NH * HS, C3 = 3 * C;
  const double sc = 1.0 / std::sqrt(static_cast<double>(HS));
  dvec out(B * T * C, 0.0);
  if (lse) lse->assign(B * NH * T, 0.0);
  dvec s(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * C3 + h * HS];
        double mx = -1e300;
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) {
          const double* kk = &qkv[(b * T + j) * C3 + C + h * HS];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += q[e] * kk[e];
          s[j] = d * sc;
          mx = std::max(mx, s[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) sum += std::exp(s[j] - mx);
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) {
          const double p = std::exp(s[j] - mx) / sum;
          const double* v = &qkv[(b * T + j) * C3 + 2 * C + h * HS];
          for (int64_t e = 0; e < HS; ++e) out[(b * T + i) * C + h * HS + e] += p * v[e];
        }
        if (lse) (*lse)[(b * NH + h) * T + i] = mx + std::log(sum);
      }
  return out;
}

// Analytic backward of ref_attention: returns dqkv.
dvec ref_attention_backward(const dvec& qkv, const dvec& dout, int64_t B, int64_t T, int64_t NH,
                            int64_t HS, bool causal = true) {
  const int64_t C = NH * HS, C3 = 3 * C;
  const double sc = 1.0 / std::sqrt(static_cast<double>(HS));
  dvec dqkv(B * T * C3, 0.0);
  dvec p(T), dp(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * C3 + h * HS];
        const double* go = &dout[(b * T + i) * C + h * HS];
        double mx = -1e300;
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) {
          const double* kk = &qkv[(b * T + j) * C3 + C + h * HS];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += q[e] * kk[e];
          p[j] = d * sc;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) sum += (p[j] = std::exp(p[j] - mx));
        double pdp = 0.0;
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) {
          p[j] /= sum;
          const double* v = &qkv[(b * T + j) * C3 + 2 * C + h * HS];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += go[e] * v[e];
          dp[j] = d;
          pdp += p[j] * d;
          double* dv = &dqkv[(b * T + j) * C3 + 2 * C + h * HS];
          for (int64_t e = 0; e < HS; ++e) dv[e] += p[j] * go[e];
        }
        for (int64_t j = 0; j <= (causal ? i : T - 1); ++j) {
          const double ds = p[j] * (dp[j] - pdp) * sc;
          const double* kk = &qkv[(b * T + j) * C3 + C + h * HS];
          double* dq = &dqkv[(b * T + i) * C3 + h * HS];
          double* dk = &dqkv[(b * T + j) * C3 + C + h * HS];
          for (int64_t e = 0; e < HS; ++e) {
            dq[e] += ds * kk[e];
            dk[e] += ds * q[e];
          }
        }
      }
  return dqkv;
}

// Returns sum of row losses; logits (N,V) if asked; rows with target < 0 ignored.
double ref_head(const dvec& x, const dvec& wte, const std::vector<int32_t>& tg, int64_t N,
                int64_t C, int64_t V, dvec* logits = nullptr, dvec* dx = nullptr,
                dvec* dwte = nullptr, double gscale = 1.0, int64_t Vp = 0) {
  double total = 0.0;
  if (logits) logits->assign(N * V, 0.0);
  if (dx) dx->assign(N * C, 0.0);
  if (dwte) dwte->assign((Vp ? Vp : V) * C, 0.0);
  dvec z(V);
  for (int64_t i = 0; i < N; ++i) {
    double mx = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += x[i * C + c] * wte[v * C + c];
      z[v] = s;
      mx = std::max(mx, s);
      if (logits) (*logits)[i * V + v] = s;
    }
    if (tg[i] < 0) continue;
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
    total += mx + std::log(sum) - z[tg[i]];
    if (dx || dwte)
      for (int64_t v = 0; v < V; ++v) {
        const double g = (std::exp(z[v] - mx) / sum - (v == tg[i] ? 1.0 : 0.0)) * gscale;
        for (int64_t c = 0; c < C; ++c) {
          if (dx) (*dx)[i * C + c] += g * wte[v * C + c];
          if (dwte) (*dwte)[v * C + c] += g * x[i * C + c];
        }
      }
  }
  return total;
}

class KernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { k::init_compute(2); }
};

}  // namespace

// ------------------------------------------------------------------------------------------

TEST_F(KernelsTest, InitComputeSetsFtzDazOnEveryThread) {
#if defined(__x86_64__) || defined(__i386__)
  int bad = 0;
#pragma omp parallel reduction(+ : bad)
  {
    if ((_mm_getcsr() & 0x8040u) != 0x8040u) bad += 1;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(omp_get_max_threads(), 2);
  volatile float tiny = 1e-30f;
  volatile float r = tiny * 1e-10f;  // 1e-40 is a denormal: flushed to zero
  EXPECT_EQ(r, 0.0f);
#else
  GTEST_SKIP() << "not x86";
#endif
}

TEST_F(KernelsTest, MatmulAllTransposesAlphaBeta) {
  const int64_t M = 13, N = 17, K = 11;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
      const int64_t arows = ta ? K : M, brows = tb ? N : K;
      fvec A = randv(arows * lda, 1), Bm = randv(brows * ldb, 2), Cm = randv(M * ldc, 3);
      dvec ref(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0.0;
          for (int64_t kk = 0; kk < K; ++kk) {
            const double a = ta ? A[kk * lda + i] : A[i * lda + kk];
            const double b = tb ? Bm[j * ldb + kk] : Bm[kk * ldb + j];
            s += a * b;
          }
          ref[i * N + j] = 1.5 * s + 0.5 * Cm[i * ldc + j];
        }
      k::matmul(ta, tb, M, N, K, 1.5f, A.data(), lda, Bm.data(), ldb, 0.5f, Cm.data(), ldc);
      dvec got(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) got[i * N + j] = Cm[i * ldc + j];
      expect_close(got, ref, 1e-5, 1e-6, "matmul");
    }
}

TEST_F(KernelsTest, MatmulRejectsBadLeadingDimension) {
  fvec A(16), Bm(16), Cm(16);
  EXPECT_THROW(k::matmul(false, false, 4, 4, 4, 1.0f, A.data(), 2, Bm.data(), 4, 0.0f, Cm.data(), 4),
               std::runtime_error);
}

TEST_F(KernelsTest, LinearForwardBackward) {
  const int64_t N = 5, C = 7, OC = 9;
  const fvec inp = randv(N * C, 10), w = randv(C * OC, 11), bias = randv(OC, 12),
             dout = randv(N * OC, 13);
  const dvec dinp_ = tod(inp), dw_ = tod(w), db_ = tod(bias), ddo = tod(dout);
  fvec out(N * OC);
  k::linear_forward(out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
  expect_close(out, ref_linear(dinp_, dw_, &db_, N, C, OC), 1e-5, 1e-6, "linear fwd");
  k::linear_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
  expect_close(out, ref_linear(dinp_, dw_, nullptr, N, C, OC), 1e-5, 1e-6, "linear fwd nobias");

  fvec gi(N * C, kFill), gw(C * OC, kFill), gb(OC, kFill);
  k::linear_backward(gi.data(), gw.data(), gb.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  auto L_in = [&](const dvec& x) { return dot(ref_linear(x, dw_, &db_, N, C, OC), ddo); };
  auto L_w = [&](const dvec& x) { return dot(ref_linear(dinp_, x, &db_, N, C, OC), ddo); };
  auto L_b = [&](const dvec& x) { return dot(ref_linear(dinp_, dw_, &x, N, C, OC), ddo); };
  expect_close(minus_fill(gi), fd_grad(L_in, dinp_), 1e-5, 1e-6, "linear dinp");
  expect_close(minus_fill(gw), fd_grad(L_w, dw_), 1e-5, 1e-6, "linear dweight");
  expect_close(minus_fill(gb), fd_grad(L_b, db_), 1e-5, 1e-6, "linear dbias");

  // null outputs are skipped
  fvec gi2(N * C, kFill);
  k::linear_backward(gi2.data(), nullptr, nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
  EXPECT_EQ(gi2, gi);
}

TEST_F(KernelsTest, LayerNormForwardBackward) {
  const int64_t N = 4, C = 37;
  fvec inp = randv(N * C, 20, -2.0f, 3.0f);
  const fvec w = randv(C, 21, 0.5f, 1.5f), b = randv(C, 22), dout = randv(N * C, 23);
  const dvec din = tod(inp), dw = tod(w), db = tod(b), ddo = tod(dout);
  fvec out(N * C), mean(N), rstd(N);
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  dvec rm, rr;
  const dvec rout = ref_layernorm(din, dw, db, N, C, &rm, &rr);
  expect_close(out, rout, 1e-5, 1e-6, "ln out");
  expect_close(mean, rm, 1e-5, 1e-6, "ln mean");
  expect_close(rstd, rr, 1e-5, 1e-6, "ln rstd");

  fvec gi(N * C, kFill), gw(C, kFill), gb(C, kFill);
  k::layernorm_backward(gi.data(), gw.data(), gb.data(), dout.data(), inp.data(), w.data(),
                        mean.data(), rstd.data(), N, C);
  auto L_in = [&](const dvec& x) { return dot(ref_layernorm(x, dw, db, N, C), ddo); };
  auto L_w = [&](const dvec& x) { return dot(ref_layernorm(din, x, db, N, C), ddo); };
  auto L_b = [&](const dvec& x) { return dot(ref_layernorm(din, dw, x, N, C), ddo); };
  expect_close(minus_fill(gi), fd_grad(L_in, din), 1e-4, 1e-5, "ln dinp");
  expect_close(minus_fill(gw), fd_grad(L_w, dw), 1e-4, 1e-5, "ln dweight");
  expect_close(minus_fill(gb), fd_grad(L_b, db), 1e-4, 1e-5, "ln dbias");
}

TEST_F(KernelsTest, GeluForwardBackward) {
  // Include large |x| (saturated regions) and an n that is not a multiple of the vector width.
  fvec x = randv(203, 30, -6.0f, 6.0f);
  x[0] = -30.0f;
  x[1] = 30.0f;
  x[2] = 0.0f;
  x[3] = -12.0f;
  const int64_t n = static_cast<int64_t>(x.size());
  fvec y(n);
  k::gelu_forward(y.data(), x.data(), n);
  dvec ry(n);
  for (int64_t i = 0; i < n; ++i) ry[i] = ref_gelu(x[i]);
  expect_close(y, ry, 1e-6, 1e-6, "gelu fwd");

  const fvec dout = randv(n, 31);
  fvec gi(n, kFill);
  k::gelu_backward(gi.data(), dout.data(), x.data(), n);
  dvec fd(n);
  for (int64_t i = 0; i < n; ++i) {
    const double e = 1e-5;
    fd[i] = (ref_gelu(x[i] + e) - ref_gelu(x[i] - e)) / (2 * e) * dout[i];
  }
  expect_close(minus_fill(gi), fd, 1e-5, 1e-6, "gelu dinp");
}

TEST_F(KernelsTest, ResidualForward) {
  const fvec a = randv(1001, 40), b = randv(1001, 41);
  fvec out(1001);
  k::residual_forward(out.data(), a.data(), b.data(), 1001);
  for (int i = 0; i < 1001; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  fvec a2 = a;
  k::residual_forward(a2.data(), a2.data(), b.data(), 1001);  // in place
  EXPECT_EQ(a2, out);
}

TEST_F(KernelsTest, EmbeddingForwardBackward) {
  const int64_t B = 2, T = 5, C = 70, V = 6;  // C spans a full and a partial channel block
  const std::vector<int32_t> tok = {1, 3, 1, 1, 5, 0, 3, 3, 2, 1};  // repeated tokens
  const fvec wte = randv(V * C, 50), wpe = randv(T * C, 51), dout = randv(B * T * C, 52);
  fvec out(B * T * C);
  k::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t c = 0; c < C; ++c)
      ASSERT_EQ(out[bt * C + c], wte[tok[bt] * C + c] + wpe[(bt % T) * C + c]);

  auto fwd = [&](const dvec& e, const dvec& p) {
    dvec o(B * T * C);
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (int64_t c = 0; c < C; ++c) o[bt * C + c] = e[tok[bt] * C + c] + p[(bt % T) * C + c];
    return o;
  };
  const dvec de = tod(wte), dp = tod(wpe), ddo = tod(dout);
  fvec gwte(V * C, kFill), gwpe(T * C, kFill);
  k::embedding_backward(gwte.data(), gwpe.data(), dout.data(), tok.data(), B, T, C);
  expect_close(minus_fill(gwte), fd_grad([&](const dvec& x) { return dot(fwd(x, dp), ddo); }, de),
               1e-5, 1e-6, "dwte");
  expect_close(minus_fill(gwpe), fd_grad([&](const dvec& x) { return dot(fwd(de, x), ddo); }, dp),
               1e-5, 1e-6, "dwpe");
}

// ------------------------------------------------------------------------------------------
// Attention
// ------------------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, T, NH, HS;
};

TEST_F(KernelsTest, AttentionMatchesNaiveReference) {
  // T not a multiple of the 64 tile, several tiles, head sizes with and without vector tails.
  const AttnShape shapes[] = {{1, 5, 2, 3}, {2, 70, 2, 16}, {1, 130, 2, 64}, {1, 64, 1, 20},
                              {2, 33, 3, 48}, {1, 200, 1, 128}};
  for (const auto& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " NH=" << s.NH
                                      << " HS=" << s.HS);
    const int64_t C = s.NH * s.HS;
    const fvec qkv = randv(s.B * s.T * 3 * C, 60 + s.T, -2.0f, 2.0f);
    const fvec dout = randv(s.B * s.T * C, 61 + s.T);
    fvec out(s.B * s.T * C), lse(s.B * s.NH * s.T);
    k::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.HS);
    dvec rlse;
    const dvec rout = ref_attention(tod(qkv), s.B, s.T, s.NH, s.HS, &rlse);
    expect_close(out, rout, 1e-5, 1e-6, "attn out");
    expect_close(lse, rlse, 1e-5, 1e-6, "attn lse");

    fvec dqkv(qkv.size(), kFill);
    fvec scratch = nan_scratch(k::attention_backward_scratch(s.B, s.T, s.NH, s.HS, omp_get_max_threads()));
    k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B,
                          s.T, s.NH, s.HS, scratch.data());
    const dvec rd = ref_attention_backward(tod(qkv), tod(dout), s.B, s.T, s.NH, s.HS);
    expect_close(minus_fill(dqkv), rd, 1e-4, 1e-6, "attn dqkv");
  }
}

TEST_F(KernelsTest, AttentionBackwardFiniteDifferences) {
  // Checks the kernel and the analytic reference against central differences.
  const int64_t B = 1, T = 6, NH = 2, HS = 3, C = NH * HS;
  const fvec qkv = randv(B * T * 3 * C, 70, -1.5f, 1.5f), dout = randv(B * T * C, 71);
  const dvec dq = tod(qkv), ddo = tod(dout);
  const dvec fd = fd_grad([&](const dvec& x) { return dot(ref_attention(x, B, T, NH, HS), ddo); }, dq);
  expect_close(ref_attention_backward(dq, ddo, B, T, NH, HS), fd, 1e-6, 1e-8, "ref bwd vs fd");
  fvec out(B * T * C), lse(B * NH * T), dqkv(qkv.size(), kFill);
  fvec scratch = nan_scratch(k::attention_backward_scratch(B, T, NH, HS, omp_get_max_threads()));
  k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
  k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                        HS, scratch.data());
  expect_close(minus_fill(dqkv), fd, 1e-4, 1e-6, "kernel bwd vs fd");
}

TEST_F(KernelsTest, AttentionBlocksComposeLikeRingAttention) {
  // One query tile at positions [64, 128) attends to keys [0, 150) given as two key/value
  // blocks, in either order, either through one running state or two merged states.
  const int64_t T = 150, HS = 32, C3 = 3 * HS;
  const fvec qkv = randv(T * C3, 80, -2.0f, 2.0f);
  fvec out(T * HS), lse(T);
  k::attention_forward(out.data(), lse.data(), qkv.data(), 1, T, 1, HS);
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int64_t q0 = 64, nq = 64, split = 100;
  const float* q = qkv.data() + q0 * C3;
  const float* kk = qkv.data() + HS;
  const float* v = qkv.data() + 2 * HS;
  fvec scratch = nan_scratch(k::attention_block_forward_scratch(HS));
  for (int variant = 0; variant < 3; ++variant) {
    fvec m(nq), l(nq), acc(nq * HS), m2(nq), l2(nq), acc2(nq * HS);
    k::attention_state_init(m.data(), l.data(), acc.data(), nq, HS);
    k::attention_state_init(m2.data(), l2.data(), acc2.data(), nq, HS);
    auto blk = [&](int64_t k0, int64_t nk, float* M, float* L, float* A) {
      k::attention_block_forward(q, C3, nq, q0, kk + k0 * C3, C3, v + k0 * C3, C3, nk, k0, HS,
                                 scale, true, M, L, A, scratch.data());
    };
    if (variant == 0) {
      blk(0, split, m.data(), l.data(), acc.data());
      blk(split, 128 - split, m.data(), l.data(), acc.data());
      blk(128, T - 128, m.data(), l.data(), acc.data());  // entirely in the future: no-op
    } else if (variant == 1) {
      blk(40, T - 40, m.data(), l.data(), acc.data());
      blk(0, 40, m.data(), l.data(), acc.data());
    } else {
      blk(0, 40, m.data(), l.data(), acc.data());
      blk(40, T - 40, m2.data(), l2.data(), acc2.data());
      k::attention_state_merge(m.data(), l.data(), acc.data(), m2.data(), l2.data(), acc2.data(),
                               nq, HS);
    }
    fvec o(nq * HS), ls(nq);
    k::attention_state_finalize(o.data(), HS, ls.data(), m.data(), l.data(), acc.data(), nq, HS);
    const fvec ro(out.begin() + q0 * HS, out.begin() + (q0 + nq) * HS);
    const fvec rl(lse.begin() + q0, lse.begin() + q0 + nq);
    expect_close(o, ro, 1e-5, 1e-6, "block out");
    expect_close(ls, rl, 1e-5, 1e-6, "block lse");
  }

  // Backward through the block routine with the key range split in two blocks equals the
  // whole-sequence backward.
  const fvec dout = randv(T * HS, 81);
  fvec dfull(qkv.size(), 0.0f), dblk(qkv.size(), 0.0f);
  fvec sc = nan_scratch(k::attention_backward_scratch(1, T, 1, HS, omp_get_max_threads()));
  k::attention_backward(dfull.data(), dout.data(), qkv.data(), out.data(), lse.data(), 1, T, 1,
                        HS, sc.data());
  fvec bs = nan_scratch(k::attention_block_backward_scratch(HS)), D(64);
  for (int64_t t0 = 0; t0 < T; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, T - t0);
    k::attention_backward_rowdot(D.data(), dout.data() + t0 * HS, HS, out.data() + t0 * HS, HS, n, HS);
    const std::pair<int64_t, int64_t> kbs[] = {{0, 37}, {37, T - 37}};
    for (const auto& kb : kbs)
      k::attention_block_backward(qkv.data() + t0 * C3, C3, dout.data() + t0 * HS, HS,
                                  lse.data() + t0, D.data(), n, t0, kk + kb.first * C3, C3,
                                  v + kb.first * C3, C3, kb.second, kb.first, HS, scale, true,
                                  dblk.data() + t0 * C3, C3, dblk.data() + HS + kb.first * C3, C3,
                                  dblk.data() + 2 * HS + kb.first * C3, C3, bs.data());
  }
  expect_close(dblk, dfull, 1e-5, 1e-7, "block backward");
}

TEST_F(KernelsTest, AttentionBlocksNonCausal) {
  // causal = false through the block routines (e.g. cross attention / a ring step whose keys
  // all precede the queries), against the naive full-softmax reference.
  const int64_t T = 90, HS = 24, C3 = 3 * HS;
  const fvec qkv = randv(T * C3, 85, -2.0f, 2.0f), dout = randv(T * HS, 86);
  dvec rlse;
  const dvec rout = ref_attention(tod(qkv), 1, T, 1, HS, &rlse, false);
  const dvec rd = ref_attention_backward(tod(qkv), tod(dout), 1, T, 1, HS, false);
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  fvec out(T * HS), lse(T), dq(qkv.size(), kFill);
  fvec fs = nan_scratch(k::attention_block_forward_scratch(HS));
  fvec bs = nan_scratch(k::attention_block_backward_scratch(HS)), D(64);
  for (int64_t t0 = 0; t0 < T; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, T - t0);
    fvec m(n), l(n), acc(n * HS);
    k::attention_state_init(m.data(), l.data(), acc.data(), n, HS);
    k::attention_block_forward(qkv.data() + t0 * C3, C3, n, t0, qkv.data() + HS, C3,
                               qkv.data() + 2 * HS, C3, T, 0, HS, scale, false, m.data(),
                               l.data(), acc.data(), fs.data());
    k::attention_state_finalize(out.data() + t0 * HS, HS, lse.data() + t0, m.data(), l.data(),
                                acc.data(), n, HS);
  }
  expect_close(out, rout, 1e-5, 1e-6, "noncausal out");
  expect_close(lse, rlse, 1e-5, 1e-6, "noncausal lse");
  for (int64_t t0 = 0; t0 < T; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, T - t0);
    k::attention_backward_rowdot(D.data(), dout.data() + t0 * HS, HS, out.data() + t0 * HS, HS,
                                 n, HS);
    k::attention_block_backward(qkv.data() + t0 * C3, C3, dout.data() + t0 * HS, HS,
                                lse.data() + t0, D.data(), n, t0, qkv.data() + HS, C3,
                                qkv.data() + 2 * HS, C3, T, 0, HS, scale, false,
                                dq.data() + t0 * C3, C3, dq.data() + HS, C3, dq.data() + 2 * HS,
                                C3, bs.data());
  }
  expect_close(minus_fill(dq), rd, 1e-4, 1e-6, "noncausal dqkv");
}

// ------------------------------------------------------------------------------------------
// LM head + cross-entropy
// ------------------------------------------------------------------------------------------

TEST_F(KernelsTest, LmHeadMatchesNaiveWithPaddingAndIgnoredRows) {
  const int64_t N = 7, C = 19, V = 37, Vp = 48, chunk = 3;  // chunk does not divide N
  const std::vector<int32_t> tg = {4, -1, 36, 0, 4, -1, 17};
  const fvec x = randv(N * C, 90, -2.0f, 2.0f), wte = randv(Vp * C, 91, -2.0f, 2.0f);
  const float gscale = 1.0f / 5.0f;
  dvec rlogits, rdx, rdw;
  const double rloss = ref_head(tod(x), tod(wte), tg, N, C, V, &rlogits, &rdx, &rdw, gscale, Vp);

  fvec scratch = nan_scratch(k::head_scratch(chunk, Vp));
  fvec dx(N * C, kFill), dw(Vp * C, kFill), logits(N * V);
  const double loss = k::lm_head_cross_entropy(dx.data(), dw.data(), x.data(), wte.data(),
                                               tg.data(), N, C, V, Vp, gscale, chunk,
                                               scratch.data(), logits.data());
  EXPECT_NEAR(loss, rloss, 1e-5 * std::fabs(rloss));
  expect_close(logits, rlogits, 1e-5, 1e-6, "logits");
  expect_close(minus_fill(dx), rdx, 1e-5, 1e-7, "dx");
  expect_close(minus_fill(dw), rdw, 1e-5, 1e-7, "dwte");
  for (int64_t i = V * C; i < Vp * C; ++i) ASSERT_EQ(dw[i], kFill) << "padding row touched";

  // Gradient of the loss itself by finite differences (grad_scale = 1).
  fvec dx1(N * C, 0.0f), dw1(Vp * C, 0.0f);
  k::lm_head_cross_entropy(dx1.data(), dw1.data(), x.data(), wte.data(), tg.data(), N, C, V, Vp,
                           1.0f, chunk, scratch.data(), nullptr);
  const dvec fdx = fd_grad([&](const dvec& xx) { return ref_head(xx, tod(wte), tg, N, C, V); }, tod(x));
  expect_close(dx1, fdx, 1e-5, 1e-6, "dx vs fd");
  const dvec fdw = fd_grad([&](const dvec& ww) { return ref_head(tod(x), ww, tg, N, C, V); }, tod(wte));
  expect_close(dw1, fdw, 1e-5, 1e-6, "dwte vs fd");  // padding rows: fd = 0

  // Loss only (no grads), no logits: same loss.
  fvec scratch4 = nan_scratch(k::head_scratch(4, Vp));
  const double loss2 = k::lm_head_cross_entropy(nullptr, nullptr, x.data(), wte.data(), tg.data(),
                                                N, C, V, Vp, gscale, 4, scratch4.data(), nullptr);
  EXPECT_NEAR(loss2, rloss, 1e-5 * std::fabs(rloss));
}

TEST_F(KernelsTest, LmHeadRejectsOutOfRangeTarget) {
  const int64_t N = 2, C = 4, V = 5, Vp = 8;
  const std::vector<int32_t> tg = {1, 5};
  const fvec x = randv(N * C, 92), wte = randv(Vp * C, 93);
  fvec scratch = nan_scratch(k::head_scratch(N, Vp));
  EXPECT_THROW(k::lm_head_cross_entropy(nullptr, nullptr, x.data(), wte.data(), tg.data(), N, C,
                                        V, Vp, 1.0f, N, scratch.data(), nullptr),
               std::out_of_range);
}

// ------------------------------------------------------------------------------------------
// Optimizer and utilities
// ------------------------------------------------------------------------------------------

TEST_F(KernelsTest, AdamWMatchesTorchFormula) {
  const int64_t n = 40000 + 13;  // several parallel blocks and a non-vector tail
  fvec p = randv(n, 100), m(n, 0.0f), v(n, 0.0f);
  dvec rp = tod(p), rm(n, 0.0), rv(n, 0.0);
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (int64_t t = 1; t <= 4; ++t) {
    const fvec g = randv(n, 200 + t);
    k::adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, t);
    // torch.optim.AdamW (single tensor): p.mul_(1-lr*wd); m.lerp_(g, 1-b1);
    // v.mul_(b2).addcmul_(g, g, value=1-b2); denom = v.sqrt()/sqrt(bc2) + eps;
    // p.addcdiv_(m, denom, value=-lr/bc1)
    const double bc1 = 1.0 - std::pow(double(b1), double(t));
    const double bc2 = 1.0 - std::pow(double(b2), double(t));
    for (int64_t i = 0; i < n; ++i) {
      rp[i] *= 1.0 - double(lr) * double(wd);
      rm[i] += (1.0 - double(b1)) * (g[i] - rm[i]);
      rv[i] = rv[i] * double(b2) + (1.0 - double(b2)) * double(g[i]) * double(g[i]);
      const double denom = std::sqrt(rv[i]) / std::sqrt(bc2) + double(eps);
      rp[i] += -(double(lr) / bc1) * rm[i] / denom;
    }
  }
  expect_close(p, rp, 1e-6, 1e-6, "adamw p");
  expect_close(m, rm, 1e-5, 1e-7, "adamw m");
  expect_close(v, rv, 1e-5, 1e-9, "adamw v");
  // The update must have moved the parameters by about lr per step (sanity: not a no-op).
  const fvec p0 = randv(n, 100);
  EXPECT_GT(std::fabs(p[0] - p0[0]), 1e-3);
}

TEST_F(KernelsTest, SumSquaresAndScale) {
  for (int64_t n : {0, 1, 17, 1000, 200001}) {
    fvec x = randv(n, 110 + static_cast<uint32_t>(n), -3.0f, 3.0f);
    double ref = 0.0;
    for (float f : x) ref += double(f) * double(f);
    const double got = k::sum_squares(x.data(), n);
    EXPECT_NEAR(got, ref, 1e-12 * std::max(1.0, ref)) << n;
    EXPECT_EQ(k::sum_squares(x.data(), n), got) << "deterministic";
    fvec y = x;
    k::scale(y.data(), n, 0.5f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], x[i] * 0.5f);
  }
}

TEST_F(KernelsTest, Bf16RoundTripAndRounding) {
  // Every bf16 value survives bf16 -> fp32 -> bf16 exactly (NaNs stay NaN).
  std::vector<uint16_t> all(65536), back(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  fvec f(65536);
  k::bf16_to_fp32(f.data(), all.data(), 65536);
  k::fp32_to_bf16(back.data(), f.data(), 65536);
  for (int i = 0; i < 65536; ++i) {
    if (std::isnan(f[i])) {
      ASSERT_EQ(back[i] & 0x7f80, 0x7f80);
      ASSERT_NE(back[i] & 0x7f, 0) << i;
    } else {
      ASSERT_EQ(back[i], all[i]) << i;
    }
  }
  EXPECT_EQ(f[0x3f80], 1.0f);
  // Round to nearest, ties to even.
  const float in[] = {1.0f + 0x1p-8f,       // tie between 1 (even) and 1+2^-7 -> 1
                      1.0f + 3 * 0x1p-8f,   // tie between 1+2^-7 and 1+2^-6 (even) -> 1+2^-6
                      1.0f + 0x1p-8f + 0x1p-20f,  // just above the tie -> 1+2^-7
                      -2.5f, std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN(), 3.4028235e38f};
  const uint16_t want[] = {0x3f80, 0x3f82, 0x3f81, 0xc020, 0x7f80, 0, 0x7f80};
  uint16_t got[7];
  k::fp32_to_bf16(got, in, 7);
  for (int i = 0; i < 7; ++i) {
    if (i == 5) {
      EXPECT_EQ(got[i] & 0x7f80, 0x7f80);
      EXPECT_NE(got[i] & 0x7f, 0);
    } else {
      EXPECT_EQ(got[i], want[i]) << i;
    }
  }
}

TEST_F(KernelsTest, FastExpAccuracy) {
  double worst = 0.0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f + 175.0f * static_cast<float>(i) / 200000.0f;
    const double ref = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(shardlm::kernels::detail::exp_fast(x) - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(shardlm::kernels::detail::exp_fast(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(shardlm::kernels::detail::exp_fast(-100.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(shardlm::kernels::detail::exp_fast(1000.0f)));
  EXPECT_EQ(shardlm::kernels::detail::exp_fast(0.0f), 1.0f);
}

TEST_F(KernelsTest, DeterministicRunToRunAndAcrossThreadCounts) {
  const int64_t B = 2, T = 100, NH = 3, HS = 32, C = NH * HS;
  const fvec qkv = randv(B * T * 3 * C, 120, -2.0f, 2.0f), dout = randv(B * T * C, 121);
  auto run_attn = [&](fvec& out, fvec& lse, fvec& dqkv) {
    out.assign(B * T * C, 0.0f);
    lse.assign(B * NH * T, 0.0f);
    dqkv.assign(qkv.size(), 0.0f);
    fvec sc = nan_scratch(k::attention_backward_scratch(B, T, NH, HS, omp_get_max_threads()));
    k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, HS);
    k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                          HS, sc.data());
  };
  fvec o1, l1, d1, o2, l2, d2, o3, l3, d3;
  run_attn(o1, l1, d1);
  run_attn(o2, l2, d2);
  EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * 4));
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4));
  EXPECT_EQ(0, std::memcmp(d1.data(), d2.data(), d1.size() * 4));
  omp_set_num_threads(1);
  run_attn(o3, l3, d3);  // attention is even independent of the thread count
  omp_set_num_threads(2);
  EXPECT_EQ(0, std::memcmp(o1.data(), o3.data(), o1.size() * 4));
  EXPECT_EQ(0, std::memcmp(d1.data(), d3.data(), d1.size() * 4));

  // LM head, layernorm backward, embedding backward, dbias: run twice, bitwise equal.
  const int64_t N = 64, Ch = 48, V = 300, Vp = 320;
  std::vector<int32_t> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[i] = static_cast<int32_t>((i * 37) % V);
  const fvec x = randv(N * Ch, 122), wte = randv(Vp * Ch, 123), w = randv(Ch, 124),
             bb = randv(Ch, 125);
  auto run_rest = [&](std::vector<fvec>& r) {
    r.assign(7, fvec());
    fvec sc = nan_scratch(k::head_scratch(16, Vp));
    r[0].assign(N * Ch, 0.0f);
    r[1].assign(Vp * Ch, 0.0f);
    const double loss = k::lm_head_cross_entropy(r[0].data(), r[1].data(), x.data(), wte.data(),
                                                 tg.data(), N, Ch, V, Vp, 0.1f, 16, sc.data(),
                                                 nullptr);
    r[2] = {static_cast<float>(loss), static_cast<float>(loss - static_cast<float>(loss))};
    fvec out(N * Ch), mean(N), rstd(N);
    k::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), bb.data(), N, Ch);
    r[3].assign(N * Ch, 0.0f);
    r[4].assign(2 * Ch, 0.0f);
    k::layernorm_backward(r[3].data(), r[4].data(), r[4].data() + Ch, x.data(), x.data(),
                          w.data(), mean.data(), rstd.data(), N, Ch);
    r[5].assign(V * Ch, 0.0f);
    k::embedding_backward(r[5].data(), nullptr, x.data(), tg.data(), 4, N / 4, Ch);
    r[6].assign(Ch, 0.0f);
    k::linear_backward(nullptr, nullptr, r[6].data(), x.data(), x.data(), x.data(), N, Ch, Ch);
  };
  std::vector<fvec> r1, r2;
  run_rest(r1);
  run_rest(r2);
  for (size_t i = 0; i < r1.size(); ++i)
    EXPECT_EQ(0, std::memcmp(r1[i].data(), r2[i].data(), r1[i].size() * 4)) << "output " << i;
}
