// `shardlm simulate | calibrate | plan`.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <malloc.h>
#include <nlohmann/json.hpp>

#include "cli/environment.h"
#include "cli/subcommands.h"
#include "files/replace_file.h"
#include "kernels/backend.h"
#include "kernels/cpu.h"
#include "report/run_data.h"
#include "run/calibrate.h"
#include "sim/cost.h"
#include "sim/goodput.h"
#include "sim/hardware.h"
#include "sim/planner.h"
#include "sim/simulator.h"
#include "trace/trace.h"
#include "train/machines.h"
#include "train/trainer.h"

namespace shardlm::cli {

namespace {

// --moe-imbalance as the cost model takes it, and the words saying where it came from: 1 (balanced
// routing) unless given; a number as given; a run (its directory or metrics.jsonl) the median over
// its steps of expert_load_imbalance, the mean over the step's routings of the busiest expert's
// rows over the mean. Only for a mixture-of-experts model.
struct ExpertLoad {
  double value = 1;
  std::string note = "1 (default: balanced routing; --moe-imbalance F or RUN_DIR sets a run's max/mean expert load)";
};

// The run's steps as the report reads them (report::load_run: a damaged line is left out).
double median_imbalance_of_run(const std::string& flag) {
  namespace fs = std::filesystem;
  const fs::path path(flag);
  const std::string dir = path.filename() == "metrics.jsonl" ? path.parent_path().string() : flag;
  report::RunData run;
  try {
    run = report::load_run(dir.empty() ? "." : dir);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument("--moe-imbalance: " + flag + ": cannot be read as a run (a number >= 1, or a run's " +
                                "directory or metrics.jsonl): " + e.what());
  }
  std::vector<double> steps = run.samples["expert_load_imbalance"].all_values();  // finite values only
  if (steps.empty())
    throw std::invalid_argument("--moe-imbalance: " + (fs::path(dir) / "metrics.jsonl").string() +
                                ": no step records expert_load_imbalance (the metrics of a mixture-of-experts run)");
  std::sort(steps.begin(), steps.end());
  const size_t n = steps.size();
  return n % 2 ? steps[n / 2] : (steps[n / 2 - 1] + steps[n / 2]) / 2;
}

ExpertLoad expert_load_of(const std::string& flag, const model::ModelDesc& desc) {
  if (flag.empty()) return {};
  if (desc.config.family != model::Family::moe)
    throw std::invalid_argument("--moe-imbalance: the model has no experts (a mixture-of-experts model only)");
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(flag, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  if (used == flag.size()) {
    if (!(x >= 1) || !std::isfinite(x)) throw std::invalid_argument("--moe-imbalance: " + flag + " is not a max/mean expert load (>= 1)");
    return {x, fmt::format("{:.3g} (--moe-imbalance)", x)};
  }
  const double m = median_imbalance_of_run(flag);
  return {m, fmt::format("{:.3g} (--moe-imbalance {}: the median of its steps' expert_load_imbalance)", m, flag)};
}

// Where the profile's figures come from, first of what simulate and plan print (each line after
// `prefix`), and for a datasheet profile how optimistic its predictions ran.
void print_provenance(const sim::HardwareProfile& hw, const char* prefix = "") {
  fmt::print("{}{}\n", prefix, sim::provenance_line(hw));
  if (const std::string caution = sim::datasheet_caution(hw); !caution.empty()) fmt::print("{}{}\n", prefix, caution);
}

// The same for --json, as fields beside "hardware".
void add_provenance(nlohmann::json& j, const sim::HardwareProfile& hw) {
  j["hardware_file"] = hw.origin;
  j["hardware_source"] = hw.provenance.source;
  j["hardware_date"] = hw.provenance.date;
}

nlohmann::json mem_json(const MemSnapshot& s) {
  nlohmann::json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

// `plan`: the planner's ranked table of the configurations that fit (printed when `talk`).
// Goodput under failures for a simulated step: the checkpoint is what shardlm writes (each kind of
// state once, by the ranks of the first replica of the shard group), at the profile's storage
// bandwidth per writing node; a snapshot copies each rank's state and its partner's across the
// device's host link.
// The share of failures a snapshot recovers: the flag; else, where the layout keeps every rank's
// snapshot copy off its own node, all but those that may take several nodes at once (Llama 3's
// network switch and cable failures, 35 of its 419: 0.92); else only those that leave the node and
// its memory in place (its software bugs, NCCL timeouts and dependency failures, 63 of 419: 0.15).
double snapshot_share(const GoodputFlags& a, int ranks, int per_node) {
  if (a.snapshot_survives >= 0) return a.snapshot_survives;
  return sim::snapshot_survives_node_loss(ranks, std::min(ranks, per_node), a.snapshot_parity) ? 0.92 : 0.15;
}

sim::Goodput goodput_of(const GoodputFlags& a, int ranks, const plan::Plan& plan, const sim::HardwareProfile& hw,
                        double step_ms, int64_t* checkpoint_bytes, int* writer_nodes) {
  const double storage = a.storage_gbs > 0 ? a.storage_gbs * 1e9 : hw.storage_bw;
  if (storage <= 0)
    throw std::invalid_argument("hardware profile " + hw.origin +
                                ": storage_bw: missing (--mtbf-hours prices checkpoints at it; or give --storage-gbs)");
  const int dpn = std::max(1, hw.devices_per_node);
  const int64_t state = plan.static_memory.params + plan.static_memory.optimizer;  // one rank's
  *checkpoint_bytes = state * plan.shard_size;
  *writer_nodes = (plan.shard_size + dpn - 1) / dpn;
  sim::GoodputInput in;
  in.step_s = step_ms * 1e-3;
  in.nodes = (ranks + dpn - 1) / dpn;
  in.mtbf_hours = a.mtbf_hours;
  in.checkpoint_s = static_cast<double>(*checkpoint_bytes) / (*writer_nodes * storage);
  in.checkpoint_read_s = in.checkpoint_s;
  in.snapshot_s = 2.0 * static_cast<double>(state) / (hw.host_link_bw > 0 ? hw.host_link_bw : hw.memory_bw);
  in.snapshot_survives = snapshot_share(a, ranks, dpn);
  in.restart_s = a.restart_s;
  return sim::goodput(in);
}

nlohmann::json level_json(const sim::GoodputLevel& l) {
  return {{"every_steps", l.every_steps}, {"interval_s", l.interval_s}, {"save_s", l.save_s},
          {"restart_s", l.restart_s},     {"young_s", l.young_s},       {"failures_per_hour", l.rate * 3600},
          {"kept", l.kept}};
}

// --memory-per-rank: bytes per rank, at most 10^18; unset, the profile's device memory.
int64_t memory_budget_of(const PlanArgs& a, const sim::HardwareProfile& hw) {
  if (a.memory.empty()) return hw.device_memory;
  const int64_t bytes = plan::parse_bytes(a.memory, "--memory-per-rank");
  if (bytes > static_cast<int64_t>(1e18)) throw std::invalid_argument("--memory-per-rank: '" + a.memory + "' is over 10^18 bytes");
  return bytes;
}

// --disk-per-rank: the disk tier's bytes per rank; the profile must price the disk.
int64_t disk_budget_of(const PlanArgs& a, const sim::HardwareProfile& hw) {
  if (a.disk.empty()) return 0;
  const int64_t bytes = plan::parse_bytes(a.disk, "--disk-per-rank");
  if (hw.disk_read_bw <= 0)
    throw std::invalid_argument("--disk-per-rank: the hardware profile '" + hw.name +
                                "' has no disk figures (disk_read_bw, disk_write_bw, disk_latency_s; calibrate "
                                "--offload-dir DIR measures them)");
  return bytes;
}

// A configuration's parallelism in a few words: "fsdp", "hybrid 8" (its shard group), "fsdp ep 8 cp 8
// all-to-all".
std::string parallelism_cell(const plan::PlanConfig& c) {
  std::string out = plan::to_string(c.strategy);
  if (c.strategy == plan::Strategy::hybrid) out += " " + std::to_string(c.shard_group);
  if (c.ep > 1) out += " ep " + std::to_string(c.ep);
  if (c.cp > 1) out += fmt::format(" cp {} {}", c.cp, model::to_string(c.cp_impl));
  return out;
}

// "none", "full", "selective-op 37 blocks" (of the model's, where fewer are rebuilt); "+int8" where
// the saved activations are compressed.
std::string recompute_cell(const plan::PlanConfig& c) {
  std::string out = model::to_string(c.recompute);
  if (c.recompute != model::Recompute::none && c.recompute_blocks >= 0) out += fmt::format(" {} blocks", c.recompute_blocks);
  if (c.act_quant.on()) out += " +int8";
  return out;
}

// The ranked rows, the knobs that tell them apart in columns, then each distinct configuration's
// full flags once, under the label its rows carry: a flag list (thirteen units kept gathered) would
// bury the columns. alike: other fitting flag sets predicted exactly the same (knobs that change
// nothing here).
void print_ranked(const sim::PlanSearch& s, int top, const std::vector<double>& kept, bool failures) {
  const int rows = std::min<int>(top, static_cast<int>(s.fitting.size()));
  std::vector<std::string> labels, flags;  // flags[k]: the configuration labelled [k + 1]
  size_t width = std::string("strategy").size(), recompute_width = std::string("recompute").size();
  for (int i = 0; i < rows; ++i) {
    const sim::Candidate& c = s.fitting[i];
    const auto at = std::find(flags.begin(), flags.end(), c.flags);
    labels.push_back(fmt::format("[{}]", (at - flags.begin()) + 1));
    if (at == flags.end()) flags.push_back(c.flags);
    width = std::max(width, parallelism_cell(c.config).size());
    recompute_width = std::max(recompute_width, recompute_cell(c.config).size());
  }
  const bool disk = s.on_disk > 0;
  fmt::print("{:>4}  {:>12}  {:>12}  {:>6}  {:>10}{}  {:>5}{}  {:<{}}  {:>5}  {:>5}  {:<{}}  {}\n", "rank", "step ms", "tokens/s",
             "MFU", "mem GiB", disk ? fmt::format("  {:>10}", "disk GiB") : "", "alike",
             failures ? fmt::format("  {:>8}  {:>12}", "goodput", "good tok/s") : "", "strategy", width, "batch", "accum",
             "recompute", recompute_width, "flags");
  for (int i = 0; i < rows; ++i) {
    const sim::Candidate& c = s.fitting[i];
    fmt::print("{:>4}  {:>12.3f}  {:>12.0f}  {:>5.1f}%  {:>10.3f}{}  {:>5}{}  {:<{}}  {:>5}  {:>5}  {:<{}}  {}\n", i + 1,
               c.step_ms, c.tokens_per_s, 100 * c.mfu, c.peak_bytes / 1073741824.0,
               disk ? fmt::format("  {:>10.3f}", c.disk_bytes / 1073741824.0) : "", c.alike,
               failures ? fmt::format("  {:>7.2f}%  {:>12.0f}", 100 * kept[i], c.tokens_per_s * kept[i]) : "",
               parallelism_cell(c.config), width, c.config.batch, c.config.grad_accum, recompute_cell(c.config),
               recompute_width, labels[i]);
  }
  fmt::print("flags (train or simulate with them):\n");
  for (size_t k = 0; k < flags.size(); ++k) fmt::print("  [{}] {}\n", k + 1, flags[k]);
}

sim::PlanSearch search_and_print(PlanArgs& a) {
  a.cfg.data = "-";
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  sim::PlanQuery q;
  q.ranks = a.ranks, q.global_tokens = a.global_batch, q.seq = a.cfg.seq, q.threads = a.cfg.threads;
  q.memory_budget = memory_budget_of(a, hw);
  const ExpertLoad load = expert_load_of(a.moe_imbalance, desc);
  q.expert_load = load.value;
  q.disk_budget = disk_budget_of(a, hw);
  q.context_always = a.search_cp;
  if (a.search_act_quant) {
    q.act_quant = {a.cfg.act_quant_group, a.cfg.act_quant_rounding == "stochastic"};
    model::validate_act_quant(desc.config, q.act_quant, 1, model::ContextImpl::ring);
  }
  // Branch and bound for the rows printed; ranked by goodput the bound on step time is not the
  // order, so every configuration is simulated there.
  q.top = a.goodput.mtbf_hours > 0 ? 0 : a.top;
  // The search builds and drops thousands of plans of a few MB: keep their pages in the heap
  // instead of mapping and unmapping them each time (a third of the search's time otherwise).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  sim::PlanSearch s = sim::search_plans(desc, train::plan_config(a.cfg, a.ranks), hw, q);
  // Under failures the ranking is by tokens/s × goodput: a configuration holding more state per
  // rank pays more for its checkpoints and snapshots.
  std::vector<double> kept(s.fitting.size(), 1);
  const bool failures = a.goodput.mtbf_hours > 0;
  if (failures) {
    for (size_t i = 0; i < s.fitting.size(); ++i) {
      const plan::Plan p = plan::build_plan(desc, sim::for_hardware(s.fitting[i].config, hw));
      int64_t bytes = 0;
      int writers = 0;
      kept[i] = goodput_of(a.goodput, a.ranks, p, hw, s.fitting[i].step_ms, &bytes, &writers).fraction;
    }
    std::vector<size_t> order(s.fitting.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return s.fitting[x].tokens_per_s * kept[x] > s.fitting[y].tokens_per_s * kept[y];
    });
    std::vector<sim::Candidate> sorted;
    std::vector<double> sorted_kept;
    for (size_t i : order) sorted.push_back(s.fitting[i]), sorted_kept.push_back(kept[i]);
    s.fitting = std::move(sorted), kept = std::move(sorted_kept);
  }
  if (!a.talk) return s;
  if (s.fitting.empty())
    throw std::runtime_error(fmt::format("plan: no configuration of {} on {} rank(s) fits {} bytes per rank; the smallest of {} "
                                         "needs {} ({})",
                                         a.cfg.model, a.ranks, q.memory_budget, s.considered, s.smallest.peak_bytes,
                                         s.smallest.flags));
  print_provenance(hw);
  fmt::print("plan: {} on {} rank(s) x {} thread(s), {} tokens per step, {}: {} configurations ({} pruned by memory "
             "or its bound unbuilt, {} by a bound on step time unbuilt, {} invalid, {} "
             "built, {} simulated), {} fit {} (+{} refined by rebuilding fewer blocks, +{} by keeping units gathered), "
             "{} distinct predictions\n",
             a.cfg.model, a.ranks, a.cfg.threads, a.global_batch, hw.name, s.considered, s.pruned, s.bounded,
             s.invalid, s.built, s.simulated, s.fit - s.refined - s.fewer_rebuilt,
             q.memory_budget ? fmt::format("{:.3f} GiB per rank", q.memory_budget / 1073741824.0) : "(no memory limit)",
             s.fewer_rebuilt, s.refined, s.fitting.size());
  if (s.on_disk > 0)
    fmt::print("disk tier: nothing fits in memory; {} configurations searched with state and saved activations placed on "
               "disk (--memory-budget), files within {:.3f} GiB per rank, copies priced at the profile's disk figures\n",
               s.on_disk, q.disk_budget / 1073741824.0);
  if (desc.config.family == model::Family::moe)
    fmt::print("mixture of experts: ep searched over the divisors of {} experts dividing {} rank(s); expert load max/mean {}\n",
               desc.config.n_experts, a.ranks, load.note);
  if (q.act_quant.on())
    fmt::print("activations: each configuration searched in fp32 and as int8 (group {}, {} rounding)\n", q.act_quant.group,
               q.act_quant.stochastic ? "stochastic" : "nearest");
  if (failures)
    fmt::print("ranked by tokens/s x goodput under failures (MTBF {:.4g} h a node, restart {:.4g} s; simulate --mtbf-hours "
               "prints the intervals)\n",
               a.goodput.mtbf_hours, a.goodput.restart_s);
  print_ranked(s, a.top, kept, failures);
  return s;
}

// The best configuration as train options over the model options of `a`.
train::TrainConfig train_config_of(const PlanArgs& a, const plan::PlanConfig& c) {
  train::TrainConfig tc = a.cfg;
  plan::take_plan_options(c, tc);
  tc.data = a.data, tc.out = a.out, tc.overwrite = a.overwrite;
  tc.steps = a.run_steps, tc.warmup = 0, tc.eval_every = 0, tc.eval_windows = 1, tc.sample_tokens = 0, tc.quiet = true;
  return tc;
}

// The best configuration's predicted step time and memory against its run's in DIR/metrics.jsonl.
void print_predicted_and_measured(const sim::Candidate& best, const std::string& out) {
  std::ifstream f(std::filesystem::path(out) / "metrics.jsonl");
  std::vector<double> ms;
  int64_t mem = 0;
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("step_ms")) continue;
    // The step itself, as the simulator prices it (step_ms also holds the time between steps).
    if (j["step"].get<int64_t>() >= 2) ms.push_back(j.value("compute_ms", j["step_ms"].get<double>()));
    mem = j["mem"]["total"].get<int64_t>();
  }
  std::sort(ms.begin(), ms.end());
  const double measured = ms.empty() ? 0 : ms[ms.size() / 2];
  fmt::print("best ({}): predicted {:.1f} ms/step, measured {:.1f} ms/step (median of {} after 2 untimed, {:+.1f}%); "
             "memory per rank predicted {} bytes, measured {}\n",
             best.flags, best.step_ms, measured, ms.size(), measured > 0 ? 100 * (best.step_ms - measured) / measured : 0.0,
             best.peak_bytes, mem);
}

// A message size: digits with an optional K, M or G (1024-based, as nccl-tests' -b/-e).
int64_t parse_size(const std::string& text, const std::string& whole) {
  const auto bad = [&] {
    return std::invalid_argument("--bytes: '" + whole + "' is not a size (8, 64K, 1G) or a range MIN:MAX (8:8G)");
  };
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) throw bad();
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    throw bad();
  }
  int shift = 0;
  if (used + 1 == text.size()) {
    const char u = static_cast<char>(std::toupper(static_cast<unsigned char>(text[used])));
    shift = u == 'K' ? 10 : u == 'M' ? 20 : u == 'G' ? 30 : -1;
    if (shift < 0) throw bad();
  } else if (used != text.size()) {
    throw bad();
  }
  // At most 1 TiB: a message beyond any device's memory is a typo.
  if (v < 1 || v > (int64_t{1} << (40 - shift))) throw std::invalid_argument("--bytes: '" + whole + "' must be in [1, 1T] bytes");
  return static_cast<int64_t>(v) << shift;
}

