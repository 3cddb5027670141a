// Tests of the LLaMA-family CPU kernels: grouped-query attention, RMSNorm, rotary position
// embedding, SwiGLU and the nn.Linear-layout dense layer. Forwards against naive double
// references, backwards against central finite differences of those references (and, for
// attention at larger shapes, against the reference's analytic backward), plus structural
// properties (GQA == MHA with repeated k/v heads, rope orthogonality and relative positions)
// and determinism.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/cpu.h"
#include "kernels/kernel_test_util.h"

namespace k = shardlm::kernels;
using namespace kernel_test;

namespace {

// ------------------------------------------------------------------------------------------
// Double-precision references
// ------------------------------------------------------------------------------------------

struct Gqa {
  int64_t B, T, NH, NKV, HS;
  int64_t W() const { return (NH + 2 * NKV) * HS; }     // qkv row width
  int64_t C() const { return NH * HS; }                  // out row width
  int64_t qcol(int64_t h) const { return h * HS; }
  int64_t kcol(int64_t h) const { return NH * HS + (h / (NH / NKV)) * HS; }
  int64_t vcol(int64_t h) const { return (NH + NKV) * HS + (h / (NH / NKV)) * HS; }
};

// Causal GQA attention: qkv (B,T,W) -> out (B,T,NH*HS), lse (B,NH,T).
dvec ref_gqa(const dvec& qkv, const Gqa& g, dvec* lse = nullptr) {
  const int64_t T = g.T, HS = g.HS, W = g.W(), C = g.C();
  const double sc = 1.0 / std::sqrt(static_cast<double>(HS));
  dvec out(g.B * T * C, 0.0), s(T);
  if (lse) lse->assign(g.B * g.NH * T, 0.0);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * W + g.qcol(h)];
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          const double* kk = &qkv[(b * T + j) * W + g.kcol(h)];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += q[e] * kk[e];
          s[j] = d * sc;
          mx = std::max(mx, s[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - mx) / sum;
          const double* v = &qkv[(b * T + j) * W + g.vcol(h)];
          for (int64_t e = 0; e < HS; ++e) out[(b * T + i) * C + h * HS + e] += p * v[e];
        }
        if (lse) (*lse)[(b * g.NH + h) * T + i] = mx + std::log(sum);
      }
  return out;
}

// Analytic backward of ref_gqa: returns dqkv (B,T,W).
dvec ref_gqa_backward(const dvec& qkv, const dvec& dout, const Gqa& g) {
  const int64_t T = g.T, HS = g.HS, W = g.W(), C = g.C();
  const double sc = 1.0 / std::sqrt(static_cast<double>(HS));
  dvec dqkv(g.B * T * W, 0.0), p(T), dp(T);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * W + g.qcol(h)];
        const double* go = &dout[(b * T + i) * C + h * HS];
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          const double* kk = &qkv[(b * T + j) * W + g.kcol(h)];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += q[e] * kk[e];
          p[j] = d * sc;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double pdp = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] /= sum;
          const double* v = &qkv[(b * T + j) * W + g.vcol(h)];
          double d = 0.0;
          for (int64_t e = 0; e < HS; ++e) d += go[e] * v[e];
          dp[j] = d;
          pdp += p[j] * d;
          double* dv = &dqkv[(b * T + j) * W + g.vcol(h)];
          for (int64_t e = 0; e < HS; ++e) dv[e] += p[j] * go[e];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - pdp) * sc;
          const double* kk = &qkv[(b * T + j) * W + g.kcol(h)];
          double* dq = &dqkv[(b * T + i) * W + g.qcol(h)];
          double* dk = &dqkv[(b * T + j) * W + g.kcol(h)];
          for (int64_t e = 0; e < HS; ++e) {
            dq[e] += ds * kk[e];
            dk[e] += ds * q[e];
          }
        }
      }
  return dqkv;
}

// Runs the kernel forward + backward (dqkv starts at kFill).
void run_gqa(const fvec& qkv, const fvec& dout, const Gqa& g, fvec& out, fvec& lse, fvec& dqkv) {
  out.assign(g.B * g.T * g.C(), 0.0f);
  lse.assign(g.B * g.NH * g.T, 0.0f);
  dqkv.assign(qkv.size(), kFill);
  fvec sc = nan_scratch(
      k::attention_backward_scratch(g.B, g.T, g.NH, g.NKV, g.HS, omp_get_max_threads()));
  k::attention_forward(out.data(), lse.data(), qkv.data(), g.B, g.T, g.NH, g.NKV, g.HS);
  k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), g.B, g.T,
                        g.NH, g.NKV, g.HS, sc.data());
}

