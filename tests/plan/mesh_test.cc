#include "plan/mesh.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

namespace shardlm::plan {
namespace {

// Ranks fill the mesh row-major; coordinates and ranks convert both ways.
TEST(Mesh, CoordinatesAreRowMajor) {
  const Mesh m({{"dp_replicate", 2}, {"ep", 3}, {"dp_shard", 2}});
  EXPECT_EQ(m.rank_count(), 12);
  EXPECT_EQ(m.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(m.coords(1), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(m.coords(2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(m.coords(11), (std::vector<int>{1, 2, 1}));
  for (int r = 0; r < 12; ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_EQ(m.find("ep"), 1);
  EXPECT_EQ(m.find("cp"), -1);
  EXPECT_THROW(m.axis("cp"), std::logic_error);
  EXPECT_EQ(m.to_string(), "dp_replicate=2 × ep=3 × dp_shard=2");
}

// A group over some axes is the ranks that agree on every other axis: group_of is the same for
// exactly those, index_in numbers them 0 … size-1, and the groups partition the world.
TEST(Mesh, GroupsOverAxesPartitionTheWorld) {
  const Mesh m({{"dp_replicate", 2}, {"ep", 3}, {"dp_shard", 2}});
  for (const std::vector<int>& axes : std::vector<std::vector<int>>{{}, {0}, {1}, {2}, {0, 2}, {1, 2}, {0, 1, 2}}) {
    const int size = m.group_size(axes);
    std::map<int, std::set<int>> members;  // group -> its members' indices
    for (int r = 0; r < 12; ++r) {
      const auto c = m.coords(r);
      const int g = m.group_of(r, axes);
      for (int q = 0; q < 12; ++q) {
        bool same = true;
        const auto d = m.coords(q);
        for (int a = 0; a < 3; ++a)
          if (std::find(axes.begin(), axes.end(), a) == axes.end() && c[a] != d[a]) same = false;
        EXPECT_EQ(m.group_of(q, axes) == g, same) << r << " " << q;
      }
      EXPECT_TRUE(members[g].insert(m.index_in(r, axes)).second);
    }
    EXPECT_EQ(members.size(), static_cast<size_t>(12 / size));
    for (const auto& [g, idx] : members) {
      EXPECT_EQ(idx.size(), static_cast<size_t>(size));
      EXPECT_EQ(*idx.rbegin(), size - 1);
    }
  }
}

TEST(Mesh, BadAxesAreRefused) {
  EXPECT_THROW(Mesh({{"dp_shard", 0}}), std::invalid_argument);
  EXPECT_THROW(Mesh({{"dp_shard", 2}, {"dp_shard", 2}}), std::invalid_argument);
}

}  // namespace
}  // namespace shardlm::plan