// `simulate --collective`: one collective over --ranks consecutive ranks (nodes of the profile's
// devices_per_node), priced per message size as the simulator prices a plan's, printed as
// nccl-tests prints its tables (size, time, algbw = S/t, busbw = algbw × factor(n)).
void run_collective(const SimulateArgs& a) {
  const std::string& name = a.collective;
  sim::Collective c;
  if (name == "all-reduce" || name == "all_reduce") c = sim::Collective::all_reduce;
  else if (name == "all-gather" || name == "all_gather") c = sim::Collective::all_gather;
  else if (name == "reduce-scatter" || name == "reduce_scatter") c = sim::Collective::reduce_scatter;
  else if (name == "all-to-all" || name == "all_to_all") c = sim::Collective::all_to_all;
  else throw std::invalid_argument("--collective: '" + name + "' is none of all-reduce, all-gather, reduce-scatter, all-to-all");
  sim::Algorithm algo;
  if (a.algo == "best") algo = sim::Algorithm::best;
  else if (a.algo == "ring") algo = sim::Algorithm::ring;
  else if (a.algo == "tree") algo = sim::Algorithm::tree;
  else if (a.algo == "nvls") algo = sim::Algorithm::nvls;
  else throw std::invalid_argument("--algo: '" + a.algo + "' is none of best, ring, tree, nvls");
  int64_t lo = 8, hi = int64_t{8} << 30;
  if (!a.bytes.empty()) {
    const size_t colon = a.bytes.find(':');
    lo = parse_size(a.bytes.substr(0, colon), a.bytes);
    hi = colon == std::string::npos ? lo : parse_size(a.bytes.substr(colon + 1), a.bytes);
    if (hi < lo) throw std::invalid_argument("--bytes: '" + a.bytes + "': MAX is below MIN");
  }
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const sim::GroupSpan g = sim::contiguous_span(a.ranks, hw.devices_per_node);
  const double factor = sim::bus_factor(c, a.ranks);
  // An algorithm that does not apply is refused before anything is printed.
  if (const sim::CollectiveCost r = sim::collective_cost(hw, c, static_cast<double>(lo), g, algo); !r.available)
    throw std::invalid_argument("--algo " + a.algo + ": " +
                                (r.algorithm == sim::Algorithm::nvls
                                     ? "NVLS prices an all-reduce inside one whole node of a profile with fabric.nvls_all_reduce"
                                     : "the tree prices an all-reduce across nodes of a profile with a network"));
  nlohmann::json rows = nlohmann::json::array();
  if (!a.json) print_provenance(hw, "# ");
  if (!a.json)
    fmt::print("# {} over {} rank(s) of {}: {} node(s) x {} rank(s) a node ({} devices a node{}); algorithm: {}\n"
               "# busbw = algbw x {:.4g} ({}); times in us, bandwidths in GB/s (1e9 bytes/s)\n"
               "# {:>12}  {:>7}  {:>12}  {:>10}  {:>10}\n",
               sim::to_string(c), a.ranks, hw.name, g.nodes, g.per_node, hw.devices_per_node,
               hw.network.present ? fmt::format(", {} NICs of {:.4g} GB/s at {:.3g}", hw.network.nics_per_node,
                                                hw.network.nic_bw / 1e9, hw.network.nic_efficiency)
                                  : "",
               a.algo, factor, c == sim::Collective::all_reduce ? "2(n-1)/n" : "(n-1)/n", "size", "algo", "time", "algbw",
               "busbw");
  for (int64_t S = lo; S <= hi; S *= 2) {
    const sim::CollectiveCost r = sim::collective_cost(hw, c, static_cast<double>(S), g, algo);
    const double algbw = r.seconds > 0 ? S / r.seconds : 0;
    const std::string algorithm = std::string(sim::to_string(r.algorithm)) + (r.low_latency ? "/LL" : "");
    if (a.json)
      rows.push_back({{"bytes", S}, {"algorithm", algorithm}, {"time_us", r.seconds * 1e6},
                      {"algbw_gbs", algbw / 1e9}, {"busbw_gbs", algbw * factor / 1e9}});
    else
      fmt::print("  {:>12}  {:>7}  {:>12.2f}  {:>10.2f}  {:>10.2f}\n", S, algorithm, r.seconds * 1e6, algbw / 1e9,
                 algbw * factor / 1e9);
    if (S > hi / 2) break;
  }
  if (a.json) {
    nlohmann::json j{{"collective", sim::to_string(c)}, {"ranks", a.ranks},      {"hardware", hw.name},
                     {"nodes", g.nodes},                {"per_node", g.per_node}, {"rows", rows}};
    add_provenance(j, hw);
    std::cout << j.dump() << "\n";
  }
}

}  // namespace

