// The plan builder: a walk over the step's schedule (plan/schedule.h: each micro-step's forward
// over the units, then its backward) that emits compute tasks with the buffers they allocate, read
// and free, and, depending on the strategy, the collectives around them.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>
#include <stdexcept>

#include "plan/param_gather.h"
#include "plan/recompute.h"
#include "plan/plan.h"
#include "plan/schedule.h"

namespace shardlm::plan {

namespace {

using model::Recompute;

// Ranks one unit is split over under a normalized config's strategy.
int shard_size_of(const PlanConfig& c) {
  return c.strategy == Strategy::ddp ? 1 : c.strategy == Strategy::hybrid ? c.shard_group : c.world;
}

// A normalized config's mesh.
// ep sits between the replicas and dp_shard: the ranks of an expert group shard (or under DDP
// replicate) dense units together with dp_shard, and a rank's part of a unit split over
// {ep, dp_shard} lies inside its ep coordinate's slice of the unit.
// cp is innermost (a ring's neighbours are consecutive ranks); it shards with dp_shard, or under
// DDP replicates, like ep.
Mesh mesh_of(const PlanConfig& c) {
  const bool ddp = c.strategy == Strategy::ddp;
  const int shard_size = shard_size_of(c);
  const int ep = c.ep, outer_ep = ddp ? ep : 1, inner_ep = ddp ? 1 : ep;
  const int cp = c.cp, outer_cp = ddp ? cp : 1, inner_cp = ddp ? 1 : cp;
  std::vector<MeshAxis> axes{{AxisRole::replicate, c.world / shard_size / outer_ep / outer_cp}};
  if (ep > 1) axes.push_back({AxisRole::expert, ep});
  axes.push_back({AxisRole::shard, shard_size / inner_ep / inner_cp});
  if (cp > 1) axes.push_back({AxisRole::context, cp});
  return Mesh(axes);
}

class Builder : private TaskList {
 public:
  Builder(const model::ModelDesc& desc, const PlanConfig& cfg) : desc_(desc), cfg_(cfg) {}
  Plan build();
  // The plan's mesh, layout, state placement and static memory: everything but tasks and buffers.
  Plan frame_only() {
    frame();
    return std::move(plan_);
  }

 private:
  void frame();
  int add(Op op, int unit, int micro, std::vector<int> deps = {}) {
    Task t;
    t.op = op, t.unit = unit, t.micro = micro;
    t.stream = info(op).stream == OpStream::comm ? kComm : info(op).stream == OpStream::exchange ? exchange_stream() : kCompute;
    for (int d : deps)
      if (d >= 0) t.deps.push_back(d);
    return append(std::move(t));
  }
  Task& at(int t) override { return tasks_[t]; }
  // The exchanges' stream, opened by the first.
  int exchange_stream() {
    auto it = std::find(plan_.streams.begin(), plan_.streams.end(), "exchange");
    if (it == plan_.streams.end()) it = plan_.streams.insert(plan_.streams.end(), "exchange");
    return static_cast<int>(it - plan_.streams.begin());
  }
  // The buffer of this name, created on first use.
  int buffer(const std::string& name, Role role, MemCategory category, int64_t bytes, int unit,
             DType dtype = DType::fp32) {
    auto it = by_name_.find(name);
    if (it != by_name_.end()) return it->second;
    BufferDesc b;
    b.id = static_cast<int>(plan_.buffers.size());
    b.name = name, b.role = role, b.category = category, b.dtype = dtype, b.bytes = bytes, b.unit = unit;
    plan_.buffers.push_back(b);
    by_name_[name] = b.id;
    return b.id;
  }
  void alloc(int t, int buf) { at(t).allocs.push_back(buf); }
  void free(int t, int buf) { at(t).frees.push_back(buf); }
  void scratch(int t, int buf) { alloc(t, buf), free(t, buf); }  // alive inside one task
  static std::string tag(int m) { return " [m" + std::to_string(m) + "]"; }
  const std::string& uname(int u) const { return desc_.units[u].name; }
  // A unit sliced over a mesh axis (model::UnitDesc::sliced_over: a MoE block's experts over ep)
  // is used in that many slices, a rank computing with its own: it is gathered and reduced only
  // among the ranks holding the same slice (`within_slice` drops the axis from a collective's).
  int slices(int u) const { return plan_.slices(desc_, u); }
  std::vector<int> within_slice(std::vector<int> axes, int u) const {
    const int a = plan_.mesh.find(desc_.units[u].sliced_over);
    axes.erase(std::remove(axes.begin(), axes.end(), a), axes.end());
    return axes;
  }
  // Elements of unit u a rank computes with (its slice), and their bytes at `elem` bytes each.
  int64_t compute_elems(int u) const { return plan_.compute_elems(desc_, u); }
  int64_t unit_bytes(int u, int elem) const { return compute_elems(u) * elem; }
  int64_t shard_elems(int u) const { return plan_.layout.units[u].padded / plan_.shard_size; }

  int gathered(int u) { return buffer("gathered " + uname(u), Role::gathered, MemCategory::params, unit_bytes(u, 4), u); }
  // A unit's full gradients: one buffer for the step, or one per micro-step where each reduces.
  int full_grads(int u, int m) {
    return buffer("grads " + uname(u) + (cfg_.reduce_each_micro_step ? tag(m) : ""), Role::full_grads, MemCategory::grads,
                  unit_bytes(u, 4), u);
  }
  bool reduces_at(int m) const { return m == last_micro_ || cfg_.reduce_each_micro_step; }
  // Allocates u's full gradients at their first writer of the step, or of the micro-step where
  // each reduces; that writer then waits for the previous micro-step's reduce-scatter of u, which
  // frees its buffer (in a repeated micro-step, the same buffer of the run before).
  void alloc_grads(int t, int u, int m) {
    if (m > 0 && !cfg_.reduce_each_micro_step) return;
    if (!grads_allocated_.insert({m, u}).second) return;
    alloc(t, full_grads(u, m));
    if (const auto before = reduce_scatter_of_.find(u); before != reduce_scatter_of_.end()) at(t).deps.push_back(before->second);
  }
  bool partly_kept(int u) const { return plan_.kept_elems[u] > 0; }
  int kept_part(int u) {
    return buffer("kept " + uname(u), Role::kept_part, MemCategory::params,
                  plan_.kept_elems[u] * plan_.shard_size * cfg_.param_bytes, u, float_dtype(cfg_.param_bytes));
  }
  int value(int v, int m) {
    const int b = buffer(desc_.values[v].name + tag(m), Role::value, MemCategory::activations,
                         desc_.values[v].bytes(shape_, desc_.config.n_embd), -1,
                         desc_.values[v].tokens ? DType::int8 : float_dtype(cfg_.activation_bytes));
    plan_.buffers[b].value = v;
    return b;
  }
  int saved(int u, int m) { return buffer("saved " + uname(u) + tag(m), Role::saved, MemCategory::activations, costs_[u].saved_bytes, u); }
  int recomputable(int u, int m) {
    return buffer("recomputable " + uname(u) + tag(m), Role::recomputable, MemCategory::activations,
                  costs_[u].recomputable_bytes, u);
  }
  int grad_stream(int m) {
    return buffer("grad stream" + tag(m), Role::grad_stream, MemCategory::activations, desc_.grad_stream_bytes(shape_), -1);
  }
  // A task's scratch: the kernels' own (a device backend's), then the layers' part.
  // (The training head runs its kernels in its backward's place: its forward's buffer needs none.)
  int forward_ws(int u, bool kernels = true) {
    const model::UnitCosts& c = costs_[u];
    return workspace("forward ws " + uname(u), Role::forward_ws, c.forward_workspace, kernels ? c.forward_kernel_scratch : 0, u);
  }
  int backward_ws(int u) {
    const model::UnitCosts& c = costs_[u];
    return workspace("backward ws " + uname(u), Role::backward_ws, c.backward_workspace, c.backward_kernel_scratch, u);
  }
  int workspace(const std::string& name, Role role, int64_t layers_part, int64_t kernels_part, int u) {
    const size_t made = plan_.buffers.size();
    const int id = buffer(name, role, MemCategory::workspace, kernels_part + layers_part, u);
    if (plan_.buffers.size() > made) plan_.buffers[id].kernel_scratch = kernels_part;
    return id;
  }
  // bf16 collectives cast through a staging buffer (comm): the whole unit and one shard. The
  // casts copy the whole unit once.
  void stage(int t, int64_t full_elems, int64_t shard_elems, int elem) {
    if (elem == 4) return;
    const int b = buffer("staging " + at(t).name(&desc_), Role::staging, MemCategory::comm,
                         (full_elems + shard_elems) * elem, at(t).unit, DType::bf16);
    scratch(t, b);
    at(t).io.staging = b;
    at(t).copy_bytes = full_elems * 4;
  }

