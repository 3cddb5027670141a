// The memory and CPU limits a rank runs under (Slurm's job, a container), which the kernel enforces
// by killing or throttling while /proc/meminfo and the CPU affinity show the whole machine: read
// from a file tree laid out as each cgroup version and container lays it out, and, where this
// machine lets a test make a cgroup, a run under a memory limit too small for it refused with one
// line instead of killed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "run/test_util.h"
#include "train/cgroups.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kGiB = int64_t{1} << 30;

// A fake root: /proc/self/cgroup, /proc/self/mountinfo and cgroup files, written as given.
class FakeRoot {
 public:
  FakeRoot() : dir_(fs::temp_directory_path() / ("shardlm_cgroup_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
  }
  ~FakeRoot() { fs::remove_all(dir_); }
  void write(const std::string& path, const std::string& text) const {
    fs::create_directories((dir_ / fs::path(path).relative_path()).parent_path());
    std::ofstream(dir_ / fs::path(path).relative_path()) << text;
  }
  std::string root() const { return dir_.string(); }
  std::string at(const std::string& path) const { return (dir_ / fs::path(path).relative_path()).string(); }

 private:
  fs::path dir_;
};

// A line of /proc/self/mountinfo mounting a cgroup hierarchy.
std::string mount_line(const std::string& hierarchy_root, const std::string& point, const std::string& fstype,
                       const std::string& super_options) {
  return "41 30 0:36 " + hierarchy_root + " " + point + " rw,nosuid - " + fstype + " cgroup " + super_options + "\n";
}

// Slurm on cgroup v1: the job's limit, an unlimited step and a task with a looser limit of its
// own. The tightest level is the job, and what the kernel would reclaim first (inactive page
// cache) is not counted as in use.
TEST(MemoryCgroup, TheTightestLevelAboveTheProcessCountsOnV1) {
  const FakeRoot f;
  f.write("/proc/self/cgroup", "5:cpu,cpuacct:/slurm/uid_0/job_7/step_0\n4:memory:/slurm/uid_0/job_7/step_0/task_1\n");
  f.write("/proc/self/mountinfo", "25 1 8:1 / / rw - ext4 /dev/sda1 rw\n" +
                                      mount_line("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory"));
  const std::string job = "/sys/fs/cgroup/memory/slurm/uid_0/job_7";
  f.write(job + "/memory.limit_in_bytes", std::to_string(2 * kGiB) + "\n");
  f.write(job + "/memory.usage_in_bytes", std::to_string(kGiB) + "\n");
  f.write(job + "/memory.stat", "cache 1\ninactive_file 5\ntotal_inactive_file " + std::to_string(kGiB / 4) + "\n");
  f.write(job + "/step_0/memory.limit_in_bytes", "9223372036854771712\n");
  f.write(job + "/step_0/task_1/memory.limit_in_bytes", std::to_string(8 * kGiB) + "\n");
  f.write(job + "/step_0/task_1/memory.usage_in_bytes", std::to_string(kGiB / 2) + "\n");
  const auto c = memory_cgroup(f.root());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->dir, f.at(job));
  EXPECT_EQ(c->limit, 2 * kGiB);
  EXPECT_EQ(c->in_use, kGiB * 3 / 4);
  EXPECT_EQ(c->available, kGiB * 5 / 4);
  EXPECT_FALSE(c->key.empty());
  EXPECT_EQ(own_cgroup_dir("memory", f.root()), f.at(job + "/step_0/task_1"));
}

// A container on cgroup v2 sees its own cgroup mounted as the root of the hierarchy: the walk
// starts and ends at the mount point. A mount point with a space is written escaped.
TEST(MemoryCgroup, AContainersOwnCgroupOnV2) {
  const FakeRoot f;
  f.write("/proc/self/cgroup", "0::/kubepods/burstable/pod1/ctr\n");
  f.write("/proc/self/mountinfo", mount_line("/kubepods/burstable/pod1/ctr", "/sys/fs/my\\040cgroup", "cgroup2",
                                             "rw,nsdelegate"));
  f.write("/sys/fs/my cgroup/memory.max", std::to_string(kGiB) + "\n");
  f.write("/sys/fs/my cgroup/memory.current", std::to_string(kGiB / 2) + "\n");
  f.write("/sys/fs/my cgroup/memory.stat", "anon 3\ninactive_file " + std::to_string(kGiB / 8) + "\n");
  const auto c = memory_cgroup(f.root());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->dir, f.at("/sys/fs/my cgroup"));
  EXPECT_EQ(c->limit, kGiB);
  EXPECT_EQ(c->available, kGiB - kGiB / 2 + kGiB / 8);
}