// `simulate`: the plan `train` would run at --ranks, priced on a hardware profile. Nothing of
// the model is allocated, so shapes far beyond this machine simulate in milliseconds.

// Where the plan keeps each unit's state (--memory-budget or --offload): per kind, the units on
// disk of those holding it, and each unit's line ("params/grads/optimizer/activations": ram |
// disk | -).
namespace {
nlohmann::json placement_json(const plan::Plan& plan, const model::ModelDesc& desc) {
  nlohmann::json j{{"memory_budget", plan.config.memory_budget}, {"peak", plan.peak_memory().total}};
  const char* names[] = {"params", "grads", "optimizer"};
  nlohmann::json units = nlohmann::json::object();
  for (int k = 0; k < plan::kNumStateKinds; ++k) {
    int disk = 0, held = 0;
    for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
      held += plan.placed(plan::State(k), u).parts > 0;
      disk += plan.on_disk(plan::State(k), u);
    }
    j["disk"][names[k]] = disk;
    j["held"][names[k]] = held;
  }
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
    std::string w;
    for (int k = 0; k < plan::kNumStateKinds; ++k) {
      const bool held = plan.placed(plan::State(k), u).parts > 0;
      w += std::string(k ? "/" : "") + (!held ? "-" : plan.on_disk(plan::State(k), u) ? "disk" : "ram");
    }
    units[desc.units[u].name] = w + "/" + plan.activations_where(u);
  }
  int activations = 0;
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) activations += std::string(plan.activations_where(u)) == "disk";
  j["disk"]["activations"] = activations;
  j["units"] = units;
  return j;
}
}  // namespace

