// The parameter gather pass: where a rank updates only a part of the parameters it holds (ZeRO-1
// and -2 hold every parameter and shard the optimizer), the updated parts travel back to every
// rank holding the whole: one param_gather per unit after the optimizer, over the axes the
// optimizer's placement adds to the parameters'. What a rank holds is read from the plan's
// placement, not from the strategy's name.
#include "plan/param_gather.h"

#include <algorithm>
#include <vector>

namespace shardlm::plan {

namespace {

// The axes unit u's optimizer state is split over beyond its parameters' (its slicing axis
// splits both), ascending; empty where each rank updates all it holds. An axis of one rank counts
// too (its gather spans the one rank).
std::vector<int> gathered_over(const Plan& p, int u) {
  const Placement &params = p.placed(State::params, u), &moments = p.placed(State::optimizer, u);
  std::vector<int> axes;
  for (int a : moments.axes)
    if (std::find(params.axes.begin(), params.axes.end(), a) == params.axes.end()) axes.push_back(a);
  return axes;
}

// Inserts `added` at position `at` of the task list, moving the tasks from there on (ids are
// list positions; deps and Repeat's counterparts follow).
void insert_tasks(Plan& p, int at, std::vector<Task> added) {
  const int n = static_cast<int>(added.size());
  auto moved = [&](int id) { return id >= at ? id + n : id; };
  for (Task& t : p.tasks) {
    t.id = moved(t.id);
    for (int& d : t.deps) d = moved(d);
  }
  for (int i = 0; i < n; ++i) added[i].id = at + i;
  p.tasks.insert(p.tasks.begin() + at, added.begin(), added.end());
  if (!p.repeat.counterpart.empty()) {
    for (int& c : p.repeat.counterpart) c = c >= 0 ? moved(c) : c;
    p.repeat.counterpart.insert(p.repeat.counterpart.begin() + at, n, -1);
  }
}

}  // namespace

void param_gather_pass(Plan& p, const model::ModelDesc& desc) {
  const auto opt = std::find_if(p.tasks.begin(), p.tasks.end(), [](const Task& t) { return t.op == Op::optimizer; });
  if (opt == p.tasks.end()) return;  // a forward-only plan updates nothing
  std::vector<Task> gathers;
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
    std::vector<int> axes = gathered_over(p, u);
    if (axes.empty()) continue;
    Task t;
    t.op = Op::param_gather, t.stream = kComm, t.unit = u, t.micro = opt->micro;
    t.axes = std::move(axes);
    t.deps = {opt->id};
    t.bytes = p.compute_elems(desc, u) * p.config.param_bytes;
    gathers.push_back(std::move(t));
  }
  // Right after the optimizer: the step's last compute task, which the comm tasks after it (the
  // loss's reduction) wait for too.
  insert_tasks(p, opt->id + 1, std::move(gathers));
}

}  // namespace shardlm::plan
