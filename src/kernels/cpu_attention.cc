// Causal multi-head self-attention in tiles with an online softmax (flash-attention style).
//
// Tiles are computed "key-major": for a query tile Q (nq,HS) and a key tile K (nk,HS) we form
// S^T = K (scale Q)^T (nk, nq) so that every per-query quantity (running max, sum, lse, D)
// is a vector along the fast axis, and no K / V / P / dS tile ever needs transposing; only
// the query tile (and dout in backward) is transposed, once per block call, and reused for
// every key tile of the block.
#include <omp.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cpu.h"
#include "kernels/cpu_internal.h"

namespace shardlm::kernels {

namespace {

constexpr int64_t kT = kAttnTile;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

inline int64_t round_up16(int64_t x) { return (x + 15) / 16 * 16; }

// dst (HS, ldd) = transpose(src (n, HS) rows at stride lds) * mul; columns n..ldd-1 zeroed.
void transpose_tile(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t n,
                    int64_t HS, float mul) {
  for (int64_t d = 0; d < HS; ++d) {
    float* o = dst + d * ldd;
    for (int64_t i = 0; i < n; ++i) o[i] = src[i * lds + d] * mul;
    for (int64_t i = n; i < ldd; ++i) o[i] = 0.0f;
  }
}

// Number of keys of the block [k_pos0, k_pos0+nk) that any query of [q_pos0, q_pos0+nq) can see.
inline int64_t visible_keys(int64_t nk, int64_t k_pos0, int64_t nq, int64_t q_pos0,
                            bool causal) {
  if (!causal) return nk;
  const int64_t lim = q_pos0 + nq - k_pos0;  // keys with position <= last query position
  return lim < 0 ? 0 : (lim < nk ? lim : nk);
}

}  // namespace

int64_t attention_block_forward_scratch(int64_t HS) {
  return kT * HS + kT * kT + 4 * kT;
}

void attention_state_init(float* m, float* l, float* acc, int64_t nq, int64_t HS) {
  for (int64_t i = 0; i < nq; ++i) {
    m[i] = kNegInf;
    l[i] = 0.0f;
  }
  for (int64_t i = 0; i < nq * HS; ++i) acc[i] = 0.0f;
}

void attention_block_forward(const float* q, int64_t ldq, int64_t nq, int64_t q_pos0,
                             const float* k, int64_t ldk, const float* v, int64_t ldv,
                             int64_t nk, int64_t k_pos0, int64_t HS, float scale, bool causal,
                             float* m, float* l, float* acc, float* scratch) {
  if (nq > kT) throw std::invalid_argument("attention_block_forward: nq > kAttnTile");
  nk = visible_keys(nk, k_pos0, nq, q_pos0, causal);
  if (nq <= 0 || nk <= 0) return;
  const int64_t nqp = round_up16(nq);
  const int nqi = static_cast<int>(nq);
  float* qt = scratch;          // (HS, nqp) = scale * Q^T
  float* st = qt + kT * HS;     // (kT, kT): S^T, then P^T, of one key tile
  float* mt = st + kT * kT;     // (kT) tile column max
  float* mref = mt + kT;        // (kT) new max used as exp reference (0 when -inf)
  float* alpha = mref + kT;     // (kT) rescale of the old state
  float* lsum = alpha + kT;     // (kT) tile sums
  transpose_tile(qt, nqp, q, ldq, nq, HS, scale);

  for (int64_t j0 = 0; j0 < nk; j0 += kT) {
    const int64_t nkt = (nk - j0) < kT ? (nk - j0) : kT;
    const int64_t kp0 = k_pos0 + j0;
    // S^T (nkt, nqp) = K_tile (nkt, HS) @ Qt (HS, nqp)
    detail::small_gemm<false>(nkt, nqp, HS, k + j0 * ldk, ldk, 1, qt, nqp, st, kT);

    for (int i = 0; i < nqi; ++i) mt[i] = kNegInf;
    const bool mask = causal && (kp0 + nkt - 1 > q_pos0);
    for (int64_t j = 0; j < nkt; ++j) {
      float* s = st + j * kT;
      if (mask) {
        const int thr = static_cast<int>(kp0 + j - q_pos0);  // visible iff i >= thr
#pragma omp simd
        for (int i = 0; i < nqi; ++i) {
          const float x = i >= thr ? s[i] : kNegInf;
          s[i] = x;
          mt[i] = mt[i] > x ? mt[i] : x;
        }
      } else {
#pragma omp simd
        for (int i = 0; i < nqi; ++i) mt[i] = mt[i] > s[i] ? mt[i] : s[i];
      }
    }
#pragma omp simd
    for (int i = 0; i < nqi; ++i) {
      const float mn = m[i] > mt[i] ? m[i] : mt[i];
      const float r = mn == kNegInf ? 0.0f : mn;
      mref[i] = r;
      alpha[i] = detail::exp_fast(m[i] - r);
      m[i] = mn;
      lsum[i] = 0.0f;
    }
    for (int64_t j = 0; j < nkt; ++j) {
      float* s = st + j * kT;
#pragma omp simd
      for (int i = 0; i < nqi; ++i) {
        const float p = detail::exp_fast(s[i] - mref[i]);
        s[i] = p;
        lsum[i] += p;
      }
    }
    for (int i = 0; i < nqi; ++i) {
      l[i] = l[i] * alpha[i] + lsum[i];
      const float a = alpha[i];
      float* ar = acc + i * HS;
#pragma omp simd
      for (int64_t d = 0; d < HS; ++d) ar[d] *= a;
    }
    // acc (nq, HS) += P (nq, nkt) @ V_tile (nkt, HS), P(i,j) = st[j*kT + i]
    detail::small_gemm<true>(nq, HS, nkt, st, 1, kT, v + j0 * ldv, ldv, acc, HS);
  }
}

void attention_state_merge(float* m, float* l, float* acc, const float* m2, const float* l2,
                           const float* acc2, int64_t nq, int64_t HS) {
  for (int64_t i = 0; i < nq; ++i) {
    const float mn = m[i] > m2[i] ? m[i] : m2[i];
    if (mn == kNegInf) continue;  // both empty
    const float a1 = std::exp(m[i] - mn), a2 = std::exp(m2[i] - mn);
    l[i] = l[i] * a1 + l2[i] * a2;
    for (int64_t d = 0; d < HS; ++d) acc[i * HS + d] = acc[i * HS + d] * a1 + acc2[i * HS + d] * a2;
    m[i] = mn;
  }
}

void attention_state_finalize(float* out, int64_t ldo, float* lse, const float* m,
                              const float* l, const float* acc, int64_t nq, int64_t HS) {
  for (int64_t i = 0; i < nq; ++i) {
    const bool empty = !(l[i] > 0.0f);
    const float inv = empty ? 0.0f : 1.0f / l[i];
    float* o = out + i * ldo;
    const float* a = acc + i * HS;
#pragma omp simd
    for (int64_t d = 0; d < HS; ++d) o[d] = a[d] * inv;
    if (lse) lse[i] = empty ? kNegInf : m[i] + std::log(l[i]);
  }
}

namespace {
// Checks the head counts of the packed-qkv kernels; returns the group size NH / NKV.
int64_t gqa_group(int64_t NH, int64_t NKV, const char* who) {
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0)
    throw std::invalid_argument(std::string(who) + ": NKV must be positive and divide NH");
  return NH / NKV;
}
}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t NH, int64_t NKV, int64_t HS, bool causal) {
  if (HS > kAttnMaxHS) throw std::invalid_argument("attention_forward: HS > kAttnMaxHS");
  const int64_t G = gqa_group(NH, NKV, "attention_forward");
  const int64_t C = NH * HS;               // q columns = out row width
  const int64_t W = (NH + 2 * NKV) * HS;   // qkv row width
  const int64_t CK = NKV * HS;             // k (and v) columns
  const int64_t nqb = (T + kT - 1) / kT;
  const int64_t nbh = B * NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  // Work units (b, h, query tile), largest (latest) tiles first. Each unit is computed by one
  // thread in a fixed order and writes disjoint outputs, so the result does not depend on
  // which thread runs it: dynamic scheduling (for the triangular load) stays deterministic.
  // Query heads of one group read the same k / v columns; the arithmetic of a unit does not
  // depend on NKV (with NKV == NH it is exactly the multi-head kernel).
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < nqb * nbh; ++u) {
    const int64_t qb = nqb - 1 - u / nbh;
    const int64_t bh = u % nbh, b = bh / NH, h = bh % NH;
    const int64_t q0 = qb * kT;
    const int64_t nq = (T - q0) < kT ? (T - q0) : kT;
    alignas(64) float scratch[kT * kAttnMaxHS + kT * kT + 4 * kT];
    alignas(64) float acc[kT * kAttnMaxHS];
    float m[kT], l[kT];
    const float* row = qkv + b * T * W;
    const float* qh = row + h * HS;
    const float* kh = row + C + (h / G) * HS;
    const float* vh = kh + CK;
    attention_state_init(m, l, acc, nq, HS);
    const int64_t keys = causal ? q0 + nq : T;  // those any query of the tile sees
    attention_block_forward(qh + q0 * W, W, nq, q0, kh, W, vh, W, keys, 0, HS, scale, causal,
                            m, l, acc, scratch);
    attention_state_finalize(out + (b * T + q0) * C + h * HS, C, lse + bh * T + q0, m, l, acc,
                             nq, HS);
  }
}