dvec ref_rmsnorm(const dvec& x, const dvec& w, int64_t N, int64_t C, double eps,
                 dvec* rstd = nullptr) {
  dvec out(N * C);
  if (rstd) rstd->resize(N);
  for (int64_t i = 0; i < N; ++i) {
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += x[i * C + c] * x[i * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = x[i * C + c] * r * w[c];
    if (rstd) (*rstd)[i] = r;
  }
  return out;
}

// Rotates (in double) the first n_heads*HS columns of each (b,t) row with the kernel's table.
dvec ref_rope(dvec x, int64_t B, int64_t T, int64_t n_heads, int64_t HS, int64_t stride,
              const fvec& table, bool inverse = false) {
  const int64_t H2 = HS / 2;
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < H2; ++i) {
        const double c = table[t * HS + i], s = (inverse ? -1.0 : 1.0) * table[t * HS + H2 + i];
        double& a = x[bt * stride + h * HS + i];
        double& b = x[bt * stride + h * HS + H2 + i];
        const double x1 = a, x2 = b;
        a = x1 * c - x2 * s;
        b = x2 * c + x1 * s;
      }
  }
  return x;
}

double ref_silu(double x) { return x / (1.0 + std::exp(-x)); }

dvec ref_swiglu(const dvec& gu, int64_t N, int64_t F) {
  dvec out(N * F);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < F; ++j)
      out[i * F + j] = ref_silu(gu[i * 2 * F + j]) * gu[i * 2 * F + F + j];
  return out;
}

// out (N,OC) = inp (N,C) @ w^T, w (OC,C).
dvec ref_dense(const dvec& inp, const dvec& w, int64_t N, int64_t C, int64_t OC) {
  dvec out(N * OC);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += inp[i * C + c] * w[o * C + c];
      out[i * OC + o] = s;
    }
  return out;
}

bool bitwise_equal(const fvec& a, const fvec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class LlamaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { k::init_compute(2); }
};

}  // namespace

// ------------------------------------------------------------------------------------------
// Grouped-query attention
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, GqaAttentionMatchesNaiveReference) {
  // NKV in {NH, NH/2, 1}; T spans several 64-tiles with a ragged tail; head sizes with and
  // without vector tails.
  const Gqa shapes[] = {{2, 150, 4, 4, 32},  {2, 150, 4, 2, 32},  {2, 150, 4, 1, 32},
                        {1, 130, 6, 6, 64},  {1, 130, 6, 3, 64},  {1, 130, 6, 1, 64},
                        {2, 70, 2, 1, 20},   {1, 200, 8, 2, 16}};
  for (const auto& g : shapes) {
    SCOPED_TRACE(::testing::Message() << "B=" << g.B << " T=" << g.T << " NH=" << g.NH
                                      << " NKV=" << g.NKV << " HS=" << g.HS);
    const fvec qkv = randv(g.B * g.T * g.W(), 300 + g.T + g.NKV, -2.0f, 2.0f);
    const fvec dout = randv(g.B * g.T * g.C(), 301 + g.T + g.NKV);
    fvec out, lse, dqkv;
    run_gqa(qkv, dout, g, out, lse, dqkv);
    dvec rlse;
    const dvec rout = ref_gqa(tod(qkv), g, &rlse);
    expect_close(out, rout, 1e-5, 1e-6, "gqa out");
    expect_close(lse, rlse, 1e-5, 1e-6, "gqa lse");
    expect_close(minus_fill(dqkv), ref_gqa_backward(tod(qkv), tod(dout), g), 1e-4, 1e-6,
                 "gqa dqkv");
  }
}

TEST_F(LlamaKernelsTest, GqaAttentionBackwardFiniteDifferences) {
  for (int64_t nkv : {4, 2, 1}) {
    SCOPED_TRACE(::testing::Message() << "NKV=" << nkv);
    const Gqa g{1, 7, 4, nkv, 3};
    const fvec qkv = randv(g.B * g.T * g.W(), 310 + nkv, -1.5f, 1.5f);
    const fvec dout = randv(g.B * g.T * g.C(), 311 + nkv);
    const dvec dq = tod(qkv), ddo = tod(dout);
    const dvec fd = fd_grad([&](const dvec& x) { return dot(ref_gqa(x, g), ddo); }, dq);
    expect_close(ref_gqa_backward(dq, ddo, g), fd, 1e-6, 1e-8, "ref bwd vs fd");
    fvec out, lse, dqkv;
    run_gqa(qkv, dout, g, out, lse, dqkv);
    expect_close(minus_fill(dqkv), fd, 1e-4, 1e-6, "kernel bwd vs fd");
  }
}

