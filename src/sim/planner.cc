#include "sim/planner.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "plan/mesh.h"
#include "plan/options.h"
#include "sim/bounds.h"
#include "sim/cost.h"

namespace shardlm::sim {

using plan::PlanConfig;
using plan::Strategy;

std::string flags_of(const PlanConfig& c) { return plan::reproduce_flags(c); }

SimResult simulate_config(const model::ModelDesc& desc, const PlanConfig& c, const HardwareProfile& hw, int threads,
                          double expert_load) {
  SimResult r = simulate(desc, plan::build_plan(desc, c), hw, threads, expert_load);
  r.times.clear(), r.runs.clear();  // the planner keeps thousands of results
  return r;
}

PrefetchChoice choose_offload_prefetch(const model::ModelDesc& desc, PlanConfig config, const HardwareProfile& hw,
                                       int threads, double expert_load) {
  PrefetchChoice out;
  std::exception_ptr shallowest;
  for (int d = 0; d <= kMaxOffloadPrefetch; ++d) {
    config.offload.prefetch = d;
    double ms = -1;
    try {
      ms = simulate_config(desc, config, hw, threads, expert_load).step_ms;
    } catch (const std::invalid_argument&) {
      if (!shallowest) shallowest = std::current_exception();
    }
    out.step_ms.push_back(ms);
    if (ms >= 0 && (out.step_ms[out.depth] < 0 || ms < out.step_ms[out.depth])) out.depth = d;
  }
  if (out.step_ms[out.depth] < 0) std::rethrow_exception(shallowest);
  return out;
}

namespace {

// Where a configuration sits among those that differ from it only in knobs whose every step up
// can only add memory: a larger micro-batch, less recompute, deeper prefetch, more gathers in
// flight, units kept gathered, larger all-gather buckets. (bf16 gathers and reductions are not
// among them: they halve a buffer but add a cast copy. Nor is the step from accumulating to one
// micro-batch: a sharded-gradient strategy keeps every unit's full gradients between micro-steps,
// which one micro-batch does not, so whether it accumulates is part of the family.) If a
// configuration does not fit, nothing above it in its family does (Planner.PruningByMemory...
// holds the search to the exhaustive one), so the search never builds those.
struct Lattice {
  std::vector<int> family;  // the knobs outside the order
  std::vector<int> steps;   // each ordered knob's index, in the order its memory grows
  int level() const {
    int l = 0;
    for (int v : steps) l += v;
    return l;
  }
};

// Every configuration of one strategy the search tries, handed to `visit`. bf16 gathers and
// reductions only where the profile computes in bf16 (a GPU): on an fp32 CPU profile their cost
// is mostly CPU work (casts, a hand-written bf16 sum beside the compute threads) that the model
// does not price, so a search there would take them for free.
template <class F>
void each_config(const PlanConfig& base, Strategy s, int64_t sequences_per_rank, bool bf16_collectives,
                 const std::vector<int>& eps, const std::vector<model::Recompute>& recomputes, F visit) {
  auto index_of = [](const auto& values, auto v) {
    return static_cast<int>(std::find(values.begin(), values.end(), v) - values.begin());
  };
  PlanConfig c = base;
  c.strategy = s;
  const bool sharded = s == Strategy::fsdp || s == Strategy::hybrid;
  // --reduce-each-micro-step, where given, applies to the strategies that shard gradients (the
  // search does not choose it: see docs/parallelism.md).
  c.reduce_each_micro_step = base.reduce_each_micro_step && (sharded || s == Strategy::zero2);
  std::vector<int> groups{0};
  if (s == Strategy::hybrid) {
    groups.clear();
    for (int g = 2; g < c.world; ++g)
      if (c.world % g == 0) groups.push_back(g);
  }
  // Each knob's values in the order its memory grows (Lattice; `recomputes` too).
  const std::vector<int> prefetches = sharded ? std::vector<int>{1, 2} : std::vector<int>{1};
  const std::vector<int> inflights = sharded ? std::vector<int>{2, 3, 4} : std::vector<int>{2};
  const std::vector<int> param_bytes = sharded && bf16_collectives ? std::vector<int>{4, 2} : std::vector<int>{4};
  const std::vector<int> reduce_bytes = c.world > 1 && bf16_collectives ? std::vector<int>{4, 2} : std::vector<int>{4};
  const std::vector<double> gather_buckets{0, 25, 100};
  int batch_index = 0;
  for (int64_t B = 1; B <= sequences_per_rank; ++B) {
    if (sequences_per_rank % B) continue;
    for (int ep : eps)
      for (int g : groups)
        for (double bucket : sharded ? std::vector<double>{25} : std::vector<double>{25, 100})
          for (auto r : recomputes)
            for (int pf : prefetches)
              for (int inflight : inflights)
                for (int pb : param_bytes)
                  for (int rb : reduce_bytes)
                    for (bool keep : sharded ? std::vector<bool>{false, true} : std::vector<bool>{false})
                      // All-gather buckets when no unit is kept (keeping all leaves one gather per
                      // unit a step), at the first prefetch depth and gather limit only: a bucket
                      // counts as one gather there, and the grid stays within the search's time.
                      for (double gather_bucket : sharded && !keep && pf == 1 && inflight == 2 ? gather_buckets
                                                                                          : std::vector<double>{0}) {
                        c.keep_gathered = keep ? std::vector<std::string>{"all"} : std::vector<std::string>{};
                        c.gather_bucket_mb = gather_bucket;
                        c.ep = ep;
                        c.shard_group = g, c.batch = B, c.grad_accum = sequences_per_rank / B, c.recompute = r;
                        c.prefetch_forward = c.prefetch_backward = pf, c.max_gathers_in_flight = inflight;
                        c.bucket_mb = bucket, c.param_bytes = pb, c.reduce_bytes = rb;
                        Lattice at;
                        // Compression is a family of its own (it keeps less but adds scratch), in
                        // which recompute is no order of memory either: what a mode rebuilds is
                        // rebuilt in fp32, what it keeps is int8, so with few blocks keeping all
                        // (none) can take less than rebuilding part (selective).
                        const int recompute_step = index_of(recomputes, r);
                        const bool compressed = c.act_quant.on();
                        at.family = {static_cast<int>(s), c.cp, static_cast<int>(c.cp_impl), ep, g, static_cast<int>(bucket), pb, rb,
                                     c.grad_accum > 1 ? 1 : 0, compressed ? 1 + recompute_step : 0};
                        at.steps = {batch_index, compressed ? 0 : recompute_step, index_of(prefetches, pf),
                                    index_of(inflights, inflight), keep ? 1 : 0, index_of(gather_buckets, gather_bucket)};
                        visit(c, at);
                      }
    ++batch_index;
  }
}

}  // namespace

namespace {

// Runs work(i) for i in [0, n) on one worker thread per core (the items share nothing); rethrows
// the first exception.
template <class F>
void parallel_for(size_t n, F work) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::exception_ptr failure;
  auto run = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failure) failure = std::current_exception();
        next = n;
      }
    }
  };
  const unsigned workers = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16));
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < std::min<size_t>(workers, n); ++w) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// What the search learnt of one configuration of its grid.
struct Outcome {
  enum class State { pending, refused, pruned, bounded, too_big, simulated } state = State::pending;
  SimResult result;  // too_big: its memory only
};

