#include "train/machines.h"

#include <algorithm>
#include <climits>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <sched.h>
#include <set>
#include <unistd.h>

#include "comm/communicator.h"
#include "train/agreement.h"
#include "train/memory_cgroup.h"

namespace shardlm::train {

namespace {

// The kernel's boot id (a random id each boot): host names can repeat across machines (a
// container image's "localhost") and differ on one (containers on one host share its kernel and
// its memory). The host name where there is no boot id.
std::string machine_id() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (std::getline(boot, id) && !id.empty()) return id;
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

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
  return machines_of(all_texts(world, timeout, machine_id(), "machine ids"), world.rank(), limits);
}

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

void warn_of_threads_beyond_cpus(comm::Communicator& world, std::chrono::milliseconds timeout, int threads) {
  const std::vector<std::string> cpus = all_texts(world, timeout, std::to_string(allowed_cpus()), "allowed CPUs");
  std::vector<std::string> short_ranks;  // "rank 3 on 1"
  for (int r = 0; r < static_cast<int>(cpus.size()); ++r)
    if (const int n = std::stoi(cpus[r]); n > 0 && n < threads) short_ranks.push_back(fmt::format("rank {} on {}", r, n));
  if (short_ranks.empty() || world.rank() != 0) return;
  const size_t shown = std::min<size_t>(short_ranks.size(), 4);
  fmt::print(stderr,
             "shardlm: warning: {} compute threads a rank, but {}{} CPU(s) (CPU affinity): mpirun binds each rank to one "
             "core when it starts two or fewer; give it --bind-to none, or --map-by slot:PE={}\n",
             threads, fmt::join(short_ranks.begin(), short_ranks.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
             shown < short_ranks.size()
                 ? fmt::format(", and {} more ranks on fewer than {}", short_ranks.size() - shown, threads)
                 : "",
             threads);
}

std::string describe(const Machines& m) {
  if (m.count == 1) return "1 machine";
  if (m.block > 1) return fmt::format("{} machines of {}", m.count, m.block);
  return fmt::format("{} machines", m.count);
}

}  // namespace shardlm::train