TEST_F(LlamaKernelsTest, GqaAttentionEqualsMhaWithRepeatedKvHeads) {
  // GQA on (NH, NKV) == MHA on (NH, NH) with each kv head repeated over its group: forward and
  // dq bitwise (same arithmetic per query head), dk / dv = the group sum of the MHA ones.
  const Gqa g{2, 150, 6, 2, 32};
  const Gqa m{g.B, g.T, g.NH, g.NH, g.HS};
  const int64_t G = g.NH / g.NKV;
  const fvec qkv = randv(g.B * g.T * g.W(), 320, -2.0f, 2.0f), dout = randv(g.B * g.T * g.C(), 321);
  fvec qkv_m(g.B * g.T * m.W());
  for (int64_t bt = 0; bt < g.B * g.T; ++bt)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t e = 0; e < g.HS; ++e) {
        qkv_m[bt * m.W() + m.qcol(h) + e] = qkv[bt * g.W() + g.qcol(h) + e];
        qkv_m[bt * m.W() + m.kcol(h) + e] = qkv[bt * g.W() + g.kcol(h) + e];
        qkv_m[bt * m.W() + m.vcol(h) + e] = qkv[bt * g.W() + g.vcol(h) + e];
      }
  fvec out, lse, d, out_m, lse_m, d_m;
  run_gqa(qkv, dout, g, out, lse, d);
  run_gqa(qkv_m, dout, m, out_m, lse_m, d_m);
  EXPECT_TRUE(bitwise_equal(out, out_m));
  EXPECT_TRUE(bitwise_equal(lse, lse_m));
  fvec dq(g.B * g.T * g.C()), dq_m(dq.size());
  dvec dkv(g.B * g.T * 2 * g.NKV * g.HS), dkv_m(dkv.size(), 0.0);
  for (int64_t bt = 0; bt < g.B * g.T; ++bt) {
    for (int64_t c = 0; c < g.C(); ++c) {
      dq[bt * g.C() + c] = d[bt * g.W() + c];
      dq_m[bt * g.C() + c] = d_m[bt * m.W() + c];
    }
    for (int64_t c = 0; c < 2 * g.NKV * g.HS; ++c)
      dkv[bt * 2 * g.NKV * g.HS + c] = d[bt * g.W() + g.C() + c] - kFill;
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t e = 0; e < g.HS; ++e) {
        const int64_t kh = h / G;
        dkv_m[bt * 2 * g.NKV * g.HS + kh * g.HS + e] +=
            d_m[bt * m.W() + m.kcol(h) + e] - double(kFill);
        dkv_m[bt * 2 * g.NKV * g.HS + (g.NKV + kh) * g.HS + e] +=
            d_m[bt * m.W() + m.vcol(h) + e] - double(kFill);
      }
  }
  EXPECT_TRUE(bitwise_equal(dq, dq_m));
  expect_close(dkv, dkv_m, 1e-5, 1e-6, "dk/dv = group sum");
}

TEST_F(LlamaKernelsTest, AttentionNkvEqualsNhBitwiseEqualsMultiHeadWrapper) {
  // The 7/10-argument multi-head forms (used by the GPT-2 layers) and NKV = NH give
  // bitwise-identical results.
  const int64_t B = 2, T = 150, NH = 3, HS = 48, C = NH * HS;
  const fvec qkv = randv(B * T * 3 * C, 330, -2.0f, 2.0f), dout = randv(B * T * C, 331);
  EXPECT_EQ(k::attention_backward_scratch(B, T, NH, HS, 2),
            k::attention_backward_scratch(B, T, NH, NH, HS, 2));
  fvec o1(B * T * C), l1(B * NH * T), d1(qkv.size(), kFill);
  fvec o2(B * T * C), l2(B * NH * T), d2(qkv.size(), kFill);
  fvec sc = nan_scratch(k::attention_backward_scratch(B, T, NH, HS, omp_get_max_threads()));
  k::attention_forward(o1.data(), l1.data(), qkv.data(), B, T, NH, HS);
  k::attention_backward(d1.data(), dout.data(), qkv.data(), o1.data(), l1.data(), B, T, NH, HS,
                        sc.data());
  k::attention_forward(o2.data(), l2.data(), qkv.data(), B, T, NH, NH, HS);
  k::attention_backward(d2.data(), dout.data(), qkv.data(), o2.data(), l2.data(), B, T, NH, NH,
                        HS, sc.data());
  EXPECT_TRUE(bitwise_equal(o1, o2));
  EXPECT_TRUE(bitwise_equal(l1, l2));
  EXPECT_TRUE(bitwise_equal(d1, d2));
}