  // The communicator's working memory for a reduction of `count` elements per rank
  // (reduce_scatter) or in all (all_reduce), alive inside the task.
  void reduction_scratch(int t, int64_t count) {
    if (!cfg_.reduction_scratch) return;
    const int group = plan_.mesh.group_size(at(t).axes);
    const int64_t bytes = cfg_.reduction_scratch(at(t).op, count, cfg_.reduce_bytes, group);
    if (bytes <= 0) return;
    const int b = buffer("comm scratch " + at(t).name(&desc_), Role::staging, MemCategory::comm, bytes, at(t).unit,
                         float_dtype(cfg_.reduce_bytes));
    scratch(t, b);
    at(t).io.comm_scratch = b;
  }

  // The state-only unit u borrows (its tasks are u's), or -1.
  int borrowed_state(int u) const {
    const int b = desc_.units[u].borrows;
    return b >= 0 && model::is_state_only(desc_.units[b].kind) ? b : -1;
  }
  int gather(int u, int micro, int prefetch, int direction);
  bool chain_gathered(int u, int direction) const;
  std::vector<int> bucket_from(int u, int direction) const;
  void stage_bucket(int t, const std::vector<int>& units);
  int gather_kept(int u);
  void gather_part(int t, int u, int direction, int deps_last);
  void consume(int compute_task, int u);
  int reuse(int compute_task);
  void walk();
  void forward_pass(int m);
  void backward_pass(int m);
  void forward(int u, int m);
  void backward(int u, int m);
  int routed(int u, int m, int exchange, bool reverse, const char* end, int64_t bytes);
  std::vector<int> exchange_axes(const model::Exchange& x) const {
    const int a = plan_.mesh.find(x.over);
    return a >= 0 ? std::vector<int>{a} : std::vector<int>{};
  }
  // The axes a staged unit's compute tasks name, which its layer routes rows by (UnitArgs::peers):
  // its exchanges' axis other than cp where it has one (a rank's place on cp reaches the layer
  // apart, UnitArgs::cp_index); empty for a unit of one stage.
  std::vector<int> stage_axes(int u, bool reverse) const {
    std::vector<int> axes;
    for (const model::Exchange& x : costs_[u].exchanges_of(reverse))
      if (x.route != model::Exchange::Route::none && (axes.empty() || x.over != model::Split::sequence)) axes = exchange_axes(x);
    return axes;
  }
  int add_stages(int first, bool reverse);
  void consumed_by_last_stage(int first, int last);
  // TaskList, which the recompute pass re-lists the walk's tasks into.
  int append(Task t) override {
    t.id = static_cast<int>(tasks_.size());
    tasks_.push_back(std::move(t));
    return tasks_.back().id;
  }
  void split_forward_into_stages(int whole) override { add_stages(whole, false); }
  void reduce_grad(int u, int producer, int m);
  void release_pending_grads();
  void close_bucket(int producer);
  void read_values(int t, int u, int m);
  void free_at_last_use();
  void keep_units(const std::vector<std::string>& names);
  void keep_parts();
  void finish();
  void place_state();
  void slice_state(int u, UnitPlacement& p) const;
  std::vector<Task> schedule();
  void repeat_middle_micro_step();

