// Mixture-of-experts kernels: router softmax and top-k, the dispatch into expert-sorted rows, the
// weighted combine, with their backwards, and the experts' GEMMs on each expert's contiguous rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu.h"

namespace shardlm::kernels {

namespace {

void softmax_row(float* p, float* lse, const float* x, int64_t E) {
  float m = x[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, x[e]);
  float sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(x[e] - m));
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
  if (lse) *lse = m + std::log(sum);
}

}  // namespace

void moe_router_probs(float* probs, float* lse, const float* logits, int64_t N, int64_t E) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) softmax_row(probs + t * E, lse ? lse + t : nullptr, logits + t * E, E);
}

void moe_router_forward(float* probs, float* lse, int32_t* expert, float* weight, const float* logits, int64_t N,
                        int64_t E, int64_t k, bool norm_topk) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* p = probs + t * E;
    softmax_row(p, lse ? lse + t : nullptr, logits + t * E, E);
    int32_t* ex = expert + t * k;
    float* w = weight + t * k;
    float sum = 0;
    for (int64_t s = 0; s < k; ++s) {
      int32_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < s; ++q) taken = taken || ex[q] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = static_cast<int32_t>(e);  // strict: ties keep the lower index
      }
      ex[s] = best;
      w[s] = p[best];
      sum += p[best];
    }
    if (norm_topk)
      for (int64_t s = 0; s < k; ++s) w[s] /= sum;
  }
}

int64_t moe_dispatch(int32_t* offsets, int32_t* assigned, int32_t* slot_row, int32_t* row_token,
                     const int32_t* expert, int64_t N, int64_t E, int64_t k, int64_t capacity, const int32_t* taken,
                     int64_t segment) {
  std::memset(assigned, 0, sizeof(int32_t) * E);
  for (int64_t i = 0; i < N * k; ++i) ++assigned[expert[i]];
  const int64_t seg = taken && segment > 0 ? segment : N;
  // Whether slot (t, s) stays: the group's slots for its expert before it, in token order, are
  // under capacity. `seen` counts the segment's slots so far.
  std::vector<int32_t> seen(E);
  auto walk = [&](auto&& visit) {
    for (int64_t t = 0; t < N; ++t) {
      if (t % seg == 0) std::fill(seen.begin(), seen.end(), 0);
      const int32_t* before = taken ? taken + (t / seg) * E : nullptr;
      for (int64_t s = 0; s < k; ++s) {
        const int32_t e = expert[t * k + s];
        visit(t, s, e, (before ? before[e] : 0) + seen[e]++ < capacity);
      }
    }
  };
  std::vector<int32_t> kept(E, 0);
  walk([&](int64_t, int64_t, int32_t e, bool keep) { kept[e] += keep; });
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + kept[e];
  std::vector<int32_t> next(offsets, offsets + E);
  walk([&](int64_t t, int64_t s, int32_t e, bool keep) {  // token order: the first `capacity` of each expert stay
    if (keep) {
      row_token[next[e]] = static_cast<int32_t>(t);
      slot_row[t * k + s] = next[e]++;
    } else {
      slot_row[t * k + s] = -1;
    }
  });
  return offsets[E];
}

void moe_gather_rows(float* xs, const float* x, const int32_t* row_token, int64_t rows, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) std::memcpy(xs + r * C, x + static_cast<int64_t>(row_token[r]) * C, sizeof(float) * C);
}

void moe_gather_rows_backward(float* dx, const float* dxs, const int32_t* slot_row, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int32_t r = slot_row[t * k + s];
      if (r < 0) continue;
      const float* g = dxs + static_cast<int64_t>(r) * C;
      float* d = dx + t * C;
      for (int64_t c = 0; c < C; ++c) d[c] += g[c];
    }
}

void moe_combine(float* out, const float* res, const float* ys, const float* weight, const int32_t* slot_row,
                 int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    if (o != res + t * C) std::memcpy(o, res + t * C, sizeof(float) * C);
    for (int64_t s = 0; s < k; ++s) {
      const int32_t r = slot_row[t * k + s];
      if (r < 0) continue;
      const float w = weight[t * k + s];
      const float* y = ys + static_cast<int64_t>(r) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * y[c];
    }
  }
}

void moe_combine_backward(float* dys, float* dweight, const float* dout, const float* ys, const float* weight,
                          const int32_t* slot_row, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int32_t r = slot_row[t * k + s];
      if (r < 0) continue;
      const float w = weight[t * k + s];
      const float* g = dout + t * C;
      const float* y = ys + static_cast<int64_t>(r) * C;
      float* d = dys + static_cast<int64_t>(r) * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        d[c] += w * g[c];
        dot += static_cast<double>(g[c]) * y[c];
      }
      dweight[t * k + s] += static_cast<float>(dot);
    }
}