TEST_F(LlamaKernelsTest, GqaAttentionRejectsBadKvHeadCount) {
  const int64_t B = 1, T = 4, NH = 6, HS = 8;
  fvec qkv(B * T * (NH + 2 * NH) * HS, 0.1f), out(B * T * NH * HS), lse(B * NH * T),
      dqkv(qkv.size()), sc(k::attention_backward_scratch(B, T, NH, NH, HS, omp_get_max_threads()));
  for (int64_t nkv : {0, 4, -2, 12}) {
    EXPECT_THROW(k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, nkv, HS),
                 std::invalid_argument)
        << nkv;
    EXPECT_THROW(k::attention_backward(dqkv.data(), out.data(), qkv.data(), out.data(),
                                       lse.data(), B, T, NH, nkv, HS, sc.data()),
                 std::invalid_argument)
        << nkv;
  }
}

// ------------------------------------------------------------------------------------------
// RMSNorm
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, RmsNormForwardBackward) {
  const int64_t N = 5, C = 100;  // C spans a full and a partial column block
  const float eps = 1e-6f;
  const fvec inp = randv(N * C, 340, -2.0f, 3.0f), w = randv(C, 341, 0.5f, 1.5f),
             dout = randv(N * C, 342);
  const dvec din = tod(inp), dw = tod(w), ddo = tod(dout);
  fvec out(N * C), rstd(N);
  k::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  dvec rr;
  const dvec rout = ref_rmsnorm(din, dw, N, C, eps, &rr);
  expect_close(out, rout, 1e-6, 1e-7, "rms out");
  expect_close(rstd, rr, 1e-6, 1e-7, "rms rstd");
  fvec out2(N * C);
  k::rmsnorm_forward(out2.data(), nullptr, inp.data(), w.data(), N, C, eps);  // rstd optional
  EXPECT_TRUE(bitwise_equal(out, out2));

  fvec gi(N * C, kFill), gw(C, kFill);
  k::rmsnorm_backward(gi.data(), gw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  auto L_in = [&](const dvec& x) { return dot(ref_rmsnorm(x, dw, N, C, eps), ddo); };
  auto L_w = [&](const dvec& x) { return dot(ref_rmsnorm(din, x, N, C, eps), ddo); };
  expect_close(minus_fill(gi), fd_grad(L_in, din), 1e-5, 1e-6, "rms dinp");
  expect_close(minus_fill(gw), fd_grad(L_w, dw), 1e-5, 1e-6, "rms dweight");

  // dweight null: dinp identical; dinp null: dweight identical.
  fvec gi2(N * C, kFill), gw2(C, kFill);
  k::rmsnorm_backward(gi2.data(), nullptr, dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  k::rmsnorm_backward(nullptr, gw2.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  EXPECT_TRUE(bitwise_equal(gi, gi2));
  EXPECT_TRUE(bitwise_equal(gw, gw2));
}

TEST_F(LlamaKernelsTest, RmsNormLargeRowsAndZeroRow) {
  // Rows large enough for the parallel path; an all-zero row gives rstd = 1/sqrt(eps), out 0.
  const int64_t N = 300, C = 384;
  const float eps = 1e-5f;
  fvec inp = randv(N * C, 343, -4.0f, 4.0f);
  for (int64_t c = 0; c < C; ++c) inp[7 * C + c] = 0.0f;
  const fvec w = randv(C, 344, -1.0f, 1.0f);
  fvec out(N * C), rstd(N);
  k::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  dvec rr;
  expect_close(out, ref_rmsnorm(tod(inp), tod(w), N, C, eps, &rr), 1e-6, 1e-7, "rms out");
  expect_close(rstd, rr, 1e-6, 1e-7, "rms rstd");
  EXPECT_FLOAT_EQ(rstd[7], 1.0f / std::sqrt(eps));
  for (int64_t c = 0; c < C; ++c) ASSERT_EQ(out[7 * C + c], 0.0f);
}

// ------------------------------------------------------------------------------------------
// Rotary position embedding
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, RopeTableFollowsHfFp32Recipe) {
  EXPECT_EQ(k::rope_table_floats(10, 64), 640);
  for (float theta : {10000.0f, 500000.0f}) {
    const int64_t T = 4096, HS = 64, H2 = HS / 2;
    fvec tab = nan_scratch(k::rope_table_floats(T, HS));
    k::rope_table(tab.data(), T, HS, {theta});
    double worst_recipe = 0.0, worst_exact = 0.0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < H2; ++i) {
        // HF in fp32: inv_freq = 1 / theta ** (arange(0, HS, 2).float() / HS); freqs = t * inv.
        const float e = static_cast<float>(2 * i) / static_cast<float>(HS);
        const float inv = 1.0f / static_cast<float>(std::pow(double(theta), double(e)));
        const float ang = static_cast<float>(t) * inv;
        const double c = tab[t * HS + i], s = tab[t * HS + H2 + i];
        worst_recipe = std::max({worst_recipe, std::fabs(c - std::cos(double(ang))),
                                 std::fabs(s - std::sin(double(ang)))});
        // Against the exact angle, the fp32 rounding of inv_freq and of the product bound
        // the error by about t * inv * 2^-23 (plus the rounding of cos / sin).
        const double exact = t * std::pow(double(theta), -2.0 * i / HS);
        const double bound = 1.5 * exact * 0x1p-23 + 1e-7;
        const double err = std::max(std::fabs(c - std::cos(exact)), std::fabs(s - std::sin(exact)));
        ASSERT_LE(err, bound) << "t=" << t << " i=" << i;
        worst_exact = std::max(worst_exact, err);
      }
    EXPECT_LE(worst_recipe, 6e-8) << "cos/sin of the fp32 angle, correctly rounded";
    EXPECT_GT(worst_exact, 1e-5) << "fp32 angles (as HF), not exact ones";
    for (int64_t i = 0; i < H2; ++i) {
      EXPECT_EQ(tab[i], 1.0f);
      EXPECT_EQ(tab[H2 + i], 0.0f);
    }
  }
  fvec tab(12);
  EXPECT_THROW(k::rope_table(tab.data(), 2, 5, {10000.0}), std::invalid_argument);
}

// Llama 3.1's rescaling (Llama 3.1 8B's settings) against the formula in double: short
// wavelengths keep their frequency, long ones are divided by the factor, and the band between
// moves smoothly from one to the other.
TEST_F(LlamaKernelsTest, RopeTableRescalesAsLlama31) {
  const int64_t T = 64, HS = 128, H2 = HS / 2;
  const k::Rope plain{500000.0}, scaled{500000.0, 8, 1, 4, 8192};
  fvec a(k::rope_table_floats(T, HS)), b(k::rope_table_floats(T, HS));
  k::rope_table(a.data(), T, HS, plain);
  k::rope_table(b.data(), T, HS, scaled);
  int kept = 0, divided = 0, smoothed = 0;
  for (int64_t i = 0; i < H2; ++i) {
    const double inv = std::pow(500000.0, -2.0 * i / HS), wavelen = 2 * M_PI / inv;
    double want = inv;
    if (wavelen > 8192) want = inv / 8, ++divided;
    else if (wavelen < 8192 / 4.0) ++kept;
    else {
      const double s = (8192 / wavelen - 1) / (4 - 1);
      want = (1 - s) * inv / 8 + s * inv, ++smoothed;
      EXPECT_GT(s, 0.0);
      EXPECT_LT(s, 1.0);
    }
    EXPECT_NEAR(k::rope_inv_freq(i, HS, scaled), want, 4e-7 * want) << "i=" << i;
    const int64_t t = T - 1;  // the angle is t * inv_freq: its sine tells the frequency
    const double angle = std::atan2(b[t * HS + H2 + i], b[t * HS + i]);
    EXPECT_NEAR(std::remainder(angle - t * want, 2 * M_PI), 0.0, 1e-5) << "i=" << i;
    if (wavelen < 8192 / 4.0) {
      EXPECT_EQ(b[t * HS + i], a[t * HS + i]) << "i=" << i;
    }
  }
  EXPECT_EQ(kept, 29);
  EXPECT_EQ(smoothed, 6);
  EXPECT_EQ(divided, 29);
}

TEST_F(LlamaKernelsTest, RopeForwardMatchesReferenceAndLeavesOtherColumns) {
  // Packed GQA qkv: rotate q and k (NH + NKV heads) in one call, v untouched.
  const int64_t B = 2, T = 70, NH = 3, NKV = 1, HS = 16, W = (NH + 2 * NKV) * HS;
  fvec tab(k::rope_table_floats(T, HS));
  k::rope_table(tab.data(), T, HS, {10000.0});
  const fvec x0 = randv(B * T * W, 350, -2.0f, 2.0f);
  fvec x = x0;
  k::rope_forward(x.data(), B, T, NH + NKV, HS, W, tab.data());
  const dvec ref = ref_rope(tod(x0), B, T, NH + NKV, HS, W, tab);
  expect_close(x, ref, 1e-6, 1e-7, "rope fwd");
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t c = (NH + NKV) * HS; c < W; ++c) ASSERT_EQ(x[bt * W + c], x0[bt * W + c]);
  // Position 0 is the identity.
  for (int64_t c = 0; c < W; ++c) ASSERT_EQ(x[c], x0[c]);
  // Large enough for the parallel path: same as the reference too.
  const int64_t B2 = 4, T2 = 256, nh2 = 8, HS2 = 64, W2 = 10 * HS2;
  fvec tab2(k::rope_table_floats(T2, HS2));
  k::rope_table(tab2.data(), T2, HS2, {10000.0});
  const fvec y0 = randv(B2 * T2 * W2, 351);
  fvec y = y0;
  k::rope_forward(y.data(), B2, T2, nh2, HS2, W2, tab2.data());
  expect_close(y, ref_rope(tod(y0), B2, T2, nh2, HS2, W2, tab2), 1e-6, 1e-7, "rope fwd large");
}

