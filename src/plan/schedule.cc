// Schedules as data (schedule.h): the builders of the classic pipeline schedules, their checker
// and their grid.
#include "plan/schedule.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace shardlm::plan {

const char* to_string(Phase p) {
  switch (p) {
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::backward_input: return "backward-input";
    case Phase::backward_weight: return "backward-weight";
  }
  return "?";
}

namespace {

// A schedule of `ranks` ranks holding stage s on rank s % ranks, its action lists empty.
Schedule empty(const std::string& name, int ranks, int stages, int micro_batches, Backward backward) {
  if (ranks < 1 || stages < ranks || micro_batches < 1)
    throw std::invalid_argument("schedule " + name + ": needs ranks >= 1, stages >= ranks and micro-batches >= 1, got " +
                                std::to_string(ranks) + " ranks, " + std::to_string(stages) + " stages, " +
                                std::to_string(micro_batches) + " micro-batches");
  Schedule s;
  s.name = name, s.ranks = ranks, s.stages = stages, s.micro_batches = micro_batches, s.backward = backward;
  for (int st = 0; st < stages; ++st) s.rank_of_stage.push_back(st % ranks);
  s.actions.resize(ranks);
  s.stated_in_flight.assign(ranks, 0);
  return s;
}

Action F(int m, int s) { return {m, s, Phase::forward}; }
Action B(int m, int s) { return {m, s, Phase::backward}; }

// An action's place in a table of every (micro-batch, stage, phase).
int key(const Schedule& s, const Action& a) { return (a.micro * s.stages + a.stage) * 4 + static_cast<int>(a.phase); }

bool allowed(Backward b, Phase p) {
  switch (b) {
    case Backward::none: return p == Phase::forward;
    case Backward::whole: return p == Phase::forward || p == Phase::backward;
    case Backward::split: return p != Phase::backward;
  }
  return false;
}

int phases(Backward b) { return b == Backward::none ? 1 : b == Backward::whole ? 2 : 3; }

// What action `a` waits for across the pipe (and on its own stage).
std::vector<Action> dependencies(const Schedule& s, const Action& a) {
  const int m = a.micro, st = a.stage, last = s.stages - 1;
  switch (a.phase) {
    case Phase::forward:
      if (st > 0) return {F(m, st - 1)};
      return {};
    case Phase::backward:
    case Phase::backward_input:
      if (st < last) return {F(m, st), {m, st + 1, a.phase}};
      return {F(m, st)};
    case Phase::backward_weight: return {{m, st, Phase::backward_input}};
  }
  return {};
}

std::string describe(const Action& a) {
  return std::string(to_string(a.phase)) + " of micro-batch " + std::to_string(a.micro) + " stage " + std::to_string(a.stage);
}

// The action that ends a micro-batch stage's stay in memory: its backward (its weight gradient,
// where split); none without backwards.
bool releases(Backward b, Phase p) {
  return (b == Backward::whole && p == Phase::backward) || (b == Backward::split && p == Phase::backward_weight);
}

// Each action once, of a phase the schedule holds, on the rank of its stage; "" when so.
std::string check_listing(const Schedule& s) {
  if (static_cast<int>(s.actions.size()) != s.ranks || static_cast<int>(s.rank_of_stage.size()) != s.stages ||
      static_cast<int>(s.stated_in_flight.size()) != s.ranks)
    return "the schedule's lists do not match its " + std::to_string(s.ranks) + " ranks and " +
           std::to_string(s.stages) + " stages";
  for (int st = 0; st < s.stages; ++st)
    if (s.rank_of_stage[st] < 0 || s.rank_of_stage[st] >= s.ranks) return "stage " + std::to_string(st) + " is on no rank";
  std::vector<char> seen(static_cast<size_t>(s.micro_batches) * s.stages * 4, 0);
  size_t listed = 0;
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.actions[r]) {
      if (a.micro < 0 || a.micro >= s.micro_batches || a.stage < 0 || a.stage >= s.stages || !allowed(s.backward, a.phase))
        return "rank " + std::to_string(r) + " lists " + describe(a) + ", which the schedule does not hold";
      if (s.rank_of_stage[a.stage] != r)
        return "rank " + std::to_string(r) + " lists " + describe(a) + ", whose stage is on rank " +
               std::to_string(s.rank_of_stage[a.stage]);
      if (seen[key(s, a)]++) return describe(a) + " is listed twice";
      ++listed;
    }
  const size_t expected = static_cast<size_t>(s.micro_batches) * s.stages * phases(s.backward);
  if (listed != expected)
    return "the schedule lists " + std::to_string(listed) + " actions of the " + std::to_string(expected) + " it holds";
  return "";
}

}  // namespace

