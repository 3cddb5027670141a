#include "run/executor.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "comm/nccl.h"
#include "kernels/backend.h"
#include "layers/layers.h"
#include "plan/arena.h"
#include "run/host_store.h"

namespace shardlm::run {

using plan::Op;
using plan::Role;
using plan::StateIndex;
using plan::StateKind;
using plan::Task;
using Clock = std::chrono::steady_clock;

namespace {
// The backend's copies, as the staged communicators want them.
class BackendCopier final : public comm::DeviceCopier {
 public:
  explicit BackendCopier(const kernels::Backend& backend) : backend_(backend) {}
  void to_host(void* host_dst, const void* device_src, size_t bytes) const override {
    backend_.download(host_dst, device_src, bytes);
  }
  void to_device(void* device_dst, const void* host_src, size_t bytes) const override {
    backend_.upload(device_dst, host_src, bytes);
  }

 private:
  const kernels::Backend& backend_;
};
}  // namespace

CommGroups::CommGroups(comm::Communicator& world, const plan::Mesh& mesh, const kernels::Backend* backend,
                       DeviceCollectives device)
    : world_(world), mesh_(mesh) {
  if (mesh.rank_count() != world.size())
    throw std::logic_error("comm groups: a mesh of " + std::to_string(mesh.rank_count()) + " ranks (" +
                           mesh.to_string() + ") over a world of " + std::to_string(world.size()));
  const int A = static_cast<int>(mesh.axes().size());
  for (int a = 0; a < A; ++a)
    if (mesh[a].size > 1) all_ |= 1u << a;
  // The group of this rank over the axes in `set`, split from `from` (a collective call).
  auto split_over = [&](comm::Communicator& from, unsigned set) {
    std::vector<int> axes;
    for (int a = 0; a < A; ++a)
      if (set & (1u << a)) axes.push_back(a);
    return from.split(mesh.group_of(world.rank(), axes), mesh.index_in(world.rank(), axes));
  };
  for (unsigned set = 0; set < all_; ++set)  // every proper subset, in the same order on every rank
    if ((set & ~all_) == 0) groups_[set] = split_over(world, set);
  // Exchanges run over ep (a MoE block's routed rows) or cp (a block's attention split): every set
  // of axes holding one of them gets communicators of its own for the exchange stream.
  unsigned exchange_axes = 0;
  for (int a : mesh.exchange_axes())
    if (mesh[a].size > 1) exchange_axes |= 1u << a;
  for (unsigned set = 1; set <= all_ && exchange_axes != 0; ++set)
    if ((set & ~all_) == 0 && (set & exchange_axes)) exchange_groups_[set] = split_over(world, set);
  if (backend == nullptr || backend->host_memory()) return;
  if (device == DeviceCollectives::nccl) {
    nccl_world_ = comm::make_nccl_communicator(world, backend->stream_handle());
    for (auto& [set, group] : groups_) nccl_groups_[set] = split_over(*nccl_world_, set);  // same order on every rank
    return;
  }
  copier_ = std::make_unique<BackendCopier>(*backend);
  staged_world_ = std::make_unique<comm::StagedCommunicator>(world, *copier_, backend->memory());
  for (auto& [set, group] : groups_)
    staged_groups_[set] = std::make_unique<comm::StagedCommunicator>(*group, *copier_, backend->memory());
  for (auto& [set, group] : exchange_groups_)
    staged_exchange_groups_[set] = std::make_unique<comm::StagedCommunicator>(*group, *copier_, backend->memory());
}

CommGroups::~CommGroups() = default;

unsigned CommGroups::key(const std::vector<int>& axes) const {
  unsigned k = 0;
  for (int a : axes) k |= 1u << a;
  return k & all_;
}

comm::Communicator& CommGroups::get(const std::vector<int>& axes) const {
  const unsigned k = key(axes);
  if (nccl_world_) return k == all_ ? *nccl_world_ : *nccl_groups_.at(k);
  if (!copier_) return host(axes);
  return k == all_ ? *staged_world_ : *staged_groups_.at(k);
}

std::string CommGroups::describe() const {
  if (nccl_world_) return "nccl";
  return staged() ? world_.backend() + " staged through host memory" : world_.backend();
}

comm::Communicator& CommGroups::host(const std::vector<int>& axes) const {
  const unsigned k = key(axes);
  return k == all_ ? world_ : *groups_.at(k);
}

comm::Communicator& CommGroups::exchange(const std::vector<int>& axes) const {
  if (!copier_) return exchange_host(axes);
  const auto it = staged_exchange_groups_.find(key(axes));
  if (it == staged_exchange_groups_.end()) throw std::logic_error("comm groups: no exchange communicator over these axes");
  return *it->second;
}

comm::Communicator& CommGroups::exchange_host(const std::vector<int>& axes) const {
  const auto it = exchange_groups_.find(key(axes));
  if (it == exchange_groups_.end()) throw std::logic_error("comm groups: no exchange communicator over these axes");
  return *it->second;
}

struct Executor::Run {
  const plan::Plan& plan;
  int64_t step;
  const StepInputs& in;
  std::vector<Buffer> live;  // by buffer id; each element is touched only by the tasks that own it
  std::mutex mu;
  StepResult result;
  double sum_squares = 0;
  std::vector<double> class_sums;  // this rank's squared-gradient sum per gradient class
  bool finiteness_known = false;  // norm_reduce has told every rank which ranks went non-finite
  std::vector<int64_t> moved;     // by task id: bytes an exchange sent to other ranks (-1: none)
  int64_t compute_micro = 0;      // the micro-step of the compute stream's task (its thread alone writes it)
  bool update_decided = false;    // decide_update has taken the norm and finiteness
  std::vector<double> unit_squares;  // this rank's squared-gradient sum per unit
  plan::ArenaLayout layout;          // where the buffers live in arena_ (empty: each allocated alone)
  char* data(int id) { return live.at(id).as<char>(); }
  float* f32(int id) { return id < 0 ? nullptr : live.at(id).f32(); }
};

// One handler per op, in ops.h's order; an op without a member function of its name fails here.
const Executor::Handler Executor::kHandlers[plan::kNumOps] = {
#define SHARDLM_OP_HANDLER(name, stream, collective, work) &Executor::name,
    SHARDLM_OPS(SHARDLM_OP_HANDLER)
#undef SHARDLM_OP_HANDLER
};

Executor::Executor(const model::ModelDesc& desc, const plan::Plan& plan, const CommGroups& comms, int threads,
                   std::chrono::milliseconds timeout, const kernels::Backend& backend, const ExecutorFaults& faults,
                   const OffloadOptions& offload)
    : desc_(desc),
      plan_(plan),
      comms_(comms),
      threads_(threads),
      timeout_(timeout),
      backend_(backend),
      arena_(backend.memory()),
      fault_skip_step_(faults.skip_collective.step_of(comms.world().rank())),
      fault_kill_step_(faults.kill.step_of(comms.world().rank())),
      fault_nan_loss_step_(faults.nan_loss.step_of(comms.world().rank())),
      fault_disk_read_step_(faults.disk_read.step_of(comms.world().rank())) {
  if (plan.config.activation_bytes != 4)
    throw std::invalid_argument("executor: layers keep fp32 activations; the plan prices " +
                                std::to_string(plan.config.activation_bytes) + "-byte ones (a simulator's plan)");
  rank_ = comms.world().rank();
  check_placement();
  if (!backend_.host_memory()) check_device_run(plan);
  const int U = static_cast<int>(desc_.units.size());
  for (int si = 0; si < plan::kNumStateBuffers; ++si) {
    const StateKind k = plan::kind_of(StateIndex(si));
    ram_at_[si].assign(1, 0);
    for (int u = 0; u < U; ++u) ram_at_[si].push_back(ram_at_[si].back() + plan.ram_elems(k, u));
  }
  auto state = [&](MemCategory c, StateKind k) {
    const int64_t n = ram_at_[static_cast<int>(k == StateKind::optimizer ? StateIndex::exp_avg : StateIndex(static_cast<int>(k)))].back();
    return n == 0 ? Buffer() : backend_.alloc(c, sizeof(float) * n, Buffer::Fill::zero);
  };
  if (plan.any_on_disk(StateKind::params) || plan.any_on_disk(StateKind::grads) || plan.any_on_disk(StateKind::optimizer) ||
      plan.config.offload.activations) {
    char rank[16];
    std::snprintf(rank, sizeof rank, "rank-%05d.", rank_);
    if (!backend_.host_memory()) {
      store_ = std::make_unique<HostStore>(backend_);
    } else {
      if (offload.dir.empty()) throw std::invalid_argument("--offload: the plan keeps state on disk but no --offload-dir was given");
      DiskStoreOptions io = offload.io;
      if (fault_disk_read_step_ >= 0 && !io.read_fault)  // the test fault: this rank's first read in that step
        io.read_fault = [this](const std::string&, int64_t, int64_t) {
          return running_step_.load() == fault_disk_read_step_ && !disk_read_failed_.exchange(true);
        };
      store_ = std::make_unique<DiskStore>(offload.dir, io, std::string(rank, 10));  // "rank-0000R"
    }
    for (int si = 0; si < plan::kNumStateBuffers; ++si) {
      const StateKind k = plan::kind_of(StateIndex(si));
      if (!plan.any_on_disk(k)) continue;
      std::vector<int64_t>& at = file_at_[si];  // a unit kept in memory takes no room in the file
      at.assign(1, 0);
      for (int u = 0; u < U; ++u) at.push_back(at.back() + plan.disk_slot_bytes(k, u));
      file_[si] = store_->create(rank + std::string(plan::to_string(StateIndex(si))), at.back());
    }
    // --offload activations: one slot per offloaded buffer of the step (scratch within a step).
    if (plan.activation_file_bytes > 0) activation_file_ = store_->create(rank + std::string("activations"), plan.activation_file_bytes);
  }
  params_ = state(MemCategory::params, StateKind::params);
  grads_ = state(MemCategory::grads, StateKind::grads);
  exp_avg_ = state(MemCategory::optimizer, StateKind::optimizer);
  exp_avg_sq_ = state(MemCategory::optimizer, StateKind::optimizer);
  check_carved_fits();
  grad_classes_ = plan_.grad_classes();
  trace_.rank = comms.world().rank();
  trace_.streams = plan.streams;
  // Every rank's trace clock starts at the same moment (to within a barrier's latency), so the
  // ranks' slices line up in one timeline.
  comms.world().barrier("trace clock")->wait(timeout_);
  t0_ = Clock::now();
  sample_memory();
}

Executor::~Executor() = default;

// What a device backend (memory the host cannot address) cannot run yet, refused before any step:
// collectives straight on device pointers, and exchanges over NCCL (a ring step's send and receive
// would need one NCCL group call).
void Executor::check_device_run(const plan::Plan& plan) const {
  if (!comms_.staged() && !comms_.nccl())
    throw std::logic_error(std::string("executor: backend ") + backend_.name() +
                           " keeps state in device memory, but the comm groups were made without it (no staging)");
  for (const Task& t : plan.tasks)
    if (t.op == Op::exchange && comms_.nccl())
      throw std::invalid_argument(std::string("executor: backend ") + backend_.name() +
                                  " cannot run exchange tasks (expert or context parallelism) over NCCL yet");
}

// The plan sizes each unit's buffers by the model's costs (the CPU kernels' scratch); a backend
// whose kernels would carve more would write past them. Checked once, before any step.
void Executor::check_carved_fits() const {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const model::Shape shape = plan_.unit_shape(desc_, u, 4);
    const model::UnitDesc& unit = desc_.units[u];
    const auto carved = layers::layer(unit.kind).carved;
    if (!carved) continue;
    const layers::Carved got = carved(backend_, desc_, unit, shape);
    const model::UnitCosts want = desc_.costs(u, shape);
    if (got.saved > want.saved_bytes || got.recomputable > want.recomputable_bytes ||
        got.forward_ws > want.forward_workspace || got.backward_ws > want.backward_workspace)
      throw std::logic_error("executor: backend " + std::string(backend_.name()) + " carves more of unit " +
                             unit.name + "'s buffers than the plan sizes");
  }
}