TEST_F(LlamaKernelsTest, RopePreservesNormsAndDependsOnlyOnRelativePosition) {
  const int64_t T = 300, HS = 64;
  fvec tab(k::rope_table_floats(T, HS));
  k::rope_table(tab.data(), T, HS, {10000.0});
  // The same q (head 0) and k (head 1) vector at every position.
  const fvec q = randv(HS, 360), kv = randv(HS, 361);
  fvec x(T * 2 * HS);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < HS; ++e) {
      x[t * 2 * HS + e] = q[e];
      x[t * 2 * HS + HS + e] = kv[e];
    }
  k::rope_forward(x.data(), 1, T, 2, HS, 2 * HS, tab.data());
  double nq = 0.0, nk = 0.0;
  for (int64_t e = 0; e < HS; ++e) {
    nq += double(q[e]) * q[e];
    nk += double(kv[e]) * kv[e];
  }
  for (int64_t t = 0; t < T; ++t) {
    double n = 0.0;
    for (int64_t e = 0; e < HS; ++e) n += double(x[t * 2 * HS + e]) * x[t * 2 * HS + e];
    ASSERT_NEAR(n, nq, 1e-5 * nq) << "t=" << t;
  }
  auto qk = [&](int64_t m, int64_t n) {
    double s = 0.0;
    for (int64_t e = 0; e < HS; ++e) s += double(x[m * 2 * HS + e]) * x[n * 2 * HS + HS + e];
    return s;
  };
  // q at m, k at n: depends only on m - n, up to the fp32 rounding of the angles
  // (~t * 2^-23 rad each).
  for (int64_t d : {0, 1, 5, 37, -3}) {
    const double base = qk(std::max<int64_t>(d, 0) + 2, std::max<int64_t>(-d, 0) + 2);
    for (int64_t m0 : {10, 100, 250}) {
      const int64_t m = m0 + std::max<int64_t>(d, 0), n = m0 + std::max<int64_t>(-d, 0);
      const double tol = std::sqrt(nq * nk) * double(m + n + 4) * 0x1p-22;
      EXPECT_NEAR(qk(m, n), base, tol) << "d=" << d << " m=" << m;
    }
  }
}

