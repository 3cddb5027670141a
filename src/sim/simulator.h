// The simulator: runs one rank's plan as a discrete-event simulation against the cost model.
// Each stream runs its tasks in plan order; a task starts when its stream is free and every
// dependency has finished; compute runs slower (the profile's comm_compute_slowdown) while a
// collective is running. The plan is the same on every rank and a homogeneous mesh makes every
// rank alike, so one rank stands for all. Nothing is allocated for the model: memory is the
// plan's figures and the timeline of its buffers.
#pragma once

#include <vector>

#include "model/model.h"
#include "plan/plan.h"
#include "sim/hardware.h"
#include "tensor/memory.h"
#include "trace/trace.h"

namespace shardlm::sim {

struct TaskTime {
  double start_s = 0, end_s = 0;
};

// One run of a task (a repeated task runs several times a step: Plan::repeat).
struct TaskRun {
  int task = 0;
  int64_t run = 0;
  TaskTime time;
};

struct SimResult {
  double step_ms = 0;
  double tokens_per_s = 0;   // global: every rank's tokens
  double mfu = 0;            // model FLOPs per second ÷ (ranks × one rank's peak)
  double comm_exposed_ms = 0;  // time the compute stream waited for other streams
  double compute_busy_ms = 0, comm_busy_ms = 0;  // time each kind of stream ran a task
  // Expert parallelism's all-to-alls (the exchange tasks): time they ran (part of comm_busy_ms),
  // and the part of comm_exposed_ms the compute stream waited with an exchange the last task it
  // waited for.
  double exchange_busy_ms = 0, exchange_exposed_ms = 0;
  // The disk tier's copy stream (--offload): time it ran reloads and write-backs (part of
  // comm_busy_ms), and the part of comm_exposed_ms the compute stream waited with a copy the last
  // task it waited for.
  double disk_busy_ms = 0, disk_exposed_ms = 0;
  // --pipeline-optimizer: time the optimizer stream's updates ran (not part of comm_busy_ms); while
  // they run beside the compute stream the two share the device, each at half its rate.
  double optimizer_busy_ms = 0;
  MemSnapshot mem;      // the plan's snapshot at its highest total (Plan::peak_memory)
  MemSnapshot mem_max;  // each category's own highest (Plan::max_memory)
  MemSnapshot timeline_peak;  // the highest total over the simulated timeline's buffers
  std::vector<TaskTime> times;  // per task id (of its last run)
  // Every run simulated, in the order they ended. A plan whose micro-step repeats more than
  // kSimulatedRuns times is simulated at kSimulatedRuns - 1 and kSimulatedRuns runs and extended
  // by their difference per further run (the repeated micro-step reaches a steady state at once:
  // its tasks, costs and buffers are the same every run); the runs not simulated are not listed,
  // and the tasks after them start that much later.
  std::vector<TaskRun> runs;
};

inline constexpr int64_t kSimulatedRuns = 3;

// The plan options a profile implies: activations in its activation_dtype (on a bf16 preset, a
// GPU, bf16, as the engines that preset stands for keep them; on an fp32 (CPU) profile, or one
// calibrate measured on shardlm's CUDA backend, fp32, what `train` runs); and hybrid shard without
// a shard group shards inside a node (devices_per_node ranks), as train does on a machine's ranks.
// Throws std::invalid_argument where the ranks do not fill whole nodes.
plan::PlanConfig for_hardware(plan::PlanConfig c, const HardwareProfile& hw);

// `threads`: compute threads per rank (per-thread CPU profiles scale with it). `expert_load`: the
// busiest expert's routed rows over the mean (CostModel; 1: balanced routing).
SimResult simulate(const model::ModelDesc& desc, const plan::Plan& plan, const HardwareProfile& hw, int threads,
                   double expert_load = 1);

// The simulated rank as a trace: the same slices (task names, streams) and memory counters a
// real run records, for step `step`.
trace::RankTrace to_trace(const model::ModelDesc& desc, const plan::Plan& plan, const SimResult& r, int64_t step = 0);

}  // namespace shardlm::sim