double Executor::now_us() const { return std::chrono::duration<double, std::micro>(Clock::now() - t0_).count(); }

void Executor::sample_memory() {
  const MemSnapshot live = backend_.memory().tracker().live();
  std::lock_guard<std::mutex> lock(trace_mu_);
  trace_.memory.push_back({now_us(), live.bytes});
}

// The optimizer updates its range of each unit in place on the parameters and gradients, so
// those must hold it.
void Executor::check_placement() const {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard o = shard_of(StateKind::optimizer, u);
    if (o.parts == 0) continue;
    for (StateKind k : {StateKind::params, StateKind::grads}) {
      const Shard h = shard_of(k, u);
      if (h.parts == 0 || o.begin < h.begin || o.begin + o.len > h.begin + h.len)
        throw std::logic_error("executor: unit " + desc_.units[u].name + "'s " + plan::to_string(k) +
                               " do not hold its optimizer range");
    }
  }
}

Executor::Shard Executor::shard_of(StateKind k, int u) const {
  const int64_t len = plan_.held_elems(k, u);
  const int parts = plan_.placed(k, u).parts;
  return {plan_.layout.units[u].offset, len, parts > 1 ? plan_.part_index(k, u, rank_) * len : 0, parts,
          plan_.held_offset(k, u)};
}

float* Executor::element(const Buffer& buf, StateKind k, int u, int64_t e) const {
  const Shard s = shard_of(k, u);
  return buf.f32() + s.at + (e - s.begin);
}

float* Executor::unit_params(int buffer, int u, Run& r) const {
  return buffer >= 0 ? r.f32(buffer) : held(StateIndex::params, u, &r);
}

float* Executor::unit_grads(int buffer, int u, Run& r) const {
  return buffer >= 0 ? r.f32(buffer) : held(StateIndex::grads, u, &r);
}

bool Executor::on_disk(StateIndex s) const { return file_[static_cast<int>(s)] >= 0; }
bool Executor::on_disk(StateIndex s, int u) const { return on_disk(s) && plan_.on_disk(plan::kind_of(s), u); }

float* Executor::held(StateIndex s, int u, const Run* r) const {
  if (!on_disk(s, u)) return state(static_cast<State>(s)).f32() + ram_at_[static_cast<int>(s)][u];
  const int w = r ? r->plan.window(static_cast<int>(s), u) : -1;
  if (w < 0 || r->live[w].data() == nullptr)
    throw std::logic_error("executor: unit " + desc_.units[u].name + "'s " + plan::to_string(s) +
                           " are on disk and not loaded into their window here");
  return r->live[w].f32();
}

// A window holds the unit's whole part: its resident head (plan::Placement::resident) from memory,
// then the rest from the file.
void Executor::disk_read(StateIndex s, int u, void* dst) {
  const int64_t head = 4 * plan_.placed(plan::kind_of(s), u).resident;
  const auto& at = file_at_[static_cast<int>(s)];
  if (head > 0) backend_.copy(dst, state(static_cast<State>(s)).f32() + ram_at_[static_cast<int>(s)][u], head);
  store_->read(file_[static_cast<int>(s)], at[u], static_cast<char*>(dst) + head, at[u + 1] - at[u]);
}