  const model::ModelDesc& desc_;
  const PlanConfig& cfg_;
  Plan plan_;
  Schedule schedule_;  // the step's actions, which build() walks
  std::vector<Task> tasks_;
  std::unordered_map<std::string, int> by_name_;
  model::Shape shape_;
  std::vector<model::UnitCosts> costs_;
  std::vector<model::Recompute> recompute_;  // each unit's mode (PlanConfig::recompute_of)
  std::vector<char> kept_;        // borrowed by another unit: gathered once per step, kept
  std::vector<double> part_;      // --keep-gathered NAME:FRACTION, per unit (0: none)
  std::vector<int> kept_gather_;  // its gather task
  // One all_gather of the chain: a bucket of units (one unless --gather-bucket-mb), gathered
  // together, each freed by its own consumer; the bucket is done when its last unit is.
  struct Gathered {
    int gather;
    std::vector<int> units, consumers;  // consumers[i]: the compute task freeing units[i]; -1 until built
    int done() const { return consumers.back(); }
    int pending(int u) const {  // index of u when its consumer is not built yet; else -1
      for (size_t i = 0; i < units.size(); ++i)
        if (units[i] == u && consumers[i] < 0) return static_cast<int>(i);
      return -1;
    }
  };
  std::vector<Gathered> chain_;  // every other all_gather, in issue order
  std::vector<int> reductions_;  // every gradient collective of the last micro-step
  std::set<std::pair<int, int>> grads_allocated_;  // (micro-step, unit) of full gradients allocated
  std::map<int, int> reduce_scatter_of_;            // by unit: its latest reduce-scatter
  // Full gradients whose reduce-scatter is issued: freed by the `countdown`-th backward after it.
  struct PendingFree {
    int reduce_scatter, buffer, countdown;
  };
  std::vector<PendingFree> pending_grads_;
  void settle_grads(int compute_task, bool all);
  std::vector<int> heads_;       // head / loss / logits tasks
  int bucket_first_ = -1, bucket_last_ = -1;
  int64_t bucket_bytes_ = 0;
  bool train_ = true, sharded_params_ = false, sharded_grads_ = false, sharded_optimizer_ = false;
  int last_micro_ = 0;
  int start_ = -1;  // zero_grads (training plans)
};

// An all-gather in the rotating chain: at most `max_gathers_in_flight` gathers (buckets) whose
// buffers are alive, and issued at most `prefetch` gathers ahead of its consumer. A unit's
// gathered buffer is one buffer, so a unit is never gathered twice at once: its gather waits for
// the consumer of its previous gather. With --gather-bucket-mb the gather takes the units after
// u in this pass (`direction` +1: a forward, -1: a backward) into one bucket; their compute
// tasks then find u's bucket already issued.
int Builder::gather(int u, int micro, int prefetch, int direction) {
  if (!chain_.empty() && chain_.back().pending(u) >= 0) return chain_.back().gather;
  const std::vector<int> units = bucket_from(u, direction);
  std::vector<int> deps;
  const int j = static_cast<int>(chain_.size());
  const int limit = cfg_.max_gathers_in_flight;
  if (j - limit >= 0) deps.push_back(chain_[j - limit].done());
  if (j - 1 - prefetch >= 0) deps.push_back(chain_[j - 1 - prefetch].done());
  for (int v : units)
    for (int k = j - 1; k >= 0; --k) {
      const auto& g = chain_[k];
      const auto i = std::find(g.units.begin(), g.units.end(), v) - g.units.begin();
      if (i < static_cast<int64_t>(g.units.size())) {
        deps.push_back(g.consumers[i]);
        break;
      }
    }
  if (deps.empty() && start_ >= 0) deps.push_back(start_);
  // Every dependency is a compute task, and the compute stream runs in order: the latest implies
  // the others (and a gather then never waits on a task two micro-steps back, as Repeat needs).
  if (!deps.empty()) deps = {*std::max_element(deps.begin(), deps.end())};
  const bool bucket = units.size() > 1;
  const int t = add(Op::all_gather, bucket ? -1 : u, micro, deps);
  at(t).axes = within_slice(plan_.shard_axes(), u);
  for (int v : units) {
    at(t).bytes += unit_bytes(v, cfg_.param_bytes);
    // The compute task the gather waits for brings its buffers into being as it ends.
    if (deps.empty()) alloc(t, gathered(v));
    else at(deps.back()).hands_off.push_back(gathered(v));
  }
  if (bucket) {
    at(t).first_unit = units.front(), at(t).last_unit = units.back();
    for (int v : units) at(t).io.bucket.push_back(gathered(v));
    stage_bucket(t, units);
  } else {
    at(t).io.params = gathered(u);
    if (partly_kept(u)) gather_part(t, u, direction, deps.empty() ? -1 : deps.back());
    else stage(t, compute_elems(u), shard_elems(u), cfg_.param_bytes);
  }
  chain_.push_back({t, units, std::vector<int>(units.size(), -1)});
  return t;
}

// Whether this pass gathers unit u through the chain (not kept; in a backward, only the units
// whose backward reads parameters or rebuilds activations, the head's ran with its forward).
bool Builder::chain_gathered(int u, int direction) const {
  if (u < 0 || u >= static_cast<int>(desc_.units.size()) || kept_[u]) return false;
  if (direction > 0) return true;
  const model::UnitCosts& c = costs_[u];
  const bool rebuild = c.kept_bytes(recompute_[u]) < c.saved_bytes + c.recomputable_bytes;
  return !model::is_head(desc_.units[u].kind) && (desc_.units[u].backward_reads_params || rebuild);
}

// u and the units gathered right after it in this pass while their wire bytes together stay
// within --gather-bucket-mb (u alone when it is larger, or bucketing is off). A bucket ends at a
// unit the pass does not gather, so it is one run of consecutive units.
std::vector<int> Builder::bucket_from(int u, int direction) const {
  std::vector<int> units{u};
  if (partly_kept(u)) return units;  // its gathers move a part of it: never in a bucket
  const double limit = cfg_.gather_bucket_mb * 1048576.0;
  double bytes = static_cast<double>(unit_bytes(u, cfg_.param_bytes));
  for (int v = u + direction; limit > 0 && chain_gathered(v, direction) && !partly_kept(v); v += direction) {
    bytes += static_cast<double>(unit_bytes(v, cfg_.param_bytes));
    if (bytes > limit) break;
    units.push_back(v);
  }
  return units;
}

// A bucket's staging (comm): its units' gathered concatenation, rank after rank, in the wire
// dtype (this rank's concatenated shards are packed in place, at its own slot); alive inside
// the gather.
void Builder::stage_bucket(int t, const std::vector<int>& units) {
  int64_t shards = 0;
  for (int v : units) shards += shard_elems(v);
  const int b = buffer("staging " + at(t).name(&desc_), Role::staging, MemCategory::comm,
                       shards * plan_.shard_size * cfg_.param_bytes, -1,
                       float_dtype(cfg_.param_bytes));
  scratch(t, b);
  at(t).io.staging = b;
  for (int v : units) at(t).copy_bytes += unit_bytes(v, 4);
}

// A partly kept unit's gather. In a forward it gathers the whole unit and copies the kept part
// aside (allocated with the gathered buffer, by the compute task the gather waits for); in a
// backward it gathers the rest of each shard into staging (its concatenation, rank after rank)
// and puts the unit together from the two. The backward's consumer frees the kept part.
void Builder::gather_part(int t, int u, int direction, int deps_last) {
  const int64_t shard = shard_elems(u), kept = plan_.kept_elems[u], rest = shard - kept;
  const int S = plan_.shard_size, elem = cfg_.param_bytes;
  if (direction > 0) {
    stage(t, compute_elems(u), shard, elem);
    at(t).io.keep_into = kept_part(u);
    if (deps_last < 0) alloc(t, kept_part(u));
    else at(deps_last).hands_off.push_back(kept_part(u));
    at(t).copy_bytes += kept * S * elem;
    return;
  }
  at(t).bytes = rest * S * elem;
  at(t).io.restore_from = kept_part(u);
  const int b = buffer("staging " + at(t).name(&desc_) + " rest", Role::staging, MemCategory::comm, rest * S * elem, u,
                       float_dtype(elem));
  scratch(t, b);
  at(t).io.staging = b;
  at(t).copy_bytes = unit_bytes(u, 4);
}

int Builder::gather_kept(int u) {
  const int t = add(Op::all_gather, u, 0, {start_});
  at(t).axes = within_slice(plan_.shard_axes(), u);
  at(t).bytes = unit_bytes(u, cfg_.param_bytes);
  at(t).io.params = gathered(u);
  if (start_ < 0) alloc(t, gathered(u));
  else at(start_).hands_off.push_back(gathered(u));
  stage(t, compute_elems(u), shard_elems(u), cfg_.param_bytes);
  kept_gather_[u] = t;
  return t;
}

// The consumer frees unit u's gathered buffer (u is in the chain's latest bucket).
void Builder::consume(int compute_task, int u) {
  Gathered& g = chain_.back();
  const auto i = std::find(g.units.begin(), g.units.end(), u) - g.units.begin();
  free(compute_task, gathered(u));
  g.consumers[i] = compute_task;
}

// Between micro-steps the parameters do not change, and the last unit the backward gathered is
// the first the next forward needs when it is the same unit: keep it instead of gathering it
// again. Returns the gather the compute task now depends on.
int Builder::reuse(int compute_task) {
  Gathered& g = chain_.back();
  const int u = g.units.back();
  auto& frees = at(g.done()).frees;
  frees.erase(std::remove(frees.begin(), frees.end(), gathered(u)), frees.end());
  consume(compute_task, u);
  return g.gather;
}

void Builder::read_values(int t, int u, int m) {
  for (int v : desc_.units[u].reads) at(t).io.inputs.push_back(value(v, m));
}

void Builder::forward(int u, int m) {
  const model::UnitDesc& ud = desc_.units[u];
  const bool head = model::is_head(ud.kind);
  const Op op = !head ? Op::forward : train_ ? Op::head : cfg_.mode == PlanConfig::Mode::loss ? Op::loss : Op::logits;
  int ag = -1;
  bool held = false;
  if (sharded_params_ && kept_[u]) {
    if (m == 0) ag = gather_kept(u);
  } else if (sharded_params_) {
    // The backward's last gathered unit, all of its bucket consumed, is this forward's first.
    // (Not a partly kept unit: its forward gather also sets its kept part aside.)
    held = m > 0 && !chain_.empty() && chain_.back().units.back() == u && chain_.back().done() >= 0 && !partly_kept(u);
    if (!held) ag = gather(u, m, cfg_.prefetch_forward, +1);
  }
  // A borrowed state-only unit (a MoE block's experts) is gathered once per step, like the tied
  // embedding, by its borrower's first forward.
  const int b = borrowed_state(u);
  const int bg = b >= 0 && sharded_params_ && kept_gather_[b] < 0 ? gather_kept(b) : -1;
  const int t = add(op, u, m, {ag, bg});
  if (held) at(t).deps.push_back(reuse(t));
  else if (ag >= 0 && !kept_[u]) consume(t, u);
  const model::UnitCosts& c = costs_[u];
  Operands& io = at(t).io;
  if (sharded_params_) io.params = gathered(u);
  if (ud.borrows >= 0 && sharded_params_) io.borrowed_params = gathered(ud.borrows);
  read_values(t, u, m);
  if (ud.writes >= 0) {
    io.output = value(ud.writes, m);
    alloc(t, io.output);
  }
  if (ud.reads.size() && ud.reads[0] == 0 && !model::is_head(ud.kind)) alloc(t, value(0, m));  // fills the batch
  at(t).flops = c.forward_flops;
  if (c.saved_bytes > 0) {
    io.saved = saved(u, m);
    alloc(t, io.saved);
    if (!train_ || recompute_[u] == Recompute::full) free(t, io.saved);
  }
  if (c.recomputable_bytes > 0) {
    io.recomputable = recomputable(u, m);
    alloc(t, io.recomputable);
    if (!train_ || recompute_[u] != Recompute::none) free(t, io.recomputable);
  }
  const bool head_trains = head && train_;
  if (c.forward_workspace + (head_trains ? 0 : c.forward_kernel_scratch) > 0) scratch(t, io.forward_ws = forward_ws(u, !head_trains));
  if (!head) {
    consumed_by_last_stage(t, add_stages(t, false));
    return;
  }
  heads_.push_back(t);
  if (!train_) return;
  // Training: the head's backward runs in the same task and starts the gradient stream.
  at(t).flops += c.backward_flops;
  if (c.backward_workspace + c.backward_kernel_scratch > 0) scratch(t, io.backward_ws = backward_ws(u));
  io.grad_stream = grad_stream(m);
  alloc(t, io.grad_stream);
  if (sharded_grads_) {
    io.grads = full_grads(u, m);
    if (ud.borrows >= 0) io.borrowed_grads = full_grads(ud.borrows, m);
    for (int g : {u, ud.borrows})
      if (g >= 0) alloc_grads(t, g, m);
  }
  if (reduces_at(m)) reduce_grad(u, t, m);
}

void Builder::backward(int u, int m) {
  const model::UnitDesc& ud = desc_.units[u];
  const model::UnitCosts& c = costs_[u];
  const bool rebuild = c.kept_bytes(recompute_[u]) < c.saved_bytes + c.recomputable_bytes;
  int ag = -1;
  if (sharded_params_ && chain_gathered(u, -1)) ag = gather(u, m, cfg_.prefetch_backward, -1);
  const int params = sharded_params_ && (ud.backward_reads_params || rebuild) ? gathered(u) : -1;
  // Where the unit rebuilds, the recompute pass puts its task before this one, waiting on the
  // gather in its place.
  const int b = add(Op::backward, u, m, {ag});
  settle_grads(b, false);
  if (params >= 0 && !kept_[u]) consume(b, u);
  if (params >= 0 && partly_kept(u)) free(b, kept_part(u));
  Operands& io = at(b).io;
  io.params = params;
  read_values(b, u, m);
  at(b).flops = c.backward_flops;
  if (c.saved_bytes > 0) free(b, io.saved = saved(u, m));
  if (c.recomputable_bytes > 0) free(b, io.recomputable = recomputable(u, m));
  if (c.backward_workspace + c.backward_kernel_scratch > 0) scratch(b, io.backward_ws = backward_ws(u));
  io.grad_stream = grad_stream(m);
  if (u == 0) free(b, io.grad_stream);
  if (sharded_grads_) {
    io.grads = full_grads(u, m);
    alloc_grads(b, u, m);
  }
  // The borrowed state-only unit's gradients come from this backward alone: reduced with it (just
  // before it, keeping DDP's buckets runs of consecutive units in backward order).
  const int lent = borrowed_state(u);
  if (lent >= 0) {
    if (sharded_params_) io.borrowed_params = gathered(lent);
    if (sharded_grads_) {
      io.borrowed_grads = full_grads(lent, m);
      alloc_grads(b, lent, m);
    }
  }
  const int last = add_stages(b, true);
  consumed_by_last_stage(b, last);
  if (lent >= 0 && reduces_at(m)) reduce_grad(lent, last, m);
  if (reduces_at(m)) reduce_grad(u, last, m);
}

// The buffer of a staged unit's routed rows on one end (send, recv) of one of its exchanges.
int Builder::routed(int u, int m, int exchange, bool reverse, const char* end, int64_t bytes) {
  return buffer(std::string(end) + " " + uname(u) + " x" + std::to_string(exchange) + (reverse ? " grads" : "") + tag(m),
                Role::routed, MemCategory::activations, bytes, u, DType::int8);
}

// A staged unit's pass (model::UnitCosts::exchanges): `first`, built as the whole pass, becomes
// its first stage (the last one in a backward, which runs the stages in reverse), and the other
// stages follow, each after the exchange that feeds it: the stage `after` stages back (the one just
// before, or earlier for a prefetch) writes the exchange's `send` (from `written_from` stages back
// on), the exchange fills `recv`, which the stage after reads and frees. An exchange that
// `forwards` sends on an earlier exchange's `recv` instead, which then lives until its own stage.
// An exchange over axes of one rank is left out (the stage after reads `send`); a `none` route has
// no exchange. Everything `first` freed, the last stage frees instead, and it is the pass's
// consumer of gathered parameters. Returns it.
int Builder::add_stages(int first, bool reverse) {
  const int u = at(first).unit, m = at(first).micro;
  const model::UnitCosts& c = costs_[u];
  const std::vector<model::Exchange>& exchanges = c.exchanges_of(reverse);
  const int S = c.stages(reverse);
  if (S == 1) return first;
  using Route = model::Exchange::Route;
  // Each exchange runs over its own axis (a MoE block under cp: the attention's and the routing
  // counts' over cp, the routed rows' over ep); one over an axis of one rank is left out. The
  // stages name stage_axes.
  auto axes_of = [&](const model::Exchange& x) { return exchange_axes(x); };
  auto spans_of = [&](const model::Exchange& x) { return plan_.mesh.group_size(axes_of(x)) > 1; };
  const std::vector<int> axes = stage_axes(u, reverse);
  at(first).axes = axes;
  const Task whole = at(first);
  at(first).frees.clear();
  at(first).stage = reverse ? S - 1 : 0;
  at(first).flops = whole.flops * c.share(at(first).stage, reverse);
  auto exchange_into = [&](int i) -> const model::Exchange& { return exchanges[reverse ? S - 1 - i : i - 1]; };
  // Per position i in the pass: its stage's task, what its stage reads (the receive, or the send
  // of an exchange left out), its exchange, and the position whose stage frees that receive (its
  // own, or a later one whose exchange sends it on).
  std::vector<int> line{first}, feed(S, -1), xts(S, -1), freed_by(S), source(S, -1), ready(S, 0), freed_at_consumer(S, -1);
  for (int i = 0; i < S; ++i) freed_by[i] = i;
  // Each exchange is listed right after the last task it waits on (its `after` stage, and the
  // exchange whose receive it sends on), so the plan's walk counts its receive from the earliest
  // moment it can be allocated: the stages between may still hold what they free.
  for (int i = 1; i < S; ++i) {
    const model::Exchange& x = exchange_into(i);
    if (x.route == Route::none) continue;
    ready[i] = std::max(0, i - x.after);
    if (x.forwards > 0 && i - x.forwards >= 1 && spans_of(x)) {
      source[i] = i - x.forwards;
      freed_by[source[i]] = i;
      ready[i] = std::max(ready[i], ready[source[i]]);
    }
  }
  auto add_exchange = [&](int i) {
    const int e = reverse ? S - 1 - i : i - 1;
    const model::Exchange& x = exchange_into(i);
    const int producer = std::max(0, i - x.after);
    const bool forward_on = source[i] >= 0 && xts[source[i]] >= 0;
    int send = forward_on ? feed[source[i]] : -1;
    if (!forward_on) {
      send = routed(u, m, e, reverse, "send", x.bound_bytes);
      const int from = std::max(0, i - std::max(x.after, x.written_from));
      alloc(line[from], send);
      for (int w = from; w <= producer; ++w) at(line[w]).io.send = send;
    }
    feed[i] = send;
    if (!spans_of(x)) return;
    const int xt = add(Op::exchange, u, m,
                       forward_on ? std::vector<int>{xts[source[i]], line[producer]} : std::vector<int>{line[producer]});
    at(xt).stage = e, at(xt).reverse = reverse, at(xt).axes = axes_of(x);
    at(xt).ring_step = x.route == Route::ring_next ? 1 : x.route == Route::ring_prev ? -1 : 0;
    at(xt).bytes = x.expected_bytes;
    at(xt).carries = x.carries;
    at(xt).io.send = send;
    at(xt).io.recv = feed[i] = routed(u, m, e, reverse, "recv", x.bound_bytes);
    // An exchange started stages ahead of its consumer runs beside those stages: its buffers
    // then live from its producer stage to its consumer stage, so they come and go with the
    // compute stream, and the plan's walk holds them alive with what those stages allocate.
    const bool beside = x.after >= 2;
    alloc(beside ? line[producer] : xt, feed[i]);
    if (!forward_on) beside ? void(freed_at_consumer[i] = send) : free(xt, send);
    xts[i] = xt;
  };
  auto add_exchanges_ready_at = [&](int j) {
    for (int i = j + 1; i < S; ++i)
      if (exchange_into(i).route != Route::none && ready[i] == j) add_exchange(i);
  };
  add_exchanges_ready_at(0);
  for (int i = 1; i < S; ++i) {
    const int s = reverse ? S - 1 - i : i;
    const int t = add(whole.op, u, m, {xts[i] >= 0 ? xts[i] : line.back()});
    at(t).stage = s, at(t).axes = axes;
    at(t).flops = whole.flops * c.share(s, reverse);
    at(t).io = whole.io;
    at(t).io.send = -1;
    at(t).io.recv = feed[i];
    line.push_back(t);
    for (int j = 1; j <= i; ++j)
      if (freed_by[j] == i && feed[j] >= 0) free(t, feed[j]);
    if (freed_at_consumer[i] >= 0) free(t, freed_at_consumer[i]);
    add_exchanges_ready_at(i);
  }
  const int last = line.back();
  for (int f : whole.frees) free(last, f);
  return last;
}

// A staged pass's last stage frees what its first task consumed (add_stages). Apart from
// add_stages, which the recompute pass reruns once the walk's gather chain is done.
void Builder::consumed_by_last_stage(int first, int last) {
  for (Gathered& g : chain_)
    for (int& consumer : g.consumers)
      if (consumer == first) consumer = last;
}

// A compute task frees the full gradients of reduce-scatters issued two backwards before it (or
// all, at the end), waiting for them: gradient memory then moves only with the compute stream,
// and at most three units' full gradients are alive at once.
void Builder::settle_grads(int compute_task, bool all) {
  std::vector<PendingFree> keep;
  for (PendingFree p : pending_grads_) {
    if (all || --p.countdown == 0) {
      at(compute_task).deps.push_back(p.reduce_scatter);
      free(compute_task, p.buffer);
    } else {
      keep.push_back(p);
    }
  }
  pending_grads_ = keep;
}

// Where each micro-step reduces, the reduce-scatters still pending at its end free their own full
// gradients: a buffer of micro-step m is then alive within m alone, as a repeated one must be.
void Builder::release_pending_grads() {
  for (const PendingFree& p : pending_grads_) free(p.reduce_scatter, p.buffer);
  pending_grads_.clear();
}

void Builder::reduce_grad(int u, int producer, int m) {
  if (cfg_.world == 1) return;
  if (sharded_grads_) {
    const int rs = add(Op::reduce_scatter, u, m, {producer});
    at(rs).axes = within_slice(plan_.shard_axes(), u);
    at(rs).bytes = unit_bytes(u, cfg_.reduce_bytes);
    at(rs).io.grads = full_grads(u, m);
    reduce_scatter_of_[u] = rs;
    pending_grads_.push_back({rs, full_grads(u, m), 2});
    stage(rs, compute_elems(u), shard_elems(u), cfg_.reduce_bytes);
    reduction_scratch(rs, shard_elems(u));
    // Each micro-step's scatter adds the held shard in (reads two shards and writes one: about one
    // and a half copies).
    if (cfg_.reduce_each_micro_step) at(rs).copy_bytes += shard_elems(u) * 4 * 3 / 2;
    // The norm waits for the last micro-step's reductions; the earlier ones precede them on the
    // comm stream.
    if (m == last_micro_) reductions_.push_back(rs);
    if (m == last_micro_ && cfg_.world > plan_.shard_size) {  // hybrid: the summed shard across the replicas
      const int ar = add(Op::all_reduce, u, last_micro_, {rs});
      at(ar).axes = plan_.replicate_axes();
      at(ar).bytes = shard_elems(u) * cfg_.reduce_bytes;
      stage(ar, shard_elems(u), 0, cfg_.reduce_bytes);
      reduction_scratch(ar, shard_elems(u));
      reductions_.push_back(ar);
    }
    return;
  }
  // DDP and ZeRO-1: units join a bucket in the order their gradients become final; a bucket of
  // consecutive units is one contiguous range of the flat gradient buffer, reduced over one group:
  // a sliced unit is a bucket of its own, and so is a unit whose gradients live on disk (--offload:
  // they are in its window, not in the flat buffer).
  const bool alone = slices(u) > 1 || cfg_.offload.on_disk(StateKind::grads, u);
  if (alone && bucket_last_ >= 0) close_bucket(producer);
  bucket_first_ = u;
  if (bucket_last_ < 0) bucket_last_ = u;
  bucket_bytes_ += unit_bytes(u, cfg_.reduce_bytes);
  if (bucket_bytes_ >= cfg_.bucket_mb * 1048576.0 || u == 0 || alone) close_bucket(producer);
}

void Builder::close_bucket(int producer) {
  const std::vector<int> axes = within_slice(plan_.grad_axes(), bucket_first_);
  if (plan_.mesh.group_size(axes) == 1) {  // one rank holds these gradients: nothing to reduce
    bucket_first_ = bucket_last_ = -1;
    bucket_bytes_ = 0;
    return;
  }
  const int ar = add(Op::all_reduce, -1, last_micro_, {producer});
  at(ar).axes = axes;
  at(ar).first_unit = bucket_first_;
  at(ar).last_unit = bucket_last_;
  at(ar).bytes = bucket_bytes_;
  stage(ar, bucket_bytes_ / cfg_.reduce_bytes, 0, cfg_.reduce_bytes);
  reduction_scratch(ar, bucket_bytes_ / cfg_.reduce_bytes);
  reductions_.push_back(ar);
  bucket_first_ = bucket_last_ = -1;
  bucket_bytes_ = 0;
}

// Marks the units --keep-gathered names as kept: gathered once per step, freed after their last
// use (the last micro-step's backward), as the borrowed embedding is. NAME:FRACTION marks a part.
void Builder::keep_units(const std::vector<std::string>& names) {
  for (const std::string& entry : names) {
    const size_t colon = entry.find(':');
    const std::string name = entry.substr(0, colon);
    double fraction = 1;
    if (colon != std::string::npos) {
      const std::string f = entry.substr(colon + 1);
      char* end = nullptr;
      fraction = std::strtod(f.c_str(), &end);
      if (f.empty() || *end != '\0' || !(fraction > 0 && fraction < 1))
        throw std::invalid_argument("keep_gathered (--keep-gathered): '" + entry +
                                    "': the part to keep must be a fraction between 0 and 1, as in h.3:0.5");
    }
    bool found = false;
    for (size_t u = 0; u < desc_.units.size(); ++u)
      if (name == "all" || desc_.units[u].name == name) {
        found = true;
        if (fraction < 1) part_[u] = fraction;
        else kept_[u] = 1;
      }
    if (!found) {
      std::string all;
      for (const auto& ud : desc_.units) all += (all.empty() ? "" : ", ") + ud.name;
      throw std::invalid_argument("keep_gathered (--keep-gathered): no unit named '" + name + "' (units: " + all + "; or all, none)");
    }
  }
}

// A part kept counts where a training step gathers the unit again for its backward; it is the
// fraction of each shard, rounded down to 16 elements.
void Builder::keep_parts() {
  plan_.kept_elems.assign(desc_.units.size(), 0);
  if (!train_ || !sharded_params_) return;
  for (size_t u = 0; u < desc_.units.size(); ++u) {
    const int i = static_cast<int>(u);
    if (part_[u] > 0 && chain_gathered(i, -1))
      plan_.kept_elems[u] = static_cast<int64_t>(part_[u] * static_cast<double>(shard_elems(i)) / 16) * 16;
  }
}

// Values and kept gathered units are freed by the last task that reads them.
void Builder::free_at_last_use() {
  std::map<int, int> last;
  for (const Task& t : tasks_) {
    for (int v : t.io.inputs) last[v] = t.id;
    if (t.stream != kCompute) continue;
    for (int b : {t.io.params, t.io.borrowed_params})
      if (b >= 0 && kept_[plan_.buffers[b].unit]) last[b] = t.id;
  }
  for (auto [buf, t] : last) free(t, buf);
}

void Builder::finish() {
  int end = -1;
  if (train_) {
    const int norm = add(Op::grad_norm, -1, last_micro_, reductions_);
    settle_grads(norm, true);
    int before_opt = norm;
    if (cfg_.world > 1) {  // every rank's norm and loss to every rank: all agree they are finite
      before_opt = add(Op::norm_reduce, -1, last_micro_, {norm});
      at(before_opt).axes = plan_.norm_axes();
      // Each rank's squared-gradient sum per gradient class and its loss sum, 8 bytes each.
      at(before_opt).bytes = 8 * static_cast<int64_t>(plan_.grad_classes().size() + 1) * plan_.mesh.group_size(plan_.norm_axes());
    }
    const int opt = add(Op::optimizer, -1, last_micro_, {before_opt});
    at(opt).flops = 10.0 * static_cast<double>(plan_.held_total(StateKind::optimizer));
    end = opt;
  } else {
    end = heads_.back();
  }
  if (cfg_.world > 1) {
    const int lr = add(Op::loss_reduce, -1, last_micro_, {end});
    at(lr).axes = plan_.loss_axes();
    at(lr).bytes = 8;
  }
}

// Every unit's state as the strategy holds it: sharded kinds split over the shard axes, the rest
// whole on every rank, all in host memory (a forward-only plan holds no gradients or moments). A
// sliced unit's state is split over its axis too: each rank holds only its own slice, or a part
// of it.
void Builder::place_state() {
  const Placement sharded{plan_.shard_axes(), plan_.shard_size}, whole{}, none{{}, 0};
  UnitPlacement p;
  p.params = sharded_params_ ? sharded : whole;
  p.grads = !train_ ? none : sharded_grads_ ? sharded : whole;
  p.optimizer = !train_ ? none : sharded_optimizer_ ? sharded : whole;
  std::vector<UnitPlacement> all(desc_.units.size(), p);
  for (int u = 0; u < static_cast<int>(all.size()); ++u)
    if (slices(u) > 1) slice_state(u, all[u]);
  plan_.set_placement(std::move(all));
}

// Adds unit u's slicing axis to each kind's placement, checking that every part then holds whole
// experts' elements: the unit (unpadded) must split into parts of a multiple of 16 elements.
void Builder::slice_state(int u, UnitPlacement& p) const {
  const int axis = plan_.mesh.find(desc_.units[u].sliced_over);
  for (Placement* k : {&p.params, &p.grads, &p.optimizer}) {
    if (k->parts == 0) continue;
    if (std::find(k->axes.begin(), k->axes.end(), axis) == k->axes.end()) {
      k->axes.push_back(axis);
      std::sort(k->axes.begin(), k->axes.end());
    }
    k->parts = plan_.mesh.group_size(k->axes);
    const int64_t numel = desc_.units[u].numel, multiple = 16 * std::max<int64_t>(k->parts, plan_.shard_size);
    if (numel % multiple != 0)
      throw std::invalid_argument("ep (--ep): " + uname(u) + " holds " + std::to_string(numel) +
                                  " elements, not a multiple of 16 × " + std::to_string(multiple / 16) +
                                  ": each rank's experts would not split evenly over the ranks holding them");
  }
}

void Builder::frame() {
  const Strategy s = cfg_.strategy;
  train_ = cfg_.mode == PlanConfig::Mode::train;
  plan_.config = cfg_;
  plan_.shard_size = shard_size_of(cfg_);
  plan_.mesh = mesh_of(cfg_);
  plan_.layout = model::flat_layout(desc_, plan_.shard_size);
  sharded_params_ = s == Strategy::fsdp || s == Strategy::hybrid;
  sharded_grads_ = sharded_params_ || s == Strategy::zero2;
  sharded_optimizer_ = s != Strategy::ddp;
  place_state();
  auto held = [&](StateKind k) { return 4 * plan_.held_total(k); };
  plan_.static_memory = {held(StateKind::params), held(StateKind::grads), 2 * held(StateKind::optimizer), 0};
  if (cfg_.stage_checkpoint && train_)
    plan_.static_memory.staging = plan_.static_memory.params + plan_.static_memory.optimizer + kCheckpointIoBytes;
}

Plan Builder::build() {
  frame();
  auto held = [&](StateKind k) { return 4 * plan_.held_total(k); };
  buffer("params", Role::params, MemCategory::params, held(StateKind::params), -1);
  buffer("grads", Role::grads, MemCategory::grads, held(StateKind::grads), -1);
  buffer("exp_avg", Role::exp_avg, MemCategory::optimizer, held(StateKind::optimizer), -1);
  buffer("exp_avg_sq", Role::exp_avg_sq, MemCategory::optimizer, held(StateKind::optimizer), -1);

  const int U = static_cast<int>(desc_.units.size());
  shape_ = plan_.unit_shape(cfg_.activation_bytes);
  kept_.assign(U, 0);
  part_.assign(U, 0);
  kept_gather_.assign(U, -1);
  for (int u = 0; u < U; ++u) {
    recompute_.push_back(plan_.recompute_of(desc_, u));
    costs_.push_back(desc_.costs(u, plan_.unit_shape(desc_, u, cfg_.activation_bytes)));
    if (desc_.units[u].borrows >= 0) kept_[desc_.units[u].borrows] = 1;
  }
  keep_units(cfg_.keep_gathered);
  keep_parts();
  const bool repeats = train_ && cfg_.grad_accum > kUnrolledMicroSteps && !cfg_.unroll_micro_steps && !cfg_.offload.disk();
  last_micro_ = !train_ ? 0 : repeats ? kUnrolledMicroSteps - 1 : static_cast<int>(cfg_.grad_accum) - 1;
  // The step's first compute task; the first gathers wait for it and it brings their buffers
  // into being, so even they are allocated in compute-stream order.
  if (train_) start_ = add(Op::zero_grads, -1, 0);
  schedule_ = one_stage(last_micro_ + 1, train_ ? Backward::whole : Backward::none);
  walk();
  finish();
  free_at_last_use();
  // The pass adds tasks amid the walk's order (before the comm stream is ordered by it): it lists
  // the walked tasks again, into tasks_.
  std::vector<Task> walked = std::move(tasks_);
  tasks_.clear();
  recompute_pass(walked, *this, plan_, desc_);
  plan_.tasks = schedule();
  if (repeats) repeat_middle_micro_step();
  return std::move(plan_);
}

// The schedule's actions in its order: a forward runs every unit in model order, a backward every
// unit but the head (whose backward its forward task holds) in reverse. One stage holds every
// unit, so the builder walks a one-stage schedule; a pipeline's stages will hold runs of units.
void Builder::walk() {
  if (schedule_.ranks != 1 || schedule_.stages != 1)
    throw std::logic_error("plan: the builder walks a one-stage schedule, not " + schedule_.name);
  for (const Action& a : schedule_.actions[0]) {
    if (a.phase == Phase::forward) forward_pass(a.micro);
    else if (a.phase == Phase::backward) backward_pass(a.micro);
    else throw std::logic_error(std::string("plan: the builder runs whole backwards, not a ") + to_string(a.phase));
  }
}

void Builder::forward_pass(int m) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u)
    if (!model::is_state_only(desc_.units[u].kind)) forward(u, m);
}