// "max" on every level, no memory controller, or nothing mounted: no limit to check against.
TEST(MemoryCgroup, NoLimitIsNone) {
  const FakeRoot f;
  f.write("/proc/self/cgroup", "0::/user.slice/session-1.scope\n");
  f.write("/proc/self/mountinfo", mount_line("/", "/sys/fs/cgroup", "cgroup2", "rw"));
  f.write("/sys/fs/cgroup/user.slice/memory.max", "max\n");
  f.write("/sys/fs/cgroup/user.slice/session-1.scope/memory.max", "max\n");
  EXPECT_FALSE(memory_cgroup(f.root()).has_value());
  EXPECT_EQ(own_cgroup_dir("memory", f.root()), f.at("/sys/fs/cgroup/user.slice/session-1.scope"));

  f.write("/proc/self/cgroup", "3:cpu:/\n");  // v1 without a memory hierarchy
  EXPECT_FALSE(memory_cgroup(f.root()).has_value());
  EXPECT_EQ(own_cgroup_dir("memory", f.root()), "");
  const FakeRoot empty;
  EXPECT_FALSE(memory_cgroup(empty.root()).has_value());
}

// A CPU quota on v1 (docker's --cpus on a cgroup v1 host: cpu.cfs_quota_us over cpu.cfs_period_us)
// in the hierarchy of cpu and cpuacct together: the job's 1.5 CPUs bind below a step's looser 4.
TEST(CpuQuota, TheTightestLevelAboveTheProcessOnV1) {
  const FakeRoot f;
  f.write("/proc/self/cgroup", "5:cpu,cpuacct:/slurm/job_7/step_0\n4:memory:/slurm/job_7/step_0\n");
  f.write("/proc/self/mountinfo", mount_line("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct") +
                                      mount_line("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory"));
  const std::string job = "/sys/fs/cgroup/cpu,cpuacct/slurm/job_7";
  f.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  f.write(job + "/cpu.cfs_quota_us", "150000\n");
  f.write(job + "/cpu.cfs_period_us", "100000\n");
  f.write(job + "/step_0/cpu.cfs_quota_us", "40000\n");
  f.write(job + "/step_0/cpu.cfs_period_us", "10000\n");
  const auto q = cpu_quota(f.root());
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->dir, f.at(job));
  EXPECT_DOUBLE_EQ(q->cpus, 1.5);
  EXPECT_FALSE(q->key.empty());
  EXPECT_EQ(own_cgroup_dir("cpu", f.root()), f.at(job + "/step_0"));
  EXPECT_FALSE(memory_cgroup(f.root()).has_value());  // the memory hierarchy sets no limit
}

