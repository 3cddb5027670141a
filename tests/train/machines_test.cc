// Which ranks share a machine: from the kernel each runs on, whatever the launcher's environment
// says (srun's direct launch sets none of Open MPI's OMPI_COMM_WORLD_LOCAL_* variables).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "run/test_util.h"
#include "train/machines.h"

namespace shardlm::train {
namespace {

// Every field of `got` against `want` {count, ranks_here, local_rank, block}.
void expect_layout(const Machines& got, const Machines& want) {
  EXPECT_EQ(got.count, want.count);
  EXPECT_EQ(got.ranks_here, want.ranks_here);
  EXPECT_EQ(got.local_rank, want.local_rank);
  EXPECT_EQ(got.block, want.block);
}

TEST(Machines, OneMachine) {
  const std::vector<std::string> hosts(4, "a");
  for (int r = 0; r < 4; ++r) expect_layout(machines_of(hosts, r), {1, 4, r, 4});
  EXPECT_EQ(describe(machines_of(hosts, 0)), "1 machine");
}

// Block placement (mpirun's and srun's default): a snapshot's partner copy goes one machine back.
TEST(Machines, BlocksOfConsecutiveRanks) {
  const std::vector<std::string> hosts{"a", "a", "a", "b", "b", "b"};
  expect_layout(machines_of(hosts, 4), {2, 3, 1, 3});
  EXPECT_EQ(describe(machines_of(hosts, 4)), "2 machines of 3");
}

// Round-robin placement (srun --distribution=cyclic) and uneven counts are no blocks: the
// partner stays rank r - 1 (in round-robin, on another machine), and each rank still counts the
// ranks its machine's memory is shared by.
TEST(Machines, PlacementsThatAreNotBlocks) {
  const std::vector<std::string> cyclic{"a", "b", "a", "b"};
  expect_layout(machines_of(cyclic, 2), {2, 2, 1, 1});
  EXPECT_EQ(describe(machines_of(cyclic, 2)), "2 machines");

  const std::vector<std::string> uneven{"a", "a", "a", "b"};
  EXPECT_EQ(machines_of(uneven, 3).ranks_here, 1);
  EXPECT_EQ(machines_of(uneven, 0).ranks_here, 3);
  EXPECT_EQ(machines_of(uneven, 0).block, 1);

  const std::vector<std::string> back{"a", "a", "b", "b", "a", "a"};  // a name seen again later
  EXPECT_EQ(machines_of(back, 4).block, 1);
  EXPECT_EQ(machines_of(back, 4).local_rank, 2);
}

// The ranks a memory cgroup's limit is shared by: those on the same machine under the same
// limiting cgroup (Slurm's job on each node; a container each, on one host). Without a limit
// the machine's ranks share its memory.
TEST(Machines, RanksUnderOneMemoryLimit) {
  const std::vector<std::string> hosts{"a", "a", "a", "b"}, limits{"job", "job", "pod", "job"};
  EXPECT_EQ(machines_of(hosts, 0, limits).ranks_under_memory_limit, 2);
  EXPECT_EQ(machines_of(hosts, 2, limits).ranks_under_memory_limit, 1);
  EXPECT_EQ(machines_of(hosts, 3, limits).ranks_under_memory_limit, 1);  // another machine's "job"
  EXPECT_EQ(machines_of(hosts, 0, {"", "", "", ""}).ranks_under_memory_limit, 3);
  EXPECT_EQ(machines_of(hosts, 0).ranks_under_memory_limit, 3);
}

// Hybrid shard without --shard-group shards inside a machine (PyTorch's HYBRID_SHARD): every
// rank where there is one machine, a block's ranks where machines hold blocks, and no group where
// no run of consecutive ranks is a machine.
TEST(Machines, HybridsShardGroupIsAMachinesRanks) {
  const std::vector<std::string> one(4, "a"), blocks{"a", "a", "a", "b", "b", "b"}, single{"a", "b", "c"},
      cyclic{"a", "b", "a", "b"}, uneven{"a", "a", "a", "b"};
  EXPECT_EQ(machine_shard_group(machines_of(one, 2), 4), 4);
  EXPECT_EQ(machine_shard_group(machines_of(blocks, 4), 6), 3);
  EXPECT_EQ(machine_shard_group(machines_of(single, 1), 3), 1);
  EXPECT_EQ(machine_shard_group(machines_of(cyclic, 1), 4), 0);
  EXPECT_EQ(machine_shard_group(machines_of(uneven, 3), 4), 0);
}

// Two ranks as two machines (the test seam): hybrid without --shard-group runs with a shard group
// of one, each rank holding whole parameters as --shard-group 1 does, and says so.
TEST(Machines, HybridWithoutAShardGroupShardsInsideEachMachine) {
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("hybrid_machines").code, 0);
  runs.flags = "--strategy hybrid";
  const testing::Result two = testing::mpirun(2, runs.args("two", 2), "-x SHARDLM_TEST_RANKS_ON_MACHINE=1");
  ASSERT_EQ(two.code, 0) << two.out;
  const testing::Result given = testing::mpirun(2, runs.args("given", 2) + " --shard-group 1");
  ASSERT_EQ(given.code, 0) << given.out;
  const testing::Result one = testing::mpirun(2, runs.args("one", 2));
  ASSERT_EQ(one.code, 0) << one.out;
  const auto info = [&](const std::string& run) {
    return nlohmann::json::parse(std::ifstream(runs.out(run) / "run_info.json"))["config"];
  };
  const auto params_held = [&](const std::string& run) {
    return testing::read_metrics(runs.out(run) / "metrics.jsonl").front()["mem_between_steps"]["params"].get<int64_t>();
  };
  EXPECT_EQ(info("two")["strategy"], "hybrid (shard group 1)");
  EXPECT_EQ(info("one")["strategy"], "hybrid (shard group 2)");
  EXPECT_EQ(params_held("two"), params_held("given"));
  EXPECT_LT(params_held("one"), params_held("two"));
  runs.remove();
}

// Two ranks under mpirun with Open MPI's local-rank variables taken away, as srun's direct
// launch leaves them: the run still finds both on one machine (run_info.json says so); the test
// seam's blocks stand in for two machines.
TEST(Machines, FoundWithoutTheLaunchersLocalVariables) {
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("machines").code, 0);
  const std::string bare = "env -u OMPI_COMM_WORLD_LOCAL_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK";
  const auto machines_of_run = [&](const std::string& run) {
    return nlohmann::json::parse(std::ifstream(runs.out(run) / "run_info.json"))["config"]["machines"];
  };
  const testing::Result r = testing::mpirun(2, runs.args("bare", 1), bare);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(machines_of_run("bare"), "1 machine");
  const testing::Result seam = testing::mpirun(2, runs.args("seam", 1), "-x SHARDLM_TEST_RANKS_ON_MACHINE=1 " + bare);
  ASSERT_EQ(seam.code, 0) << seam.out;
  EXPECT_EQ(machines_of_run("seam"), "2 machines");
  runs.remove();
}

