// Mixture-of-experts kernels: ties, capacity drops in token order, the load-balancing loss's
// normalisation (1 at perfect balance for any k), and the grouped expert GEMMs against one
// dense GEMM per group.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <omp.h>

#include "kernels/cpu.h"

namespace shardlm::kernels {
namespace {

TEST(MoeKernels, TiesGoToTheLowerExpertAndCapacityDropsLaterTokens) {
  const int64_t N = 4, E = 3, k = 2;
  // Tokens 0..2 tie on every expert; token 3 prefers expert 2, then 1.
  const std::vector<float> logits = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2};
  std::vector<float> probs(N * E), lse(N), weight(N * k);
  std::vector<int32_t> expert(N * k), offsets(E + 1), assigned(E), slot_row(N * k), row_token(N * k);
  moe_router_forward(probs.data(), lse.data(), expert.data(), weight.data(), logits.data(), N, E, k, true);
  EXPECT_EQ(expert, (std::vector<int32_t>{0, 1, 0, 1, 0, 1, 2, 1}));
  EXPECT_FLOAT_EQ(weight[0], 0.5f);
  // Capacity 2: experts 0 and 1 keep tokens 0 and 1; tokens 2 (and 3 on expert 1) are dropped.
  const int64_t rows = moe_dispatch(offsets.data(), assigned.data(), slot_row.data(), row_token.data(), expert.data(),
                                    N, E, k, 2);
  EXPECT_EQ(assigned, (std::vector<int32_t>{3, 4, 1}));
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 2, 4, 5}));
  EXPECT_EQ(rows, 5);
  EXPECT_EQ(slot_row, (std::vector<int32_t>{0, 2, 1, 3, -1, -1, 4, -1}));
  EXPECT_EQ(std::vector<int32_t>(row_token.begin(), row_token.begin() + rows), (std::vector<int32_t>{0, 1, 0, 1, 3}));
}

// A routing group split over two ranks as a ring splits a sequence (4 chunks: rank 0 holds chunks
// 0 and 3, rank 1 chunks 1 and 2), each dispatching its chunks with `taken` (the group's slots
// before each chunk, per expert): every slot is kept or dropped as in the whole group's dispatch.
TEST(MoeKernels, DispatchOfAGroupSplitInSegmentsKeepsTheWholeGroupsSlots) {
  const int64_t rows = 5, N = 4 * rows, E = 3, k = 2, capacity = 6;
  std::vector<int32_t> expert(N * k);
  for (int64_t t = 0; t < N; ++t) {  // two distinct experts a token, unevenly spread
    expert[t * k] = static_cast<int32_t>((t * 7) % 5 % E);
    expert[t * k + 1] = static_cast<int32_t>((expert[t * k] + 1 + t % 2) % E);
  }
  std::vector<int32_t> offsets(E + 1), assigned(E), slot_row(N * k), row_token(N * k);
  moe_dispatch(offsets.data(), assigned.data(), slot_row.data(), row_token.data(), expert.data(), N, E, k, capacity);
  ASSERT_LT(offsets[E], N * k) << "the capacity drops some slots";
  const std::vector<std::vector<int64_t>> held = {{0, 3}, {1, 2}};
  for (const auto& chunks : held) {
    std::vector<int32_t> mine, taken;
    for (int64_t c : chunks) {
      for (int64_t e = 0; e < E; ++e) {
        int32_t before = 0;
        for (int64_t i = 0; i < c * rows * k; ++i) before += expert[i] == e;
        taken.push_back(before);
      }
      mine.insert(mine.end(), expert.begin() + c * rows * k, expert.begin() + (c + 1) * rows * k);
    }
    const int64_t n = 2 * rows;
    std::vector<int32_t> off(E + 1), as(E), slot(n * k), tok(n * k);
    moe_dispatch(off.data(), as.data(), slot.data(), tok.data(), mine.data(), n, E, k, capacity, taken.data(), rows);
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < rows * k; ++i)
        EXPECT_EQ(slot[j * rows * k + i] >= 0, slot_row[chunks[j] * rows * k + i] >= 0) << "chunk " << chunks[j] << " slot " << i;
  }
}

TEST(MoeKernels, LoadBalancingLossIsOneAtPerfectBalanceForAnyK) {
  for (int64_t k : {1, 2, 4}) {
    const int64_t N = 8, E = 4;
    std::vector<float> probs(N * E, 1.0f / E), lse(N, 0.0f);
    std::vector<int32_t> assigned(E, static_cast<int32_t>(N * k / E));
    double aux = 0, z = 0;
    moe_router_losses(&aux, &z, probs.data(), lse.data(), assigned.data(), N, E, k, N);
    EXPECT_NEAR(aux, 1.0, 1e-12) << "k = " << k;
    EXPECT_EQ(z, 0.0);
  }
}

// Groups of 0, 1, 64, 65 and 130 rows (an idle expert, blocks and their remainders), with a
// weight gradient skipped for one group; at 1 and 2 threads, the same bits.
TEST(MoeKernels, GroupedGemmsMatchOneDenseGemmPerGroup) {
  const int64_t C = 24, OC = 136;
  const std::vector<int64_t> first = {0, 0, 1, 65, 130, 260};
  const int64_t G = 5, R = first[G];
  auto fill = [](std::vector<float>& v, float s) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = s * std::sin(0.37f * static_cast<float>(i) + s);
  };
  std::vector<float> inp(R * C), w(G * OC * C), dout(R * OC);
  fill(inp, 1.0f), fill(w, 0.5f), fill(dout, 0.25f);
  std::vector<const float*> wp(G);
  for (int64_t g = 0; g < G; ++g) wp[g] = w.data() + g * OC * C;
  std::vector<float> want_out(R * OC), want_dinp(R * C, 0.1f), want_dw(G * OC * C, 0.2f);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t a = first[g], n = first[g + 1] - a;
    if (n == 0) continue;
    dense_forward(want_out.data() + a * OC, inp.data() + a * C, wp[g], n, C, OC);
    dense_backward(want_dinp.data() + a * C, g == 3 ? nullptr : want_dw.data() + g * OC * C, dout.data() + a * OC,
                   inp.data() + a * C, wp[g], n, C, OC);
  }
  std::vector<float> first_bits;
  for (int threads : {1, 2}) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> out(R * OC), dinp(R * C, 0.1f), dw(G * OC * C, 0.2f);
    std::vector<float*> dwp(G);
    for (int64_t g = 0; g < G; ++g) dwp[g] = g == 3 ? nullptr : dw.data() + g * OC * C;
    grouped_dense_forward(out.data(), inp.data(), wp.data(), first.data(), G, C, OC);
    grouped_dense_backward(dinp.data(), dwp.data(), dout.data(), inp.data(), wp.data(), first.data(), G, C, OC);
    omp_set_num_threads(before);
    for (int64_t i = 0; i < R * OC; ++i) ASSERT_NEAR(out[i], want_out[i], 1e-4f) << "out " << i;
    for (int64_t i = 0; i < R * C; ++i) ASSERT_NEAR(dinp[i], want_dinp[i], 1e-4f) << "dinp " << i;
    for (int64_t i = 0; i < G * OC * C; ++i) ASSERT_NEAR(dw[i], want_dw[i], 1e-3f) << "dweight " << i;
    std::vector<float> bits = out;
    bits.insert(bits.end(), dinp.begin(), dinp.end());
    bits.insert(bits.end(), dw.begin(), dw.end());
    if (first_bits.empty()) first_bits = bits;
    else EXPECT_EQ(bits, first_bits) << "the thread count changed the result";
  }
}

}  // namespace
}  // namespace shardlm::kernels
