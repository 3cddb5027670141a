// Attention over sequence chunks, as context parallelism runs it: each of K simulated ranks
// holds the load-balanced chunks i and 2K-1-i of every sequence, and the key/value blocks of
// all ranks pass by it one ring step at a time (forward merges partial results by their
// log-sum-exp; backward accumulates dq locally and dk / dv in accumulators that travel with
// their block). The result must equal whole-sequence attention_forward / attention_backward.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu.h"
#include "kernels/kernel_test_util.h"

namespace k = shardlm::kernels;
using namespace kernel_test;

namespace {

struct Case {
  int64_t K, NH, NKV, HS, chunk;
};

struct Rank {
  std::vector<int64_t> pos;  // starting positions of its chunks
  fvec qkv, dout, out, lse, dqkv;
  k::SeqChunks chunks(int64_t rows) const { return {static_cast<int64_t>(pos.size()), rows, pos.data()}; }
};

// Copies the rows of `full` (B, T, width) at the rank's chunks into (B, chunks·rows, width), or
// back with `scatter`.
void move_rows(fvec& local, fvec& full, const Rank& r, int64_t B, int64_t T, int64_t rows, int64_t width,
               bool scatter) {
  const int64_t Tl = static_cast<int64_t>(r.pos.size()) * rows;
  local.resize(B * Tl * width);
  for (int64_t b = 0; b < B; ++b)
    for (size_t c = 0; c < r.pos.size(); ++c)
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t e = 0; e < width; ++e) {
          float& l = local[((b * Tl) + c * rows + t) * width + e];
          float& f = full[((b * T) + r.pos[c] + t) * width + e];
          if (scatter)
            f = l;
          else
            l = f;
        }
}

// ||got - ref|| / ||ref|| (Euclidean norms): the two differ only in the order their sums are
// taken (tiles fall elsewhere in a chunk than in the whole sequence), so the error is rounding.
void expect_relative(const fvec& got, const fvec& ref, double bound, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(ref[i]);
    diff += d * d;
    norm += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  EXPECT_LE(std::sqrt(diff / norm), bound) << what;
}

class ChunkedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkedAttention, RingOfLoadBalancedChunksEqualsWholeSequence) {
  const Case cs = GetParam();
  const int64_t B = 2, K = cs.K, c = cs.chunk, T = 2 * K * c, NH = cs.NH, NKV = cs.NKV, HS = cs.HS;
  const int64_t W = (NH + 2 * NKV) * HS, C = NH * HS, KV = 2 * NKV * HS;
  fvec qkv = randv(B * T * W, 11, -1.5f, 1.5f), dout = randv(B * T * C, 12);
  fvec out(B * T * C), lse(B * NH * T), dqkv(B * T * W, 0.0f);
  k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HS);
  fvec scratch = nan_scratch(k::attention_backward_scratch(B, T, NH, NKV, HS, omp_get_max_threads()));
  k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV, HS,
                        scratch.data());

  std::vector<Rank> ranks(K);
  for (int64_t i = 0; i < K; ++i) {
    ranks[i].pos = {i * c, (2 * K - 1 - i) * c};
    move_rows(ranks[i].qkv, qkv, ranks[i], B, T, c, W, false);
    move_rows(ranks[i].dout, dout, ranks[i], B, T, c, C, false);
  }
  const int64_t Tl = 2 * c;
  // Forward: at ring step s rank i holds rank (i - s)'s key/value block.
  for (int64_t i = 0; i < K; ++i) {
    Rank& r = ranks[i];
    r.out.assign(B * Tl * C, 0.0f);
    r.lse.assign(B * NH * Tl, 0.0f);
    for (int64_t s = 0; s < K; ++s) {
      const Rank& from = ranks[(i - s + K) % K];
      k::attention_chunked_forward(r.out.data(), r.lse.data(), r.qkv.data(), W, r.chunks(c), from.qkv.data() + C,
                                   from.qkv.data() + C + NKV * HS, W, from.chunks(c), B, NH, NKV, HS, s > 0);
    }
  }
  // Backward: block j's dk / dv accumulator visits every rank with the block.
  std::vector<fvec> dkv(K, fvec(B * Tl * KV, 0.0f));
  fvec bscratch = nan_scratch(k::attention_chunked_backward_scratch(HS, omp_get_max_threads()));
  for (int64_t i = 0; i < K; ++i) {
    Rank& r = ranks[i];
    r.dqkv.assign(B * Tl * W, 0.0f);
    for (int64_t s = 0; s < K; ++s) {
      const int64_t j = (i - s + K) % K;
      const Rank& from = ranks[j];
      k::attention_chunked_backward(r.dqkv.data(), W, dkv[j].data(), dkv[j].data() + NKV * HS, KV, r.dout.data(),
                                    r.qkv.data(), W, r.out.data(), r.lse.data(), r.chunks(c), from.qkv.data() + C,
                                    from.qkv.data() + C + NKV * HS, W, from.chunks(c), B, NH, NKV, HS,
                                    bscratch.data());
    }
  }
  fvec ring_out(B * T * C), ring_dqkv(B * T * W);
  fvec ring_lse(B * NH * T);
  for (int64_t i = 0; i < K; ++i) {
    Rank& r = ranks[i];
    for (int64_t row = 0; row < B * Tl; ++row)  // the block's dk / dv back into the rank's dqkv
      for (int64_t e = 0; e < KV; ++e) r.dqkv[row * W + C + e] = dkv[i][row * KV + e];
    move_rows(r.out, ring_out, r, B, T, c, C, true);
    move_rows(r.dqkv, ring_dqkv, r, B, T, c, W, true);
    // lse (B, NH, Tl): one row of Tl per (b, h), chunks in order.
    for (int64_t bh = 0; bh < B * NH; ++bh)
      for (size_t ch = 0; ch < r.pos.size(); ++ch)
        for (int64_t t = 0; t < c; ++t) ring_lse[bh * T + r.pos[ch] + t] = r.lse[bh * Tl + ch * c + t];
  }
  expect_relative(ring_out, out, 1e-6, "out");
  expect_relative(ring_lse, lse, 1e-6, "lse");
  expect_relative(ring_dqkv, dqkv, 1e-6, "dqkv");
}

INSTANTIATE_TEST_SUITE_P(Shapes, ChunkedAttention,
                         ::testing::Values(Case{2, 4, 4, 32, 24}, Case{3, 4, 2, 48, 40}, Case{4, 4, 1, 64, 16},
                                           Case{2, 2, 2, 128, 70}, Case{4, 6, 3, 32, 20}, Case{3, 2, 1, 128, 33},
                                           Case{2, 4, 2, 64, 96}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "K" + std::to_string(c.K) + "_NH" + std::to_string(c.NH) + "_NKV" +
                                  std::to_string(c.NKV) + "_HS" + std::to_string(c.HS) + "_chunk" +
                                  std::to_string(c.chunk);
                         });

// The head-split form (all-to-all) sees the whole sequence but in the ranks' chunk order:
// chunks 0, 2K-1, 1, 2K-2, ... One call over all 2K chunks equals attention_forward.
TEST(ChunkedAttention, PermutedChunksOfAWholeSequenceEqualAttentionForward) {
  const int64_t B = 1, K = 3, c = 20, T = 2 * K * c, NH = 4, NKV = 2, HS = 32, W = (NH + 2 * NKV) * HS, C = NH * HS;
  fvec qkv = randv(B * T * W, 21, -1.5f, 1.5f);
  fvec out(B * T * C), lse(B * NH * T);
  k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HS);
  Rank all;
  for (int64_t i = 0; i < K; ++i) {
    all.pos.push_back(i * c);
    all.pos.push_back((2 * K - 1 - i) * c);
  }
  fvec local, lout(B * T * C), llse(B * NH * T), back(B * T * C);
  move_rows(local, qkv, all, B, T, c, W, false);
  k::attention_chunked_forward(lout.data(), llse.data(), local.data(), W, all.chunks(c), local.data() + C,
                               local.data() + C + NKV * HS, W, all.chunks(c), B, NH, NKV, HS, false);
  move_rows(lout, back, all, B, T, c, C, true);
  expect_relative(back, out, 1e-6, "out");
}

}  // namespace
