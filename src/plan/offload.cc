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

// Grouped by what the executor's handler of each op touches.
std::vector<StateTouch> state_touches(const Plan& p, const model::ModelDesc& desc, const Task& t) {
  std::vector<StateTouch> out;
  const int U = static_cast<int>(desc.units.size());
  auto add = [&](State s, int u, bool write) {
    if (u >= 0 && p.placed(kind_of(s), u).parts > 0) out.push_back({s, u, write});
  };
  auto range = [&](int first, int last, State s, bool write) {
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
      if (t.io.params < 0) add(State::params, t.unit, false);
      if (grads && t.io.grads < 0) add(State::grads, t.unit, true);
      const int b = desc.units[t.unit].borrows;
      if (b >= 0 && t.io.borrowed_params < 0) add(State::params, b, false);
      if (b >= 0 && grads && t.io.borrowed_grads < 0) add(State::grads, b, true);
      break;
    }
    case Op::all_gather:
      if (t.first_unit >= 0) range(t.first_unit, t.last_unit, State::params, false);
      else add(State::params, t.unit, false);
      break;
    case Op::reduce_scatter: add(State::grads, t.unit, true); break;
    case Op::all_reduce:
      if (t.first_unit >= 0) range(t.first_unit, t.last_unit, State::grads, true);
      else add(State::grads, t.unit, true);
      break;
    case Op::param_gather: add(State::params, t.unit, true); break;
    case Op::grad_norm:
      if (t.unit >= 0) add(State::grads, t.unit, false);
      else range(0, U - 1, State::grads, false);
      break;
    case Op::optimizer:
    case Op::optimizer_commit:  // a rollback or redo
      for (int u = t.unit >= 0 ? t.unit : 0; u <= (t.unit >= 0 ? t.unit : U - 1); ++u)
        for (State s : {State::params, State::grads, State::exp_avg, State::exp_avg_sq})
          add(s, u, true);  // gradients are clipped in place
      break;
    default: break;  // zero_grads: offloaded gradients start as zero-filled windows
  }
  return out;
}

