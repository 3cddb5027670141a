// A model whose state needs more memory than this machine has is refused, with the figures,
// before anything is allocated (it would otherwise die of std::bad_alloc or the OOM killer after
// minutes, or swap the machine to a halt).
#pragma once

#include <cstdint>

#include "model/model.h"
#include "plan/plan.h"
#include "train/machines.h"

namespace shardlm::train {

struct MachineMemory {
  int64_t available = 0;  // /proc/meminfo MemAvailable (MemTotal where the kernel lacks it)
  int64_t physical = 0;   // MemTotal
};
MachineMemory machine_memory();

// A cheap first check from the configuration alone: each rank holds at least
// bytes_per_param × parameters / shards (training: fp32 parameters, gradients and AdamW's two
// moments, 16 bytes, over the ranks that shard them; evaluation: 4 bytes, 1 shard). Describes
// only a 1- and a 2-layer copy of the model, so a config asking for a million layers is refused
// at once instead of being described for minutes. `machines`: how many ranks of the job share
// this machine's memory, and its memory cgroup's limit (Machines::ranks_here,
// ranks_under_memory_limit). Returns `c`; throws std::runtime_error.
const model::ModelConfig& refuse_unless_state_fits(const model::ModelConfig& c, double bytes_per_param, int shards,
                                                   const Machines& machines);

// The plan's peak per rank (every category, as `explain` prints it), plus three whole fp32
// copies of the state when `stages_whole_state` (resuming an older whole checkpoint reads
// parameters and both moments whole on every rank), times the ranks sharing each, against this
// machine's available memory and this rank's memory cgroup's. Returns `plan`; throws
// std::runtime_error naming the figures.
plan::Plan refuse_unless_plan_fits(plan::Plan plan, bool stages_whole_state, const Machines& machines);

}  // namespace shardlm::train