void Builder::backward_pass(int m) {
  for (int u = static_cast<int>(desc_.units.size()) - 1; u >= 0; --u)
    if (!model::is_head(desc_.units[u].kind) && !model::is_state_only(desc_.units[u].kind)) backward(u, m);
  if (cfg_.reduce_each_micro_step && m < last_micro_) release_pending_grads();
}

// Micro-step 2 of a plan of four stands for micro-steps 2 .. N-2 (Repeat). Pairs each task of
// micro-step 1 with the one in its place on its stream in micro-step 2, and checks what running
// micro-step 2's tasks again relies on: they are consecutive on their stream, alike to micro-step
// 1's, and wait on nothing further back than micro-step 1.
void Builder::repeat_middle_micro_step() {
  constexpr int R = 2;
  Repeat& rep = plan_.repeat;
  rep.micro = R;
  rep.times = cfg_.grad_accum - (kUnrolledMicroSteps - 1);
  rep.counterpart.assign(plan_.tasks.size(), -1);
  auto broken = [](const std::string& what) { throw std::logic_error("plan: micro-step 2 cannot repeat: " + what); };
  // Micro-steps are alike only where each runs alone, whole, one after the other: in the
  // one-stage schedule (a pipeline's micro-batches overlap the ones before and after).
  if (!(schedule_ == one_stage(kUnrolledMicroSteps))) broken("the step walks the " + schedule_.name + " schedule");
  for (int s = 0; s < static_cast<int>(plan_.streams.size()); ++s) {
    std::vector<int> before, repeated;
    bool left = false;
    for (const Task& t : plan_.tasks) {
      if (t.stream != s) continue;
      if (t.micro == R - 1) before.push_back(t.id);
      if (t.micro == R && left) broken(t.name(&desc_) + " is not with the others on its stream");
      if (t.micro == R) repeated.push_back(t.id);
      else left = left || !repeated.empty();
    }
    if (before.size() != repeated.size()) broken(plan_.streams[s] + " holds a different number of tasks");
    for (size_t i = 0; i < before.size(); ++i) {
      const Task &a = plan_.tasks[before[i]], &b = plan_.tasks[repeated[i]];
      if (a.op != b.op || a.unit != b.unit || a.first_unit != b.first_unit || a.last_unit != b.last_unit ||
          a.deps.size() != b.deps.size() || a.allocs.size() != b.allocs.size() || a.frees.size() != b.frees.size() ||
          a.hands_off.size() != b.hands_off.size())
        broken(a.name(&desc_) + " and " + b.name(&desc_) + " differ");
      rep.counterpart[a.id] = b.id;
    }
  }
  for (const Task& t : plan_.tasks)
    for (int d : t.deps)
      if (t.micro >= R && plan_.tasks[d].micro < t.micro - 1)
        broken(t.name(&desc_) + " waits on " + plan_.tasks[d].name(&desc_));
}

