#include "plan/plan.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace shardlm::plan {
namespace {

model::ModelDesc small() { return model::describe(model::model_preset("small")); }

int find(const Plan& p, Op op, int unit, int micro = 0) {
  for (const Task& t : p.tasks)
    if (t.op == op && t.unit == unit && t.micro == micro) return t.id;
  return -1;
}

// Index of task id among the tasks of its own stream.
int stream_pos(const Plan& p, int id) {
  int n = 0;
  for (const Task& t : p.tasks) {
    if (t.id == id) return n;
    if (t.stream == p.tasks[id].stream) ++n;
  }
  return -1;
}

TEST(Plan, DepsPointBackwardAndEveryStreamIsRunnable) {
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid}) {
    PlanConfig c;
    c.strategy = s;
    c.world = 4;
    c.shard_group = 2;
    c.grad_accum = 2;
    const Plan p = build_plan(small(), c);
    for (const Task& t : p.tasks) {
      EXPECT_EQ(&t - p.tasks.data(), t.id);
      for (int d : t.deps) EXPECT_LT(d, t.id) << to_string(s) << " " << t.name();
    }
  }
}

TEST(Plan, FsdpForwardGatherOfNextUnitIsIssuedBeforeTheCurrentUnitComputes) {
  PlanConfig c;
  c.world = 2;
  const model::ModelDesc d = small();
  const Plan p = build_plan(d, c);
  const int L = static_cast<int>(d.config.n_layer);
  for (int u = 1; u < L; ++u) {
    const int fwd = find(p, Op::forward, u), next_ag = find(p, Op::all_gather, u + 1);
    ASSERT_GE(fwd, 0);
    ASSERT_GE(next_ag, 0);
    // Listed (so issued on the comm stream) before the forward of u, and not waiting for it.
    EXPECT_LT(next_ag, fwd) << "unit " << u;
    EXPECT_FALSE(p.depends_on(next_ag, fwd)) << "unit " << u;
  }
}

TEST(Plan, FsdpReduceScatterOfUnitOverlapsTheBackwardOfThePreviousUnit) {
  PlanConfig c;
  c.world = 2;
  const model::ModelDesc d = small();
  const Plan p = build_plan(d, c);
  const int L = static_cast<int>(d.config.n_layer);
  for (int u = L; u >= 2; --u) {
    const int rs = find(p, Op::reduce_scatter, u), prev_bwd = find(p, Op::backward, u - 1);
    const int bwd = find(p, Op::backward, u);
    ASSERT_GE(rs, 0);
    EXPECT_TRUE(p.depends_on(rs, bwd));
    // Neither waits for the other: they may run at once on their two streams.
    EXPECT_FALSE(p.depends_on(prev_bwd, rs)) << "unit " << u;
    EXPECT_FALSE(p.depends_on(rs, prev_bwd)) << "unit " << u;
    // And the gather for backward of u-1 is queued ahead of the reduce-scatter of u.
    const int ag_prev = [&] {
      int id = -1;
      for (const Task& t : p.tasks)
        if (t.op == Op::all_gather && t.unit == u - 1) id = t.id;  // the backward one comes last
      return id;
    }();
    EXPECT_LT(stream_pos(p, ag_prev), stream_pos(p, rs)) << "unit " << u;
  }
}

TEST(Plan, GathersInFlightNeverExceedTheLimit) {
  for (int limit : {1, 2, 3}) {
    PlanConfig c;
    c.world = 2;
    c.max_gathers_in_flight = limit;
    c.prefetch_forward = c.prefetch_backward = 4;
    const Plan p = build_plan(small(), c);
    // Walk in list order: rotating gathered buffers (all but the kept embedding) alive at once.
    int alive = 0, worst = 0;
    for (const Task& t : p.tasks) {
      for (const auto& a : t.allocs)
        if (a.name.rfind("gathered", 0) == 0 && a.name != "gathered u0") ++alive;
      worst = std::max(worst, alive);
      for (const auto& f : t.frees)
        if (f.rfind("gathered", 0) == 0 && f != "gathered u0") --alive;
    }
    EXPECT_LE(worst, limit);
    EXPECT_GE(worst, 1);
  }
}

