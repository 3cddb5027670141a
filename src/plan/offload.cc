// The offload pass: the disk tier as an edit of a built plan. Which state lives on disk is a
// placement (Placement::where); the copies that bring it into memory and take it back are tasks on
// a copy stream, with dependencies bounding how far they run ahead, and the memory they occupy is
// window buffers, so `explain`, the executor's accounting and the simulator read the same plan.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/plan.h"
#include "tensor/disk_store.h"

namespace shardlm::plan {

StateKind kind_of(StateIndex s) {
  switch (s) {
    case StateIndex::params: return StateKind::params;
    case StateIndex::grads: return StateKind::grads;
    default: return StateKind::optimizer;
  }
}

const char* to_string(StateIndex s) {
  switch (s) {
    case StateIndex::params: return "params";
    case StateIndex::grads: return "grads";
    case StateIndex::exp_avg: return "exp_avg";
    case StateIndex::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

namespace {

struct Touch {
  int state, unit;
  bool write;
};

// The run-long state a task reads or writes in place (not through a per-task buffer), by
// state and unit. Grouped by what the executor's handler of each op touches.
std::vector<Touch> touches(const Plan& p, const model::ModelDesc& desc, const Task& t) {
  std::vector<Touch> out;
  const int U = static_cast<int>(desc.units.size());
  auto add = [&](StateIndex s, int u, bool write) {
    if (u >= 0 && p.placed(kind_of(s), u).parts > 0) out.push_back({static_cast<int>(s), u, write});
  };
  auto range = [&](int first, int last, StateIndex s, bool write) {
    const int step = last >= first ? 1 : -1;
    for (int u = first;; u += step) {
      add(s, u, write);
      if (u == last) break;
    }
  };
  switch (t.op) {
    case Op::forward:
    case Op::recompute:
    case Op::head:
    case Op::loss:
    case Op::logits:
    case Op::backward: {
      const bool grads = t.op == Op::head || t.op == Op::backward;
      if (t.io.params < 0) add(StateIndex::params, t.unit, false);
      if (grads && t.io.grads < 0) add(StateIndex::grads, t.unit, true);
      const int b = desc.units[t.unit].borrows;
      if (b >= 0 && t.io.borrowed_params < 0) add(StateIndex::params, b, false);
      if (b >= 0 && grads && t.io.borrowed_grads < 0) add(StateIndex::grads, b, true);
      break;
    }
    case Op::all_gather:
      if (t.first_unit >= 0) range(t.first_unit, t.last_unit, StateIndex::params, false);
      else add(StateIndex::params, t.unit, false);
      break;
    case Op::reduce_scatter: add(StateIndex::grads, t.unit, true); break;
    case Op::all_reduce:
      if (t.first_unit >= 0) range(t.first_unit, t.last_unit, StateIndex::grads, true);
      else add(StateIndex::grads, t.unit, true);
      break;
    case Op::param_gather: add(StateIndex::params, t.unit, true); break;
    case Op::grad_norm:
      if (t.unit >= 0) add(StateIndex::grads, t.unit, false);
      else range(0, U - 1, StateIndex::grads, false);
      break;
    case Op::optimizer:
      for (int u = t.unit >= 0 ? t.unit : 0; u <= (t.unit >= 0 ? t.unit : U - 1); ++u)
        for (StateIndex s : {StateIndex::params, StateIndex::grads, StateIndex::exp_avg, StateIndex::exp_avg_sq})
          add(s, u, true);  // gradients are clipped in place
      break;
    default: break;  // zero_grads: offloaded gradients start as zero-filled windows
  }
  return out;
}

// Replaces the task `op` (unit -1) by one per unit holding `kind`, in unit order, on the same
// stream; the first keeps its buffers and dependencies, and what waited for it waits for the last.
void split_per_unit(Plan& p, const model::ModelDesc& desc, Op op, StateKind kind) {
  const int n = static_cast<int>(p.tasks.size()), U = static_cast<int>(desc.units.size());
  std::vector<int> units;
  for (int u = 0; u < U; ++u)
    if (p.placed(kind, u).parts > 0) units.push_back(u);
  if (units.empty()) return;
  auto split = [&](const Task& t) { return t.op == op && t.unit < 0; };
  std::vector<int> first_new(n), last_new(n);
  int next = 0;
  for (const Task& t : p.tasks) {
    const int count = split(t) ? static_cast<int>(units.size()) : 1;
    first_new[t.id] = next, last_new[t.id] = next + count - 1;
    next += count;
  }
  std::vector<Task> out;
  out.reserve(next);
  for (Task& t : p.tasks) {
    for (int& d : t.deps) d = last_new[d];
    if (!split(t)) {
      t.id = first_new[t.id];
      out.push_back(std::move(t));
      continue;
    }
    const double per_elem = t.flops / std::max<int64_t>(1, p.held_total(kind));
    for (size_t k = 0; k < units.size(); ++k) {
      Task s;
      if (k == 0) s = t;
      else s.op = op, s.stream = t.stream, s.micro = t.micro, s.deps = {static_cast<int>(out.size()) - 1};
      s.id = static_cast<int>(out.size());
      s.unit = units[k];
      s.flops = per_elem * static_cast<double>(p.held_elems(kind, units[k]));
      out.push_back(std::move(s));
    }
  }
  p.tasks = std::move(out);
}

}  // namespace

void offload_pass(Plan& p, const model::ModelDesc& desc) {
  const OffloadConfig& o = p.config.offload;
  if (!o.any()) return;
  const bool train = p.config.mode == PlanConfig::Mode::train;
  if (o.prefetch < 0) throw std::invalid_argument("offload prefetch (--offload-prefetch): must be >= 0, got " + std::to_string(o.prefetch));
  if (train && p.config.grad_accum > 1)
    throw std::invalid_argument("--offload: gradient accumulation (--grad-accum > 1) with offloaded state is not supported yet");
  if (p.config.world > 1 && p.config.strategy != Strategy::fsdp)
    throw std::invalid_argument(std::string("--offload: supported on one process or with --strategy fsdp, not yet with ") +
                                to_string(p.config.strategy) + " at " + std::to_string(p.config.world) + " ranks");
  const int U = static_cast<int>(desc.units.size());

  // Placement: every unit's part of each offloaded kind lives on disk.
  std::vector<UnitPlacement> placed = p.placement();
  for (int k = 0; k < kNumStateKinds; ++k) {
    if (!o.kinds[k]) continue;
    for (UnitPlacement& up : placed) {
      Placement& pl = k == 0 ? up.params : k == 1 ? up.grads : up.optimizer;
      if (pl.parts > 0) pl.where = Location::disk;
    }
  }
  p.set_placement(std::move(placed));
  if (o.kinds[0]) p.static_memory.params = 0;
  if (o.kinds[1]) p.static_memory.grads = 0;
  if (o.kinds[2]) p.static_memory.optimizer = 0;
  for (BufferDesc& b : p.buffers) {
    const bool disk = (b.role == Role::params && o.kinds[0]) || (b.role == Role::grads && o.kinds[1]) ||
                      ((b.role == Role::exp_avg || b.role == Role::exp_avg_sq) && o.kinds[2]);
    if (disk) b.where = Location::disk;
  }

  // One gradient-norm and one optimizer task per unit, so a unit's state is in memory only while
  // its own task runs.
  if (train) {
    split_per_unit(p, desc, Op::grad_norm, StateKind::grads);
    split_per_unit(p, desc, Op::optimizer, StateKind::optimizer);
  }

  // Windows.
  p.windows.assign(U, {-1, -1, -1, -1});
  for (int s = 0; s < kNumStateBuffers; ++s) {
    const StateKind k = kind_of(StateIndex(s));
    if (!o.kinds[static_cast<int>(k)]) continue;
    for (int u = 0; u < U; ++u) {
      if (p.placed(k, u).parts == 0) continue;
      BufferDesc b;
      b.id = static_cast<int>(p.buffers.size());
      b.name = std::string("window ") + to_string(StateIndex(s)) + " " + desc.units[u].name;
      b.role = Role::window;
      b.category = k == StateKind::params ? MemCategory::params : k == StateKind::grads ? MemCategory::grads : MemCategory::optimizer;
      b.bytes = disk_aligned(4 * p.held_elems(k, u));
      b.unit = u;
      p.buffers.push_back(b);
      p.windows[u][s] = b.id;
    }
  }

  // The tasks using offloaded state, in plan order, and each state's residencies: runs of uses
  // close enough (within prefetch + 1 using tasks) to keep the window in memory between them.
  struct Use {
    int task;
    std::vector<Touch> touch;
  };
  std::vector<Use> uses;
  for (const Task& t : p.tasks) {
    std::vector<Touch> all = touches(p, desc, t), kept;
    for (const Touch& x : all)
      if (p.window(x.state, x.unit) >= 0) kept.push_back(x);
    if (!kept.empty()) uses.push_back({t.id, kept});
  }
  struct Residency {
    int state, unit, first, last;
    bool written, fresh;
  };
  std::vector<Residency> res;
  std::vector<std::array<int, 4>> open(U, {-1, -1, -1, -1});  // the state's latest residency
  const int d = o.prefetch;
  for (int i = 0; i < static_cast<int>(uses.size()); ++i)
    for (const Touch& x : uses[i].touch) {
      int& r = open[x.unit][x.state];
      if (r >= 0 && res[r].last == i) {  // the same task touches it twice (a head and its tied embedding)
        res[r].written = res[r].written || x.write;
        continue;
      }
      if (r >= 0 && res[r].last >= i - d - 1) {
        res[r].last = i;
        res[r].written = res[r].written || x.write;
        continue;
      }
      // A step's gradients start at zero (zero_grads): their first window needs no read.
      const bool fresh = train && x.state == static_cast<int>(StateIndex::grads) && r < 0;
      res.push_back({x.state, x.unit, i, i, x.write, fresh});
      r = static_cast<int>(res.size()) - 1;
    }
  std::vector<char> last_of_state(res.size(), 0);
  for (int u = 0; u < U; ++u)
    for (int s = 0; s < kNumStateBuffers; ++s)
      if (open[u][s] >= 0) last_of_state[open[u][s]] = 1;

  // The copy tasks, in copy-stream order. Slot i is listed right after use i - 1 (slot 0 before
  // use 0): the write_backs of use i - 1, then the reloads of use i + d, which wait for use i - 1
  // (so at most d + 1 uses' windows are read ahead).
  struct Pending {
    Task task;
    int for_use;  // a reload: the use that waits for it
  };
  std::vector<std::vector<Pending>> slot(uses.size() + 1);
  auto copy_task = [&](Op op, const Residency& r) {
    Task t;
    t.op = op;
    t.unit = r.unit;
    t.micro = p.tasks[uses[r.first].task].micro;
    t.io.window = p.windows[r.unit][r.state];
    t.bytes = p.buffers[t.io.window].bytes;
    return t;
  };
  for (size_t ri = 0; ri < res.size(); ++ri) {
    const Residency& r = res[ri];
    const int w = p.windows[r.unit][r.state];
    if (r.fresh) {
      p.tasks[uses[r.first].task].allocs.push_back(w);
    } else {
      Task t = copy_task(Op::reload, r);
      t.allocs.push_back(w);
      if (r.first - d - 1 >= 0) t.deps.push_back(uses[r.first - d - 1].task);
      slot[std::max(0, r.first - d)].push_back({std::move(t), r.first});
    }
    // Gradients are dead after the step's last use (the next step starts them at zero).
    const bool write_back = r.written && !(train && last_of_state[ri] && r.state == static_cast<int>(StateIndex::grads));
    if (write_back) {
      Task t = copy_task(Op::write_back, r);
      t.frees.push_back(w);
      t.deps.push_back(uses[r.last].task);
      slot[r.last + 1].push_back({std::move(t), -1});
    } else {
      p.tasks[uses[r.last].task].frees.push_back(w);
    }
  }
  for (auto& s : slot)
    std::stable_partition(s.begin(), s.end(), [](const Pending& x) { return x.task.op == Op::write_back; });

  // The new list, ids renumbered to list order; a using task waits for its reloads.
  const int copy_stream = static_cast<int>(p.streams.size());
  p.streams.push_back("copy");
  std::vector<int> use_at(p.tasks.size(), -1);
  for (int i = 0; i < static_cast<int>(uses.size()); ++i) use_at[uses[i].task] = i;
  std::vector<Task> out;
  std::vector<int> new_id(p.tasks.size(), -1);
  std::vector<std::vector<int>> reloads(uses.size());  // by use: new ids of its reloads
  auto emit = [&](int i) {
    for (Pending& x : slot[i]) {
      Task& t = x.task;
      t.stream = copy_stream;
      for (int& dep : t.deps) dep = new_id[dep];  // using tasks already listed
      t.id = static_cast<int>(out.size());
      if (x.for_use >= 0) reloads[x.for_use].push_back(t.id);
      out.push_back(std::move(t));
    }
  };
  for (Task& t : p.tasks) {
    const int i = use_at[t.id];
    if (i == 0) emit(0);
    for (int& dep : t.deps) {
      dep = new_id[dep];
      if (dep < 0) throw std::logic_error("offload pass: " + t.name(&desc) + " waits on a task listed after it");
    }
    new_id[t.id] = static_cast<int>(out.size());
    t.id = new_id[t.id];
    out.push_back(std::move(t));
    if (i >= 0) emit(i + 1);
  }
  for (int i = 0; i < static_cast<int>(uses.size()); ++i) {
    Task& t = out[new_id[uses[i].task]];
    t.deps.insert(t.deps.end(), reloads[i].begin(), reloads[i].end());
    std::sort(t.deps.begin(), t.deps.end());
  }
  p.tasks = std::move(out);
}

}  // namespace shardlm::plan
