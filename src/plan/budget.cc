// The placement pass of --memory-budget: chooses, per unit and kind of state, memory or disk so
// that the plan's accounted peak (Plan::peak_memory().total, the figure `explain` prints and the
// executor's allocator reaches) stays within the budget; and per unit, whether its saved
// activations go to disk between its forward and its backward.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>

#include "plan/plan.h"

namespace shardlm::plan {

int64_t parse_memory_budget(const std::string& text) { return parse_bytes(text, "--memory-budget"); }

int64_t parse_bytes(const std::string& text, const std::string& flag) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(flag + ": '" + text + "' " + why +
                                 " (bytes per rank: 4096, 512MiB, 8GB; K/M/G/T with B = 10^3 steps or iB = 2^10)");
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) throw bad("is not a size");
  double value;
  try {
    size_t used = 0;
    value = std::stod(text.substr(0, i), &used);
    if (used != i) throw bad("is not a size");
  } catch (const std::logic_error&) {
    throw bad("is not a size");
  }
  std::string unit = text.substr(i);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  const std::string prefixes = "KMGT";
  if (unit.size() >= 2 && prefixes.find(unit[0]) != std::string::npos) {
    const int power = static_cast<int>(prefixes.find(unit[0])) + 1;
    if (unit.substr(1) == "B") scale = std::pow(1000.0, power);
    if (unit.substr(1) == "IB") scale = std::pow(1024.0, power);
  }
  if (scale == 0) throw bad("has an unknown unit");
  const double bytes = std::floor(value * scale);
  if (!(bytes >= 1)) throw bad("must be at least one byte");
  if (bytes > 9.2e18) throw bad("is too large");
  return static_cast<int64_t>(bytes);
}

namespace {

constexpr int kActivations = kNumStateKinds;  // a Candidate's kind: a unit's saved activations

struct Candidate {
  int kind, unit;  // kind: a State, or kActivations
  int64_t bytes;
};

// What whole units leave of the budget goes back to what was moved last (the most touched), in
// reverse order, each candidate whole while it fits; what moved is still a prefix of the order.
// Then the state moved before keeps heads of its parts in memory, in whole pages
// (Placement::resident), in the same order while room is left, so a step reads and writes that
// much less. A head adds its bytes to the peak exactly (the windows do not change); a candidate
// brought back whole need not (saved activations move the peak's place), so the plan is built
// again and kept only within the budget, else the heads alone are tried on the last plan.
Plan keep_what_fits(Plan p, int64_t budget, const std::vector<Candidate>& moved, std::vector<char>& activations,
                    std::vector<std::array<bool, kNumStateKinds>>& choice,
                    std::vector<std::array<int64_t, kNumStateKinds>>& resident, const std::function<Plan()>& build) {
  auto give_heads = [&](size_t whole, int64_t room) {  // to the state candidates past the whole ones
    bool any = false;
    for (auto m = moved.rbegin() + static_cast<std::ptrdiff_t>(whole); m != moved.rend(); ++m) {
      if (m->kind == kActivations) continue;  // saved activations move whole buffers
      const int64_t per_elem = m->kind == static_cast<int>(State::optimizer) ? 8 : 4;
      const int64_t n = p.held_elems(State(m->kind), m->unit);
      const int64_t head = std::min((n - 1) / kResidentGrain, room / per_elem / kResidentGrain) * kResidentGrain;
      resident[m->unit][m->kind] = head;
      room -= per_elem * head;
      any = any || head > 0;
    }
    return any;
  };
  int64_t room = budget - p.peak_memory().total;
  size_t whole = 0;
  for (auto m = moved.rbegin(); m != moved.rend() && m->bytes <= room; ++m, ++whole) {
    if (m->kind == kActivations) activations[m->unit] = 0;
    else choice[m->unit][m->kind] = false;
    room -= m->bytes;
  }
  if (give_heads(whole, room) || whole > 0) {
    Plan kept = build();
    if (kept.peak_memory().total <= budget) return kept;
  }
  if (whole == 0) return p;
  for (auto m = moved.rbegin(); m != moved.rbegin() + static_cast<std::ptrdiff_t>(whole); ++m) {  // undo the whole ones
    if (m->kind == kActivations) activations[m->unit] = 1;
    else choice[m->unit][m->kind] = true;
  }
  std::fill(resident.begin(), resident.end(), std::array<int64_t, kNumStateKinds>{});
  if (!give_heads(0, budget - p.peak_memory().total)) return p;
  Plan kept = build();
  return kept.peak_memory().total <= budget ? kept : p;
}

std::string bytes_text(int64_t b) {
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.1f", static_cast<double>(b) / 1048576.0);
  return std::to_string(b) + " bytes (" + mib + " MiB)";
}
}  // namespace