// Plan buffers are named, so two lives of one name must never overlap in any order the
// dependencies allow: each allocation of a name after the first depends on the free of the one
// before, and every allocation is freed within the step. Over every strategy, micro-step count,
// gather limit and prefetch depth.
TEST(Plan, ANamedBufferIsNeverAliveTwiceInAnyScheduleTheDepsAllow) {
  const model::ModelDesc d = model::describe(model::model_preset("tiny", 256));
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
    for (int accum : {1, 2, 3})
      for (int limit : {1, 2, 3, 4})
        for (int prefetch : {0, 1, 2, 3}) {
          PlanConfig c;
          c.strategy = s;
          c.world = 4;
          c.shard_group = 2;
          c.grad_accum = accum;
          c.max_gathers_in_flight = limit;
          c.prefetch_forward = c.prefetch_backward = prefetch;
          c.param_bytes = s == Strategy::fsdp || s == Strategy::hybrid ? 2 : 4;
          c.reduce_bytes = 2;
          const Plan p = build_plan(d, c);
          const std::string what = std::string(to_string(s)) + " accum " + std::to_string(accum) + " limit " +
                                   std::to_string(limit) + " prefetch " + std::to_string(prefetch);
          std::map<std::string, int> live;       // name -> allocating task
          std::map<std::string, int> last_free;  // name -> task that freed its previous life
          for (const Task& t : p.tasks) {
            for (const auto& a : t.allocs) {
              EXPECT_FALSE(live.count(a.name)) << what << ": " << a.name << " allocated twice in list order";
              if (last_free.count(a.name)) {
                EXPECT_TRUE(p.depends_on(t.id, last_free[a.name]))
                    << what << ": " << t.name(&d) << " allocates " << a.name << " without waiting for task "
                    << last_free[a.name] << " to free it";
              }
              live[a.name] = t.id;
            }
            for (const auto& f : t.frees) {
              ASSERT_TRUE(live.count(f)) << what << ": " << t.name(&d) << " frees " << f << ", which is not alive";
              if (live[f] != t.id) {
                EXPECT_TRUE(p.depends_on(t.id, live[f])) << what << ": " << t.name(&d) << " frees " << f;
              }
              last_free[f] = t.id;
              live.erase(f);
            }
          }
          EXPECT_TRUE(live.empty()) << what << ": " << live.size() << " buffers outlive the step, e.g. "
                                    << (live.empty() ? "" : live.begin()->first);
        }
}

TEST(Plan, ShardedStateIsOneNthOfThePaddedTotal) {
  const model::ModelDesc d = small();
  for (int n = 1; n <= 4; ++n) {
    PlanConfig c;
    c.world = n;
    c.strategy = Strategy::fsdp;
    const Plan f = build_plan(d, c);
    EXPECT_EQ(f.static_memory.params * n, f.layout.total * 4);
    EXPECT_EQ(f.static_memory.optimizer * n, 2 * f.layout.total * 4);
    c.strategy = Strategy::ddp;
    const Plan ddp = build_plan(d, c);
    EXPECT_EQ(ddp.static_memory.params, ddp.layout.total * 4);
    EXPECT_EQ(ddp.static_memory.optimizer, 2 * ddp.layout.total * 4);
  }
}

TEST(Plan, NoCommunicationBeforeTheLastMicroStep) {
  PlanConfig c;
  c.world = 2;
  c.grad_accum = 3;
  for (Strategy s : {Strategy::ddp, Strategy::zero2, Strategy::fsdp}) {
    c.strategy = s;
    const Plan p = build_plan(small(), c);
    for (const Task& t : p.tasks) {
      if (t.op == Op::reduce_scatter || t.op == Op::all_reduce) {
        EXPECT_EQ(t.micro, 2) << t.name();
      }
    }
  }
}

TEST(Plan, DdpBucketsCoverEveryUnitOnce) {
  PlanConfig c;
  c.world = 2;
  c.strategy = Strategy::ddp;
  c.bucket_mb = 5;
  const model::ModelDesc d = small();
  const Plan p = build_plan(d, c);
  std::vector<int> covered(d.units.size(), 0);
  for (const Task& t : p.tasks)
    if (t.op == Op::all_reduce)
      for (int u = t.first_unit; u <= t.last_unit; ++u) ++covered[u];
  for (size_t u = 0; u < covered.size(); ++u) EXPECT_EQ(covered[u], 1) << "unit " << u;
}

TEST(Plan, RejectsAShardGroupThatDoesNotDivideTheRanks) {
  PlanConfig c;
  c.strategy = Strategy::hybrid;
  c.world = 4;
  c.shard_group = 3;
  EXPECT_THROW(build_plan(small(), c), std::invalid_argument);
}

}  // namespace
}  // namespace shardlm::plan