TEST_F(LlamaKernelsTest, RopeBackwardIsInverseAndGradient) {
  const int64_t B = 2, T = 9, nh = 3, HS = 8, W = nh * HS + 5;  // padding columns in each row
  fvec tab(k::rope_table_floats(T, HS));
  k::rope_table(tab.data(), T, HS, {10000.0});
  const fvec x0 = randv(B * T * W, 370, -2.0f, 2.0f);
  fvec x = x0;
  k::rope_forward(x.data(), B, T, nh, HS, W, tab.data());
  k::rope_backward(x.data(), B, T, nh, HS, W, tab.data());
  expect_close(x, x0, 1e-6, 1e-7, "backward o forward");
  // Gradient: for L = <rope(x), dy>, dL/dx = rope_backward(dy).
  const fvec dy = randv(B * T * W, 371);
  fvec g = dy;
  k::rope_backward(g.data(), B, T, nh, HS, W, tab.data());
  const dvec ddy = tod(dy);
  const dvec fd = fd_grad(
      [&](const dvec& xx) { return dot(ref_rope(xx, B, T, nh, HS, W, tab), ddy); }, tod(x0));
  // Padding columns pass through both (identity forward, dx left as dy).
  expect_close(g, fd, 1e-5, 1e-7, "rope dx vs fd");
  // And forward o backward = identity as well.
  fvec y = x0;
  k::rope_backward(y.data(), B, T, nh, HS, W, tab.data());
  k::rope_forward(y.data(), B, T, nh, HS, W, tab.data());
  expect_close(y, x0, 1e-6, 1e-7, "forward o backward");
}

