#include "plan/pipe_layout.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace shardlm::plan {

namespace {

// Contiguous runs of `cost` (one per block) into `parts` runs of at least one block, the most
// expensive run as cheap as possible; `first` and `last` are added to the first and last run.
// Returns each run's block count.
std::vector<int> balanced_runs(const std::vector<double>& cost, int parts, double first, double last) {
  const int L = static_cast<int>(cost.size());
  std::vector<double> prefix(L + 1, 0);
  for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + cost[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[p][i]: the cheapest most expensive run splitting blocks [0, i) into p runs; cut[p][i]: where the last run starts.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int p = 1; p <= parts; ++p)
    for (int i = p; i <= L; ++i)
      for (int j = p - 1; j < i; ++j) {
        const double run = prefix[i] - prefix[j] + (j == 0 ? first : 0) + (p == parts && i == L ? last : 0);
        const double worst = std::max(best[p - 1][j], run);
        if (worst < best[p][i]) best[p][i] = worst, cut[p][i] = j;
      }
  std::vector<int> runs(parts);
  for (int p = parts, i = L; p >= 1; --p) {
    runs[p - 1] = i - cut[p][i];
    i = cut[p][i];
  }
  return runs;
}

std::vector<int> blocks_per_stage(const model::ModelDesc& desc, const PlanConfig& c, int S, const std::vector<int>& blocks) {
  const int L = static_cast<int>(blocks.size());
  if (!c.pp_layers.empty()) {
    if (static_cast<int>(c.pp_layers.size()) != S)
      throw std::invalid_argument("pp_layers (--pp-layers): lists " + std::to_string(c.pp_layers.size()) +
                                  " stages, the schedule has " + std::to_string(S));
    for (int n : c.pp_layers)
      if (n < 1) throw std::invalid_argument("pp_layers (--pp-layers): every stage needs at least one block");
    if (std::accumulate(c.pp_layers.begin(), c.pp_layers.end(), 0) != L)
      throw std::invalid_argument("pp_layers (--pp-layers): the stages' blocks must sum to the model's " +
                                  std::to_string(L) + " blocks");
    return c.pp_layers;
  }
  const model::Shape shape{c.batch, c.seq};
  auto compute = [&](int u) {
    const model::UnitCosts k = desc.costs(u, shape);
    return k.forward_flops + k.backward_flops;
  };
  std::vector<double> cost;
  for (int u : blocks) cost.push_back(compute(u));
  double first = 0, last = 0;
  for (int u = 0; u < static_cast<int>(desc.units.size()); ++u) {
    if (model::is_embedding(desc.units[u].kind)) first += compute(u);
    if (model::is_head(desc.units[u].kind)) last += compute(u);
  }
  return balanced_runs(cost, S, first, last);
}

// A forward-only step (evaluation, generation) over `s`'s stages where it places them: each rank
// its stages in stage order, each stage's M micro-batches in turn.
Schedule forward_only(const Schedule& s, int M) {
  Schedule f = s;
  f.name = s.name + " (forward)";
  f.micro_batches = M;
  f.backward = Backward::none;
  f.actions.assign(s.ranks, {});
  for (int st = 0; st < s.stages; ++st)
    for (int m = 0; m < M; ++m) f.actions[s.rank_of_stage[st]].push_back({m, st, Phase::forward});
  // Nothing is released by a backward, so check_schedule counts every forward in flight (the
  // builder frees what a forward-only plan's forwards keep at once).
  f.stated_in_flight.clear();
  for (const auto& a : f.actions) f.stated_in_flight.push_back(static_cast<int>(a.size()));
  return f;
}

}  // namespace

std::vector<int> stage_of_units(const model::ModelDesc& desc, const PlanConfig& c, int S) {
  const int U = static_cast<int>(desc.units.size());
  std::vector<int> stage(U, 0);
  if (S == 1) return stage;
  std::vector<int> blocks;
  for (int u = 0; u < U; ++u)
    if (model::is_block(desc.units[u].kind)) blocks.push_back(u);
  if (static_cast<int>(blocks.size()) < S)
    throw std::invalid_argument("pp (--pp): " + std::to_string(S) + " stages for " + std::to_string(blocks.size()) +
                                " blocks: every stage needs at least one block");
  const std::vector<int> runs = blocks_per_stage(desc, c, S, blocks);
  for (int s = 0, i = 0; s < S; ++s)
    for (int k = 0; k < runs[s]; ++k) stage[blocks[i++]] = s;
  for (int u = 0; u < U; ++u) {
    const model::UnitDesc& d = desc.units[u];
    if (model::is_embedding(d.kind)) stage[u] = 0;
    if (model::is_head(d.kind)) stage[u] = S - 1;
  }
  for (int u = 0; u < U; ++u) {
    const int lent = desc.units[u].borrows;
    if (lent < 0) continue;
    if (model::is_state_only(desc.units[lent].kind)) stage[lent] = stage[u];
    else if (stage[lent] != stage[u])
      throw std::invalid_argument("pp (--pp): " + desc.units[u].name + " borrows " + desc.units[lent].name +
                                  "'s parameters (a tied embedding) from another stage, which is not supported yet");
  }
  return stage;
}

Schedule step_schedule(const PlanConfig& c, bool train, int listed) {
  const int M = train ? static_cast<int>(c.grad_accum) : 1;
  if (c.pp == 1) {
    if (c.pp_virtual != 1) throw std::invalid_argument("pp_virtual (--pp-virtual): needs --pp above 1");
    return one_stage(listed, train ? Backward::whole : Backward::none);
  }
  // The training schedule names the stages and where they live; a forward-only step keeps them.
  // (A forward-only plan's one micro-batch would not make an interleaved schedule: its stages'
  // places are the same at any count.)
  const Schedule s = schedule_by_name(c.pp_schedule, c.pp, c.pp_virtual, train ? M : c.pp);
  if (s.backward == Backward::split)
    throw std::invalid_argument("pp_schedule (--pp-schedule): " + c.pp_schedule +
                                " splits each backward into its input and weight gradients, which the layers do not "
                                "run apart yet; use gpipe, 1f1b or interleaved-1f1b");
  return train ? s : forward_only(s, M);
}

}  // namespace shardlm::plan
