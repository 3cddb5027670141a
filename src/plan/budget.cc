// The placement pass of --memory-budget: chooses, per unit and kind of state, memory or disk so
// that the plan's accounted peak (Plan::peak_memory().total, the figure `explain` prints and the
// executor's allocator reaches) stays within the budget; and per unit, whether its saved
// activations go to disk between its forward and its backward.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
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
// plan builds stays small (at most 4 × units + 1 in the worst case). An explicit --offload's kinds
// are a floor: those stay on disk for every unit.
Plan place_for_budget(const model::ModelDesc& desc, PlanConfig c) {
  const int U = static_cast<int>(desc.units.size());
  const int64_t budget = c.memory_budget;
  const bool train = c.mode == PlanConfig::Mode::train;
  std::vector<std::array<bool, kNumStateKinds>> choice(U);
  for (auto& unit : choice) unit = c.offload.kinds;
  c.offload.kinds = {};
  const bool all_activations = c.offload.activations;  // --offload activations: every unit's
  std::vector<char> activations(U, all_activations ? 1 : 0);
  auto build = [&] {
    c.offload.units = choice;
    c.offload.activations = std::find(activations.begin(), activations.end(), 1) != activations.end();
    c.offload.activation_units = c.offload.activations && !all_activations ? activations : std::vector<char>{};
    return build_plan(desc, c);
  };
  Plan p = build();
  int64_t peak = p.peak_memory().total;
  if (peak <= budget) return p;

  struct Candidate {
    int kind, unit;  // kind: a StateKind, or kActivations
    int64_t bytes;
  };
  constexpr int kActivations = kNumStateKinds;
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
      const int64_t n = p.placed(StateKind(k), u).parts > 0 ? p.held_elems(StateKind(k), u) : 0;
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
  for (size_t next = 0; peak > budget;) {
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
  return p;
}

}  // namespace shardlm::plan