void build_and_simulate(const model::ModelDesc& desc, const PlanConfig& c, const HardwareProfile& hw, const PlanQuery& q,
                        Outcome& o);

// The grid's configurations by their place in the lattice (family, steps).
using LatticeIndex = std::map<std::pair<std::vector<int>, std::vector<int>>, size_t>;

// True when a configuration one step below i on some axis is known not to fit (too big, or pruned
// for that): i needs at least as much memory, so it does not fit either.
bool above_too_big(size_t i, const std::vector<Lattice>& at, const LatticeIndex& index, const std::vector<Outcome>& out) {
  std::vector<int> below = at[i].steps;
  for (int& v : below) {
    if (v == 0) continue;
    --v;
    const auto it = index.find({at[i].family, below});
    ++v;
    if (it != index.end() && (out[it->second].state == Outcome::State::too_big || out[it->second].state == Outcome::State::pruned))
      return true;
  }
  return false;
}

// Each configuration built and, where its peak fits the budget, simulated; with `prune`, one above
// a configuration that does not fit (Lattice) is pruned, never built. Levels of the lattice in
// turn, each on one worker thread per core; in the grid's order, whatever the threads.
std::vector<Outcome> evaluate(const model::ModelDesc& desc, const std::vector<PlanConfig>& grid,
                              const std::vector<Lattice>& at, const HardwareProfile& hw, const PlanQuery& q, bool prune) {
  using State = Outcome::State;
  std::vector<Outcome> out(grid.size());
  LatticeIndex index;
  int levels = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    index[{at[i].family, at[i].steps}] = i;
    levels = std::max(levels, at[i].level() + 1);
  }
  std::vector<std::vector<size_t>> by_level(levels);  // one walk of the grid
  for (size_t i = 0; i < grid.size(); ++i) by_level[at[i].level()].push_back(i);
  for (int level = 0; level < levels; ++level) {
    std::vector<size_t> now;
    for (size_t i : by_level[level]) {
      if (prune && q.memory_budget > 0 && above_too_big(i, at, index, out)) out[i].state = State::pruned;
      else now.push_back(i);
    }
    parallel_for(now.size(), [&](size_t k) { build_and_simulate(desc, grid[now[k]], hw, q, out[now[k]]); });
  }
  return out;
}