namespace {

// Replaces the task `op` (unit -1) by one per unit holding `kind`, in unit order, on the same
// stream; the first keeps its buffers and dependencies, and what waited for it waits for the last.
void split_per_unit(Plan& p, const model::ModelDesc& desc, Op op, State kind) {
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


// Windows (offloaded activations, comm tasks' own scratch) come and go with the compute stream,
// as gathered parameters and full gradients do (plan.h), so their bytes over time do not depend on
// how the copy and comm streams interleave and the plan's walk is the allocator's measurement
// exactly. A window a copy or comm task would allocate is handed off at the end of the last
// compute task listed before it, which that task now waits for; one it would free is freed by a
// compute task listed after it that waits for it: the first compute task already waiting for it
// if that is no later than the second compute task after it, else the second one, made to wait (a
// write-back then runs behind one compute task, as a reduce-scatter's full gradients are freed
// two backwards after it). Where no compute task comes before (or after), a window_sync task opens
// (or closes) the step.
void settle_windows(Plan& p) {
  // What the copy stream moves: windows, and offloaded saved activations (their first allocation
  // and last free are a forward's and a backward's, compute tasks, and stay where they are). And
  // the scratch a comm task allocates and frees itself (staging, the communicator's working
  // memory): a comm task that waits for a copy, or for a comm task that does, runs when the disk
  // lets it, so its scratch would otherwise land beside whichever compute task it then overlaps
  // (a reduce-scatter adding into a gradient window reloaded for it, beside a later backward).
  std::vector<char> comm_scratch(p.buffers.size(), 0);
  for (const Task& t : p.tasks)
    if (t.stream != kCompute)
      for (int a : t.allocs) comm_scratch[a] = std::find(t.frees.begin(), t.frees.end(), a) != t.frees.end();
  auto is_window = [&](int b) { return p.buffers[b].role == Role::window || p.buffers[b].disk_offset >= 0 || comm_scratch[b]; };
  auto moved = [&](const std::vector<int>& v) { return std::any_of(v.begin(), v.end(), is_window); };
  auto compute = [&](const Task& t) { return t.stream == kCompute; };
  bool open = false, close = false;
  {
    bool seen = false;
    for (const Task& t : p.tasks) {
      if (compute(t)) seen = true;
      else if (!seen && moved(t.allocs)) open = true;
    }
    int after = 0;  // compute tasks listed after the current one
    for (auto it = p.tasks.rbegin(); it != p.tasks.rend(); ++it) {
      if (compute(*it)) ++after;
      else if (after < 2 && moved(it->frees)) close = true;
    }
  }
  if (open) {  // ids shift by one
    for (Task& t : p.tasks) {
      ++t.id;
      for (int& d : t.deps) ++d;
    }
    Task s;
    s.op = Op::window_sync;
    s.stream = kCompute;
    s.id = 0;
    p.tasks.insert(p.tasks.begin(), std::move(s));
  }
  if (close) {
    Task s;
    s.op = Op::window_sync;
    s.stream = kCompute;
    s.id = static_cast<int>(p.tasks.size());
    p.tasks.push_back(std::move(s));
  }
  const int n = static_cast<int>(p.tasks.size());
  // first_waiting[t]: the first compute task (by id) that waits for t, directly or through others
  // (the list order is one the streams run in, so a reverse walk sees every waiter first).
  std::vector<int> first_waiting(n, n), prev_on_stream(n, -1), last(p.streams.size(), -1);
  for (const Task& t : p.tasks) prev_on_stream[t.id] = last[t.stream], last[t.stream] = t.id;
  for (int i = n - 1; i >= 0; --i) {
    const int reach = compute(p.tasks[i]) ? i : first_waiting[i];
    std::vector<int> preds = p.tasks[i].deps;
    if (prev_on_stream[i] >= 0) preds.push_back(prev_on_stream[i]);
    for (int d : preds) first_waiting[d] = std::min(first_waiting[d], reach);
  }
  std::vector<int> computes;
  for (const Task& t : p.tasks)
    if (compute(t)) computes.push_back(t.id);
  auto wait = [](Task& t, int on) {
    if (std::find(t.deps.begin(), t.deps.end(), on) == t.deps.end()) t.deps.push_back(on), std::sort(t.deps.begin(), t.deps.end());
  };
  // A window whose free the compute stream reaches only after its next residency's allocation
  // (a buffer id is never alive twice) stays in memory between the two instead: both go. (The
  // reload then refills a live window, after the write-back before it on the same stream.)
  std::vector<int> freed_by(p.buffers.size(), -1);
  auto allocated = [&](int b, int at, bool at_end) {  // false: the window is alive already
    int& by = freed_by[b];
    if (by < 0 || by < at || (at_end && by == at)) return true;  // a task's frees precede its hands_off
    auto& fs = p.tasks[by].frees;
    fs.erase(std::find(fs.begin(), fs.end(), b));
    by = -1;
    return false;
  };
  for (int i = 0; i < n; ++i) {
    Task& t = p.tasks[i];
    if (compute(t)) {
      for (auto a = t.allocs.begin(); a != t.allocs.end();)
        a = is_window(*a) && !allocated(*a, i, false) ? t.allocs.erase(a) : a + 1;
      continue;
    }
    const auto next = std::upper_bound(computes.begin(), computes.end(), i);
    for (auto a = t.allocs.begin(); a != t.allocs.end();) {
      if (!is_window(*a)) {
        ++a;
        continue;
      }
      const int by = next == computes.begin() ? 0 : *(next - 1);  // the opening window_sync when none is listed before
      if (allocated(*a, by, true)) {
        p.tasks[by].hands_off.push_back(*a);
        wait(t, by);
      }
      a = t.allocs.erase(a);
    }
    for (auto f = t.frees.begin(); f != t.frees.end();) {
      if (!is_window(*f)) {
        ++f;
        continue;
      }
      const int second = next + 1 < computes.end() ? *(next + 1) : computes.back();  // else the closing window_sync
      const int by = std::min(first_waiting[i], second);
      p.tasks[by].frees.push_back(*f);
      wait(p.tasks[by], i);
      freed_by[*f] = by;
      f = t.frees.erase(f);
    }
  }
}

// Placement: each (unit, kind) the config chooses lives on disk, but for a resident head; what
// stays in memory is the static memory (an optimizer unit's two moments), and the state buffers
// shrink to it (or go to disk whole where no unit of the kind stays).
void place_state_on_disk(Plan& p, const model::ModelDesc& desc) {
  const OffloadConfig& o = p.config.offload;
  const int U = static_cast<int>(desc.units.size());
  std::vector<UnitPlacement> placed = p.placement();
  std::array<int64_t, kNumStateKinds> left{};  // bytes per kind that stay resident
  std::array<bool, kNumStateKinds> all{true, true, true};  // every held unit of the kind on disk
  for (int k = 0; k < kNumStateKinds; ++k)
    for (int u = 0; u < U; ++u) {
      UnitPlacement& up = placed[u];
      Placement& pl = k == 0 ? up.params : k == 1 ? up.grads : up.optimizer;
      if (pl.parts == 0) continue;
      if (o.on_disk(State(k), u)) pl.where = Location::disk, pl.resident = o.resident_elems(State(k), u);
      const int64_t in_memory = pl.where == Location::disk ? pl.resident : p.held_elems(State(k), u);
      left[k] += 4 * in_memory;
      if (in_memory > 0) all[k] = false;
    }
  p.set_placement(std::move(placed));
  p.static_memory.params = left[0];
  p.static_memory.grads = left[1];
  p.static_memory.optimizer = 2 * left[2];
  for (BufferDesc& b : p.buffers) {
    const int k = b.role == Role::params ? 0 : b.role == Role::grads ? 1 : b.role == Role::exp_avg || b.role == Role::exp_avg_sq ? 2 : -1;
    if (k < 0 || !p.any_on_disk(State(k))) continue;
    if (all[k]) b.where = Location::disk;
    else b.bytes = left[k];  // the resident units' and heads' part, packed (run::Executor lays it out so)
  }
}

// A window buffer for each offloaded (unit, state buffer): p.windows[unit][state].
void add_windows(Plan& p, const model::ModelDesc& desc) {
  const int U = static_cast<int>(desc.units.size());
  p.windows.assign(U, {-1, -1, -1, -1});
  for (int s = 0; s < kNumStateBuffers; ++s) {
    const State k = kind_of(State(s));
    for (int u = 0; u < U; ++u) {
      if (!p.on_disk(k, u)) continue;
      BufferDesc b;
      b.id = static_cast<int>(p.buffers.size());
      b.name = std::string("window ") + to_string(State(s)) + " " + desc.units[u].name;
      b.role = Role::window;
      b.category = k == State::params ? MemCategory::params : k == State::grads ? MemCategory::grads : MemCategory::optimizer;
      b.bytes = p.window_bytes(k, u);
      b.unit = u;
      p.buffers.push_back(b);
      p.windows[u][s] = b.id;
    }
  }
}

// A task that uses offloaded state, and what of it.
struct Touch {
  int state, unit;
  bool write;
};
struct Use {
  int task;
  std::vector<Touch> touch;
};

// The tasks using offloaded state, in plan order.
std::vector<Use> offloaded_uses(const Plan& p, const model::ModelDesc& desc) {
  std::vector<Use> uses;
  for (const Task& t : p.tasks) {
    std::vector<Touch> kept;
    for (const StateTouch& x : state_touches(p, desc, t))
      if (p.window(static_cast<int>(x.state), x.unit) >= 0) kept.push_back({static_cast<int>(x.state), x.unit, x.write});
    if (!kept.empty()) uses.push_back({t.id, kept});
  }
  return uses;
}

// A state's window kept in memory from use `first` to use `last` (indices into the uses).
struct Residency {
  int state, unit, first, last;
  bool written;
  bool fresh;        // a step's first window of its gradients: they start at zero, nothing to read
  bool last_of_step;  // the state's last residency in the step
};

// Each state's residencies: runs of uses close enough (within prefetch + 1 using tasks) to keep
// the window in memory between them.
std::vector<Residency> residencies(const std::vector<Use>& uses, int U, int prefetch, bool train) {
  std::vector<Residency> res;
  std::vector<std::array<int, 4>> open(U, {-1, -1, -1, -1});  // the state's latest residency
  for (int i = 0; i < static_cast<int>(uses.size()); ++i)
    for (const Touch& x : uses[i].touch) {
      int& r = open[x.unit][x.state];
      if (r >= 0 && res[r].last == i) {  // the same task touches it twice (a head and its tied embedding)
        res[r].written = res[r].written || x.write;
        continue;
      }
      if (r >= 0 && res[r].last >= i - prefetch - 1) {
        res[r].last = i;
        res[r].written = res[r].written || x.write;
        continue;
      }
      const bool fresh = train && x.state == static_cast<int>(State::grads) && r < 0;
      res.push_back({x.state, x.unit, i, i, x.write, fresh, false});
      r = static_cast<int>(res.size()) - 1;
    }
  for (int u = 0; u < U; ++u)
    for (int s = 0; s < kNumStateBuffers; ++s)
      if (open[u][s] >= 0) res[open[u][s]].last_of_step = true;
  return res;
}

// A copy task not yet in the list; a reload names the use that waits for it.
struct PendingCopy {
  Task task;
  int for_use;  // -1: a write_back
};

// The copy tasks, in copy-stream order. Slot i is listed right after use i - 1 (slot 0 before
// use 0): the write_backs of use i - 1, then the reloads of use i + d, which wait for use i - 1
// (so at most d + 1 uses' windows are read ahead). A residency with nothing to copy has its
// using tasks allocate and free the window.
std::vector<std::vector<PendingCopy>> copy_slots(Plan& p, const std::vector<Use>& uses,
                                                 const std::vector<Residency>& res, int d, bool train) {
  std::vector<std::vector<PendingCopy>> slot(uses.size() + 1);
  auto copy_task = [&](Op op, const Residency& r) {
    Task t;
    t.op = op;
    t.unit = r.unit;
    t.micro = p.tasks[uses[r.first].task].micro;
    t.io.window = p.windows[r.unit][r.state];
    const State k = kind_of(State(r.state));
    t.bytes = p.disk_slot_bytes(k, r.unit);           // to or from the file
    t.copy_bytes = 4 * p.placed(k, r.unit).resident;  // the resident head, within memory
    return t;
  };
  for (const Residency& r : res) {
    const int w = p.windows[r.unit][r.state];
    if (r.fresh) {
      p.tasks[uses[r.first].task].allocs.push_back(w);
    } else {
      Task t = copy_task(Op::reload, r);
      t.allocs.push_back(w);
      if (r.first - d - 1 >= 0) t.deps.push_back(uses[r.first - d - 1].task);
      // Slot 0 (the reads before the first use): after the task listed before that use, as the
      // memory walk counts them; with nothing to wait for, the copy stream would read them at the
      // step's start, their windows alive through everything before (a budget placing only a
      // late-used kind, the optimizer's, on disk would see its windows beside the activations).
      else if (uses[0].task > 0) t.deps.push_back(uses[0].task - 1);
      slot[std::max(0, r.first - d)].push_back({std::move(t), r.first});
    }
    // Gradients are dead after the step's last use (the next step starts them at zero).
    const bool write_back = r.written && !(train && r.last_of_step && r.state == static_cast<int>(State::grads));
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
    std::stable_partition(s.begin(), s.end(), [](const PendingCopy& x) { return x.task.op == Op::write_back; });
  return slot;
}

// The new task list, the copies on a stream of their own between the using tasks, ids
// renumbered to list order; a using task waits for its reloads.
void list_with_copies(Plan& p, const model::ModelDesc& desc, const std::vector<Use>& uses,
                      std::vector<std::vector<PendingCopy>> slot) {
  const int copy_stream = static_cast<int>(p.streams.size());
  p.streams.push_back("copy");
  std::vector<int> use_at(p.tasks.size(), -1);
  for (int i = 0; i < static_cast<int>(uses.size()); ++i) use_at[uses[i].task] = i;
  std::vector<Task> out;
  std::vector<int> new_id(p.tasks.size(), -1);
  std::vector<std::vector<int>> reloads(uses.size());  // by use: new ids of its reloads
  auto emit = [&](int i) {
    for (PendingCopy& x : slot[i]) {
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

// The run-long state kinds of config.offload: their placement, windows, and copies.
void offload_state(Plan& p, const model::ModelDesc& desc) {
  const bool train = p.config.mode == PlanConfig::Mode::train;
  place_state_on_disk(p, desc);
  // One gradient-norm and one optimizer task per unit, so a unit's state is in memory only while
  // its own task runs.
  if (train) {
    split_per_unit(p, desc, Op::grad_norm, State::grads);
    split_per_unit(p, desc, Op::optimizer, State::optimizer);
  }
  add_windows(p, desc);
  const std::vector<Use> uses = offloaded_uses(p, desc);
  const int d = p.config.offload.prefetch;
  const std::vector<Residency> res = residencies(uses, static_cast<int>(desc.units.size()), d, train);
  list_with_copies(p, desc, uses, copy_slots(p, uses, res, d, train));
}

// --offload activations. A buffer a unit's forward allocates for its backward (saved, and
// recomputable where no recompute rebuilds it) and that only forward tasks (a staged unit's
// stages) use before the backward side (its recompute or backward) does is offloaded: a write_back
// on the copy stream after its last forward use frees it, and a reload allocates the same id again
// before its first backward-side use (its consumer). A micro-step's consumers in list order (its
// backward's, so its forward's reverse) are c0, c1, ...; the reload for c_j waits for c_(j-d-1),
// so at most d + 1 consumers' activations are read ahead. The first d + 1 consumers' buffers stay
// in memory: their reload would be issued at once, so writing them out would cost I/O and save no
// peak. Each offloaded buffer gets a 4 KiB-aligned slot of the rank's activations file, in write
// order within its micro-step; micro-steps share the slots, since one's last reload finishes
// before its last backward, which the next one's forward, hence its first write, follows.
void offload_activations(Plan& p) {
  const int n = static_cast<int>(p.tasks.size()), B = static_cast<int>(p.buffers.size());
  for (int i = 0; i < n; ++i)
    if (p.tasks[i].id != i) throw std::logic_error("offload pass: task ids are not list positions");
  auto activation = [&](int b) { return p.buffers[b].kept_for_backward(); };
  auto forward_side = [](const Task& t) { return t.op == Op::forward; };
  auto backward_side = [](const Task& t) { return t.op == Op::recompute || t.op == Op::backward; };
  std::vector<int> last_forward(B, -1), consumer(B, -1), allocs(B, 0), frees(B, 0);
  std::vector<char> fits(B, 1);  // false: used in a way this pass does not move
  for (const Task& t : p.tasks) {
    for (int a : t.allocs)
      if (activation(a) && (++allocs[a] > 1 || !forward_side(t))) fits[a] = 0;  // rebuilt: not stored
    for (int b : {t.io.saved, t.io.recomputable}) {
      if (b < 0) continue;
      if (forward_side(t) && consumer[b] < 0) last_forward[b] = t.id;
      else if (backward_side(t) && consumer[b] < 0) consumer[b] = t.id;
      else if (!backward_side(t)) fits[b] = 0;
    }
    for (int f : t.frees)
      if (activation(f) && (++frees[f] > 1 || !backward_side(t))) fits[f] = 0;  // freed by its forward: not kept
  }
  auto micro_of = [&](int b) { return p.tasks[consumer[b]].micro; };
  std::vector<std::vector<int>> consumers;  // by micro-step
  for (int b = 0; b < B; ++b) {
    fits[b] = fits[b] && activation(b) && allocs[b] == 1 && frees[b] == 1 && last_forward[b] >= 0 && consumer[b] > last_forward[b];
    if (!fits[b]) continue;
    if (micro_of(b) >= static_cast<int>(consumers.size())) consumers.resize(micro_of(b) + 1);
    consumers[micro_of(b)].push_back(consumer[b]);
  }
  for (auto& c : consumers) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  const int d = p.config.offload.prefetch;
  auto rank_of = [&](int b) {
    const std::vector<int>& c = consumers[micro_of(b)];
    return static_cast<int>(std::lower_bound(c.begin(), c.end(), consumer[b]) - c.begin());
  };
  std::vector<int> moved;  // in write order
  for (int b = 0; b < B; ++b)
    if (fits[b] && rank_of(b) > d && p.config.offload.activations_on_disk(p.buffers[b].unit)) moved.push_back(b);
  if (moved.empty()) return;
  std::stable_sort(moved.begin(), moved.end(), [&](int x, int y) { return last_forward[x] < last_forward[y]; });

  int copy_stream = static_cast<int>(std::find(p.streams.begin(), p.streams.end(), "copy") - p.streams.begin());
  if (copy_stream == static_cast<int>(p.streams.size())) p.streams.push_back("copy");
  // A copy is listed after its anchor and the copy tasks already listed right after it (the state's
  // copies, which are wanted sooner), waiting for the anchor.
  std::vector<std::vector<Task>> after(n);
  auto add = [&](Op op, int b, int anchor) {
    Task t;
    t.op = op;
    t.stream = copy_stream;
    t.unit = p.buffers[b].unit;
    t.micro = p.tasks[last_forward[b]].micro;
    t.io.window = b;
    t.bytes = p.buffers[b].bytes;
    t.deps = {anchor};
    (op == Op::reload ? t.allocs : t.frees).push_back(b);
    int at = anchor;
    while (at + 1 < n && p.tasks[at + 1].stream == copy_stream) ++at;
    after[at].push_back(std::move(t));
  };
  std::vector<int64_t> offset(consumers.size(), 0);  // by micro-step
  for (int b : moved) {
    BufferDesc& buf = p.buffers[b];
    buf.bytes = disk_aligned(buf.bytes);  // O_DIRECT moves whole 4 KiB blocks
    buf.disk_offset = offset[micro_of(b)];
    offset[micro_of(b)] += buf.bytes;
    add(Op::write_back, b, last_forward[b]);
    add(Op::reload, b, consumers[micro_of(b)][rank_of(b) - d - 1]);
  }
  p.activation_file_bytes = *std::max_element(offset.begin(), offset.end());

  // The new list, ids renumbered to list order; a consumer waits for its reloads.
  std::vector<int> new_id(n);
  for (int i = 0, next = 0; i < n; ++i) new_id[i] = next++, next += static_cast<int>(after[i].size());
  std::vector<Task> out;
  out.reserve(n + 2 * moved.size());
  std::vector<std::vector<int>> reloads(n);  // by old consumer id
  for (int i = 0; i < n; ++i) {
    Task& t = p.tasks[i];
    t.id = new_id[i];
    for (int& dep : t.deps) dep = new_id[dep];
    out.push_back(std::move(t));
    for (Task& c : after[i]) {
      c.id = static_cast<int>(out.size());
      for (int& dep : c.deps) dep = new_id[dep];
      if (c.op == Op::reload) reloads[consumer[c.io.window]].push_back(c.id);
      out.push_back(std::move(c));
    }
  }
  for (int i = 0; i < n; ++i) {
    if (reloads[i].empty()) continue;
    Task& t = out[new_id[i]];
    t.deps.insert(t.deps.end(), reloads[i].begin(), reloads[i].end());
    std::sort(t.deps.begin(), t.deps.end());
  }
  p.tasks = std::move(out);
}

}  // namespace

void offload_pass(Plan& p, const model::ModelDesc& desc) {
  const OffloadConfig& o = p.config.offload;
  if (!o.disk()) return;
  const bool train = p.config.mode == PlanConfig::Mode::train;
  if (o.prefetch < 0 || o.prefetch > kMaxOffloadPrefetchDepth)
    throw std::invalid_argument("offload prefetch (--offload-prefetch): must be in [0, " +
                                std::to_string(kMaxOffloadPrefetchDepth) + "], got " + std::to_string(o.prefetch));
  if (o.any()) offload_state(p, desc);
  if (o.activations && train) offload_activations(p);
  settle_windows(p);
}

}  // namespace shardlm::plan
