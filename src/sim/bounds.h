// Lower bounds on what a configuration's plan costs, from its frame alone (plan::plan_frame: the
// mesh, layout, state placement and static memory; no tasks): the planner prunes and bounds with
// them before it builds a plan, which costs a hundred times more.
//
// Contract, for an in-memory training configuration (no --offload, --memory-budget or
// --pipeline-optimizer; for others every figure is 0, which bounds nothing):
//  - compute_ms: the compute stream's work at full speed: every unit's forward, rebuild and
//    backward stage by stage, the head, the full gradients' zero fill, zeroing the gradients, the
//    norm and AdamW, as CostModel prices those tasks, every micro-step counted. The plan's compute
//    tasks are exactly these, so it equals their sum (Bounds.AreBelowThePlansFigures...).
//  - comm_ms: the comm stream's work: each collective of state the strategy runs at least once a
//    step (gathers of sharded parameters once per micro-step's forward unless kept, reductions of
//    gradients, ZeRO's parameter gathers), each op on each group priced as one message of the
//    bytes summed: one message costs no more than its parts (α + S·factor/(busBw·η(S)), η the
//    published tables' rate at that size; Cost.OneMessageCostsNoMoreThanItsParts), so the sum of
//    several is no less than one of their total. At most the comm stream's busy time.
//  - exchange_ms: the exchange stream's work: every all-to-all and ring step of the staged units'
//    passes (and of a full rebuild's), as CostModel prices them; equal to the plan's.
//  - waited_ms: of those, the exchanges the compute stream waits for idle: one started by a
//    stage (`after` 1: all-to-alls of routed rows and of Ulysses' heads) feeds the stage right
//    after it on the compute stream, which cannot start before it ends.
//  - ends_ms: what the compute stream waits for at the step's two ends, where nothing can hide
//    it: unit 0's gather before the first forward (it waits for zero_grads); unit 0's reduction
//    (and hybrid's all-reduce of it over the replicas) between the last backward and grad_norm;
//    norm_reduce before the optimizer; ZeRO-1/2's parameter gathers after it.
//  - step_ms(): the compute stream's work with its waits, or another stream's work, whichever is
//    more; a stream runs its tasks one at a time, so no step is shorter.
//  - peak_bytes: what is alive when the last micro-step's head runs: the static memory, every
//    unit's activations kept for its backward, the head's scratch; under sharded parameters the
//    head's and the borrowed units' gathered parameters (and, with --keep-gathered all, every unit's
//    whose backward reads them); under sharded gradients the head's full gradients, or every
//    unit's where micro-steps accumulate into them. At most Plan::peak_memory().total.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/model.h"
#include "plan/plan.h"
#include "sim/cost.h"
#include "sim/hardware.h"

namespace shardlm::sim {

struct StepBounds {
  double compute_ms = 0, comm_ms = 0, exchange_ms = 0, waited_ms = 0, ends_ms = 0;
  int64_t peak_bytes = 0;
  double step_ms() const { return std::max({compute_ms + waited_ms + ends_ms, comm_ms, exchange_ms}); }
};

// A frame (plan::plan_frame) and the spans of every group its configurations' bounds price (each
// mesh axis alone; the shard, replicate and gradient axes with and without each unit's slicing
// axis), computed once for all the configurations that share it.
struct BoundsFrame {
  plan::Plan plan;
  CostModel::Spans spans;                    // the groups below by their axes, each mesh axis alone first
  std::vector<int64_t> elems;                // per unit: the slice of it a rank computes with
  std::vector<GroupSpan> groups;             // the groups the comm bound prices
  std::vector<int> shard_group, grad_group;  // per unit: its shard and gradient axes' group, less its slicing axis
  int replicate_group = -1, norm_group = -1;  // the replicate axes', the norm's (norm_reduce's)
  int64_t norm_reduce_bytes = 0;
};
BoundsFrame bounds_frame(const model::ModelDesc& desc, plan::Plan frame, const HardwareProfile& hw);

// The bounds of configuration `c` laid out by `frame` (its frame: plan::plan_frame(desc, c) but
// for the knobs a frame does not read); `threads` and `expert_load` as simulate takes them.
StepBounds step_bounds(const model::ModelDesc& desc, const BoundsFrame& frame, const plan::PlanConfig& c,
                       const HardwareProfile& hw, int threads, double expert_load = 1);

// The same in two parts, for a search that bounds many configurations: what the frame, the
// micro-batch, accumulation and recompute decide (the units' costs and the cost model: nearly all
// the work), shared by configurations that differ only in dtypes and units kept; then the rest.
struct ComputeBounds {
  double compute_ms = 0, exchange_ms = 0, waited_ms = 0;
  int64_t peak_bytes = 0;  // the static memory, kept activations and the head's scratch
  // Alive when the last micro-step's head runs, by strategy and knobs: gathered under sharded
  // parameters (and what --keep-gathered all adds), full gradients under sharded gradients (all,
  // when micro-steps accumulate into them).
  int64_t gathered = 0, kept_gathered = 0, grads_at_head = 0, grads_all = 0;
};
ComputeBounds compute_bounds(const model::ModelDesc& desc, const BoundsFrame& frame, const plan::PlanConfig& c,
                             const HardwareProfile& hw, int threads, double expert_load = 1);
StepBounds step_bounds(const model::ModelDesc& desc, const BoundsFrame& frame, const plan::PlanConfig& c,
                       const ComputeBounds& computed, const HardwareProfile& hw);

}  // namespace shardlm::sim