void Executor::disk_write(StateIndex s, int u, const void* src) {
  const int64_t head = 4 * plan_.placed(plan::kind_of(s), u).resident;
  const auto& at = file_at_[static_cast<int>(s)];
  if (head > 0) backend_.copy(state(static_cast<State>(s)).f32() + ram_at_[static_cast<int>(s)][u], src, head);
  store_->write(file_[static_cast<int>(s)], at[u], static_cast<const char*>(src) + head, at[u + 1] - at[u]);
}

// Through one window-sized bounce buffer: the file pads each unit to 4 KiB, the packed buffer does not.
// A window-sized buffer for the largest unit's part of state s (transfers are whole, aligned units).
Buffer Executor::bounce_window(StateIndex s, Buffer::Fill fill) const {
  int64_t most = 0;
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) most = std::max(most, plan_.window_bytes(plan::kind_of(s), u));
  return backend_.alloc(MemCategory::staging, most, fill);
}

void Executor::disk_read_all(StateIndex s, float* packed) {
  const StateKind k = plan::kind_of(s);
  const auto& at = file_at_[static_cast<int>(s)];
  Buffer bounce = bounce_window(s, Buffer::Fill::none);
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    if (!on_disk(s, u)) {  // kept in memory (a budget's placement may mix)
      backend_.copy(packed + plan_.held_offset(k, u), state(static_cast<State>(s)).f32() + ram_at_[static_cast<int>(s)][u],
                    4 * plan_.held_elems(k, u));
      continue;
    }
    if (at[u + 1] == at[u]) continue;
    disk_read(s, u, bounce.data());
    backend_.wait(kernels::Backend::Lane::compute, backend_.mark(kernels::Backend::Lane::copy));  // the read, then the copy
    backend_.copy(packed + plan_.held_offset(k, u), bounce.data(), 4 * plan_.held_elems(k, u));
  }
}

void Executor::disk_write_all(StateIndex s, const float* packed) {
  const StateKind k = plan::kind_of(s);
  const auto& at = file_at_[static_cast<int>(s)];
  Buffer bounce = bounce_window(s, Buffer::Fill::zero);  // the padding past the unit's part is written too
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    if (!on_disk(s, u)) {
      backend_.copy(const_cast<Buffer&>(state(static_cast<State>(s))).f32() + ram_at_[static_cast<int>(s)][u],
                    packed + plan_.held_offset(k, u), 4 * plan_.held_elems(k, u));
      continue;
    }
    if (at[u + 1] == at[u]) continue;
    backend_.copy(bounce.data(), packed + plan_.held_offset(k, u), 4 * plan_.held_elems(k, u));
    disk_write(s, u, bounce.data());
  }
}


namespace {
StateKind kind_of(Executor::State which) {
  switch (which) {
    case Executor::State::params: return StateKind::params;
    case Executor::State::grads: return StateKind::grads;
    default: return StateKind::optimizer;
  }
}
}  // namespace

const Buffer& Executor::state(State which) const {
  switch (which) {
    case State::params: return params_;
    case State::grads: return grads_;
    case State::exp_avg: return exp_avg_;
    case State::exp_avg_sq: return exp_avg_sq_;
  }
  return params_;
}

float* Executor::local_state(State which) {
  const int si = static_cast<int>(which);
  if (!on_disk(StateIndex(si))) return state(which).bytes() ? state(which).f32() : nullptr;
  if (!staged_[si].data()) {
    staged_[si] = backend_.alloc(MemCategory::staging, 4 * plan_.held_total(kind_of(which)), Buffer::Fill::none);
    disk_read_all(StateIndex(si), staged_[si].f32());
  }
  return staged_[si].f32();
}

void Executor::commit_local_state() {
  for (int si = 0; si < plan::kNumStateBuffers; ++si)
    if (staged_[si].data()) disk_write_all(StateIndex(si), staged_[si].f32());
  release_local_state();
}

void Executor::release_local_state() {
  for (Buffer& b : staged_) b = Buffer();
}

float* Executor::whole(State which) {
  return plan_.held_whole(kind_of(which)) && !on_disk(StateIndex(static_cast<int>(which))) ? state(which).f32() : nullptr;
}

// Unit u's initial values of its elements [begin, end) into dst, in the backend's memory (a
// device's are made on the host and uploaded; the padding past the unit stays as it was).
void Executor::init_range(int u, uint64_t seed, float* dst, int64_t begin, int64_t end) const {
  end = std::min(end, desc_.units[u].numel);
  if (backend_.host_memory()) return layers::init_unit(desc_.units[u], seed, dst, begin, end);
  std::vector<float> host(std::max<int64_t>(0, end - begin));
  layers::init_unit(desc_.units[u], seed, host.data(), begin, end);
  backend_.upload(dst, host.data(), sizeof(float) * host.size());
}

void Executor::init_params(uint64_t seed) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(StateKind::params, u);
    if (!on_disk(StateIndex::params, u)) {
      const int64_t at = on_disk(StateIndex::params) ? ram_at_[static_cast<int>(StateIndex::params)][u] : s.at;
      init_range(u, seed, params_.f32() + at, s.begin, s.begin + s.len);
      continue;
    }
    // Offloaded: through a window-sized buffer into the file (and the resident head).
    Buffer window = backend_.alloc(MemCategory::staging, plan_.window_bytes(StateKind::params, u), Buffer::Fill::zero);
    init_range(u, seed, window.f32(), s.begin, s.begin + s.len);
    disk_write(StateIndex::params, u, window.data());
  }
}

void Executor::allocate(const Task&, int64_t micro, const std::vector<int>& ids, Run& r) {
  if (ids.empty()) return;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (int a : ids) {
      const plan::BufferDesc& b = r.plan.buffers[a];
      // Gradients accumulate and start at zero; everything else is written before it is read.
      // An offloaded unit's gradients start as a zero-filled window.
      const bool zero = b.role == Role::full_grads || (b.role == Role::window && b.category == MemCategory::grads);
      const auto fill = zero ? Buffer::Fill::zero : Buffer::Fill::none;
      const int64_t at = r.layout.offset.empty() ? -1 : r.layout.offset[a];
      r.live[a] = at >= 0 ? arena_.part(b.category, at, b.bytes, fill) : backend_.alloc(b.category, b.bytes, fill);
    }
  }
  for (int a : ids) {  // a task that brings the batch into being fills it
    const plan::BufferDesc& b = r.plan.buffers[a];
    if (b.role == Role::value && b.value == 0) {
      int32_t* tokens = r.live[a].as<int32_t>();
      if (backend_.host_memory()) {
        r.in.batch(micro, tokens, tokens + b.bytes / 8);
        continue;
      }
      // The batch is sampled on the host; a device backend gets a copy.
      std::vector<int32_t> host(b.bytes / 4);
      r.in.batch(micro, host.data(), host.data() + b.bytes / 8);
      backend_.upload(tokens, host.data(), b.bytes);
    }
  }
  sample_memory();
}

void Executor::release(const Task& t, Run& r) {
  if (t.frees.empty()) return;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (int f : t.frees) r.live[f] = Buffer();
  }
  sample_memory();
}

std::string Executor::label(const Task& t, int64_t step) const {
  std::string s = plan::to_string(t.op);
  if ((t.op == Op::all_reduce || t.op == Op::all_gather) && t.first_unit >= 0)
    s += " units " + desc_.units[t.first_unit].name + ".." + desc_.units[t.last_unit].name;
  else if (t.unit >= 0)
    s += " unit " + desc_.units[t.unit].name;
  return s + " step " + std::to_string(step);
}

