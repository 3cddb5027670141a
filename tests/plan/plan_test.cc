#include "plan/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "plan/arena.h"
#include "tensor/disk_store.h"

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

// Either moment is the optimizer's kind: placed, laid out and sized alike, named apart as a buffer.
TEST(Plan, EachMomentIsPlacedAsTheOptimizerKind) {
  static_assert(kind_of(State::exp_avg_sq) == State::optimizer && kind_of(State::exp_avg) == State::optimizer);
  static_assert(kind_of(State::params) == State::params && kind_of(State::grads) == State::grads);
  EXPECT_STREQ(to_string(State::exp_avg), "exp_avg");
  EXPECT_STREQ(to_string(State::exp_avg_sq), "exp_avg_sq");
  EXPECT_STREQ(kind_name(State::exp_avg_sq), "optimizer");
  EXPECT_STREQ(kind_name(State::grads), "grads");
  PlanConfig c;
  c.world = 2;
  c.strategy = Strategy::zero1;
  const model::ModelDesc d = small();
  const Plan p = build_plan(d, c);
  EXPECT_NE(p.held_total(State::optimizer), p.held_total(State::params));  // zero1: the moments are split
  EXPECT_EQ(p.held_total(State::exp_avg_sq), p.held_total(State::optimizer));
  for (int u = 0; u < static_cast<int>(d.units.size()); ++u) {
    EXPECT_EQ(&p.placed(State::exp_avg_sq, u), &p.placed(State::optimizer, u)) << u;
    EXPECT_EQ(p.held_offset(State::exp_avg_sq, u), p.held_offset(State::exp_avg, u)) << u;
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
    auto rotating = [&](int b) { return p.buffers[b].role == Role::gathered && p.buffers[b].unit != 0; };
    for (const Task& t : p.tasks) {
      for (int a : t.allocs)
        if (rotating(a)) ++alive;
      worst = std::max(worst, alive);
      for (int f : t.frees)
        if (rotating(f)) --alive;
      for (int a : t.hands_off)
        if (rotating(a)) ++alive;
      worst = std::max(worst, alive);
    }
    EXPECT_LE(worst, limit);
    EXPECT_GE(worst, 1);
  }
}

// A plan buffer is one id, so two lives of one buffer must never overlap in any order the
// dependencies allow: each allocation after the first depends on the free of the one before, and
// every allocation is freed within the step. Over both families (tied and untied heads), every
// strategy, micro-step count, gather limit, prefetch depth, recompute mode and forward-only plans.
void expect_no_buffer_alive_twice(const model::ModelDesc& d, const PlanConfig& c, const std::string& what) {
  const Plan p = build_plan(d, c);
  std::map<int, int> live;       // buffer -> allocating task
  std::map<int, int> last_free;  // buffer -> task that freed its previous life
  for (const Task& t : p.tasks) {
    for (int a : t.allocs) {
      const std::string& name = p.buffers[a].name;
      EXPECT_FALSE(live.count(a)) << what << ": " << name << " allocated twice in list order";
      if (last_free.count(a)) {
        EXPECT_TRUE(p.depends_on(t.id, last_free[a]))
            << what << ": " << t.name(&d) << " allocates " << name << " without waiting for task " << last_free[a]
            << " to free it";
      }
      live[a] = t.id;
    }
    for (int f : t.frees) {
      ASSERT_TRUE(live.count(f)) << what << ": " << t.name(&d) << " frees " << p.buffers[f].name << ", which is not alive";
      if (live[f] != t.id) {
        EXPECT_TRUE(p.depends_on(t.id, live[f])) << what << ": " << t.name(&d) << " frees " << p.buffers[f].name;
      }
      last_free[f] = t.id;
      live.erase(f);
    }
    for (int a : t.hands_off) {
      EXPECT_EQ(t.stream, kCompute) << what << ": only compute tasks hand buffers off";
      EXPECT_FALSE(live.count(a)) << what << ": " << p.buffers[a].name << " handed off while alive";
      if (last_free.count(a)) {
        EXPECT_TRUE(t.id == last_free[a] || p.depends_on(t.id, last_free[a])) << what;
      }
      live[a] = t.id;
    }
  }
  EXPECT_TRUE(live.empty()) << what << ": " << live.size() << " buffers outlive the step, e.g. "
                            << (live.empty() ? "" : p.buffers[live.begin()->first].name);
  // Every buffer a task names as an operand is alive while it runs (allocated by it or before, in
  // an order the deps force, and not yet freed).
  std::map<int, int> alloc_by, free_by;
  for (const Task& t : p.tasks) {
    for (int a : t.allocs) alloc_by[a] = t.id;
    for (int f : t.frees) free_by[f] = t.id;
    const Operands& io = t.io;
    std::vector<int> used = io.inputs;
    for (int b : {io.params, io.grads, io.borrowed_params, io.borrowed_grads, io.output, io.saved, io.recomputable,
                  io.forward_ws, io.backward_ws, io.grad_stream, io.staging, io.keep_into, io.restore_from})
      if (b >= 0) used.push_back(b);
    used.insert(used.end(), io.bucket.begin(), io.bucket.end());
    if (io.window >= 0) used.push_back(io.window);
    if (io.rollback >= 0) used.push_back(io.rollback);
    // Offloaded state (--offload) is used through its unit's window, which must be loaded.
    auto window = [&](State s, int u) {
      if (u >= 0 && p.window(static_cast<int>(s), u) >= 0) used.push_back(p.window(static_cast<int>(s), u));
    };
    const bool unit_task = t.op == Op::forward || t.op == Op::recompute || t.op == Op::head || t.op == Op::loss ||
                           t.op == Op::logits || t.op == Op::backward;
    if (unit_task && io.params < 0) window(State::params, t.unit);
    if ((t.op == Op::head || t.op == Op::backward) && io.grads < 0) window(State::grads, t.unit);
    if (unit_task && d.units[t.unit].borrows >= 0 && io.borrowed_params < 0) window(State::params, d.units[t.unit].borrows);
    if (t.op == Op::all_gather && t.first_unit < 0) window(State::params, t.unit);
    if (t.op == Op::reduce_scatter || (t.op == Op::grad_norm && t.unit >= 0)) window(State::grads, t.unit);
    if (t.op == Op::optimizer && t.unit >= 0)
      for (State s : {State::params, State::grads, State::exp_avg, State::exp_avg_sq}) window(s, t.unit);
    for (int b : used) {
      ASSERT_TRUE(alloc_by.count(b)) << what << ": " << t.name(&d) << " uses " << p.buffers[b].name << " before any allocation";
      const int a = alloc_by[b];
      EXPECT_TRUE(a == t.id || p.depends_on(t.id, a)) << what << ": " << t.name(&d) << " uses " << p.buffers[b].name;
      EXPECT_FALSE(free_by.count(b) && free_by[b] > alloc_by[b] && free_by[b] != t.id && free_by[b] < t.id)
          << what << ": " << t.name(&d) << " uses " << p.buffers[b].name << " after it was freed";
    }
    for (int a : t.hands_off) alloc_by[a] = t.id;  // alive for later tasks only
  }
  // Offloaded saved activations (--offload activations): written back after every forward use,
  // then reloaded before every backward-side use, in any order the deps allow; and their slots of
  // the activations file are 4 KiB-aligned, and two that share bytes (micro-steps take turns) are
  // never on disk together: one's reload precedes the other's write in any such order.
  int64_t file_end = 0;
  struct Slot {
    const BufferDesc* b;
    int write_back, reload;
  };
  std::vector<Slot> on_disk;
  for (const BufferDesc& b : p.buffers) {
    if (b.disk_offset < 0) continue;
    EXPECT_TRUE(b.role == Role::saved || b.role == Role::recomputable) << what << ": " << b.name;
    EXPECT_EQ(b.disk_offset % 4096, 0) << what << ": " << b.name;
    EXPECT_EQ(b.bytes % 4096, 0) << what << ": " << b.name;
    EXPECT_LE(b.disk_offset + b.bytes, p.activation_file_bytes) << what << ": " << b.name;
    file_end = std::max(file_end, b.disk_offset + b.bytes);
    int wb = -1, rl = -1;
    for (const Task& t : p.tasks) {
      if (t.io.window != b.id) continue;
      EXPECT_EQ(t.op == Op::write_back ? wb : rl, -1) << what << ": " << b.name << " copied twice";
      (t.op == Op::write_back ? wb : rl) = t.id;
    }
    ASSERT_TRUE(wb >= 0 && rl >= 0) << what << ": " << b.name << " has no write_back and reload";
    EXPECT_TRUE(p.depends_on(rl, wb)) << what << ": " << b.name << " reloaded before it is written";
    on_disk.push_back({&b, wb, rl});
    for (const Task& t : p.tasks) {
      if (t.io.saved != b.id && t.io.recomputable != b.id) continue;
      if (t.op == Op::forward) {
        EXPECT_TRUE(p.depends_on(wb, t.id)) << what << ": " << b.name << " written before " << t.name(&d);
      } else {
        EXPECT_TRUE(t.op == Op::backward || t.op == Op::recompute) << what << ": " << t.name(&d);
        EXPECT_TRUE(p.depends_on(t.id, rl)) << what << ": " << t.name(&d) << " reads " << b.name << " before its reload";
      }
    }
  }
  EXPECT_EQ(file_end, p.activation_file_bytes) << what;
  for (size_t i = 0; i < on_disk.size(); ++i)
    for (size_t j = i + 1; j < on_disk.size(); ++j) {
      const Slot &x = on_disk[i], &y = on_disk[j];
      if (x.b->disk_offset >= y.b->disk_offset + y.b->bytes || y.b->disk_offset >= x.b->disk_offset + x.b->bytes) continue;
      EXPECT_TRUE(p.depends_on(y.write_back, x.reload) || p.depends_on(x.write_back, y.reload))
          << what << ": " << x.b->name << " and " << y.b->name << " share bytes of the activations file and may be there together";
    }
}

// Every family (tied and untied heads; MoE with and without expert parallelism), every strategy, `accums` micro-step counts, gather
// limits, prefetch depths, recompute modes, all-gather buckets and partly kept units, on 4 ranks.
template <class Visit>
void each_training_config(const std::vector<int64_t>& accums, Visit visit) {
  model::ModelConfig tied = model::model_preset("llama-tiny", 256);
  tied.tie_embeddings = true;
  const std::vector<std::pair<std::string, model::ModelDesc>> models = {
      {"gpt2", model::describe(model::model_preset("tiny", 256))},
      {"llama", model::describe(model::model_preset("llama-tiny", 256))},
      {"llama tied", model::describe(tied)},
      // Staged units: three stages a pass, their exchanges left out (ep 1) or over ep (ep 2).
      {"moe", model::describe(model::model_preset("moe-tiny", 256))},
      {"moe ep2", model::describe(model::model_preset("moe-tiny", 256))}};
  for (const auto& [family, d] : models)
    for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
      for (int64_t accum : accums)
        for (int limit : {1, 2, 3, 4})
          for (int prefetch : {0, 1, 2, 3})
            for (model::Recompute r : {model::Recompute::none, model::Recompute::selective, model::Recompute::full,
                                       model::Recompute::selective_op})
              // All-gather buckets (only sharded parameters have gathers): off, two or three of
              // the tiny units' bf16 gathers (~0.1 MiB each) a bucket, a whole pass a bucket.
              for (double bucket : s == Strategy::fsdp || s == Strategy::hybrid ? std::vector<double>{0, 0.25, 100}
                                                                                   : std::vector<double>{0})
              // Half of every unit kept from its forward to its backward (which then gathers the rest).
              for (const std::string& keep : s == Strategy::fsdp || s == Strategy::hybrid ? std::vector<std::string>{"", "all:0.5"}
                                                                                          : std::vector<std::string>{""}) {
              if (r == model::Recompute::selective_op && d.config.family != model::Family::llama) continue;  // LLaMA only
              PlanConfig c;
              c.gather_bucket_mb = bucket;
              if (!keep.empty()) c.keep_gathered = {keep};
              c.strategy = s;
              c.world = 4;
              c.shard_group = 2;
              c.grad_accum = accum;
              c.max_gathers_in_flight = limit;
              c.prefetch_forward = c.prefetch_backward = prefetch;
              c.param_bytes = s == Strategy::fsdp || s == Strategy::hybrid ? 2 : 4;
              c.reduce_bytes = 2;
              c.recompute = r;
              c.ep = family == "moe ep2" ? 2 : 1;
              const std::string what = family + " " + to_string(s) + " accum " + std::to_string(accum) + " limit " +
                                       std::to_string(limit) + " prefetch " + std::to_string(prefetch) +
                                       " recompute " + model::to_string(r) + " gather bucket " + std::to_string(bucket) +
                                       " keep " + keep;
              visit(d, c, what);
            }
}

