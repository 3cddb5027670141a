// In-memory snapshots end to end, under mpirun: a relaunch with --resume auto after a rank was
// killed continues from the last snapshot with the uninterrupted run's losses bit for bit; a
// lost rank's segments are rebuilt from its partner's copy (N = 2) or its group's parity (N = 4,
// G = 2); a flipped byte is detected and the run falls back to the disk checkpoint, saying so;
// two ranks' segments swapped are not taken for each other's state; a snapshot taken on 4 ranks
// restores on 2 (and one on 2 on 4), resharded in memory.
// Every test removes the shared-memory segments its runs made, also when it fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include "ckpt/snapshot.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::step_losses;

class SnapshotSlow : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --timeout 60 --strategy fsdp";
    runs_.create("snap");
  }
  static void TearDownTestSuite() { runs_.remove(); }
  // Whatever a test's runs left in /dev/shm goes, pass or fail.
  void TearDown() override {
    for (const auto& out : outs_) ckpt::remove_snapshot_segments(ckpt::snapshot_prefix(out) + "-");
  }
  // The run directory of run NAME, whose segments this test removes.
  std::string out(const std::string& name) {
    outs_.push_back(runs_.out(name).string());
    return outs_.back();
  }
  static std::string args(const std::string& name, const std::string& extra = "", int steps = 10) {
    return runs_.args(name, steps) + " " + extra;
  }
  // The uninterrupted run's losses on `ranks` ranks (run once per rank count).
  std::vector<double> straight(int ranks) {
    const std::string name = "straight_" + std::to_string(ranks), o = out(name);
    if (!fs::exists(fs::path(o) / "metrics.jsonl")) {
      const Result r = mpirun(ranks, args(name));
      EXPECT_EQ(r.code, 0) << r.out;
    }
    return step_losses(fs::path(o) / "metrics.jsonl");
  }
  static std::vector<std::string> segments(const std::string& out, const std::string& infix = "") {
    std::vector<std::string> names;
    for (const auto& s : ckpt::list_snapshot_slots(ckpt::snapshot_prefix(out) + "-" + infix, false)) names.push_back(s.name);
    return names;
  }
  // Rank 1 killed at step 6 of run NAME (snapshots every step, `flags` besides), then every
  // segment it held removed, as on a lost node: the relaunch continues from the snapshot of
  // step 6 with the uninterrupted losses, saying it rebuilt rank 1's state `from`.
  // `check_segments` looks at what the crash left before they are removed.
  void expect_lost_rank_rebuilt(const std::string& name, int ranks, const std::string& flags, const std::string& from,
                                const std::function<void(const std::string&)>& check_segments) {
    const auto want = straight(ranks);
    const std::string o = out(name);
    ASSERT_NE(crash(ranks, args(name, "--snapshot-every 1" + flags), 6).code, 0);
    check_segments(o);
    ckpt::remove_snapshot_segments(ckpt::snapshot_prefix(o) + "-rank1-");
    const Result r = mpirun(ranks, args(name, "--snapshot-every 1" + flags + " --resume auto"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("snapshot of step 6"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("rank 1's rebuilt from " + from), std::string::npos) << r.out;
    EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);
  }
  // Kills rank 1 at the start of step `k` of a run taking a snapshot every step.
  static Result crash(int ranks, const std::string& a, int k) {
    return mpirun(ranks, a, "-x SHARDLM_FAULT_KILL=1:" + std::to_string(k));
  }
  std::vector<std::string> outs_;
  static inline testing::TinyRuns runs_;
};

// Renames /dev/shm/A to B and B to A.
void swap_segments(const std::string& a, const std::string& b) {
  const fs::path shm = "/dev/shm", aside = shm / (a + ".swapping");
  fs::rename(shm / a, aside);
  fs::rename(shm / b, shm / a);
  fs::rename(aside, shm / b);
}