// Sums a double over a communicator exactly and identically on every rank: gather every rank's
// bits, add in rank order.
double Executor::sum_over(comm::Communicator& c, double local, const std::string& label) {
  std::vector<double> all(c.size());
  c.all_gather(&local, all.data(), 2, DType::fp32, label)->wait(timeout_);
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

// ---- compute handlers

void Executor::zero_grads(const Task&, Run&) {
  if (grads_.data()) backend_.zero(grads_.data(), grads_.bytes());
}

namespace {
uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t quant_key(uint64_t seed, int rank, int64_t step, int64_t micro, int unit) {
  uint64_t k = mix64(seed ^ 0x61637471756e7421ull);  // "actqunt!": apart from the init's draws
  for (uint64_t v : {static_cast<uint64_t>(rank), static_cast<uint64_t>(step), static_cast<uint64_t>(micro),
                     static_cast<uint64_t>(unit)})
    k = mix64(k ^ v);
  return k;
}
}  // namespace

namespace {

// The head of a unit task's workspace buffer, before the layers' part, given to the backend for its
// kernels' own scratch (model::UnitCosts::*_kernel_scratch) while the task's layer runs.
class KernelScratch {
 public:
  KernelScratch(const kernels::Backend& backend, char* ws, int64_t bytes) : backend_(backend), on_(ws && bytes > 0) {
    if (on_) backend_.use_scratch(ws, static_cast<size_t>(bytes));
  }
  ~KernelScratch() {
    if (on_) backend_.use_scratch(nullptr, 0);
  }
  KernelScratch(const KernelScratch&) = delete;
  KernelScratch& operator=(const KernelScratch&) = delete;

 private:
  const kernels::Backend& backend_;
  const bool on_;
};

}  // namespace

// Resolves a unit task's operands and runs its layer.
void Executor::unit_task(const Task& t, Run& r) {
  const model::UnitDesc& u = desc_.units[t.unit];
  const plan::Operands& io = t.io;
  layers::UnitArgs a;
  a.backend = &backend_;
  a.desc = &desc_;
  a.unit = &u;
  a.B = r.plan.config.batch;
  a.T = r.plan.local_seq();
  a.cp = r.plan.sequence_split();
  a.cp_index = r.plan.cp_index(rank_);
  a.cp_impl = r.plan.config.cp_impl;
  a.threads = threads_;
  a.params = unit_params(io.params, t.unit, r);
  // Only a backward (or the training head) writes gradients; offloaded ones are in memory only then.
  const bool grads = !on_disk(StateIndex::grads) || t.op == Op::backward || t.op == Op::head;
  if (grads && (r.plan.placed(StateKind::grads, t.unit).parts > 0 || io.grads >= 0)) a.grads = unit_grads(io.grads, t.unit, r);
  if (u.borrows >= 0) {
    a.borrowed_params = unit_params(io.borrowed_params, u.borrows, r);
    if (grads && (r.plan.placed(StateKind::grads, u.borrows).parts > 0 || io.borrowed_grads >= 0))
      a.borrowed_grads = unit_grads(io.borrowed_grads, u.borrows, r);
  }
  for (size_t i = 0; i < io.inputs.size(); ++i) {
    const int v = u.reads[i];
    if (desc_.values[v].tokens) {
      a.tokens = reinterpret_cast<const int32_t*>(r.data(io.inputs[i]));
      a.targets = a.tokens + r.plan.buffers[io.inputs[i]].bytes / 8;
    } else {
      a.in = r.f32(io.inputs[i]);
    }
  }
  if (io.output >= 0) a.out = r.f32(io.output);
  if (io.saved >= 0) a.saved = r.data(io.saved);
  if (io.recomputable >= 0) a.recomputable = r.data(io.recomputable);
  // A workspace buffer starts with what the plan gave the kernels for their own scratch
  // (512-byte pieces: the layers' part after it keeps the buffer's alignment).
  const auto kernel_part = [&](int ws) { return ws >= 0 ? r.plan.buffers[ws].kernel_scratch : int64_t{0}; };
  const int64_t forward_kernels = kernel_part(io.forward_ws), backward_kernels = kernel_part(io.backward_ws);
  if (io.forward_ws >= 0) a.forward_ws = r.data(io.forward_ws) + forward_kernels;
  if (io.backward_ws >= 0) a.backward_ws = r.data(io.backward_ws) + backward_kernels;
  a.dx = r.f32(io.grad_stream);
  a.grad_scale = r.in.grad_scale;
  a.stage = t.stage;
  if (io.recv >= 0) a.recv = r.data(io.recv);
  if (io.send >= 0) a.send = r.data(io.send);
  a.peers = r.plan.mesh.group_size(t.axes);
  a.peer = r.plan.mesh.index_in(rank_, t.axes);
  a.group_weight = r.in.group_weight > 0 ? r.in.group_weight
                                         : 1.0f / static_cast<float>(r.plan.dp_size() * r.plan.config.grad_accum);
  if (t.op == Op::forward) a.moe = &r.result.moe;
  a.logits = r.in.logits;
  a.all_logits = r.in.all_logits;
  a.act_quant = r.plan.config.act_quant;
  a.recompute = r.plan.recompute_of(desc_, t.unit);
  // Stochastic rounding draws from (seed, rank, step, micro-step, unit) and, in layers/, the tensor
  // and element: reproducible on any thread count and on resume, no generator state to carry, and
  // ranks holding other sequences draw apart.
  a.quant_key = quant_key(r.in.quant_seed, rank_, r.step, r.compute_micro, t.unit);
  const layers::LayerKind& kind = layers::layer(u.kind);
  const bool backward_ws = t.op == Op::backward || t.op == Op::head;
  const int ws = backward_ws ? io.backward_ws : io.forward_ws;
  const KernelScratch scratch(backend_, ws >= 0 ? r.data(ws) : nullptr, backward_ws ? backward_kernels : forward_kernels);
  switch (t.op) {
    case Op::forward: kind.forward(a); break;
    case Op::recompute: kind.recompute(a, a.recompute); break;
    case Op::backward: kind.backward(a); break;
    case Op::head: r.result.loss_sum += kind.head(a, layers::HeadMode::train); break;
    case Op::loss: r.result.loss_sum += kind.head(a, layers::HeadMode::loss); break;
    case Op::logits: kind.head(a, layers::HeadMode::logits); break;
    default: throw std::logic_error("executor: " + t.name() + " is not a unit task");
  }
}

void Executor::forward(const Task& t, Run& r) { unit_task(t, r); }
void Executor::recompute(const Task& t, Run& r) { unit_task(t, r); }
void Executor::head(const Task& t, Run& r) {
  unit_task(t, r);
  if (r.step >= 0 && r.step == fault_nan_loss_step_) r.result.loss_sum = std::nan("");
}
void Executor::loss(const Task& t, Run& r) { unit_task(t, r); }
void Executor::logits(const Task& t, Run& r) { unit_task(t, r); }
void Executor::backward(const Task& t, Run& r) { unit_task(t, r); }

// Gradients are either whole and identical on every rank (DDP, ZeRO-1) or sharded over the
// shard axis (and identical across replicas): the sum of squares over what this rank holds. Each
// unit's sum is kept apart and the class sums add them in unit order, whether one task covers
// every unit or each unit has its own (offloaded state, the pipelined optimizer, in whatever order
// the units' gradients become final), so the norm is bitwise the same every way.
void Executor::grad_norm(const Task& t, Run& r) {
  const int U = static_cast<int>(desc_.units.size());
  if (r.unit_squares.empty()) r.unit_squares.assign(U, 0.0);
  for (const auto& c : grad_classes_)
    for (int u : c.units)
      if (t.unit < 0 || t.unit == u)
        r.unit_squares[u] = backend_.sum_squares(held(StateIndex::grads, u, &r), plan_.held_elems(StateKind::grads, u));
  r.class_sums.assign(grad_classes_.size(), 0.0);
  r.sum_squares = 0;
  for (size_t k = 0; k < grad_classes_.size(); ++k) {
    for (int u : grad_classes_[k].units) r.class_sums[k] += r.unit_squares[u];
    r.sum_squares += r.class_sums[k];
  }
}

// Records a rank whose loss or squared-gradient sum is NaN or infinite.
void Executor::note_nonfinite(Run& r, int rank, double sum_squares, double loss_sum) {
  if (!std::isfinite(loss_sum)) r.result.nonfinite_loss.push_back(rank);
  if (!std::isfinite(sum_squares)) r.result.nonfinite_grads.push_back(rank);
}

// Once a step, before any update is kept: the global norm, and whether the update happens at all.
void Executor::decide_update(Run& r) {
  if (r.update_decided) return;
  r.update_decided = true;
  r.result.grad_norm = std::sqrt(r.sum_squares);
  // One rank (no norm_reduce in the plan): its own values are the whole step's.
  if (!r.finiteness_known) note_nonfinite(r, comms_.world().rank(), r.sum_squares, r.result.loss_sum);
  // Nothing non-finite reaches the parameters or AdamW's moments.
  r.result.update_skipped = r.result.nonfinite();
}

// Clips by the global norm and updates this rank's range of one unit (t.unit) or of all. A
// speculative task (--pipeline-optimizer, t.io.rollback) runs before the norm is known: it keeps
// the unit's state, then updates as if the norm did not clip; optimizer_commit settles it.
void Executor::optimizer(const Task& t, Run& r) {
  if (t.io.rollback >= 0) {
    keep_state(t.unit, r.f32(t.io.rollback), r);
    return adamw(t.unit, r);
  }
  decide_update(r);
  if (r.result.update_skipped) return;
  if (t.unit >= 0) return unit_optimizer(t.unit, r);
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) unit_optimizer(u, r);
}