int64_t attention_block_backward_scratch(int64_t HS) { return 2 * kT * HS + 2 * kT * kT + kT; }

void attention_backward_rowdot(float* Drow, const float* dout, int64_t lddo, const float* out,
                               int64_t ldo, int64_t nq, int64_t HS) {
  for (int64_t i = 0; i < nq; ++i) {
    const float* a = dout + i * lddo;
    const float* o = out + i * ldo;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < HS; ++d) s += a[d] * o[d];
    Drow[i] = s;
  }
}

void attention_block_backward(const float* q, int64_t ldq, const float* dout, int64_t lddo,
                              const float* lse, const float* Drow, int64_t nq, int64_t q_pos0,
                              const float* k, int64_t ldk, const float* v, int64_t ldv,
                              int64_t nk, int64_t k_pos0, int64_t HS, float scale, bool causal,
                              float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                              int64_t lddv, float* scratch) {
  if (nq > kT) throw std::invalid_argument("attention_block_backward: nq > kAttnTile");
  nk = visible_keys(nk, k_pos0, nq, q_pos0, causal);
  if (nq <= 0 || nk <= 0) return;
  const int64_t nqp = round_up16(nq);
  const int nqi = static_cast<int>(nq);
  float* qt = scratch;          // (HS, nqp) = scale * Q^T
  float* dot = qt + kT * HS;    // (HS, nqp) = dout^T
  float* pt = dot + kT * HS;    // (kT, kT) P^T of one key tile
  float* dst = pt + kT * kT;    // (kT, kT) dP^T, then dS^T
  float* lsev = dst + kT * kT;  // (kT) lse with -inf (row saw nothing) mapped to +inf => P = 0
  transpose_tile(qt, nqp, q, ldq, nq, HS, scale);
  transpose_tile(dot, nqp, dout, lddo, nq, HS, 1.0f);
  for (int i = 0; i < nqi; ++i) lsev[i] = lse[i] == kNegInf ? kPosInf : lse[i];

  for (int64_t j0 = 0; j0 < nk; j0 += kT) {
    const int64_t nkt = (nk - j0) < kT ? (nk - j0) : kT;
    const int64_t kp0 = k_pos0 + j0;
    const float* kt = k + j0 * ldk;
    const float* vt = v + j0 * ldv;
    // S^T (nkt, nqp) = K_tile @ (scale Q)^T, then P^T = exp(S^T - lse) (masked)
    detail::small_gemm<false>(nkt, nqp, HS, kt, ldk, 1, qt, nqp, pt, kT);
    const bool mask = causal && (kp0 + nkt - 1 > q_pos0);
    for (int64_t j = 0; j < nkt; ++j) {
      float* s = pt + j * kT;
      const int thr = mask ? static_cast<int>(kp0 + j - q_pos0) : 0;
#pragma omp simd
      for (int i = 0; i < nqi; ++i) {
        const float p = detail::exp_fast(s[i] - lsev[i]);
        s[i] = i >= thr ? p : 0.0f;
      }
    }
    // dV_tile (nkt, HS) += P^T (nkt, nq) @ dout (nq, HS)
    detail::small_gemm<true>(nkt, HS, nq, pt, kT, 1, dout, lddo, dv + j0 * lddv, lddv);
    // dP^T (nkt, nqp) = V_tile (nkt, HS) @ dout^T (HS, nqp)
    detail::small_gemm<false>(nkt, nqp, HS, vt, ldv, 1, dot, nqp, dst, kT);
    // dS^T = P^T * (dP^T - D) * scale   (the scale of the scores, folded in here)
    for (int64_t j = 0; j < nkt; ++j) {
      const float* p = pt + j * kT;
      float* g = dst + j * kT;
#pragma omp simd
      for (int i = 0; i < nqi; ++i) g[i] = p[i] * (g[i] - Drow[i]) * scale;
    }
    // dQ (nq, HS) += dS (nq, nkt) @ K_tile (nkt, HS), dS(i,j) = dst[j*kT + i]
    detail::small_gemm<true>(nq, HS, nkt, dst, 1, kT, kt, ldk, dq, lddq);
    // dK_tile (nkt, HS) += dS^T (nkt, nq) @ Q (nq, HS)
    detail::small_gemm<true>(nkt, HS, nq, dst, kT, 1, q, ldq, dk + j0 * lddk, lddk);
  }
}

int64_t attention_backward_scratch(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                   int threads) {
  if (threads < 1) threads = 1;
  const int64_t per = attention_block_backward_scratch(HS) + kT;  // + Drow
  return per * threads;
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t HS, float* scratch, bool causal) {
  gqa_group(NH, NKV, "attention_backward");
  // The whole sequence is one chunk at position 0: the chunked kernel's work units (b, kv head),
  // each summing its group's heads and query tiles in a fixed order, are this kernel's.
  const int64_t C = NH * HS, W = (NH + 2 * NKV) * HS, CK = NKV * HS, start = 0;
  const SeqChunks all{1, T, &start};
  attention_chunked_backward(dqkv, W, dqkv + C, dqkv + C + CK, W, dout, qkv, W, out, lse, all, qkv + C,
                             qkv + C + CK, W, all, B, NH, NKV, HS, scratch, causal);
}

}  // namespace shardlm::kernels