// Builds and, where it fits, simulates grid[i] into out[i] (any thread).
void build_and_simulate(const model::ModelDesc& desc, const PlanConfig& c, const HardwareProfile& hw, const PlanQuery& q,
                        Outcome& o) {
  using State = Outcome::State;
  try {
    const plan::Plan p = plan::build_plan(desc, c);
    o.result.mem = p.peak_memory();
    if (q.memory_budget > 0 && o.result.mem.total > q.memory_budget) {
      o.state = State::too_big;
      return;
    }
    o.result = simulate(desc, p, hw, q.threads, q.expert_load);
    o.result.times.clear(), o.result.runs.clear();  // the planner keeps thousands of results
    o.state = State::simulated;
  } catch (const std::invalid_argument&) {
    o.state = State::refused;  // a combination the builder refuses (e.g. prefetch beyond the gathers in flight)
  }
}

}  // namespace

namespace {

// Each configuration's StepBounds, from one frame per mesh and strategy and one ComputeBounds per
// frame, micro-batch, accumulation and recompute (what is costly); nullopt where its frame is
// refused (so is its plan).
std::vector<std::optional<StepBounds>> bound_each(const model::ModelDesc& desc, const std::vector<PlanConfig>& grid,
                                                  const HardwareProfile& hw, const PlanQuery& q) {
  std::map<std::vector<int>, std::optional<BoundsFrame>> frames;
  std::map<std::vector<int64_t>, size_t> compute_of;
  std::vector<std::pair<size_t, const BoundsFrame*>> computed_for;  // a configuration of each, and its frame
  std::vector<const BoundsFrame*> frame_of(grid.size(), nullptr);
  std::vector<size_t> compute_index(grid.size(), 0);
  for (size_t i = 0; i < grid.size(); ++i) {
    const PlanConfig& c = grid[i];
    const std::vector<int> frame_key{static_cast<int>(c.strategy), c.shard_group, c.ep, c.cp, static_cast<int>(c.cp_impl), c.world};
    auto f = frames.find(frame_key);
    if (f == frames.end()) {
      PlanConfig laid = c;  // dtypes lay out nothing (the builder refuses a bad one, not the frame)
      laid.param_bytes = laid.reduce_bytes = 4;
      std::optional<BoundsFrame> frame;
      try {
        frame = bounds_frame(desc, plan::plan_frame(desc, laid), hw);
      } catch (const std::invalid_argument&) {
      }
      f = frames.emplace(frame_key, std::move(frame)).first;
    }
    if (!f->second) continue;
    frame_of[i] = &*f->second;
    std::vector<int64_t> key(frame_key.begin(), frame_key.end());
    key.insert(key.end(), {c.batch, c.grad_accum, static_cast<int>(c.recompute), c.reduce_each_micro_step ? 1 : 0});
    const auto [k, fresh] = compute_of.emplace(std::move(key), computed_for.size());
    if (fresh) computed_for.emplace_back(i, frame_of[i]);
    compute_index[i] = k->second;
  }
  std::vector<ComputeBounds> computed(computed_for.size());
  parallel_for(computed.size(), [&](size_t k) {
    computed[k] = compute_bounds(desc, *computed_for[k].second, grid[computed_for[k].first], hw, q.threads, q.expert_load);
  });
  std::vector<std::optional<StepBounds>> out(grid.size());
  for (size_t i = 0; i < grid.size(); ++i)
    if (frame_of[i]) out[i] = step_bounds(desc, *frame_of[i], grid[i], computed[compute_index[i]], hw);
  return out;
}

// The pruned search with branch and bound (PlanQuery::top), no plan built for a bound
// (bound_each). One whose peak bound is above the budget is pruned; the rest, by their step bound
// (then lattice level), are built and simulated in small parallel batches while the bound is at
// most the bar: the top-th fastest distinct prediction so far, or for a sharded configuration
// without units kept (those keep_greedily refines) the third fastest of those if that is higher.
// The first above both ends the search: it and everything after could enter neither.
std::vector<Outcome> evaluate_bounded(const model::ModelDesc& desc, const std::vector<PlanConfig>& grid,
                                      const std::vector<Lattice>& at, const HardwareProfile& hw, const PlanQuery& q) {
  using State = Outcome::State;
  std::vector<Outcome> out(grid.size());
  const std::vector<std::optional<StepBounds>> bounds = bound_each(desc, grid, hw, q);
  std::vector<StepBounds> bound(grid.size());
  std::vector<size_t> order;
  LatticeIndex index;  // of those the frame takes (one it refuses says nothing of those above it)
  for (size_t i = 0; i < grid.size(); ++i) {
    if (!bounds[i]) {
      out[i].state = State::refused;
      continue;
    }
    index[{at[i].family, at[i].steps}] = i;
    bound[i] = *bounds[i];
    if (q.memory_budget > 0 && bound[i].peak_bytes > q.memory_budget) out[i].state = State::pruned;
    else order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return bound[a].step_ms() < bound[b].step_ms() || (bound[a].step_ms() == bound[b].step_ms() && at[a].level() < at[b].level());
  });
  // The bars: the top-th fastest distinct (step, memory) prediction, and the third fastest sharded
  // configuration without units kept (counting alike ones, as keep_greedily's pick does).
  const auto inf = std::numeric_limits<double>::infinity();
  std::set<std::pair<double, int64_t>> best;
  std::multiset<double> sharded;
  auto refinable = [&](const PlanConfig& c) {
    return (c.strategy == Strategy::fsdp || c.strategy == Strategy::hybrid) && c.keep_gathered.empty();
  };
  // The top rows: at least kFewerRebuiltRows of them, which recompute_fewer refines.
  const size_t top = std::max<size_t>(q.top, kFewerRebuiltRows);
  auto note = [&](size_t i) {
    const SimResult& r = out[i].result;
    best.insert({r.step_ms, r.mem.total});
    if (best.size() > top) best.erase(std::prev(best.end()));
    if (refinable(grid[i])) {
      sharded.insert(r.step_ms);
      if (sharded.size() > 3) sharded.erase(std::prev(sharded.end()));
    }
  };
  // A configuration is wanted while its bound is at most the top bar, or, sharded without units
  // kept, the refine bar; the search ends at the first above both.
  auto top_bar = [&] { return best.size() < top ? inf : std::prev(best.end())->first; };
  auto refine_bar = [&] { return sharded.size() < 3 ? inf : *std::prev(sharded.end()); };
  const size_t batch = 4 * std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  size_t next = 0;
  for (bool past_both = false; !past_both && next < order.size();) {
    std::vector<size_t> now;
    for (; next < order.size() && now.size() < batch; ++next) {
      const size_t i = order[next];
      const double b = bound[i].step_ms();
      if ((past_both = b > std::max(top_bar(), refine_bar()))) break;
      if (b > top_bar() && !refinable(grid[i])) out[i].state = State::bounded;
      else if (q.memory_budget > 0 && above_too_big(i, at, index, out)) out[i].state = State::pruned;
      else now.push_back(i);
    }
    parallel_for(now.size(), [&](size_t j) { build_and_simulate(desc, grid[now[j]], hw, q, out[now[j]]); });
    for (size_t i : now)
      if (out[i].state == State::simulated) note(i);
  }
  for (; next < order.size(); ++next) out[order[next]].state = State::bounded;
  return out;
}

