// `shardlm simulate | calibrate | plan`.
#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <malloc.h>
#include <nlohmann/json.hpp>

#include "cli/environment.h"
#include "cli/subcommands.h"
#include "kernels/backend.h"
#include "kernels/cpu.h"
#include "run/calibrate.h"
#include "sim/hardware.h"
#include "sim/planner.h"
#include "sim/simulator.h"
#include "trace/trace.h"
#include "train/trainer.h"

namespace shardlm::cli {

namespace {

// --moe-imbalance as the cost model takes it: 1 (balanced routing) unless given, and only for a
// mixture-of-experts model. simulate and plan read no run, so the figure is the user's (a run's
// metrics.jsonl has expert_load_max per step: over the mean B·T·k/E it is this figure).
double expert_load_of(double moe_imbalance, const model::ModelDesc& desc) {
  if (moe_imbalance == 0) return 1;
  if (desc.config.family != model::Family::moe)
    throw std::invalid_argument("--moe-imbalance: the model has no experts (a mixture-of-experts model only)");
  return moe_imbalance;
}

std::string expert_load_note(double moe_imbalance) {
  return moe_imbalance == 0 ? "1 (default: balanced routing; --moe-imbalance F sets a run's max/mean expert load)"
                            : fmt::format("{:.3g} (--moe-imbalance)", moe_imbalance);
}

nlohmann::json mem_json(const MemSnapshot& s) {
  nlohmann::json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

// `plan`: the planner's ranked table of the configurations that fit (printed when `talk`).
sim::PlanSearch search_and_print(PlanArgs& a) {
  a.cfg.data = "-";
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  sim::PlanQuery q;
  q.ranks = a.ranks, q.global_tokens = a.global_batch, q.seq = a.cfg.seq, q.threads = a.cfg.threads;
  q.memory_budget = a.memory >= 0 ? static_cast<int64_t>(a.memory) : hw.device_memory;
  q.expert_load = expert_load_of(a.moe_imbalance, desc);
  // The search builds and drops thousands of plans of a few MB: keep their pages in the heap
  // instead of mapping and unmapping them each time (a third of the search's time otherwise).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const sim::PlanSearch s = sim::search_plans(desc, train::plan_config(a.cfg, a.ranks), hw, q);
  if (!a.talk) return s;
  if (s.fitting.empty())
    throw std::runtime_error(fmt::format("plan: no configuration of {} on {} rank(s) fits {} bytes per rank; the smallest of {} "
                                         "needs {} ({})",
                                         a.cfg.model, a.ranks, q.memory_budget, s.considered, s.smallest.peak_bytes,
                                         s.smallest.flags));
  fmt::print("plan: {} on {} rank(s) x {} thread(s), {} tokens per step, {}: {} configurations simulated, {} fit {} "
             "(+{} refined by keeping units gathered)\n",
             a.cfg.model, a.ranks, a.cfg.threads, a.global_batch, hw.name, s.considered, s.fitting.size() - s.refined,
             q.memory_budget ? fmt::format("{:.3f} GiB per rank", q.memory_budget / 1073741824.0) : "(no memory limit)",
             s.refined);
  if (desc.config.family == model::Family::moe)
    fmt::print("mixture of experts: ep searched over the divisors of {} experts dividing {} rank(s); expert load max/mean {}\n",
               desc.config.n_experts, a.ranks, expert_load_note(a.moe_imbalance));
  fmt::print("{:>4}  {:>12}  {:>12}  {:>6}  {:>10}  {}\n", "rank", "step ms", "tokens/s", "MFU", "mem GiB", "flags");
  for (int i = 0; i < std::min<int>(a.top, static_cast<int>(s.fitting.size())); ++i) {
    const sim::Candidate& c = s.fitting[i];
    fmt::print("{:>4}  {:>12.3f}  {:>12.0f}  {:>5.1f}%  {:>10.3f}  {}\n", i + 1, c.step_ms, c.tokens_per_s, 100 * c.mfu,
               c.peak_bytes / 1073741824.0, c.flags);
  }
  return s;
}

// The best configuration as train options over the model options of `a`.
train::TrainConfig train_config_of(const PlanArgs& a, const plan::PlanConfig& c) {
  train::TrainConfig tc = a.cfg;
  tc.strategy = plan::to_string(c.strategy);
  tc.shard_group = c.shard_group;
  tc.ep = c.ep;
  tc.batch = c.batch, tc.grad_accum = c.grad_accum, tc.seq = c.seq;
  tc.recompute = model::to_string(c.recompute);
  tc.prefetch_forward = c.prefetch_forward, tc.prefetch_backward = c.prefetch_backward;
  tc.max_gathers_in_flight = c.max_gathers_in_flight;
  tc.bucket_mb = c.bucket_mb;
  tc.gather_bucket_mb = c.gather_bucket_mb;
  tc.param_dtype = c.param_bytes == 2 ? "bf16" : "fp32";
  tc.reduce_dtype = c.reduce_bytes == 2 ? "bf16" : "fp32";
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

}  // namespace

// `simulate`: the plan `train` would run at --ranks, priced on a hardware profile. Nothing of
// the model is allocated, so shapes far beyond this machine simulate in milliseconds.
void run_simulate(SimulateArgs& a) {
  a.cfg.data = "-";  // simulate reads no data
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware, hardware_dir());
  sim::require_collectives(hw, a.ranks);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  const plan::Plan plan = plan::build_plan(desc, sim::for_hardware(train::plan_config(a.cfg, a.ranks), hw));
  const double expert_load = expert_load_of(a.moe_imbalance, desc);
  const sim::SimResult r = sim::simulate(desc, plan, hw, a.cfg.threads, expert_load);
  const bool moe = desc.config.family == model::Family::moe;
  if (!a.trace.empty()) trace::write_trace(a.trace, {sim::to_trace(desc, plan, r).events_json()});
  const bool fits = hw.device_memory == 0 || r.mem.total <= hw.device_memory;
  if (a.json) {
    nlohmann::json j{{"model", a.cfg.model},       {"strategy", plan::to_string(plan.config.strategy)},
                     {"ranks", a.ranks},           {"hardware", hw.name},
                     {"step_ms", r.step_ms},       {"tokens_per_s", r.tokens_per_s},
                     {"mfu", r.mfu},               {"comm_exposed_ms", r.comm_exposed_ms},
                     {"compute_busy_ms", r.compute_busy_ms}, {"comm_busy_ms", r.comm_busy_ms},
                     {"mem", mem_json(r.mem)},     {"mem_max", mem_json(r.mem_max)},
                     {"device_memory", hw.device_memory}, {"fits", fits}};
    if (plan.config.cp > 1) {
      j["cp"] = plan.config.cp;
      j["exchange_busy_ms"] = r.exchange_busy_ms;
      j["exchange_exposed_ms"] = r.exchange_exposed_ms;
    }
    if (moe) {
      j["ep"] = plan.config.ep;
      j["moe_imbalance"] = expert_load;
      j["exchange_busy_ms"] = r.exchange_busy_ms;
      j["exchange_exposed_ms"] = r.exchange_exposed_ms;
    }
    std::cout << j.dump() << "\n";
    return;
  }
  const double peak = hw.peak_flops * (hw.per_thread ? a.cfg.threads : 1);
  fmt::print("simulated: model {}, strategy {}, {} rank(s) on {} ({} peak {:.4g} TFLOP/s per rank, GEMM efficiency {:.3g})\n",
             a.cfg.model, plan::to_string(plan.config.strategy), a.ranks, hw.name, hw.compute_dtype, peak / 1e12,
             hw.gemm_efficiency);
  fmt::print("step {:.3f} ms | {:.0f} tokens/s | MFU {:.1f}% | comm exposed {:.3f} ms (compute busy {:.3f} ms, comm busy {:.3f} ms)\n",
             r.step_ms, r.tokens_per_s, 100 * r.mfu, r.comm_exposed_ms, r.compute_busy_ms, r.comm_busy_ms);
  const double pct = r.step_ms > 0 ? 100 / r.step_ms : 0;
  if (plan.config.cp > 1)  // the attention's exchanges, and a MoE block's routing counts and routed rows
    fmt::print("exchanges (cp {} {}{}): {:.3f} ms in exchange tasks ({:.1f}% of the step), {:.3f} ms exposed ({:.1f}% of "
               "the step)\n",
               plan.config.cp, model::to_string(plan.config.cp_impl),
               plan.config.ep > 1 ? fmt::format(", ep {}", plan.config.ep) : std::string(), r.exchange_busy_ms,
               r.exchange_busy_ms * pct, r.exchange_exposed_ms, r.exchange_exposed_ms * pct);
  if (moe && plan.config.cp == 1) {
    if (plan.config.ep > 1)
      fmt::print("all-to-all (ep {} exchanges): {:.3f} ms in exchange tasks ({:.1f}% of the step), {:.3f} ms exposed ({:.1f}% of "
                 "the step); expert load max/mean {}\n",
                 plan.config.ep, r.exchange_busy_ms, r.exchange_busy_ms * pct, r.exchange_exposed_ms,
                 r.exchange_exposed_ms * pct, expert_load_note(a.moe_imbalance));
    else
      fmt::print("all-to-all: none (ep 1: every rank runs every expert; --ep K splits them)\n");
  }
  fmt::print("memory per rank at peak (bytes):\n");
  for (int c = 0; c < kNumMemCategories; ++c)
    if (r.mem.bytes[c] > 0 || r.mem_max.bytes[c] > 0)
      fmt::print("  {}: {} ({:.1f} MiB), own peak {}\n", to_string(static_cast<MemCategory>(c)), r.mem.bytes[c],
                 r.mem.bytes[c] / 1048576.0, r.mem_max.bytes[c]);
  fmt::print("  total: {} ({:.2f} GiB){}\n", r.mem.total, r.mem.total / 1073741824.0,
             hw.device_memory == 0 ? std::string()
                                   : fmt::format(", device memory {:.0f} GiB: {}", hw.device_memory / 1073741824.0,
                                                 fits ? "fits" : "does NOT fit"));
}

// `calibrate`: every rank measures (collectives span the world); rank 0 writes the profile.
// The profile is read back as simulate reads it before it is written (a figure simulate would
// refuse is an error here, not a file), and written to a temporary name renamed into place.
int run_calibrate(const run::CalibrateOptions& co, const std::string& out) {
  run::check_calibrate_options(co);  // before MPI: a bad flag is one line, not an aborted job
  return on_world([&](comm::Communicator& world, MemoryPool& memory) {
    const std::string text = run::calibrate(*kernels::make_cpu_backend(memory), world, co);
    if (world.rank() == 0) {
      try {
        sim::parse_hardware(text, out);
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("calibrate: nothing written: ") + e.what());
      }
      const std::string tmp = out + ".tmp";
      std::ofstream f(tmp);
      f << text << "\n";
      f.close();
      std::error_code ec;
      if (f) std::filesystem::rename(tmp, out, ec);
      if (!f || ec) {
        std::filesystem::remove(tmp, ec);
        throw std::runtime_error("calibrate: cannot write " + out);
      }
      fmt::print("calibrate: wrote {} ({} rank(s) x {} thread(s)){}\n", out, world.size(), co.threads,
                 world.size() > 1 ? "" : "; one rank has no collectives to time: the profile simulates one rank "
                                         "(mpirun -np N calibrate for more)");
    }
    return 0;
  });
}

// `plan --run`: every rank searches (the search is deterministic), trains the best for a few
// steps, and rank 0 prints predicted against measured (median step after 2 untimed).
int run_plan(PlanArgs& a) {
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