// Orders the comm stream: each collective goes right after the compute task that makes it
// ready (the latest compute task it depends on, directly or through other collectives), so an
// all-gather prefetched for the next unit is queued ahead of the reduce-scatter of the unit
// that just finished. Compute keeps its order. Ids are renumbered to list order.
std::vector<Task> Builder::schedule() {
  const int n = static_cast<int>(tasks_.size());
  std::vector<int> pos(n, -1), ready(n, -1);
  int next = 0;
  for (const Task& t : tasks_)
    if (t.stream == kCompute) pos[t.id] = next++;
  for (const Task& t : tasks_) {  // deps always precede their task in creation order
    if (t.stream == kCompute) continue;
    for (int d : t.deps) ready[t.id] = std::max(ready[t.id], tasks_[d].stream == kCompute ? pos[d] : ready[d]);
  }
  std::vector<int> comm_order;
  for (const Task& t : tasks_)
    if (t.stream != kCompute) comm_order.push_back(t.id);
  // Reductions in every micro-step end it on the comm stream after the next one's first gathers
  // are ready: such a plan keeps each micro-step's comm tasks together (as Repeat needs), the
  // next micro-step's gathers waiting behind the last reduce-scatters.
  const bool by_micro = cfg_.reduce_each_micro_step;
  std::stable_sort(comm_order.begin(), comm_order.end(), [&](int a, int b) {
    if (by_micro && tasks_[a].micro != tasks_[b].micro) return tasks_[a].micro < tasks_[b].micro;
    return ready[a] < ready[b];
  });

  std::vector<int> order;
  size_t ci = 0;
  int compute_seen = 0;
  for (const Task& t : tasks_) {
    if (t.stream != kCompute) continue;
    while (ci < comm_order.size() && ready[comm_order[ci]] < compute_seen) order.push_back(comm_order[ci++]);
    order.push_back(t.id);
    ++compute_seen;
  }
  while (ci < comm_order.size()) order.push_back(comm_order[ci++]);

  std::vector<int> new_id(n);
  for (int i = 0; i < n; ++i) new_id[order[i]] = i;
  std::vector<Task> out;
  out.reserve(n);
  for (int old : order) {
    Task t = std::move(tasks_[old]);
    t.id = new_id[old];
    for (int& d : t.deps) d = new_id[d];
    std::sort(t.deps.begin(), t.deps.end());
    t.deps.erase(std::unique(t.deps.begin(), t.deps.end()), t.deps.end());
    out.push_back(std::move(t));
  }
  return out;
}

