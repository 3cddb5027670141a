// The planner: enumerates plan configurations for a model, a rank count and a global batch,
// builds each plan (one worker thread per core), simulates those whose per-rank peak memory fits
// the budget and ranks them by predicted step time. Configurations above one that does not fit
// in memory (a larger micro-batch, less recompute, ... : Lattice in planner.cc) are pruned
// unbuilt. bf16 gathers and reductions are tried on bf16
// (GPU) profiles only. For a mixture-of-experts model the expert-parallel size (ep) is searched
// too: each divisor of the experts that divides the ranks. Activation compression where
// PlanQuery::act_quant asks for it.
// Configurations whose plan cannot be built are skipped. The fastest few that recompute are then
// refined by rebuilding fewer blocks (recompute_fewer), and the fastest few sharded ones by
// selective unsharding (keep_greedily). Every configuration is first bounded from its
// frame alone (sim/bounds.h): one whose memory bound does not fit is never built, and with
// PlanQuery::top (branch and bound on step time) neither is one whose step bound is above the top.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "plan/plan.h"
#include "sim/hardware.h"
#include "sim/simulator.h"

namespace shardlm::sim {

struct PlanQuery {
  int ranks = 1;
  int64_t global_tokens = 0;  // tokens per optimizer step over all ranks (ranks × B × accum × T)
  int64_t seq = 256;
  int64_t memory_budget = 0;  // bytes per rank; 0: no limit
  int threads = 1;
  double expert_load = 1;  // the busiest expert's routed rows over the mean (simulate)
  // Build every configuration, pruning none by memory or bound (tests: the pruned search finds the same).
  bool exhaustive = false;
  // > 0: only the `top` fastest distinct predictions (and the configurations keep_greedily
  // refines) need be found: configurations whose step bound (StepBounds::step_ms) is above them
  // are bounded, never built. PlanSearch::fitting then holds every configuration at least as fast
  // as the top-th, with their `alike` counts, and perhaps some slower. 0: every one that fits.
  int top = 0;
  // Context parallelism beside cp 1 (every cp, both forms); false: only where nothing fits at cp 1.
  bool context_always = false;
  // On: every configuration is searched twice, with fp32 activations and with these compressed
  // (--act-quant int8). Compression changes the gradients a little (BENCHMARKS.md), so the search
  // tries it only where asked; it buys memory (less recompute, larger micro-batches) for the
  // quantize and dequantize passes. Off: fp32 only (PlanConfig::act_quant of `base` is not read).
  model::ActQuant act_quant{};
  // Bytes per rank the disk tier may hold (its offload files, Plan::disk_bytes); 0: no disk tier.
  // Where nothing fits memory_budget in memory, the configurations the disk tier runs (fsdp, or
  // one process; no gradient accumulation) are searched with memory_budget as their
  // --memory-budget: the placement pass moves state and saved activations to disk until they fit.
  // The profile must price the disk (disk_read_bw).
  int64_t disk_budget = 0;
};

struct Candidate {
  plan::PlanConfig config;
  double step_ms = 0, tokens_per_s = 0, mfu = 0, comm_exposed_ms = 0;
  int64_t peak_bytes = 0;
  std::string flags;  // the train / simulate flags that reproduce it
  int64_t disk_bytes = 0;  // its offload files (the disk tier; PlanQuery::disk_budget)
  // Other fitting configurations predicted exactly alike (step time and memory): knobs that change
  // nothing here (e.g. gathers in flight where none wait). This one is the first of them found.
  int64_t alike = 0;
};

struct PlanSearch {
  // By step time, fastest first (then least memory), one per prediction: configurations predicted
  // exactly alike are counted in the first's `alike`.
  std::vector<Candidate> fitting;
  int64_t fit = 0;                  // configurations that fit, alike ones included
  // The grid's configurations (every combination of the knobs searched), and of them: pruned
  // (its memory bound above the budget, or above one that does not fit: never built), refused by
  // the plan builder (or its frame), built, and simulated (built and fitting).
  int64_t considered = 0, pruned = 0, invalid = 0, built = 0, simulated = 0;
  int64_t bounded = 0;              // of `considered`, those whose step bound is above the top (PlanQuery::top)
  int64_t refined = 0;              // of `fitting`, those the unit-by-unit keep-gathered pass added
  int64_t fewer_rebuilt = 0;        // of `fitting`, those recompute_fewer added
  int64_t on_disk = 0;              // of `considered`, those searched with the disk tier (PlanQuery::disk_budget)
  // The least memory of all built (to say by how much nothing fits: then every configuration not
  // above one that does not fit is built, bounds or not).
  Candidate smallest;
};

// The most sequences per rank a global batch may hold: the search tries every micro-batch that
// divides them, so its time grows with them.
inline constexpr int64_t kMaxSequencesPerRank = 1 << 20;
// The planner tries recompute_fewer on those that recompute among this many fastest distinct
// predictions (a bounded search finds at least these exactly).
inline constexpr int kFewerRebuiltRows = 3;
// The largest cp the search tries (where nothing fits without it).
inline constexpr int kMaxContextSearch = 64;

// `base` carries what the search does not vary (reduction_scratch, threads). Throws
// std::invalid_argument when the global batch is not a whole number of sequences per rank, or
// more than kMaxSequencesPerRank of them.
PlanSearch search_plans(const model::ModelDesc& desc, const plan::PlanConfig& base, const HardwareProfile& hw,
                        const PlanQuery& q);

std::string flags_of(const plan::PlanConfig& c);

// The deepest model of `model`'s shape (its n_layer varied; width, heads, vocabulary kept) for
// which search_plans finds a configuration fitting q's memory budget (and, with q.disk_budget, the
// disk tier's), with that search's fastest configuration. Doubling from the model's own depth up
// to the depth whose parameters and moments alone (12 bytes each) fill every rank's memory and
// disk budgets, then bisection: O(log L) searches, assuming (as the memory does) that a deeper
// model needs no less. n_layer 0: not even one layer fits. Throws std::invalid_argument without a
// memory budget.
struct LargestFit {
  int64_t n_layer = 0, params = 0;
  bool capped = false;  // kMaxLargestLayers fits: the true answer is at least that
  Candidate best;
};
inline constexpr int64_t kMaxLargestLayers = 1 << 14;
LargestFit largest_model(const model::ModelConfig& model, const plan::PlanConfig& base, const HardwareProfile& hw,
                         const PlanQuery& q);

// Selective unsharding of `start` (fsdp / hybrid): each unit's saving of step time per byte of
// peak memory is measured alone; then, best first, a unit stays gathered when that still makes
// the step faster and the peak fits q.memory_budget (one pass in that order). A unit whose whole
// does not fit is split finer: the largest part of it, in eighths, that fits is kept (NAME:0.375)
// instead. The result is no slower than `start` and fits.
Candidate keep_greedily(const model::ModelDesc& desc, const HardwareProfile& hw, const PlanQuery& q, Candidate start);

// Fewer blocks rebuilt: for a `start` that recomputes (on all its blocks, or on N), the fewest
// blocks (--recompute-blocks) with which the plan still fits q.memory_budget, found by bisection
// (the activation peak falls with every block rebuilt). Returned where it is faster, else `start`.
Candidate recompute_fewer(const model::ModelDesc& desc, const HardwareProfile& hw, const PlanQuery& q, Candidate start);

// One configuration's simulation as the search sees it: the plan's simulation (whose cost does
// not grow with the accumulation: Plan::repeat), without its per-task times. Throws
// std::invalid_argument as build_plan does.
SimResult simulate_config(const model::ModelDesc& desc, const plan::PlanConfig& c, const HardwareProfile& hw,
                          int threads, double expert_load = 1);

// --offload-prefetch auto: of the disk tier's read-ahead depths 0 .. kMaxOffloadPrefetch, the one
// the simulator predicts fastest on hw for `config` (each depth placed anew under its
// --memory-budget: a deeper read-ahead keeps more windows in memory, so a budget moves more to
// disk); the shallowest of equal ones. step_ms[d]: the prediction at depth d, or -1 where the plan
// is refused (the budget does not fit at that depth). Throws the shallowest depth's refusal when
// every depth is refused.
inline constexpr int kMaxOffloadPrefetch = 4;
struct PrefetchChoice {
  int depth = 0;
  std::vector<double> step_ms;
};
PrefetchChoice choose_offload_prefetch(const model::ModelDesc& desc, plan::PlanConfig config, const HardwareProfile& hw,
                                       int threads, double expert_load = 1);

}  // namespace shardlm::sim
