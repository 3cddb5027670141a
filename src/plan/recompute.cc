// The recompute pass: a unit whose recompute mode keeps less than its backward reads gets a
// recompute task right before its backward, rebuilding the dropped activations from the unit's
// inputs and (gathered) parameters. Everything the task names already exists: the forward made
// the saved and recomputable buffers and its workspace, and the backward reads the same inputs
// and parameters, so the pass creates no buffers.
#include "plan/recompute.h"

#include <set>
#include <utility>

namespace shardlm::plan {

namespace {

// The (unit, micro-step)'s first task of `op` in `tasks`, which every stage of its pass copies
// the operands of; nullptr where there is none.
const Task* first_of(const std::vector<Task>& tasks, Op op, int u, int m) {
  for (const Task& t : tasks)
    if (t.op == op && t.unit == u && t.micro == m) return &t;
  return nullptr;
}

// The recompute task before `backward` (the first task of its unit's backward pass) of a unit
// rebuilding in `mode`. Its operands are the backward's inputs and parameters and the forward's
// workspace, its axes the forward's (its stages' routed rows size what it carves); it allocates
// what the forward freed.
Task rebuild_task(const Task& backward, const Task& forward, const model::UnitCosts& c, model::Recompute mode) {
  const bool full = mode == model::Recompute::full;
  Task r;
  r.op = Op::recompute, r.stream = kCompute, r.unit = backward.unit, r.micro = backward.micro;
  r.axes = forward.axes;
  r.flops = c.recompute_flops(mode);
  Operands& io = r.io;
  io.params = backward.io.params, io.borrowed_params = backward.io.borrowed_params;
  io.inputs = backward.io.inputs;
  if (c.saved_bytes > 0) {
    io.saved = backward.io.saved;
    if (full) r.allocs.push_back(io.saved);
  }
  if (c.recomputable_bytes > 0) r.allocs.push_back(io.recomputable = backward.io.recomputable);
  if (forward.io.forward_ws >= 0) {  // alive inside the task
    io.forward_ws = forward.io.forward_ws;
    r.allocs.push_back(io.forward_ws), r.frees.push_back(io.forward_ws);
  }
  return r;
}

}  // namespace

void recompute_pass(const std::vector<Task>& walked, TaskList& out, const Plan& plan, const model::ModelDesc& desc) {
  const int activation_bytes = plan.config.activation_bytes;
  std::vector<int> moved(walked.size(), -1);  // walked id -> listed id
  std::set<std::pair<int, int>> rebuilt;      // (unit, micro-step) whose backward has its recompute
  for (const Task& t : walked) {
    Task listed = t;
    for (int& d : listed.deps) d = moved[d];
    const model::Recompute mode = t.op == Op::backward ? plan.recompute_of(desc, t.unit) : model::Recompute::none;
    const model::UnitCosts c = mode != model::Recompute::none
                                   ? desc.costs(t.unit, plan.unit_shape(desc, t.unit, activation_bytes))
                                   : model::UnitCosts{};
    const bool rebuilds = mode != model::Recompute::none && c.kept_bytes(mode) < c.saved_bytes + c.recomputable_bytes;
    if (rebuilds && rebuilt.insert({t.unit, t.micro}).second) {
      Task r = rebuild_task(t, *first_of(walked, Op::forward, t.unit, t.micro), c, mode);
      // The recompute waits for the unit's gather in the backward's place; the backward follows
      // it on the compute stream.
      std::vector<int> kept_deps;
      for (int d : listed.deps)
        (out.at(d).op == Op::all_gather ? r.deps : kept_deps).push_back(d);
      listed.deps = std::move(kept_deps);
      const int id = out.append(std::move(r));
      // Only a full rebuild reruns the stages (and their exchanges); a selective one rebuilds
      // what each stage dropped on this rank, in one task.
      if (mode == model::Recompute::full) out.split_forward_into_stages(id);
    }
    moved[t.id] = out.append(std::move(listed));
  }
}

}  // namespace shardlm::plan