// A pod's CPU limit on v2 (cpu.max "QUOTA PERIOD"); "max PERIOD" is none.
TEST(CpuQuota, APodsLimitOnV2AndMaxIsNone) {
  const FakeRoot f;
  f.write("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  f.write("/proc/self/mountinfo", mount_line("/", "/sys/fs/cgroup", "cgroup2", "rw"));
  f.write("/sys/fs/cgroup/kubepods/pod1/cpu.max", "250000 100000\n");
  f.write("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
  const auto q = cpu_quota(f.root());
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->dir, f.at("/sys/fs/cgroup/kubepods/pod1"));
  EXPECT_DOUBLE_EQ(q->cpus, 2.5);
  f.write("/sys/fs/cgroup/kubepods/pod1/cpu.max", "max 100000\n");
  EXPECT_FALSE(cpu_quota(f.root()).has_value());
}

// This machine's own, whatever it has: a limit found is consistent.
TEST(MemoryCgroup, ThisMachine) {
  if (const auto c = memory_cgroup()) {
    EXPECT_GT(c->limit, 0);
    EXPECT_LE(c->available, c->limit);
    EXPECT_TRUE(fs::is_directory(c->dir)) << c->dir;
  }
}

// A cgroup of `controller` below this process's own, limited by the first of `settings` (a file
// and what to write to it) that the cgroup has and keeps; its dir() is "" where this machine does
// not let the test make one (no cgroupfs, not root, the v2 controller not delegated).
class LimitedCgroup {
 public:
  LimitedCgroup(const std::string& controller, const std::vector<std::pair<std::string, std::string>>& settings) {
    const std::string own = own_cgroup_dir(controller);
    if (own.empty()) return;
    std::error_code ec;
    const fs::path dir = fs::path(own) / ("shardlm_test_" + std::to_string(::getpid()));
    if (!fs::create_directory(dir, ec)) return;
    dir_ = dir.string();
    for (const auto& [file, value] : settings) {
      if (!fs::exists(dir / file)) continue;
      std::ofstream(dir / file) << value;
      if (read_back(dir / file) == value) return;
    }
    fs::remove(dir_, ec);
    dir_.clear();
  }
  ~LimitedCgroup() {
    std::error_code ec;
    if (!dir_.empty()) fs::remove(dir_, ec);  // empty by then: its processes have exited
  }
  const std::string& dir() const { return dir_; }
  // `command` run in the cgroup.
  std::string in_it(const std::string& command) const {
    return "sh -c 'echo $$ > " + dir_ + "/cgroup.procs && exec " + command + "'";
  }

 private:
  static std::string read_back(const fs::path& file) {
    std::ifstream f(file);
    std::string line;
    std::getline(f, line);
    return line;
  }
  std::string dir_;
};

LimitedCgroup memory_limited(int64_t bytes) {
  return LimitedCgroup("memory", {{"memory.limit_in_bytes", std::to_string(bytes)}, {"memory.max", std::to_string(bytes)}});
}

// `small` at width 768 needs 0.68 GB of training state; in a cgroup of 256 MiB the run was killed
// by the kernel (SIGKILL, no word) however much memory the machine has. Now it is refused before
// allocating, with one line naming the cgroup and its limit.
TEST(MemoryCgroupSlow, ARunPastItsCgroupLimitIsOneLineNotAKill) {
  const LimitedCgroup cgroup = memory_limited(256 << 20);
  if (cgroup.dir().empty()) GTEST_SKIP() << "this machine does not let a test make a memory cgroup";
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("cgroup_one").code, 0);
  const testing::Result r =
      testing::run_command(cgroup.in_it(testing::shardlm_binary() + " " + runs.args("one", 1, 2, "small") + " --n-embd 768"));
  testing::expect_one_line_error(r, {"does not fit in memory", "the memory cgroup " + cgroup.dir(), "limit 0.25 GiB"});
  runs.remove();
}

// Two ranks under one limit each count the other: a model whose state fits the cgroup once but
// not twice is refused, naming both, where a machine with room for both passed it.
TEST(MemoryCgroupSlow, RanksUnderOneLimitShareIt) {
  const LimitedCgroup cgroup = memory_limited(768 << 20);
  if (cgroup.dir().empty()) GTEST_SKIP() << "this machine does not let a test make a memory cgroup";
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("cgroup_two").code, 0);
  // small with 4 blocks of width 768: 28 M parameters, 0.45 GB of state a rank under ddp
  const std::string args = runs.args("two", 1, 2, "small") + " --n-layer 4 --n-embd 768 --strategy ddp";
  const testing::MpiSession session;
  const testing::Result r = testing::run_command(
      session.env() + cgroup.in_it("mpirun --oversubscribe -np 2 " + testing::shardlm_binary() + " " + args));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 ranks share its limit; the memory cgroup " + cgroup.dir()), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Killed"), std::string::npos) << r.out;
  runs.remove();
}

// A run whose threads outnumber its CPU quota trains, throttled, and says so once, naming the
// cgroup and the threads that fit (docker --cpus 1 with --threads 2 here).
TEST(CpuQuotaSlow, ThreadsPastTheQuotaAreWarnedOf) {
  const LimitedCgroup cgroup("cpu", {{"cpu.cfs_quota_us", "100000"}, {"cpu.max", "100000 100000"}});
  if (cgroup.dir().empty()) GTEST_SKIP() << "this machine does not let a test make a CPU cgroup";
  testing::TinyRuns runs;
  runs.threads = 2;
  ASSERT_EQ(runs.create("cpu_quota").code, 0);
  const testing::Result r = testing::run_command(cgroup.in_it(testing::shardlm_binary() + " " + runs.args("quota", 1)));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("shardlm: warning: 2 compute threads a rank, but rank 0 under 1 CPU(s) of cgroup " +
                       cgroup.dir() + " (CPU quota"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("give --threads 1"), std::string::npos) << r.out;
  EXPECT_EQ(testing::count_lines(r.out), 1) << r.out;
  runs.remove();
}

}  // namespace
}  // namespace shardlm::train
