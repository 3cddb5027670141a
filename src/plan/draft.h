// A plan while it is built: the builder's task list and buffers, which the builder's walk and the
// passes that run inside it (DESIGN: "A schedule, then passes") write through. Ids are list
// positions: a task's id is its place in `tasks_` until the comm stream is ordered at the end.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "model/model.h"
#include "plan/plan.h"

namespace shardlm::plan {

// The task list a pass appends to. A pass adding tasks in the middle of the walk's order lists
// every task again, each at the end.
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

class PlanDraft : public TaskList {
 public:
  PlanDraft(const model::ModelDesc& desc, const PlanConfig& cfg) : desc_(desc), cfg_(cfg) {}

  const model::ModelDesc& desc() const { return desc_; }
  const PlanConfig& config() const { return cfg_; }
  Plan& plan() { return plan_; }
  const Plan& plan() const { return plan_; }

  // A task on the stream its op runs on, waiting for `deps` (-1s dropped).
  int add(Op op, int unit, int micro, std::vector<int> deps = {});
  Task& at(int t) override { return tasks_[t]; }
  const Task& at(int t) const { return tasks_[t]; }
  int append(Task t) override;
  // The buffer of this name, created on first use.
  int buffer(const std::string& name, Role role, MemCategory category, int64_t bytes, int unit,
             DType dtype = DType::fp32);
  void alloc(int t, int buf) { at(t).allocs.push_back(buf); }
  void free(int t, int buf) { at(t).frees.push_back(buf); }
  void scratch(int t, int buf) { alloc(t, buf), free(t, buf); }  // alive inside one task
  static std::string tag(int m) { return " [m" + std::to_string(m) + "]"; }
  const std::string& uname(int u) const { return desc_.units[u].name; }

  // A unit sliced over a mesh axis (model::UnitDesc::sliced_over: a MoE block's experts over ep)
  // is used in that many slices, a rank computing with its own: it is gathered and reduced only
  // among the ranks holding the same slice (`within_slice` drops the axis from a collective's).
  int slices(int u) const { return plan_.slices(desc_, u); }
  std::vector<int> within_slice(std::vector<int> axes, int u) const;
  // Elements of unit u a rank computes with (its slice), and their bytes at `elem` bytes each.
  int64_t compute_elems(int u) const { return plan_.compute_elems(desc_, u); }
  int64_t unit_bytes(int u, int elem) const { return compute_elems(u) * elem; }
  int64_t shard_elems(int u) const { return plan_.layout.units[u].padded / plan_.shard_size; }
  // Whether kind k of unit u is split beyond its slice (over the axes that shard it).
  bool split_beyond_slice(State k, int u) const { return !within_slice(plan_.placed(k, u).axes, u).empty(); }

  // bf16 collectives cast through a staging buffer (comm): the whole unit and one shard. The
  // casts copy the whole unit once.
  void stage(int t, int64_t full_elems, int64_t shard_elems, int elem);
  // The communicator's working memory for a reduction of `count` elements per rank
  // (reduce_scatter) or in all (all_reduce), alive inside the task.
  void reduction_scratch(int t, int64_t count);

 protected:
  // The exchanges' stream, opened by the first.
  int exchange_stream();
  int named_stream(const char* name);  // the stream of this name, opened by its first task

  const model::ModelDesc& desc_;
  const PlanConfig& cfg_;
  Plan plan_;
  std::vector<Task> tasks_;
  std::unordered_map<std::string, int> by_name_;
};

}  // namespace shardlm::plan