// More compute threads than CPUs a rank may run on (mpirun binds each rank to one core when it
// starts two or fewer; taskset here) is said in one warning from rank 0, naming the ranks; threads
// that fit their CPUs say nothing.
TEST(Machines, ThreadsBeyondTheAllowedCpusAreWarnedOf) {
  testing::TinyRuns runs;
  runs.threads = 2;
  ASSERT_EQ(runs.create("threads").code, 0);
  const testing::Result pinned =
      testing::run_command("taskset -c 0 " + testing::shardlm_binary() + " " + runs.args("pinned", 1));
  ASSERT_EQ(pinned.code, 0) << pinned.out;
  EXPECT_NE(pinned.out.find("shardlm: warning: 2 compute threads a rank, but rank 0 on 1 CPU(s) (CPU affinity)"),
            std::string::npos) << pinned.out;
  EXPECT_EQ(testing::count_lines(pinned.out), 1) << pinned.out;
  runs.threads = 1;
  const testing::Result fits = testing::mpirun(2, runs.args("fits", 1));
  ASSERT_EQ(fits.code, 0) << fits.out;
  EXPECT_EQ(fits.out.find("warning"), std::string::npos) << fits.out;
  runs.remove();
}

// Ranks under one CPU quota (one machine, one cgroup) share it: two ranks of two threads under 2
// CPUs are warned of, with the threads a rank that fit; the same cgroup key on another machine
// is another quota, and a rank without a quota has nothing to fit.
TEST(Machines, ThreadsPastACpuQuotaTheirRanksShareAreWarnedOf) {
  const RankCpus pod{8, "m1 0:5", "/sys/fs/cgroup/pod", 2.0}, other_machine{8, "m2 0:5", "/sys/fs/cgroup/pod", 2.0},
      free{8, "", "", 0.0};
  const auto lines = threads_beyond_cpus({pod, pod, other_machine, free}, 2);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0],
            "2 compute threads a rank, but ranks 0, 1 under 2 CPU(s) of cgroup /sys/fs/cgroup/pod (CPU quota: docker "
            "--cpus, a pod's CPU limit): the kernel throttles threads past a quota every period, and a throttled thread "
            "holds up the others at each barrier; give --threads 1");
  EXPECT_TRUE(threads_beyond_cpus({pod, pod, other_machine, free}, 1).empty());
  const auto crowded = threads_beyond_cpus({pod, pod, pod}, 1);  // fewer threads would not do
  ASSERT_EQ(crowded.size(), 1u);
  EXPECT_NE(crowded[0].find("ranks 0, 1, 2 under 2 CPU(s)"), std::string::npos) << crowded[0];
  EXPECT_NE(crowded[0].find("; start fewer ranks under it, or give it more CPUs"), std::string::npos) << crowded[0];

  const RankCpus pinned{1, "", "", 0.0};  // and bound to one core: both are said
  EXPECT_EQ(threads_beyond_cpus({pinned, pod, pod}, 2).size(), 2u);
  const auto six = threads_beyond_cpus(std::vector<RankCpus>(6, pinned), 2);  // the first four named
  ASSERT_EQ(six.size(), 1u);
  EXPECT_NE(six[0].find("but rank 0 on 1, rank 1 on 1, rank 2 on 1, rank 3 on 1, and 2 more ranks on fewer than 2 CPU(s)"),
            std::string::npos) << six[0];
}

}  // namespace
}  // namespace shardlm::train