train::TrainConfig with_offload_prefetch(train::TrainConfig cfg, int ranks, int64_t vocab, const sim::HardwareProfile& hw,
                                         double expert_load, std::string* line) {
  if (line) line->clear();
  if (cfg.offload_prefetch != train::kOffloadPrefetchAuto) return cfg;
  cfg.offload_prefetch = train::TrainConfig{}.offload_prefetch;  // for a plan with nothing on disk; the choice replaces it
  if (cfg.offload == "none" && cfg.memory_budget.empty()) return cfg;
  const model::ModelDesc desc = model::describe(cfg.model_config(vocab));
  const sim::PrefetchChoice c =
      sim::choose_offload_prefetch(desc, sim::for_hardware(train::plan_config(cfg, ranks), hw), hw, cfg.threads, expert_load);
  cfg.offload_prefetch = c.depth;
  if (line) {
    *line = fmt::format("offload read-ahead: {} (auto: predicted on {}", c.depth, hw.name);
    for (size_t d = 0; d < c.step_ms.size(); ++d)
      *line += c.step_ms[d] < 0 ? fmt::format("; {}: does not fit", d) : fmt::format("; {}: {:.1f} ms", d, c.step_ms[d]);
    *line += ")";
  }
  return cfg;
}

// What run_simulate found, for its JSON line or its text.
struct Simulation {
  const SimulateArgs& a;
  const model::ModelDesc& desc;
  const plan::Plan& plan;
  const sim::HardwareProfile& hw;
  const sim::SimResult& r;
  const ExpertLoad& load;
  const std::string& read_ahead;  // --offload-prefetch auto's choice, "" for none
  bool moe = false;
  bool fits = true;  // the peak within the profile's device memory
  sim::Goodput gp;   // with --mtbf-hours
  int64_t ckpt_bytes = 0;
  int writers = 0;
};