void validate(const PlanConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(c.world >= 1, "world size must be >= 1");
  need(c.batch > 0 && c.seq > 0 && c.grad_accum > 0, "batch, seq and grad-accum must be positive");
  need(c.prefetch_forward >= 0 && c.prefetch_backward >= 0, "prefetch-forward and prefetch-backward must be >= 0");
  need(c.max_gathers_in_flight >= 1, "max-gathers-in-flight must be >= 1");
  need(c.bucket_mb > 0, "bucket-mb must be positive");
  need(std::isfinite(c.gather_bucket_mb) && c.gather_bucket_mb >= 0,
       "gather_bucket_mb (--gather-bucket-mb): must be a finite number of MiB >= 0 (0: off), got " +
           std::to_string(c.gather_bucket_mb));
  need(c.threads >= 1, "threads must be >= 1");
  need(c.param_bytes == 4 || c.param_bytes == 2, "param dtype must be fp32 or bf16");
  need(c.reduce_bytes == 4 || c.reduce_bytes == 2, "reduce dtype must be fp32 or bf16");
  need(c.activation_bytes == 4 || c.activation_bytes == 2, "activation bytes must be 4 (fp32) or 2 (bf16)");
  // ZeRO-1/2 and DDP keep no separate fp32 master copy of the parameters: gathering them in
  // bf16 would round the replicas apart. Their mixed precision is bf16 reduction.
  need(c.param_bytes == 4 || c.strategy == Strategy::fsdp || c.strategy == Strategy::hybrid,
       "param-dtype bf16 needs a sharded-parameter strategy (fsdp or hybrid); use reduce-dtype bf16 with " +
           std::string(to_string(c.strategy)));
  need(c.cp >= 1 && c.world % c.cp == 0,
       "cp (--cp): " + std::to_string(c.cp) + " must divide the number of ranks " + std::to_string(c.world));
  need(c.ep >= 1 && (c.world / c.cp) % c.ep == 0, "ep (--ep): " + std::to_string(c.ep) +
                                                     " must divide the number of data-parallel ranks " +
                                                     std::to_string(c.world / c.cp));
  if (c.strategy == Strategy::hybrid) {
    need(c.shard_group >= 1, "hybrid needs --shard-group G >= 1");
    need(c.world % c.shard_group == 0, "shard-group " + std::to_string(c.shard_group) +
                                           " does not divide the number of ranks " + std::to_string(c.world));
    need(c.shard_group % c.ep == 0, "ep (--ep): " + std::to_string(c.ep) + " must divide the shard group " +
                                        std::to_string(c.shard_group) + " (an expert group shards together)");
    need(c.shard_group % (c.cp * c.ep) == 0, "cp (--cp): " + std::to_string(c.cp) + " × ep " + std::to_string(c.ep) +
                                                 " must divide the shard group " + std::to_string(c.shard_group) +
                                                 " (a context group shards together)");
  }
}