// The speculative updates stand when the norm did not clip and the step is not skipped; else each
// unit's kept state comes back, and (not skipped) the update runs again with clipped gradients.
// Either way the state is what the unpipelined optimizer leaves, bit for bit.
void Executor::optimizer_commit(const Task& t, Run& r) {
  decide_update(r);
  const float clip = r.in.grad_clip;
  const bool clipped = clip > 0 && r.result.grad_norm > clip;
  if (!r.result.update_skipped && !clipped) return;
  for (int b : t.frees) {
    const plan::BufferDesc& d = plan_.buffers[b];
    if (d.role != plan::Role::rollback) continue;
    restore_state(d.unit, r.f32(b), r);
    if (!r.result.update_skipped) unit_optimizer(d.unit, r);
  }
}

// A unit's kept state: its parameters' optimizer range, then both moments, each held_elems long.
void Executor::keep_state(int u, float* copy, Run& r) {
  const int64_t n = plan_.held_elems(StateKind::optimizer, u);
  const Shard o = shard_of(StateKind::optimizer, u);
  float* p = held(StateIndex::params, u, &r) + (o.begin - shard_of(StateKind::params, u).begin);
  backend_.copy(copy, p, 4 * o.len);
  backend_.copy(copy + n, held(StateIndex::exp_avg, u, &r), 4 * n);
  backend_.copy(copy + 2 * n, held(StateIndex::exp_avg_sq, u, &r), 4 * n);
}

void Executor::restore_state(int u, const float* copy, Run& r) {
  const int64_t n = plan_.held_elems(StateKind::optimizer, u);
  const Shard o = shard_of(StateKind::optimizer, u);
  float* p = held(StateIndex::params, u, &r) + (o.begin - shard_of(StateKind::params, u).begin);
  backend_.copy(p, copy, 4 * o.len);
  backend_.copy(held(StateIndex::exp_avg, u, &r), copy + n, 4 * n);
  backend_.copy(held(StateIndex::exp_avg_sq, u, &r), copy + 2 * n, 4 * n);
}

// Clipping scales the unit's gradients in place (elementwise, so unit by unit is the same as the
// whole buffer at once), then AdamW runs on each parameter's part of the range.
void Executor::unit_optimizer(int u, Run& r) {
  const float clip = r.in.grad_clip;
  if (clip > 0 && r.result.grad_norm > clip)
    backend_.scale(held(StateIndex::grads, u, &r), plan_.held_elems(StateKind::grads, u), static_cast<float>(clip / r.result.grad_norm));
  adamw(u, r);
}

void Executor::adamw(int u, Run& r) {
  const Shard o = shard_of(StateKind::optimizer, u);
  if (o.parts == 0 || o.len == 0) return;
  const AdamW& opt = r.in.opt;
  const int64_t lo = o.begin, hi = o.begin + o.len;
  float* p = held(StateIndex::params, u, &r) + (lo - shard_of(StateKind::params, u).begin);
  float* g = held(StateIndex::grads, u, &r) + (lo - shard_of(StateKind::grads, u).begin);
  float* m = held(StateIndex::exp_avg, u, &r);
  float* v = held(StateIndex::exp_avg_sq, u, &r);
  for (const auto& spec : desc_.units[u].params) {  // this shard's part of each parameter
    const int64_t a = std::max(lo, spec.offset), b = std::min(hi, spec.offset + spec.numel);
    if (a >= b) continue;
    backend_.adamw_update(p + (a - lo), g + (a - lo), m + (a - lo), v + (a - lo), b - a, opt.lr, opt.beta1,
                          opt.beta2, opt.eps, spec.decay ? opt.weight_decay : 0.0f, r.in.adam_t);
  }
}

// ---- the disk tier's copies: a window is the plan's buffer, the file this rank's.

namespace {
StateIndex window_state(const plan::Plan& plan, const Task& t) {
  for (int s = 0; s < plan::kNumStateBuffers; ++s)
    if (plan.window(s, t.unit) == t.io.window) return StateIndex(s);
  throw std::logic_error("executor: " + t.name() + " names no window of its unit");
}
}  // namespace

// Saved activations (a buffer with a disk_offset) go to their slot of the activations file.
void Executor::reload(const Task& t, Run& r) {
  const plan::BufferDesc& b = r.plan.buffers[t.io.window];
  if (b.disk_offset >= 0) return store_->read(activation_file(r), b.disk_offset, r.data(b.id), b.bytes);
  disk_read(window_state(r.plan, t), t.unit, r.data(t.io.window));
}
void Executor::write_back(const Task& t, Run& r) {
  const plan::BufferDesc& b = r.plan.buffers[t.io.window];
  if (b.disk_offset >= 0) return store_->write(activation_file(r), b.disk_offset, r.data(b.id), b.bytes);
  disk_write(window_state(r.plan, t), t.unit, r.data(t.io.window));
}
int Executor::activation_file(const Run& r) const {
  if (activation_file_ < 0 || r.plan.activation_file_bytes > plan_.activation_file_bytes)
    throw std::logic_error("executor: a plan offloads activations past the activations file this executor made");
  return activation_file_;
}
// Only its allocations and frees (the plan's): the compute stream's point where windows come and go.
void Executor::window_sync(const Task&, Run&) {}

// ---- communication handlers

comm::Scratch Executor::comm_scratch(const Task& t, Run& r) {
  if (t.io.comm_scratch < 0) return {};
  Buffer& b = r.live[t.io.comm_scratch];
  return {b.data(), static_cast<int64_t>(b.bytes())};
}