// ------------------------------------------------------------------------------------------
// SwiGLU
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, SwigluForwardBackward) {
  const int64_t N = 3, F = 37;  // F not a multiple of the vector width
  fvec gu = randv(N * 2 * F, 380, -6.0f, 6.0f);
  const float special[] = {-100.0f, -30.0f, -12.0f, 0.0f, 12.0f, 30.0f, 100.0f, -88.5f, 89.0f};
  for (size_t i = 0; i < std::size(special); ++i) gu[i] = special[i];  // gate entries of row 0
  const dvec dgu = tod(gu);
  fvec out(N * F);
  k::swiglu_forward(out.data(), gu.data(), N, F);
  const dvec rout = ref_swiglu(dgu, N, F);
  expect_close(out, rout, 1e-6, 1e-7, "swiglu fwd");
  // Elementwise relative accuracy (exp_fast is ~1 ulp).
  for (int64_t i = 0; i < N * F; ++i)
    ASSERT_NEAR(out[i], rout[i], 2e-6 * std::fabs(rout[i]) + 1e-30) << i;

  const fvec dout = randv(N * F, 381);
  fvec g(N * 2 * F, kFill);
  k::swiglu_backward(g.data(), dout.data(), gu.data(), N, F);
  const dvec fd = fd_grad([&](const dvec& x) { return dot(ref_swiglu(x, N, F), tod(dout)); }, dgu);
  expect_close(minus_fill(g), fd, 1e-5, 1e-6, "swiglu dgate_up");
}

TEST_F(LlamaKernelsTest, SwigluLargeMatchesReference) {
  // Parallel path; PyTorch-reference tolerance is 1e-4 of the max, we are far inside it.
  const int64_t N = 64, F = 1024;
  const fvec gu = randv(N * 2 * F, 382, -8.0f, 8.0f), dout = randv(N * F, 383);
  const dvec dgu = tod(gu);
  fvec out(N * F), g(N * 2 * F, kFill);
  k::swiglu_forward(out.data(), gu.data(), N, F);
  k::swiglu_backward(g.data(), dout.data(), gu.data(), N, F);
  expect_close(out, ref_swiglu(dgu, N, F), 1e-6, 1e-7, "swiglu fwd");
  dvec rg(N * 2 * F);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < F; ++j) {
      const double x = dgu[i * 2 * F + j], u = dgu[i * 2 * F + F + j], dy = dout[i * F + j];
      const double s = 1.0 / (1.0 + std::exp(-x));
      rg[i * 2 * F + j] = dy * u * s * (1.0 + x * (1.0 - s));
      rg[i * 2 * F + F + j] = dy * x * s;
    }
  expect_close(minus_fill(g), rg, 1e-6, 1e-7, "swiglu bwd");
}