Schedule one_stage(int micro_batches, Backward backward) {
  if (backward == Backward::split) throw std::invalid_argument("schedule one-stage: a backward is whole or none");
  Schedule s = empty("one-stage", 1, 1, micro_batches, backward);
  for (int m = 0; m < micro_batches; ++m) {
    s.actions[0].push_back(F(m, 0));
    if (backward == Backward::whole) s.actions[0].push_back(B(m, 0));
  }
  s.stated_in_flight[0] = backward == Backward::none ? 0 : 1;
  return s;
}

Schedule gpipe(int ranks, int micro_batches) {
  Schedule s = empty("gpipe", ranks, ranks, micro_batches, Backward::whole);
  for (int r = 0; r < ranks; ++r) {
    for (int m = 0; m < micro_batches; ++m) s.actions[r].push_back(F(m, r));
    for (int m = 0; m < micro_batches; ++m) s.actions[r].push_back(B(m, r));
    s.stated_in_flight[r] = micro_batches;
  }
  return s;
}

Schedule one_f_one_b(int ranks, int micro_batches) {
  Schedule s = empty("1f1b", ranks, ranks, micro_batches, Backward::whole);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - 1 - r, micro_batches);
    std::vector<Action>& line = s.actions[r];
    int f = 0, b = 0;
    while (f < warmup) line.push_back(F(f++, r));
    while (f < micro_batches) line.push_back(F(f++, r)), line.push_back(B(b++, r));
    while (b < micro_batches) line.push_back(B(b++, r));
    s.stated_in_flight[r] = std::min(ranks - r, micro_batches);
  }
  return s;
}

// Megatron-LM's order: rank r's k-th forward (of M·V) is micro-batch group·P + k % P of its chunk
// (k / P) % V, where group = k / (P·V); its k-th backward runs the chunks the other way round.
Schedule interleaved_one_f_one_b(int ranks, int virtual_stages, int micro_batches) {
  const int P = ranks, V = virtual_stages, M = micro_batches;
  if (V < 1) throw std::invalid_argument("schedule interleaved-1f1b: --pp-virtual must be >= 1, got " + std::to_string(V));
  if (P >= 1 && M % P != 0)
    throw std::invalid_argument("schedule interleaved-1f1b: --grad-accum " + std::to_string(M) +
                                " must be a multiple of --pp " + std::to_string(P) +
                                " (it runs micro-batches in groups of the ranks)");
  Schedule s = empty("interleaved-1f1b", P, P * V, M, Backward::whole);
  const int total = M * V;
  auto nth = [&](int r, int k, bool forward) {
    const int within = k % (P * V), chunk = forward ? within / P : V - 1 - within / P;
    return Action{k / (P * V) * P + within % P, chunk * P + r, forward ? Phase::forward : Phase::backward};
  };
  for (int r = 0; r < P; ++r) {
    // Where every micro-batch fits in the first round, the rank warms up through all of them.
    const int warmup = M == P ? total : std::min(total, 2 * (P - 1 - r) + (V - 1) * P);
    std::vector<Action>& line = s.actions[r];
    int f = 0, b = 0;
    while (f < warmup) line.push_back(nth(r, f++, true));
    while (f < total) line.push_back(nth(r, f++, true)), line.push_back(nth(r, b++, false));
    while (b < total) line.push_back(nth(r, b++, false));
    s.stated_in_flight[r] = warmup == total ? total : warmup + 1;
  }
  return s;
}

