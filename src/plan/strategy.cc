// The plan builder: a walk over the step's schedule (plan/schedule.h: each micro-step's forward
// over the units, then its backward) that emits compute tasks with the buffers they allocate, read
// and free. The passes it runs inside the walk add what the placement asks for around them: the
// parameter gathers (gather_chain.h), the units' stages (stages.h) and the gradient reductions
// (grad_reduce.h); the recompute pass (recompute.h) follows the walk.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>

#include "plan/draft.h"
#include "plan/gather_chain.h"
#include "plan/grad_reduce.h"
#include "plan/param_gather.h"
#include "plan/pipe_layout.h"
#include "plan/recompute.h"
#include "plan/plan.h"
#include "plan/schedule.h"
#include "plan/stages.h"

namespace shardlm::plan {

namespace {

using model::Recompute;

// Ranks one unit is split over under a normalized config's strategy.
int shard_size_of(const PlanConfig& c) {
  return c.strategy == Strategy::ddp ? 1 : c.strategy == Strategy::hybrid ? c.shard_group : c.stage_world();
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
  std::vector<MeshAxis> axes;
  if (c.pp > 1) axes.push_back({AxisRole::pipe, c.pp});  // outermost: stages apart, often across machines
  axes.push_back({AxisRole::replicate, c.stage_world() / shard_size / outer_ep / outer_cp});
  if (ep > 1) axes.push_back({AxisRole::expert, ep});
  axes.push_back({AxisRole::shard, shard_size / inner_ep / inner_cp});
  if (cp > 1) axes.push_back({AxisRole::context, cp});
  return Mesh(axes);
}

class Builder : private PlanDraft {
 public:
  Builder(const model::ModelDesc& desc, const PlanConfig& cfg) : PlanDraft(desc, cfg) {}
  Plan build();
  // The plan's mesh, layout, state placement and static memory: everything but tasks and buffers.
  Plan frame_only() {
    frame();
    return std::move(plan_);
  }