void rank(std::vector<Candidate>& v) {
  std::stable_sort(v.begin(), v.end(), [](const Candidate& a, const Candidate& b) {
    // Equal times (prefetch depths that change nothing): the one that needs less memory.
    return a.step_ms < b.step_ms || (a.step_ms == b.step_ms && a.peak_bytes < b.peak_bytes);
  });
}

// Ranked candidates with the same step time and memory as the one before them are folded into it.
void collapse_alike(std::vector<Candidate>& v) {
  std::vector<Candidate> out;
  for (Candidate& k : v) {
    if (!out.empty() && out.back().step_ms == k.step_ms && out.back().peak_bytes == k.peak_bytes) {
      out.back().alike += 1 + k.alike;
      continue;
    }
    out.push_back(std::move(k));
  }
  v = std::move(out);
}

}  // namespace

Candidate recompute_fewer(const model::ModelDesc& desc, const HardwareProfile& hw, const PlanQuery& q, Candidate start) {
  const int L = desc.config.n_layer;
  const int rebuilt = start.config.recompute_blocks < 0 ? L : start.config.recompute_blocks;
  if (start.config.recompute == model::Recompute::none || q.memory_budget == 0 || rebuilt <= 1) return start;
  auto on = [&](int blocks) {
    PlanConfig c = start.config;
    c.recompute_blocks = blocks;
    const SimResult r = simulate_config(desc, c, hw, q.threads, q.expert_load);
    return Candidate{c, r.step_ms, r.tokens_per_s, r.mfu, r.comm_exposed_ms, r.mem.total, flags_of(c)};
  };
  // `fits` rebuilds `rebuilt` blocks and fits; fewer than lo + 1 were not tried (none is its own
  // configuration in the grid).
  Candidate fits = start;
  int lo = 0, hi = rebuilt;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    Candidate k = on(mid);
    if (k.peak_bytes <= q.memory_budget) hi = mid, fits = std::move(k);
    else lo = mid;
  }
  return fits.step_ms < start.step_ms ? fits : start;
}

