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
