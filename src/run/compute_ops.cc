// Compute handlers: gradient zeroing and the unit tasks (forward, recompute, backward, the head's
// three modes), each resolving its operands from the plan's buffers and running its layer.
#include "run/executor.h"

#include <cmath>
#include <stdexcept>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::Op;
using plan::State;
using plan::Task;

void Executor::zero_grads(const Task&, Run&) {
  const Buffer& grads = store_->buffer(State::grads);
  if (grads.data()) backend_.zero(grads.data(), grads.bytes());
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

// A workspace buffer starts with what the plan gave the kernels for their own scratch
// (512-byte pieces: the layers' part after it keeps the buffer's alignment).
int64_t kernel_part(const plan::Plan& plan, int ws) { return ws >= 0 ? plan.buffers[ws].kernel_scratch : int64_t{0}; }

}  // namespace

// A unit task's operands, resolved from the run's buffers and the state store.
layers::UnitArgs Executor::unit_args(const Task& t, Run& r) {
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
  const bool grads = !on_disk(State::grads) || t.op == Op::backward || t.op == Op::head;
  if (grads && (r.plan.placed(State::grads, t.unit).parts > 0 || io.grads >= 0)) a.grads = unit_grads(io.grads, t.unit, r);
  if (u.borrows >= 0) {
    a.borrowed_params = unit_params(io.borrowed_params, u.borrows, r);
    if (grads && (r.plan.placed(State::grads, u.borrows).parts > 0 || io.borrowed_grads >= 0))
      a.borrowed_grads = unit_grads(io.borrowed_grads, u.borrows, r);
  }
  for (size_t i = 0; i < io.inputs.size(); ++i) {
    const int v = u.reads[i];
    if (desc_.values[v].tokens) {
      a.batch = r.data(io.inputs[i]);
      a.tokens = reinterpret_cast<const int32_t*>(a.batch);
      a.targets = a.tokens + r.plan.buffers[io.inputs[i]].bytes / 8;
    } else {
      a.in = r.f32(io.inputs[i]);
    }
  }
  if (io.output >= 0) a.out = r.f32(io.output);
  if (io.saved >= 0) a.saved = r.data(io.saved);
  if (io.recomputable >= 0) a.recomputable = r.data(io.recomputable);
  if (io.forward_ws >= 0) a.forward_ws = r.data(io.forward_ws) + kernel_part(r.plan, io.forward_ws);
  if (io.backward_ws >= 0) a.backward_ws = r.data(io.backward_ws) + kernel_part(r.plan, io.backward_ws);
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
  return a;
}

// Runs a unit task's layer, its kernels' scratch lent to the backend meanwhile.
void Executor::unit_task(const Task& t, Run& r) {
  const layers::UnitArgs a = unit_args(t, r);
  const layers::LayerKind& kind = layers::layer(desc_.units[t.unit].kind);
  const int ws = t.op == Op::backward || t.op == Op::head ? t.io.backward_ws : t.io.forward_ws;
  const KernelScratch scratch(backend_, ws >= 0 ? r.data(ws) : nullptr, kernel_part(r.plan, ws));
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

}  // namespace shardlm::run
