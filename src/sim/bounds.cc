#include "sim/bounds.h"

#include <algorithm>
#include <array>
#include <vector>

#include "sim/cost.h"

namespace shardlm::sim {

using plan::Op;
using plan::Plan;
using plan::PlanConfig;
using plan::Strategy;
using plan::Task;

namespace {

bool in_memory(const PlanConfig& c) {
  return c.mode == PlanConfig::Mode::train && !c.offload.disk() && c.memory_budget == 0 && !c.pipeline_optimizer;
}

// Of each unit, the slice a rank computes with.
std::vector<int64_t> compute_elems_of(const model::ModelDesc& desc, const Plan& frame) {
  std::vector<int64_t> elems;
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) elems.push_back(frame.compute_elems(desc, u));
  return elems;
}

// Seconds of the compute stream's tasks and the exchange stream's, as the builder lays them out,
// priced one by one; and of the exchanges the compute stream waits out idle (`after` 1: the stage
// fed runs right after the one that starts it, in the compute stream's order).
struct StreamSeconds {
  double compute = 0, exchanges = 0, waited = 0;
};
StreamSeconds stream_seconds(const model::ModelDesc& desc, const Plan& frame, const std::vector<model::UnitCosts>& costs,
                             const CostModel& cost) {
  const PlanConfig& c = frame.config;
  double per_micro = 0, exchanges = 0, waited = 0;
  // A pass of `flops`: one task, or (staged) one per stage with its share and an exchange between
  // each two where it spans more than one rank.
  auto pass = [&](Op op, int u, const model::UnitCosts& k, double flops, bool staged, bool reverse) {
    Task t;
    t.op = op, t.unit = u;
    const int S = staged ? k.stages(reverse) : 1;
    if (S == 1) {
      t.flops = flops;
      per_micro += cost.seconds(t);
      return;
    }
    for (int s = 0; s < S; ++s) {
      t.stage = s, t.flops = flops * k.share(s, reverse);
      per_micro += cost.seconds(t);
    }
    const std::vector<model::Exchange>& xs = k.exchanges_of(reverse);
    for (int e = 0; e < static_cast<int>(xs.size()); ++e) {
      const int axis = frame.mesh.find(xs[e].over);
      if (xs[e].route == model::Exchange::Route::none || axis < 0 || frame.mesh[axis].size <= 1) continue;
      Task x;
      x.op = Op::exchange, x.unit = u, x.stage = e, x.reverse = reverse, x.axes = {axis};
      x.ring_step = xs[e].route == model::Exchange::Route::ring_next ? 1 : xs[e].route == model::Exchange::Route::ring_prev ? -1 : 0;
      x.bytes = xs[e].expected_bytes;
      const double seconds = cost.seconds(x);
      exchanges += seconds;
      if (xs[e].after == 1) waited += seconds;
    }
  };
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
    const model::UnitKind kind = desc.units[u].kind;
    if (model::is_state_only(kind)) continue;
    const model::UnitCosts& k = costs[u];
    if (model::is_head(kind)) {  // its backward in the same task
      pass(Op::head, u, k, k.forward_flops + k.backward_flops, false, false);
      continue;
    }
    pass(Op::forward, u, k, k.forward_flops, true, false);
    const model::Recompute mode = frame.recompute_of(desc, u);
    if (k.kept_bytes(mode) < k.saved_bytes + k.recomputable_bytes)  // only a full rebuild reruns the stages
      pass(Op::recompute, u, k, k.recompute_flops(mode), mode == model::Recompute::full, false);
    pass(Op::backward, u, k, k.backward_flops, true, true);
  }
  double once = 0;  // the step's own tasks
  Task t;
  t.op = Op::zero_grads;
  once += cost.seconds(t);
  t.op = Op::grad_norm;
  once += cost.seconds(t);
  t.op = Op::optimizer;
  t.flops = 10.0 * static_cast<double>(frame.held_total(plan::State::optimizer));
  once += cost.seconds(t);
  const double A = static_cast<double>(c.grad_accum);
  return {per_micro * A + once, exchanges * A, waited * A};
}

