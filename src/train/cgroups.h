// What cgroups limit a process to, where /proc/meminfo and the CPU affinity show the machine:
// - memory: Slurm's ConstrainRAMSpace, docker --memory, a Kubernetes pod's limit, systemd's
//   MemoryMax. The kernel kills a process that goes past it; so a memory check that reads only
//   /proc/meminfo passes a model the job cannot hold, and the run dies of SIGKILL without a word.
// - CPU time: docker --cpus, a pod's CPU limit, systemd's CPUQuota. The kernel throttles: each
//   period the cgroup's threads run until they have used its quota, then all of them wait for the
//   next period; a compute thread held there holds up the others at the next barrier.
// Both cgroup versions; the tightest limit on the path from the process's cgroup up to the root of
// the hierarchy it can see (Slurm puts the limit on the job and the tasks below it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace shardlm::train {

struct MemoryCgroup {
  std::string dir;        // the cgroup directory whose limit is the tightest
  std::string key;        // what tells that cgroup from every other on this machine (device:inode)
  int64_t limit = 0;      // memory.max (v2) or memory.limit_in_bytes (v1)
  int64_t in_use = 0;     // memory.current or memory.usage_in_bytes, less inactive page cache
  int64_t available = 0;  // limit - in_use, at least 0: what the cgroup's processes may still take
};

// The memory cgroup of this process with the least available, or nullopt where no level of it
// has a limit (or there are no cgroups: not Linux, nothing mounted). `root` prefixes every path
// read (/proc/self/cgroup, /proc/self/mountinfo, the cgroup files), for tests.
std::optional<MemoryCgroup> memory_cgroup(const std::string& root = "");

struct CpuQuota {
  std::string dir;  // the cgroup directory whose quota is the tightest
  std::string key;  // what tells that cgroup from every other on this machine (device:inode)
  double cpus = 0;  // quota / period: the CPUs' worth of time its processes may use together
};

// The CPU quota of this process with the fewest CPUs, or nullopt where no level of it has one.
// `root` as memory_cgroup's.
std::optional<CpuQuota> cpu_quota(const std::string& root = "");

// This process's own cgroup directory of `controller` ("memory", "cpu"; the leaf, limited or
// not), "" where none is found.
std::string own_cgroup_dir(const std::string& controller, const std::string& root = "");

}  // namespace shardlm::train