Schedule zb_h1(int ranks, int micro_batches) {
  const int P = ranks, M = micro_batches;
  Schedule s = empty("zb-h1", P, P, M, Backward::split);
  for (int r = 0; r < P; ++r) {
    std::vector<Action>& line = s.actions[r];
    const int warmup = std::min(P - 1 - r, M), deferred = r;
    int f = 0, b = 0, w = 0;
    auto input = [&] { line.push_back({b++, r, Phase::backward_input}); };
    auto weight = [&] { line.push_back({w++, r, Phase::backward_weight}); };
    while (f < warmup) line.push_back(F(f++, r));
    while (f < M) {
      line.push_back(F(f++, r));
      input();
      if (b - w > deferred) weight();
    }
    while (b < M) {
      input();
      if (b - w > deferred) weight();
    }
    while (w < M) weight();
    s.stated_in_flight[r] = std::min(P, M);
  }
  return s;
}

namespace {

// One rank's ZB-V order (see schedule.h) for a pattern of N >= 2P - 1 micro-batches, leaving out
// those at or past M: each chunk's next forward, input gradient or weight gradient in turn.
std::vector<Action> zbv_rank(int P, int r, int N, int M) {
  std::vector<Action> line;
  const int stage[2] = {r, 2 * P - 1 - r};
  int next[2][3] = {};  // by chunk, by forward / input gradient / weight gradient
  const Phase phase[3] = {Phase::forward, Phase::backward_input, Phase::backward_weight};
  auto run = [&](int chunk, int k) {
    const int m = next[chunk][k]++;
    if (m < M) line.push_back({m, stage[chunk], phase[k]});
  };
  enum { f, b, w };
  for (int i = 0; i < 2 * (P - r) - 1; ++i) run(0, f);
  for (int i = 0; i < r; ++i) run(1, f), run(0, f);
  for (int i = 0; i < P - r; ++i) run(1, f), run(1, b), run(1, w);
  while (next[1][f] < N) {
    if (next[0][f] < N) run(0, f);
    run(0, b), run(0, w), run(1, f), run(1, b), run(1, w);
  }
  for (int i = 0; i < r; ++i) run(0, b), run(1, b);
  for (int i = 0; i < P - r; ++i) run(0, b), run(0, w);
  while (next[1][w] < N) run(1, w);
  while (next[0][w] < N) run(0, w);
  return line;
}

}  // namespace

Schedule zbv(int ranks, int micro_batches) {
  const int P = ranks, M = micro_batches;
  Schedule s = empty("zbv", P, 2 * P, M, Backward::split);
  for (int st = P; st < 2 * P; ++st) s.rank_of_stage[st] = 2 * P - 1 - st;
  // The warm-up needs 2P - 1 chunk-0 forwards on rank 0; fewer micro-batches leave the rest out.
  const int N = std::max(M, 2 * P - 1);
  for (int r = 0; r < P; ++r) {
    s.actions[r] = zbv_rank(P, r, N, M);
    s.stated_in_flight[r] = std::min(M, 2 * P - 1 - r) + std::min(M, r + 1);
  }
  return s;
}

Schedule schedule_by_name(const std::string& name, int ranks, int virtual_stages, int micro_batches) {
  const int V = virtual_stages;
  if (V < 1) throw std::invalid_argument("--pp-virtual must be >= 1, got " + std::to_string(V));
  const bool one_a_rank = name == "gpipe" || name == "1f1b" || name == "zb-h1";
  if (one_a_rank && V > 1)
    throw std::invalid_argument("--pp-virtual " + std::to_string(V) + ": --pp-schedule " + name +
                                " holds one stage a rank; virtual stages need interleaved-1f1b (or zbv, two a rank)");
  if (name == "zbv" && V > 2)
    throw std::invalid_argument("--pp-virtual " + std::to_string(V) + ": --pp-schedule zbv holds two stages a rank");
  if (name == "gpipe") return gpipe(ranks, micro_batches);
  if (name == "1f1b") return one_f_one_b(ranks, micro_batches);
  if (name == "zb-h1") return zb_h1(ranks, micro_batches);
  if (name == "zbv") return zbv(ranks, micro_batches);
  if (name == "interleaved-1f1b") return interleaved_one_f_one_b(ranks, V, micro_batches);
  throw std::invalid_argument("--pp-schedule: unknown schedule '" + name + "' (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv)");
}