Candidate keep_greedily(const model::ModelDesc& desc, const HardwareProfile& hw, const PlanQuery& q, Candidate best) {
  auto with = [&](const Candidate& from, const std::string& entry) {
    PlanConfig c = from.config;
    c.keep_gathered.push_back(entry);
    const SimResult r = simulate_config(desc, c, hw, q.threads, q.expert_load);
    return Candidate{c, r.step_ms, r.tokens_per_s, r.mfu, r.comm_exposed_ms, r.mem.total, flags_of(c)};
  };
  auto fits = [&](const Candidate& k) { return q.memory_budget == 0 || k.peak_bytes <= q.memory_budget; };
  // Each unit's own saving per byte, measured once against the start, whether it fits or not.
  struct Option {
    int unit;
    double ms_per_byte;
  };
  const int U = static_cast<int>(desc.units.size());
  std::vector<Candidate> alone(U);
  parallel_for(U, [&](size_t u) { alone[u] = with(best, desc.units[u].name); });
  std::vector<Option> options;
  for (int u = U - 1; u >= 0; --u) {
    const Candidate& k = alone[u];
    if (k.step_ms < best.step_ms)
      options.push_back({u, (best.step_ms - k.step_ms) / static_cast<double>(std::max<int64_t>(1, k.peak_bytes - best.peak_bytes))});
  }
  std::stable_sort(options.begin(), options.end(), [](const Option& a, const Option& b) { return a.ms_per_byte > b.ms_per_byte; });
  for (const Option& o : options) {
    const std::string& name = desc.units[o.unit].name;
    const Candidate k = with(best, name);
    if (!(k.step_ms < best.step_ms)) continue;
    if (fits(k)) {
      best = k;
      continue;
    }
    // The whole unit does not fit: the largest part of it, in eighths, that fits the budget left.
    const double left = static_cast<double>(q.memory_budget - best.peak_bytes);
    const double price = static_cast<double>(k.peak_bytes - best.peak_bytes);
    for (int eighths = std::min(7, static_cast<int>(8 * left / price)); eighths >= 1; --eighths) {
      std::ostringstream part;
      part << name << ':' << eighths / 8.0;  // h.3:0.375
      const Candidate p = with(best, part.str());
      if (p.step_ms < best.step_ms && fits(p)) {
        best = p;
        break;
      }
    }
  }
  return best;
}