void Executor::all_gather(const Task& t, Run& r) {
  if (t.first_unit >= 0) return gather_bucket(t, r);
  if (t.io.restore_from >= 0) return gather_rest(t, r);
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  const Shard s = shard_of(StateKind::params, t.unit);
  float* full = r.f32(t.io.params);
  float* mine = held(StateIndex::params, t.unit, &r);
  if (t.io.staging < 0) {
    c.all_gather(mine, full, s.len, DType::fp32, lbl)->wait(timeout_);
  } else {  // bf16: [what the group gathers | one shard] staging, cast, gather, widen.
    uint16_t* whole = r.live[t.io.staging].as<uint16_t>();
    uint16_t* own = whole + s.len * c.size();
    backend_.fp32_to_bf16(own, mine, s.len);
    c.all_gather(own, whole, s.len, DType::bf16, lbl)->wait(timeout_);
    backend_.bf16_to_fp32(full, whole, s.len * c.size());
  }
  if (t.io.keep_into >= 0) keep_part(t, r);
}

// Copies a partly kept unit's kept part (the first kept_elems of each rank's shard) out of its
// gathered buffer, in the wire dtype: the values are the gather's, bf16 ones narrowed exactly.
void Executor::keep_part(const Task& t, Run& r) {
  const Shard s = shard_of(StateKind::params, t.unit);
  const int64_t len = s.len, kept = r.plan.kept_elems[t.unit];
  const float* full = r.f32(t.io.params);
  char* part = r.data(t.io.keep_into);
  const int elem = r.plan.config.param_bytes;
  for (int q = 0; q < comms_.get(t.axes).size(); ++q) to_wire(part + q * kept * elem, full + q * len, kept, elem);
}

// A partly kept unit's backward gather: the rest of each rank's shard (after its kept part),
// gathered in place rank after rank into staging, then each rank's kept part and rest copied
// (widened) into the gathered buffer: the whole gather's values, bit for bit.
void Executor::gather_rest(const Task& t, Run& r) {
  const Shard s = shard_of(StateKind::params, t.unit);
  const int64_t len = s.len, kept = r.plan.kept_elems[t.unit], rest = len - kept;
  const int elem = r.plan.config.param_bytes;
  comm::Communicator& c = comms_.get(t.axes);
  char* whole = r.data(t.io.staging);
  char* own = whole + c.rank() * rest * elem;
  to_wire(own, held(StateIndex::params, t.unit, &r) + kept, rest, elem);
  c.all_gather(own, whole, rest, float_dtype(elem), label(t, r.step))->wait(timeout_);
  float* full = r.f32(t.io.params);
  const char* part = r.data(t.io.restore_from);
  for (int q = 0; q < c.size(); ++q) {
    from_wire(full + q * len, part + q * kept * elem, kept, elem);
    from_wire(full + q * len + kept, whole + q * rest * elem, rest, elem);
  }
}

// A floating array into a collective's wire dtype (`elem` bytes: bf16 narrowed, fp32 copied),
// and back.
void Executor::to_wire(void* dst, const float* src, int64_t n, int elem) const {
  if (elem == 2) backend_.fp32_to_bf16(static_cast<uint16_t*>(dst), src, n);
  else backend_.copy(dst, src, 4 * n);
}

void Executor::from_wire(float* dst, const void* src, int64_t n, int elem) const {
  if (elem == 2) backend_.bf16_to_fp32(dst, static_cast<const uint16_t*>(src), n);
  else backend_.copy(dst, src, 4 * n);
}

// A bucket of units, one collective: this rank's shards of the units, back to back (cast to
// bf16 as each unit's own gather would) in its own slot of the staging buffer, gathered in
// place rank after rank, then
// each rank's part of each unit copied (widened) into the unit's gathered buffer. The values are
// those of one gather per unit, bit for bit.
void Executor::gather_bucket(const Task& t, Run& r) {
  const int step = t.last_unit >= t.first_unit ? 1 : -1;
  std::vector<int> units;
  int64_t shards = 0;
  for (int u = t.first_unit;; u += step) {
    units.push_back(u);
    shards += shard_of(StateKind::params, u).len;
    if (u == t.last_unit) break;
  }
  // A bucket's units are placed alike: one group, one slot per rank.
  comm::Communicator& c = comms_.get(t.axes);
  const int elem = r.plan.config.param_bytes;
  char* whole = r.data(t.io.staging);
  char* own = whole + c.rank() * shards * elem;  // in place: this rank's slot of the gathered
  int64_t at = 0;
  for (int u : units) {
    const Shard s = shard_of(StateKind::params, u);
    to_wire(own + at * elem, held(StateIndex::params, u, &r), s.len, elem);
    at += s.len;
  }
  c.all_gather(own, whole, shards, float_dtype(elem), label(t, r.step))->wait(timeout_);
  for (int q = 0; q < c.size(); ++q) {
    at = q * shards;
    for (size_t i = 0; i < units.size(); ++i) {
      const int64_t len = shard_of(StateKind::params, units[i]).len;
      from_wire(r.f32(t.io.bucket[i]) + q * len, whole + at * elem, len, elem);
      at += len;
    }
  }
}

// In place on this rank's parameters of the unit: the group's optimizer ranges tile them.
void Executor::param_gather(const Task& t, Run& r) {
  const Shard s = shard_of(StateKind::optimizer, t.unit);
  float* whole = held(StateIndex::params, t.unit, &r);
  comms_.get(t.axes).all_gather(whole + (s.begin - shard_of(StateKind::params, t.unit).begin), whole, s.len,
                                DType::fp32, label(t, r.step))->wait(timeout_);
}

void Executor::reduce_scatter(const Task& t, Run& r) {
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  const Shard s = shard_of(StateKind::grads, t.unit);
  float* full = r.f32(t.io.grads);
  float* mine = held(StateIndex::grads, t.unit, &r);
  // Reduced each micro-step, the shard adds to the sum of the earlier ones (zero at the start):
  // in fp32 the held sum joins this rank's part of the scatter, in bf16 (which would round it) the
  // fp32 result is added after, in the full gradients' bytes (dead once cast to the wire).
  const bool accumulate = r.plan.config.reduce_each_micro_step;
  const comm::Scratch scratch = comm_scratch(t, r);
  if (t.io.staging < 0) {
    float* own_part = full + c.rank() * s.len;
    if (accumulate) backend_.residual_forward(own_part, own_part, mine, s.len);
    c.reduce_scatter(full, mine, s.len, DType::fp32, lbl, scratch)->wait(timeout_);
    return;
  }
  uint16_t* whole = r.live[t.io.staging].as<uint16_t>();
  uint16_t* own = whole + s.len * c.size();
  backend_.fp32_to_bf16(whole, full, s.len * c.size());
  c.reduce_scatter(whole, own, s.len, DType::bf16, lbl, scratch)->wait(timeout_);
  if (!accumulate) return backend_.bf16_to_fp32(mine, own, s.len);
  backend_.bf16_to_fp32(full, own, s.len);
  backend_.residual_forward(mine, mine, full, s.len);
}