// What the sharded-gradient strategies' backwards also pay: each unit's full gradients, written
// from zero once a step, or once a micro-step under reduce_each_micro_step (CostModel prices a task
// allocating them so). Adds them to `frame` as buffers and returns a task allocating them all,
// which costs their sum; none elsewhere.
Task zero_fill(const model::ModelDesc& desc, Plan& frame, const std::vector<int64_t>& compute_elems) {
  Task t;
  t.op = Op::backward;  // a unit's work without its unit: only the allocations' bytes
  const Strategy s = frame.config.strategy;
  if (frame.config.world == 1 || !(s == Strategy::fsdp || s == Strategy::hybrid || s == Strategy::zero2)) return t;
  for (size_t u = 0; u < desc.units.size(); ++u) {
    plan::BufferDesc b;
    b.id = static_cast<int>(frame.buffers.size());
    b.role = plan::Role::full_grads;
    b.bytes = compute_elems[u] * 4;
    frame.buffers.push_back(b);
    t.allocs.push_back(b.id);
  }
  return t;
}

// The comm stream's collectives of state, each (op, group) once with its bytes summed.
double comm_seconds(const model::ModelDesc& desc, const BoundsFrame& f, const PlanConfig& c, const HardwareProfile& hw) {
  if (c.world == 1) return 0;
  const Plan& frame = f.plan;
  const Strategy s = c.strategy;
  const bool sharded_params = s == Strategy::fsdp || s == Strategy::hybrid;
  const bool sharded_grads = sharded_params || s == Strategy::zero2;
  constexpr int kOps = 3;
  const Collective ops[kOps] = {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce};
  std::vector<std::array<double, kOps>> bytes(f.groups.size(), std::array<double, kOps>{});
  const int U = static_cast<int>(desc.units.size());
  std::vector<char> once(U, 0);  // gathered once a step: kept, borrowed, or state only
  for (int u = 0; u < U; ++u) {
    once[u] = once[u] || !c.keep_gathered.empty() || model::is_state_only(desc.units[u].kind);
    if (desc.units[u].borrows >= 0) once[desc.units[u].borrows] = 1;
  }
  const double A = static_cast<double>(c.grad_accum);
  int reused = -1;  // a later micro-step's first forward may reuse one unit the backward before gathered
  for (int u = 0; u < U; ++u) {
    std::array<double, kOps>& shard = bytes[f.shard_group[u]];
    const double elems = static_cast<double>(f.elems[u]);
    if (sharded_params) shard[0] += elems * c.param_bytes * (once[u] ? 1 : A);
    if (sharded_params && !once[u] && (reused < 0 || f.elems[u] > f.elems[reused])) reused = u;
    if (sharded_grads) shard[1] += elems * c.reduce_bytes * (c.reduce_each_micro_step ? A : 1);
    if (s == Strategy::hybrid && c.world > frame.shard_size)
      bytes[f.replicate_group][2] += static_cast<double>(frame.layout.units[u].padded / frame.shard_size) * c.reduce_bytes;
    if (s == Strategy::ddp || s == Strategy::zero1) bytes[f.grad_group[u]][2] += elems * c.reduce_bytes;
    if (s == Strategy::zero1 || s == Strategy::zero2) shard[0] += elems * c.param_bytes;
  }
  if (reused >= 0) bytes[f.shard_group[reused]][0] -= (A - 1) * static_cast<double>(f.elems[reused]) * c.param_bytes;
  double seconds = 0;
  for (size_t g = 0; g < f.groups.size(); ++g)
    for (int op = 0; op < kOps; ++op)
      if (bytes[g][op] > 0) seconds += collective_cost(hw, ops[op], bytes[g][op], f.groups[g]).seconds;
  return seconds;
}

