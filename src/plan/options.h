// The plan's options, each declared once (plan_options()): the flag (also the TOML key, with '-'
// or '_'), its --help group and text, the setting it fills, the check of its value, how it goes
// into a PlanConfig and back, whether every rank must agree on it, and the words `plan` prints
// to reproduce it. The command line registers its flags by walking the table (cli/), the train
// config holds the settings (train::TrainConfig derives from PlanOptions), the trainer builds its
// PlanConfig, the ranks compare and the planner prints its configurations from the same entries.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "plan/plan.h"

namespace shardlm::plan {

inline constexpr int kOffloadPrefetchAuto = -1;  // --offload-prefetch auto

// The plan's settings as a user gives them: flags and TOML keys, before they are parsed into a
// PlanConfig (to_plan_config) for a world of ranks.
struct PlanOptions {
  int64_t batch = 4;  // B sequences per micro-step
  int64_t seq = 256;  // T
  int64_t grad_accum = 1;
  int threads = 2;
  std::string strategy = "fsdp";  // ddp | zero1 | zero2 | fsdp | hybrid
  int shard_group = 0;            // hybrid: ranks per shard group (0: a machine's, once start-up has found the machines)
  int ep = 1;                     // expert parallel: ranks an expert group spans (E / ep experts each)
  int cp = 1;                     // context parallel: ranks each sequence is split over
  std::string cp_impl = "ring";   // ring | all-to-all
  int pp = 1;                         // pipeline parallel: stages the blocks are split into
  std::string pp_schedule = "1f1b";   // gpipe | 1f1b | interleaved-1f1b
  int pp_virtual = 1;                 // stages a rank holds (interleaved-1f1b)
  std::string pp_layers;              // blocks per stage, comma-separated (empty: balanced by cost)
  int prefetch_forward = 1, prefetch_backward = 1;
  int max_gathers_in_flight = 2;
  double bucket_mb = 25;
  std::string keep_gathered = "none";  // all | none | unit names, comma-separated (h.10,final_norm,h.9:0.5)
  double gather_bucket_mb = 0;         // fsdp / hybrid all-gather buckets (0: off)
  // The disk tier: kinds of state kept in files (none | any of params,grads,optimizer), where
  // (empty: OUT/offload), and how many using tasks ahead the copy stream reads
  // (kOffloadPrefetchAuto: the depth a simulation on a hardware profile predicts fastest, which the
  // cli resolves before the plan is built).
  std::string offload = "none";
  // --memory-budget: per-rank bytes ("8GB", "512MiB", "4096") the plan's accounted peak must stay
  // within; the placement pass puts units' params, grads and optimizer state on disk until it
  // does (activations stay in memory). Empty: no budget.
  std::string memory_budget;
  std::string offload_dir;
  int offload_prefetch = 2;
  // AdamW per unit as soon as its gradients are final, speculatively (plan/optimizer_overlap.cc).
  bool pipeline_optimizer = false;
  bool reduce_each_micro_step = false;  // PlanConfig::reduce_each_micro_step
  std::string param_dtype = "fp32", reduce_dtype = "fp32";
  std::string recompute = "none";  // none | selective | full
  int recompute_blocks = -1;       // how many blocks `recompute` applies to, spread evenly; -1: all
  // Activation compression (model::ActQuant): none | int8, values per scale, nearest | stochastic.
  std::string act_quant = "none";
  int64_t act_quant_group = 64;
  std::string act_quant_rounding = "nearest";
  bool async_save = false;  // stage each rank's shard and write it in a background thread
};

// What the command line checks before the value is stored (the rest is `check`'s, after).
enum class FlagCheck {
  none,
  not_empty,      // an empty value is refused, with `why`
  depth_or_auto,  // "auto" (kOffloadPrefetchAuto) or a depth in [0, kMaxOffloadPrefetchDepth]
};

struct PlanOption {
  using Field = std::variant<int PlanOptions::*, int64_t PlanOptions::*, double PlanOptions::*, std::string PlanOptions::*,
                             bool PlanOptions::*>;
  const char* flag;  // without "--"
  const char* group;
  std::string help;
  Field field;
  bool show_default = true;  // --help shows the default value
  FlagCheck flag_check = FlagCheck::none;
  const char* why = "";  // FlagCheck::not_empty's reason
  // Throws std::invalid_argument, one line naming the flag, for a value out of range (the
  // checks that need other settings too are train::TrainConfig::validate's).
  void (*check)(const PlanOptions&) = nullptr;
  // Into a PlanConfig (throws naming the flag for a value that does not parse), and back for a
  // configuration the planner chose (nullptr: the planner does not choose it).
  void (*to_plan)(const PlanOptions&, PlanConfig&) = nullptr;
  void (*from_plan)(const PlanConfig&, PlanOptions&) = nullptr;
  bool ranks_agree = true;  // compared across ranks at start-up (train::check_ranks_agree)
  // The words of `plan`'s line that reproduces a configuration (" --flag value", or nothing where
  // it does not apply), and where among them: printed by increasing `reproduce_at` (0: never).
  int reproduce_at = 0;
  void (*reproduce)(const PlanConfig&, std::ostream&) = nullptr;
};

// Every plan option, in the order --help lists them.
const std::vector<PlanOption>& plan_options();

// The value as the ranks compare it: numbers as fmt prints them, switches "on" / "off".
std::string option_text(const PlanOption& o, const PlanOptions& v);

// Every option's check, in the table's order.
void check_plan_options(const PlanOptions& v);

// Every option's to_plan onto `c` (world, threads-independent settings and the backend's scratch
// are the caller's).
void apply_plan_options(const PlanOptions& v, PlanConfig& c);

// Every option the planner chooses, from its configuration `c` into `v`.
void take_plan_options(const PlanConfig& c, PlanOptions& v);

// The flags that reproduce `c` ("--strategy fsdp --batch 4 ..."), as `plan` prints them.
std::string reproduce_flags(const PlanConfig& c);

}  // namespace shardlm::plan
