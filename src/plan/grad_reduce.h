// The gradient reduction pass, one of the passes the builder's walk runs (DESIGN: "A schedule,
// then passes"): as each unit's gradients become final in a backward, it reduces them over the
// ranks that summed different batches. Where a unit's gradients are placed split over the ranks
// that shard it (ZeRO-2, FSDP, hybrid), each unit gets full gradients of its own, a reduce_scatter
// into this rank's part and, over the ranks holding the same part (hybrid's replicas), an
// all_reduce; where every rank holds them whole (DDP, ZeRO-1), consecutive units join buckets of
// --bucket-mb, one all_reduce each. Which is read from the placement, not the strategy's name.
#pragma once

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "plan/draft.h"

namespace shardlm::plan {

class GradReduction {
 public:
  // `last_micro`: the plan's last micro-step, the one whose gradients are reduced (every one's
  // with --reduce-each-micro-step).
  GradReduction(PlanDraft& draft, int last_micro) : d_(draft), last_micro_(last_micro) {}

  // Whether unit u's gradients are written into full gradients of their own (reduce-scattered),
  // not into the unit's range of the flat gradient buffer.
  bool scatters(int u) const { return d_.split_beyond_slice(State::grads, u); }
  // A scattered unit's full gradients: one buffer for the step, or one per micro-step where each
  // reduces.
  int full_grads(int u, int m);
  // Compute task t of micro-step m writes unit u's full gradients: the first writer of the step
  // (or of the micro-step, where each reduces) allocates them and waits for the previous
  // micro-step's reduce-scatter of u, which frees its buffer (in a repeated micro-step, the same
  // buffer of the run before).
  void written(int t, int u, int m);
  bool reduces_at(int m) const;
  // Unit u's gradients of micro-step m are final at the end of compute task `producer`.
  void reduce(int u, int producer, int m);
  // Compute task t (a backward; `all`: the gradient norm) frees the full gradients of
  // reduce-scatters issued two backwards before it (or all of them), waiting for them: gradient
  // memory then moves only with the compute stream, and at most three units' full gradients are
  // alive at once.
  void settle(int t, bool all);
  // The end of micro-step m's backward.
  void end_micro_step(int m);
  // Every gradient collective of the last micro-step, which the norm waits for.
  const std::vector<int>& collectives() const { return reductions_; }

 private:
  void close_bucket(int producer);

  PlanDraft& d_;
  const int last_micro_;
  std::vector<int> reductions_;
  std::set<std::pair<int, int>> allocated_;  // (micro-step, unit) of full gradients allocated
  std::map<int, int> reduce_scatter_of_;     // by unit: its latest reduce-scatter
  // Full gradients whose reduce-scatter is issued: freed by the `countdown`-th backward after it.
  struct PendingFree {
    int reduce_scatter, buffer, countdown;
  };
  std::vector<PendingFree> pending_;
  // The all_reduce bucket being filled: units [first, last] (filled last to first), their bytes.
  int bucket_first_ = -1, bucket_last_ = -1;
  int64_t bucket_bytes_ = 0;
};

}  // namespace shardlm::plan
