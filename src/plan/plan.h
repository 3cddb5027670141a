// A plan: the tasks one rank runs for one training step, as plain data. Strategies build plans
// (strategy.h); the executor (run/) runs them with real kernels and collectives; the simulator
// will run them against a cost model; `shardlm explain` prints them.
//
// Contract of a plan:
//  - Tasks on one stream run in their order in `tasks`; a task starts only when every task in
//    `deps` (on any stream) has finished. Prefetch depth and the limit on gathers in flight are
//    expressed as such dependencies, never as special cases in an executor.
//  - Buffers are named; a task's `allocs` exist from its start, its `frees` end at its end.
//    Static buffers (the sharded or replicated state) live for the whole run.
//  - The plan is the same on every rank of a job (ranks differ only in which shard they hold).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/gpt2.h"
#include "tensor/memory.h"

namespace shardlm::plan {

enum class Strategy { ddp, zero1, zero2, fsdp, hybrid };
const char* to_string(Strategy s);
Strategy parse_strategy(const std::string& name);  // throws std::invalid_argument naming it

enum class Stream { compute, comm };
const char* to_string(Stream s);

enum class Op {
  all_gather,      // comm: a unit's parameter shards -> its gathered parameters
  reduce_scatter,  // comm: a unit's full gradients -> this rank's summed gradient shard
  all_reduce,      // comm: a bucket of gradients (DDP, ZeRO-1) or a shard across replicas (hybrid)
  forward,         // compute: unit forward of one micro-step
  head,            // compute: final norm + tied head + loss, forward and backward
  backward,        // compute: unit backward of one micro-step
  grad_norm,       // compute + comm: global gradient norm over all shards, and clipping
  optimizer,       // compute: AdamW on this rank's shard of every unit
  param_gather,    // comm: ZeRO-1/2: updated parameter shards -> every rank's full copy
};
const char* to_string(Op op);

// Which ranks a collective spans: all of them, this rank's shard group, or the ranks holding
// the same shard in the other groups (hybrid).
enum class Group { world, shard, replicate };
const char* to_string(Group g);

struct BufferUse {
  std::string name;  // e.g. "gathered h.3", "grad h.3"
  MemCategory category;
  int64_t bytes;
};

struct Task {
  int id = 0;
  Op op = Op::forward;
  Stream stream = Stream::compute;
  Group group = Group::world;
  int unit = -1;      // index into ModelDesc::units; -1: all units / none
  int micro = 0;      // micro-step
  int first_unit = -1, last_unit = -1;  // all_reduce buckets: units [first, last]
  std::vector<int> deps;
  double flops = 0;   // compute work
  int64_t bytes = 0;  // a collective's size: the whole gathered unit / reduced gradients, in the wire dtype
  std::vector<BufferUse> allocs;
  std::vector<std::string> frees;
  // "all_gather u3 [m0]", or with the model's unit names "all_gather h.2 [m0]".
  std::string name(const model::ModelDesc* desc = nullptr) const;
  // The bf16 staging buffer of a collective (its allocs name it so).
  std::string staging_buffer() const { return "staging " + name() + " " + std::to_string(first_unit); }
};

struct PlanConfig {
  Strategy strategy = Strategy::fsdp;
  int world = 1;        // N ranks
  int shard_group = 0;  // hybrid: G consecutive ranks shard (0: world)
  int64_t batch = 4, seq = 256, grad_accum = 1;
  int prefetch_forward = 1, prefetch_backward = 1;
  int max_gathers_in_flight = 2;
  double bucket_mb = 25;
  int param_bytes = 4;   // gathered parameter / communication element size (fp32 4, bf16 2)
  int reduce_bytes = 4;  // gradient communication element size
};

// Bytes per category the rank holds for the whole run (state and step-long buffers).
struct StaticMemory {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0;
};

struct Plan {
  PlanConfig config;
  int shard_size = 1;  // ranks one unit is split over (N for fsdp/zero, G for hybrid, 1 for ddp)
  model::FlatLayout layout;  // units padded to a multiple of 16 × shard_size
  StaticMemory static_memory;
  std::vector<Task> tasks;
  // Highest bytes per category of the dynamic buffers when tasks run in plan order (compute and
  // comm interleaved as their dependencies allow the earliest), plus the static memory.
  MemSnapshot peak_memory() const;
  // Each category's own highest bytes over the same walk (they need not peak together).
  MemSnapshot max_memory() const;
  // True when `later` cannot start before `earlier` has finished in any execution: it depends
  // on it through deps and stream order (a task waits for the one before it on its stream).
  bool depends_on(int later, int earlier) const;
  std::string to_text(const model::ModelDesc& desc) const;
};

// The embedding unit is used at both ends of the forward and at the start and end of the
// backward (tied head), so sharded plans gather it once per step and keep it, as FSDP keeps its
// root unit: a memory price of one gathered embedding for fewer collectives.
// With one rank every strategy becomes DDP's plan without collectives.
// Throws std::invalid_argument naming the field of a bad configuration.
Plan build_plan(const model::ModelDesc& desc, const PlanConfig& config);

}  // namespace shardlm::plan
