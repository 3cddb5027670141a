#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "sim/cost.h"

namespace shardlm::sim {

using plan::Plan;
using plan::Task;

namespace {

// Live bytes per category as tasks allocate and free their buffers.
struct MemoryWalk {
  const Plan& plan;
  MemSnapshot live, peak;
  std::vector<char> alive;
  explicit MemoryWalk(const Plan& p) : plan(p), alive(p.buffers.size(), 0) {
    live = p.static_memory.by_category();
    peak = live;
  }
  void add(MemCategory c, int64_t b) {
    live.bytes[static_cast<int>(c)] += b;
    live.total += b;
  }
  void alloc(const std::vector<int>& ids) {
    for (int a : ids) {
      alive[a] = 1;
      add(plan.buffers[a].category, plan.buffers[a].bytes);
    }
    if (live.total > peak.total) peak = live;
  }
  void free(const std::vector<int>& ids) {
    for (int f : ids) {
      if (!alive[f]) continue;
      alive[f] = 0;
      add(plan.buffers[f].category, -plan.buffers[f].bytes);
    }
  }
};

}  // namespace

plan::PlanConfig for_hardware(plan::PlanConfig c, const HardwareProfile& hw) {
  c.activation_bytes = hw.activation_dtype == "bf16" ? 2 : 4;
  const int node = std::max(1, hw.devices_per_node);
  if (c.strategy == plan::Strategy::hybrid && c.shard_group == 0 && c.world > node) {
    if (c.world % node != 0)
      throw std::invalid_argument("--strategy hybrid: " + std::to_string(c.world) + " ranks do not fill nodes of " +
                                  std::to_string(node) + " (" + hw.name +
                                  "'s devices_per_node), so no node's ranks can be the shard group; give --shard-group G");
    c.shard_group = node;
  }
  return c;
}

namespace {

// The discrete-event simulation of one step whose repeated micro-step runs `times` times.
SimResult simulate_runs(const CostModel& cost, const Plan& plan, const HardwareProfile& hw, int64_t times) {
  const int S = static_cast<int>(plan.streams.size());
  std::vector<plan::StreamWalk> walk;
  for (int s = 0; s < S; ++s) walk.emplace_back(plan, s, times);

  SimResult r;
  r.times.assign(plan.tasks.size(), {});
  std::vector<int64_t> done(plan.tasks.size(), 0);  // runs finished, per task
  std::vector<int> running(S, -1);
  std::vector<double> remaining(S, 0);  // seconds of work left at full speed
  std::vector<double> free_since(S, 0), started(S, 0);
  std::vector<double> busy(S, 0);
  std::vector<char> side_stream(S, 0);  // a stream other than compute running compute ops
  for (const Task& t : plan.tasks) side_stream[t.stream] = t.stream != plan::kCompute && plan::info(t.op).stream == plan::OpStream::compute;
  std::vector<char> copy_stream(S, 0);  // the disk tier's reloads and write-backs
  for (int s = 0; s < S; ++s) copy_stream[s] = plan.streams[s] == "copy";
  auto computes = [&](int s) { return side_stream[s] != 0; };
  auto copies = [&](int s) { return copy_stream[s] != 0; };
  MemoryWalk mem(plan);
  double now = 0;

  auto ready = [&](int s) {
    const Task& t = plan.tasks[walk[s].task()];
    for (int d : t.deps) {
      const Plan::Wait w = plan.wait_for(t, walk[s].run(), d, times);
      if (done[w.task] < w.runs) return false;
    }
    return true;
  };
  // The dependency that finished last (the one a waiting task waited for), -1 if none.
  auto last_dep = [&](const Task& t) {
    int last = -1;
    for (int d : t.deps) {
      const int w = plan.wait_for(t, walk[plan::kCompute].run(), d, times).task;
      if (last < 0 || r.times[w].end_s > r.times[last].end_s) last = w;
    }
    return last;
  };
  auto all_done = [&] {
    for (int s = 0; s < S; ++s)
      if (!walk[s].done()) return false;
    return true;
  };
  while (!all_done()) {
    // Start every stream's next task whose dependencies are done.
    for (int s = 0; s < S; ++s) {
      if (running[s] >= 0 || walk[s].done() || !ready(s)) continue;
      const int t = walk[s].task();
      if (s == plan::kCompute && now > free_since[s]) {
        r.comm_exposed_ms += (now - free_since[s]) * 1e3;  // as the executor's wait_deps
        const int last = last_dep(plan.tasks[t]);
        const plan::OpStream kind = last >= 0 ? plan::info(plan.tasks[last].op).stream : plan::OpStream::compute;
        if (kind == plan::OpStream::exchange) r.exchange_exposed_ms += (now - free_since[s]) * 1e3;
        if (kind == plan::OpStream::copy) r.disk_exposed_ms += (now - free_since[s]) * 1e3;
      }
      running[s] = t;
      remaining[s] = cost.seconds(plan.tasks[t]);
      started[s] = now;
      mem.alloc(plan.tasks[t].allocs);
    }
    bool comm_running = false, side_compute = false, copy_running = false;
    for (int s = 1; s < S; ++s)
      if (running[s] >= 0) (computes(s) ? side_compute : copies(s) ? copy_running : comm_running) = true;
    // Compute shares the machine with a running collective (NCCL's SMs, a CPU core) and with a
    // disk copy (each slows the other), and halves it with compute work on another stream (the
    // pipelined optimizer's updates).
    const bool main_running = running[plan::kCompute] >= 0;
    auto rate = [&](int s) {
      if (s == plan::kCompute)
        return (comm_running ? 1.0 / hw.comm_compute_slowdown : 1.0) *
               (copy_running ? 1.0 / hw.compute_slowdown_beside_disk : 1.0) * (side_compute ? 0.5 : 1.0);
      if (copies(s)) return main_running ? 1.0 / hw.disk_slowdown_beside_compute : 1.0;
      if (!computes(s)) return main_running ? 1.0 / hw.comm_slowdown_beside_compute : 1.0;
      return main_running ? 0.5 : 1.0;
    };
    double dt = std::numeric_limits<double>::infinity();
    for (int s = 0; s < S; ++s)
      if (running[s] >= 0) dt = std::min(dt, remaining[s] / rate(s));
    if (!std::isfinite(dt)) throw std::runtime_error("simulate: the plan cannot proceed: tasks wait for tasks that never run");
    now += dt;
    for (int s = 0; s < S; ++s) {
      if (running[s] < 0) continue;
      busy[s] += dt;
      remaining[s] -= dt * rate(s);
      if (remaining[s] > 1e-15 * std::max(1.0, now)) continue;
      const Task& t = plan.tasks[running[s]];
      r.times[t.id] = {started[s], now};
      r.runs.push_back({t.id, walk[s].run(), {started[s], now}});
      ++done[t.id];
      mem.free(t.frees);
      mem.alloc(t.hands_off);
      running[s] = -1;
      walk[s].next();
      free_since[s] = now;
    }
  }
  r.step_ms = now * 1e3;
  r.compute_busy_ms = busy[plan::kCompute] * 1e3;
  for (int s = 1; s < S; ++s) (computes(s) ? r.optimizer_busy_ms : r.comm_busy_ms) += busy[s] * 1e3;
  for (int s = 1; s < S; ++s)
    if (plan.streams[s] == "exchange") r.exchange_busy_ms += busy[s] * 1e3;
    else if (copies(s)) r.disk_busy_ms += busy[s] * 1e3;
  r.timeline_peak = mem.peak;
  return r;
}

// `at` plus `more` runs of the repeated micro-step, each costing what `at` costs over `before`
// (one run fewer): the runs after the repeated ones start that much later.
void extend_runs(SimResult& at, const SimResult& before, const Plan& plan, int64_t more) {
  const double extra_ms = static_cast<double>(more) * (at.step_ms - before.step_ms);
  at.step_ms += extra_ms;
  at.comm_exposed_ms += static_cast<double>(more) * (at.comm_exposed_ms - before.comm_exposed_ms);
  at.compute_busy_ms += static_cast<double>(more) * (at.compute_busy_ms - before.compute_busy_ms);
  at.comm_busy_ms += static_cast<double>(more) * (at.comm_busy_ms - before.comm_busy_ms);
  at.exchange_busy_ms += static_cast<double>(more) * (at.exchange_busy_ms - before.exchange_busy_ms);
  at.exchange_exposed_ms += static_cast<double>(more) * (at.exchange_exposed_ms - before.exchange_exposed_ms);
  at.disk_busy_ms += static_cast<double>(more) * (at.disk_busy_ms - before.disk_busy_ms);
  at.disk_exposed_ms += static_cast<double>(more) * (at.disk_exposed_ms - before.disk_exposed_ms);
  at.optimizer_busy_ms += static_cast<double>(more) * (at.optimizer_busy_ms - before.optimizer_busy_ms);
  auto shift = [&](int task, TaskTime& t) {
    if (plan.tasks[task].micro <= plan.repeat.micro) return;
    t.start_s += extra_ms / 1e3, t.end_s += extra_ms / 1e3;
  };
  for (size_t i = 0; i < at.times.size(); ++i) shift(static_cast<int>(i), at.times[i]);
  for (TaskRun& run : at.runs) shift(run.task, run.time);
}

}  // namespace

SimResult simulate(const model::ModelDesc& desc, const Plan& plan, const HardwareProfile& hw, int threads,
                   double expert_load) {
  const CostModel cost(desc, plan, hw, threads, expert_load);
  const int64_t times = plan.repeat.times;
  SimResult r = simulate_runs(cost, plan, hw, std::min(times, kSimulatedRuns));
  if (times > kSimulatedRuns)
    extend_runs(r, simulate_runs(cost, plan, hw, kSimulatedRuns - 1), plan, times - kSimulatedRuns);
  const auto& c = plan.config;
  const double step_s = r.step_ms / 1e3;
  // The ranks of a cp group share their sequences: the step's are the data-parallel ranks'.
  const int64_t sequences = static_cast<int64_t>(plan.dp_size()) * c.batch * c.grad_accum;
  const double tokens = static_cast<double>(sequences) * c.seq;
  r.tokens_per_s = step_s > 0 ? tokens / step_s : 0;
  const double flops = desc.train_flops(sequences, c.seq);
  r.mfu = step_s > 0 ? flops / step_s / (cost.peak_flops() * c.world) : 0;
  r.mem = plan.peak_memory();
  r.mem_max = plan.max_memory();
  return r;
}

trace::RankTrace to_trace(const model::ModelDesc& desc, const Plan& plan, const SimResult& r, int64_t step) {
  trace::RankTrace tr;
  tr.rank = 0;
  tr.streams = plan.streams;
  for (const TaskRun& run : r.runs) {
    const Task& t = plan.tasks[run.task];
    tr.slices.push_back({t.name(&desc, plan.step_micro(t, run.run)), t.stream, step, run.time.start_s * 1e6,
                         (run.time.end_s - run.time.start_s) * 1e6});
  }
  // Memory counters at every allocation and free, in time order (frees before allocations at
  // the same instant, as a task's end precedes the next one's start).
  struct Event {
    double t;
    int kind;  // 0: end of a task (frees, then hands_off), 1: start (allocs)
    int task;
  };
  std::vector<Event> ev;
  for (const TaskRun& run : r.runs) {
    ev.push_back({run.time.start_s, 1, run.task});
    ev.push_back({run.time.end_s, 0, run.task});
  }
  std::stable_sort(ev.begin(), ev.end(), [](const Event& a, const Event& b) { return a.t < b.t || (a.t == b.t && a.kind < b.kind); });
  MemoryWalk mem(plan);
  tr.memory.push_back({0, mem.live.bytes});
  for (const Event& e : ev) {
    const Task& t = plan.tasks[e.task];
    if (e.kind == 1) {
      if (t.allocs.empty()) continue;
      mem.alloc(t.allocs);
    } else {
      if (t.frees.empty() && t.hands_off.empty()) continue;
      mem.free(t.frees);
      mem.alloc(t.hands_off);
    }
    tr.memory.push_back({e.t * 1e6, mem.live.bytes});
  }
  return tr;
}

}  // namespace shardlm::sim
