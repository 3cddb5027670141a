// Memory planned from the graph: the buffers a step's tasks allocate, at fixed offsets of one block
// (the arena) that the executor keeps from step to step.
//
// Two buffers may share bytes only when, in every schedule the plan's dependencies and stream
// order allow, one of them is freed before the other is allocated. So no two buffers alive at once
// ever overlap, whichever order the streams take, and the memory a step touches is the same block
// every step: nothing is handed back to the system and faulted in again (on a virtual machine,
// first touches of fresh pages cost more than the kernels that write them).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/plan.h"

namespace shardlm::plan {

// Offsets are multiples of this: a buffer may be a direct-I/O target (the disk tier's windows and
// activation slots), which needs 4 KiB alignment.
inline constexpr int64_t kArenaAlign = 4096;

struct ArenaLayout {
  std::vector<int64_t> offset;  // per buffer id; -1: no task allocates it
  int64_t bytes = 0;            // the block's size: the end of the highest buffer
};

// Greedy first fit, largest buffers first, each at the lowest offset clear of every placed buffer
// it may be alive beside. The block is at least the plan's dynamic peak (peak_memory() less the
// static state: the list order is one schedule) and in the plans measured within ~2% of it.
ArenaLayout lay_out_arena(const Plan& plan);

}  // namespace shardlm::plan
