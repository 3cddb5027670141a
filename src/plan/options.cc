#include "plan/options.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace shardlm::plan {

namespace {

// One line naming the flag (also the TOML key) and the value refused; `!(v >= lo)` also
// refuses NaN.
template <class T>
void at_least(T v, T lo, const char* flag) {
  if (!(v >= lo)) throw std::invalid_argument(fmt::format("--{}: must be >= {}, got {}", flag, lo, v));
}

void positive(double v, const char* flag) {
  if (!(v > 0)) throw std::invalid_argument(fmt::format("--{}: must be > 0, got {}", flag, v));
}

// Infinity passes every lower bound above; no setting here means anything at infinity.
void finite(double v, const char* flag) {
  if (!std::isfinite(v)) throw std::invalid_argument(fmt::format("--{}: must be finite, got {}", flag, v));
}

void wire_dtype(const std::string& dt, const char* flag) {
  if (dt != "fp32" && dt != "bf16") throw std::invalid_argument(fmt::format("--{}: must be fp32 or bf16, got '{}'", flag, dt));
}

bool gathers(const PlanConfig& c) { return c.strategy == Strategy::fsdp || c.strategy == Strategy::hybrid; }

// The names of a comma list, empty ones dropped.
std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> out;
  std::string rest = text;
  for (size_t at; !rest.empty(); rest = at == std::string::npos ? "" : rest.substr(at + 1)) {
    at = rest.find(',');
    if (const std::string name = rest.substr(0, at); !name.empty()) out.push_back(name);
  }
  return out;
}

std::string keep_list(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ",") + n;
  return s.empty() ? "none" : s;
}

// params,grads,optimizer,activations in any subset.
// --pp-layers "4,4,3,5": each stage's block count (empty: none given).
std::vector<int> block_counts(const std::string& text) {
  std::vector<int> out;
  for (const std::string& n : comma_list(text)) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != n.size() || n.empty())
      throw std::invalid_argument("pp-layers (--pp-layers): '" + n + "' is not a block count (e.g. 4,4,3,5)");
    out.push_back(v);
  }
  return out;
}

void apply_offload(const std::string& kinds, OffloadConfig& o) {
  for (std::string rest = kinds; !rest.empty();) {
    const size_t at = rest.find(',');
    const std::string kind = rest.substr(0, at);
    rest = at == std::string::npos ? "" : rest.substr(at + 1);
    if (kind == "params") o.kinds[static_cast<int>(State::params)] = true;
    else if (kind == "grads") o.kinds[static_cast<int>(State::grads)] = true;
    else if (kind == "optimizer") o.kinds[static_cast<int>(State::optimizer)] = true;
    else if (kind == "activations") o.activations = true;
    else throw std::invalid_argument("--offload: unknown kind '" + kind + "' (none, or any of params,grads,optimizer,activations)");
  }
}

