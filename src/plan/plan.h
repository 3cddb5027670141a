// A plan: the tasks one rank runs for one step, as plain data. Strategies build plans
// (build_plan); the executor (run/) runs them with real kernels and collectives; the simulator
// runs them against a cost model; `shardlm explain` prints them.
//
// Contract of a plan:
//  - Streams are an open list (streams[0] is compute). Tasks on one stream run in their order in
//    `tasks`; a task starts only when every task in `deps` (on any stream) has finished.
//    Prefetch depth and the limit on gathers in flight are such dependencies, never special
//    cases in an executor.
//  - Every byte a step touches is a typed buffer (buffers[id]): the run-long state (parameters,
//    gradients, AdamW moments: this rank's element ranges, `state`), and the per-task buffers a
//    task allocates (`allocs`, at its start; `hands_off`, at its end, for a task on another stream
//    that depends on it) and a later one frees (`frees`, at its end): gathered parameters, full
//    gradients, activations, workspace, staging. A buffer id is never alive twice at once.
//  - Parameters and gradients are allocated and freed only at compute tasks' boundaries (a
//    gather's buffer is handed off by the compute task it waits for; a unit's full gradients are
//    freed by the second backward after its reduce-scatter, which waits for it), so their bytes
//    over time do not depend on how the streams interleave.
//  - A task names the buffers it reads and writes (`io`), so an executor resolves ids, not names.
//  - Collectives run over mesh axes, each declared by its role (plan/mesh.h); the plan is the
//    same on every rank (ranks differ only in their coordinates, hence which shard they hold).
//  - Nothing happens outside a task: zeroing gradients, the gradient-norm reduction and the loss
//    sum are tasks.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "model/model.h"
#include "plan/mesh.h"
#include "plan/ops.h"
#include "plan/schedule.h"
#include "tensor/dtype.h"
#include "tensor/memory.h"

namespace shardlm::plan {

enum class Strategy { ddp, zero1, zero2, fsdp, hybrid };
const char* to_string(Strategy s);
Strategy parse_strategy(const std::string& name);  // throws std::invalid_argument naming it

inline constexpr int kCompute = 0, kComm = 1;  // the streams builders emit today

// What a buffer holds.
enum class Role {
  params, grads, exp_avg, exp_avg_sq,  // run-long state (this rank's element ranges)
  gathered,                            // a unit's whole parameters, gathered
  kept_part,                           // a partly kept unit's kept part, forward to backward (wire dtype)
  full_grads,                          // a unit's whole gradients before reduce-scatter
  value,                               // a residual-stream value (batch or hidden state)
  saved, recomputable,                 // a unit's activations kept for its backward
  forward_ws, backward_ws,             // a task's scratch
  grad_stream,                         // gradient of the residual stream through a backward
  staging,                             // a bf16 collective's cast copy
  routed,                              // rows an exchange sends or receives between a unit's stages
  window,                              // a unit's offloaded state while it is in memory (--offload)
  rollback,                            // a unit's params, exp_avg, exp_avg_sq before a speculative update
};
const char* to_string(Role r);

enum class Location { host, device, disk };
const char* to_string(Location l);

struct BufferDesc {
  int id = 0;
  std::string name;  // e.g. "gathered h.3", "saved h.3 [m0]"
  Role role = Role::value;
  MemCategory category = MemCategory::activations;
  DType dtype = DType::fp32;
  int64_t bytes = 0;
  int unit = -1;
  int value = -1;  // Role::value: index into ModelDesc::values
  Location where = Location::host;
  // --offload activations: the byte offset of this buffer's slot in the rank's activations file
  // (its saved activations, written back after the forward and reloaded before the backward);
  // -1: never leaves memory. Such a buffer's bytes are padded to the disk's 4 KiB.
  int64_t disk_offset = -1;
  // A task's workspace (Role::forward_ws, backward_ws): its first bytes are lent to the backend's
  // kernels for their own scratch (model::UnitCosts::*_kernel_scratch), the layers' part follows.
  int64_t kernel_scratch = 0;