ScheduleCheck check_schedule(const Schedule& s) {
  ScheduleCheck c;
  c.error = check_listing(s);
  if (!c.ok()) return c;
  // Activations in flight: a rank's own running count, whatever the timing.
  c.peak_in_flight.assign(s.ranks, 0);
  for (int r = 0; r < s.ranks; ++r) {
    int held = 0;
    for (const Action& a : s.actions[r]) {
      if (a.phase == Phase::forward && s.backward != Backward::none) ++held;
      if (releases(s.backward, a.phase)) --held;
      c.peak_in_flight[r] = std::max(c.peak_in_flight[r], held);
    }
  }
  // Each rank runs its next action once what it waits for has finished, one slot an action.
  std::vector<int> finished(static_cast<size_t>(s.micro_batches) * s.stages * 4, -1), next(s.ranks, 0), free_at(s.ranks, 0);
  c.slot.resize(s.ranks);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r)
      for (; next[r] < static_cast<int>(s.actions[r].size()); ++next[r]) {
        const Action& a = s.actions[r][next[r]];
        int start = free_at[r];
        bool ready = true;
        for (const Action& d : dependencies(s, a)) {
          ready = ready && finished[key(s, d)] >= 0;
          start = std::max(start, finished[key(s, d)]);
        }
        if (!ready) break;
        c.slot[r].push_back(start);
        finished[key(s, a)] = free_at[r] = start + 1;
        c.slots = std::max(c.slots, start + 1);
        progress = true;
      }
  }
  for (int r = 0; r < s.ranks; ++r)
    if (next[r] < static_cast<int>(s.actions[r].size())) {
      const Action& a = s.actions[r][next[r]];
      std::string waits;
      for (const Action& d : dependencies(s, a))
        if (finished[key(s, d)] < 0) waits += (waits.empty() ? "" : ", ") + describe(d);
      c.error = "deadlock: rank " + std::to_string(r) + " waits at " + describe(a) + " for " + waits;
      return c;
    }
  for (int r = 0; r < s.ranks; ++r)
    if (c.peak_in_flight[r] != s.stated_in_flight[r]) {
      c.error = "rank " + std::to_string(r) + " holds " + std::to_string(c.peak_in_flight[r]) +
                " micro-batch stages in flight; the schedule states " + std::to_string(s.stated_in_flight[r]);
      return c;
    }
  return c;
}

std::string schedule_grid(const Schedule& s) {
  const ScheduleCheck c = check_schedule(s);
  std::ostringstream o;
  o << s.name << ": " << s.ranks << " ranks, " << s.stages << " stages, " << s.micro_batches << " micro-batches, "
    << c.slots << " slots\n";
  if (!c.ok()) return o.str() + "  unsound: " + c.error + "\n";
  const bool several = s.stages > s.ranks;
  auto label = [&](const Action& a) {
    const char letter = a.phase == Phase::forward ? 'F' : a.phase == Phase::backward_weight ? 'W' : 'B';
    return letter + std::to_string(a.micro) + (several ? "." + std::to_string(a.stage) : "");
  };
  size_t width = 1;
  for (const auto& line : s.actions)
    for (const Action& a : line) width = std::max(width, label(a).size());
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> cells(c.slots, ".");
    for (size_t i = 0; i < s.actions[r].size(); ++i) cells[c.slot[r][i]] = label(s.actions[r][i]);
    o << "  rank " << r << " |";
    for (const std::string& cell : cells) o << " " << cell << std::string(width - cell.size(), ' ');
    o << "\n";
  }
  return o.str();
}

}  // namespace shardlm::plan
