#include "train/machines.h"

#include <algorithm>
#include <climits>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <map>
#include <sched.h>
#include <set>
#include <sstream>
#include <unistd.h>

#include "comm/communicator.h"
#include "train/agreement.h"
#include "train/cgroups.h"

namespace shardlm::train {

std::string kernel_id() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (std::getline(boot, id) && !id.empty()) return id;
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

namespace {

// k when ranks [0, k), [k, 2k), … each share one machine and no two blocks do; 1 otherwise.
int block_of(const std::vector<std::string>& hosts, int machines) {
  const int n = static_cast<int>(hosts.size());
  if (n % machines != 0) return 1;
  const int k = n / machines;
  for (int r = 0; r < n; ++r)
    if (hosts[r] != hosts[r - r % k]) return 1;
  return k;  // k consecutive ranks on each of `machines` distinct names
}

}  // namespace

Machines machines_of(const std::vector<std::string>& hosts, int rank, const std::vector<std::string>& memory_limits) {
  Machines m;
  const std::string& mine = hosts.at(rank);
  m.count = static_cast<int>(std::set<std::string>(hosts.begin(), hosts.end()).size());
  m.ranks_here = static_cast<int>(std::count(hosts.begin(), hosts.end(), mine));
  m.local_rank = static_cast<int>(std::count(hosts.begin(), hosts.begin() + rank, mine));
  m.block = block_of(hosts, m.count);
  m.ranks_under_memory_limit = m.ranks_here;
  if (!memory_limits.empty() && !memory_limits.at(rank).empty()) {
    m.ranks_under_memory_limit = 0;
    for (size_t r = 0; r < hosts.size(); ++r)
      m.ranks_under_memory_limit += hosts[r] == mine && memory_limits.at(r) == memory_limits.at(rank);
  }
  return m;
}

Machines find_machines(comm::Communicator& world, std::chrono::milliseconds timeout, int test_block) {
  const auto cgroup = memory_cgroup();
  const auto limits = all_texts(world, timeout, cgroup ? cgroup->key : "", "memory cgroups");
  if (test_block > 0) {
    std::vector<std::string> hosts;
    for (int r = 0; r < world.size(); ++r) hosts.push_back("machine " + std::to_string(r / test_block));
    return machines_of(hosts, world.rank(), limits);
  }
  const std::string machine = "machine of rank " + std::to_string(world.machine());
  return machines_of(all_texts(world, timeout, machine, "machine ids"), world.rank(), limits);
}

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

namespace {

// The first `most` items joined by `sep`, then "<sep>and N more <what>" for those left out.
std::string listed(const std::vector<std::string>& items, size_t most, const std::string& sep, const std::string& what) {
  const size_t shown = std::min(items.size(), most);
  return fmt::format("{}{}", fmt::join(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(shown), sep),
                     shown < items.size() ? fmt::format("{}and {} more {}", sep, items.size() - shown, what) : "");
}

// "rank 3", "ranks 0, 1, 2, 3, and 4 more ranks"
std::string ranks_text(const std::vector<int>& ranks) {
  std::vector<std::string> names;
  for (const int r : ranks) names.push_back(std::to_string(r));
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", listed(names, 4, ", ", "ranks"));
}

std::string affinity_warning(const std::vector<RankCpus>& ranks, int threads) {
  std::vector<std::string> short_ranks;  // "rank 3 on 1"
  for (size_t r = 0; r < ranks.size(); ++r)
    if (const int n = ranks[r].allowed; n > 0 && n < threads) short_ranks.push_back(fmt::format("rank {} on {}", r, n));
  if (short_ranks.empty()) return "";
  return fmt::format(
      "{} compute threads a rank, but {} CPU(s) (CPU affinity): mpirun binds each rank to one core when it starts two or "
      "fewer; give it --bind-to none, or --map-by slot:PE={}",
      threads, listed(short_ranks, 4, ", ", fmt::format("ranks on fewer than {}", threads)), threads);
}

std::string quota_warning(const std::vector<RankCpus>& ranks, int threads) {
  std::map<std::string, std::vector<int>> groups;  // quota group -> its ranks
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].quota_group.empty()) groups[ranks[r].quota_group].push_back(static_cast<int>(r));
  std::vector<std::string> over;  // "ranks 0, 1 under 1.5 CPU(s) of cgroup DIR"
  double least_a_rank = threads;  // CPUs a rank of the tightest quota
  for (const auto& [group, members] : groups) {
    const RankCpus& q = ranks[members[0]];
    const double n = static_cast<double>(members.size());
    if (n * threads <= q.quota_cpus * (1 + 1e-9)) continue;
    over.push_back(fmt::format("{} under {:g} CPU(s) of cgroup {}", ranks_text(members), q.quota_cpus, q.quota_dir));
    least_a_rank = std::min(least_a_rank, q.quota_cpus / n);
  }
  if (over.empty()) return "";
  return fmt::format(
      "{} compute threads a rank, but {} (CPU quota: docker --cpus, a pod's CPU limit): the kernel throttles threads "
      "past a quota every period, and a throttled thread holds up the others at each barrier; {}",
      threads, listed(over, 3, "; ", "quotas"),
      least_a_rank >= 1 ? fmt::format("give --threads {}", static_cast<int>(least_a_rank))
                        : "start fewer ranks under it, or give it more CPUs");
}

}  // namespace

std::vector<std::string> threads_beyond_cpus(const std::vector<RankCpus>& ranks, int threads) {
  std::vector<std::string> lines;
  for (std::string line : {affinity_warning(ranks, threads), quota_warning(ranks, threads)})
    if (!line.empty()) lines.push_back(std::move(line));
  return lines;
}

void warn_of_threads_beyond_cpus(comm::Communicator& world, std::chrono::milliseconds timeout, int threads) {
  const auto quota = cpu_quota();
  const std::string mine = fmt::format("{}\t{}\t{}\t{}", allowed_cpus(), quota ? kernel_id() + " " + quota->key : "",
                                       quota ? quota->cpus : 0.0, quota ? quota->dir : "");
  std::vector<RankCpus> ranks;
  for (const std::string& text : all_texts(world, timeout, mine, "allowed CPUs")) {
    std::istringstream in(text);
    RankCpus r;
    std::string allowed, cpus;
    std::getline(in, allowed, '\t');
    std::getline(in, r.quota_group, '\t');
    std::getline(in, cpus, '\t');
    std::getline(in, r.quota_dir);
    r.allowed = std::stoi(allowed);
    r.quota_cpus = std::stod(cpus);
    ranks.push_back(std::move(r));
  }
  if (world.rank() != 0) return;
  for (const std::string& line : threads_beyond_cpus(ranks, threads)) fmt::print(stderr, "shardlm: warning: {}\n", line);
}

int machine_shard_group(const Machines& m, int world) {
  if (m.count == 1) return world;
  return m.block > 1 || m.count == world ? m.block : 0;
}

std::string describe(const Machines& m) {
  if (m.count == 1) return "1 machine";
  if (m.block > 1) return fmt::format("{} machines of {}", m.count, m.block);
  return fmt::format("{} machines", m.count);
}

}  // namespace shardlm::train