std::vector<PlanOption> make_table() {
  using O = PlanOptions;
  using C = PlanConfig;
  using S = std::ostream;
  std::vector<PlanOption> t;
  auto add = [&t](PlanOption o) -> PlanOption& { return t.emplace_back(std::move(o)); };

  // Schedule
  add({"batch", "Schedule", "sequences per micro-step", &O::batch}).to_plan = [](const O& v, C& c) { c.batch = v.batch; };
  t.back().from_plan = [](const C& c, O& v) { v.batch = c.batch; };
  t.back().reproduce_at = 6, t.back().reproduce = [](const C& c, S& o) { o << " --batch " << c.batch; };
  add({"seq", "Schedule", "sequence length T", &O::seq}).to_plan = [](const O& v, C& c) { c.seq = v.seq; };
  t.back().from_plan = [](const C& c, O& v) { v.seq = c.seq; };
  t.back().reproduce_at = 8, t.back().reproduce = [](const C& c, S& o) { o << " --seq " << c.seq; };
  add({"grad-accum", "Schedule", "micro-steps per optimizer step", &O::grad_accum}).to_plan = [](const O& v, C& c) {
    c.grad_accum = v.grad_accum;
  };
  t.back().from_plan = [](const C& c, O& v) { v.grad_accum = c.grad_accum; };
  t.back().reproduce_at = 7, t.back().reproduce = [](const C& c, S& o) { o << " --grad-accum " << c.grad_accum; };

  // Parallelism
  add({"threads", "Parallelism", "compute threads (default: OMP_NUM_THREADS where set, else 2)", &O::threads}).to_plan =
      [](const O& v, C& c) { c.threads = v.threads; };
  t.back().ranks_agree = false;  // the process's own (its cores)
  add({"strategy", "Parallelism", "ddp | zero1 | zero2 | fsdp | hybrid", &O::strategy}).to_plan = [](const O& v, C& c) {
    c.strategy = parse_strategy(v.strategy);
  };
  t.back().from_plan = [](const C& c, O& v) { v.strategy = to_string(c.strategy); };
  t.back().reproduce_at = 1, t.back().reproduce = [](const C& c, S& o) { o << " --strategy " << to_string(c.strategy); };
  add({"shard-group", "Parallelism",
       "hybrid: consecutive ranks that shard (default: train, a machine's ranks; simulate, a node's devices; explain, all)",
       &O::shard_group})
      .check = [](const O& v) { at_least(v.shard_group, 0, "shard-group"); };
  t.back().to_plan = [](const O& v, C& c) { c.shard_group = v.shard_group; };
  t.back().from_plan = [](const C& c, O& v) { v.shard_group = c.shard_group; };
  t.back().reproduce_at = 2, t.back().reproduce = [](const C& c, S& o) {
    if (c.strategy == Strategy::hybrid) o << " --shard-group " << c.shard_group;
  };
  add({"ep", "Parallelism",
       "expert parallel: ranks of an expert group, each running E / ep experts (divides E and the data-parallel ranks)", &O::ep})
      .check = [](const O& v) { at_least(v.ep, 1, "ep"); };
  t.back().to_plan = [](const O& v, C& c) { c.ep = v.ep; };
  t.back().from_plan = [](const C& c, O& v) { v.ep = c.ep; };
  t.back().reproduce_at = 3, t.back().reproduce = [](const C& c, S& o) {
    if (c.ep > 1) o << " --ep " << c.ep;
  };
  add({"cp", "Parallelism", "context parallel: ranks each sequence is split over (divides the ranks)", &O::cp}).check =
      [](const O& v) { at_least(v.cp, 1, "cp"); };
  t.back().to_plan = [](const O& v, C& c) { c.cp = v.cp; };
  t.back().from_plan = [](const C& c, O& v) { v.cp = c.cp; };
  t.back().reproduce_at = 4, t.back().reproduce = [](const C& c, S& o) {
    if (c.cp > 1) o << " --cp " << c.cp;
  };
  add({"cp-impl", "Parallelism", "context parallel attention: ring | all-to-all (heads split over cp)", &O::cp_impl}).check =
      [](const O& v) { model::parse_context_impl(v.cp_impl); };
  t.back().to_plan = [](const O& v, C& c) { c.cp_impl = model::parse_context_impl(v.cp_impl); };
  t.back().from_plan = [](const C& c, O& v) { v.cp_impl = model::to_string(c.cp_impl); };
  t.back().reproduce_at = 5, t.back().reproduce = [](const C& c, S& o) {
    if (c.cp > 1) o << " --cp-impl " << model::to_string(c.cp_impl);
  };
  // The planner does not choose pipeline stages yet (`plan` refuses --pp): nothing to reproduce.
  add({"pp", "Parallelism",
       "pipeline parallel: stages the blocks are split into, pp ranks apart (divides the ranks); --grad-accum "
       "micro-batches flow through them",
       &O::pp})
      .check = [](const O& v) { at_least(v.pp, 1, "pp"); };
  t.back().to_plan = [](const O& v, C& c) { c.pp = v.pp; };
  add({"pp-schedule", "Parallelism", "pipeline schedule: gpipe | 1f1b | interleaved-1f1b", &O::pp_schedule});
  t.back().to_plan = [](const O& v, C& c) { c.pp_schedule = v.pp_schedule; };  // the plan builder checks the name
  add({"pp-virtual", "Parallelism", "pipeline stages each rank holds (interleaved-1f1b)", &O::pp_virtual}).check =
      [](const O& v) { at_least(v.pp_virtual, 1, "pp-virtual"); };
  t.back().to_plan = [](const O& v, C& c) { c.pp_virtual = v.pp_virtual; };
  add({"pp-layers", "Parallelism", "blocks of each pipeline stage, comma-separated (default: balanced by their compute)",
       &O::pp_layers});
  t.back().show_default = false;
  t.back().to_plan = [](const O& v, C& c) { c.pp_layers = block_counts(v.pp_layers); };
  add({"prefetch-forward", "Parallelism", "all-gathers issued ahead in the forward", &O::prefetch_forward}).check =
      [](const O& v) { at_least(v.prefetch_forward, 0, "prefetch-forward"); };
  t.back().to_plan = [](const O& v, C& c) { c.prefetch_forward = v.prefetch_forward; };
  t.back().from_plan = [](const C& c, O& v) { v.prefetch_forward = c.prefetch_forward; };
  t.back().reproduce_at = 15, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --prefetch-forward " << c.prefetch_forward;
  };
  add({"prefetch-backward", "Parallelism", "all-gathers issued ahead in the backward", &O::prefetch_backward}).check =
      [](const O& v) { at_least(v.prefetch_backward, 0, "prefetch-backward"); };
  t.back().to_plan = [](const O& v, C& c) { c.prefetch_backward = v.prefetch_backward; };
  t.back().from_plan = [](const C& c, O& v) { v.prefetch_backward = c.prefetch_backward; };
  t.back().reproduce_at = 16, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --prefetch-backward " << c.prefetch_backward;
  };
  add({"max-gathers-in-flight", "Parallelism", "gathered units alive at once", &O::max_gathers_in_flight}).check =
      [](const O& v) { at_least(v.max_gathers_in_flight, 1, "max-gathers-in-flight"); };
  t.back().to_plan = [](const O& v, C& c) { c.max_gathers_in_flight = v.max_gathers_in_flight; };
  t.back().from_plan = [](const C& c, O& v) { v.max_gathers_in_flight = c.max_gathers_in_flight; };
  t.back().reproduce_at = 17, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --max-gathers-in-flight " << c.max_gathers_in_flight;
  };
  add({"bucket-mb", "Parallelism", "DDP / ZeRO-1 gradient bucket size", &O::bucket_mb}).check = [](const O& v) {
    positive(v.bucket_mb, "bucket-mb");
    finite(v.bucket_mb, "bucket-mb");
  };
  t.back().to_plan = [](const O& v, C& c) { c.bucket_mb = v.bucket_mb; };
  t.back().from_plan = [](const C& c, O& v) { v.bucket_mb = c.bucket_mb; };
  t.back().reproduce_at = 21, t.back().reproduce = [](const C& c, S& o) {
    if (c.strategy == Strategy::ddp || c.strategy == Strategy::zero1) o << " --bucket-mb " << c.bucket_mb;
  };
  add({"keep-gathered", "Parallelism",
       "fsdp / hybrid: units kept gathered through the step: all | none | names (h.10,final_norm); "
       "NAME:FRACTION keeps that part of a unit from its forward to its backward (h.9:0.5)",
       &O::keep_gathered})
      .to_plan = [](const O& v, C& c) {  // build_plan checks the names
    if (v.keep_gathered != "none") c.keep_gathered = comma_list(v.keep_gathered);
  };
  t.back().from_plan = [](const C& c, O& v) { v.keep_gathered = keep_list(c.keep_gathered); };
  t.back().reproduce_at = 19, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --keep-gathered " << keep_list(c.keep_gathered);
  };
  add({"gather-bucket-mb", "Parallelism", "fsdp / hybrid: consecutive units gathered by one all-gather up to this many MiB (0: off)",
       &O::gather_bucket_mb})
      .check = [](const O& v) {
    at_least(v.gather_bucket_mb, 0.0, "gather-bucket-mb");
    finite(v.gather_bucket_mb, "gather-bucket-mb");
  };
  t.back().to_plan = [](const O& v, C& c) { c.gather_bucket_mb = v.gather_bucket_mb; };
  t.back().from_plan = [](const C& c, O& v) { v.gather_bucket_mb = c.gather_bucket_mb; };
  t.back().reproduce_at = 20, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --gather-bucket-mb " << c.gather_bucket_mb;
  };

  // Memory
  add({"offload", "Memory", "state kept on disk instead of memory: none | any of params,grads,optimizer,activations (comma-separated)",
       &O::offload, true, FlagCheck::not_empty, "none for nothing offloaded"})
      .check = [](const O& v) {
    if (v.offload.empty())
      throw std::invalid_argument("--offload: is an empty string (none, or any of params,grads,optimizer,activations)");
  };
  t.back().to_plan = [](const O& v, C& c) {
    if (v.offload != "none") apply_offload(v.offload, c.offload);
  };
  add({"memory-budget", "Memory",
       "per-rank bytes (8GB, 512MiB, 4096) the plan's peak must fit: units' optimizer state, then "
       "grads, then blocks' saved activations (first forward first), then params go to disk, largest first, until it does; "
       "what that leaves keeps the last moved whole or in part",
       &O::memory_budget, false, FlagCheck::not_empty, "omit the flag for no budget"})
      .check = [](const O& v) {
    if (!v.memory_budget.empty()) parse_memory_budget(v.memory_budget);  // throws naming --memory-budget
  };
  t.back().to_plan = [](const O& v, C& c) {
    if (!v.memory_budget.empty()) c.memory_budget = parse_memory_budget(v.memory_budget);
  };
  t.back().from_plan = [](const C& c, O& v) {
    if (c.memory_budget > 0) v.memory_budget = std::to_string(c.memory_budget);
  };
  t.back().reproduce_at = 23, t.back().reproduce = [](const C& c, S& o) {
    if (c.memory_budget > 0) o << " --memory-budget " << c.memory_budget;
  };
  add({"offload-dir", "Memory", "where offloaded state's scratch files go (default: OUT/offload)", &O::offload_dir, false})
      .ranks_agree = false;  // a node's own disk may be mounted elsewhere
  add({"offload-prefetch", "Memory",
       "offloaded units read ahead of the task using them (0-" + std::to_string(kMaxOffloadPrefetchDepth) +
           "), or auto: the depth (0-4) the simulator predicts fastest on --hardware (train, simulate)",
       &O::offload_prefetch, true, FlagCheck::depth_or_auto})
      .check = [](const O& v) {
    if (v.offload_prefetch != kOffloadPrefetchAuto && (v.offload_prefetch < 0 || v.offload_prefetch > kMaxOffloadPrefetchDepth))
      throw std::invalid_argument(
          fmt::format("--offload-prefetch: must be in [0, {}] or auto, got {}", kMaxOffloadPrefetchDepth, v.offload_prefetch));
  };
  t.back().to_plan = [](const O& v, C& c) {
    if (v.offload_prefetch == kOffloadPrefetchAuto)
      throw std::invalid_argument("--offload-prefetch auto: the depth is chosen by simulating the plan on a hardware profile "
                                  "(--hardware); here give a number");
    c.offload.prefetch = v.offload_prefetch;
  };
  t.back().reproduce_at = 24, t.back().reproduce = [](const C& c, S& o) {
    if (c.memory_budget > 0) o << " --offload-prefetch " << c.offload.prefetch;
  };
  add({"pipeline-optimizer", "Memory",
       "each unit's AdamW runs as soon as its gradients are final, during the backward; the step stays "
       "bitwise the same (a copy of the unit's params and moments, 3x its optimizer shard, restores it when "
       "the norm clips or the step is skipped)",
       &O::pipeline_optimizer, false})
      .to_plan = [](const O& v, C& c) { c.pipeline_optimizer = v.pipeline_optimizer; };
  add({"reduce-each-micro-step", "Parallelism",
       "zero2 / fsdp / hybrid with --grad-accum > 1: reduce-scatter every micro-step's gradients and add "
       "the shard to the held one (PyTorch FSDP's and DeepSpeed ZeRO's default), so whole gradients live "
       "one micro-step; default: accumulate them whole and reduce once a step",
       &O::reduce_each_micro_step, false})
      .to_plan = [](const O& v, C& c) { c.reduce_each_micro_step = v.reduce_each_micro_step; };
  t.back().from_plan = [](const C& c, O& v) { v.reduce_each_micro_step = c.reduce_each_micro_step; };
  t.back().reproduce_at = 14, t.back().reproduce = [](const C& c, S& o) {
    if (c.reduce_each_micro_step) o << " --reduce-each-micro-step";
  };
  add({"param-dtype", "Parallelism", "gathered parameters: fp32 | bf16", &O::param_dtype}).check = [](const O& v) {
    wire_dtype(v.param_dtype, "param-dtype");
  };
  t.back().to_plan = [](const O& v, C& c) { c.param_bytes = v.param_dtype == "bf16" ? 2 : 4; };
  t.back().from_plan = [](const C& c, O& v) { v.param_dtype = c.param_bytes == 2 ? "bf16" : "fp32"; };
  t.back().reproduce_at = 18, t.back().reproduce = [](const C& c, S& o) {
    if (gathers(c)) o << " --param-dtype " << (c.param_bytes == 2 ? "bf16" : "fp32");
  };
  add({"reduce-dtype", "Parallelism", "gradient reduction: fp32 | bf16", &O::reduce_dtype}).check = [](const O& v) {
    wire_dtype(v.reduce_dtype, "reduce-dtype");
  };
  t.back().to_plan = [](const O& v, C& c) { c.reduce_bytes = v.reduce_dtype == "bf16" ? 2 : 4; };
  t.back().from_plan = [](const C& c, O& v) { v.reduce_dtype = c.reduce_bytes == 2 ? "bf16" : "fp32"; };
  t.back().reproduce_at = 22, t.back().reproduce = [](const C& c, S& o) {
    if (c.strategy != Strategy::ddp || c.world > 1) o << " --reduce-dtype " << (c.reduce_bytes == 2 ? "bf16" : "fp32");
  };
  add({"recompute", "Memory",
       "activation recompute: none | selective | full | selective-op (torchtitan's op policy: LLaMA blocks keep attention "
       "and every other GEMM's output)",
       &O::recompute})
      .check = [](const O& v) { model::parse_recompute(v.recompute); };
  t.back().to_plan = [](const O& v, C& c) { c.recompute = model::parse_recompute(v.recompute); };
  t.back().from_plan = [](const C& c, O& v) { v.recompute = model::to_string(c.recompute); };
  t.back().reproduce_at = 9, t.back().reproduce = [](const C& c, S& o) { o << " --recompute " << model::to_string(c.recompute); };
  add({"recompute-blocks", "Memory",
       "apply --recompute to only N of the n_layer blocks, spread evenly (n_layer / k: every k-th "
       "block); the others keep all they save. Default: every block",
       &O::recompute_blocks, false})
      .check = [](const O& v) {
    if (v.recompute_blocks < -1)
      throw std::invalid_argument("recompute_blocks (--recompute-blocks): must be >= 0, got " + std::to_string(v.recompute_blocks));
  };
  t.back().to_plan = [](const O& v, C& c) { c.recompute_blocks = v.recompute_blocks; };
  t.back().from_plan = [](const C& c, O& v) { v.recompute_blocks = c.recompute_blocks; };
  t.back().reproduce_at = 10, t.back().reproduce = [](const C& c, S& o) {
    if (c.recompute_blocks >= 0 && c.recompute != model::Recompute::none) o << " --recompute-blocks " << c.recompute_blocks;
  };
  add({"act-quant", "Memory",
       "activation compression: none | int8 (the GEMM inputs kept for the backward as int8 with a "
       "fp32 scale per group; what recompute rebuilds is not stored)",
       &O::act_quant})
      .check = [](const O& v) {
    if (v.act_quant != "none" && v.act_quant != "int8")
      throw std::invalid_argument("act_quant (--act-quant): unknown '" + v.act_quant + "' (expected none or int8)");
  };
  // The three act-quant settings make one model::ActQuant.
  t.back().to_plan = [](const O& v, C& c) {
    if (v.act_quant == "int8") c.act_quant = {v.act_quant_group, v.act_quant_rounding == "stochastic"};
  };
  t.back().from_plan = [](const C& c, O& v) { v.act_quant = model::to_string_act_quant(c.act_quant); };
  t.back().reproduce_at = 11, t.back().reproduce = [](const C& c, S& o) {
    if (c.act_quant.on()) o << " --act-quant int8";
  };
  add({"act-quant-group", "Memory",
       "--act-quant: values per scale along the feature axis (divides n_embd, ffn_dim or moe_ffn_dim, the q|k|v row)",
       &O::act_quant_group})
      .check = [](const O& v) {
    if (v.act_quant_group <= 0 || v.act_quant_group > (int64_t{1} << 20))
      throw std::invalid_argument("act_quant_group (--act-quant-group): must be in [1, 1048576], got " +
                                  std::to_string(v.act_quant_group));
  };
  t.back().from_plan = [](const C& c, O& v) {
    if (c.act_quant.on()) v.act_quant_group = c.act_quant.group;
  };
  t.back().reproduce_at = 12, t.back().reproduce = [](const C& c, S& o) {
    if (c.act_quant.on()) o << " --act-quant-group " << c.act_quant.group;
  };
  add({"act-quant-rounding", "Memory", "with --act-quant: nearest | stochastic (unbiased; keyed by seed, step, tensor, element)",
       &O::act_quant_rounding})
      .check = [](const O& v) {
    if (v.act_quant_rounding != "nearest" && v.act_quant_rounding != "stochastic")
      throw std::invalid_argument("act_quant_rounding (--act-quant-rounding): unknown '" + v.act_quant_rounding +
                                  "' (expected nearest or stochastic)");
  };
  t.back().from_plan = [](const C& c, O& v) { v.act_quant_rounding = c.act_quant.stochastic ? "stochastic" : "nearest"; };
  t.back().reproduce_at = 13, t.back().reproduce = [](const C& c, S& o) {
    if (c.act_quant.on()) o << " --act-quant-rounding " << (c.act_quant.stochastic ? "stochastic" : "nearest");
  };

  // Checkpoints
  add({"async-save", "Checkpoints",
       "checkpoints: copy each rank's shard into a staging buffer (memory category staging) and write it "
       "in a background thread while training goes on",
       &O::async_save, false})
      .to_plan = [](const O& v, C& c) { c.stage_checkpoint = v.async_save; };
  return t;
}

}  // namespace