// What splitting each sequence over cp ranks needs of the model and the sequence length.
void check_context_split(const model::ModelDesc& desc, const PlanConfig& c) {
  const std::string K = std::to_string(c.cp), impl = model::to_string(c.cp_impl);
  if (!c.split_sequence) return;
  const int64_t parts = c.cp_impl == model::ContextImpl::ring ? 2 * c.cp : c.cp;
  if (c.seq < parts || c.seq % parts != 0)
    throw std::invalid_argument("cp (--cp): the sequence length " + std::to_string(c.seq) + " must be a multiple of " +
                                std::to_string(parts) + " (--cp-impl " + impl + " cuts each sequence into " +
                                std::to_string(parts) + " equal chunks)");
  const int64_t NKV = desc.config.n_kv_head > 0 ? desc.config.n_kv_head : desc.config.n_head;
  if (c.cp_impl == model::ContextImpl::all_to_all && NKV % c.cp != 0)
    throw std::invalid_argument("cp (--cp): " + K + " must divide the " + std::to_string(NKV) +
                                " key/value heads (--cp-impl all-to-all gives each rank whole heads)");
}


// --recompute-blocks within [0, n_layer] and with a mode to apply; all blocks read as -1 and
// none as no recompute, so that a plan has one spelling of each.
void check_recompute_blocks(const model::ModelDesc& desc, PlanConfig& c) {
  const int L = desc.config.n_layer;
  if (c.recompute_blocks < -1 || c.recompute_blocks > L)
    throw std::invalid_argument("recompute_blocks (--recompute-blocks): must be in [0, n_layer = " + std::to_string(L) +
                                "], got " + std::to_string(c.recompute_blocks));
  if (c.recompute_blocks > 0 && c.recompute == Recompute::none)
    throw std::invalid_argument("recompute_blocks (--recompute-blocks): says how many blocks --recompute applies to, "
                                "but --recompute is none");
  if (c.recompute_blocks == L) c.recompute_blocks = -1;
  if (c.recompute_blocks == 0) c.recompute = Recompute::none, c.recompute_blocks = -1;
}

