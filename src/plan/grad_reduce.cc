// The gradient reduction pass (grad_reduce.h).
#include "plan/grad_reduce.h"

#include <algorithm>

namespace shardlm::plan {

namespace {

// The axes of `all` not in `some`, ascending.
std::vector<int> minus(const std::vector<int>& all, const std::vector<int>& some) {
  std::vector<int> out;
  for (int a : all)
    if (std::find(some.begin(), some.end(), a) == some.end()) out.push_back(a);
  return out;
}

}  // namespace

int GradReduction::full_grads(int u, int m) {
  const bool each = d_.config().reduce_each_micro_step;
  return d_.buffer("grads " + d_.uname(u) + (each ? PlanDraft::tag(m) : ""), Role::full_grads, MemCategory::grads,
                   d_.unit_bytes(u, 4), u);
}

void GradReduction::written(int t, int u, int m) {
  if (m > 0 && !d_.config().reduce_each_micro_step) return;
  if (!allocated_.insert({m, u}).second) return;
  d_.alloc(t, full_grads(u, m));
  if (const auto before = reduce_scatter_of_.find(u); before != reduce_scatter_of_.end())
    d_.at(t).deps.push_back(before->second);
}

bool GradReduction::reduces_at(int m) const { return m == last_micro_ || d_.config().reduce_each_micro_step; }

void GradReduction::settle(int t, bool all) {
  std::vector<PendingFree> keep;
  for (PendingFree p : pending_) {
    if (all || --p.countdown == 0) {
      d_.at(t).deps.push_back(p.reduce_scatter);
      d_.free(t, p.buffer);
    } else {
      keep.push_back(p);
    }
  }
  pending_ = keep;
}

// Where each micro-step reduces, the reduce-scatters still pending at its end free their own full
// gradients: a buffer of micro-step m is then alive within m alone, as a repeated one must be.
void GradReduction::end_micro_step(int m) {
  if (!d_.config().reduce_each_micro_step || m >= last_micro_) return;
  for (const PendingFree& p : pending_) d_.free(p.reduce_scatter, p.buffer);
  pending_.clear();
}

void GradReduction::reduce(int u, int producer, int m) {
  const PlanConfig& cfg = d_.config();
  const Plan& plan = d_.plan();
  if (cfg.stage_world() == 1) return;
  if (scatters(u)) {
    const std::vector<int>& placed = plan.placed(State::grads, u).axes;
    const int64_t shard = d_.shard_elems(u);
    const int rs = d_.add(Op::reduce_scatter, u, m, {producer});
    d_.at(rs).axes = d_.within_slice(placed, u);
    d_.at(rs).bytes = d_.unit_bytes(u, cfg.reduce_bytes);
    d_.at(rs).io.grads = full_grads(u, m);
    reduce_scatter_of_[u] = rs;
    pending_.push_back({rs, full_grads(u, m), 2});
    d_.stage(rs, d_.compute_elems(u), shard, cfg.reduce_bytes);
    d_.reduction_scratch(rs, shard);
    // Each micro-step's scatter adds the held shard in (reads two shards and writes one: about one
    // and a half copies).
    if (cfg.reduce_each_micro_step) d_.at(rs).copy_bytes += shard * 4 * 3 / 2;
    // The norm waits for the last micro-step's reductions; the earlier ones precede them on the
    // comm stream.
    if (m != last_micro_) return;
    reductions_.push_back(rs);
    // The summed shard across the ranks holding the same one (hybrid's replicas), once a step.
    const std::vector<int> replicas = minus(plan.grad_axes(), placed);
    if (plan.mesh.group_size(replicas) == 1) return;
    const int ar = d_.add(Op::all_reduce, u, last_micro_, {rs});
    d_.at(ar).axes = replicas;
    d_.at(ar).bytes = shard * cfg.reduce_bytes;
    d_.stage(ar, shard, 0, cfg.reduce_bytes);
    d_.reduction_scratch(ar, shard);
    reductions_.push_back(ar);
    return;
  }
  // Whole gradients: units join a bucket in the order their gradients become final; a bucket of
  // consecutive units is one contiguous range of the flat gradient buffer, reduced over one group:
  // a sliced unit is a bucket of its own, and so is a unit whose gradients live on disk (--offload:
  // they are in its window, not in the flat buffer).
  const bool alone = d_.slices(u) > 1 || cfg.offload.on_disk(State::grads, u);
  if (alone && bucket_last_ >= 0) close_bucket(producer);
  bucket_first_ = u;
  if (bucket_last_ < 0) bucket_last_ = u;
  bucket_bytes_ += d_.unit_bytes(u, cfg.reduce_bytes);
  if (bucket_bytes_ >= cfg.bucket_mb * 1048576.0 || u == 0 || alone) close_bucket(producer);
}

void GradReduction::close_bucket(int producer) {
  const int elem = d_.config().reduce_bytes;
  const std::vector<int> axes = d_.within_slice(d_.plan().grad_axes(), bucket_first_);
  if (d_.plan().mesh.group_size(axes) > 1) {  // else one rank holds these gradients: nothing to reduce
    const int ar = d_.add(Op::all_reduce, -1, last_micro_, {producer});
    d_.at(ar).axes = axes;
    d_.at(ar).first_unit = bucket_first_;
    d_.at(ar).last_unit = bucket_last_;
    d_.at(ar).bytes = bucket_bytes_;
    d_.stage(ar, bucket_bytes_ / elem, 0, elem);
    d_.reduction_scratch(ar, bucket_bytes_ / elem);
    reductions_.push_back(ar);
  }
  bucket_first_ = bucket_last_ = -1;
  bucket_bytes_ = 0;
}

}  // namespace shardlm::plan
