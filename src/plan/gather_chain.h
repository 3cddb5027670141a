// The parameter gather pass, one of the passes the builder's walk runs (DESIGN: "A schedule, then
// passes"): where a unit's parameters are placed split over the ranks that shard it (FSDP,
// hybrid), each compute task using them waits for an all_gather into the unit's gathered buffer,
// and frees it. The gathers form one chain in issue order, each issued at most --prefetch-forward
// / --prefetch-backward gathers ahead of its consumer and with at most --max-gathers-in-flight
// gathers' buffers alive; --gather-bucket-mb gathers runs of units together, --keep-gathered keeps
// units (or a part of each shard) gathered between their forward and backward, and a unit another
// borrows (the tied embedding, a MoE block's experts) is gathered once per step. Which units are
// gathered is read from the placement, not the strategy's name.
#pragma once

#include <string>
#include <vector>

#include "plan/draft.h"

namespace shardlm::plan {

class GatherChain {
 public:
  // `backward_reads_params`, per unit: whether its backward reads its parameters (it reads them,
  // or rebuilds activations from them). Marks the borrowed and --keep-gathered units and lays out
  // the kept parts (Plan::kept_elems; only a training plan gathers again for a backward).
  GatherChain(PlanDraft& draft, std::vector<char> backward_reads_params, bool train);
  // The step's first compute task: the first gathers wait for it, and it brings their buffers
  // into being.
  void set_start(int t) { start_ = t; }

  // Whether unit u's compute tasks read its parameters from a gathered buffer.
  bool sharded(int u) const { return d_.split_beyond_slice(State::params, u); }
  // Kept gathered for the whole step (borrowed, or --keep-gathered whole): freed at its last use.
  bool kept(int u) const { return kept_[u]; }
  int gathered(int u);

  // Unit u's forward in micro-step m (borrowing state-only unit `borrowed`, or -1): the gathers
  // its task waits for (`deps`), issued before it; then `forward_added` with its task.
  struct Forward {
    std::vector<int> deps;
    int gather = -1;
    bool held = false;  // the backward's last gathered unit, reused
  };
  Forward before_forward(int u, int borrowed, int m);
  void forward_added(int t, int u, const Forward& f);
  // Unit u's backward in micro-step m: the gather its task waits for (-1: none), issued before
  // it; the buffer of parameters it reads (-1: none); then `backward_added` with its task.
  int before_backward(int u, int m);
  int backward_params(int u) { return sharded(u) && backward_reads_params_[u] ? gathered(u) : -1; }
  void backward_added(int t, int u);
  // A staged pass's last stage frees what its first task consumed.
  void consumed_by_last_stage(int first, int last);

 private:
  int gather(int u, int micro, int prefetch, int direction);
  bool chain_gathered(int u, int direction) const;
  std::vector<int> bucket_from(int u, int direction) const;
  void stage_bucket(int t, const std::vector<int>& units);
  int gather_kept(int u);
  void gather_part(int t, int u, int direction, int deps_last);
  void consume(int compute_task, int u);
  int reuse(int compute_task);
  void keep_units(const std::vector<std::string>& names);
  void keep_parts(bool train);
  bool partly_kept(int u) const { return plan_.kept_elems[u] > 0; }
  int kept_part(int u);

  PlanDraft& d_;
  const model::ModelDesc& desc_;
  const PlanConfig& cfg_;
  Plan& plan_;
  const std::vector<char> backward_reads_params_;
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
  int start_ = -1;
};

}  // namespace shardlm::plan