// What is alive when the last micro-step's head runs, but what units kept and accumulation decide:
// the static memory, every unit's activations kept for its backward and the head's scratch; and
// each unit's gathered or full-gradient bytes by when they are alive then.
void peak_parts(const model::ModelDesc& desc, const Plan& frame, const std::vector<model::UnitCosts>& costs,
                const std::vector<int64_t>& elems, ComputeBounds& b) {
  const plan::StaticMemory& st = frame.static_memory;
  b.peak_bytes = st.total();
  const int U = static_cast<int>(desc.units.size());
  std::vector<char> borrowed(U, 0);
  for (int u = 0; u < U; ++u)
    if (desc.units[u].borrows >= 0) borrowed[desc.units[u].borrows] = 1;
  for (int u = 0; u < U; ++u) {
    const model::UnitDesc& ud = desc.units[u];
    const int64_t bytes = elems[u] * 4;
    b.grads_all += bytes;
    if (borrowed[u]) b.gathered += bytes;  // stays gathered for the step
    if (model::is_state_only(ud.kind)) continue;
    const model::UnitCosts& k = costs[u];
    const model::Recompute mode = frame.recompute_of(desc, u);
    b.peak_bytes += k.kept_bytes(mode);
    const bool rebuild = k.kept_bytes(mode) < k.saved_bytes + k.recomputable_bytes;
    if (model::is_head(ud.kind)) {
      b.peak_bytes += k.forward_workspace + k.forward_kernel_scratch + k.backward_workspace + k.backward_kernel_scratch;
      b.gathered += bytes, b.grads_at_head += bytes;
      if (ud.borrows >= 0) b.grads_at_head += elems[ud.borrows] * 4;
    } else if (!borrowed[u] && (ud.backward_reads_params || rebuild)) {
      b.kept_gathered += bytes;  // under --keep-gathered all, gathered until its last backward
    }
  }
}

// Seconds the compute stream waits at the step's two ends, where no compute can hide a
// collective: the first forward waits for unit 0's gather, which waits for zero_grads; after the
// last backward (unit 0's), grad_norm waits for unit 0's reduction (and under hybrid its
// all-reduce over the replicas), the optimizer for norm_reduce, and under ZeRO-1/2 the step ends
// with every unit's parameter gather after the optimizer.
double fill_and_drain_seconds(const model::ModelDesc& desc, const BoundsFrame& f, const PlanConfig& c,
                              const HardwareProfile& hw) {
  if (c.world == 1) return 0;
  const Plan& frame = f.plan;
  const Strategy s = c.strategy;
  const bool sharded_params = s == Strategy::fsdp || s == Strategy::hybrid;
  auto cost = [&](Collective op, double bytes, int group) { return collective_cost(hw, op, bytes, f.groups[group]).seconds; };
  const double first = static_cast<double>(f.elems[0]);
  double seconds = cost(Collective::all_gather, static_cast<double>(f.norm_reduce_bytes), f.norm_group);
  if (sharded_params) seconds += cost(Collective::all_gather, first * c.param_bytes, f.shard_group[0]);
  if (sharded_params || s == Strategy::zero2) seconds += cost(Collective::reduce_scatter, first * c.reduce_bytes, f.shard_group[0]);
  else seconds += cost(Collective::all_reduce, first * c.reduce_bytes, f.grad_group[0]);
  if (s == Strategy::hybrid && c.world > frame.shard_size)
    seconds += cost(Collective::all_reduce, static_cast<double>(frame.layout.units[0].padded / frame.shard_size) * c.reduce_bytes,
                    f.replicate_group);
  if (s == Strategy::zero1 || s == Strategy::zero2)
    for (size_t u = 0; u < desc.units.size(); ++u)
      seconds += cost(Collective::all_gather, static_cast<double>(f.elems[u]) * c.param_bytes, f.shard_group[u]);
  return seconds;
}

}  // namespace