// ------------------------------------------------------------------------------------------
// Dense (nn.Linear layout)
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, DenseForwardBackward) {
  const int64_t N = 5, C = 7, OC = 9;
  const fvec inp = randv(N * C, 390), w = randv(OC * C, 391), dout = randv(N * OC, 392);
  const dvec di = tod(inp), dw = tod(w), ddo = tod(dout);
  fvec out(N * OC, 123.0f);  // overwritten
  k::dense_forward(out.data(), inp.data(), w.data(), N, C, OC);
  expect_close(out, ref_dense(di, dw, N, C, OC), 1e-5, 1e-6, "dense fwd");

  fvec gi(N * C, kFill), gw(OC * C, kFill);
  k::dense_backward(gi.data(), gw.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  auto L_in = [&](const dvec& x) { return dot(ref_dense(x, dw, N, C, OC), ddo); };
  auto L_w = [&](const dvec& x) { return dot(ref_dense(di, x, N, C, OC), ddo); };
  expect_close(minus_fill(gi), fd_grad(L_in, di), 1e-5, 1e-6, "dense dinp");
  expect_close(minus_fill(gw), fd_grad(L_w, dw), 1e-5, 1e-6, "dense dweight");

  fvec gi2(N * C, kFill), gw2(OC * C, kFill);
  k::dense_backward(gi2.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
  k::dense_backward(nullptr, gw2.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  EXPECT_TRUE(bitwise_equal(gi, gi2));
  EXPECT_TRUE(bitwise_equal(gw, gw2));
}

// ------------------------------------------------------------------------------------------
// Determinism
// ------------------------------------------------------------------------------------------

TEST_F(LlamaKernelsTest, DeterministicRunToRunAndAcrossThreadCounts) {
  // LLaMA-small-like shapes (reduced T for test time).
  const Gqa g{2, 200, 6, 2, 64};
  const int64_t N = g.B * g.T, C = 384, F = 256;
  const fvec qkv = randv(g.B * g.T * g.W(), 400, -2.0f, 2.0f), dattn = randv(N * g.C(), 401);
  const fvec x = randv(N * C, 402), w = randv(C, 403), dy = randv(N * C, 404),
             gu = randv(N * 2 * F, 405, -5.0f, 5.0f), dsw = randv(N * F, 406),
             wd = randv(F * C, 407);
  fvec tab(k::rope_table_floats(g.T, g.HS));
  auto run_all = [&]() {
    std::vector<fvec> r;
    fvec out, lse, d;
    run_gqa(qkv, dattn, g, out, lse, d);
    r.push_back(out);
    r.push_back(lse);
    r.push_back(d);
    fvec o(N * C), rs(N), gi(N * C, kFill), gw(C, kFill);
    k::rmsnorm_forward(o.data(), rs.data(), x.data(), w.data(), N, C, 1e-5f);
    k::rmsnorm_backward(gi.data(), gw.data(), dy.data(), x.data(), w.data(), rs.data(), N, C);
    r.push_back(o);
    r.push_back(rs);
    r.push_back(gi);
    r.push_back(gw);
    k::rope_table(tab.data(), g.T, g.HS, {10000.0});
    r.push_back(tab);
    fvec q = qkv;
    k::rope_forward(q.data(), g.B, g.T, g.NH + g.NKV, g.HS, g.W(), tab.data());
    r.push_back(q);
    k::rope_backward(q.data(), g.B, g.T, g.NH + g.NKV, g.HS, g.W(), tab.data());
    r.push_back(q);
    fvec so(N * F), sg(N * 2 * F, kFill);
    k::swiglu_forward(so.data(), gu.data(), N, F);
    k::swiglu_backward(sg.data(), dsw.data(), gu.data(), N, F);
    r.push_back(so);
    r.push_back(sg);
    fvec dof(N * C), dgi(N * F, kFill), dgw(C * F, kFill);
    k::dense_forward(dof.data(), so.data(), wd.data(), N, F, C);
    k::dense_backward(dgi.data(), dgw.data(), dy.data(), so.data(), wd.data(), N, F, C);
    r.push_back(dof);
    r.push_back(dgi);
    r.push_back(dgw);
    return r;
  };
  const std::vector<fvec> r1 = run_all(), r2 = run_all();
  ASSERT_EQ(r1.size(), r2.size());
  for (size_t i = 0; i < r1.size(); ++i) EXPECT_TRUE(bitwise_equal(r1[i], r2[i])) << "output " << i;
  // All but the oneDNN GEMMs (the last three outputs) are independent of the thread count.
  omp_set_num_threads(1);
  const std::vector<fvec> r3 = run_all();
  omp_set_num_threads(2);
  for (size_t i = 0; i + 3 < r1.size(); ++i)
    EXPECT_TRUE(bitwise_equal(r1[i], r3[i])) << "output " << i << " with 1 thread";
}