// A configuration whose micro-steps accumulate sharded gradients, and its twin reducing them
// each micro-step (or false: none).
bool reduces_each_micro_step(PlanConfig& c) {
  const bool sharded_grads = c.strategy == Strategy::zero2 || c.strategy == Strategy::fsdp || c.strategy == Strategy::hybrid;
  if (!sharded_grads || c.grad_accum == 1) return false;
  c.reduce_each_micro_step = true;
  return true;
}

// The step arena (plan/arena.h): two buffers whose bytes overlap are never alive together in any
// schedule the deps and stream order allow: every life of one ends before every life of the other
// begins (a hand-off at the end of the freeing task counts). Lives in a repeated micro-step that
// share bytes run on the compute stream only (so the runs keep them apart). The block holds the
// plan's dynamic peak (the list order is one schedule) and no more than every buffer end to end.
void expect_arena_keeps_live_buffers_apart(const model::ModelDesc& d, const Plan& p, const std::string& what) {
  const ArenaLayout layout = lay_out_arena(p);
  const size_t T = p.tasks.size();
  std::vector<std::vector<char>> before(T, std::vector<char>(T, 0));  // before[later][earlier]
  std::vector<int> prev_on_stream(T, -1), last(p.streams.size(), -1);
  for (const Task& t : p.tasks) prev_on_stream[t.id] = last[t.stream], last[t.stream] = t.id;
  for (size_t t = 0; t < T; ++t) {
    std::vector<int> stack{static_cast<int>(t)};
    while (!stack.empty()) {
      const int u = stack.back();
      stack.pop_back();
      std::vector<int> preds = p.tasks[u].deps;
      if (prev_on_stream[u] >= 0) preds.push_back(prev_on_stream[u]);
      for (int q : preds)
        if (!before[t][q]) before[t][q] = 1, stack.push_back(q);
    }
  }
  struct Life {
    int alloc, free;
    bool handed;
  };
  std::vector<std::vector<Life>> lives(p.buffers.size());
  for (const Task& t : p.tasks) {
    for (int a : t.allocs) lives[a].push_back({t.id, -1, false});
    for (int f : t.frees) lives[f].back().free = t.id;
    for (int a : t.hands_off) lives[a].push_back({t.id, -1, true});
  }
  auto ends_before = [&](const Life& x, const Life& y) {
    return x.free >= 0 && (x.free == y.alloc ? y.handed : before[y.alloc][x.free] != 0);
  };
  auto repeated = [&](const Life& l) {
    return p.repeat.micro >= 0 && (p.tasks[l.alloc].micro == p.repeat.micro || p.tasks[l.free].micro == p.repeat.micro);
  };
  auto compute_only = [&](const Life& l) { return p.tasks[l.alloc].stream == kCompute && p.tasks[l.free].stream == kCompute; };
  int64_t end_to_end = 0;
  for (const BufferDesc& a : p.buffers) {
    if (lives[a.id].empty() || a.bytes == 0) continue;
    const int64_t at = layout.offset[a.id];
    ASSERT_GE(at, 0) << what << ": " << a.name << " has no place in the arena";
    EXPECT_EQ(at % kArenaAlign, 0) << what << ": " << a.name;
    EXPECT_LE(at + a.bytes, layout.bytes) << what << ": " << a.name;
    end_to_end += (a.bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
    for (const BufferDesc& b : p.buffers) {
      if (b.id <= a.id || lives[b.id].empty() || b.bytes == 0) continue;
      const int64_t bt = layout.offset[b.id];
      if (bt >= at + a.bytes || at >= bt + b.bytes) continue;  // apart
      for (const Life& x : lives[a.id])
        for (const Life& y : lives[b.id]) {
          EXPECT_TRUE(ends_before(x, y) || ends_before(y, x))
              << what << ": " << a.name << " (tasks " << x.alloc << ".." << x.free << ") and " << b.name << " (tasks " << y.alloc
              << ".." << y.free << ") share bytes and may be alive together";
          if (repeated(x) && repeated(y)) {
            EXPECT_TRUE(compute_only(x) && compute_only(y)) << what << ": " << a.name << " and " << b.name << " in the repeated micro-step";
          }
        }
    }
  }
  const MemSnapshot peak = p.peak_memory();
  const auto& s = p.static_memory;
  EXPECT_GE(layout.bytes, peak.total - (s.params + s.grads + s.optimizer + s.snapshot + s.staging)) << what;
  EXPECT_LE(layout.bytes, end_to_end) << what;
  (void)d;
}

TEST(Plan, ArenaKeepsBuffersAliveTogetherApartInAnyScheduleTheDepsAllow) {
  each_training_config({1, 2, 6}, [](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    if (c.max_gathers_in_flight % 2 == 0 || c.prefetch_forward % 2 == 1) return;  // limits 1, 3; prefetch 0, 2
    expect_arena_keeps_live_buffers_apart(d, build_plan(d, c), what);
    if (PlanConfig e = c; reduces_each_micro_step(e))
      expect_arena_keeps_live_buffers_apart(d, build_plan(d, e), what + " reduce each micro-step");
    if (c.max_gathers_in_flight == 1) {  // the disk tier's windows and activation slots, micro-steps unrolled
      c.offload.kinds = {true, true, true};
      c.offload.activations = true;
      expect_arena_keeps_live_buffers_apart(d, build_plan(d, c), what + " offload");
      c.pipeline_optimizer = true;
      expect_arena_keeps_live_buffers_apart(d, build_plan(d, c), what + " offload pipelined");
    }
  });
}

TEST(Plan, ABufferIsNeverAliveTwiceInAnyScheduleTheDepsAllow) {
  each_training_config({1, 2, 3, 6}, [](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    expect_no_buffer_alive_twice(d, c, what);
    if (PlanConfig e = c; c.max_gathers_in_flight == 2 && reduces_each_micro_step(e))
      expect_no_buffer_alive_twice(d, e, what + " reduce each micro-step");
    if (c.recompute != model::Recompute::none && c.grad_accum <= 2) {  // one block of the two rebuilt
      PlanConfig one = c;
      one.recompute_blocks = 1;
      expect_no_buffer_alive_twice(d, one, what + " on 1 block");
    }
    if (c.grad_accum == 1 && c.recompute == model::Recompute::none) {
      c.mode = PlanConfig::Mode::loss;
      expect_no_buffer_alive_twice(d, c, what + " loss");
      c.mode = PlanConfig::Mode::logits;
      expect_no_buffer_alive_twice(d, c, what + " logits");
    }
  });
}

// The offload pass: every use of offloaded state finds its window loaded (by a reload, or the
// zero-filled first window of a step's gradients) in any schedule the deps allow, and no window is
// alive twice, for every family, strategy (and one process), prefetch depths, recompute modes,
// gather buckets and partly kept units, micro-step counts (gradients accumulated whole or reduced
// each micro-step; past kUnrolledMicroSteps, every micro-step listed), in training and forward-only
// plans. DDP and ZeRO-1 reduce a unit whose gradients are on disk as a bucket of its own.
TEST(Plan, OffloadedStateIsInItsWindowForEveryUse) {
  each_training_config({1, 2, 6}, [](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    if (c.max_gathers_in_flight != 2 || c.prefetch_forward != 1) return;  // orthogonal to offload; keeps it quick
    if (c.strategy == Strategy::zero1 && c.grad_accum == 1) c.world = 1, c.ep = 1;  // one process (runs as ddp)
    for (int depth : {0, 1, 3}) {
      SCOPED_TRACE(what + " offload prefetch " + std::to_string(depth));
      c.offload.kinds = {true, true, true};
      c.offload.prefetch = depth;
      const std::string w = what + " offload prefetch " + std::to_string(depth);
      expect_no_buffer_alive_twice(d, c, w);
      PlanConfig pipelined = c;  // the sums of squares in the backward, the updates after it
      pipelined.pipeline_optimizer = true;
      expect_no_buffer_alive_twice(d, pipelined, w + " pipelined");
      if (PlanConfig e = c; reduces_each_micro_step(e)) expect_no_buffer_alive_twice(d, e, w + " reduce each micro-step");
      const Plan p = build_plan(d, c);
      EXPECT_EQ(p.static_memory.params + p.static_memory.grads + p.static_memory.optimizer, 0) << w;
      EXPECT_EQ(p.repeat.micro, -1) << w << ": the offload pass sees every micro-step";
      // Windows come and go only with the compute stream (so the walk is the allocator's figure),
      // in training and forward-only plans (whose first reloads a window_sync opens).
      auto only_compute = [&](const Plan& q, const std::string& what) {
        for (const Task& t : q.tasks)
          for (const std::vector<int>* v : {&t.allocs, &t.frees, &t.hands_off})
            for (int b : *v)
              if (q.buffers[b].role == Role::window) { EXPECT_EQ(t.stream, kCompute) << what << ": " << t.name(&d) << " " << q.buffers[b].name; }
      };
      only_compute(p, w);
      only_compute(build_plan(d, pipelined), w + " pipelined");
      PlanConfig logits = c;
      logits.mode = PlanConfig::Mode::logits;
      logits.recompute = model::Recompute::none;
      only_compute(build_plan(d, logits), w + " logits");
      for (int u = 0; u < static_cast<int>(d.units.size()); ++u)
        EXPECT_EQ(p.placed(State::params, u).where, Location::disk) << w;
      if (c.recompute == model::Recompute::none) {
        PlanConfig f = c;
        f.mode = PlanConfig::Mode::loss;
        expect_no_buffer_alive_twice(d, f, w + " loss");
      }
    }
    // A per-unit choice (the budget's): each kind on disk for every other unit, staggered.
    c.offload.kinds = {};
    c.offload.prefetch = 1;
    c.offload.units.assign(d.units.size(), {});
    for (size_t u = 0; u < d.units.size(); ++u)
      for (int k = 0; k < kNumStateKinds; ++k) c.offload.units[u][k] = (u + k) % 2 == 0;
    expect_no_buffer_alive_twice(d, c, what + " mixed placement");
    const Plan p = build_plan(d, c);
    for (int u = 0; u < static_cast<int>(d.units.size()); ++u)
      for (int k = 0; k < kNumStateKinds; ++k)
        if (p.placed(State(k), u).parts > 0) {
          EXPECT_EQ(p.on_disk(State(k), u), (u + k) % 2 == 0) << what << " unit " << u << " kind " << k; }
    // A gradient bucket is a range of the flat buffer in memory, or one unit's window.
    for (const Task& t : p.tasks)
      if (t.op == Op::all_reduce && t.first_unit >= 0)
        for (int u = t.first_unit; u <= t.last_unit; ++u)
          if (p.on_disk(State::grads, u)) { EXPECT_EQ(t.first_unit, t.last_unit) << what << ": " << t.name(&d); }
  });
}

// gpt2-124m: each offloaded kind's peak in memory falls by its resident state, less what its
// windows hold at once (at most prefetch + 2 units' worth: the tied embedding, a third of the
// model, is one unit and so one window), one process and fsdp at 2 ranks; a kind left resident is
// untouched.
// --offload activations, alone and with every kind of state (and the pipelined optimizer): every
// use of an offloaded activation finds it loaded (expect_no_buffer_alive_twice), its allocations
// and frees are the compute stream's, what a recompute rebuilds is never offloaded, and beyond
// the first prefetch + 1 consumers every block's saved activations are.
TEST(Plan, OffloadedActivationsAreLoadedForEveryUse) {
  int offloaded = 0;
  each_training_config({1, 2, 6}, [&](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    if (c.max_gathers_in_flight != 2 || c.prefetch_forward != 1) return;  // orthogonal to offload; keeps it quick
    if (c.strategy == Strategy::zero1 && c.grad_accum == 1) c.world = 1, c.ep = 1;  // one process (runs as ddp)
    for (int depth : {0, 1, 3})
      for (bool state : {false, true}) {
        const std::string w = what + " offload activations" + (state ? ",state" : "") + " prefetch " + std::to_string(depth);
        SCOPED_TRACE(w);
        c.offload.activations = true;
        c.offload.kinds = {state, state, state};
        c.offload.prefetch = depth;
        expect_no_buffer_alive_twice(d, c, w);
        PlanConfig pipelined = c;
        pipelined.pipeline_optimizer = true;
        expect_no_buffer_alive_twice(d, pipelined, w + " pipelined");
        const Plan p = build_plan(d, c);
        std::set<int> moved_units;
        for (const BufferDesc& b : p.buffers) {
          if (b.disk_offset < 0) continue;
          moved_units.insert(b.unit);
          ++offloaded;
        }
        for (const Task& t : p.tasks) {
          for (const std::vector<int>* v : {&t.allocs, &t.frees, &t.hands_off})
            for (int b : *v)
              if (p.buffers[b].disk_offset >= 0) { EXPECT_EQ(t.stream, kCompute) << w << ": " << t.name(&d) << " " << p.buffers[b].name; }
          // A rebuilt buffer is never written out.
          if (t.op == Op::recompute) {
            for (int a : t.allocs) EXPECT_LT(p.buffers[a].disk_offset, 0) << w << ": " << p.buffers[a].name; }
        }
        // Blocks (units whose forward keeps something other than rebuilt activations) beyond
        // the first prefetch + 1 the backward reaches are offloaded.
        if (c.recompute != model::Recompute::full && d.config.n_layer > depth + 1) {
          EXPECT_EQ(static_cast<int>(moved_units.size()) >= d.config.n_layer - depth - 1, true)
              << w << ": " << moved_units.size() << " units offloaded";
        } else if (c.recompute == model::Recompute::full) {
          EXPECT_EQ(p.activation_file_bytes, 0) << w << ": full recompute keeps nothing to offload";
        }
        // Every micro-step writes out the same bytes, into the same slots: the file is one
        // micro-step's.
        std::vector<int64_t> written(c.grad_accum, 0);
        for (const Task& t : p.tasks)
          if (t.op == Op::write_back && p.buffers[t.io.window].disk_offset >= 0) written[t.micro] += p.buffers[t.io.window].bytes;
        for (int64_t m = 0; m < c.grad_accum; ++m) EXPECT_EQ(written[m], p.activation_file_bytes) << w << " micro-step " << m;
        if (PlanConfig e = c; reduces_each_micro_step(e)) expect_no_buffer_alive_twice(d, e, w + " reduce each micro-step");
        PlanConfig loss = c;  // forward-only plans keep no activations: nothing moves
        loss.mode = PlanConfig::Mode::loss;
        loss.recompute = model::Recompute::none;
        EXPECT_EQ(build_plan(d, loss).activation_file_bytes, 0) << w;
      }
  });
  EXPECT_GT(offloaded, 0);
}

// `small` B8 T256: the activations' peak with --offload activations falls to what prefetch + 2
// blocks' saved activations (plus what is never offloaded) take, well under the resident one;
// the other categories are untouched, and with every kind of state on disk too nothing else
// changes; with gradients accumulated over micro-steps the peak and the file stay one
// micro-step's.
TEST(Plan, OffloadedActivationsPeakAtAboutPrefetchPlusTwoBlocks) {
  const model::ModelDesc d = small();
  PlanConfig c;
  c.batch = 8;
  c.seq = 256;
  const Plan resident = build_plan(d, c);
  c.offload.activations = true;
  const Plan p = build_plan(d, c);
  const MemSnapshot res = resident.max_memory(), off = p.max_memory();
  int64_t block = 0, moved = 0;  // one block's offloaded bytes (the smallest, less its padding), all of them
  std::map<int, int64_t> per_unit;
  for (const BufferDesc& b : p.buffers)
    if (b.disk_offset >= 0) per_unit[b.unit] += b.bytes, moved += b.bytes;
  for (const auto& [u, bytes] : per_unit) block = block ? std::min(block, bytes - 2 * 4096) : bytes - 2 * 4096;
  ASSERT_GT(block, 0);
  const int L = static_cast<int>(d.config.n_layer), depth = c.offload.prefetch;
  EXPECT_EQ(static_cast<int>(per_unit.size()), L - depth - 1);  // the last prefetch + 1 blocks stay
  // The peak holds at most prefetch + 2 of the L blocks' activations: it is down by at least the others'.
  EXPECT_LE(off[MemCategory::activations], res[MemCategory::activations] - (L - depth - 2) * block);
  for (MemCategory k : {MemCategory::params, MemCategory::grads, MemCategory::optimizer, MemCategory::workspace})
    EXPECT_EQ(off[k], res[k]) << to_string(k);
  const std::string text = p.to_text(d);
  EXPECT_NE(text.find("saved activation buffers"), std::string::npos) << text;
  std::printf("small B8 T256: activations peak %.1f MiB resident -> %.1f MiB offloaded (%zu blocks, %.1f MiB each, "
              "%.1f MiB to disk a step)\n",
              res[MemCategory::activations] / 1048576.0, off[MemCategory::activations] / 1048576.0, per_unit.size(),
              block / 1048576.0, moved / 1048576.0);
  c.offload.kinds = {true, true, true};
  const MemSnapshot all = build_plan(d, c).max_memory();
  EXPECT_EQ(all[MemCategory::activations], off[MemCategory::activations]);
  c.offload.kinds = {false, false, false};
  for (int64_t accum : {2, 6}) {
    c.grad_accum = accum;
    const Plan a = build_plan(d, c);
    EXPECT_EQ(a.max_memory()[MemCategory::activations], off[MemCategory::activations]) << accum;
    EXPECT_EQ(a.activation_file_bytes, p.activation_file_bytes) << accum;
    EXPECT_NE(a.to_text(d).find("the micro-steps take turns in a file of"), std::string::npos) << accum;
  }
}

// The offload tests' gpt2-124m configuration: B2 T128 over `world` ranks (fsdp).
PlanConfig b2_t128(int world) {
  PlanConfig c;
  c.world = world;
  c.batch = 2;
  c.seq = 128;
  return c;
}

TEST(Plan, OffloadDropsTheResidentFiguresOfTheOffloadedKinds) {
  const model::ModelDesc d = model::describe(model::model_preset("gpt2-124m"));
  for (int world : {1, 2}) {
    PlanConfig c = b2_t128(world);
    const Plan resident = build_plan(d, c);
    c.offload.kinds = {true, false, true};  // params and optimizer, gradients resident
    const Plan p = build_plan(d, c);
    const MemSnapshot off = p.max_memory(), res = resident.max_memory();
    EXPECT_EQ(p.static_memory.params, 0);
    EXPECT_EQ(p.static_memory.optimizer, 0);
    EXPECT_EQ(p.static_memory.grads, resident.static_memory.grads);
    EXPECT_EQ(off[MemCategory::grads], res[MemCategory::grads]);
    std::map<MemCategory, int64_t> largest;
    for (const BufferDesc& b : p.buffers)
      if (b.role == Role::window) largest[b.category] = std::max(largest[b.category], b.bytes);
    const int64_t bound = c.offload.prefetch + 2;
    EXPECT_LT(off[MemCategory::params], res[MemCategory::params]) << world;
    EXPECT_LE(off[MemCategory::params], res[MemCategory::params] - resident.static_memory.params + bound * largest[MemCategory::params]) << world;
    EXPECT_LT(off[MemCategory::optimizer], res[MemCategory::optimizer]) << world;
    EXPECT_LE(off[MemCategory::optimizer], 2 * bound * largest[MemCategory::optimizer]) << world;
    const std::string text = p.to_text(d);
    EXPECT_NE(text.find("params: u0-u"), std::string::npos);
    EXPECT_NE(text.find(", disk"), std::string::npos);
    EXPECT_NE(text.find("offload: on disk"), std::string::npos);
    std::printf("gpt2-124m %d rank(s): params peak %.0f -> %.0f MiB, optimizer peak %.0f -> %.0f MiB\n", world,
                res[MemCategory::params] / 1048576.0, off[MemCategory::params] / 1048576.0,
                res[MemCategory::optimizer] / 1048576.0, off[MemCategory::optimizer] / 1048576.0);
  }
}

// A resident head (Placement::resident, the budget's use of what whole units leave): each unit's
// part on disk but its first half (whole 4 KiB pages) in memory. The static memory is the heads,
// the windows are the whole parts as before, each copy moves the rest to or from the file and the
// head within memory, the files shrink by the heads, and the peak rises by exactly the heads'
// bytes (the windows' schedule is unchanged), one process and fsdp at 2 ranks. A head that is not
// whole pages, or all of the part, is refused.
TEST(Plan, AResidentHeadStaysInMemoryAndTheCopiesMoveOnlyTheRest) {
  const model::ModelDesc d = model::describe(model::model_preset("gpt2-124m"));
  for (int world : {1, 2}) {
    PlanConfig c = b2_t128(world);
    c.offload.kinds = {true, true, true};
    const Plan full = build_plan(d, c);
    const int U = static_cast<int>(d.units.size());
    c.offload.resident.assign(U, {});
    std::array<int64_t, kNumStateKinds> heads{};
    for (int u = 0; u < U; ++u)
      for (int k = 0; k < kNumStateKinds; ++k) {
        const int64_t half = full.held_elems(State(k), u) / 2 / kResidentGrain * kResidentGrain;
        c.offload.resident[u][k] = half;
        heads[k] += half;
      }
    ASSERT_GT(heads[0], 0);
    const Plan p = build_plan(d, c);
    expect_no_buffer_alive_twice(d, c, "gpt2-124m resident heads " + std::to_string(world));
    EXPECT_EQ(p.static_memory.params, 4 * heads[0]) << world;
    EXPECT_EQ(p.static_memory.grads, 4 * heads[1]) << world;
    EXPECT_EQ(p.static_memory.optimizer, 8 * heads[2]) << world;
    const int64_t head_bytes = 4 * (heads[0] + heads[1] + 2 * heads[2]);
    EXPECT_EQ(full.disk_bytes() - p.disk_bytes(), head_bytes) << world;
    EXPECT_EQ(p.peak_memory().total, full.peak_memory().total + head_bytes) << world;
    int copies = 0;
    for (const Task& t : p.tasks) {
      if (t.op != Op::reload && t.op != Op::write_back) continue;
      ++copies;
      const BufferDesc& w = p.buffers[t.io.window];
      const State k = w.category == MemCategory::params ? State::params
                          : w.category == MemCategory::grads ? State::grads : State::optimizer;
      const int64_t n = p.held_elems(k, t.unit), head = p.placed(k, t.unit).resident;
      EXPECT_EQ(head, c.offload.resident[t.unit][static_cast<int>(k)]);
      EXPECT_EQ(w.bytes, full.window_bytes(k, t.unit)) << t.name(&d);
      EXPECT_EQ(t.bytes, disk_aligned(4 * (n - head))) << t.name(&d);
      EXPECT_EQ(t.copy_bytes, 4 * head) << t.name(&d);
    }
    EXPECT_GT(copies, 0);
    const std::string text = p.to_text(d);
    EXPECT_NE(text.find("elements of each part, in memory"), std::string::npos) << text;

    PlanConfig bad = c;
    bad.offload.resident[1][0] = kResidentGrain / 2;
    EXPECT_THROW(build_plan(d, bad), std::logic_error);
    bad.offload.resident[1][0] = full.held_elems(State::params, 1);
    EXPECT_THROW(build_plan(d, bad), std::logic_error);
  }
}

TEST(Plan, OffloadRefusesAReadAheadOutOfRangeWithOneLine) {
  PlanConfig c;
  c.offload.kinds = {true, true, true};
  for (int depth : {-1, kMaxOffloadPrefetchDepth + 1}) {
    c.offload.prefetch = depth;
    try {
      build_plan(small(), c);
      FAIL() << "--offload-prefetch " << depth;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--offload-prefetch"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("[0, 64], got " + std::to_string(depth)), std::string::npos) << e.what();
    }
  }
  c.offload.prefetch = kMaxOffloadPrefetchDepth;
  EXPECT_NO_THROW(build_plan(small(), c));
}

// The optimizer overlap pass (--pipeline-optimizer): each unit's update waits for every task
// writing its gradients, and at least one can run during the backward (it does not wait for the last one); the commit waits for every
// update and for the norm, and whatever reads the updated state after the step (ZeRO's
// param_gather) waits for the commit; no buffer is alive twice, in every family, strategy,
// micro-step count (a repeated one too), recompute mode, gather bucket and partly kept unit.
TEST(Plan, PipelinedUpdatesWaitForTheirGradientsAndTheCommitForThemAll) {
  int pipelined = 0;
  each_training_config({1, 3, 6}, [&](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    if (c.max_gathers_in_flight != 2 || c.prefetch_forward != 1) return;  // orthogonal to the pass; keeps it quick
    c.pipeline_optimizer = true;
    c.bucket_mb = 0.05;  // ddp / zero1: more than one gradient bucket, so some are reduced during the backward
    SCOPED_TRACE(what);
    expect_no_buffer_alive_twice(d, c, what + " pipelined");
    const Plan p = build_plan(d, c);
    const int U = static_cast<int>(d.units.size());
    std::vector<int> update(U, -1), norm(U, -1);
    int commit = -1, last_backward = -1;
    for (const Task& t : p.tasks) {
      if (t.op == Op::optimizer) update[t.unit] = t.id;
      if (t.op == Op::grad_norm) norm[t.unit] = t.id;
      if (t.op == Op::optimizer_commit) commit = t.id;
      if (t.op == Op::backward) last_backward = t.id;
      EXPECT_FALSE((t.op == Op::optimizer || t.op == Op::grad_norm) && t.unit < 0) << t.name(&d);
    }
    ASSERT_GE(commit, 0);
    bool overlaps = false;
    for (int u = 0; u < U; ++u) {
      ASSERT_GE(update[u], 0) << d.units[u].name;
      ASSERT_GE(p.tasks[update[u]].io.rollback, 0);
      EXPECT_TRUE(p.depends_on(commit, update[u]) && p.depends_on(commit, norm[u])) << d.units[u].name;
      EXPECT_TRUE(p.depends_on(update[u], norm[u]));
      overlaps = overlaps || !p.depends_on(update[u], last_backward);
    }
    EXPECT_TRUE(overlaps) << "no update can run during the backward";
    for (const Task& t : p.tasks) {
      if (t.op == Op::param_gather || t.op == Op::loss_reduce) { EXPECT_TRUE(p.depends_on(t.id, commit)) << t.name(&d); }
      if (t.op == Op::optimizer || t.op == Op::grad_norm || t.op == Op::optimizer_commit) continue;
      for (const StateTouch& x : state_touches(p, d, t))
        if (x.state == State::grads && x.write) {
          EXPECT_TRUE(p.depends_on(update[x.unit], t.id)) << t.name(&d) << " writes gradients its unit's update may not see";
          EXPECT_TRUE(p.depends_on(norm[x.unit], t.id)) << t.name(&d);
        }
    }
    ++pipelined;
  });
  EXPECT_GT(pipelined, 100);
}

// With offloaded state the updates are deferred (a rollback copy would hold in memory what the
// disk keeps out of it): only each unit's sum of squares moves into the backward, right after its
// gradients' last writer while their window is still in memory, so the step reads the gradients
// from disk once fewer; the per-unit updates wait for the norm.
TEST(Plan, PipelinedOptimizerWithOffloadMovesOnlyTheNorms) {
  for (int world : {1, 2}) {
    PlanConfig c;
    c.world = world;
    c.offload.kinds = {true, true, true};
    const Plan plain = build_plan(small(), c);
    c.pipeline_optimizer = true;
    const Plan p = build_plan(small(), c);
    auto grad_reloads = [](const Plan& q) {
      int n = 0;
      for (const Task& t : q.tasks)
        if (t.op == Op::reload && q.buffers[t.io.window].name.rfind("window grads", 0) == 0) ++n;
      return n;
    };
    const int U = static_cast<int>(small().units.size());
    // (unpipelined, the last unit's gradients may still be in memory for its norm)
    EXPECT_LE(grad_reloads(p), grad_reloads(plain) - (U - 1)) << world << " rank(s)";
    int last_norm = -1, first_update = -1;
    for (const Task& t : p.tasks) {
      EXPECT_NE(t.op, Op::optimizer_commit);
      if (t.op == Op::grad_norm) last_norm = t.id;
      if (t.op == Op::optimizer && first_update < 0) first_update = t.id;
      if (t.op == Op::optimizer) { EXPECT_LT(t.io.rollback, 0); }
    }
    ASSERT_GE(first_update, 0);
    EXPECT_TRUE(p.depends_on(first_update, last_norm));
    for (const BufferDesc& b : p.buffers) EXPECT_NE(b.role, Role::rollback) << b.name;
  }
  PlanConfig f;
  f.pipeline_optimizer = true;
  f.mode = PlanConfig::Mode::loss;  // nothing to pipeline in a forward
  for (const Task& t : build_plan(small(), f).tasks) EXPECT_NE(t.op, Op::grad_norm);
}

// One task run as the tests compare them: what it does, which micro-step of the step it is, and
// the buffers it allocates and frees (by role and size: a repeated task's buffers keep their
// micro-step 2 names).
struct RunShape {
  Op op;
  int unit, first_unit, last_unit;
  int64_t micro, bytes;
  double flops;
  std::vector<std::tuple<Role, int64_t>> allocs, frees, hands_off;
  bool operator==(const RunShape&) const = default;
};

// Every task run of a step, stream by stream, and what each waits for as (stream, position).
struct Unrolled {
  std::vector<std::vector<RunShape>> runs;
  std::vector<std::vector<std::set<std::pair<int, size_t>>>> waits;
};

Unrolled unroll(const Plan& p) {
  Unrolled u;
  const int S = static_cast<int>(p.streams.size());
  u.runs.resize(S), u.waits.resize(S);
  std::map<std::pair<int, int64_t>, std::pair<int, size_t>> place;  // (task, run) -> (stream, position)
  for (int s = 0; s < S; ++s) {
    size_t position = 0;
    for (StreamWalk w(p, s); !w.done(); w.next()) place[{w.task(), w.run()}] = {s, position++};
  }
  auto shapes = [&](const std::vector<int>& ids) {
    std::vector<std::tuple<Role, int64_t>> out;
    for (int b : ids) out.emplace_back(p.buffers[b].role, p.buffers[b].bytes);
    return out;
  };
  for (int s = 0; s < S; ++s)
    for (StreamWalk w(p, s); !w.done(); w.next()) {
      const Task& t = p.tasks[w.task()];
      u.runs[s].push_back({t.op, t.unit, t.first_unit, t.last_unit, p.step_micro(t, w.run()), t.bytes, t.flops,
                           shapes(t.allocs), shapes(t.frees), shapes(t.hands_off)});
      std::set<std::pair<int, size_t>> waits;
      for (int d : t.deps) {
        const Plan::Wait wait = p.wait_for(t, w.run(), d);
        waits.insert(place.at({wait.task, wait.runs - 1}));
      }
      u.waits[s].push_back(waits);
    }
  return u;
}

// Past kUnrolledMicroSteps a plan lists four micro-steps and repeats the third; run out, it is
// the plan that lists every micro-step: the same task runs on every stream in the same order,
// each waiting on the same runs, allocating and freeing the same buffers.
TEST(Plan, ARepeatedMicroStepRunsAsTheUnrolledPlan) {
  int compared = 0;
  each_training_config({5, 7}, [&](const model::ModelDesc& d, PlanConfig c, const std::string& what) {
    if (PlanConfig e = c; c.max_gathers_in_flight == 2 && reduces_each_micro_step(e)) c = e;  // its repeats too
    const Plan repeated = build_plan(d, c);
    ASSERT_EQ(repeated.repeat.micro, 2) << what;
    ASSERT_EQ(repeated.repeat.times, c.grad_accum - 3) << what;
    c.unroll_micro_steps = true;
    const Plan whole = build_plan(d, c);
    ASSERT_EQ(whole.repeat.micro, -1) << what;
    const Unrolled a = unroll(repeated), b = unroll(whole);
    ASSERT_EQ(a.runs.size(), b.runs.size()) << what;
    for (size_t s = 0; s < a.runs.size(); ++s) {
      ASSERT_EQ(a.runs[s].size(), b.runs[s].size()) << what << " stream " << s;
      for (size_t i = 0; i < a.runs[s].size(); ++i) {
        EXPECT_TRUE(a.runs[s][i] == b.runs[s][i]) << what << " stream " << s << " run " << i;
        EXPECT_EQ(a.waits[s][i], b.waits[s][i]) << what << " stream " << s << " run " << i;
      }
    }
    const MemSnapshot pa = repeated.peak_memory(), pb = whole.peak_memory();
    for (int k = 0; k < kNumMemCategories; ++k) EXPECT_EQ(pa.bytes[k], pb.bytes[k]) << what;
    ++compared;
  });
  EXPECT_GT(compared, 1000);
}

// The plan's size does not grow with the accumulation.
TEST(Plan, AMillionMicroStepsAreAPlanOfFour) {
  PlanConfig c;
  c.strategy = Strategy::fsdp, c.world = 2;
  c.grad_accum = 4;
  const size_t four = build_plan(small(), c).tasks.size();
  c.grad_accum = 1000000;
  const Plan p = build_plan(small(), c);
  EXPECT_EQ(p.tasks.size(), four);
  EXPECT_EQ(p.repeat.times, 999997);
  const Task& last = p.tasks.back();
  EXPECT_EQ(p.step_micro(last, 0), 999999);
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

// --reduce-each-micro-step: every micro-step reduce-scatters each unit once (hybrid's all-reduce
// over the replicas stays one a step, on the summed shard), a micro-step's full gradients are
// allocated and freed within it, and the gradient peak is one micro-step's: the plan without
// accumulation's, below accumulating whole gradients. Off where it means nothing; refused by the
// strategies that keep whole gradients.
TEST(Plan, ReducingEachMicroStepKeepsFullGradientsWithinTheMicroStep) {
  int checked = 0;
  for (const char* name : {"tiny", "llama-tiny", "moe-tiny"}) {
    const model::ModelDesc d = model::describe(model::model_preset(name, 128));
    for (Strategy s : {Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
      for (int64_t accum : {2, 3, 6}) {
        PlanConfig c;
        c.strategy = s, c.world = 4, c.shard_group = 2, c.seq = 128, c.grad_accum = accum;
        const std::string what = std::string(name) + " " + to_string(s) + " accum " + std::to_string(accum);
        const Plan whole = build_plan(d, c);
        PlanConfig one = c;
        one.grad_accum = 1;
        const Plan single = build_plan(d, one);
        c.reduce_each_micro_step = true;
        const Plan each = build_plan(d, c);
        ASSERT_TRUE(each.config.reduce_each_micro_step) << what;
        auto count = [](const Plan& p, Op op, int micro) {
          int n = 0;
          for (const Task& t : p.tasks) n += t.op == op && t.micro == micro;
          return n;
        };
        const int units = count(whole, Op::reduce_scatter, whole.tasks.back().micro);
        ASSERT_GT(units, 0) << what;
        const int last = static_cast<int>(std::min<int64_t>(accum, kUnrolledMicroSteps)) - 1;
        for (int m = 0; m <= last; ++m) {
          EXPECT_EQ(count(each, Op::reduce_scatter, m), units) << what << " micro " << m;
          EXPECT_EQ(count(each, Op::all_reduce, m), m == last ? count(whole, Op::all_reduce, m) : 0) << what << " micro " << m;
        }
        std::map<int, int> alloc_micro;
        for (const Task& t : each.tasks) {
          for (int b : t.allocs)
            if (each.buffers[b].role == Role::full_grads) alloc_micro[b] = t.micro;
          for (int b : t.frees)
            if (each.buffers[b].role == Role::full_grads) { EXPECT_EQ(t.micro, alloc_micro.at(b)) << what << " " << each.buffers[b].name; }
        }
        const int g = static_cast<int>(MemCategory::grads);
        EXPECT_EQ(each.peak_memory().bytes[g], single.peak_memory().bytes[g]) << what;
        EXPECT_LT(each.peak_memory().bytes[g], whole.peak_memory().bytes[g]) << what;
        ++checked;
      }
    PlanConfig c;
    c.world = 4, c.seq = 128, c.grad_accum = 2, c.reduce_each_micro_step = true;
    for (Strategy s : {Strategy::ddp, Strategy::zero1}) {
      c.strategy = s;
      try {
        build_plan(d, c);
        ADD_FAILURE() << to_string(s) << " reduced each micro-step";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("reduce_each_micro_step (--reduce-each-micro-step)"), std::string::npos) << e.what();
      }
    }
    c.strategy = Strategy::fsdp, c.grad_accum = 1;
    EXPECT_FALSE(build_plan(d, c).config.reduce_each_micro_step);
    c.world = 1, c.grad_accum = 2;
    EXPECT_FALSE(build_plan(d, c).config.reduce_each_micro_step);
  }
  EXPECT_EQ(checked, 27);
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

// The parameter gather pass reads the placement: where the optimizer state is split over axes the
// parameters are not (ZeRO-1/2, experts over ep as well), every unit's updated parts are gathered
// after the optimizer over exactly those axes, before the loss's reduction; where each rank
// updates all it holds (DDP, FSDP, hybrid, one rank), nothing is.
TEST(Plan, ParamGathersFollowTheOptimizerWhereItUpdatesPartOfWhatARankHolds) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
    for (int world : {1, 4}) {
      PlanConfig c;
      c.strategy = s, c.world = world, c.shard_group = 2, c.ep = world > 1 ? 2 : 1;
      const Plan p = build_plan(moe, c);
      const std::string what = std::string(to_string(s)) + " on " + std::to_string(world);
      const bool zero = world > 1 && (s == Strategy::zero1 || s == Strategy::zero2);
      int gathers = 0, optimizer = -1, loss_reduce = -1;
      for (const Task& t : p.tasks) {
        if (t.op == Op::optimizer) optimizer = t.id;
        if (t.op == Op::loss_reduce) loss_reduce = t.id;
        if (t.op != Op::param_gather) continue;
        ++gathers;
        EXPECT_EQ(t.deps, std::vector<int>{optimizer}) << what << ": " << t.name(&moe);
        EXPECT_EQ(loss_reduce, -1) << what << ": " << t.name(&moe) << " after the loss's reduction";
        std::vector<int> extra;
        for (int a : p.placed(State::optimizer, t.unit).axes) {
          const std::vector<int>& held = p.placed(State::params, t.unit).axes;
          if (std::find(held.begin(), held.end(), a) == held.end()) extra.push_back(a);
        }
        EXPECT_EQ(t.axes, extra) << what << ": " << t.name(&moe);
        EXPECT_EQ(t.bytes, p.compute_elems(moe, t.unit) * 4) << what << ": " << t.name(&moe);
      }
      EXPECT_EQ(gathers, zero ? static_cast<int>(moe.units.size()) : 0) << what;
    }
}

// The axes of `axes` but unit u's slicing axis (a MoE block's experts over ep are reduced and
// gathered only among the ranks holding the same experts).
std::vector<int> within_slice(const Plan& p, const model::ModelDesc& d, std::vector<int> axes, int u) {
  const int a = p.mesh.find(d.units[u].sliced_over);
  axes.erase(std::remove(axes.begin(), axes.end(), a), axes.end());
  return axes;
}

// Every layout a small model plans under: each strategy at 1, 2 and 4 ranks, with ep and cp where
// they divide, with and without accumulation and each micro-step's reduction.
template <class Check>
void for_each_layout(Check check) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  const model::ModelDesc gpt = model::describe(model::model_preset("tiny", 256));
  for (const model::ModelDesc* d : {&moe, &gpt})
    for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
      for (int world : {1, 2, 4})
        for (int ep : {1, 2})
          for (int cp : {1, 2})
            for (int accum : {1, 3})
              for (bool each : {false, true}) {
                if (ep * cp > world || (ep > 1 && d != &moe)) continue;
                if (each && (s == Strategy::ddp || s == Strategy::zero1)) continue;
                PlanConfig c;
                c.strategy = s, c.world = world, c.ep = ep, c.cp = cp, c.grad_accum = accum;
                c.shard_group = world == 4 && ep * cp == 1 ? 2 : world;
                c.reduce_each_micro_step = each;
                c.batch = 2, c.seq = 64;
                const std::string what = std::string(d == &moe ? "moe-tiny " : "tiny ") + to_string(s) + " on " +
                                         std::to_string(world) + " ep " + std::to_string(ep) + " cp " +
                                         std::to_string(cp) + " accum " + std::to_string(accum) + (each ? " each" : "");
                check(*d, build_plan(*d, c), what);
              }
}

// The gradient reduction pass reads the placement: a unit whose gradients are placed split is
// reduce-scattered over the axes that split them (every micro-step where each reduces), and its
// shard then summed over the rest (hybrid's replicas); a unit held whole is in one all_reduce
// bucket. Either way each unit's gradients of the step are summed over exactly the ranks that read
// other batches or other positions (within its slice), once.
TEST(Plan, GradientsAreSummedOnceOverTheRanksTheirPlacementSays) {
  for_each_layout([](const model::ModelDesc& d, const Plan& p, const std::string& what) {
    int last = 0;
    for (const Task& t : p.tasks) last = std::max(last, t.micro);
    for (int u = 0; u < static_cast<int>(d.units.size()); ++u) {
      const Placement& g = p.placed(State::grads, u);
      const bool split = !within_slice(p, d, g.axes, u).empty();
      const int summed = p.mesh.group_size(within_slice(p, d, p.grad_axes(), u));
      int64_t ranks = 1;
      std::set<int> scattered_in;
      int collectives = 0;
      for (const Task& t : p.tasks) {
        const bool covers = t.unit == u || (t.unit < 0 && t.first_unit <= u && u <= t.last_unit);
        if (!covers || (t.op != Op::reduce_scatter && t.op != Op::all_reduce)) continue;
        if (t.op == Op::reduce_scatter) {
          EXPECT_TRUE(split) << what << ": " << t.name(&d);
          EXPECT_EQ(t.axes, within_slice(p, d, g.axes, u)) << what << ": " << t.name(&d);
          scattered_in.insert(t.micro);
        }
        if (t.micro != last) continue;
        ++collectives;
        ranks *= p.mesh.group_size(t.axes);
      }
      EXPECT_EQ(ranks, summed) << what << ": unit " << d.units[u].name;
      EXPECT_LE(collectives, 2) << what << ": unit " << d.units[u].name;
      if (split && summed > 1 && p.config.reduce_each_micro_step)
        EXPECT_EQ(static_cast<int>(scattered_in.size()), last + 1) << what << ": unit " << d.units[u].name;
    }
  });
}

// The parameter gather pass reads the placement: every compute task reading a unit whose
// parameters are placed split reads a gathered buffer that an all_gather over those axes (within
// the unit's slice) filled before it; a plan with no split parameters has no all_gather.
TEST(Plan, SplitParametersAreGatheredBeforeEveryTaskReadingThem) {
  for_each_layout([](const model::ModelDesc& d, const Plan& p, const std::string& what) {
    bool any_split = false;
    for (int u = 0; u < static_cast<int>(d.units.size()); ++u)
      any_split = any_split || !within_slice(p, d, p.placed(State::params, u).axes, u).empty();
    for (const Task& t : p.tasks) {
      if (t.op == Op::all_gather) EXPECT_TRUE(any_split) << what << ": " << t.name(&d);
      if (t.stream != kCompute) continue;
      for (int b : {t.io.params, t.io.borrowed_params}) {
        if (b < 0) continue;
        const int u = p.buffers[b].unit;
        EXPECT_FALSE(within_slice(p, d, p.placed(State::params, u).axes, u).empty()) << what << ": " << t.name(&d);
        bool filled = false;
        for (const Task& g : p.tasks) {
          if (g.id >= t.id || g.op != Op::all_gather) continue;
          const bool fills = g.io.params == b || std::count(g.io.bucket.begin(), g.io.bucket.end(), b) > 0;
          if (!fills || !p.depends_on(t.id, g.id)) continue;
          filled = true;
          EXPECT_EQ(g.axes, within_slice(p, d, p.placed(State::params, u).axes, u)) << what << ": " << g.name(&d);
        }
        EXPECT_TRUE(filled) << what << ": " << t.name(&d) << " reads " << p.buffers[b].name << " no gather filled";
      }
    }
  });
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

namespace shardlm::plan {
namespace {

// Recompute is an edit of the plan: a recompute task before every block's backward, the block's
// activations dropped after its forward, and the activation peak smaller.
TEST(Plan, RecomputeAddsATaskBeforeEachBlockBackwardAndLowersTheActivationPeak) {
  for (const char* preset : {"small", "llama-small"}) {
    const model::ModelDesc d = model::describe(model::model_preset(preset));
    std::map<model::Recompute, int64_t> peak;
    for (model::Recompute r : {model::Recompute::none, model::Recompute::selective, model::Recompute::full}) {
      PlanConfig c;
      c.world = 2;
      c.recompute = r;
      const Plan p = build_plan(d, c);
      int recomputes = 0;
      for (const Task& t : p.tasks) {
        if (t.op != Op::recompute) continue;
        ++recomputes;
        const int b = find(p, Op::backward, t.unit);
        EXPECT_TRUE(p.depends_on(b, t.id)) << preset;
        EXPECT_NEAR(t.flops, d.costs(t.unit, {c.batch, c.seq, 4, 1}).recompute_flops(r), 1.0);
      }
      EXPECT_EQ(recomputes, r == model::Recompute::none ? 0 : d.config.n_layer) << preset << " " << model::to_string(r);
      peak[r] = p.max_memory()[MemCategory::activations];
    }
    EXPECT_LT(peak[model::Recompute::selective], peak[model::Recompute::none]) << preset;
    EXPECT_LT(peak[model::Recompute::full], peak[model::Recompute::selective]) << preset;
  }
}

// build_plan refuses `c` with std::invalid_argument whose line contains `says`.
void expect_refused(const model::ModelDesc& d, const PlanConfig& c, const std::string& says) {
  try {
    build_plan(d, c);
    ADD_FAILURE() << "not refused: " << says;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

// --recompute selective-op (torchtitan's op policy) on LLaMA: each block's rebuild reruns k_proj,
// o_proj and up_proj (their FLOPs on top of selective's norms and SwiGLU), keeps less than
// selective (q and v, not q|k|v; the gate, not gate|up; no residual) and more than full, on every
// block or on some. Other families, a sequence split over cp ranks and --act-quant are refused
// naming the flag.
TEST(Plan, SelectiveOpRerunsEveryOtherGemmAndKeepsLessThanSelective) {
  for (const char* preset : {"llama-small", "llama3-8b"}) {
    const model::ModelDesc d = model::describe(model::model_preset(preset));
    const auto& m = d.config;
    std::map<model::Recompute, int64_t> peak;
    for (model::Recompute r : {model::Recompute::selective, model::Recompute::selective_op, model::Recompute::full}) {
      PlanConfig c;
      c.world = 2, c.batch = 4, c.seq = 256;
      c.recompute = r;
      const Plan p = build_plan(d, c);
      peak[r] = p.max_memory()[MemCategory::activations];
      if (r != model::Recompute::selective_op) continue;
      const model::Shape shape{c.batch, c.seq, 4, 1};
      const double BT = static_cast<double>(c.batch * c.seq), C = m.n_embd, KV = m.n_kv_head * m.head_size();
      int rebuilt = 0;
      for (const Task& t : p.tasks) {
        if (t.op != Op::recompute) continue;
        ++rebuilt;
        const model::UnitCosts k = d.costs(t.unit, shape);
        EXPECT_NEAR(t.flops, k.selective_recompute_flops + 2 * BT * C * (KV + C + m.ffn_dim), 1.0) << preset;
        model::Shape selective = shape;
        selective.recompute = model::Recompute::selective;
        model::Shape op = shape;
        op.recompute = model::Recompute::selective_op;
        const model::UnitCosts ks = d.costs(t.unit, selective), ko = d.costs(t.unit, op);
        EXPECT_LT(ko.kept_bytes(op.recompute), ks.kept_bytes(selective.recompute)) << preset;
        // What it keeps and what it rebuilds are together what none keeps, and q|v and the gate again.
        const auto slice = [](double n) { return (static_cast<int64_t>(n) * 4 + 63) / 64 * 64; };
        const double QV = (m.n_head + m.n_kv_head) * m.head_size();
        EXPECT_EQ(ko.saved_bytes + ko.recomputable_bytes,
                  ks.saved_bytes + ks.recomputable_bytes + slice(BT * QV) + slice(BT * m.ffn_dim))
            << preset;
      }
      EXPECT_EQ(rebuilt, m.n_layer) << preset;
    }
    EXPECT_LT(peak[model::Recompute::selective_op], peak[model::Recompute::selective]) << preset;
    EXPECT_GT(peak[model::Recompute::selective_op], peak[model::Recompute::full]) << preset;
  }
  PlanConfig op;
  op.world = 2, op.recompute = model::Recompute::selective_op;
  expect_refused(model::describe(model::model_preset("small")), op, "recompute (--recompute): selective-op");
  expect_refused(model::describe(model::model_preset("moe-tiny")), op, "recompute (--recompute): selective-op");
  const model::ModelDesc llama = model::describe(model::model_preset("llama-tiny"));
  PlanConfig cp = op;
  cp.cp = 2;
  expect_refused(llama, cp, "selective-op runs on one cp rank");
  PlanConfig quant = op;
  quant.act_quant = {32, false};
  expect_refused(llama, quant, "not with --act-quant");
}

// --recompute-blocks N rebuilds N blocks spread evenly (N = L / k: every k-th, the k-th first),
// each with the mode's task and FLOPs, the others keeping all they save: the activation peak falls
// with every block added, from no recompute's at N = 0 to the mode's at N = L. Out of range, or
// with nothing to apply, it is refused naming the flag.
TEST(Plan, RecomputeBlocksRebuildsThatManyBlocksSpreadEvenly) {
  for (const char* preset : {"small", "llama-small"}) {
    const model::ModelDesc d = model::describe(model::model_preset(preset));
    const int L = d.config.n_layer;
    for (model::Recompute r : {model::Recompute::selective, model::Recompute::full}) {
      PlanConfig c;
      c.world = 2;
      c.recompute = r;
      int64_t previous = 0;
      for (int N = 0; N <= L; ++N) {
        c.recompute_blocks = N;
        const Plan p = build_plan(d, c);
        const std::string at = std::string(preset) + " " + model::to_string(r) + " on " + std::to_string(N);
        std::vector<int> rebuilt;
        for (const Task& t : p.tasks) {
          if (t.op != Op::recompute) continue;
          rebuilt.push_back(d.units[t.unit].layer);
          EXPECT_NEAR(t.flops, d.costs(t.unit, {c.batch, c.seq, 4, 1}).recompute_flops(r), 1.0) << at;
        }
        std::vector<int> want;
        for (int l = L - 1; l >= 0; --l)  // in backward order
          if ((l + 1) * N / L > l * N / L) want.push_back(l);
        EXPECT_EQ(rebuilt, want) << at;
        if (2 * N == L) {
          for (int l : want) EXPECT_EQ(l % 2, 1) << at << ": every second block";
        }
        const int64_t peak = p.max_memory()[MemCategory::activations];
        if (N > 0) {
          EXPECT_LT(peak, previous) << at;
        }
        previous = peak;
        PlanConfig whole = c;
        whole.recompute_blocks = -1;
        whole.recompute = N == 0 ? model::Recompute::none : N == L ? r : whole.recompute;
        if (N == 0 || N == L) {
          EXPECT_EQ(peak, build_plan(d, whole).max_memory()[MemCategory::activations]) << at;
        }
      }
    }
    PlanConfig bad;
    bad.recompute = model::Recompute::full;
    for (int N : {-2, L + 1}) {
      bad.recompute_blocks = N;
      expect_refused(d, bad, "recompute_blocks (--recompute-blocks)");
    }
    bad.recompute = model::Recompute::none, bad.recompute_blocks = 2;
    expect_refused(d, bad, "but --recompute is none");
  }
}

// The plan carries the model's figures: its compute FLOPs are the units' costs, never its own.
TEST(Plan, ComputeFlopsAreTheModelsCosts) {
  for (const char* preset : {"small", "llama-small", "llama2-7b"}) {
    const model::ModelDesc d = model::describe(model::model_preset(preset));
    PlanConfig c;
    c.world = 8;
    c.grad_accum = 2;
    const Plan p = build_plan(d, c);
    double units = 0;
    for (const Task& t : p.tasks)
      if (t.op == Op::forward || t.op == Op::backward || t.op == Op::head) units += t.flops;
    EXPECT_NEAR(units, 2 * d.train_flops(c.batch, c.seq), 1e-9 * units) << preset;
  }
}

}  // namespace
}  // namespace shardlm::plan

namespace shardlm::plan {
namespace {

int gathers_of(const Plan& p, int unit) {
  int n = 0;
  for (const Task& t : p.tasks) n += t.op == Op::all_gather && t.unit == unit;
  return n;
}

// Selective unsharding: a kept unit is gathered once per step (whatever the micro-steps) and
// stays gathered to its last backward; the memory price shows in the plan's params.
TEST(Plan, KeepGatheredUnitsAreGatheredOncePerStep) {
  const model::ModelDesc desc = model::describe(model::model_preset("small"));
  PlanConfig c;
  c.strategy = Strategy::fsdp, c.world = 2, c.grad_accum = 2;
  const Plan none = build_plan(desc, c);
  c.keep_gathered = {"h.0", "final_norm"};
  const Plan some = build_plan(desc, c);
  c.keep_gathered = {"all"};
  const Plan all = build_plan(desc, c);
  int h0 = -1;
  for (size_t u = 0; u < desc.units.size(); ++u)
    if (desc.units[u].name == "h.0") h0 = static_cast<int>(u);
  EXPECT_GT(gathers_of(none, h0), 1);
  EXPECT_EQ(gathers_of(some, h0), 1);
  for (size_t u = 0; u < desc.units.size(); ++u) EXPECT_EQ(gathers_of(all, static_cast<int>(u)), 1) << desc.units[u].name;
  EXPECT_LT(none.peak_memory()[MemCategory::params], some.peak_memory()[MemCategory::params]);
  EXPECT_LT(some.peak_memory()[MemCategory::params], all.peak_memory()[MemCategory::params]);
  c.keep_gathered = {"h.99"};
  try {
    build_plan(desc, c);
    ADD_FAILURE() << "h.99 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'h.99'"), std::string::npos) << e.what();
  }
}

// Part of a unit kept (NAME:FRACTION): its forward gathers the whole unit and sets the part
// aside; its backward gathers only the rest. The memory price lies between none and the whole.
TEST(Plan, KeepingPartOfAUnitGathersOnlyTheRestForItsBackward) {
  const model::ModelDesc desc = model::describe(model::model_preset("small"));
  int h0 = -1;
  for (size_t u = 0; u < desc.units.size(); ++u)
    if (desc.units[u].name == "h.0") h0 = static_cast<int>(u);
  for (int param_bytes : {4, 2}) {
    PlanConfig c;
    c.strategy = Strategy::fsdp, c.world = 2, c.param_bytes = param_bytes;
    const Plan none = build_plan(desc, c);
    c.keep_gathered = {"h.0:0.5"};
    const Plan part = build_plan(desc, c);
    c.keep_gathered = {"h.0"};
    const Plan whole = build_plan(desc, c);
    const int64_t shard = part.layout.units[h0].padded / 2, kept = shard / 2 / 16 * 16;
    EXPECT_EQ(part.kept_elems[h0], kept);
    std::vector<int64_t> bytes;
    for (const Task& t : part.tasks)
      if (t.op == Op::all_gather && t.unit == h0) bytes.push_back(t.bytes);
    ASSERT_EQ(bytes.size(), 2u);
    EXPECT_EQ(bytes[0], part.layout.units[h0].padded * param_bytes);  // the forward: all of it
    EXPECT_EQ(bytes[1], (shard - kept) * 2 * param_bytes);           // the backward: the rest
    const int64_t params_none = none.max_memory()[MemCategory::params], params_part = part.max_memory()[MemCategory::params];
    EXPECT_EQ(params_part - params_none, kept * 2 * param_bytes) << "the kept part, in the wire dtype";
    EXPECT_LT(params_part, whole.max_memory()[MemCategory::params]);
  }
  PlanConfig c;
  c.strategy = Strategy::fsdp, c.world = 2;
  for (const std::string bad : {"h.0:0", "h.0:1", "h.0:1.5", "h.0:x", "h.0:", "h.0:-0.5"}) {
    c.keep_gathered = {bad};
    try {
      build_plan(desc, c);
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--keep-gathered"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("'" + bad + "'"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardlm::plan

namespace shardlm::plan {
namespace {

// Every (micro-step, unit) an all_gather brings, buckets expanded, and the gathers' count.
std::multiset<std::pair<int, int>> gathered_units(const Plan& p, int* gathers) {
  std::multiset<std::pair<int, int>> out;
  *gathers = 0;
  for (const Task& t : p.tasks) {
    if (t.op != Op::all_gather) continue;
    ++*gathers;
    if (t.first_unit < 0) {
      out.insert({t.micro, t.unit});
      continue;
    }
    const int step = t.last_unit >= t.first_unit ? 1 : -1;
    for (int u = t.first_unit;; u += step) {
      out.insert({t.micro, u});
      if (u == t.last_unit) break;
    }
  }
  return out;
}

// All-gather buckets: with a bucket as large as a pass, fewer all_gather tasks gather the same
// units (each micro-step, forward and backward) as one gather per unit; a bucket's bytes are its
// units' and never above the limit unless it holds one unit; the price is memory (gathered
// parameters alive together, and the bucket's comm staging).
TEST(Plan, GatherBucketsGatherTheSameUnitsWithFewerCollectives) {
  for (const char* preset : {"small", "llama-small"})
    for (Strategy s : {Strategy::fsdp, Strategy::hybrid})
      for (int pb : {4, 2}) {
        const model::ModelDesc d = model::describe(model::model_preset(preset));
        const std::string what = std::string(preset) + " " + to_string(s) + " param bytes " + std::to_string(pb);
        PlanConfig c;
        c.strategy = s, c.world = 4, c.shard_group = 2, c.grad_accum = 2, c.param_bytes = pb;
        const Plan off = build_plan(d, c);
        c.gather_bucket_mb = 1000;
        const Plan big = build_plan(d, c);
        c.gather_bucket_mb = 20;
        const Plan mid = build_plan(d, c);
        int n_off = 0, n_big = 0, n_mid = 0;
        const auto units_off = gathered_units(off, &n_off);
        const auto units_big = gathered_units(big, &n_big);
        const auto units_mid = gathered_units(mid, &n_mid);
        EXPECT_LT(n_big, n_off) << what;
        EXPECT_LE(n_big, n_mid) << what;
        EXPECT_LT(n_mid, n_off) << what;
        // The forward of micro-step 0 (every unit but the kept embedding, when tied) in one bucket.
        int forward0 = 0;
        for (const Task& t : big.tasks) forward0 += t.op == Op::all_gather && t.micro == 0 && t.first_unit >= 0 && t.last_unit > t.first_unit;
        EXPECT_EQ(forward0, 1) << what;
        if (std::string(preset) == "small") {  // tied: no unit's reuse between micro-steps changes
          EXPECT_EQ(units_big, units_off) << what;
          EXPECT_EQ(units_mid, units_off) << what;
        }
        for (const Task& t : mid.tasks) {
          if (t.op != Op::all_gather || t.first_unit < 0) continue;
          int64_t bytes = 0;
          const int step = t.last_unit >= t.first_unit ? 1 : -1;
          for (int u = t.first_unit;; u += step) {
            bytes += mid.layout.units[u].padded * pb;
            if (u == t.last_unit) break;
          }
          EXPECT_EQ(t.bytes, bytes) << what << " " << t.name(&d);
          EXPECT_LE(t.bytes, 20 * 1048576) << what << " " << t.name(&d);
          ASSERT_GE(t.io.staging, 0) << what;
          EXPECT_EQ(mid.buffers[t.io.staging].category, MemCategory::comm);
          EXPECT_EQ(mid.buffers[t.io.staging].bytes, bytes) << what;  // the gathered concatenation
        }
        EXPECT_GT(big.max_memory()[MemCategory::params], off.max_memory()[MemCategory::params]) << what;
        // fp32 gathers had no staging; bf16 ones had (and a bf16 reduce-scatter may stage more).
        if (pb == 4) EXPECT_GT(big.max_memory()[MemCategory::comm], off.max_memory()[MemCategory::comm]) << what;
        else EXPECT_GE(big.max_memory()[MemCategory::comm], off.max_memory()[MemCategory::comm]) << what;
        EXPECT_GE(big.peak_memory().total, mid.peak_memory().total) << what;
      }
}

// Bucketing applies to sharded parameters only: ddp / zero1 / zero2 plans are unchanged; a
// negative or non-finite size is refused naming the flag.
TEST(Plan, GatherBucketsLeaveUnshardedPlansAndRefuseBadSizes) {
  const model::ModelDesc d = small();
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2}) {
    PlanConfig c;
    c.strategy = s, c.world = 2;
    const Plan off = build_plan(d, c);
    c.gather_bucket_mb = 100;
    EXPECT_EQ(build_plan(d, c).to_text(d).substr(off.to_text(d).find('\n')), off.to_text(d).substr(off.to_text(d).find('\n')))
        << to_string(s);
  }
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    PlanConfig c;
    c.world = 2, c.gather_bucket_mb = bad;
    try {
      build_plan(d, c);
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--gather-bucket-mb"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardlm::plan

namespace shardlm::plan {
namespace {

// --ep splits the data-parallel ranks into expert groups: under a sharding
// strategy ep shards units together with dp_shard, under DDP it replicates them; every ep rank
// reads its own batch.
TEST(Plan, ExpertAxisSplitsTheDataParallelRanks) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  PlanConfig c;
  c.strategy = Strategy::hybrid, c.world = 8, c.shard_group = 4, c.ep = 2;
  const Plan h = build_plan(moe, c);
  EXPECT_EQ(h.mesh.to_string(), "dp_replicate=2 × ep=2 × dp_shard=2");
  EXPECT_EQ(h.shard_size, 4);
  EXPECT_EQ(h.shard_axes(), (std::vector<int>{1, 2}));
  EXPECT_EQ(h.replicate_axes(), (std::vector<int>{0}));
  EXPECT_EQ(h.dp_size(), 8);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(h.part_index(State::params, 0, r), r % 4);
  c.strategy = Strategy::ddp, c.world = 4;
  const Plan d = build_plan(moe, c);
  EXPECT_EQ(d.mesh.to_string(), "dp_replicate=2 × ep=2 × dp_shard=1");
  EXPECT_EQ(d.shard_size, 1);
  EXPECT_EQ(d.replicate_axes(), (std::vector<int>{0, 1}));
  for (const Task& t : d.tasks) {  // dense buckets over every rank; the experts' over their replicas
    if (t.op == Op::all_reduce) {
      const bool experts = moe.units[t.first_unit].kind == model::UnitKind::moe_experts;
      EXPECT_EQ(d.mesh.group_size(t.axes), experts ? 2 : 4);
    }
  }
  c.strategy = Strategy::fsdp, c.world = 6, c.ep = 4;  // ep must divide the ranks
  EXPECT_THROW(build_plan(moe, c), std::invalid_argument);
  c.strategy = Strategy::hybrid, c.world = 8, c.shard_group = 2;  // and the shard group
  EXPECT_THROW(build_plan(moe, c), std::invalid_argument);
  c.shard_group = 8, c.ep = 8;  // and the experts (moe-tiny has 4)
  EXPECT_THROW(build_plan(moe, c), std::invalid_argument);
  c.ep = 2;  // and needs experts
  EXPECT_THROW(build_plan(small(), c), std::invalid_argument);
}

// With --ep K a rank holds, of every kind of the experts' state, only a part of its own ep slice
// (its E/K experts): 1/K of what ep 1 holds where that was whole, the same where it was already
// sharded over all ranks. Its gathers and reductions run over the ranks that hold the same
// experts, and DDP reduces it in a bucket of its own.
TEST(Plan, ExpertsAreHeldAsEachExpertRanksSlice) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  const int K = 2;
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid}) {
    PlanConfig c;
    c.strategy = s, c.world = 8, c.shard_group = 4;
    const Plan one = build_plan(moe, c);
    c.ep = K;
    const Plan p = build_plan(moe, c);
    const int ep = p.mesh.find(AxisRole::expert);
    for (size_t x = 0; x < moe.units.size(); ++x) {
      const int u = static_cast<int>(x);
      const bool experts = moe.units[x].kind == model::UnitKind::moe_experts;
      for (State k : {State::params, State::grads, State::optimizer}) {
        const Placement& where = p.placed(k, u);
        const int64_t whole = p.layout.units[x].padded, before = one.held_elems(k, u);
        EXPECT_EQ(p.held_elems(k, u), experts && before == whole ? whole / K : before) << to_string(s) << " " << kind_name(k);
        if (!experts) continue;
        for (int r = 0; r < 8; ++r)  // the part lies in the rank's ep slice
          EXPECT_EQ(p.part_index(k, u, r) / (where.parts / K), p.mesh.coords(r)[ep]) << to_string(s) << " rank " << r;
      }
      if (!experts) continue;
      for (const Task& t : p.tasks) {
        const bool mine = t.unit == u || (t.first_unit >= 0 && t.first_unit <= u && u <= t.last_unit) ||
                          (t.first_unit >= 0 && t.last_unit <= u && u <= t.first_unit);
        if (!mine || t.stream == kCompute || t.op == Op::exchange) continue;
        EXPECT_EQ(std::count(t.axes.begin(), t.axes.end(), ep), 0) << to_string(s) << " " << t.name(&moe);
        if (t.op == Op::all_reduce && t.first_unit >= 0) { EXPECT_EQ(t.first_unit, t.last_unit) << to_string(s); }
      }
      for (const BufferDesc& b : p.buffers)
        if (b.unit == u && (b.role == Role::gathered || b.role == Role::full_grads)) {
          EXPECT_EQ(b.bytes, 4 * p.layout.units[x].padded / K) << to_string(s) << " " << b.name; }
    }
  }
}

// A MoE block's pass is three stages; with ep 2 an exchange over ep (on a stream of its own) feeds
// each stage after the first, forward and backward (in reverse), from the buffer the stage before
// sent into, and the stage after frees what it received. With one expert rank the stages read
// each other's sends.
TEST(Plan, StagedUnitsExchangeBetweenTheirStagesOverEp) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  int block = -1;
  for (size_t u = 0; u < moe.units.size(); ++u)
    if (moe.units[u].kind == model::UnitKind::moe_block && block < 0) block = static_cast<int>(u);
  for (int ep : {1, 2}) {
    PlanConfig c;
    c.strategy = Strategy::fsdp, c.world = 2, c.ep = ep;
    const Plan p = build_plan(moe, c);
    std::vector<const Task*> forward, backward, exchanges;
    for (const Task& t : p.tasks) {
      if (t.unit != block) continue;
      if (t.op == Op::forward) forward.push_back(&t);
      if (t.op == Op::backward) backward.push_back(&t);
      if (t.op == Op::exchange) exchanges.push_back(&t);
    }
    ASSERT_EQ(forward.size(), 3u);
    ASSERT_EQ(backward.size(), 3u);
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(forward[s]->stage, s);
      EXPECT_EQ(backward[s]->stage, 2 - s);
    }
    EXPECT_EQ(exchanges.size(), ep == 1 ? 0u : 4u);
    for (const Task* x : exchanges) {
      EXPECT_EQ(p.streams.at(x->stream), "exchange");
      EXPECT_EQ(p.mesh[x->axes.at(0)].role, AxisRole::expert);
      EXPECT_GT(x->bytes, 0);
      EXPECT_EQ(p.buffers[x->io.recv].bytes, p.buffers[x->io.send].bytes);
      EXPECT_TRUE(std::count(x->frees.begin(), x->frees.end(), x->io.send));
    }
    for (const auto& pass : {forward, backward})
      for (int s = 1; s < 3; ++s) {
        const Task &before = *pass[s - 1], &after = *pass[s];
        EXPECT_GE(before.io.send, 0);
        EXPECT_TRUE(p.depends_on(after.id, before.id));
        if (ep == 1) {
          EXPECT_EQ(after.io.recv, before.io.send);
        } else {
          EXPECT_NE(after.io.recv, before.io.send);
        }
        EXPECT_TRUE(std::count(after.frees.begin(), after.frees.end(), after.io.recv));
        EXPECT_EQ(p.buffers[after.io.recv].role, Role::routed);
      }
    // The pass's last stage frees its gathered parameters.
    EXPECT_TRUE(std::count(forward[2]->frees.begin(), forward[2]->frees.end(), forward[0]->io.params));
    EXPECT_FALSE(std::count(forward[0]->frees.begin(), forward[0]->frees.end(), forward[0]->io.params));
  }
}

// The plan's mesh: hybrid shards over dp_shard (consecutive ranks) and replicates over
// dp_replicate; every collective names its axes; explain prints each rank's coordinates.
TEST(Plan, HybridMeshNamesItsAxesAndExplainPrintsCoordinates) {
  PlanConfig c;
  c.strategy = Strategy::hybrid, c.world = 4, c.shard_group = 2;
  const Plan p = build_plan(small(), c);
  EXPECT_EQ(p.mesh.to_string(), "dp_replicate=2 × dp_shard=2");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.part_index(State::params, 0, r), r % 2);
    EXPECT_EQ(p.dp_index(r), r);
  }
  std::set<std::vector<int>> used;
  for (const Task& t : p.tasks)
    if (t.stream != kCompute) used.insert(t.axes);
  EXPECT_EQ(used, (std::set<std::vector<int>>{p.shard_axes(), p.replicate_axes(), p.dp_axes()}));
  const std::string text = p.to_text(small());
  EXPECT_NE(text.find("rank 2: dp_replicate=1 dp_shard=0"), std::string::npos) << text.substr(0, 600);
}

// --cp K --cp-impl ring: per block, K − 1 ring steps forward, each a key/value block (B·T rows of
// 2·NKV·HS floats) to the next rank of cp, and K − 1 backward, each the block and its gradient
// accumulator to the previous rank. Forward steps are double-buffered: the step into stage s + 1
// needs only stage s − 1 (and the step before it, whose block it sends on), so it runs beside
// stage s. Every block buffer is freed by a later stage; a block is kept from the forward.
// A MoE block under context parallelism, ring and all-to-all, alone and beside ep: the attention
// half's exchanges over cp, then per block and micro-step one forward exchange over cp of every
// rank's routing counts (model::moe_count_bytes to each of the cp − 1 others; none in the
// backward, which reads the counts the forward kept), then the routed rows over ep (left out
// without an ep axis). The block's stages name the ep axis (the layer routes rows by it), and
// no buffer is alive twice, with full recompute and gradient accumulation too.
TEST(Plan, MixtureOfExpertsUnderContextParallelismExchangesCountsOverCp) {
  const model::ModelDesc moe = model::describe(model::model_preset("moe-tiny", 256));
  for (model::ContextImpl impl : {model::ContextImpl::ring, model::ContextImpl::all_to_all})
    for (int ep : {1, 2}) {
      PlanConfig c;
      c.strategy = Strategy::fsdp, c.world = 2 * ep, c.cp = 2, c.ep = ep, c.cp_impl = impl;
      c.batch = 2, c.seq = 32;
      const Plan p = build_plan(moe, c);
      const std::string at = std::string(model::to_string(impl)) + " ep " + std::to_string(ep);
      model::Shape shape = p.unit_shape(4);
      const int64_t counts = model::moe_count_bytes(moe, shape);
      EXPECT_EQ(counts, 4 * c.batch * (impl == model::ContextImpl::ring ? 2 : 1) * moe.config.n_experts) << at;
      const int cp_axis = p.mesh.find(AxisRole::context), ep_axis = p.mesh.find(AxisRole::expert);
      int count_exchanges = 0, ep_exchanges = 0;
      for (const Task& t : p.tasks) {
        if (t.unit < 0 || moe.units[t.unit].kind != model::UnitKind::moe_block) continue;
        if (t.op == Op::exchange && t.carries && std::string(t.carries) == "routing counts of the cp group") {
          ++count_exchanges;
          EXPECT_FALSE(t.reverse) << t.name();
          EXPECT_EQ(t.axes, std::vector<int>{cp_axis}) << t.name();
          EXPECT_EQ(t.bytes, counts) << t.name();
          EXPECT_EQ(p.buffers[t.io.send].bytes, model::exchange_header_bytes(2) + 2 * counts) << t.name();
        } else if (t.op == Op::exchange && t.axes != std::vector<int>{cp_axis}) {
          ++ep_exchanges;
          EXPECT_EQ(t.axes, std::vector<int>{ep_axis}) << t.name();
        } else if (t.op == Op::forward || t.op == Op::backward) {
          EXPECT_EQ(t.axes, ep > 1 ? std::vector<int>{ep_axis} : std::vector<int>{}) << t.name();
        }
      }
      EXPECT_EQ(count_exchanges, moe.config.n_layer) << at;
      EXPECT_EQ(ep_exchanges, ep > 1 ? 4 * moe.config.n_layer : 0) << at;
      const model::UnitCosts u = moe.costs(1, shape);
      EXPECT_EQ(u.stages(), (impl == model::ContextImpl::ring ? c.cp + 1 : 3) + 3) << at;  // attention, then the MoE half
      for (model::Recompute r : {model::Recompute::none, model::Recompute::full}) {
        PlanConfig again = c;
        again.recompute = r, again.grad_accum = 2;
        expect_no_buffer_alive_twice(moe, again, "moe " + at + " " + model::to_string(r));
      }
      // A selective rebuild is one task, carving the stages' activations: it names their ep axis
      // too (sized by it), with and without cp.
      for (int cp : {1, 2}) {
        PlanConfig selective = c;
        selective.recompute = model::Recompute::selective, selective.cp = cp, selective.world = cp * ep;
        const Plan q = build_plan(moe, selective);
        const int ep_of_q = q.mesh.find(AxisRole::expert);
        int rebuilds = 0;
        for (const Task& t : q.tasks)
          if (t.op == Op::recompute && moe.units[t.unit].kind == model::UnitKind::moe_block) {
            ++rebuilds;
            EXPECT_EQ(t.axes, ep > 1 ? std::vector<int>{ep_of_q} : std::vector<int>{}) << t.name();
          }
        EXPECT_EQ(rebuilds, moe.config.n_layer) << at;
      }
    }
}

TEST(Plan, RingStepsCountAndBytes) {
  const model::ModelDesc llama = model::describe(model::model_preset("llama-tiny", 256));
  for (int K : {2, 3, 4}) {
    PlanConfig c;
    c.strategy = Strategy::fsdp, c.world = K, c.cp = K, c.cp_impl = model::ContextImpl::ring;
    c.batch = 2, c.seq = 24 * K;
    const Plan p = build_plan(llama, c);
    const int64_t T = c.seq / K, block = 4 * c.batch * T * 2 * llama.config.n_kv_head * llama.config.head_size();
    int forward = 0, backward = 0;
    for (const Task& t : p.tasks) {
      if (t.op != Op::exchange) continue;
      EXPECT_EQ(t.ring_step, t.reverse ? -1 : 1) << t.name();
      EXPECT_EQ(p.buffers[t.io.send].bytes, block) << t.name();
      EXPECT_EQ(t.bytes, p.buffers[t.io.send].bytes) << t.name();
      ++(t.reverse ? backward : forward);
      // A forward step after the first sends on what the one before it received, once the stage
      // before the one reading it is done (double buffering), not after that stage.
      if (!t.reverse) {
        int exchange_before = -1, stage_before = -1;
        for (int d : t.deps) {
          if (p.tasks[d].op == Op::exchange) exchange_before = d;
          if (p.tasks[d].stream == kCompute) stage_before = p.tasks[d].stage;
        }
        // Exchange x1 (x0 is the local step from q|k|v to the first attention) follows stage 0.
        EXPECT_EQ(stage_before, t.stage - 1) << t.name();
        if (t.stage > 1) {
          ASSERT_GE(exchange_before, 0) << t.name();
          EXPECT_EQ(t.io.send, p.tasks[exchange_before].io.recv) << t.name();
        }
      }
    }
    for (const Task& t : p.tasks)  // the forward stage a step feeds
      if (t.op == Op::forward && t.unit == 1 && t.stage >= 2) {
        ASSERT_EQ(t.deps.size(), 1u) << t.name();
        EXPECT_EQ(p.tasks[t.deps[0]].op, Op::exchange) << t.name();
        EXPECT_EQ(p.tasks[t.deps[0]].stage, t.stage - 1) << t.name();
      }
    EXPECT_EQ(forward, llama.config.n_layer * (K - 1)) << K;
    // Backward: K − 1 accumulators and K − 2 key/value blocks (the first block is the forward's
    // kept one), each beside a computing stage: no backward step waits for the stage just before
    // the one it feeds.
    EXPECT_EQ(backward, llama.config.n_layer * (2 * K - 3)) << K;
    for (size_t i = 0; i < p.tasks.size(); ++i) {
      const Task& t = p.tasks[i];
      if (t.op != Op::backward || t.unit != 1 || t.deps.size() != 1 || p.tasks[t.deps[0]].op != Op::exchange) continue;
      const Task& x = p.tasks[t.deps[0]];
      int before = -1;  // the compute task just before t
      for (size_t j = 0; j < i; ++j)
        if (p.tasks[j].stream == kCompute) before = static_cast<int>(j);
      ASSERT_GE(before, 0);
      EXPECT_EQ(p.tasks[before].op, Op::backward) << t.name();
      for (int d : x.deps) EXPECT_NE(d, before) << x.name() << " waits for " << p.tasks[before].name();
    }
    for (model::Recompute r : {model::Recompute::none, model::Recompute::full}) {
      PlanConfig again = c;
      again.recompute = r, again.grad_accum = 2;
      expect_no_buffer_alive_twice(llama, again, "ring " + std::to_string(K) + " " + model::to_string(r));
    }
    c.cp = 1, c.world = 1;
    const model::UnitCosts whole = llama.costs(1, build_plan(llama, c).unit_shape(4));
    const model::UnitCosts split = llama.costs(1, p.unit_shape(4));
    EXPECT_EQ(split.stages(), K + 1);
    EXPECT_NEAR(split.attention_flops, whole.attention_flops / K, 1e-9 * whole.attention_flops);
  }
}

// --cp K: a mesh axis after dp_shard; the ranks of a cp group read the same batch (one data-parallel
// coordinate) but shard the state with dp_shard and sum gradients and losses together. A block's
// pass, split in the all-to-all form, is three stages with its q|k|v and its attention output
// exchanged over cp; each rank's units are sized for T / K positions.
TEST(Plan, ContextAxisSplitsSequencesButNotTheData) {
  const model::ModelDesc llama = model::describe(model::model_preset("llama-tiny", 256));
  PlanConfig c;
  c.strategy = Strategy::fsdp, c.world = 4, c.cp = 2, c.cp_impl = model::ContextImpl::all_to_all;
  c.batch = 2, c.seq = 64;
  const Plan p = build_plan(llama, c);
  EXPECT_EQ(p.mesh.to_string(), "dp_replicate=1 × dp_shard=2 × cp=2");
  EXPECT_EQ(p.dp_size(), 2);
  EXPECT_EQ(p.shard_size, 4);
  EXPECT_EQ(p.grad_axes(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(p.local_seq(), 32);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.dp_index(r), r / 2);
    EXPECT_EQ(p.cp_index(r), r % 2);
  }
  int exchanges = 0;
  for (const Task& t : p.tasks)
    if (t.op == Op::exchange) {
      ++exchanges;
      EXPECT_EQ(p.mesh.group_size(t.axes), 2);
    }
  EXPECT_EQ(exchanges, 2 * 2 * 2);  // two blocks, two exchanges each way
  c.cp = 1;
  const model::UnitCosts whole = llama.costs(1, build_plan(llama, c).unit_shape(4));
  const model::UnitCosts half = llama.costs(1, p.unit_shape(4));
  EXPECT_EQ(half.stages(), 3);
  EXPECT_NEAR(half.attention_flops, whole.attention_flops / 2, 1e-9 * whole.attention_flops);
  EXPECT_LT(half.saved_bytes, whole.saved_bytes);
  // A plan that does not split sequences (evaluation, generation) keeps the mesh and the placement.
  c.cp = 2, c.split_sequence = false, c.mode = PlanConfig::Mode::loss;
  const Plan eval = build_plan(llama, c);
  EXPECT_EQ(eval.mesh.to_string(), p.mesh.to_string());
  EXPECT_EQ(eval.local_seq(), 64);
  EXPECT_EQ(eval.placed(State::params, 1).axes, p.placed(State::params, 1).axes);
}

// Bad context-parallel layouts: one line each, naming the flag.
TEST(Plan, ContextSplitRefusesBadLayouts) {
  const model::ModelDesc llama = model::describe(model::model_preset("llama-tiny", 256));  // NKV 2
  PlanConfig c;
  c.strategy = Strategy::fsdp, c.world = 4, c.cp = 2, c.cp_impl = model::ContextImpl::all_to_all, c.seq = 64;
  auto refused = [&](const model::ModelDesc& d, const std::string& needle) {
    try {
      build_plan(d, c);
      ADD_FAILURE() << "accepted, expected: " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  c.world = 3;
  refused(llama, "cp (--cp): 2 must divide the number of ranks 3");
  c.world = 4, c.seq = 63;
  refused(llama, "sequence length 63 must be a multiple of 2");
  c.seq = 64, c.cp = 4;
  refused(llama, "must divide the 2 key/value heads");
  c.cp = 2, c.cp_impl = model::ContextImpl::ring, c.seq = 66;
  refused(llama, "sequence length 66 must be a multiple of 4 (--cp-impl ring cuts each sequence into 4 equal chunks)");
  c.cp_impl = model::ContextImpl::all_to_all, c.seq = 64;
  c.cp = 4;  // a MoE model meets the same checks: its attention half splits as LLaMA's
  refused(model::describe(model::model_preset("moe-tiny", 256)), "must divide the 2 key/value heads");
  c.cp = 2;
  c.strategy = Strategy::hybrid, c.shard_group = 1;
  refused(llama, "must divide the shard group");
}

}  // namespace
}  // namespace shardlm::plan

namespace shardlm::plan {
namespace {

// llama-small with eight blocks: enough for four ranks of two virtual stages.
model::ModelDesc eight_blocks() {
  model::ModelConfig m = model::model_preset("llama-small");
  m.n_layer = 8;
  return model::describe(m);
}

// Every rank of the pipe's plan, for pp stages of `cfg`.
std::vector<Plan> stage_plans(const model::ModelDesc& desc, PlanConfig cfg) {
  std::vector<Plan> plans;
  for (int r = 0; r < cfg.pp; ++r) {
    cfg.pipe_rank = r;
    plans.push_back(build_plan(desc, cfg));
  }
  return plans;
}

// Each stage's plan holds its units' state and nobody else's: together the pipe's ranks hold
// every unit's once, as one process does.
TEST(PipelinePlan, EachRankHoldsItsStagesUnitsAndTogetherTheyHoldTheModelOnce) {
  const model::ModelDesc desc = eight_blocks();
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved-1f1b"})
    for (int pp : {2, 4}) {
      PlanConfig c;
      c.strategy = Strategy::ddp;
      c.world = c.pp = pp;
      c.grad_accum = 2 * pp;
      c.pp_schedule = schedule;
      c.pp_virtual = schedule == "interleaved-1f1b" ? 2 : 1;
      PlanConfig one = c;
      one.world = one.pp = 1, one.pp_virtual = 1;
      const Plan whole = build_plan(desc, one);
      int64_t held = 0;
      std::vector<int> holders(desc.units.size(), 0);
      for (const Plan& p : stage_plans(desc, c)) {
        held += p.held_total(State::params);
        EXPECT_LT(p.static_memory.total(), whole.static_memory.total()) << schedule << " pp " << pp;
        for (size_t u = 0; u < desc.units.size(); ++u) {
          holders[u] += p.holds(static_cast<int>(u));
          if (!p.holds(static_cast<int>(u))) {
            EXPECT_EQ(p.held_elems(State::params, static_cast<int>(u)), 0);
          }
          for (const Task& t : p.tasks)
            if (t.unit >= 0) EXPECT_TRUE(p.holds(t.unit)) << t.name(&desc) << " on pipe rank " << p.config.pipe_rank;
        }
      }
      EXPECT_EQ(held, whole.held_total(State::params)) << schedule << " pp " << pp;
      for (int n : holders) EXPECT_EQ(n, 1);
    }
}

// What one stage sends, its neighbour receives: for every send a recv of the same micro-batch,
// direction and bytes on the peer, in the same order between each pair of stages, so no message
// waits for a receive that never comes; every micro-batch's activations go forward once per stage
// boundary and its gradients back once.
TEST(PipelinePlan, EverySendHasItsReceiveOnTheNeighbouringStage) {
  const model::ModelDesc desc = eight_blocks();
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved-1f1b"})
    for (int pp : {2, 4})
      for (int M : {1, 2, 4, 8}) {
        PlanConfig c;
        c.strategy = Strategy::ddp;
        c.world = c.pp = pp;
        c.grad_accum = M;
        c.pp_schedule = schedule;
        c.pp_virtual = schedule == "interleaved-1f1b" ? 2 : 1;
        if (schedule == "interleaved-1f1b" && M % pp != 0) continue;
        const std::vector<Plan> plans = stage_plans(desc, c);
        using Message = std::tuple<int, int, bool, int64_t>;  // micro, from stage, gradients, bytes
        std::map<std::pair<int, int>, std::vector<Message>> sent, received;  // by (from rank, to rank)
        for (int r = 0; r < pp; ++r)
          for (const Task& t : plans[r].tasks) {
            if (t.op == Op::send) sent[{r, t.peer}].emplace_back(t.micro, t.stage, t.reverse, t.bytes);
            if (t.op == Op::recv) received[{t.peer, r}].emplace_back(t.micro, t.peer_stage, t.reverse, t.bytes);
          }
        const std::string what = schedule + " pp " + std::to_string(pp) + " M " + std::to_string(M);
        for (auto& [pair, msgs] : sent) {
          auto by_key = msgs, got = received[pair];
          std::sort(by_key.begin(), by_key.end());
          std::sort(got.begin(), got.end());
          EXPECT_EQ(by_key, got) << what;
        }
        const int boundaries = plans[0].schedule.stages - 1;
        size_t total = 0;
        for (auto& [pair, msgs] : sent) total += msgs.size();
        EXPECT_EQ(total, static_cast<size_t>(2 * boundaries * M)) << what;
      }
}

TEST(PipelinePlan, BadPipelinesAreRefusedInOneLineNamingTheFlag) {
  const model::ModelDesc desc = model::describe(model::model_preset("llama-tiny"));  // two blocks
  auto refusal = [&](PlanConfig c) {
    try {
      build_plan(desc, c);
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();  // one line
      return std::string(e.what());
    }
    return std::string();
  };
  PlanConfig c;
  c.strategy = Strategy::ddp;
  c.world = 3, c.pp = 2;
  EXPECT_NE(refusal(c).find("pp (--pp): 2 must divide the number of ranks 3"), std::string::npos) << refusal(c);
  c.world = c.pp = 4;
  EXPECT_NE(refusal(c).find("pp (--pp): 4 stages for 2 blocks"), std::string::npos) << refusal(c);
  c.world = c.pp = 2, c.pp_virtual = 2;
  EXPECT_NE(refusal(c).find("--pp-virtual"), std::string::npos) << refusal(c);
  c.pp_virtual = 1, c.pp_schedule = "zb-h1";
  EXPECT_NE(refusal(c).find("pp_schedule (--pp-schedule): zb-h1 splits"), std::string::npos) << refusal(c);
  c.pp_schedule = "1f1b", c.pp_layers = {1, 2};
  EXPECT_NE(refusal(c).find("pp_layers (--pp-layers): the stages' blocks must sum"), std::string::npos) << refusal(c);
  const model::ModelDesc gpt2 = model::describe(model::model_preset("tiny"));  // a tied head
  c.pp_layers = {};
  try {
    build_plan(gpt2, c);
    ADD_FAILURE() << "a tied embedding across stages was planned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tied embedding"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm::plan