void flip_byte(const std::string& segment, int64_t at) {
  std::fstream f("/dev/shm/" + segment, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << segment;
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

// 10 steps straight vs 5 + resume from the snapshot of step 5 + 5 (no disk checkpoint exists):
// the same losses bit for bit, and a run that ends normally leaves no segment behind.
TEST_F(SnapshotSlow, ResumeFromSnapshotGivesTheUninterruptedLossesBitwise) {
  const auto want = straight(2);
  const std::string o = out("five");
  ASSERT_NE(mpirun(2, args("five", "--snapshot-every 5"), "-x SHARDLM_FAULT_KILL=0:5").code, 0);
  EXPECT_EQ(segments(o, "rank0-own").size(), 2u);
  const Result listed = testing::shardlm("ckpt snapshots --out " + o);  // what it holds, verified
  EXPECT_NE(listed.out.find(ckpt::snapshot_prefix(o) + "-rank1-own-slot"), std::string::npos) << listed.out;
  EXPECT_NE(listed.out.find("step 5  world 2"), std::string::npos) << listed.out;
  EXPECT_EQ(listed.out.find("mismatch"), std::string::npos) << listed.out;
  const Result r = mpirun(2, args("five", "--snapshot-every 5 --resume auto"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("took the in-memory snapshot of step 5"), std::string::npos) << r.out;
  EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);  // exact
  EXPECT_TRUE(segments(o).empty()) << "snapshots left after a normal end";
}

// A /dev/shm too small for the snapshots (a container's is 64 MiB unless given --shm-size) used
// to kill the run with SIGBUS at its first write into the sparse segment. The segment is reserved
// when made, so the run ends with one line naming /dev/shm and what it has free, and leaves no
// segment. Run in a mount namespace of its own with a 1 MiB /dev/shm (skipped where that is not
// permitted).
TEST_F(SnapshotSlow, ADevShmTooSmallIsOneLineNotABusError) {
  const std::string o = out("small_shm");
  const Result r = testing::run_command("unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm || exit 77; " +
                                        testing::shardlm_binary() + " " + args("small_shm", "--snapshot-every 1", 2) +
                                        "; code=$?; ls /dev/shm; exit $code'");
  if (r.code == 77 || r.out.find("unshare:") != std::string::npos) GTEST_SKIP() << "no mount namespace here: " << r.out;
  // One line in all: `ls /dev/shm` would add one for a segment left behind.
  testing::expect_one_line_error(r, {"/dev/shm has no room for", "bytes free of its 1048576"});
  EXPECT_EQ(r.out.find("Bus error"), std::string::npos) << r.out;
}

// `ckpt snapshots --clear` removes a run's segments (and only that run's).
TEST_F(SnapshotSlow, CkptSnapshotsClearRemovesTheRunsSegments) {
  const std::string a = out("clear_a"), b = out("clear_b");
  ASSERT_NE(mpirun(2, args("clear_a", "--snapshot-every 1"), "-x SHARDLM_FAULT_KILL=0:2").code, 0);
  ASSERT_NE(mpirun(2, args("clear_b", "--snapshot-every 1"), "-x SHARDLM_FAULT_KILL=0:2").code, 0);
  ASSERT_EQ(segments(a).size(), 8u);
  const Result r = testing::shardlm("ckpt snapshots --clear --out " + a);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("removed 8 snapshot segment(s)"), std::string::npos) << r.out;
  EXPECT_TRUE(segments(a).empty());
  EXPECT_EQ(segments(b).size(), 8u);
}

// The shared memory each rank maps is the plan's `snapshot` figure (what `explain` prints), and
// metrics.jsonl shows it: partner copies on 2 ranks, parity on 4 (the parity holders hold most).
TEST_F(SnapshotSlow, SnapshotMemoryIsThePlansFigure) {
  for (const auto& [ranks, parity] : {std::pair{2, 0}, {4, 2}}) {
    const std::string name = "mem_" + std::to_string(ranks), o = out(name);
    const std::string flags = " --snapshot-every 1 --snapshot-parity " + std::to_string(parity);
    const Result r = mpirun(ranks, args(name, "--vocab 256" + flags, 3));
    ASSERT_EQ(r.code, 0) << r.out;
    const Result e = testing::shardlm("explain --model tiny --vocab 256 --batch 2 --seq 32 --threads 1 --strategy fsdp --ranks " +
                                      std::to_string(ranks) + flags);
    ASSERT_EQ(e.code, 0) << e.out;
    const size_t at = e.out.find("  snapshot: static ");
    ASSERT_NE(at, std::string::npos) << e.out;
    const int64_t planned = std::stoll(e.out.substr(at + 19));
    EXPECT_GT(planned, 0);
    int steps = 0;
    for (const auto& row : testing::read_metrics(fs::path(o) / "metrics.jsonl")) {
      if (!row.contains("mem_between_steps")) continue;
      ++steps;  // every slot is mapped before the first step
      EXPECT_EQ(row["mem_between_steps"]["snapshot"].get<int64_t>(), planned) << ranks << " ranks";
    }
    EXPECT_EQ(steps, 3);
  }
}

// --snapshot-every 1, rank 1 killed at step 6: the relaunch continues from step 6 (>= k - 1)
// with the uninterrupted losses, on 2 and on 4 ranks.
TEST_F(SnapshotSlow, ARankKilledMidRunResumesFromTheLastSnapshot) {
  for (int ranks : {2, 4}) {
    const auto want = straight(ranks);
    const std::string name = "kill_" + std::to_string(ranks), o = out(name);
    ASSERT_NE(crash(ranks, args(name, "--snapshot-every 1"), 6).code, 0);
    const Result r = mpirun(ranks, args(name, "--snapshot-every 1 --resume auto"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("took the in-memory snapshot of step 6"), std::string::npos) << r.out;
    EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want) << ranks << " ranks";
  }
}

// A lost node: every segment rank 1 held is gone before the relaunch. Its state comes back from
// rank 0's copy of it.
TEST_F(SnapshotSlow, ALostRanksSnapshotIsRebuiltFromItsPartnerCopy) {
  expect_lost_rank_rebuilt("partner", 2, "", "its partner copy", [](const std::string& o) {
    ASSERT_EQ(segments(o, "rank1-").size(), 4u);  // own and rank 0's copy, two slots each
  });
}

// Four ranks as two machines of two (the test seam): rank r's copy is held by r − 2, on the other
// machine, so a lost machine (every segment of ranks 0 and 1 gone) is rebuilt from those copies.
TEST_F(SnapshotSlow, ALostMachineIsRebuiltFromCopiesOnTheOther) {
  const auto want = straight(4);
  const std::string o = out("machines"), seam = "-x SHARDLM_TEST_RANKS_ON_MACHINE=2";
  ASSERT_NE(mpirun(4, args("machines", "--snapshot-every 1"), seam + " -x SHARDLM_FAULT_KILL=1:6").code, 0);
  EXPECT_EQ(segments(o, "rank3-copy1-").size(), 2u);
  EXPECT_EQ(segments(o, "rank2-copy0-").size(), 2u);
  EXPECT_EQ(segments(o, "rank0-copy2-").size(), 2u);
  for (const char* rank : {"-rank0-", "-rank1-"}) ckpt::remove_snapshot_segments(ckpt::snapshot_prefix(o) + rank);
  const Result r = mpirun(4, args("machines", "--snapshot-every 1 --resume auto"), seam);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("snapshot of step 6"), std::string::npos) << r.out;
  for (const char* rank : {"rank 0's", "rank 1's"})
    EXPECT_NE(r.out.find(std::string(rank) + " rebuilt from its partner copy"), std::string::npos) << r.out;
  EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);
}