  // What a unit's forward keeps for its backward: the buffers --offload activations and the
  // budget may move to disk.
  bool kept_for_backward() const { return role == Role::saved || role == Role::recomputable; }
};

// The buffers a task reads and writes; -1: not used. Unit parameters and gradients that are not
// per-task buffers are the unit's range of the run-long state.
struct Operands {
  int params = -1, grads = -1;                    // the task's unit
  int borrowed_params = -1, borrowed_grads = -1;  // the unit it borrows (tied head)
  std::vector<int> inputs;                        // values read, in the unit's `reads` order
  int output = -1;                                // value written
  int saved = -1, recomputable = -1;
  int forward_ws = -1, backward_ws = -1;
  int grad_stream = -1;
  int staging = -1;       // bf16 collectives: the cast copy
  int comm_scratch = -1;  // reductions: the communicator's working memory
  // A staged unit (model::UnitCosts::exchanges): the routed rows a stage reads (the exchange before
  // it delivered them) and writes (for the exchange after it); an exchange reads `send` and fills
  // `recv`. Where an exchange spans one rank it is left out and the next stage reads its `send`.
  int send = -1, recv = -1;
  // A copy task (reload, write_back): the window it fills from disk or writes back, or (where the
  // buffer has a disk_offset) the saved activations.
  int window = -1;
  // A speculative optimizer task (--pipeline-optimizer): where it keeps the unit's state first.
  int rollback = -1;
  // A bucketed all_gather (first_unit >= 0): each unit's gathered buffer, in gather order; its
  // staging (the concatenated shards and their gathered concatenation) is `staging`.
  std::vector<int> bucket;
  // A partly kept unit (--keep-gathered NAME:FRACTION): its forward all_gather also copies the
  // kept part (the first Plan::kept_elems[unit] elements of every rank's shard) into `keep_into`;
  // its backward all_gather gathers only the rest of each shard and copies the kept part back
  // from `restore_from`. -1: not used.
  int keep_into = -1, restore_from = -1;
};

struct Task {
  int id = 0;
  Op op = Op::forward;
  int stream = kCompute;
  std::vector<int> axes;  // mesh axes a collective spans (indices into Plan::mesh), ascending
  int unit = -1;          // index into ModelDesc::units; -1: all units / none
  int micro = 0;          // micro-step
  // A staged unit's task: which stage of its pass a compute task runs (-1: the whole pass), and
  // for an exchange, which one (between stages `stage` and `stage` + 1) and whether it carries the
  // backward's gradients (from stage + 1 back to stage).
  int stage = -1;
  bool reverse = false;
  // A send or recv between pipeline stages: the stage at the other end (the task's own is `stage`),
  // its rank along the task's axes (the pipe's) and, with `reverse`, that it carries gradients.
  int peer_stage = -1, peer = -1;
  // An exchange's route: 0 an all-to-all (model::Exchange::Route::all_to_all); +1 / −1 a ring step,
  // the whole buffer to the next / previous rank of its axes and the same size from the other side.
  int ring_step = 0;
  const char* carries = nullptr;  // an exchange's payload in words for `explain` (model::Exchange::carries)
  // all_reduce buckets: units [first, last]; all_gather buckets: first..last in gather order
  // (ascending in a forward, descending in a backward; unit is then -1).
  int first_unit = -1, last_unit = -1;
  std::vector<int> deps;
  double flops = 0;   // compute work
  int64_t bytes = 0;  // a collective's size in the wire dtype
  // Bytes a collective also copies in local memory (each read once and written once): a bucket's
  // packing and unpacking, a partly kept unit's kept part.
  int64_t copy_bytes = 0;
  std::vector<int> allocs, frees;  // buffer ids
  std::vector<int> hands_off;      // allocated at the task's end, after its frees
  Operands io;
  // "all_gather u3 [m0]", or with the model's unit names "all_gather h.2 [m0]"; `step_micro`
  // >= 0 names that micro-step of the step instead (a run of a repeated task, Plan::step_micro).
  std::string name(const model::ModelDesc* desc = nullptr, int64_t step_micro = -1) const;
};

// The run-long state of a unit, one enum for the whole engine: a buffer of each of params, grads,
// exp_avg and exp_avg_sq (kNumStateBuffers). The two AdamW moments share one placement and
// layout, named by the first: State::optimizer is State::exp_avg, so what is placed, laid out or
// offloaded per kind is indexed by the first kNumStateKinds values (params, grads, optimizer).
// tensor's MemCategory stays apart: it is what the allocator charges bytes to (activations, comm,
// workspace, staging and snapshot as well as state, both moments one category), a part below this.
enum class State { params, grads, exp_avg, exp_avg_sq, optimizer = exp_avg };
inline constexpr int kNumStateKinds = 3;
inline constexpr int kNumStateBuffers = 4;
// The kind a buffer is placed as: either moment is the optimizer's.
constexpr State kind_of(State s) { return s == State::exp_avg_sq ? State::optimizer : s; }
// The buffer's name (params, grads, exp_avg, exp_avg_sq: the offload files' and windows' names).
const char* to_string(State s);
// The kind's name (params, grads, optimizer for either moment), as placements print.
const char* kind_name(State s);

// The deepest read-ahead of the disk tier (--offload-prefetch). A depth d keeps about d + 1
// units' windows of offloaded state in memory at once, so at 64 it holds more blocks than most
// presets have (the 70B LLaMAs' 80 and gpt3-175b's 96 aside): offloading has long stopped saving
// memory there, and auto chooses from 0..4. A deeper value is a slip of the keyboard, not a plan.
inline constexpr int kMaxOffloadPrefetchDepth = 64;

// The disk tier (--offload): which kinds of state live in files instead of memory, and how many
// units' state the copy stream reads ahead of the task using it.
struct OffloadConfig {
  std::array<bool, kNumStateKinds> kinds{};  // by kind (State below kNumStateKinds): every unit's state of that kind
  // A choice per unit (by unit index, then kind), e.g. the budget's placement pass's; empty:
  // `kinds` holds for every unit. When set, it is the whole choice (`kinds` is ignored).
  std::vector<std::array<bool, kNumStateKinds>> units;
  // --offload activations: the blocks' saved activations are written to disk after their forward
  // and read back, `prefetch` backward tasks ahead, for their backward.
  bool activations = false;
  // With `activations`, a choice per unit (the budget's); empty: every unit's.
  std::vector<char> activation_units;
  // Per unit (then kind), elements at the head of each rank's part of an offloaded kind that
  // stay in memory (Placement::resident; the budget's use of what whole units leave of it); empty
  // or 0: the whole part is on disk.
  std::vector<std::array<int64_t, kNumStateKinds>> resident;
  int64_t resident_elems(State k, int u) const {  // either moment reads the optimizer's
    return u < static_cast<int>(resident.size()) ? resident[u][static_cast<int>(kind_of(k))] : 0;
  }
  int prefetch = 2;
  bool on_disk(State k, int u) const {
    const int i = static_cast<int>(kind_of(k));
    return units.empty() ? kinds[i] : u < static_cast<int>(units.size()) && units[u][i];
  }
  bool activations_on_disk(int u) const {
    return activations && (activation_units.empty() || (u < static_cast<int>(activation_units.size()) && activation_units[u]));
  }
  bool disk() const { return any() || activations; }  // anything at all
  // Any kind of run-long state, for some unit.
  bool any() const {
    if (units.empty()) return kinds[0] || kinds[1] || kinds[2];
    for (const auto& u : units)
      if (u[0] || u[1] || u[2]) return true;
    return false;
  }
};

struct PlanConfig {
  Strategy strategy = Strategy::fsdp;
  int world = 1;        // N ranks
  int shard_group = 0;  // hybrid: G consecutive ranks shard (0: world)
  int ep = 1;           // expert parallel (--ep): the data-parallel ranks split into groups of ep
  // Context parallel (--cp): groups of cp consecutive ranks read the same batch and each holds
  // seq / cp positions of every sequence (model::context_chunk_starts), attention running as
  // `cp_impl`. Parameters shard (or replicate, under DDP) over cp with the data-parallel axes, and
  // gradients and the loss are summed over it. A plan that does not `split_sequence` (generation,
  // evaluation) keeps the mesh, hence the state's placement, but every rank runs whole sequences.
  int cp = 1;
  // Pipeline parallel (--pp): the blocks split into stages along the model (the first holding the
  // embedding, the last the head), pp ranks apart on the outermost axis; each rank holds only its
  // stages' units and runs its part of `pp_schedule` (plan/schedule.h) over grad_accum
  // micro-batches, passing activations and their gradients to the neighbouring stages. The other
  // axes lay out world / pp ranks as they lay out a world without pp. `pp_virtual` stages a rank
  // (interleaved-1f1b); `pp_layers` the blocks of each stage (empty: balanced by the blocks'
  // costs). `pipe_rank` is which rank of the pipe this plan is for: ranks of one stage run the
  // same plan, ranks of different stages different ones.
  int pp = 1;
  std::string pp_schedule = "1f1b";
  int pp_virtual = 1;
  std::vector<int> pp_layers;
  int pipe_rank = 0;
  // Ranks of one pipeline stage (all of them without pp): what the data-parallel, expert and
  // context axes lay out.
  int stage_world() const { return world / pp; }
  model::ContextImpl cp_impl = model::ContextImpl::ring;
  bool split_sequence = true;
  int64_t batch = 4, seq = 256, grad_accum = 1;
  // Build every micro-step's tasks even past kUnrolledMicroSteps (tests: the repeated plan runs
  // as the unrolled one).
  bool unroll_micro_steps = false;
  int prefetch_forward = 1, prefetch_backward = 1;
  int max_gathers_in_flight = 2;
  double bucket_mb = 25;
  int param_bytes = 4;   // gathered parameter / communication element size (fp32 4, bf16 2)
  int reduce_bytes = 4;  // gradient communication element size
  model::Recompute recompute = model::Recompute::none;
  // --recompute-blocks: how many of the model's n_layer blocks `recompute` applies to, spread
  // evenly (recompute_of); the others keep all they save. N = n_layer / k is every k-th block, as
  // torchtitan's per-layer selective AC and fms-fsdp's fraction of blocks checkpointed; any N lets
  // a plan recompute only what memory needs. -1: every block.
  int recompute_blocks = -1;
  // The recompute mode of the block at `layer` of n_layer: block l is one of the N when
  // floor((l + 1)·N / L) > floor(l·N / L). Units outside the blocks (layer -1: nothing to rebuild)
  // keep `recompute`.
  model::Recompute recompute_of(int layer, int n_layer) const;
  // --act-quant: the GEMM inputs kept for the backward as int8 with per-group scales (model::ActQuant;
  // the costs, so the saved buffers, follow it and `recompute`). Forward-only plans drop it.
  model::ActQuant act_quant{};
  // Selective unsharding (FSDP / hybrid): units that stay gathered from the step's start to their
  // last backward instead of being regathered, by name ("h.10", "final_norm") or {"all"}; a
  // memory price for fewer all-gathers. Empty: none (the borrowed embedding is kept regardless).
  // "NAME:FRACTION" (0 < FRACTION < 1, e.g. "h.10:0.5") keeps that fraction of the unit (of each
  // rank's shard, rounded down to 16 elements) from each forward to its backward, whose gather
  // then moves only the rest: the choice split finer, for a budget a whole unit does not fit.
  std::vector<std::string> keep_gathered;
  // All-gather buckets (FSDP / hybrid): consecutive units, in the order they are gathered, whose
  // gathered bytes (wire dtype) sum to <= this many MiB share one all_gather over their
  // concatenated shards, unpacked into each unit's gathered buffer; the unit shard layout stays.
  // A price in memory (a bucket's units are gathered, so alive, together; comm staging) for fewer
  // collectives. 0: off, one all_gather per unit. Ignored by ddp / zero1 / zero2.
  double gather_bucket_mb = 0;
  int threads = 1;  // compute threads (kernels' per-thread scratch)
  // Bytes of an activation element: 4 is what the executor runs (layers/ keeps fp32); 2 prices an
  // engine keeping bf16 activations, as the simulator does on a bf16 (GPU) hardware profile.
  int activation_bytes = 4;
  enum class Mode { train, loss, logits } mode = Mode::train;  // loss, logits: forward only
  // --async-save: the rank keeps a copy of the state its checkpoint file holds (staging), which a
  // background thread writes while the steps go on.
  bool stage_checkpoint = false;
  // Bytes of working memory the communicator takes for a reduction task of `count` elements
  // (per rank for reduce_scatter, in all for all_reduce) of `elem` bytes over `group` ranks
  // (Communicator::scratch_bytes); each such task gets a buffer of that size. Unset: none.
  std::function<int64_t(Op op, int64_t count, int elem, int group)> reduction_scratch;
  // --offload: the offload pass (plan/offload.cc) places these kinds on disk and adds the copies.
  OffloadConfig offload;
  // --pipeline-optimizer: the optimizer overlap pass (plan/optimizer_overlap.cc) updates each unit
  // as soon as its gradients are final, speculatively, and commits or rolls back once the global
  // norm is known.
  bool pipeline_optimizer = false;
  // --reduce-each-micro-step (zero2, fsdp, hybrid with grad_accum > 1): every micro-step's
  // backward reduce-scatters its unit's gradients and adds the shard to the held one, as PyTorch
  // FSDP and DeepSpeed ZeRO-2/3 do by default, so a unit's full gradients live only from its
  // backward to its reduce-scatter; the price is grad_accum reduce-scatters a step instead of one.
  // Unset, micro-steps accumulate whole gradients and the last one reduces them (FSDP's no_sync).
  // Hybrid's all-reduce over the replicas still runs once, on the summed shard.
  bool reduce_each_micro_step = false;
  // What the kernels of the backend the plan runs on take as scratch of their own (a CUDA
  // backend's; none on the CPU): each unit task's workspace buffer holds the most one of its calls
  // does (model::UnitCosts::*_kernel_scratch) before the layers' part.
  model::KernelScratch kernel_scratch{};
  // --memory-budget: per-rank bytes the plan's accounted peak (peak_memory().total) must stay
  // within; the placement pass (plan/budget.cc) moves params, grads and optimizer state and saved
  // activations of units to disk until it does, and writes its choice into `offload.units` and
  // `offload.activation_units`. 0: no budget.
  int64_t memory_budget = 0;
};

// The strategy as a run header and run_info.json name it: "fsdp", "hybrid (shard group 4)".
std::string strategy_text(const PlanConfig& c);

// A plan lists the tasks of at most this many micro-steps; more are runs of a repeated one.
inline constexpr int64_t kUnrolledMicroSteps = 4;

// Micro-steps in the middle of a step are alike: no first gathers, no gradient reductions. With
// grad_accum N > kUnrolledMicroSteps a plan lists micro-steps 0, 1, 2 and 3, where micro-step 2
// stands for micro-steps 2 .. N-2 (its tasks run `times` = N-3 times in a row) and 3 is the
// step's last, N-1; so a plan's size, and the time to build, walk or simulate it, do not grow
// with N. Run k+1 of a repeated task waits on run k of the tasks it waits on in micro-step 2, and
// on run k of their counterparts where it waits on micro-step 1 (`counterpart`, per task id: the
// repeated task in the same place of its stream, for a task of micro-step 1; else -1). The
// repeated tasks are consecutive on each stream, and no task waits on one two micro-steps back.
// A plan with the disk tier (OffloadConfig::disk) lists every micro-step: its reloads run ahead
// across micro-step boundaries, so its micro-steps are not alike on the copy stream.
struct Repeat {
  int micro = -1;  // -1: nothing repeats
  int64_t times = 1;
  std::vector<int> counterpart;
};


// How one kind of one unit's state is held: the unit's padded flat buffer split into `parts`
// equal element ranges over the ranks of mesh `axes` (parts = the product of their sizes; a rank
// holds range mesh.index_in(rank, axes)); no axes and parts 1: whole on every rank; parts 0: not
// held at all (a forward-only plan has no gradients). `where` is where the held range lives.
// With `where` disk, the first `resident` elements of the held range stay in memory (a multiple
// of kResidentGrain, less than the range): a reload copies them into the window beside the rest,
// read from disk, so a unit too large to keep whole still keeps what the memory has room for.
struct Placement {
  std::vector<int> axes;
  int parts = 1;
  Location where = Location::host;
  int64_t resident = 0;
};
// Elements: the disk's 4 KiB alignment, so the on-disk rest of a window starts aligned.
inline constexpr int64_t kResidentGrain = 1024;

// Each kind of a unit's state has a placement of its own, so units may shard over different axes
// (experts over the ranks that hold the same experts, dense weights over dp_shard) and live in
// different places.
struct UnitPlacement {
  Placement params, grads, optimizer;
  const Placement& of(State k) const;
};

// Units whose gradients are placed over the same axes: the ranks of one group over those axes
// hold disjoint parts of them, which together are the whole (the gradient norm sums each class
// over its own group). With pipeline stages the pipe axis is one of them: each stage holds
// other units of the class.
struct GradClass {
  std::vector<int> axes, units;
};

// Bytes per category the rank holds for the whole run. snapshot: in-memory snapshots' shared
// memory; the plan builder leaves it 0 and train/ fills it in when the run takes snapshots.
// staging: the checkpoint copy of a rank that writes every kind of state it holds (the lowest
// rank always does).
struct StaticMemory {
  int64_t params = 0, grads = 0, optimizer = 0, snapshot = 0, staging = 0;
  int64_t total() const { return params + grads + optimizer + snapshot + staging; }
  MemSnapshot by_category() const;
};

struct Plan {
  PlanConfig config;
  std::vector<std::string> streams{"compute", "comm"};
  Mesh mesh;                   // (pp ×) dp_replicate (× ep) × dp_shard (× cp)
  // The step's schedule over the pipe (the one-stage schedule without pp), the pipeline stage of
  // each unit (0 without pp) and which of them this plan's rank holds (config.pipe_rank's).
  Schedule schedule;
  std::vector<int> stage_of_unit;
  bool holds(int u) const { return stage_of_unit.empty() || schedule.rank_of_stage[stage_of_unit[u]] == config.pipe_rank; }
  int shard_size = 1;          // ranks one unit is split over: |shard_axes()|
  model::FlatLayout layout;    // units padded to a multiple of 16 × shard_size
  StaticMemory static_memory;
  std::vector<BufferDesc> buffers;
  std::vector<Task> tasks;
  // Per unit: elements of each shard a partly kept unit keeps between forward and backward (0:
  // not partly kept).
  std::vector<int64_t> kept_elems;
  Repeat repeat;
  // --offload: per unit, the window buffer of each kind of state on disk, by State (params,
  // grads, exp_avg, exp_avg_sq); -1: that state is in memory (or not held). A window holds the
  // rank's part of the unit, padded to the disk's 4 KiB, from the task that loads it (a reload,
  // or for a step's first gradients the first task writing them, zero-filled) to the task that
  // frees it (its last user, or the write_back after it).
  std::vector<std::array<int, 4>> windows;
  int window(int state, int u) const { return windows.empty() ? -1 : windows[u][state]; }
  // --offload activations: bytes of the rank's activations file, one 4 KiB-aligned slot per
  // offloaded buffer (BufferDesc::disk_offset); 0: none offloaded.
  int64_t activation_file_bytes = 0;

