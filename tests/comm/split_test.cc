// Sub-communicators for hybrid shard: groups of G consecutive ranks shard (split(rank / G)),
// ranks with the same index in their group replicate (split(rank % G)).
#include <gtest/gtest.h>

#include <vector>

#include "comm/mpi_backend.h"
#include "comm/test_util.h"

namespace shardlm::comm {
namespace {

using testing::test_memory;
using testing::kTestTimeout;
using testing::small_int;

TEST(Split, ShardAndReplicateGroupsOfTwo) {
  MpiCommunicator world(test_memory());
  const int n = world.size(), r = world.rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const int G = 2;
  auto shard = world.split(r / G, r);
  auto replicate = world.split(r % G, r);
  ASSERT_TRUE(shard && replicate);
  EXPECT_EQ(shard->size(), G);
  EXPECT_EQ(shard->rank(), r % G);
  EXPECT_EQ(replicate->size(), n / G);
  EXPECT_EQ(replicate->rank(), r / G);

  // Hybrid gradient path: reduce-scatter within the shard group, then all-reduce the shard
  // across the replicate group: every rank ends with the world sum of its shard.
  const int64_t c = 1001;
  std::vector<float> grad(G * c);
  for (int64_t i = 0; i < G * c; ++i) grad[i] = small_int(r, i);
  std::vector<float> shard_sum(c);
  shard->reduce_scatter(grad.data(), shard_sum.data(), c, DType::fp32, "rs shard")->wait(kTestTimeout);
  replicate->all_reduce(shard_sum.data(), c, DType::fp32, "ar replicate")->wait(kTestTimeout);
  for (int64_t i = 0; i < c; ++i) {
    float want = 0;
    for (int q = 0; q < n; ++q) want += small_int(q, (r % G) * c + i);
    ASSERT_EQ(shard_sum[i], want);
  }

  // Parameter path: all-gather within the shard group gives the group's full buffer.
  std::vector<float> full(G * c, -1);
  std::vector<float> mine(c);
  for (int64_t i = 0; i < c; ++i) mine[i] = small_int(r, i, 5);
  shard->all_gather(mine.data(), full.data(), c, DType::fp32,
                    "ag shard")->wait(kTestTimeout);
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(full[g * c + i], small_int((r / G) * G + g, i, 5));

  // The groups run concurrently and independently of the world communicator.
  auto w1 = shard->barrier("shard barrier");
  auto w2 = replicate->barrier("replicate barrier");
  auto w3 = world.barrier("world barrier");
  w1->wait(kTestTimeout);
  w2->wait(kTestTimeout);
  w3->wait(kTestTimeout);
}

TEST(Split, UnevenGroupsAndKeyOrder) {
  MpiCommunicator world(test_memory());
  const int n = world.size(), r = world.rank();
  // Odd and even ranks, ranked in reverse order of world rank.
  auto sub = world.split(r % 2, n - r);
  ASSERT_TRUE(sub);
  const int members = (n - r % 2 + 1) / 2;
  EXPECT_EQ(sub->size(), members);
  EXPECT_EQ(sub->rank(), members - 1 - r / 2);
  float x = static_cast<float>(r), sum = 0;
  sub->all_reduce(&x, 1, DType::fp32, "parity sum")->wait(kTestTimeout);
  for (int q = r % 2; q < n; q += 2) sum += q;
  EXPECT_EQ(x, sum);
}

// mpirun -np N on this one machine: every rank shares memory with rank 0, in the world and in a
// split of it (the cluster's tests, tests/cluster/, see ranks on namespaced hosts apart).
TEST(Split, RanksOfOneMachineShareItsLowestRank) {
  MpiCommunicator world(test_memory());
  EXPECT_EQ(world.machine(), 0);
  auto odd_even = world.split(world.rank() % 2, world.rank());
  ASSERT_TRUE(odd_even);
  EXPECT_EQ(odd_even->machine(), world.rank() % 2);  // the lowest world rank of its group here
}

TEST(Split, NegativeColorGivesNoCommunicator) {
  MpiCommunicator world(test_memory());
  const int r = world.rank();
  auto sub = world.split(r == 0 ? -1 : 0, r);
  if (r == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub->size(), world.size() - 1);
    sub->barrier("without rank 0")->wait(kTestTimeout);
  }
}

}  // namespace
}  // namespace shardlm::comm
