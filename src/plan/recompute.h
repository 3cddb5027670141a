// The recompute pass, one of the passes over a built plan (DESIGN: "A schedule, then passes"):
// where a unit's recompute mode (--recompute, --recompute-blocks) drops activations its backward
// needs, a recompute task rebuilds them right before that backward, and takes over the
// backward's wait on the unit's gathered parameters.
#pragma once

#include <vector>

#include "model/model.h"
#include "plan/draft.h"
#include "plan/plan.h"

namespace shardlm::plan {

// `walked`: the walk's tasks in creation order (ids are positions; the comm stream not yet
// ordered), each unit's forward already dropping what its recompute mode rebuilds. Re-lists them
// into `out`, with the recompute tasks added.
void recompute_pass(const std::vector<Task>& walked, TaskList& out, const Plan& plan, const model::ModelDesc& desc);

}  // namespace shardlm::plan