  // Each unit's state placement (set_placement); a rank's buffer of one kind holds its range of
  // every unit that kind is held of, back to back in unit order.
  const std::vector<UnitPlacement>& placement() const { return placement_; }
  const Placement& placed(State k, int u) const { return placement_[u].of(k); }
  // Whether unit u's kind-k state is held and lives on disk; whether any unit's does.
  bool on_disk(State k, int u) const { return placed(k, u).parts > 0 && placed(k, u).where == Location::disk; }
  bool any_on_disk(State k) const;
  // Bytes unit u's kind-k state (one moment, for the optimizer) takes in its offload file (its
  // held part past the resident head) and in its window (all of its held part), each padded to the
  // disk's 4 KiB; 0 where it stays in memory.
  int64_t disk_slot_bytes(State k, int u) const;
  int64_t window_bytes(State k, int u) const;
  // Elements of unit u's kind-k part that live in memory: all of it, the resident head of a part
  // on disk, or none.
  int64_t ram_elems(State k, int u) const { return on_disk(k, u) ? placed(k, u).resident : held_elems(k, u); }
  // Bytes of this rank's offload files: each unit's part of each kind of state it keeps on disk,
  // padded to the disk's 4 KiB (the optimizer's two moments apart), and the activations file.
  int64_t disk_bytes() const;
  // Where unit u's saved activations (what its forward keeps for its backward) are between the
  // two: "disk" (some written to the activations file), "ram", or "-" (it keeps none).
  const char* activations_where(int u) const;
  // Checks every placement against the mesh and the layout (throws std::logic_error) and lays out
  // each kind's buffer.
  void set_placement(std::vector<UnitPlacement> placement);
  // Elements of unit u's kind-k state one rank holds, where they start in its buffer of that kind,
  // and that buffer's length.
  int64_t held_elems(State k, int u) const;
  int64_t held_offset(State k, int u) const { return held_offsets_[static_cast<int>(kind_of(k))][u]; }
  int64_t held_total(State k) const { return held_offsets_[static_cast<int>(kind_of(k))].back(); }
  // Which of unit u's `parts` ranges of kind k rank `rank` holds.
  int part_index(State k, int u, int rank) const { return mesh.index_in(rank, placed(k, u).axes); }
  // True when every unit holds kind k whole (a process's buffer is the whole flat layout).
  bool held_whole(State k) const;
  // The units holding gradients, by the axes their gradients are placed over, in unit order.
  std::vector<GradClass> grad_classes() const;