namespace {

// The disk tier's configurations (PlanQuery::disk_budget): the strategy it runs (fsdp; ddp on one
// rank), each micro-batch dividing the rank's sequences over at most kMaxDiskMicroSteps micro-steps
// (such a plan lists every one; fsdp reduces each, so whole gradients live one micro-step and the
// budget can move the rest), each recompute mode, gather prefetch depth and disk read-ahead depth,
// each ep; q.memory_budget as their --memory-budget. A few hundred at most, each a few plan builds
// (the placement pass's), so they are built and simulated one by one.
constexpr int64_t kMaxDiskMicroSteps = 8;

// Builds and simulates one disk-tier configuration into `out` (counted; kept when its files fit
// q.disk_budget).
void try_disk_tier(const model::ModelDesc& desc, const PlanConfig& c, const HardwareProfile& hw, const PlanQuery& q,
                   PlanSearch& out) {
  ++out.considered, ++out.on_disk;
  plan::Plan p;
  try {
    p = plan::build_plan(desc, c);
  } catch (const std::invalid_argument&) {  // refused, or nothing on disk fits the budget
    ++out.invalid;
    return;
  }
  ++out.built;
  const SimResult r = simulate(desc, p, hw, q.threads, q.expert_load);
  Candidate k{c, r.step_ms, r.tokens_per_s, r.mfu, r.comm_exposed_ms, r.mem.total, flags_of(c), p.disk_bytes()};
  if (out.smallest.peak_bytes < 0 || k.peak_bytes < out.smallest.peak_bytes) out.smallest = k;
  if (k.disk_bytes > q.disk_budget) return;
  ++out.simulated;
  out.fitting.push_back(std::move(k));
}

void search_disk_tier(const model::ModelDesc& desc, const PlanConfig& b, const HardwareProfile& hw, const PlanQuery& q,
                      const std::vector<int>& eps, PlanSearch& out) {
  PlanConfig c = b;
  c.strategy = q.ranks == 1 ? Strategy::ddp : Strategy::fsdp;
  c.memory_budget = q.memory_budget;
  const std::vector<int> gather_depths = c.strategy == Strategy::fsdp ? std::vector<int>{1, 2} : std::vector<int>{1};
  const int64_t sequences = q.global_tokens / (static_cast<int64_t>(q.ranks) * q.seq);
  for (int64_t accum = 1; accum <= std::min(sequences, kMaxDiskMicroSteps); ++accum) {
    if (sequences % accum != 0) continue;
    c.batch = sequences / accum, c.grad_accum = accum;
    c.reduce_each_micro_step = accum > 1 && c.strategy == Strategy::fsdp;
    for (int ep : eps)
      for (model::Recompute r : {model::Recompute::full, model::Recompute::selective, model::Recompute::none})
        for (int pf : gather_depths)
          for (int depth = 0; depth <= kMaxOffloadPrefetch; ++depth) {
            c.ep = ep, c.recompute = r, c.prefetch_forward = c.prefetch_backward = pf, c.offload.prefetch = depth;
            try_disk_tier(desc, c, hw, q, out);
          }
  }
}

}  // namespace