// N = 4, --snapshot-parity 2: groups {0,1} and {2,3}, parities held by ranks 2 and 0. Rank 1's
// segments are gone; its state is parity(0,1) XOR rank 0's.
TEST_F(SnapshotSlow, ALostRanksSnapshotIsRebuiltFromParity) {
  expect_lost_rank_rebuilt("parity", 4, " --snapshot-parity 2", "its group's parity", [](const std::string& o) {
    EXPECT_EQ(segments(o, "rank2-parity0").size(), 2u);
    EXPECT_EQ(segments(o, "rank0-parity1").size(), 2u);
    EXPECT_TRUE(segments(o, "rank1-copy").empty()) << "parity keeps no copies";
  });
}

// One byte of rank 1's state flipped in both its slots: detected, never used; the relaunch takes
// the disk checkpoint of step 6 instead, says so, and still gives the uninterrupted losses.
TEST_F(SnapshotSlow, AFlippedByteIsDetectedAndTheDiskCheckpointIsUsed) {
  const auto want = straight(2);
  const std::string o = out("flip");
  ASSERT_NE(crash(2, args("flip", "--snapshot-every 1 --save-every 3"), 7).code, 0);
  const auto own = segments(o, "rank1-own");
  ASSERT_EQ(own.size(), 2u);
  for (const auto& s : own) flip_byte(s, ckpt::kSnapshotHeaderBytes + 1000);
  const Result r = mpirun(2, args("flip", "--snapshot-every 1 --save-every 3 --resume auto"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("payload checksum mismatch"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("took the checkpoint " + o + "/ckpt/step_6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("failed its checksum"), std::string::npos) << r.out;
  EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);
}

// Ranks 0 and 1's own segments swapped (renamed into each other's names) used to verify: every
// rank "resumed" the other's shard and the losses jumped (1.69 to 5.52 in the report). Each slot
// says whose state it is: both are refused, and each rank's state is rebuilt from its partner's
// copy, giving the uninterrupted losses.
TEST_F(SnapshotSlow, SwappedOwnSegmentsAreRebuiltFromThePartnerCopies) {
  const auto want = straight(2);
  const std::string o = out("swap_own");
  ASSERT_NE(crash(2, args("swap_own", "--snapshot-every 1"), 6).code, 0);
  const std::string prefix = ckpt::snapshot_prefix(o);
  for (const char* slot : {"-slot0", "-slot1"}) swap_segments(prefix + "-rank0-own" + slot, prefix + "-rank1-own" + slot);
  const Result r = mpirun(2, args("swap_own", "--snapshot-every 1 --resume auto"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rank1-own-slot0: holds rank 0's state"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not what its name says"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("took the in-memory snapshot of step 6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0's rebuilt from its partner copy; rank 1's rebuilt from its partner copy"), std::string::npos)
      << r.out;
  EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);
}

// Every segment of ranks 0 and 1 swapped: no slot is what its name says, so no snapshot can be
// had; the relaunch takes the disk checkpoint, says why, and gives the uninterrupted losses.
TEST_F(SnapshotSlow, SwappedRanksFallBackToTheDiskCheckpoint) {
  const auto want = straight(2);
  const std::string o = out("swap_all");
  ASSERT_NE(crash(2, args("swap_all", "--snapshot-every 1 --save-every 3"), 7).code, 0);
  const std::string prefix = ckpt::snapshot_prefix(o);
  for (const char* held : {"-own", "-copy0", "-copy1"})
    for (const char* slot : {"-slot0", "-slot1"}) {
      const std::string zero = prefix + "-rank0" + held + slot, one = prefix + "-rank1" + held + slot;
      if (fs::exists("/dev/shm/" + zero) || fs::exists("/dev/shm/" + one)) {
        if (!fs::exists("/dev/shm/" + zero)) fs::rename("/dev/shm/" + one, "/dev/shm/" + zero);
        else if (!fs::exists("/dev/shm/" + one)) fs::rename("/dev/shm/" + zero, "/dev/shm/" + one);
        else swap_segments(zero, one);
      }
    }
  ASSERT_EQ(segments(o, "rank0-copy0").size(), 2u);  // rank 1's copy of rank 0, now under rank 0's name
  const Result r = mpirun(2, args("swap_all", "--snapshot-every 1 --save-every 3 --resume auto"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("not what its name says"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("took the checkpoint " + o + "/ckpt/step_6"), std::string::npos) << r.out;
  EXPECT_EQ(step_losses(fs::path(o) / "metrics.jsonl"), want);
}

// A lost machine's survivors on fewer ranks: 4 ranks as two machines of two (the test seam),
// snapshots and checkpoints every 5 steps, rank 1 killed at step 7 and every segment of the other
// machine's ranks (2, 3) gone. --resume auto on 2 ranks (the same global batch, 2 x 4) reshards
// the snapshot of step 5 in memory from what ranks 0 and 1 hold (their own states and their copies
// of 2's and 3's): its losses from step 5 are a 2-rank run's from the 4-rank run's checkpoint of
// step 5, bit for bit, and no checkpoint was there to read. And the other way, 2 ranks onto 4.
TEST_F(SnapshotSlow, ASnapshotReshardsInMemoryToAnotherWorldSize) {
  auto batch = [](int ranks) { return " --batch " + std::to_string(8 / ranks); };
  for (const auto& [from, to] : {std::pair{4, 2}, {2, 4}}) {
    const std::string name = "reshard_" + std::to_string(from) + "_" + std::to_string(to), o = out(name);
    const std::string seam = from == 4 ? "-x SHARDLM_TEST_RANKS_ON_MACHINE=2 " : "";
    ASSERT_NE(mpirun(from, args(name, "--snapshot-every 5 --save-every 5" + batch(from)), seam + "-x SHARDLM_FAULT_KILL=1:7").code, 0);
    if (from == 4)
      for (const char* rank : {"-rank2-", "-rank3-"}) ckpt::remove_snapshot_segments(ckpt::snapshot_prefix(o) + rank);
    const fs::path saved = runs_.dir / (name + "_saved");
    fs::rename(fs::path(o) / "ckpt", saved);  // the reference's: the resumed run finds no checkpoint
    const Result r = mpirun(to, args(name, "--snapshot-every 5 --resume auto" + batch(to)));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("took the in-memory snapshot of step 5 (every state of the " + std::to_string(from) + " ranks"),
              std::string::npos)
        << r.out;
    EXPECT_FALSE(fs::exists(fs::path(o) / "ckpt"));
    const std::string ref = name + "_ref";
    out(ref);
    const Result f = mpirun(to, args(ref, "--resume " + (saved / "step_5").string() + batch(to)));
    ASSERT_EQ(f.code, 0) << f.out;
    const auto got = step_losses(fs::path(o) / "metrics.jsonl"), want = step_losses(runs_.out(ref) / "metrics.jsonl");
    ASSERT_EQ(got.size(), 10u);
    ASSERT_EQ(want.size(), 5u);
    EXPECT_EQ(std::vector<double>(got.begin() + 5, got.end()), want) << from << " ranks onto " << to;
    EXPECT_TRUE(segments(o).empty()) << "snapshots left after a normal end";
  }
}

}  // namespace
}  // namespace shardlm
