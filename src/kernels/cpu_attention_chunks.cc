// Attention over sequence chunks: the block routines of cpu_attention.cc driven over chunks at
// arbitrary positions, for context parallelism (ring steps and the head-split all-to-all form).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cpu.h"

namespace shardlm::kernels {

namespace {

constexpr int64_t kT = kAttnTile;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_heads(int64_t NH, int64_t NKV, int64_t HS, const char* who) {
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0)
    throw std::invalid_argument(std::string(who) + ": NKV must be positive and divide NH");
  if (HS > kAttnMaxHS) throw std::invalid_argument(std::string(who) + ": HS > kAttnMaxHS");
}

// The online-softmax state that attention_state_finalize turns into (out, lse): m = lse, l = 1,
// acc = out reproduce them exactly, so more blocks merge into an earlier result.
void state_from_result(float* m, float* l, float* acc, const float* out, int64_t ldo, const float* lse, int64_t nq,
                       int64_t HS) {
  for (int64_t i = 0; i < nq; ++i) {
    const bool empty = lse[i] == kNegInf;
    m[i] = lse[i];
    l[i] = empty ? 0.0f : 1.0f;
    for (int64_t d = 0; d < HS; ++d) acc[i * HS + d] = empty ? 0.0f : out[i * ldo + d];
  }
}

}  // namespace

void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc,
                               const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B,
                               int64_t NH, int64_t NKV, int64_t HS, bool accumulate, bool causal) {
  check_heads(NH, NKV, HS, "attention_chunked_forward");
  const int64_t G = NH / NKV, C = NH * HS, Tq = qc.total(), Tk = kc.total();
  const int64_t tiles = (qc.rows + kT - 1) / kT;
  const int64_t units = B * NH * qc.count * tiles;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  // One unit = (b, h, query chunk, query tile); each writes disjoint rows of out and lse in a
  // fixed order, so dynamic scheduling keeps the result independent of the thread count.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t tile = u % tiles, qci = u / tiles % qc.count, bh = u / tiles / qc.count;
    const int64_t b = bh / NH, h = bh % NH;
    const int64_t r0 = qci * qc.rows + tile * kT;  // first row of the tile in this rank's rows
    const int64_t nq = std::min(kT, qc.rows - tile * kT);
    const int64_t qpos = qc.pos[qci] + tile * kT;
    alignas(64) float scratch[kT * kAttnMaxHS + kT * kT + 4 * kT];
    alignas(64) float acc[kT * kAttnMaxHS];
    float m[kT], l[kT];
    float* o = out + (b * Tq + r0) * C + h * HS;
    float* ls = lse + bh * Tq + r0;
    if (accumulate)
      state_from_result(m, l, acc, o, C, ls, nq, HS);
    else
      attention_state_init(m, l, acc, nq, HS);
    const float* qt = q + (b * Tq + r0) * ldq + h * HS;
    const int64_t kv_col = (h / G) * HS;
    for (int64_t kci = 0; kci < kc.count; ++kci) {
      const int64_t k0 = (b * Tk + kci * kc.rows) * ldkv + kv_col;
      attention_block_forward(qt, ldq, nq, qpos, k + k0, ldkv, v + k0, ldkv, kc.rows, kc.pos[kci], HS, scale,
                              causal, m, l, acc, scratch);
    }
    attention_state_finalize(o, C, ls, m, l, acc, nq, HS);
  }
}

int64_t attention_chunked_backward_scratch(int64_t HS, int threads) {
  return (attention_block_backward_scratch(HS) + kT) * std::max(threads, 1);
}

void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv,
                                const float* dout, const float* q, int64_t ldq, const float* out,
                                const float* lse, SeqChunks qc, const float* k, const float* v,
                                int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                                int64_t HS, float* scratch, bool causal) {
  check_heads(NH, NKV, HS, "attention_chunked_backward");
  const int64_t G = NH / NKV, C = NH * HS, Tq = qc.total(), Tk = kc.total();
  const int64_t tiles = (qc.rows + kT - 1) / kT;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int64_t per = attention_block_backward_scratch(HS) + kT;
  // One unit = (b, key/value head): its dk / dv rows sum the group's query heads, chunks and
  // tiles in a fixed order on one thread (deterministic, no atomics); dq columns of different
  // query heads are disjoint.
#pragma omp parallel
  {
    float* mine = scratch + per * omp_get_thread_num();
    float* Drow = mine + attention_block_backward_scratch(HS);
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < B * NKV; ++bk) {
      const int64_t b = bk / NKV, g = bk % NKV;
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        const float* ls = lse + (b * NH + h) * Tq;
        for (int64_t qci = 0; qci < qc.count; ++qci) {
          for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t r0 = qci * qc.rows + tile * kT, nq = std::min(kT, qc.rows - tile * kT);
            const int64_t qpos = qc.pos[qci] + tile * kT;
            const int64_t orow = (b * Tq + r0) * C + h * HS;
            attention_backward_rowdot(Drow, dout + orow, C, out + orow, C, nq, HS);
            for (int64_t kci = 0; kci < kc.count; ++kci) {
              const int64_t krow = (b * Tk + kci * kc.rows);
              attention_block_backward(q + (b * Tq + r0) * ldq + h * HS, ldq, dout + orow, C, ls + r0, Drow, nq, qpos,
                                       k + krow * ldkv + g * HS, ldkv, v + krow * ldkv + g * HS, ldkv, kc.rows,
                                       kc.pos[kci], HS, scale, causal, dq + (b * Tq + r0) * lddq + h * HS, lddq,
                                       dk + krow * lddkv + g * HS, lddkv, dv + krow * lddkv + g * HS, lddkv, mine);
            }
          }
        }
      }
    }
  }
}

}  // namespace shardlm::kernels
