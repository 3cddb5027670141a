// Optimizer handlers: this rank's gradient norm, clipping and AdamW on its range, and the
// pipelined optimizer's speculative updates and their commit.
#include "run/executor.h"

#include <algorithm>
#include <cmath>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::State;
using plan::Task;

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
        r.unit_squares[u] = backend_.sum_squares(held(State::grads, u, &r), plan_.held_elems(State::grads, u));
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
  const int64_t n = plan_.held_elems(State::optimizer, u);
  const Shard o = shard_of(State::optimizer, u);
  float* p = held(State::params, u, &r) + (o.begin - shard_of(State::params, u).begin);
  backend_.copy(copy, p, 4 * o.len);
  backend_.copy(copy + n, held(State::exp_avg, u, &r), 4 * n);
  backend_.copy(copy + 2 * n, held(State::exp_avg_sq, u, &r), 4 * n);
}

void Executor::restore_state(int u, const float* copy, Run& r) {
  const int64_t n = plan_.held_elems(State::optimizer, u);
  const Shard o = shard_of(State::optimizer, u);
  float* p = held(State::params, u, &r) + (o.begin - shard_of(State::params, u).begin);
  backend_.copy(p, copy, 4 * o.len);
  backend_.copy(held(State::exp_avg, u, &r), copy + n, 4 * n);
  backend_.copy(held(State::exp_avg_sq, u, &r), copy + 2 * n, 4 * n);
}

// Clipping scales the unit's gradients in place (elementwise, so unit by unit is the same as the
// whole buffer at once), then AdamW runs on each parameter's part of the range.
void Executor::unit_optimizer(int u, Run& r) {
  const float clip = r.in.grad_clip;
  if (clip > 0 && r.result.grad_norm > clip)
    backend_.scale(held(State::grads, u, &r), plan_.held_elems(State::grads, u), static_cast<float>(clip / r.result.grad_norm));
  adamw(u, r);
}

void Executor::adamw(int u, Run& r) {
  const Shard o = shard_of(State::optimizer, u);
  if (o.parts == 0 || o.len == 0) return;
  const AdamW& opt = r.in.opt;
  const int64_t lo = o.begin, hi = o.begin + o.len;
  float* p = held(State::params, u, &r) + (lo - shard_of(State::params, u).begin);
  float* g = held(State::grads, u, &r) + (lo - shard_of(State::grads, u).begin);
  float* m = held(State::exp_avg, u, &r);
  float* v = held(State::exp_avg_sq, u, &r);
  for (const auto& spec : desc_.units[u].params) {  // this shard's part of each parameter
    const int64_t a = std::max(lo, spec.offset), b = std::min(hi, spec.offset + spec.numel);
    if (a >= b) continue;
    backend_.adamw_update(p + (a - lo), g + (a - lo), m + (a - lo), v + (a - lo), b - a, opt.lr, opt.beta1,
                          opt.beta2, opt.eps, spec.decay ? opt.weight_decay : 0.0f, r.in.adam_t);
  }
}

}  // namespace shardlm::run
