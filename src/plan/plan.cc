#include "plan/plan.h"

#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include "tensor/disk_store.h"

namespace shardlm::plan {

const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::ddp: return "ddp";
    case Strategy::zero1: return "zero1";
    case Strategy::zero2: return "zero2";
    case Strategy::fsdp: return "fsdp";
    case Strategy::hybrid: return "hybrid";
  }
  return "?";
}

std::string strategy_text(const PlanConfig& c) {
  const std::string name = to_string(c.strategy);
  return c.strategy == Strategy::hybrid ? name + " (shard group " + std::to_string(c.shard_group) + ")" : name;
}

Strategy parse_strategy(const std::string& name) {
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
    if (name == to_string(s)) return s;
  throw std::invalid_argument("strategy: unknown '" + name + "' (expected ddp, zero1, zero2, fsdp or hybrid)");
}

const char* to_string(Role r) {
  switch (r) {
    case Role::params: return "params";
    case Role::grads: return "grads";
    case Role::exp_avg: return "exp_avg";
    case Role::exp_avg_sq: return "exp_avg_sq";
    case Role::gathered: return "gathered";
    case Role::kept_part: return "kept_part";
    case Role::full_grads: return "full_grads";
    case Role::value: return "value";
    case Role::saved: return "saved";
    case Role::recomputable: return "recomputable";
    case Role::forward_ws: return "forward_ws";
    case Role::backward_ws: return "backward_ws";
    case Role::grad_stream: return "grad_stream";
    case Role::staging: return "staging";
    case Role::routed: return "routed";
    case Role::window: return "window";
    case Role::rollback: return "rollback";
  }
  return "?";
}

const char* to_string(Location l) {
  switch (l) {
    case Location::host: return "host";
    case Location::device: return "device";
    case Location::disk: return "disk";
  }
  return "?";
}