PlanSearch search_plans(const model::ModelDesc& desc, const PlanConfig& base, const HardwareProfile& hw,
                        const PlanQuery& q) {
  const int64_t per_step = static_cast<int64_t>(q.ranks) * q.seq;
  if (q.global_tokens <= 0 || q.global_tokens % per_step != 0)
    throw std::invalid_argument("--global-batch: " + std::to_string(q.global_tokens) + " tokens is not a whole number of " +
                                std::to_string(q.seq) + "-token sequences on each of " + std::to_string(q.ranks) + " ranks");
  if (q.global_tokens / per_step > kMaxSequencesPerRank)
    throw std::invalid_argument("--global-batch: " + std::to_string(q.global_tokens) + " tokens is " +
                                std::to_string(q.global_tokens / per_step) + " sequences of " + std::to_string(q.seq) +
                                " tokens on each of " + std::to_string(q.ranks) + " ranks; at most " +
                                std::to_string(kMaxSequencesPerRank) + " (the search tries each micro-batch dividing them)");
  PlanConfig b = for_hardware(base, hw);
  b.world = q.ranks, b.seq = q.seq, b.threads = q.threads, b.act_quant = {};
  PlanSearch out;
  out.smallest.peak_bytes = -1;
  const std::vector<Strategy> strategies =
      q.ranks == 1 ? std::vector<Strategy>{Strategy::ddp}
                   : std::vector<Strategy>{Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid};
  // Expert parallelism: each ep dividing the experts and the ranks (the builder refuses the rest,
  // e.g. an ep that does not divide a hybrid shard group).
  std::vector<int> eps{1};
  if (desc.config.family == model::Family::moe)
    for (int ep = 2; ep <= q.ranks && ep <= desc.config.n_experts; ++ep)
      if (desc.config.n_experts % ep == 0 && q.ranks % ep == 0) eps.push_back(ep);
  // The recompute modes in the order their memory grows: selective_op keeps less than selective
  // (q and v, not q|k|v; the gate, not gate|up; no residual), on the blocks that have it, in fp32.
  const auto recomputes_at = [&](int cp, const model::ActQuant& aq) {
    if (desc.config.family == model::Family::llama && cp == 1 && !aq.on())
      return std::vector<model::Recompute>{model::Recompute::full, model::Recompute::selective_op, model::Recompute::selective,
                                           model::Recompute::none};
    return std::vector<model::Recompute>{model::Recompute::full, model::Recompute::selective, model::Recompute::none};
  };
  std::vector<model::ActQuant> activations{model::ActQuant{}};
  if (q.act_quant.on()) activations.push_back(q.act_quant);
  auto search = [&](const std::vector<std::pair<int, model::ContextImpl>>& cps) {
    std::vector<PlanConfig> grid;
    std::vector<Lattice> at;
    for (const auto& [cp, impl] : cps)
      for (const model::ActQuant& aq : activations) {
        PlanConfig bc = b;
        bc.cp = cp, bc.cp_impl = impl, bc.act_quant = aq;
        for (Strategy s : strategies)  // a cp group's K ranks share their sequences
          each_config(bc, s, q.global_tokens / per_step * cp, hw.compute_dtype == "bf16", eps, recomputes_at(cp, aq),
                      [&](const PlanConfig& c, const Lattice& l) { grid.push_back(c), at.push_back(l); });
      }
    std::vector<Outcome> outcomes =
        q.top > 0 && !q.exhaustive ? evaluate_bounded(desc, grid, at, hw, q) : evaluate(desc, grid, at, hw, q, !q.exhaustive);
    // Nothing fits: the bounds built none of what does not, so the smallest (which the answer
    // names) is found by building as the search without bounds does.
    if (q.top > 0 && !q.exhaustive &&
        std::none_of(outcomes.begin(), outcomes.end(), [](const Outcome& o) { return o.state == Outcome::State::simulated; }))
      outcomes = evaluate(desc, grid, at, hw, q, true);
    out.considered += static_cast<int64_t>(grid.size());
    for (size_t i = 0; i < grid.size(); ++i) {
      using State = Outcome::State;
      const Outcome& o = outcomes[i];
      out.pruned += o.state == State::pruned;
      out.bounded += o.state == State::bounded;
      out.invalid += o.state == State::refused;
      out.built += o.state == State::too_big || o.state == State::simulated;
      out.simulated += o.state == State::simulated;
      if (o.state != State::too_big && o.state != State::simulated) continue;
      const SimResult& r = o.result;
      Candidate k{grid[i], r.step_ms, r.tokens_per_s, r.mfu, r.comm_exposed_ms, r.mem.total, flags_of(grid[i])};
      if (out.smallest.peak_bytes < 0 || k.peak_bytes < out.smallest.peak_bytes) out.smallest = k;
      if (o.state == State::simulated) out.fitting.push_back(std::move(k));
    }
  };
  // Context parallelism: every cp (powers of two dividing the ranks) in both forms, as the
  // builder accepts them, beside cp 1. It shares a sequence's activations over cp ranks, so it
  // buys memory (less recompute, larger micro-batches) for its exchanges.
  // With PlanQuery::context_always they are searched beside cp 1; else only where nothing fits.
  std::vector<std::pair<int, model::ContextImpl>> cps;
  for (int cp = 2; cp <= q.ranks && cp <= kMaxContextSearch; cp *= 2)
    if (q.ranks % cp == 0)
      for (model::ContextImpl impl : {model::ContextImpl::ring, model::ContextImpl::all_to_all}) cps.push_back({cp, impl});
  if (q.context_always) {
    cps.insert(cps.begin(), {1, model::ContextImpl::ring});
    search(cps);
  } else {
    search({{1, model::ContextImpl::ring}});
    if (out.fitting.empty() && q.memory_budget > 0) search(cps);
  }
  if (out.fitting.empty() && q.memory_budget > 0 && q.disk_budget > 0)
    for (const model::ActQuant& aq : activations) {
      PlanConfig bc = b;
      bc.act_quant = aq;
      search_disk_tier(desc, bc, hw, q, eps, out);
    }
  rank(out.fitting);
  // Fewer blocks rebuilt, on those that recompute among the first kFewerRebuiltRows distinct
  // predictions (which a bounded search finds exactly, so it refines what the exhaustive one does).
  std::vector<Candidate> fewer;
  std::set<std::pair<double, int64_t>> rows;
  for (const Candidate& c : out.fitting) {
    rows.insert({c.step_ms, c.peak_bytes});
    if (rows.size() > static_cast<size_t>(kFewerRebuiltRows)) break;
    if (c.config.recompute == model::Recompute::none || c.config.memory_budget > 0) continue;
    Candidate k = recompute_fewer(desc, hw, q, c);
    if (k.step_ms < c.step_ms) fewer.push_back(std::move(k));
  }
  out.fewer_rebuilt = static_cast<int64_t>(fewer.size());
  for (auto& k : fewer) out.fitting.push_back(std::move(k));
  rank(out.fitting);
  // Selective unsharding, unit by unit, on the fastest few sharded configurations in memory.
  std::vector<Candidate> refined;
  for (size_t i = 0, tried = 0; i < out.fitting.size() && tried < 3; ++i) {
    const Candidate& c = out.fitting[i];
    if ((c.config.strategy != Strategy::fsdp && c.config.strategy != Strategy::hybrid) || !c.config.keep_gathered.empty() ||
        c.config.memory_budget > 0)
      continue;
    ++tried;
    Candidate k = keep_greedily(desc, hw, q, c);
    if (!k.config.keep_gathered.empty()) refined.push_back(std::move(k));
  }
  out.refined = static_cast<int64_t>(refined.size());
  for (auto& k : refined) out.fitting.push_back(std::move(k));
  rank(out.fitting);
  out.fit = static_cast<int64_t>(out.fitting.size());
  collapse_alike(out.fitting);
  return out;
}