nlohmann::json simulation_json(const Simulation& s) {
  const sim::SimResult& r = s.r;
  nlohmann::json j{{"model", s.a.cfg.model},
                   {"strategy", plan::to_string(s.plan.config.strategy)},
                   {"ranks", s.a.ranks},
                   {"hardware", s.hw.name},
                   {"step_ms", r.step_ms},
                   {"tokens_per_s", r.tokens_per_s},
                   {"mfu", r.mfu},
                   {"comm_exposed_ms", r.comm_exposed_ms},
                   {"compute_busy_ms", r.compute_busy_ms},
                   {"comm_busy_ms", r.comm_busy_ms},
                   {"mem", mem_json(r.mem)},
                   {"mem_max", mem_json(r.mem_max)},
                   {"device_memory", s.hw.device_memory},
                   {"fits", s.fits}};
  add_provenance(j, s.hw);
  if (s.plan.config.offload.disk()) {
    j["disk_busy_ms"] = r.disk_busy_ms;
    j["disk_exposed_ms"] = r.disk_exposed_ms;
    j["offload_prefetch"] = s.plan.config.offload.prefetch;
  }
  if (s.plan.config.pipeline_optimizer) j["optimizer_busy_ms"] = r.optimizer_busy_ms;
  if (s.plan.config.cp > 1) {
    j["cp"] = s.plan.config.cp;
    j["exchange_busy_ms"] = r.exchange_busy_ms;
    j["exchange_exposed_ms"] = r.exchange_exposed_ms;
  }
  if (s.moe) {
    j["ep"] = s.plan.config.ep;
    j["moe_imbalance"] = s.load.value;
    j["exchange_busy_ms"] = r.exchange_busy_ms;
    j["exchange_exposed_ms"] = r.exchange_exposed_ms;
  }
  if (s.plan.config.memory_budget > 0 || s.plan.config.offload.disk())
    j["placement"] = placement_json(s.plan, s.desc);
  if (s.a.goodput.mtbf_hours > 0)
    j["goodput"] = {{"fraction", s.gp.fraction},
                    {"mtbf_hours", s.a.goodput.mtbf_hours},
                    {"checkpoint_bytes", s.ckpt_bytes},
                    {"checkpoint", level_json(s.gp.checkpoint)},
                    {"snapshot", level_json(s.gp.snapshot)},
                    {"tokens_per_s", r.tokens_per_s * s.gp.fraction},
                    {"snapshot_survives", snapshot_share(s.a.goodput, s.a.ranks, std::max(1, s.hw.devices_per_node))}};
  return j;
}