const char* to_string(State s) {
  switch (s) {
    case State::params: return "params";
    case State::grads: return "grads";
    case State::exp_avg: return "exp_avg";
    case State::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

const char* kind_name(State s) { return kind_of(s) == State::optimizer ? "optimizer" : to_string(s); }

const Placement& UnitPlacement::of(State s) const {
  switch (kind_of(s)) {
    case State::params: return params;
    case State::grads: return grads;
    default: return optimizer;  // either moment
  }
}

void Plan::set_placement(std::vector<UnitPlacement> placement) {
  if (placement.size() != layout.units.size())
    throw std::logic_error("plan: " + std::to_string(placement.size()) + " unit placements for " +
                           std::to_string(layout.units.size()) + " units");
  placement_ = std::move(placement);
  for (int k = 0; k < kNumStateKinds; ++k) {
    auto& at = held_offsets_[k];
    at.assign(1, 0);
    for (size_t u = 0; u < placement_.size(); ++u) {
      const Placement& p = placement_[u].of(State(k));
      const bool held = p.parts > 0;
      if ((held && p.parts != mesh.group_size(p.axes)) || (!held && (p.parts < 0 || !p.axes.empty())) ||
          (held && layout.units[u].padded % (16 * p.parts) != 0))
        throw std::logic_error("plan: unit " + std::to_string(u) + "'s " + kind_name(State(k)) + " in " +
                               std::to_string(p.parts) + " parts does not fit its axes or its padding");
      const int64_t n = held_elems(State(k), static_cast<int>(u));
      if (p.resident != 0 && (p.where != Location::disk || p.resident < 0 || p.resident >= n || p.resident % kResidentGrain != 0))
        throw std::logic_error("plan: unit " + std::to_string(u) + "'s " + kind_name(State(k)) + " keeps " +
                               std::to_string(p.resident) + " of its " + std::to_string(n) +
                               " elements resident (on disk, fewer than all, whole 4 KiB pages only)");
      at.push_back(at.back() + n);
    }
  }
}

int64_t Plan::held_elems(State k, int u) const {
  const int parts = placed(k, u).parts;
  return parts == 0 ? 0 : layout.units[u].padded / parts;
}

bool Plan::any_on_disk(State k) const {
  for (int u = 0; u < static_cast<int>(placement_.size()); ++u)
    if (on_disk(k, u)) return true;
  return false;
}

int64_t Plan::disk_slot_bytes(State k, int u) const {
  return on_disk(k, u) ? disk_aligned(4 * (held_elems(k, u) - placed(k, u).resident)) : 0;
}

int64_t Plan::window_bytes(State k, int u) const { return on_disk(k, u) ? disk_aligned(4 * held_elems(k, u)) : 0; }

int64_t Plan::disk_bytes() const {
  int64_t bytes = activation_file_bytes;
  for (int u = 0; u < static_cast<int>(placement_.size()); ++u)
    for (int k = 0; k < kNumStateKinds; ++k)
      bytes += disk_slot_bytes(State(k), u) * (State(k) == State::optimizer ? 2 : 1);
  return bytes;
}

const char* Plan::activations_where(int u) const {
  bool kept = false;
  for (const BufferDesc& b : buffers) {
    if (b.unit != u || !b.kept_for_backward()) continue;
    if (b.disk_offset >= 0) return "disk";
    kept = true;
  }
  return kept ? "ram" : "-";
}

bool Plan::held_whole(State k) const {
  for (const UnitPlacement& p : placement_)
    if (p.of(k).parts != 1) return false;
  return true;
}

std::vector<GradClass> Plan::grad_classes() const {
  std::vector<GradClass> classes;
  const int pipe = mesh.find(AxisRole::pipe);
  for (int u = 0; u < static_cast<int>(placement_.size()); ++u) {
    const Placement& g = placed(State::grads, u);
    if (g.parts == 0) continue;
    std::vector<int> axes = g.axes;
    if (pipe >= 0 && std::find(axes.begin(), axes.end(), pipe) == axes.end()) {
      axes.push_back(pipe);
      std::sort(axes.begin(), axes.end());
    }
    auto it = std::find_if(classes.begin(), classes.end(), [&](const GradClass& c) { return c.axes == axes; });
    if (it == classes.end()) it = classes.insert(classes.end(), GradClass{axes, {}});
    it->units.push_back(u);
  }
  return classes;
}

std::vector<int> Plan::shard_axes() const { return mesh.shard_axes(config.strategy != Strategy::ddp); }
std::vector<int> Plan::replicate_axes() const { return mesh.replicate_axes(config.strategy != Strategy::ddp); }
std::vector<int> Plan::dp_axes() const { return mesh.data_axes(); }
std::vector<int> Plan::grad_axes(ParamKind kind) const { return mesh.grad_axes(kind, config.split_sequence); }
std::vector<int> Plan::loss_axes() const { return mesh.loss_axes(config.split_sequence); }
std::vector<int> Plan::norm_axes() const { return mesh.norm_axes(config.split_sequence); }
model::Shape Plan::unit_shape(int elem, double expert_load) const {
  model::Shape s{config.batch, local_seq(), elem, config.threads, config.ep, expert_load};
  s.cp = sequence_split();
  s.cp_impl = config.cp_impl;
  s.act_quant = config.act_quant;
  s.recompute = config.recompute;
  s.kernels = config.kernel_scratch;
  return s;
}
model::Recompute PlanConfig::recompute_of(int layer, int n_layer) const {
  if (layer < 0 || recompute_blocks < 0 || recompute_blocks >= n_layer) return recompute;
  const int64_t N = recompute_blocks, l = layer;
  return (l + 1) * N / n_layer > l * N / n_layer ? recompute : model::Recompute::none;
}
model::Recompute Plan::recompute_of(const model::ModelDesc& desc, int u) const {
  return config.recompute_of(desc.units[u].layer, desc.config.n_layer);
}
model::Shape Plan::unit_shape(const model::ModelDesc& desc, int u, int elem, double expert_load) const {
  model::Shape s = unit_shape(elem, expert_load);
  s.recompute = recompute_of(desc, u);
  return s;
}
int Plan::slices(const model::ModelDesc& desc, int u) const {
  const int a = mesh.find(desc.units[u].sliced_over);
  return a >= 0 ? mesh[a].size : 1;
}
int Plan::cp_index(int rank) const { return mesh.index_in(rank, mesh.axes_of({AxisRole::context})); }

std::string Task::name(const model::ModelDesc* desc, int64_t step_micro) const {
  std::string s = to_string(op);
  auto add_unit = [&](int u) {
    s += ' ';
    if (desc) {
      s += desc->units[u].name;
    } else {
      s += 'u';
      s += std::to_string(u);
    }
  };
  if ((op == Op::all_reduce || op == Op::all_gather) && first_unit >= 0) {
    add_unit(first_unit);
    s += "..";
    add_unit(last_unit);
  } else if (unit >= 0) {
    add_unit(unit);
  }
  if (op == Op::exchange) {
    s += " x" + std::to_string(stage);
    if (reverse) s += " grads";
  } else if (op == Op::send || op == Op::recv) {
    s += (reverse ? " grads s" : " activations s") + std::to_string(op == Op::send ? stage : peer_stage) + " -> s" +
         std::to_string(op == Op::send ? peer_stage : stage);
  } else if (stage >= 0) {
    s += " s" + std::to_string(stage);
  }
  if (op == Op::forward || op == Op::backward || op == Op::recompute || op == Op::head || op == Op::loss ||
      op == Op::logits || op == Op::all_gather || op == Op::exchange || op == Op::send || op == Op::recv) {
    s += " [m";
    s += std::to_string(step_micro >= 0 ? step_micro : micro);
    s += ']';
  }
  return s;
}

Plan::Wait Plan::wait_for(const Task& t, int64_t run, int dep, int64_t times) const {
  const int R = repeat.micro, dep_micro = tasks[dep].micro;
  if (R < 0 || dep_micro < R - 1) return {dep, 1};
  if (dep_micro == R) return {dep, t.micro == R ? run + 1 : times};
  if (dep_micro == R - 1 && t.micro == R && run > 0) return {repeat.counterpart[dep], run};
  return {dep, 1};
}

StreamWalk::StreamWalk(const Plan& plan, int stream, int64_t times) : times_(times < 0 ? plan.repeat.times : times) {
  for (const Task& t : plan.tasks) {
    if (t.stream != stream) continue;
    if (t.micro == plan.repeat.micro && first_ == end_) first_ = end_ = order_.size();
    order_.push_back(t.id);
    if (t.micro == plan.repeat.micro) end_ = order_.size();
  }
}

void StreamWalk::next() {
  if (i_ + 1 == end_ && run_ + 1 < times_) {
    i_ = first_;
    ++run_;
    return;
  }
  if (i_ + 1 == end_) run_ = 0;
  ++i_;
}

bool Plan::depends_on(int later, int earlier) const {
  // A task waits for its deps and for the task before it on its own stream.
  std::vector<int> prev_on_stream(tasks.size(), -1);
  std::vector<int> last(streams.size(), -1);
  for (const Task& t : tasks) {
    prev_on_stream[t.id] = last[t.stream];
    last[t.stream] = t.id;
  }
  std::vector<char> seen(tasks.size(), 0);
  std::vector<int> stack{later};
  while (!stack.empty()) {
    const int t = stack.back();
    stack.pop_back();
    std::vector<int> preds = tasks[t].deps;
    if (prev_on_stream[t] >= 0) preds.push_back(prev_on_stream[t]);
    for (int d : preds) {
      if (d == earlier) return true;
      if (!seen[d]) seen[d] = 1, stack.push_back(d);
    }
  }
  return false;
}

MemSnapshot StaticMemory::by_category() const {
  MemSnapshot m;
  const std::pair<MemCategory, int64_t> parts[] = {{MemCategory::params, params},       {MemCategory::grads, grads},
                                                   {MemCategory::optimizer, optimizer}, {MemCategory::snapshot, snapshot},
                                                   {MemCategory::staging, staging}};
  for (const auto& [c, b] : parts) {
    m.bytes[static_cast<int>(c)] += b;
    m.total += b;
  }
  return m;
}

namespace {

// Walks the tasks in list order (every allocation precedes its frees, and the list order is one
// the streams can run in, so this visits a reachable sequence of live sets); returns the
// snapshot at the highest total and, in `each`, every category's own maximum.
MemSnapshot walk_memory(const Plan& plan, MemSnapshot* each) {
  MemSnapshot live;
  auto add = [&](MemCategory c, int64_t b) {
    live.bytes[static_cast<int>(c)] += b;
    live.total += b;
  };
  live = plan.static_memory.by_category();
  MemSnapshot peak = live;
  if (each) *each = live;
  std::vector<char> alive(plan.buffers.size(), 0);
  for (const Task& t : plan.tasks) {
    for (int a : t.allocs) {
      alive[a] = 1;
      add(plan.buffers[a].category, plan.buffers[a].bytes);
    }
    if (live.total > peak.total) peak = live;
    if (each)
      for (int c = 0; c < kNumMemCategories; ++c) each->bytes[c] = std::max(each->bytes[c], live.bytes[c]);
    for (int f : t.frees) {
      if (!alive[f]) continue;
      alive[f] = 0;
      add(plan.buffers[f].category, -plan.buffers[f].bytes);
    }
    for (int a : t.hands_off) {
      alive[a] = 1;
      add(plan.buffers[a].category, plan.buffers[a].bytes);
    }
    if (live.total > peak.total) peak = live;
    if (each)
      for (int c = 0; c < kNumMemCategories; ++c) each->bytes[c] = std::max(each->bytes[c], live.bytes[c]);
  }
  if (each) {
    each->total = 0;
    for (int c = 0; c < kNumMemCategories; ++c) each->total += each->bytes[c];
  }
  return peak;
}

// --gather-bucket-mb: which units share an all_gather, and what that costs in memory against
// the same plan with one all_gather per unit.
void gather_buckets_text(const Plan& plan, const model::ModelDesc& desc, std::ostream& o) {
  if (plan.config.gather_bucket_mb <= 0 || plan.held_whole(State::params)) return;  // no sharded parameters, no gathers
  std::vector<const Task*> buckets;
  int gathers = 0;
  for (const Task& t : plan.tasks) {
    gathers += t.op == Op::all_gather;
    if (t.op == Op::all_gather && t.first_unit >= 0) buckets.push_back(&t);
  }
  PlanConfig unbucketed = plan.config;
  unbucketed.gather_bucket_mb = 0;
  const Plan base = build_plan(desc, unbucketed);
  int base_gathers = 0;
  for (const Task& t : base.tasks) base_gathers += t.op == Op::all_gather;
  auto mib = [](int64_t b) { return b / 1048576.0; };
  o << "\ngather buckets (<= " << plan.config.gather_bucket_mb << " MiB): " << gathers << " all_gathers a step instead of "
    << base_gathers << "; " << buckets.size() << " of them gather several units:\n";
  for (const Task* t : buckets) {
    const int n = std::abs(t->last_unit - t->first_unit) + 1;
    o << "  " << t->name(&desc) << ": " << n << " units, " << mib(t->bytes) << " MiB, staging "
      << mib(plan.buffers[t->io.staging].bytes) << " MiB (comm)\n";
  }
  const MemSnapshot with = plan.peak_memory(), without = base.peak_memory();
  const MemSnapshot each = plan.max_memory(), each_base = base.max_memory();
  o << "  memory price (own peak, bucketed - unbucketed): params " << mib(each[MemCategory::params] - each_base[MemCategory::params])
    << " MiB, comm " << mib(each[MemCategory::comm] - each_base[MemCategory::comm]) << " MiB; total at peak "
    << mib(with.total - without.total) << " MiB\n";
}

// The mesh and each rank's coordinates on it (the first and last ranks of a large world).
void mesh_text(const Mesh& mesh, std::ostream& o) {
  o << "\nmesh: " << mesh.to_string() << " (ranks fill it row-major; the last axis holds consecutive ranks)\n";
  const int n = mesh.rank_count(), shown = 4;
  for (int r = 0; r < n; ++r) {
    if (n > 2 * shown && r == shown) {
      o << "  ...\n";
      r = n - shown;
    }
    const std::vector<int> c = mesh.coords(r);
    o << "  rank " << r << ":";
    for (size_t a = 0; a < c.size(); ++a) o << " " << mesh[static_cast<int>(a)].name() << "=" << c[a];
    o << "\n";
  }
}

// With --memory-budget or --offload: where each unit's state lives, one line a unit, and the peak.
void unit_state_text(const Plan& plan, const model::ModelDesc& desc, std::ostream& o) {
  const PlanConfig& c = plan.config;
  if (c.memory_budget <= 0 && !c.offload.disk()) return;
  o << "\nstate per unit (params / grads / optimizer / saved activations: ram | disk (with the share of each rank's part "
       "kept in memory, if any) | - not held)";
  if (c.memory_budget > 0) o << ", memory budget " << c.memory_budget << " bytes per rank";
  const int64_t peak = plan.peak_memory().total;
  const std::streamsize precision = o.precision();
  o << ", accounted peak " << peak << " (" << std::fixed << std::setprecision(1) << peak / 1048576.0 << " MiB), on disk "
    << plan.disk_bytes() << " bytes:\n";
  o.unsetf(std::ios::floatfield);
  o.precision(precision);
  size_t width = 0;
  for (const model::UnitDesc& u : desc.units) width = std::max(width, u.name.size());
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
    o << "  " << desc.units[u].name << std::string(width - desc.units[u].name.size(), ' ');
    for (int k = 0; k < kNumStateKinds; ++k) {
      const Placement& p = plan.placed(State(k), u);
      o << (k ? " / " : " ") << (p.parts == 0 ? "-" : p.where == Location::disk ? "disk" : "ram");
      if (p.resident > 0)  // a resident head: the share of the part kept in memory
        o << " (" << 100 * p.resident / plan.held_elems(State(k), u) << "% ram)";
    }
    o << " / " << plan.activations_where(u);
    o << "\n";
  }
}

// Each kind of state, runs of consecutive units placed alike: "u0-u13 4 parts over dp_shard, host".
void placement_text(const Plan& plan, std::ostream& o) {
  o << "\nstate placement (each unit's element ranges over mesh axes, and where they live):\n";
  const std::vector<UnitPlacement>& units = plan.placement();
  for (int k = 0; k < kNumStateKinds; ++k) {
    o << "  " << kind_name(State(k)) << ":";
    for (size_t first = 0, u = 0; first < units.size(); first = u) {
      const Placement& p = units[first].of(State(k));
      auto same = [&](const Placement& q) {
        return q.axes == p.axes && q.parts == p.parts && q.where == p.where && q.resident == p.resident;
      };
      while (u < units.size() && same(units[u].of(State(k)))) ++u;
      o << (first ? ";" : "") << " u" << first;
      if (u - 1 > first) o << "-u" << u - 1;
      if (p.parts == 0) {
        o << " not held";
        continue;
      }
      o << " " << (p.parts == 1 ? std::string("whole") : std::to_string(p.parts) + " parts over");
      for (size_t a = 0; a < p.axes.size() && p.parts > 1; ++a) o << (a ? "×" : " ") << plan.mesh[p.axes[a]].name();
      o << ", " << to_string(p.where);
      if (p.resident > 0) o << " but the first " << p.resident << " elements of each part, in memory";
    }
    o << "\n";
  }
  if (plan.activation_file_bytes > 0) {  // --offload activations
    int moved = 0;
    int64_t moved_bytes = 0;
    for (const BufferDesc& b : plan.buffers)
      if (b.disk_offset >= 0) ++moved, moved_bytes += b.bytes;
    const std::streamsize precision = o.precision();
    o << "  offload: " << moved << " saved activation buffers (" << std::fixed << std::setprecision(1)
      << moved_bytes / 1048576.0 << " MiB) written to disk after their forward, read back up to "
      << plan.config.offload.prefetch << " backward tasks ahead; activations at most "
      << plan.max_memory()[MemCategory::activations] / 1048576.0 << " MiB in memory";
    if (moved_bytes > plan.activation_file_bytes)
      o << "; the micro-steps take turns in a file of " << plan.activation_file_bytes / 1048576.0 << " MiB";
    o << "\n";
    o.unsetf(std::ios::floatfield);
    o.precision(precision);
  }
  if (plan.windows.empty()) return;
  // The disk tier: what a step moves and how much of it is in memory at once.
  const std::streamsize precision = o.precision();  // restored below: later figures print as before
  int64_t read = 0, written = 0, windows = 0;
  for (const Task& t : plan.tasks) {
    if (t.op == Op::reload && plan.buffers[t.io.window].disk_offset < 0) read += t.bytes;
    if (t.op == Op::write_back && plan.buffers[t.io.window].disk_offset < 0) written += t.bytes;
  }
  for (const BufferDesc& b : plan.buffers)
    if (b.role == Role::window) windows += b.bytes;
  const MemSnapshot each = plan.max_memory();
  o << "  offload: on disk, read into window buffers by the copy stream up to " << plan.config.offload.prefetch
    << " using tasks ahead, written back behind; a step reads " << std::fixed << std::setprecision(1)
    << read / 1048576.0 << " MiB and writes " << written / 1048576.0 << " MiB; windows of all units "
    << windows / 1048576.0 << " MiB, at most params " << each[MemCategory::params] / 1048576.0 << " / grads "
    << each[MemCategory::grads] / 1048576.0 << " / optimizer " << each[MemCategory::optimizer] / 1048576.0
    << " MiB in memory\n";
  o.unsetf(std::ios::floatfield);
  o.precision(precision);
}

}  // namespace

MemSnapshot Plan::peak_memory() const { return walk_memory(*this, nullptr); }

MemSnapshot Plan::max_memory() const {
  MemSnapshot each;
  walk_memory(*this, &each);
  return each;
}

std::string Plan::to_text(const model::ModelDesc& desc) const {
  std::ostringstream o;
  const auto& c = config;
  const char* mode = c.mode == PlanConfig::Mode::train ? "train" : c.mode == PlanConfig::Mode::loss ? "loss" : "logits";
  o << "plan (" << mode << "): model " << model::to_string(desc.config.family) << ", strategy " << to_string(c.strategy)
    << ", " << c.world << " ranks (mesh";
  for (const auto& a : mesh.axes()) o << " " << a.name() << "=" << a.size;
  o << "), B=" << c.batch << " T=" << c.seq;
  if (c.cp > 1)
    o << " (cp " << c.cp << ", " << model::to_string(c.cp_impl) << ": " << local_seq() << " positions a rank"
      << (c.split_sequence ? "" : ", not split here") << ")";
  o << " grad_accum=" << c.grad_accum << ", prefetch fwd " << c.prefetch_forward
    << " bwd " << c.prefetch_backward << ", gathers in flight <= " << c.max_gathers_in_flight << ", recompute "
    << model::to_string(c.recompute);
  if (c.recompute_blocks >= 0) o << " on " << c.recompute_blocks << " of " << desc.config.n_layer << " blocks";
  o << ", " << c.threads << " thread(s)";
  if (c.act_quant.on())
    o << ", act-quant int8 (group " << c.act_quant.group << ", " << (c.act_quant.stochastic ? "stochastic" : "nearest")
      << " rounding)";
  if (c.gather_bucket_mb > 0 && !held_whole(State::params)) o << ", gather buckets <= " << c.gather_bucket_mb << " MiB";
  if (c.pipeline_optimizer && c.mode == PlanConfig::Mode::train) o << ", pipelined optimizer";
  if (c.reduce_each_micro_step) o << ", gradients reduce-scattered each micro-step";
  o << "\n";

  mesh_text(mesh, o);
  placement_text(*this, o);
  unit_state_text(*this, desc, o);

  o << "\nunits (per micro-step; GFLOP; activation MiB kept for the backward under this recompute mode / "
       "transient; workspace MiB forward / backward):\n";
  auto mib = [](int64_t b) { return b / 1048576.0; };
  for (size_t u = 0; u < desc.units.size(); ++u) {
    const model::Shape shape = unit_shape(desc, static_cast<int>(u), 4);
    const model::UnitCosts k = desc.costs(static_cast<int>(u), shape);
    const int64_t kept = k.kept_bytes(shape.recompute), all = k.saved_bytes + k.recomputable_bytes;
    o << "  u" << u << " " << desc.units[u].name << " (" << model::to_string(desc.units[u].kind) << ", "
      << layout.units[u].numel << " params, padded " << layout.units[u].padded << "): fwd " << k.forward_flops / 1e9
      << " bwd " << k.backward_flops / 1e9 << " recompute " << k.recompute_flops(shape.recompute) / 1e9 << " | out "
      << mib(k.output_bytes) << " kept " << mib(kept) << " transient " << mib(all - kept) << " | ws "
      << mib(k.forward_workspace + k.forward_kernel_scratch) << " / " << mib(k.backward_workspace + k.backward_kernel_scratch) << "\n";
  }

  o << "\nmemory per rank (bytes):\n";
  const MemSnapshot peak = peak_memory(), each = max_memory();
  auto line = [&](MemCategory cat, int64_t st) {
    o << "  " << to_string(cat) << ": static " << st << ", at peak " << peak[cat] << " (" << mib(peak[cat])
      << " MiB), own peak " << each[cat] << " (" << mib(each[cat]) << " MiB)\n";
  };
  line(MemCategory::params, static_memory.params);
  line(MemCategory::grads, static_memory.grads);
  line(MemCategory::optimizer, static_memory.optimizer);
  line(MemCategory::activations, 0);
  line(MemCategory::comm, 0);
  line(MemCategory::workspace, 0);
  line(MemCategory::snapshot, static_memory.snapshot);
  line(MemCategory::staging, static_memory.staging);
  o << "  total at peak: " << peak.total << " (" << mib(peak.total) << " MiB)\n";
  gather_buckets_text(*this, desc, o);

  o << "\ntasks (id stream op | deps | GFLOP | MiB | allocs / frees):\n";
  if (repeat.micro >= 0)
    o << "  (grad_accum " << c.grad_accum << ": the tasks of [m" << repeat.micro << "] run " << repeat.times
      << " times, as micro-steps " << repeat.micro << ".." << repeat.micro + repeat.times - 1 << "; [m"
      << repeat.micro + 1 << "] is micro-step " << c.grad_accum - 1 << ")\n";
  double flops = 0;
  int64_t comm_bytes = 0, disk_bytes = 0;
  for (const Task& t : tasks) {
    o << "  " << t.id << "\t" << streams[t.stream] << "\t" << t.name(&desc);
    if (!t.axes.empty()) {
      o << " (";
      for (size_t i = 0; i < t.axes.size(); ++i) o << (i ? "×" : "") << mesh[t.axes[i]].name();
      o << ")";
    }
    if (t.ring_step != 0) o << (t.ring_step > 0 ? " ring step to the next rank" : " ring step to the previous rank");
    if (t.carries) o << " " << t.carries;
    o << " | deps";
    for (int d : t.deps) o << " " << d;
    if (t.flops > 0) o << " | " << t.flops / 1e9 << " GFLOP";
    if (t.bytes > 0) o << " | " << mib(t.bytes) << " MiB";
    for (int a : t.allocs) o << " | +" << buffers[a].name << " " << buffers[a].bytes;
    for (int f : t.frees) o << " | -" << buffers[f].name;
    for (int a : t.hands_off) o << " | +" << buffers[a].name << " " << buffers[a].bytes << " (at end)";
    o << "\n";
    flops += t.flops * static_cast<double>(runs(t));
    const bool copy = t.op == Op::reload || t.op == Op::write_back;  // the disk tier's, not collectives
    if (t.stream != kCompute) (copy ? disk_bytes : comm_bytes) += t.bytes * runs(t);
  }
  int64_t task_runs = 0;
  for (const Task& t : tasks) task_runs += runs(t);
  o << "\ntotal: " << tasks.size() << " tasks (" << task_runs << " runs), " << flops / 1e9 << " GFLOP, " << mib(comm_bytes)
    << " MiB of collectives";
  if (disk_bytes > 0) o << ", " << mib(disk_bytes) << " MiB of disk reads and writes";
  o << "\n";
  return o.str();
}

}  // namespace shardlm::plan