  // How many times task t runs in a step.
  int64_t runs(const Task& t) const { return t.micro == repeat.micro ? repeat.times : 1; }
  // The micro-step of the step that run `run` of task t belongs to.
  int64_t step_micro(const Task& t, int64_t run) const {
    if (repeat.micro < 0 || t.micro < repeat.micro) return t.micro;
    return t.micro == repeat.micro ? t.micro + run : t.micro + repeat.times - 1;
  }
  // What run `run` of task t waits for from its dependency `dep`: that many runs of `task`.
  struct Wait {
    int task;
    int64_t runs;
  };
  // `times`: the repeated micro-step's run count, where a walk takes it as other than repeat.times.
  Wait wait_for(const Task& t, int64_t run, int dep) const { return wait_for(t, run, dep, repeat.times); }
  Wait wait_for(const Task& t, int64_t run, int dep, int64_t times) const;

  // Highest bytes per category of the buffers when tasks run in plan order (compute and comm
  // interleaved as their dependencies allow the earliest), plus the static memory.
  MemSnapshot peak_memory() const;
  // Each category's own highest bytes over the same walk (they need not peak together).
  MemSnapshot max_memory() const;
  // True when `later` cannot start before `earlier` has finished in any execution: it depends
  // on it through deps and stream order (a task waits for the one before it on its stream).
  bool depends_on(int later, int earlier) const;
  std::string to_text(const model::ModelDesc& desc) const;
  // The mesh's role queries (Mesh::shard_axes ..) under this plan's strategy and sequence split:
  // the axes a unit's state is sharded over and those its shards are replicated over (ep and cp
  // shard with dp_shard under a sharding strategy, replicate with dp_replicate under DDP), and
  // the data-parallel axes (the ranks that read different batches), outermost first.
  std::vector<int> shard_axes() const;
  std::vector<int> replicate_axes() const;
  std::vector<int> dp_axes() const;
  // A rank's data-parallel coordinate (which batch it reads).
  int dp_index(int rank) const { return mesh.index_in(rank, dp_axes()); }
  int dp_size() const { return mesh.group_size(dp_axes()); }
  // The ranks whose gradients of a kind of parameter are summed (the data-parallel axes and,
  // where the plan splits sequences, cp; not ep for experts), and those the loss and the
  // squared gradients of the norm are summed over.
  std::vector<int> grad_axes(ParamKind kind = ParamKind::dense) const;
  std::vector<int> loss_axes() const;
  std::vector<int> norm_axes() const;
  // Ranks a sequence is split over in this plan's compute (1: whole sequences), this rank's place
  // among them, and the rows of each sequence it holds.
  int sequence_split() const { return config.split_sequence ? config.cp : 1; }
  int cp_index(int rank) const;
  int64_t local_seq() const { return config.seq / sequence_split(); }
  // The micro-batch as the model's costs see it on one rank of this plan (its units' buffers are
  // sized by it), with activations of `elem` bytes and the busiest expert at `expert_load`.
  model::Shape unit_shape(int elem, double expert_load = 1) const;
  // Unit u's own recompute mode (PlanConfig::recompute_of), and its shape carrying it (the costs
  // of an --act-quant unit depend on what it keeps).
  model::Recompute recompute_of(const model::ModelDesc& desc, int u) const;
  model::Shape unit_shape(const model::ModelDesc& desc, int u, int elem, double expert_load = 1) const;
  // Ranks unit u's compute is sliced over (its `sliced_over` axis: a MoE layer's experts over ep;
  // 1 where it has none), and the elements of the unit one rank computes with.
  int slices(const model::ModelDesc& desc, int u) const;
  int64_t compute_elems(const model::ModelDesc& desc, int u) const { return layout.units[u].padded / slices(desc, u); }

