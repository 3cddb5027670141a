#include "train/memory_check.h"

#include <algorithm>

#include <cstdlib>
#include <fmt/format.h>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "train/cgroups.h"

namespace shardlm::train {

namespace {

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

std::string human(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", gib(bytes));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
  return fmt::format("{:.0f} bytes", bytes);
}

std::string machine_text(const MachineMemory& m, int ranks) {
  return fmt::format("{}this machine has {:.2f} GiB available (MemAvailable; {:.2f} GiB physical)",
                     ranks > 1 ? fmt::format("{} ranks share this machine; ", ranks) : "", gib(m.available),
                     gib(m.physical));
}

std::string cgroup_text(const MemoryCgroup& c, int ranks) {
  return fmt::format("{}the memory cgroup {} has {:.2f} GiB available (its limit {:.2f} GiB, {:.2f} GiB in use)",
                     ranks > 1 ? fmt::format("{} ranks share its limit; ", ranks) : "", c.dir, gib(c.available),
                     gib(c.limit), gib(c.in_use));
}

// What `per_rank` bytes on each of the ranks sharing them overrun, as the end of the error line:
// the machine's available memory, or the limit of the memory cgroup this rank runs under (the
// kernel kills past it, whatever /proc/meminfo says). nullopt where both hold them.
std::optional<std::string> overrun(double per_rank, const Machines& machines) {
  const MachineMemory m = machine_memory();
  const int here = std::max(1, machines.ranks_here);
  if (m.physical > 0 && per_rank * here > static_cast<double>(m.available)) return machine_text(m, here);
  if (const auto cgroup = memory_cgroup()) {
    const int under = std::max(1, machines.ranks_under_memory_limit);
    if (per_rank * under > static_cast<double>(cgroup->available)) return cgroup_text(*cgroup, under);
  }
  return std::nullopt;
}

}  // namespace

MachineMemory machine_memory() {
  MachineMemory m;
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string key;
    int64_t kib = 0;
    in >> key >> kib;
    if (key == "MemTotal:") m.physical = kib * 1024;
    if (key == "MemAvailable:") m.available = kib * 1024;
  }
  if (m.available == 0) m.available = m.physical;
  return m;
}

namespace {

// The parameters of `c` from models of one and two periods of its blocks, without describing
// its every layer (n_layer may be 2^20). The blocks repeat with period P: 1, or a MoE model's
// moe_every M (M - 1 dense blocks, then a MoE block); n_layer mod P more blocks are dense ones.
double count_params(const model::ModelConfig& c) {
  const int64_t P = c.family == model::Family::moe ? c.moe_every : 1;
  model::ModelConfig probe = c;
  auto params = [&](int64_t layers) {
    probe.n_layer = layers;
    return static_cast<double>(model::describe(probe).num_params());
  };
  const double one = params(P), per_period = params(2 * P) - one, dense = P > 1 ? params(P + 1) - one : 0.0;
  // double: no overflow
  return one + static_cast<double>(c.n_layer / P - 1) * per_period + static_cast<double>(c.n_layer % P) * dense;
}

}  // namespace

const model::ModelConfig& refuse_unless_state_fits(const model::ModelConfig& c, double bytes_per_param, int shards,
                                                   const Machines& machines) {
  const double params = count_params(c);
  const double per_rank = bytes_per_param * params / shards;
  if (const auto over = overrun(per_rank, machines))
    throw std::runtime_error(fmt::format(
        "model does not fit in memory: {:.3g} parameters (n_layer {}, n_embd {}) need at least {} per rank "
        "({} bytes each over {} rank(s)), but {}",
        params, c.n_layer, c.n_embd, human(per_rank), bytes_per_param, shards, *over));
  return c;
}

plan::Plan refuse_unless_plan_fits(plan::Plan plan, bool stages_whole_state, const Machines& machines) {
  const MemSnapshot peak = plan.peak_memory();
  const int64_t staging = stages_whole_state ? 3 * static_cast<int64_t>(sizeof(float)) * plan.layout.total : 0;
  const double per_rank = static_cast<double>(peak.total + staging);
  const auto over = overrun(per_rank, machines);
  if (!over) return plan;
  std::string parts;
  for (int i = 0; i < kNumMemCategories; ++i)
    if (peak.bytes[i] > 0)
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", to_string(static_cast<MemCategory>(i)),
                           human(static_cast<double>(peak.bytes[i])));
  if (staging > 0) parts += ", checkpoint staging " + human(static_cast<double>(staging));
  throw std::runtime_error(fmt::format("model does not fit in memory: the plan needs {} per rank at its peak ({}), but {}",
                                       human(per_rank), parts, *over));
}

}  // namespace shardlm::train