const std::vector<PlanOption>& plan_options() {
  static const std::vector<PlanOption> table = make_table();
  return table;
}

std::string option_text(const PlanOption& o, const PlanOptions& v) {
  return std::visit(
      [&v](auto field) -> std::string {
        const auto& value = v.*field;
        if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) return value ? "on" : "off";
        else return fmt::format("{}", value);
      },
      o.field);
}

void check_plan_options(const PlanOptions& v) {
  for (const PlanOption& o : plan_options())
    if (o.check) o.check(v);
}

void apply_plan_options(const PlanOptions& v, PlanConfig& c) {
  for (const PlanOption& o : plan_options())
    if (o.to_plan) o.to_plan(v, c);
}

void take_plan_options(const PlanConfig& c, PlanOptions& v) {
  for (const PlanOption& o : plan_options())
    if (o.from_plan) o.from_plan(c, v);
}

std::string reproduce_flags(const PlanConfig& c) {
  std::vector<const PlanOption*> printed;
  for (const PlanOption& o : plan_options())
    if (o.reproduce_at > 0) printed.push_back(&o);
  std::sort(printed.begin(), printed.end(), [](const PlanOption* a, const PlanOption* b) { return a->reproduce_at < b->reproduce_at; });
  std::ostringstream words;
  for (const PlanOption* o : printed) o->reproduce(c, words);
  const std::string s = words.str();
  return s.empty() ? s : s.substr(1);  // no space before the first flag
}

}  // namespace shardlm::plan