void Executor::all_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  float* buf;
  int64_t n;
  if (t.first_unit >= 0) {  // a bucket: consecutive units in memory, one contiguous range; or one unit's window
    const int64_t begin = plan_.held_offset(StateKind::grads, t.first_unit);
    buf = held(StateIndex::grads, t.first_unit, &r);
    n = plan_.held_offset(StateKind::grads, t.last_unit) + plan_.held_elems(StateKind::grads, t.last_unit) - begin;
  } else {  // hybrid: this rank's gradient shard across the replicas
    const Shard s = shard_of(StateKind::grads, t.unit);
    buf = held(StateIndex::grads, t.unit, &r);
    n = s.len;
  }
  const comm::Scratch scratch = comm_scratch(t, r);
  if (t.io.staging < 0) return c.all_reduce(buf, n, DType::fp32, lbl, scratch)->wait(timeout_);
  uint16_t* tmp = r.live[t.io.staging].as<uint16_t>();
  backend_.fp32_to_bf16(tmp, buf, n);
  c.all_reduce(tmp, n, DType::bf16, lbl, scratch)->wait(timeout_);
  backend_.bf16_to_fp32(buf, tmp, n);
}

// Every rank's (squared-gradient sum, loss sum) reaches every rank of the plan's communicator (the
// world): the norm adds, in rank order, the sums of the ranks holding this replica's gradient
// shards (only this rank's own when gradients are whole), and every rank learns, identically and
// before any optimizer task runs, which ranks' loss or gradients went non-finite.
void Executor::norm_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.host(t.axes);  // host sums
  const int K = static_cast<int>(grad_classes_.size()), n = K + 1;
  std::vector<double> mine(r.class_sums);
  mine.push_back(r.result.loss_sum);
  std::vector<double> all(n * c.size());
  c.all_gather(mine.data(), all.data(), 2 * n, DType::fp32, "grad_norm step " + std::to_string(r.step))->wait(timeout_);
  // Member i of the group (row-major over its axes) is the world rank with my coordinates
  // elsewhere; a class's sum adds the members that differ from me only on the class's axes.
  const plan::Mesh& mesh = plan_.mesh;
  const std::vector<int> me = mesh.coords(rank_);
  std::vector<std::vector<int>> member(c.size(), me);
  for (int i = 0; i < c.size(); ++i)
    for (int a = static_cast<int>(t.axes.size()) - 1, rest = i; a >= 0; --a) {
      member[i][t.axes[a]] = rest % mesh[t.axes[a]].size;
      rest /= mesh[t.axes[a]].size;
    }
  auto same_outside = [&](const std::vector<int>& coords, const std::vector<int>& axes) {
    for (int a : t.axes)
      if (std::find(axes.begin(), axes.end(), a) == axes.end() && coords[a] != me[a]) return false;
    return true;
  };
  r.sum_squares = 0;
  for (int k = 0; k < K; ++k) {
    double sum = 0;
    for (int i = 0; i < c.size(); ++i)
      if (same_outside(member[i], grad_classes_[k].axes)) sum += all[n * i + k];
    r.sum_squares += sum;
  }
  for (int i = 0; i < c.size(); ++i) {
    double squares = 0;
    for (int k = 0; k < K; ++k) squares += all[n * i + k];
    note_nonfinite(r, mesh.rank_of(member[i]), squares, all[n * i + K]);
  }
  r.finiteness_known = true;
}

void Executor::loss_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.host(t.axes);  // host sums
  const std::string lbl = "loss step " + std::to_string(r.step);
  if (desc_.config.family != model::Family::moe) {
    r.result.loss_sum = sum_over(c, r.result.loss_sum, lbl);
    return;
  }
  // With the loss, every rank's routing figures (summed in rank order, so the loss is as above).
  layers::MoeStats& m = r.result.moe;
  constexpr int kFields = 9;
  const double mine[kFields] = {r.result.loss_sum, m.aux_loss, m.z_loss, static_cast<double>(m.routed),
                                static_cast<double>(m.dropped), static_cast<double>(m.min_load),
                                static_cast<double>(m.max_load), m.imbalance_sum, static_cast<double>(m.routings)};
  std::vector<double> all(kFields * c.size());
  c.all_gather(mine, all.data(), 2 * kFields, DType::fp32, lbl)->wait(timeout_);
  double loss = 0;
  layers::MoeStats sum;
  for (int i = 0; i < c.size(); ++i) {
    const double* v = all.data() + kFields * i;
    loss += v[0];
    sum.add({v[1], v[2], static_cast<int64_t>(v[3]), static_cast<int64_t>(v[4]), static_cast<int64_t>(v[5]),
             static_cast<int64_t>(v[6]), v[7], static_cast<int64_t>(v[8])});
  }
  r.result.loss_sum = loss;
  m = sum;
}

// A staged unit's routed rows to the ranks of the task's axes. The send buffer's header says how
// many bytes go to each rank; one all_to_all of the headers tells every rank what comes from each,
// then the payloads move, packed rank after rank behind the receive buffer's header, which records
// what came from each. What left this rank for the others is the task's figure in the trace.
void Executor::exchange(const Task& t, Run& r) {
  comm::Communicator& c = comms_.exchange(t.axes);
  const int P = c.size();
  const std::string lbl = label(t, r.step);
  if (t.ring_step != 0) return ring_step(t, r, c, lbl);
  const char* send = r.data(t.io.send);
  char* recv = r.data(t.io.recv);
  std::vector<int64_t> out(P), in(P);
  backend_.download(out.data(), send, sizeof(int64_t) * P);
  comms_.exchange_host(t.axes).all_to_all(out.data(), in.data(), sizeof(int64_t), DType::int8, lbl + " (sizes)")
      ->wait(timeout_);
  const int64_t header = model::exchange_header_bytes(P);
  std::vector<int64_t> out_at(P), in_at(P);
  int64_t sent = header, received = header, moved = 0;
  for (int j = 0; j < P; ++j) {
    out_at[j] = sent, in_at[j] = received;
    sent += out[j], received += in[j];
    if (j != c.rank()) moved += out[j];
  }
  if (sent > r.plan.buffers[t.io.send].bytes || received > r.plan.buffers[t.io.recv].bytes)
    throw std::logic_error("executor: " + lbl + " moves more than its buffers' planned bound");
  backend_.upload(recv, in.data(), sizeof(int64_t) * P);
  c.all_to_all_v(send, out, out_at, recv, in, in_at, DType::int8, lbl)->wait(timeout_);
  r.moved[t.id] = moved;
}

// A ring step: the whole send buffer to the rank `ring_step` further round the task's axes, the
// same size from the rank as far back. The tag keeps a pass's steps apart.
void Executor::ring_step(const Task& t, Run& r, comm::Communicator& c, const std::string& lbl) {
  const int P = c.size(), me = c.rank();
  const int64_t bytes = r.plan.buffers[t.io.send].bytes;
  if (r.plan.buffers[t.io.recv].bytes != bytes) throw std::logic_error("executor: " + lbl + " has unequal ring buffers");
  const int tag = 2 * t.stage + (t.reverse ? 1 : 0);
  auto got = c.recv(r.data(t.io.recv), bytes, DType::int8, (me - t.ring_step + P) % P, tag, lbl + " (recv)");
  auto sent = c.send(r.data(t.io.send), bytes, DType::int8, (me + t.ring_step + P) % P, tag, lbl + " (send)");
  got->wait(timeout_);
  sent->wait(timeout_);
  r.moved[t.id] = bytes;
}

// ---- the stream runner

// A plan this executor's state serves: the same parameters, placed alike, and of the gradients and
// moments either none or the same placement.
bool Executor::holds_state_of(const plan::Plan& plan) const {
  if (plan.layout.total != plan_.layout.total || plan.placement().size() != plan_.placement().size()) return false;
  for (size_t u = 0; u < plan.placement().size(); ++u)
    for (int k = 0; k < plan::kNumStateKinds; ++k) {
      const plan::Placement &a = plan.placement()[u].of(StateKind(k)), &b = plan_.placement()[u].of(StateKind(k));
      const bool may_drop = StateKind(k) != StateKind::params && a.parts == 0;
      if (!may_drop && (a.parts != b.parts || a.axes != b.axes)) return false;
    }
  return true;
}