// Greedy: build the plan, measure its peak, and move to disk at least as many bytes as the peak is
// over the budget, taking candidates in a fixed order: optimizer state first (touched once a step:
// read and written by the update), then gradients (written by the backward, read by the update),
// then saved activations (written by the forward, read by the backward), then parameters (read by
// the forward and the backward, written by the update). Within a kind of state the largest units
// first (most bytes per window), ties by unit index; activations in forward order (the first
// forward's are read back last, so their reload has the most time to hide). Then build and measure
// again, since windows and copies add back some of what was freed. Each round moves at least one
// candidate, and typically one or two rounds after the resident plan suffice, so the number of
// plan builds stays small (at most 4 × units + 3 in the worst case, keep_what_fits's two
// included). An explicit --offload's kinds are a floor: those stay on disk for every unit. Last,
// what the whole units leave of the budget keeps the most touched of the moved state in memory
// (keep_what_fits).
Plan place_for_budget(const model::ModelDesc& desc, PlanConfig c) {
  const int U = static_cast<int>(desc.units.size());
  const int64_t budget = c.memory_budget;
  const bool train = c.mode == PlanConfig::Mode::train;
  std::vector<std::array<bool, kNumStateKinds>> choice(U);
  for (auto& unit : choice) unit = c.offload.kinds;
  c.offload.kinds = {};
  const bool all_activations = c.offload.activations;  // --offload activations: every unit's
  std::vector<char> activations(U, all_activations ? 1 : 0);
  std::vector<std::array<int64_t, kNumStateKinds>> resident(U, std::array<int64_t, kNumStateKinds>{});
  auto build = [&] {
    c.offload.units = choice;
    c.offload.resident = resident;
    c.offload.activations = std::find(activations.begin(), activations.end(), 1) != activations.end();
    c.offload.activation_units = c.offload.activations && !all_activations ? activations : std::vector<char>{};
    return build_plan(desc, c);
  };
  Plan p = build();
  int64_t peak = p.peak_memory().total;
  if (peak <= budget) return p;

  std::vector<int64_t> saved_bytes(U, 0);  // what a unit's forward keeps for its backward
  for (const BufferDesc& b : p.buffers)
    if (b.kept_for_backward() && b.unit >= 0) saved_bytes[b.unit] += b.bytes;
  std::vector<Candidate> order;
  for (int k : {2, 1, kActivations, 0}) {
    std::vector<Candidate> of_kind;
    for (int u = 0; u < U; ++u) {
      if (k == kActivations) {
        if (train && !activations[u] && saved_bytes[u] > 0) of_kind.push_back({k, u, saved_bytes[u]});
        continue;
      }
      const int64_t n = p.placed(State(k), u).parts > 0 ? p.held_elems(State(k), u) : 0;
      if (n > 0 && !choice[u][k]) of_kind.push_back({k, u, 4 * n * (k == 2 ? 2 : 1)});
    }
    if (k != kActivations)
      std::stable_sort(of_kind.begin(), of_kind.end(), [](const Candidate& a, const Candidate& b) { return a.bytes > b.bytes; });
    order.insert(order.end(), of_kind.begin(), of_kind.end());
  }
  const std::string head = "--memory-budget " + bytes_text(budget) + ": ";
  // Windows and copies cost memory too, so the peak need not fall with every unit moved: the
  // smallest peak seen (the full offload's, or one on the way) is what the refusal reports.
  int64_t smallest = peak;
  size_t next = 0;
  while (peak > budget) {
    if (next == order.size())
      throw std::invalid_argument(head + "does not fit even with every unit's params, grads, optimizer state" +
                                  (train ? " and saved activations" : "") + " on disk; the smallest peak reachable is " +
                                  bytes_text(smallest));
    int64_t freed = 0;
    for (; next < order.size() && freed < peak - budget; ++next) {
      const Candidate& m = order[next];
      if (m.kind == kActivations) activations[m.unit] = 1;
      else choice[m.unit][m.kind] = true;
      freed += m.bytes;
    }
    try {
      p = build();
    } catch (const std::invalid_argument& e) {  // a combination the disk tier refuses
      throw std::invalid_argument(head + "the plan's peak in memory is " + bytes_text(p.peak_memory().total) +
                                  " and placing state on disk is refused: " + e.what());
    }
    peak = p.peak_memory().total;
    smallest = std::min(smallest, peak);
  }
  order.resize(next);  // what was moved
  return keep_what_fits(std::move(p), budget, order, activations, choice, resident, build);
}

}  // namespace shardlm::plan