namespace {

// A one-thread GEMM's share of the experts' work: big enough to run near the GEMM's peak, small
// enough that a skewed routing still spreads over the threads. Fixed, so results do not depend on
// the thread count.
constexpr int64_t kExpertBlock = 64;

struct Block {
  int64_t group, begin, end;
};

// Blocks of [first[g], first[g+1]) of `block` rows each (the last shorter), group after group.
std::vector<Block> row_blocks(const int64_t* first, int64_t groups, int64_t block) {
  std::vector<Block> out;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = first[g]; r < first[g + 1]; r += block) out.push_back({g, r, std::min(r + block, first[g + 1])});
  return out;
}

}  // namespace

void grouped_dense_forward(float* out, const float* inp, const float* const* weight, const int64_t* first,
                           int64_t groups, int64_t C, int64_t OC) {
  const std::vector<Block> tasks = row_blocks(first, groups, kExpertBlock);
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {  // inside the region oneDNN runs each GEMM on its calling thread
    const Block& t = tasks[i];
    matmul(false, true, t.end - t.begin, OC, C, 1.0f, inp + t.begin * C, C, weight[t.group], C, 0.0f,
           out + t.begin * OC, OC);
  }
}

void grouped_dense_backward(float* dinp, float* const* dweight, const float* dout, const float* inp,
                            const float* const* weight, const int64_t* first, int64_t groups, int64_t C, int64_t OC) {
  // dweight's tasks: blocks of its OC rows, over the whole group (one GEMM sums all its rows).
  std::vector<Block> grad;
  for (int64_t g = 0; g < groups; ++g)
    if (dweight[g] && first[g + 1] > first[g])
      for (int64_t o = 0; o < OC; o += kExpertBlock) grad.push_back({g, o, std::min(o + kExpertBlock, OC)});
  const std::vector<Block> rows = dinp ? row_blocks(first, groups, kExpertBlock) : std::vector<Block>{};
  const int64_t nr = static_cast<int64_t>(rows.size()), n = nr + static_cast<int64_t>(grad.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    if (i < nr) {
      const Block& t = rows[i];
      matmul(false, false, t.end - t.begin, C, OC, 1.0f, dout + t.begin * OC, OC, weight[t.group], C, 1.0f,
             dinp + t.begin * C, C);
    } else {
      const Block& t = grad[i - nr];
      const int64_t r0 = first[t.group], m = first[t.group + 1] - r0;
      matmul(true, false, t.end - t.begin, C, m, 1.0f, dout + r0 * OC + t.begin, OC, inp + r0 * C, C, 1.0f,
             dweight[t.group] + t.begin * C, C);
    }
  }
}

void moe_router_losses(double* aux, double* z, const float* probs, const float* lse, const int32_t* assigned,
                       int64_t N, int64_t E, int64_t k, int64_t G) {
  double a = 0, zz = 0;
  for (int64_t e = 0; e < E; ++e) {
    double P = 0;
    for (int64_t t = 0; t < N; ++t) P += probs[t * E + e];
    a += static_cast<double>(assigned[e]) / static_cast<double>(G * k) * (P / static_cast<double>(G));
  }
  for (int64_t t = 0; t < N; ++t) zz += static_cast<double>(lse[t]) * lse[t];
  *aux = a * static_cast<double>(E);
  *z = zz / static_cast<double>(G);
}

void moe_router_backward(float* dlogits, const float* dweight, const float* probs, const float* lse,
                         const int32_t* expert, const float* weight, const int32_t* assigned, int64_t N, int64_t E,
                         int64_t k, int64_t G, bool norm_topk, float aux_scale, float z_scale) {
  // d aux / d probs[t, e] = E f_e / G: the same for every token.
  std::vector<float> daux(E);
  for (int64_t e = 0; e < E; ++e)
    daux[e] = static_cast<float>(static_cast<double>(aux_scale) * static_cast<double>(E) *
                                 static_cast<double>(assigned[e]) / static_cast<double>(G * k) / static_cast<double>(G));
  const float dz = 2.0f * z_scale / static_cast<float>(G);
#pragma omp parallel
  {
    std::vector<float> dp(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const float* p = probs + t * E;
      const int32_t* ex = expert + t * k;
      const float* w = weight + t * k;
      const float* dw = dweight + t * k;
      for (int64_t e = 0; e < E; ++e) dp[e] = daux[e];
      if (norm_topk) {  // w_s = p_s / S, S the sum over the k chosen
        float S = 0, dot = 0;
        for (int64_t s = 0; s < k; ++s) S += p[ex[s]], dot += dw[s] * w[s];
        for (int64_t s = 0; s < k; ++s) dp[ex[s]] += (dw[s] - dot) / S;
      } else {
        for (int64_t s = 0; s < k; ++s) dp[ex[s]] += dw[s];
      }
      float g = 0;
      for (int64_t e = 0; e < E; ++e) g += dp[e] * p[e];
      float* dl = dlogits + t * E;
      const float zt = dz * lse[t];
      for (int64_t e = 0; e < E; ++e) dl[e] += p[e] * (dp[e] - g) + zt * p[e];
    }
  }
}

}  // namespace shardlm::kernels