StepResult Executor::run(const plan::Plan& plan, int64_t step, const StepInputs& in) {
  if (!holds_state_of(plan))
    throw std::logic_error("executor: a plan whose state layout differs from the executor's");
  Run r{plan, step, in, {}, {}, {}, 0, {}, false, {}, 0, false, {}, {}};
  r.live.resize(plan.buffers.size());
  r.moved.assign(plan.tasks.size(), -1);
  if (backend_.host_memory()) {
    r.layout = plan::lay_out_arena(plan);
    arena_.reserve(r.layout.bytes);
  }
  if (step >= 0 && step == fault_kill_step_) std::raise(SIGKILL);
  running_step_ = step;
  const size_t n = plan.tasks.size();
  std::vector<int64_t> done(n, 0);  // runs finished, per task
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr failure;
  bool stop = false;
  // The copy stream's tasks run on the backend's copy lane: what reads their result waits for
  // their mark, recorded as each ends (the latest run's, which covers the earlier ones).
  using Lane = kernels::Backend::Lane;
  const int copy_stream = static_cast<int>(std::find(plan.streams.begin(), plan.streams.end(), "copy") - plan.streams.begin());
  std::vector<kernels::Backend::Mark> marks(n);
  auto wait_for_copies = [&](const Task& task, int64_t run) {
    for (int dep : task.deps) {
      const plan::Plan::Wait w = plan.wait_for(task, run, dep);
      if (plan.tasks[w.task].stream != copy_stream) continue;
      kernels::Backend::Mark m;
      {
        std::lock_guard<std::mutex> lock(mu);
        m = marks[w.task];
      }
      backend_.wait(Lane::compute, m);
    }
  };

  // Waits for a task's dependencies; returns ms spent waiting on the other streams' tasks.
  auto wait_deps = [&](const Task& task, int64_t run) {
    auto t0 = Clock::now();
    std::unique_lock<std::mutex> lock(mu);
    for (int dep : task.deps) {
      const plan::Plan::Wait w = plan.wait_for(task, run, dep);
      cv.wait(lock, [&] { return done[w.task] >= w.runs || stop; });
      if (stop) return -1.0;
    }
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto finish = [&](const Task& task, int64_t micro, double start_us) {
    const double end = now_us();
    {
      std::lock_guard<std::mutex> lock(trace_mu_);
      trace_.slices.push_back({task.name(&desc_, micro), task.stream, step, start_us, end - start_us, r.moved[task.id]});
    }
    std::lock_guard<std::mutex> lock(mu);
    ++done[task.id];
    cv.notify_all();
  };
  auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failure) failure = e;
    stop = true;
    cv.notify_all();
  };
  auto run_stream = [&](int stream) {
    for (plan::StreamWalk walk(plan, stream); !walk.done(); walk.next()) {
      const Task& task = plan.tasks[walk.task()];
      const double waited = wait_deps(task, walk.run());
      if (waited < 0) return;
      if (stream == plan::kCompute) r.result.comm_exposed_ms += waited;
      else if (step >= 0 && step == fault_skip_step_) {  // a rank gone astray: never issues this collective
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      const int64_t micro = plan.step_micro(task, walk.run());
      if (stream == plan::kCompute) r.compute_micro = micro;
      if (stream != copy_stream) wait_for_copies(task, walk.run());
      const double start = now_us();
      allocate(task, micro, task.allocs, r);
      (this->*kHandlers[static_cast<int>(task.op)])(task, r);
      release(task, r);
      allocate(task, micro, task.hands_off, r);
      if (stream == copy_stream) {
        kernels::Backend::Mark m = backend_.mark(Lane::copy);
        std::lock_guard<std::mutex> lock(mu);
        marks[task.id] = std::move(m);
      }
      finish(task, micro, start);
    }
  };

  std::vector<std::thread> others;
  for (int s = 1; s < static_cast<int>(plan.streams.size()); ++s)
    others.emplace_back([&, s] {
      try {
        // These threads only cast for bf16 collectives: one OpenMP thread, so they never compete
        // with the compute stream's pool; denormals flushed as on every compute thread.
        backend_.init_compute(1);
        run_stream(s);
      } catch (...) {
        fail(std::current_exception());
      }
    });
  try {
    run_stream(plan::kCompute);
  } catch (...) {
    fail(std::current_exception());
  }
  for (auto& t : others) t.join();
  if (failure) std::rethrow_exception(failure);
  return r.result;
}

void Executor::gather_full(State which, float* full) {
  const StateKind k = kind_of(which);
  Buffer from_disk;  // offloaded state is read back first, through the disk tier
  if (on_disk(StateIndex(static_cast<int>(which)))) {
    from_disk = backend_.alloc(MemCategory::staging, 4 * plan_.held_total(k), Buffer::Fill::none);
    disk_read_all(StateIndex(static_cast<int>(which)), from_disk.f32());
  }
  const Buffer& buf = from_disk.data() ? from_disk : state(which);
  if (plan_.held_total(k) == 0) throw std::logic_error("executor: this plan holds no " + std::string(which == State::grads ? "gradients" : "optimizer state"));
  if (plan_.held_whole(k)) {
    backend_.download(full, buf.data(), buf.bytes());
    return;
  }
  if (!backend_.host_memory()) return gather_full_from_device(k, buf, full);
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(k, u);
    if (s.parts == 1) {
      std::copy_n(buf.f32() + s.at, s.len, full + s.unit_offset);
      continue;
    }
    comms_.get(plan_.placed(k, u).axes)
        .all_gather(buf.f32() + s.at, full + s.unit_offset, s.len, DType::fp32, "gather state unit " + desc_.units[u].name)
        ->wait(timeout_);
  }
}

// Device memory: each rank's part comes to its own place in `full` on the host, then the
// group's parts are gathered there in place (the group's members are the parts in order).
void Executor::gather_full_from_device(StateKind k, const Buffer& buf, float* full) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(k, u);
    float* mine = full + s.unit_offset + s.begin;
    backend_.download(mine, buf.f32() + s.at, sizeof(float) * s.len);
    if (s.parts == 1) continue;
    comm::Communicator& c = comms_.host(plan_.placed(k, u).axes);
    if (s.begin != c.rank() * s.len) throw std::logic_error("executor: unit " + desc_.units[u].name + "'s parts are not in group order");
    c.all_gather(mine, full + s.unit_offset, s.len, DType::fp32, "gather state unit " + desc_.units[u].name)->wait(timeout_);
  }
}

void Executor::load_full(State which, const float* full) {
  Buffer& buf = const_cast<Buffer&>(state(which));
  const StateKind k = kind_of(which);
  if (plan_.held_total(k) == 0) return;
  if (on_disk(StateIndex(static_cast<int>(which)))) {  // this rank's ranges, packed, then to the file
    Buffer packed = backend_.alloc(MemCategory::staging, 4 * plan_.held_total(k), Buffer::Fill::none);
    for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
      const Shard s = shard_of(k, u);
      backend_.upload(packed.f32() + s.at, full + s.unit_offset + s.begin, sizeof(float) * s.len);
    }
    return disk_write_all(StateIndex(static_cast<int>(which)), packed.f32());
  }
  if (plan_.held_whole(k)) {
    if (buf.f32() != full) backend_.upload(buf.data(), full, buf.bytes());
    return;
  }
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(k, u);
    backend_.upload(buf.f32() + s.at, full + s.unit_offset + s.begin, sizeof(float) * s.len);
  }
}

}  // namespace shardlm::run
