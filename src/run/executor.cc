#include "run/executor.h"

#include <chrono>
#include <csignal>
#include <stdexcept>
#include <thread>

#include "kernels/backend.h"
#include "layers/layers.h"
#include "plan/arena.h"
#include "run/executor_run.h"
#include "run/stream_runner.h"

namespace shardlm::run {

using plan::Op;
using plan::Role;
using plan::State;
using plan::Task;
using Clock = std::chrono::steady_clock;

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
      rank_(comms.world().rank()),
      arena_(backend.memory()),
      fault_skip_step_(faults.skip_collective.step_of(comms.world().rank())),
      fault_kill_step_(faults.kill.step_of(comms.world().rank())),
      fault_nan_loss_step_(faults.nan_loss.step_of(comms.world().rank())),
      fault_disk_read_step_(faults.disk_read.step_of(comms.world().rank())) {
  if (plan.config.activation_bytes != 4)
    throw std::invalid_argument("executor: layers keep fp32 activations; the plan prices " +
                                std::to_string(plan.config.activation_bytes) + "-byte ones (a simulator's plan)");
  if (!backend_.host_memory()) check_device_run(plan);
  store_ = std::make_unique<StateStore>(desc_, plan_, rank_, backend_, with_fault(offload));
  check_carved_fits();
  grad_classes_ = plan_.grad_classes();
  trace_.rank = rank_;
  trace_.streams = plan.streams;
  // Every rank's trace clock starts at the same moment (to within a barrier's latency), so the
  // ranks' slices line up in one timeline.
  comms.world().barrier("trace clock")->wait(timeout_);
  t0_ = Clock::now();
  sample_memory();
}

Executor::~Executor() = default;

// The test fault of the offload files: this rank's first read in that step fails.
OffloadOptions Executor::with_fault(const OffloadOptions& offload) {
  OffloadOptions o = offload;
  if (fault_disk_read_step_ >= 0 && !o.io.read_fault)
    o.io.read_fault = [this](const std::string&, int64_t, int64_t) {
      return running_step_.load() == fault_disk_read_step_ && !disk_read_failed_.exchange(true);
    };
  return o;
}

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

float* Executor::unit_params(int buffer, int u, Run& r) const {
  return buffer >= 0 ? r.f32(buffer) : held(State::params, u, &r);
}

float* Executor::unit_grads(int buffer, int u, Run& r) const {
  return buffer >= 0 ? r.f32(buffer) : held(State::grads, u, &r);
}

float* Executor::held(State s, int u, const Run* r) const {
  if (!on_disk(s, u)) return store_->resident(s, u);
  const int w = r ? r->plan.window(static_cast<int>(s), u) : -1;
  if (w < 0 || r->live[w].data() == nullptr)
    throw std::logic_error("executor: unit " + desc_.units[u].name + "'s " + plan::to_string(s) +
                           " are on disk and not loaded into their window here");
  return r->live[w].f32();
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
      const bool samples = desc_.values[0].sample_bytes > 0;
      if (samples && !r.in.samples) throw std::logic_error("executor: a batch of samples and no StepInputs::samples to fill it");
      const auto fill = [&](char* dst) {
        if (samples) return r.in.samples(micro, dst, b.bytes);
        int32_t* tokens = reinterpret_cast<int32_t*>(dst);
        r.in.batch(micro, tokens, tokens + b.bytes / 8);
      };
      if (backend_.host_memory()) {
        fill(r.live[a].as<char>());
        continue;
      }
      // The batch is sampled on the host; a device backend gets a copy.
      std::vector<char> host(b.bytes);
      fill(host.data());
      backend_.upload(r.live[a].data(), host.data(), b.bytes);
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

// A plan this executor's state serves: the same parameters, placed alike, and of the gradients and
// moments either none or the same placement.
bool Executor::holds_state_of(const plan::Plan& plan) const {
  if (plan.layout.total != plan_.layout.total || plan.placement().size() != plan_.placement().size()) return false;
  for (size_t u = 0; u < plan.placement().size(); ++u)
    for (int k = 0; k < plan::kNumStateKinds; ++k) {
      const plan::Placement &a = plan.placement()[u].of(State(k)), &b = plan_.placement()[u].of(State(k));
      const bool may_drop = State(k) != State::params && a.parts == 0;
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
  run_streams(plan, backend_, [&](const Task& t, int64_t micro, double waited_ms) { run_task(t, micro, waited_ms, r); });
  return r.result;
}

// Its buffers come into being, its handler runs, what it frees goes and what it hands off comes,
// and its slice joins the trace.
void Executor::run_task(const Task& t, int64_t micro, double waited_ms, Run& r) {
  if (t.stream == plan::kCompute) {
    r.result.comm_exposed_ms += waited_ms;
    r.compute_micro = micro;
  } else if (r.step >= 0 && r.step == fault_skip_step_) {  // a rank gone astray: never issues this collective
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  const double start = now_us();
  allocate(t, micro, t.allocs, r);
  (this->*kHandlers[static_cast<int>(t.op)])(t, r);
  release(t, r);
  allocate(t, micro, t.hands_off, r);
  const double end = now_us();
  std::lock_guard<std::mutex> lock(trace_mu_);
  trace_.slices.push_back({t.name(&desc_, micro), t.stream, r.step, start, end - start, r.moved[t.id]});
}

}  // namespace shardlm::run
