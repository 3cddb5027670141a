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
  const Mesh m({{AxisRole::replicate, 2}, {AxisRole::expert, 3}, {AxisRole::shard, 2}});
  EXPECT_EQ(m.rank_count(), 12);
  EXPECT_EQ(m.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(m.coords(1), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(m.coords(2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(m.coords(11), (std::vector<int>{1, 2, 1}));
  for (int r = 0; r < 12; ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_EQ(m.find(AxisRole::expert), 1);
  EXPECT_EQ(m.find(AxisRole::context), -1);
  EXPECT_THROW(m.axis(AxisRole::context), std::logic_error);
  EXPECT_EQ(m.to_string(), "dp_replicate=2 × ep=3 × dp_shard=2");
}

// A group over some axes is the ranks that agree on every other axis: group_of is the same for
// exactly those, index_in numbers them 0 … size-1, and the groups partition the world.
TEST(Mesh, GroupsOverAxesPartitionTheWorld) {
  const Mesh m({{AxisRole::replicate, 2}, {AxisRole::expert, 3}, {AxisRole::shard, 2}});
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

// The role queries, over every mesh of distinct roles in every order (sizes 2 and 3), against
// what each rank computes, written out per role: a rank reads the batch of its replicate, shard
// and expert coordinates, holds the sequence positions of its context coordinate (where the plan
// splits sequences; else whole sequences, as its context neighbours do), the experts of its
// expert coordinate and the units of its pipe coordinate. A query's group must be exactly the
// ranks it should sum with, each contributing a term no other member does.
TEST(Mesh, RoleQueriesFollowFromWhatEachRankComputes) {
  const std::vector<AxisRole> roles(std::begin(kAxisRoles), std::end(kAxisRoles));
  std::set<std::string> names;
  for (size_t i = 0; i < roles.size(); ++i) {
    ASSERT_EQ(static_cast<size_t>(roles[i]), i);  // kAxisRoles lists every role once, in order
    EXPECT_TRUE(names.insert(to_string(roles[i])).second) << to_string(roles[i]);
  }
  EXPECT_EQ(role_of(model::Split::experts), AxisRole::expert);
  EXPECT_EQ(role_of(model::Split::sequence), AxisRole::context);
  int meshes = 0;
  for (unsigned subset = 0; subset < (1u << roles.size()); ++subset) {
    std::vector<AxisRole> chosen;
    for (size_t i = 0; i < roles.size(); ++i)
      if (subset & (1u << i)) chosen.push_back(roles[i]);
    std::sort(chosen.begin(), chosen.end());
    do {
      std::vector<MeshAxis> axes;
      for (size_t i = 0; i < chosen.size(); ++i) axes.push_back({chosen[i], 2 + static_cast<int>((i + subset) % 2)});
      const Mesh m(axes);
      ++meshes;
      const int n = m.rank_count();
      std::vector<std::vector<int>> on_role(n, std::vector<int>(roles.size(), 0));  // a rank's coordinate by role
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < roles.size(); ++i)
          if (m.find(roles[i]) >= 0) on_role[r][i] = m.coords(r)[m.find(roles[i])];
      auto coord = [&](int rank, AxisRole role) { return on_role[rank][static_cast<size_t>(role)]; };
      auto batch = [&](int r) {
        return std::vector<int>{coord(r, AxisRole::replicate), coord(r, AxisRole::shard), coord(r, AxisRole::expert)};
      };
      auto groups = [&](const std::vector<int>& over) {  // each rank's group's members
        std::map<int, std::set<int>> members;
        for (int q = 0; q < n; ++q) members[m.group_of(q, over)].insert(q);
        std::vector<std::set<int>> of(n);
        for (int q = 0; q < n; ++q) of[q] = members[m.group_of(q, over)];
        return of;
      };
      auto ranks_where = [&](auto same) {
        std::set<int> g;
        for (int q = 0; q < n; ++q)
          if (same(q)) g.insert(q);
        return g;
      };
      const std::string mesh = m.to_string();
      for (bool split : {true, false}) {
        auto chunk = [&](int r) { return split ? coord(r, AxisRole::context) : 0; };
        // Each member of the group holds a term no other member holds.
        auto distinct_terms = [&](const std::set<int>& g, bool by_stage) {
          std::set<std::vector<int>> terms;
          for (int q : g) {
            std::vector<int> t = batch(q);
            t.push_back(chunk(q));
            if (by_stage) t.push_back(coord(q, AxisRole::pipe));
            if (!terms.insert(t).second) return false;
          }
          return true;
        };
        const std::vector<int> dense = m.grad_axes(ParamKind::dense, split), expert = m.grad_axes(ParamKind::expert, split);
        const std::vector<int> loss = m.loss_axes(split), norm = m.norm_axes(split);
        for (const auto* q : {&dense, &expert, &loss, &norm}) EXPECT_TRUE(std::is_sorted(q->begin(), q->end())) << mesh;
        EXPECT_EQ(loss, norm) << mesh;
        const auto dense_group = groups(dense), expert_group = groups(expert), loss_group = groups(loss);
        for (int r = 0; r < n; ++r) {
          auto same = [&](int q, std::initializer_list<AxisRole> on) {
            for (AxisRole role : on)
              if (coord(q, role) != coord(r, role)) return false;
            return true;
          };
          const std::set<int> holders = ranks_where([&](int q) {
            return same(q, {AxisRole::pipe}) && (split || same(q, {AxisRole::context}));
          });
          const std::set<int> expert_holders = ranks_where([&](int q) {
            return same(q, {AxisRole::pipe, AxisRole::expert}) && (split || same(q, {AxisRole::context}));
          });
          const std::set<int> whole_model = ranks_where([&](int q) { return split || same(q, {AxisRole::context}); });
          EXPECT_EQ(dense_group[r], holders) << mesh << " split " << split << " rank " << r;
          EXPECT_TRUE(distinct_terms(holders, false)) << mesh;
          EXPECT_EQ(expert_group[r], expert_holders) << mesh << " split " << split << " rank " << r;
          EXPECT_TRUE(distinct_terms(expert_holders, false)) << mesh;
          EXPECT_EQ(loss_group[r], whole_model) << mesh << " split " << split << " rank " << r;
          EXPECT_TRUE(distinct_terms(whole_model, true)) << mesh;
        }
      }
      std::vector<int> data_index(n);
      for (int r = 0; r < n; ++r) data_index[r] = m.index_in(r, m.data_axes());
      for (int r = 0; r < n; ++r)  // ranks agreeing on the data axes read the same batch
        for (int q = 0; q < n; ++q) EXPECT_EQ(data_index[q] == data_index[r], batch(q) == batch(r)) << mesh;
      for (bool shards : {true, false}) {
        const std::vector<int> shard = m.shard_axes(shards), replicate = m.replicate_axes(shards);
        std::vector<int> both = shard;
        both.insert(both.end(), replicate.begin(), replicate.end());
        std::sort(both.begin(), both.end());
        std::vector<int> holding = m.axes_of({AxisRole::replicate, AxisRole::shard, AxisRole::expert, AxisRole::context});
        EXPECT_EQ(both, holding) << mesh;  // a unit's state lies over every axis but pipe, once
        for (AxisRole joins : {AxisRole::expert, AxisRole::context})
          if (m.find(joins) >= 0) {
            const std::vector<int>& with = shards ? shard : replicate;
            EXPECT_TRUE(std::count(with.begin(), with.end(), m.find(joins))) << mesh;
          }
      }
      EXPECT_EQ(m.exchange_axes(), m.axes_of({AxisRole::expert, AxisRole::context})) << mesh;
    } while (std::next_permutation(chosen.begin(), chosen.end()));
  }
  EXPECT_EQ(meshes, 326);  // every ordered choice of distinct roles, the empty mesh included
}

TEST(Mesh, BadAxesAreRefused) {
  EXPECT_THROW(Mesh({{AxisRole::shard, 0}}), std::invalid_argument);
  EXPECT_THROW(Mesh({{AxisRole::shard, 2}, {AxisRole::shard, 2}}), std::invalid_argument);
}

}  // namespace
}  // namespace shardlm::plan