 private:
  void frame();
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
  // A stage's gradient stream of micro-batch m (each of a rank's stages its own: they pass
  // gradients on at different times).
  int grad_stream(int m) {
    const std::string stage = schedule_.stages > 1 ? " s" + std::to_string(stage_) : "";
    return buffer("grad stream" + stage + tag(m), Role::grad_stream, MemCategory::activations,
                  desc_.grad_stream_bytes(shape_), -1);
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
  // The state-only unit u borrows (its tasks are u's), or -1.
  int borrowed_state(int u) const {
    const int b = desc_.units[u].borrows;
    return b >= 0 && model::is_state_only(desc_.units[b].kind) ? b : -1;
  }
  void walk();
  // The forward and the backward of micro-batch m over stage_'s units.
  void forward_pass(int m);
  void backward_pass(int m);
  // Whether stage_'s neighbour `side` (-1 before, +1 after) is held by another rank.
  bool crosses(int side) const;
  // A transfer between stage_ and its neighbour `side`: the recv filling `buf` (handed off by the
  // rank's last compute task, which it waits for: the receive overlaps that task, not earlier
  // ones), which the next compute task waits for; the send of `buf` after the last compute task.
  int recv(int buf, int m, int side, bool grads);
  void send(int buf, int m, int side, bool grads);
  int transfer(Op op, int buf, int m, int side, bool grads, int after);
  int last_compute() const;
  void wait_in_first_compute(size_t first, int received);
  void forward(int u, int m);
  void backward(int u, int m);
  void split_forward_into_stages(int whole) override { stages_->split(whole, false); }
  void read_values(int t, int u, int m);
  void free_at_last_use();
  void finish();
  void place_state();
  void slice_state(int u, UnitPlacement& p) const;
  std::vector<Task> schedule();
  void repeat_middle_micro_step();

  Schedule schedule_;  // the step's actions, which build() walks
  model::Shape shape_;
  std::vector<model::UnitCosts> costs_;
  std::vector<model::Recompute> recompute_;  // each unit's mode (PlanConfig::recompute_of)
  std::vector<int> heads_;       // head / loss / logits tasks
  std::optional<UnitStages> stages_;    // the ep and cp stages pass
  std::optional<GatherChain> gathers_;  // the parameter gather pass
  std::optional<GradReduction> grads_;  // the gradient reduction pass
  bool train_ = true;
  // The strategy as frame() places the state (the passes read the placement, not these).
  bool sharded_params_ = false, sharded_grads_ = false, sharded_optimizer_ = false;
  int last_micro_ = 0;
  int start_ = -1;  // zero_grads (training plans)
  int stage_ = 0;   // the pipeline stage of the action the walk is in
  std::vector<std::vector<int>> stage_units_;  // by stage: its units with tasks, in model order
  std::vector<char> batch_filled_;             // by micro-batch: a forward has brought the batch into being
};

void Builder::read_values(int t, int u, int m) {
  for (int v : desc_.units[u].reads) at(t).io.inputs.push_back(value(v, m));
}

void Builder::forward(int u, int m) {
  const model::UnitDesc& ud = desc_.units[u];
  const bool head = model::is_head(ud.kind);
  const Op op = !head ? Op::forward : train_ ? Op::head : cfg_.mode == PlanConfig::Mode::loss ? Op::loss : Op::logits;
  const GatherChain::Forward gathers = gathers_->before_forward(u, borrowed_state(u), m);
  const int t = add(op, u, m, gathers.deps);
  gathers_->forward_added(t, u, gathers);
  const model::UnitCosts& c = costs_[u];
  Operands& io = at(t).io;
  if (gathers_->sharded(u)) io.params = gathers_->gathered(u);
  if (ud.borrows >= 0 && gathers_->sharded(ud.borrows)) io.borrowed_params = gathers_->gathered(ud.borrows);
  read_values(t, u, m);
  if (ud.writes >= 0) {
    io.output = value(ud.writes, m);
    alloc(t, io.output);
  }
  // The first forward reading the batch brings it into being, so fills it (the embedding's; on a
  // pipeline stage without it, the head's, for the targets).
  const bool reads_batch = std::find(ud.reads.begin(), ud.reads.end(), 0) != ud.reads.end();
  if (reads_batch && !batch_filled_[m]) alloc(t, value(0, m)), batch_filled_[m] = 1;
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
    gathers_->consumed_by_last_stage(t, stages_->split(t, false));
    return;
  }
  heads_.push_back(t);
  if (!train_) return;
  // Training: the head's backward runs in the same task and starts the gradient stream.
  at(t).flops += c.backward_flops;
  if (c.backward_workspace + c.backward_kernel_scratch > 0) scratch(t, io.backward_ws = backward_ws(u));
  io.grad_stream = grad_stream(m);
  alloc(t, io.grad_stream);
  if (grads_->scatters(u)) {
    io.grads = grads_->full_grads(u, m);
    if (ud.borrows >= 0) io.borrowed_grads = grads_->full_grads(ud.borrows, m);
    for (int g : {u, ud.borrows})
      if (g >= 0) grads_->written(t, g, m);
  }
  if (grads_->reduces_at(m)) grads_->reduce(u, t, m);
}

void Builder::backward(int u, int m) {
  const model::UnitCosts& c = costs_[u];
  const model::UnitDesc& ud = desc_.units[u];
  const int ag = gathers_->before_backward(u, m);
  const int params = gathers_->backward_params(u);
  // Where the unit rebuilds, the recompute pass puts its task before this one, waiting on the
  // gather in its place.
  const int b = add(Op::backward, u, m, {ag});
  grads_->settle(b, false);
  gathers_->backward_added(b, u);
  Operands& io = at(b).io;
  io.params = params;
  read_values(b, u, m);
  at(b).flops = c.backward_flops;
  if (c.saved_bytes > 0) free(b, io.saved = saved(u, m));
  if (c.recomputable_bytes > 0) free(b, io.recomputable = recomputable(u, m));
  if (c.backward_workspace + c.backward_kernel_scratch > 0) scratch(b, io.backward_ws = backward_ws(u));
  io.grad_stream = grad_stream(m);
  if (u == 0) free(b, io.grad_stream);
  if (grads_->scatters(u)) {
    io.grads = grads_->full_grads(u, m);
    grads_->written(b, u, m);
  }
  // The borrowed state-only unit's gradients come from this backward alone: reduced with it (just
  // before it, keeping DDP's buckets runs of consecutive units in backward order).
  const int lent = borrowed_state(u);
  if (lent >= 0) {
    if (gathers_->sharded(lent)) io.borrowed_params = gathers_->gathered(lent);
    if (grads_->scatters(lent)) {
      io.borrowed_grads = grads_->full_grads(lent, m);
      grads_->written(b, lent, m);
    }
  }
  // A block borrowing a unit with tasks of its own (a DiT block, the embedding's conditioning):
  // it reads the unit gathered (kept for the step) and adds to its gradients, which become final
  // at that unit's own backward, later in the pass.
  const int shared = ud.borrows >= 0 && lent < 0 ? ud.borrows : -1;
  if (shared >= 0) {
    if (gathers_->sharded(shared)) io.borrowed_params = gathers_->gathered(shared);
    if (grads_->scatters(shared)) {
      io.borrowed_grads = grads_->full_grads(shared, m);
      grads_->written(b, shared, m);
    }
  }
  const int last = stages_->split(b, true);
  gathers_->consumed_by_last_stage(b, last);
  if (lent >= 0 && grads_->reduces_at(m)) grads_->reduce(lent, last, m);
  if (grads_->reduces_at(m)) grads_->reduce(u, last, m);
}

// Values and kept gathered units are freed by the last task that reads them.
void Builder::free_at_last_use() {
  std::map<int, int> last;
  for (const Task& t : tasks_) {
    for (int v : t.io.inputs) last[v] = t.id;
    if (t.stream != kCompute) continue;
    for (int b : {t.io.params, t.io.borrowed_params})
      if (b >= 0 && gathers_->kept(plan_.buffers[b].unit)) last[b] = t.id;
  }
  for (auto [buf, t] : last) free(t, buf);
}

void Builder::finish() {
  int end = -1;
  if (train_) {
    const int norm = add(Op::grad_norm, -1, last_micro_, grads_->collectives());
    grads_->settle(norm, true);
    int before_opt = norm;
    if (cfg_.world > 1) {  // every rank's norm and loss to every rank: all agree they are finite
      before_opt = add(Op::norm_reduce, -1, last_micro_, {norm});
      at(before_opt).axes = plan_.norm_axes();
      // Each rank's squared-gradient sum per gradient class and its loss sum, 8 bytes each.
      at(before_opt).bytes = 8 * static_cast<int64_t>(plan_.grad_classes().size() + 1) * plan_.mesh.group_size(plan_.norm_axes());
    }
    const int opt = add(Op::optimizer, -1, last_micro_, {before_opt});
    at(opt).flops = 10.0 * static_cast<double>(plan_.held_total(State::optimizer));
    end = opt;
  } else {
    end = heads_.empty() ? last_compute() : heads_.back();  // a pipeline stage before the head's has none
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
  for (int u = 0; u < static_cast<int>(all.size()); ++u) {
    if (!plan_.holds(u)) all[u] = {none, none, none};  // another pipeline stage's
    else if (slices(u) > 1) slice_state(u, all[u]);
  }
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
  plan_.schedule = schedule_ = step_schedule(cfg_, train_, 1);  // build() lists its micro-steps
  plan_.stage_of_unit = stage_of_units(desc_, cfg_, schedule_.stages);
  sharded_params_ = s == Strategy::fsdp || s == Strategy::hybrid;
  sharded_grads_ = sharded_params_ || s == Strategy::zero2;
  sharded_optimizer_ = s != Strategy::ddp;
  place_state();
  auto held = [&](State k) { return 4 * plan_.held_total(k); };
  plan_.static_memory = {held(State::params), held(State::grads), 2 * held(State::optimizer), 0};
  if (cfg_.stage_checkpoint && train_)
    plan_.static_memory.staging = plan_.static_memory.params + plan_.static_memory.optimizer + kCheckpointIoBytes;
}

Plan Builder::build() {
  frame();
  auto held = [&](State k) { return 4 * plan_.held_total(k); };
  buffer("params", Role::params, MemCategory::params, held(State::params), -1);
  buffer("grads", Role::grads, MemCategory::grads, held(State::grads), -1);
  buffer("exp_avg", Role::exp_avg, MemCategory::optimizer, held(State::optimizer), -1);
  buffer("exp_avg_sq", Role::exp_avg_sq, MemCategory::optimizer, held(State::optimizer), -1);

  const int U = static_cast<int>(desc_.units.size());
  shape_ = plan_.unit_shape(cfg_.activation_bytes);
  std::vector<char> backward_reads_params(U);
  for (int u = 0; u < U; ++u) {
    recompute_.push_back(plan_.recompute_of(desc_, u));
    costs_.push_back(desc_.costs(u, plan_.unit_shape(desc_, u, cfg_.activation_bytes)));
    const model::UnitCosts& c = costs_[u];
    const bool rebuild = c.kept_bytes(recompute_[u]) < c.saved_bytes + c.recomputable_bytes;
    backward_reads_params[u] = desc_.units[u].backward_reads_params || rebuild;
  }
  gathers_.emplace(static_cast<PlanDraft&>(*this), std::move(backward_reads_params), train_);
  stages_.emplace(static_cast<PlanDraft&>(*this), costs_);
  const bool repeats = train_ && cfg_.grad_accum > kUnrolledMicroSteps && !cfg_.unroll_micro_steps &&
                       !cfg_.offload.disk() && cfg_.pp == 1;
  last_micro_ = !train_ ? 0 : repeats ? kUnrolledMicroSteps - 1 : static_cast<int>(cfg_.grad_accum) - 1;
  grads_.emplace(static_cast<PlanDraft&>(*this), last_micro_);
  // The step's first compute task; the first gathers wait for it and it brings their buffers
  // into being, so even they are allocated in compute-stream order.
  if (train_) start_ = add(Op::zero_grads, -1, 0);
  gathers_->set_start(start_);
  if (schedule_.stages == 1) plan_.schedule = schedule_ = step_schedule(cfg_, train_, last_micro_ + 1);
  stage_units_.assign(schedule_.stages, {});
  for (int u = 0; u < U; ++u)
    if (!model::is_state_only(desc_.units[u].kind)) stage_units_[plan_.stage_of_unit[u]].push_back(u);
  batch_filled_.assign(schedule_.micro_batches, 0);
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

// The schedule's actions for this plan's rank of the pipe, in its order: a stage's forward runs
// its units in model order, its backward every unit but the head (whose backward its forward task
// holds) in reverse; activations come from the stage before and gradients from the stage after
// where another rank holds it.
void Builder::walk() {
  for (const Action& a : schedule_.actions.at(cfg_.pipe_rank)) {
    stage_ = a.stage;
    if (a.phase == Phase::forward) forward_pass(a.micro);
    else if (a.phase == Phase::backward) backward_pass(a.micro);
    else throw std::logic_error(std::string("plan: the builder runs whole backwards, not a ") + to_string(a.phase));
  }
}

void Builder::forward_pass(int m) {
  const std::vector<int>& units = stage_units_[stage_];
  const int received = crosses(-1) ? recv(value(desc_.units[units.front()].reads[0], m), m, -1, false) : -1;
  const size_t first = tasks_.size();
  for (int u : units) forward(u, m);
  wait_in_first_compute(first, received);
  if (crosses(+1)) send(value(desc_.units[units.back()].writes, m), m, +1, false);
}

void Builder::backward_pass(int m) {
  const std::vector<int>& units = stage_units_[stage_];
  const int received = crosses(+1) ? recv(grad_stream(m), m, +1, true) : -1;
  const size_t first = tasks_.size();
  for (auto u = units.rbegin(); u != units.rend(); ++u)
    if (!model::is_head(desc_.units[*u].kind)) backward(*u, m);
  wait_in_first_compute(first, received);
  if (crosses(-1)) send(grad_stream(m), m, -1, true);
  grads_->end_micro_step(m);
}

bool Builder::crosses(int side) const {
  const int n = stage_ + side;
  return n >= 0 && n < schedule_.stages && schedule_.rank_of_stage[n] != cfg_.pipe_rank;
}

// The first compute task from `first` on waits for the recv `received` (-1: none).
void Builder::wait_in_first_compute(size_t first, int received) {
  if (received < 0) return;
  for (size_t t = first; t < tasks_.size(); ++t)
    if (tasks_[t].stream == kCompute) return tasks_[t].deps.push_back(received);
}

int Builder::last_compute() const {
  for (auto t = tasks_.rbegin(); t != tasks_.rend(); ++t)
    if (t->stream == kCompute) return t->id;
  return -1;
}

int Builder::transfer(Op op, int buf, int m, int side, bool grads, int after) {
  const int t = add(op, -1, m, {after});
  Task& task = at(t);
  task.axes = {plan_.mesh.axis(AxisRole::pipe)};
  task.stage = stage_;
  task.peer_stage = stage_ + side;
  task.peer = schedule_.rank_of_stage[stage_ + side];
  task.reverse = grads;
  task.bytes = plan_.buffers[buf].bytes;
  return t;
}

int Builder::recv(int buf, int m, int side, bool grads) {
  const int before = last_compute();
  const int t = transfer(Op::recv, buf, m, side, grads, before);
  at(t).io.recv = buf;
  if (before >= 0) at(before).hands_off.push_back(buf);
  else alloc(t, buf);
  return t;
}

void Builder::send(int buf, int m, int side, bool grads) {
  const int t = transfer(Op::send, buf, m, side, grads, last_compute());
  at(t).io.send = buf;
  free(t, buf);
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
  need(c.pp >= 1 && c.world % c.pp == 0,
       "pp (--pp): " + std::to_string(c.pp) + " must divide the number of ranks " + std::to_string(c.world));
  const int W = c.stage_world();
  const std::string of_stage = c.pp > 1 ? " of a pipeline stage" : "";
  need(c.cp >= 1 && W % c.cp == 0,
       "cp (--cp): " + std::to_string(c.cp) + " must divide the number of ranks" + of_stage + " " + std::to_string(W));
  need(c.ep >= 1 && (W / c.cp) % c.ep == 0, "ep (--ep): " + std::to_string(c.ep) +
                                                " must divide the number of data-parallel ranks" + of_stage + " " +
                                                std::to_string(W / c.cp));
  if (c.strategy == Strategy::hybrid) {
    need(c.shard_group >= 1, "hybrid needs --shard-group G >= 1");
    need(W % c.shard_group == 0, "shard-group " + std::to_string(c.shard_group) + " does not divide the number of ranks" +
                                     of_stage + " " + std::to_string(W));
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
  if (c.stage_world() > 1 && (c.strategy == Strategy::ddp || c.strategy == Strategy::zero1))
    throw std::invalid_argument("reduce_each_micro_step (--reduce-each-micro-step): " + std::string(to_string(c.strategy)) +
                                " keeps whole gradients on every rank, reduced once a step; zero2, fsdp and hybrid "
                                "shard them");
  if (c.stage_world() == 1 || c.grad_accum == 1) c.reduce_each_micro_step = false;
}

// The configuration as the builder runs it, checked (throws std::invalid_argument naming the field).
// The strategy and shard group as the mesh is laid out from them.
void normalize_layout(PlanConfig& c) {
  // One rank has nothing to shard or reduce: every strategy is DDP's compute without collectives
  // (a sharded plan would only copy parameters into gathered buffers and back).
  if (c.pp < 1 || c.world % c.pp != 0) return;  // validate() names it
  if (c.stage_world() == 1) c.strategy = Strategy::ddp, c.param_bytes = c.reduce_bytes = 4;
  if (c.strategy == Strategy::hybrid && c.shard_group == 0) c.shard_group = c.stage_world();
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

int pipe_rank_of(const PlanConfig& config, int rank) {
  const Mesh mesh = plan_mesh(config);
  const int pipe = mesh.find(AxisRole::pipe);
  return pipe < 0 ? 0 : mesh.coords(rank)[pipe];
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