// selective_op names a LLaMA block's GEMMs one by one (model::Recompute): it has no meaning yet for
// the other families' blocks, a sequence split over cp ranks or compressed activations.
void check_selective_op(const model::ModelDesc& desc, const PlanConfig& c) {
  if (c.recompute != Recompute::selective_op) return;
  const auto refuse = [](const std::string& why) {
    throw std::invalid_argument("recompute (--recompute): selective-op " + why);
  };
  if (desc.config.family != model::Family::llama)
    refuse("keeps a LLaMA block's GEMM outputs one by one; this model is " + std::string(model::to_string(desc.config.family)));
  if (c.cp > 1) refuse("runs on one cp rank (--cp 1)");
  if (c.act_quant.on()) refuse("keeps its values in fp32: not with --act-quant");
}

// --reduce-each-micro-step means something where gradients shard and micro-steps accumulate;
// elsewhere it is off, so that a plan has one spelling.
void check_reduce_each_micro_step(PlanConfig& c) {
  if (!c.reduce_each_micro_step) return;
  if (c.world > 1 && (c.strategy == Strategy::ddp || c.strategy == Strategy::zero1))
    throw std::invalid_argument("reduce_each_micro_step (--reduce-each-micro-step): " + std::string(to_string(c.strategy)) +
                                " keeps whole gradients on every rank, reduced once a step; zero2, fsdp and hybrid "
                                "shard them");
  if (c.world == 1 || c.grad_accum == 1) c.reduce_each_micro_step = false;
}

// The configuration as the builder runs it, checked (throws std::invalid_argument naming the field).
// The strategy and shard group as the mesh is laid out from them.
void normalize_layout(PlanConfig& c) {
  // One rank has nothing to shard or reduce: every strategy is DDP's compute without collectives
  // (a sharded plan would only copy parameters into gathered buffers and back).
  if (c.world == 1) c.strategy = Strategy::ddp, c.param_bytes = c.reduce_bytes = 4;
  if (c.strategy == Strategy::hybrid && c.shard_group == 0) c.shard_group = c.world;
}

PlanConfig normalized(const model::ModelDesc& desc, const PlanConfig& config) {
  PlanConfig c = config;
  normalize_layout(c);
  if (c.mode != PlanConfig::Mode::train) c.grad_accum = 1;
  // A forward-only plan keeps nothing for a backward, so it has nothing to compress or rebuild.
  if (c.mode != PlanConfig::Mode::train) c.act_quant = {}, c.recompute = Recompute::none, c.recompute_blocks = -1;
  validate(c);
  model::validate_act_quant(desc.config, c.act_quant, c.cp, c.cp_impl);
  if (c.ep > 1 && desc.config.family != model::Family::moe)
    throw std::invalid_argument("ep (--ep): expert parallelism needs a mixture-of-experts model (--experts), not " +
                                std::string(model::to_string(desc.config.family)));
  if (c.ep > 1 && desc.config.n_experts % c.ep != 0)
    throw std::invalid_argument("ep (--ep): " + std::to_string(c.ep) + " does not divide the number of experts " +
                                std::to_string(desc.config.n_experts));
  if (c.cp > 1) check_context_split(desc, c);
  check_recompute_blocks(desc, c);
  check_selective_op(desc, c);
  check_reduce_each_micro_step(c);
  if (c.memory_budget < 0) throw std::invalid_argument("memory budget (--memory-budget): must be > 0, got " + std::to_string(c.memory_budget));
  return c;
}

}  // namespace

Mesh plan_mesh(const PlanConfig& config) {
  PlanConfig c = config;
  normalize_layout(c);
  validate(c);
  return mesh_of(c);
}

Plan plan_frame(const model::ModelDesc& desc, const PlanConfig& config) {
  return Builder(desc, normalized(desc, config)).frame_only();
}

Plan build_plan(const model::ModelDesc& desc, const PlanConfig& config) {
  const PlanConfig c = normalized(desc, config);
  if (c.memory_budget > 0 && c.offload.units.empty()) return place_for_budget(desc, c);
  Plan plan = Builder(desc, c).build();
  param_gather_pass(plan, desc);
  optimizer_overlap_pass(plan, desc);
  offload_pass(plan, desc);
  return plan;
}

}  // namespace shardlm::plan