void print_goodput(const Simulation& s) {
  const GoodputFlags& gf = s.a.goodput;
  const int node = std::max(1, s.hw.devices_per_node), nodes = (s.a.ranks + node - 1) / node;
  fmt::print("goodput under failures: {:.2f}% of wall time on counted steps, {:.0f} tokens/s ({} node(s) at MTBF {:.4g} h "
             "each: a failure every {:.3g} h; restart {:.4g} s)\n",
             100 * s.gp.fraction, s.r.tokens_per_s * s.gp.fraction, nodes, gf.mtbf_hours, gf.mtbf_hours / nodes, gf.restart_s);
  const double q = snapshot_share(gf, s.a.ranks, node);
  const sim::GoodputLevel& c = s.gp.checkpoint;
  fmt::print("  disk checkpoint: {:.3g} s each ({:.4g} GB over {} writing node(s)), every {} steps ({:.4g} s; Young "
             "sqrt(2C/rate) {:.4g} s), {:.4g} failures/h fall back to it, keeps {:.2f}%\n",
             c.save_s, s.ckpt_bytes / 1e9, s.writers, c.every_steps, c.interval_s, c.young_s, c.rate * 3600, 100 * c.kept);
  const sim::GoodputLevel& snap = s.gp.snapshot;
  if (snap.every_steps > 0)
    fmt::print("  in-memory snapshot: {:.3g} s each, every {} steps ({:.4g} s; Young {:.4g} s), recovers {:.4g} "
               "failures/h ({:.0f}%), keeps {:.2f}%\n",
               snap.save_s, snap.every_steps, snap.interval_s, snap.young_s, snap.rate * 3600, 100 * q, 100 * snap.kept);
  else
    fmt::print("  in-memory snapshots: none ({})\n", q > 0 ? "they would cost more than the work they save"
                                                           : "--snapshot-survives 0");
}