 private:
  std::vector<UnitPlacement> placement_;
  std::array<std::vector<int64_t>, kNumStateKinds> held_offsets_;  // per kind: U + 1 prefix sums
};

// One stream's task runs in order: each task once, the repeated ones (Plan::repeat) `times`
// times over (-1: repeat.times).
class StreamWalk {
 public:
  StreamWalk(const Plan& plan, int stream, int64_t times = -1);
  bool done() const { return i_ >= order_.size(); }
  int task() const { return order_[i_]; }
  int64_t run() const { return run_; }
  void next();

 private:
  std::vector<int> order_;
  size_t i_ = 0, first_ = 0, end_ = 0;  // [first_, end_): the repeated tasks
  int64_t run_ = 0, times_ = 1;
};

// The offload pass (plan/offload.cc): with config.offload set, places those kinds of every unit on
// disk (their resident bytes leave static_memory), gives each unit a window buffer per offloaded
// state, splits grad_norm and optimizer into one task per unit, and adds the copy stream's reload
// (before each use, up to `prefetch` using tasks ahead) and write_back (after a use that changed
// the state) tasks. A use within prefetch + 1 using tasks of the last keeps the window in memory.
// With config.offload.activations, each block's saved activations a forward keeps for the
// backward (not what a recompute rebuilds) are written back by the copy stream after the forward
// and freed, and reloaded (into the same buffer id) `prefetch` consumers ahead of the recompute or
// backward reading them first; the last prefetch + 1 blocks' stay in memory (their reload would
// come at once). offload.activation_units narrows this to the units chosen (the rank among
// consumers, hence which stay, is counted over every unit's). Their allocations and frees, like
// windows', follow the compute stream.
// Throws std::invalid_argument naming --offload for a plan it cannot offload yet.
void offload_pass(Plan& plan, const model::ModelDesc& desc);

// The optimizer overlap pass (plan/optimizer_overlap.cc): with config.pipeline_optimizer set,
// replaces the step's grad_norm and optimizer tasks by, per unit and as soon as the unit's gradients are final, its
// sum of squares and a speculative AdamW update (no clipping) on an "optimizer" stream, which
// first copies the unit's parameters and moments into a rollback buffer; an optimizer_commit task
// where the optimizer task was then keeps the updates (the norm did not clip, everything finite),
// redoes them from the copies with the clipped gradients, or restores the copies (a skipped step).
// Either way the step's result is bitwise the unpipelined one. With config.offload set only the
// sums of squares move (the updates stay after the norm, split per unit by the offload pass).
void optimizer_overlap_pass(Plan& plan, const model::ModelDesc& desc);

// The run-long state a task reads or writes in place (not through a per-task buffer).
struct StateTouch {
  State state;
  int unit;
  bool write;
};
std::vector<StateTouch> state_touches(const Plan& plan, const model::ModelDesc& desc, const Task& t);

// --memory-budget BYTES: "8GB" (10^9), "512MiB" (2^20), "4096" (bytes); K/M/G/T with B or iB.
// Throws std::invalid_argument naming --memory-budget for anything else or a value <= 0.
int64_t parse_memory_budget(const std::string& text);
// The same sizes for another flag (plan's --disk-per-rank), named in the error.
int64_t parse_bytes(const std::string& text, const std::string& flag);

// The placement pass (plan/budget.cc): build_plan's answer for a config with memory_budget set and
// no per-unit choice yet. Throws std::invalid_argument naming --memory-budget when even every
// unit's state and saved activations on disk do not fit (with the smallest peak reachable).
Plan place_for_budget(const model::ModelDesc& desc, PlanConfig config);

// Builds one rank's plan of a training step (or, with Mode::loss / logits, of a forward pass
// with the same state layout). With one rank every strategy becomes DDP's plan without
// collectives. Units borrowed by another (the tied head's embedding) stay gathered for the whole
// step under sharded strategies, as FSDP keeps its root unit. Throws std::invalid_argument naming
// the field of a bad configuration.
Plan build_plan(const model::ModelDesc& desc, const PlanConfig& config);
// The same configuration's mesh, flat layout, state placement and static memory, no tasks or
// buffers (the planner's bounds read them; cheaper than a plan by the tasks' count). Throws as
// build_plan does for a configuration it refuses before laying out tasks.
Plan plan_frame(const model::ModelDesc& desc, const PlanConfig& config);
// The mesh build_plan lays the configuration's ranks on, without a model: what a run's settings
// say before its model is read (the data-parallel size a resume compares). Throws
// std::invalid_argument as build_plan does for sizes that do not divide the ranks.
Mesh plan_mesh(const PlanConfig& config);
// Which rank of its pipe `rank` is (the stage plan it runs; 0 without pp).
int pipe_rank_of(const PlanConfig& config, int rank);

}  // namespace shardlm::plan
