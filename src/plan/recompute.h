// The recompute pass, one of the passes over a built plan (DESIGN: "A schedule, then passes"):
// where a unit's recompute mode (--recompute, --recompute-blocks) drops activations its backward
// needs, a recompute task rebuilds them right before that backward, and takes over the
// backward's wait on the unit's gathered parameters.
#pragma once

#include <vector>

#include "model/model.h"
#include "plan/plan.h"

namespace shardlm::plan {

// The task list the builder re-lists the walk's tasks into. A pass adds tasks in the middle of
// the walk's order, so it lists every task again, each at the end (ids are list positions).
class TaskList {
 public:
  virtual ~TaskList() = default;
  // Appends `t` with the next id; returns that id.
  virtual int append(Task t) = 0;
  virtual Task& at(int id) = 0;
  // Splits a staged unit's forward pass, appended whole as task `whole`, into its stages and the
  // exchanges between them, appended after it (a unit of one stage is left as it is).
  virtual void split_forward_into_stages(int whole) = 0;
};

// `walked`: the walk's tasks in creation order (ids are positions; the comm stream not yet
// ordered), each unit's forward already dropping what its recompute mode rebuilds. Re-lists them
// into `out`, with the recompute tasks added.
void recompute_pass(const std::vector<Task>& walked, TaskList& out, const Plan& plan, const model::ModelDesc& desc);

}  // namespace shardlm::plan
