// The optimizer overlap pass (--pipeline-optimizer): the optimizer moved into the backward as an
// edit of a built plan; it overlaps the optimizer step with the backward (pipeline parallelism is
// plan/schedule.h's business, not this). A unit's AdamW update needs the global gradient norm
// (clipping) and every rank's finiteness (a skipped step), which are known only after the last
// unit's gradients are reduced. Updating each unit speculatively as soon as its own gradients are
// final, with the norm taken as not clipping, is exact whenever that guess holds, which a training
// run's norm mostly does; a copy of the state the update overwrites makes the other cases exact
// too: the commit redoes the update from it with the clipped gradients, or restores it when the
// step is skipped. The price is that copy: the parameters' and both moments' shards of every unit,
// alive from the unit's update to the commit. With offloaded state that copy would hold in memory
// what the disk tier keeps out of it, so there the updates are deferred instead: only each unit's
// sum of squares moves into the backward (read while its gradients are still in their window, not
// reloaded after it), and the offload pass streams the per-unit updates through their windows after
// the norm.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/plan.h"

namespace shardlm::plan {

namespace {

int find_task(const Plan& p, Op op) {
  for (const Task& t : p.tasks)
    if (t.op == op && t.unit < 0) return t.id;
  throw std::logic_error(std::string("optimizer overlap pass: the plan has no ") + to_string(op) + " task");
}

void add_dep(Task& t, int on) {
  if (std::find(t.deps.begin(), t.deps.end(), on) == t.deps.end()) t.deps.push_back(on);
  std::sort(t.deps.begin(), t.deps.end());
}

}  // namespace

void optimizer_overlap_pass(Plan& p, const model::ModelDesc& desc) {
  if (!p.config.pipeline_optimizer || p.config.mode != PlanConfig::Mode::train) return;
  const bool speculate = !p.config.offload.any();
  const int U = static_cast<int>(desc.units.size());
  const int norm = find_task(p, Op::grad_norm), opt = find_task(p, Op::optimizer);

  // Where each unit's gradients become final: the last task writing them before the norm.
  std::vector<int> ready(U, -1);
  for (const Task& t : p.tasks) {
    if (t.id == norm) break;
    for (const StateTouch& x : state_touches(p, desc, t))
      if (x.state == State::grads && x.write) ready[x.unit] = t.id;
  }
  std::vector<std::vector<int>> ready_at(p.tasks.size());  // by task: the units it makes final
  for (int u = 0; u < U; ++u)
    if (p.placed(State::optimizer, u).parts > 0) {
      if (ready[u] < 0) throw std::logic_error("optimizer overlap pass: no task writes the gradients of " + desc.units[u].name);
      ready_at[ready[u]].push_back(u);
    }

  const int stream = static_cast<int>(p.streams.size());
  p.streams.push_back("optimizer");
  std::vector<int> new_id(p.tasks.size(), -1), rollbacks;
  std::vector<Task> out;
  out.reserve(p.tasks.size() + 2 * U);
  int last_compute = -1, last_norm = -1, last_update = -1;
  Task norm_task = p.tasks[norm];
  auto remap = [&](Task& t) {
    std::vector<int> deps;
    for (int d : t.deps) deps.push_back(d == norm ? last_norm : new_id[d]);
    t.deps = std::move(deps);
    for (int d : t.deps)
      if (d < 0) throw std::logic_error("optimizer overlap pass: " + t.name(&desc) + " waits on a task listed after it");
    std::sort(t.deps.begin(), t.deps.end());
  };
  auto emit = [&](Task t) {
    t.id = static_cast<int>(out.size());
    if (t.stream == kCompute) last_compute = t.id;
    out.push_back(std::move(t));
    return out.back().id;
  };
  for (Task& t : p.tasks) {
    const int old = t.id;
    if (old == norm) continue;  // per unit now; its frees (full gradients) move to the commit
    if (old == opt && !speculate) {  // deferred: it waits for the norm, and frees what the norm task did
      remap(t);
      for (int d : norm_task.deps) add_dep(t, new_id[d]);
      t.frees.insert(t.frees.end(), norm_task.frees.begin(), norm_task.frees.end());
      new_id[old] = emit(std::move(t));
      continue;
    }
    if (old == opt) {
      Task commit;
      commit.op = Op::optimizer_commit;
      commit.micro = t.micro;
      commit.deps = t.deps;
      commit.allocs = t.allocs;
      commit.frees = t.frees;
      remap(commit);
      add_dep(commit, last_update);
      for (int d : norm_task.deps) add_dep(commit, new_id[d]);
      commit.frees.insert(commit.frees.end(), norm_task.frees.begin(), norm_task.frees.end());
      commit.frees.insert(commit.frees.end(), rollbacks.begin(), rollbacks.end());
      new_id[old] = emit(std::move(commit));
      continue;
    }
    remap(t);
    new_id[old] = emit(std::move(t));
    for (int u : ready_at[old]) {
      Task n;
      n.op = Op::grad_norm;
      n.stream = stream;
      n.unit = u;
      n.micro = out[new_id[old]].micro;
      n.deps = {new_id[old]};
      last_norm = emit(std::move(n));
      if (!speculate) continue;

      // The copy comes and goes with the compute stream (handed off by the last compute task
      // listed before the update, which it waits for; freed by the commit), so the plan's bytes
      // over time do not depend on how the streams interleave.
      BufferDesc b;
      b.id = static_cast<int>(p.buffers.size());
      b.name = "rollback " + desc.units[u].name;
      b.role = Role::rollback;
      b.category = MemCategory::optimizer;
      b.bytes = 3 * 4 * p.held_elems(State::optimizer, u);
      b.unit = u;
      p.buffers.push_back(b);
      rollbacks.push_back(b.id);
      out[last_compute].hands_off.push_back(b.id);

      Task a;
      a.op = Op::optimizer;
      a.stream = stream;
      a.unit = u;
      a.micro = n.micro;
      a.deps = {last_norm, last_compute};
      std::sort(a.deps.begin(), a.deps.end());
      a.flops = 10.0 * static_cast<double>(p.held_elems(State::optimizer, u));
      a.copy_bytes = b.bytes;
      a.io.rollback = b.id;
      last_update = emit(std::move(a));
    }
  }
  if (!p.repeat.counterpart.empty()) {  // by task id
    std::vector<int> counterpart(out.size(), -1);
    for (size_t old = 0; old < new_id.size(); ++old)
      if (new_id[old] >= 0 && p.repeat.counterpart[old] >= 0) counterpart[new_id[old]] = new_id[p.repeat.counterpart[old]];
    p.repeat.counterpart = std::move(counterpart);
  }
  p.tasks = std::move(out);
}

}  // namespace shardlm::plan
