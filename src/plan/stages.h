// The stages pass, one of the passes the builder's walk runs (DESIGN: "A schedule, then passes"):
// a unit whose pass is a short list of stages (model::UnitCosts::exchanges: a MoE block's
// all-to-alls over ep, ring attention's steps over cp, all-to-all attention's over cp) has its
// forward or backward task split into one compute task per stage, with an exchange task between
// two stages where the exchange spans more than one rank, and the routed rows each exchange sends
// and receives as buffers. Which axis each exchange runs over comes from the unit's costs and the
// mesh, not from the strategy.
#pragma once

#include <vector>

#include "plan/draft.h"

namespace shardlm::plan {

class UnitStages {
 public:
  // `costs`: each unit's, as the walk sizes its tasks.
  UnitStages(PlanDraft& draft, const std::vector<model::UnitCosts>& costs)
      : d_(draft), plan_(draft.plan()), costs_(costs) {}
  // Splits the staged unit's pass built whole as task `first` (`reverse`: a backward, which runs
  // the stages in reverse) into its stages; returns the last stage's task (`first` for a unit of
  // one stage), which frees what `first` freed.
  int split(int first, bool reverse);

 private:
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

  PlanDraft& d_;
  const Plan& plan_;
  const std::vector<model::UnitCosts>& costs_;
};

}  // namespace shardlm::plan