BoundsFrame bounds_frame(const model::ModelDesc& desc, plan::Plan frame, const HardwareProfile& hw) {
  BoundsFrame f;
  f.plan = std::move(frame);
  const Plan& p = f.plan;
  f.elems = compute_elems_of(desc, p);
  auto group = [&](const std::vector<int>& axes) {
    for (size_t g = 0; g < f.spans.size(); ++g)
      if (f.spans[g].first == axes) return static_cast<int>(g);
    f.groups.push_back(span_of(p.mesh, axes, hw.devices_per_node));
    f.spans.emplace_back(axes, f.groups.back());
    return static_cast<int>(f.groups.size()) - 1;
  };
  for (int a = 0; a < static_cast<int>(p.mesh.axes().size()); ++a) group({a});  // an exchange's
  f.replicate_group = group(p.replicate_axes());
  f.norm_group = group(p.norm_axes());
  // norm_reduce: each rank's squared-gradient sum per gradient class and its loss sum, 8 bytes each.
  f.norm_reduce_bytes = 8 * static_cast<int64_t>(p.grad_classes().size() + 1) * p.mesh.group_size(p.norm_axes());
  for (const model::UnitDesc& u : desc.units) {
    const int slice = p.mesh.find(u.sliced_over);
    std::vector<int> shard = p.shard_axes(), grad = p.grad_axes();
    std::erase(shard, slice);
    std::erase(grad, slice);
    f.shard_group.push_back(group(shard));
    f.grad_group.push_back(group(grad));
  }
  return f;
}

ComputeBounds compute_bounds(const model::ModelDesc& desc, const BoundsFrame& f, const PlanConfig& c,
                             const HardwareProfile& hw, int threads, double expert_load) {
  ComputeBounds b;
  if (!in_memory(c)) return b;
  Plan frame = f.plan;
  frame.config = c;
  const std::vector<int64_t>& elems = f.elems;
  std::vector<model::UnitCosts> costs;  // the builder's
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u)
    costs.push_back(desc.costs(u, frame.unit_shape(desc, u, c.activation_bytes)));
  peak_parts(desc, frame, costs, elems, b);
  const Task fill = zero_fill(desc, frame, elems);
  const CostModel cost(desc, frame, hw, threads, expert_load, f.spans);
  const StreamSeconds streams = stream_seconds(desc, frame, costs, cost);
  const double fills = c.reduce_each_micro_step ? static_cast<double>(c.grad_accum) : 1;  // full gradients each micro-step
  b.compute_ms = 1e3 * (streams.compute + fills * cost.seconds(fill));
  b.exchange_ms = 1e3 * streams.exchanges;
  b.waited_ms = 1e3 * streams.waited;
  return b;
}

StepBounds step_bounds(const model::ModelDesc& desc, const BoundsFrame& f, const PlanConfig& c,
                       const ComputeBounds& computed, const HardwareProfile& hw) {
  StepBounds b;
  if (!in_memory(c)) return b;
  const Strategy s = c.strategy;
  const bool sharded_params = c.world > 1 && (s == Strategy::fsdp || s == Strategy::hybrid);
  const bool sharded_grads = c.world > 1 && (sharded_params || s == Strategy::zero2);
  b.compute_ms = computed.compute_ms, b.exchange_ms = computed.exchange_ms, b.waited_ms = computed.waited_ms;
  b.peak_bytes = computed.peak_bytes;
  if (sharded_params)
    b.peak_bytes += computed.gathered + (c.keep_gathered == std::vector<std::string>{"all"} ? computed.kept_gathered : 0);
  const bool accumulate_whole = c.grad_accum > 1 && !c.reduce_each_micro_step;
  if (sharded_grads) b.peak_bytes += accumulate_whole ? computed.grads_all : computed.grads_at_head;
  b.comm_ms = 1e3 * comm_seconds(desc, f, c, hw);
  b.ends_ms = 1e3 * fill_and_drain_seconds(desc, f, c, hw);
  return b;
}

StepBounds step_bounds(const model::ModelDesc& desc, const BoundsFrame& frame, const PlanConfig& c, const HardwareProfile& hw,
                       int threads, double expert_load) {
  return step_bounds(desc, frame, c, compute_bounds(desc, frame, c, hw, threads, expert_load), hw);
}

}  // namespace shardlm::sim
