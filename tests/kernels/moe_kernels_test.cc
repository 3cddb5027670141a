// Mixture-of-experts routing kernels: ties, capacity drops in token order, and the
// load-balancing loss's normalisation (1 at perfect balance for any k).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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
    moe_router_losses(&aux, &z, probs.data(), lse.data(), assigned.data(), N, E, k);
    EXPECT_NEAR(aux, 1.0, 1e-12) << "k = " << k;
    EXPECT_EQ(z, 0.0);
  }
}

}  // namespace
}  // namespace shardlm::kernels