LargestFit largest_model(const model::ModelConfig& model, const PlanConfig& base, const HardwareProfile& hw,
                         const PlanQuery& q) {
  if (q.memory_budget <= 0)
    throw std::invalid_argument("plan --largest-model: needs a memory budget (--memory-per-rank, or a profile's device memory)");
  std::map<int64_t, LargestFit> seen;
  auto fit = [&](int64_t layers) -> const LargestFit& {
    auto it = seen.find(layers);
    if (it != seen.end()) return it->second;
    model::ModelConfig m = model;
    m.n_layer = layers;
    const model::ModelDesc desc = model::describe(m);
    PlanSearch s = search_plans(desc, base, hw, q);
    LargestFit f;
    if (!s.fitting.empty()) f.n_layer = layers, f.params = desc.num_params(), f.best = std::move(s.fitting.front());
    return seen[layers] = std::move(f);
  };
  // Every parameter's value and both AdamW moments (12 bytes) are somewhere in the ranks' memory or
  // on their disks, so no depth past this fits (what keeps the searches off deep, slow plans).
  model::ModelConfig one = model, two = model;
  one.n_layer = 1, two.n_layer = 2;
  const double per_layer = static_cast<double>(model::describe(two).num_params() - model::describe(one).num_params());
  const double room = static_cast<double>(q.memory_budget + q.disk_budget) * q.ranks;
  const int64_t most = std::clamp<int64_t>(static_cast<int64_t>(room / (12 * std::max(per_layer, 1.0))), 1, kMaxLargestLayers);
  int64_t lo = 0, hi = std::min<int64_t>(std::max<int64_t>(model.n_layer, 1), most);  // lo fits, hi unknown
  while (fit(hi).n_layer > 0) {  // double until one does not fit
    lo = hi;
    if (hi == most) {
      LargestFit f = fit(hi);
      f.capped = hi == kMaxLargestLayers;
      return f;
    }
    hi = std::min(2 * hi, most);
  }
  while (hi - lo > 1) {  // lo fits (or is 0), hi does not
    const int64_t mid = lo + (hi - lo) / 2;
    (fit(mid).n_layer > 0 ? lo : hi) = mid;
  }
  return lo > 0 ? fit(lo) : LargestFit{};
}

}  // namespace shardlm::sim