void print_simulation(const Simulation& s) {
  const plan::PlanConfig& pc = s.plan.config;
  const sim::SimResult& r = s.r;
  const sim::HardwareProfile& hw = s.hw;
  const double peak = hw.peak_flops * (hw.per_thread ? s.a.cfg.threads : 1);
  print_provenance(hw);
  // Measured GEMM rates price the model's weight GEMMs; the efficiency only what they leave out.
  fmt::print("simulated: model {}, strategy {}, {} rank(s) on {} ({} peak {:.4g} TFLOP/s per rank, {})\n", s.a.cfg.model,
             plan::strategy_text(s.plan.config), s.a.ranks, hw.name, hw.compute_dtype, peak / 1e12,
             hw.gemm_rates.empty()
                 ? fmt::format("GEMM efficiency {:.3g}", hw.gemm_efficiency)
                 : fmt::format("{} measured GEMM shapes, elsewhere GEMM efficiency {:.3g}", hw.gemm_rates.size(),
                               hw.gemm_efficiency));
  fmt::print("step {:.3f} ms | {:.0f} tokens/s | MFU {:.1f}% | comm exposed {:.3f} ms (compute busy {:.3f} ms, comm busy {:.3f} ms)\n",
             r.step_ms, r.tokens_per_s, 100 * r.mfu, r.comm_exposed_ms, r.compute_busy_ms, r.comm_busy_ms);
  const double pct = r.step_ms > 0 ? 100 / r.step_ms : 0;
  if (pc.offload.disk())  // the disk tier's reads and writes on their copy stream
    fmt::print("disk ({}): {:.3f} ms of reloads and write-backs ({:.1f}% of the step), {:.3f} ms exposed ({:.1f}% "
               "of the step){}\n",
               pc.memory_budget > 0 ? "--memory-budget " + std::to_string(pc.memory_budget) : "--offload " + s.a.cfg.offload,
               r.disk_busy_ms, r.disk_busy_ms * pct, r.disk_exposed_ms, r.disk_exposed_ms * pct,
               hw.disk_read_bw > 0 ? fmt::format("; disk read {:.3g} GB/s, write {:.3g} GB/s, latency {:.3g} ms ({})",
                                                 hw.disk_read_bw / 1e9, hw.disk_write_bw / 1e9, hw.disk_latency_s * 1e3, hw.name)
                                   : std::string("; the profile has no disk figures: copies priced at nothing"));
  if (!s.read_ahead.empty()) fmt::print("{}\n", s.read_ahead);
  if (pc.pipeline_optimizer)
    fmt::print("pipelined optimizer: {:.3f} ms of updates on the optimizer stream ({:.1f}% of the step), sharing the "
               "device with the backward\n",
               r.optimizer_busy_ms, r.optimizer_busy_ms * pct);
  if (pc.cp > 1)  // the attention's exchanges, and a MoE block's routing counts and routed rows
    fmt::print("exchanges (cp {} {}{}): {:.3f} ms in exchange tasks ({:.1f}% of the step), {:.3f} ms exposed ({:.1f}% of "
               "the step)\n",
               pc.cp, model::to_string(pc.cp_impl),
               pc.ep > 1 ? fmt::format(", ep {}", pc.ep) : std::string(), r.exchange_busy_ms,
               r.exchange_busy_ms * pct, r.exchange_exposed_ms, r.exchange_exposed_ms * pct);
  if (s.moe && pc.cp == 1) {
    if (pc.ep > 1)
      fmt::print("all-to-all (ep {} exchanges): {:.3f} ms in exchange tasks ({:.1f}% of the step), {:.3f} ms exposed ({:.1f}% of "
                 "the step); expert load max/mean {}\n",
                 pc.ep, r.exchange_busy_ms, r.exchange_busy_ms * pct, r.exchange_exposed_ms,
                 r.exchange_exposed_ms * pct, s.load.note);
    else
      fmt::print("all-to-all: none (ep 1: every rank runs every expert; --ep K splits them)\n");
  }
  if (s.a.goodput.mtbf_hours > 0) print_goodput(s);
  if (pc.memory_budget > 0 || pc.offload.disk()) {
    fmt::print("state placement{}: on disk ", pc.memory_budget > 0 ? fmt::format(" (--memory-budget {} bytes)", pc.memory_budget) : "");
    const nlohmann::json pj = placement_json(s.plan, s.desc);
    for (const char* k : {"params", "grads", "optimizer"})
      fmt::print("{} {}/{} unit(s), ", k, pj["disk"][k].get<int>(), pj["held"][k].get<int>());
    fmt::print("saved activations of {} unit(s); accounted peak {} bytes ({:.1f} MiB); the disk copies {}\n",
               pj["disk"]["activations"].get<int>(), s.plan.peak_memory().total, s.plan.peak_memory().total / 1048576.0,
               hw.disk_read_bw > 0 ? fmt::format("priced at {:.2f} GB/s read, {:.2f} GB/s write, {:.0f} us a request",
                                                 hw.disk_read_bw / 1e9, hw.disk_write_bw / 1e9, hw.disk_latency_s * 1e6)
                                   : std::string("not priced (the profile has no disk figures)"));
  }
  fmt::print("memory per rank at peak (bytes):\n");
  for (int c = 0; c < kNumMemCategories; ++c)
    if (r.mem.bytes[c] > 0 || r.mem_max.bytes[c] > 0)
      fmt::print("  {}: {} ({:.1f} MiB), own peak {}\n", to_string(static_cast<MemCategory>(c)), r.mem.bytes[c],
                 r.mem.bytes[c] / 1048576.0, r.mem_max.bytes[c]);
  fmt::print("  total: {} ({:.2f} GiB){}\n", r.mem.total, r.mem.total / 1073741824.0,
             hw.device_memory == 0 ? std::string()
                                   : fmt::format(", device memory {:.0f} GiB: {}", hw.device_memory / 1073741824.0,
                                                 s.fits ? "fits" : "does NOT fit"));
}

void run_simulate(SimulateArgs& a) {
  if (!a.collective.empty()) return run_collective(a);
  if (!a.bytes.empty() || a.algo != "best") throw std::invalid_argument("--bytes and --algo go with --collective");
  a.cfg.data = "-";  // simulate reads no data
  a.cfg.validate();
  // One rank's plan, priced alone, cannot show the bubble between stages.
  if (a.cfg.pp > 1) throw std::invalid_argument("simulate --pp: pipeline stages are not simulated yet (explain prints each stage's plan)");
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  const ExpertLoad load = expert_load_of(a.moe_imbalance, desc);
  std::string read_ahead;
  a.cfg = with_offload_prefetch(a.cfg, a.ranks, 50257, hw, load.value, &read_ahead);
  const plan::Plan plan = plan::build_plan(desc, sim::for_hardware(train::plan_config(a.cfg, a.ranks), hw));
  const sim::SimResult r = sim::simulate(desc, plan, hw, a.cfg.threads, load.value);
  if (!a.trace.empty()) trace::write_trace(a.trace, {sim::to_trace(desc, plan, r).events_json()});
  Simulation s{a, desc, plan, hw, r, load, read_ahead, desc.config.family == model::Family::moe,
               hw.device_memory == 0 || r.mem.total <= hw.device_memory, {}, 0, 0};
  if (a.goodput.mtbf_hours > 0) s.gp = goodput_of(a.goodput, a.ranks, plan, hw, r.step_ms, &s.ckpt_bytes, &s.writers);
  if (a.json)
    std::cout << simulation_json(s).dump() << "\n";
  else
    print_simulation(s);
}

// `calibrate`: every rank measures (collectives span the world); rank 0 writes the profile.
// The profile is read back as simulate reads it before it is written (a figure simulate would
// refuse is an error here, not a file), and written to a temporary name renamed into place.
int run_calibrate(const run::CalibrateOptions& co, const std::string& compute_dtype, const std::string& out) {
  run::check_calibrate_options(co);  // before MPI: a bad flag is one line, not an aborted job
  if (co.device != "cpu" && co.device != "cuda")
    throw std::invalid_argument("--device: must be cpu or cuda, got '" + co.device + "'");
  if (compute_dtype != "auto" && compute_dtype != "fp32" && compute_dtype != "bf16")
    throw std::invalid_argument("--compute-dtype: must be auto, fp32 or bf16, got '" + compute_dtype + "'");
  if (co.device == "cpu" && compute_dtype == "bf16")
    throw std::invalid_argument("--compute-dtype bf16: needs --device cuda (the CPU's GEMMs are fp32)");
  // The backend as `train` makes it, so the figures are of the kernels a run on this device uses
  // (SHARDLM_CUDA_* and SHARDLM_TEST_CPU_AS_DEVICE read as train reads them).
  train::TrainConfig kernels_of;
  kernels_of.device = co.device;
  kernels_of.compute_dtype = compute_dtype;
  kernels_of.cuda = cuda_options();
  const bool cpu_as_device = test_faults().cpu_as_device;
  return on_world([&](comm::Communicator& world, MemoryPool& memory) {
    kernels_of.cuda.local_rank = train::find_machines(world, std::chrono::minutes(5)).local_rank;  // its GPU
    // Rates measured with the threads squeezed onto fewer cores would be that squeeze's.
    train::warn_of_threads_beyond_cpus(world, std::chrono::minutes(5), co.threads);
    run::CalibrateOptions here = co;
    here.kernel_id = train::kernel_id();  // machines of one kernel share its cores
    const std::string text = run::calibrate(*train::make_backend(kernels_of, memory, cpu_as_device), world, here);
    if (world.rank() == 0) {
      try {
        sim::parse_hardware(text, out);
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("calibrate: nothing written: ") + e.what());
      }
      try {
        files::replace_file(out, text + "\n");
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("calibrate: ") + e.what());
      }
      const bool device = co.device != "cpu" || cpu_as_device;
      fmt::print("calibrate: wrote {} ({}){}\n", out,
                 device ? fmt::format("--device {}{}", co.device, cpu_as_device ? ", the CPU as a device" : "")
                        : fmt::format("{} rank(s) x {} thread(s)", world.size(), co.threads),
                 world.size() > 1 ? ""
                 : device         ? "; the profile simulates one rank (no collectives measured)"
                                  : "; one rank has no collectives to time: the profile simulates one rank "
                                    "(mpirun -np N calibrate for more)");
    }
    return 0;
  });
}

// `plan --run`: every rank searches (the search is deterministic), trains the best for a few
// steps, and rank 0 prints predicted against measured (median step after 2 untimed).
// plan --largest-model: the most layers of --model's shape that fit, and how to train it.
void print_largest_model(PlanArgs& a) {
  a.cfg.data = "-";
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const model::ModelConfig m = a.cfg.model_config(50257);
  sim::PlanQuery q;
  q.ranks = a.ranks, q.global_tokens = a.global_batch, q.seq = a.cfg.seq, q.threads = a.cfg.threads;
  q.memory_budget = memory_budget_of(a, hw);
  q.expert_load = expert_load_of(a.moe_imbalance, model::describe(m)).value;
  q.disk_budget = disk_budget_of(a, hw);
  q.top = 1;
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const sim::LargestFit f = sim::largest_model(m, train::plan_config(a.cfg, a.ranks), hw, q);
  const std::string within = fmt::format("{:.3f} GiB of memory per rank{}", q.memory_budget / 1073741824.0,
                                         q.disk_budget ? fmt::format(" and {:.3f} GiB of disk", q.disk_budget / 1073741824.0) : "");
  if (f.n_layer == 0)
    throw std::runtime_error(fmt::format("plan --largest-model: not even one layer of {}'s shape fits {} on {} rank(s) at "
                                         "{} tokens per step",
                                         a.cfg.model, within, a.ranks, a.global_batch));
  print_provenance(hw);
  fmt::print("largest model of {}'s shape (n_embd {}, n_head {}, vocabulary {}) that fits {} on {} rank(s) x {} thread(s), "
             "{} tokens per step, {}: n_layer {}{} ({:.3f} B parameters)\n",
             a.cfg.model, m.n_embd, m.n_head, m.vocab_size, within, a.ranks, a.cfg.threads, a.global_batch, hw.name,
             f.n_layer, f.capped ? " or more (the search stops there)" : "", f.params / 1e9);
  fmt::print("fastest: step {:.3f} ms, {:.0f} tokens/s, MFU {:.1f}%, memory {:.3f} GiB{}: --n-layer {} {}\n", f.best.step_ms,
             f.best.tokens_per_s, 100 * f.best.mfu, f.best.peak_bytes / 1073741824.0,
             f.best.disk_bytes ? fmt::format(", disk {:.3f} GiB", f.best.disk_bytes / 1073741824.0) : "", f.n_layer, f.best.flags);
}

int run_plan(PlanArgs& a) {
  if (a.cfg.pp > 1) throw std::invalid_argument("plan --pp: the planner does not search pipeline stages yet");
  if (a.largest) {
    if (a.run) throw std::invalid_argument("plan --largest-model: not with --run (train the model it reports with its flags)");
    print_largest_model(a);
    return 0;
  }
  if (!a.run) {
    search_and_print(a);
    return 0;
  }
  if (a.data.empty()) throw std::runtime_error("plan --run: --data PREFIX is required (the tokens to train on)");
  return on_world([&](comm::Communicator& world, MemoryPool& memory) {
    if (world.size() != a.ranks)
      throw std::runtime_error(fmt::format("plan --run: --ranks {} but {} process(es) were started (mpirun -np {})", a.ranks,
                                           world.size(), a.ranks));
    a.talk = world.rank() == 0;
    const sim::PlanSearch s = search_and_print(a);
    if (s.fitting.empty())
      throw std::runtime_error("plan --run: no configuration fits " + std::to_string(s.smallest.peak_bytes));
    const sim::Candidate& best = s.fitting.front();
    const train::TrainConfig tc = train_config_of(a, best.config);
    const train::TrainSummary run = train::run_training(tc, world, memory);
    if (run.exit_code != 0) throw std::runtime_error("plan --run: training stopped: " + run.stop_reason);
    if (world.rank() == 0) print_predicted_and_measured(best, tc.out);
    return 0;
  });
}

}  // namespace shardlm::cli
