// The snapshot store on one process: slots alternate, a slot whose valid flag is down (its writer
// died mid-write) is skipped for the older one, a damaged header or payload is never used, a
// snapshot of another size, run or mesh place is not this run's, a slot under another rank's
// name says whose it is, a slot of the older format is refused, and the memory it maps is the
// figure the plan is given. Each test removes the segments it made (a fixture, also on failure).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "ckpt/snapshot.h"
#include "comm/single_rank.h"

namespace shardlm::ckpt {
namespace {

class SnapshotStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = "/tmp/shardlm_snapstore_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    prefix_ = snapshot_prefix(run_);
  }
  void TearDown() override { remove_snapshot_segments(prefix_ + "-"); }
  std::unique_ptr<SnapshotStore> store(SnapshotMesh mesh = {{"dp_replicate", "dp_shard"}, {{0, 0}}}) {
    return std::make_unique<SnapshotStore>(run_, comm_, memory_, SnapshotScheme{1, 0}, std::move(mesh),
                                           std::chrono::milliseconds(10000));
  }
  // A state of 3 parts whose every float says which step wrote it.
  std::vector<StatePart> parts(std::vector<float>& buf, float step) {
    buf.assign(3000, 0);
    std::iota(buf.begin(), buf.end(), step * 10000);
    return {{buf.data(), 4000}, {buf.data() + 1000, 4000}, {buf.data() + 2000, 4000}};
  }
  void save(SnapshotStore& s, int64_t step, const std::string& run = kRun) {
    std::vector<float> buf;
    s.save(run, step, {{"step", step}}, parts(buf, static_cast<float>(step)));
  }
  static inline const std::string kRun = "0123456789abcdef0123456789abcdef";
  std::string own(int slot) const { return prefix_ + "-rank0-own-slot" + std::to_string(slot); }
  void poke(const std::string& segment, int64_t at, char x) {
    std::fstream f("/dev/shm/" + segment, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f) << segment;
    f.seekp(at);
    f.write(&x, 1);
  }
  int slot_of(int64_t step) {
    for (const auto& s : list_snapshot_slots(prefix_ + "-", false))
      if (s.step == step && s.status == "ok") return s.slot;
    return -1;
  }
  MemoryPool memory_;
  comm::SingleRankCommunicator comm_{memory_};
  std::string run_, prefix_;
};

TEST_F(SnapshotStoreTest, NewestStepIsRestoredBitwiseAndSlotsAlternate) {
  auto s = store();
  for (int64_t step : {3, 4, 5}) save(*s, step);
  EXPECT_EQ(slot_of(3), -1);  // overwritten: two slots keep the newest two
  EXPECT_NE(slot_of(4), slot_of(5));
  const SnapshotChoice c = s->find_newest(12000, kRun);
  ASSERT_EQ(c.step, 5) << c.why;
  EXPECT_EQ(c.meta["step"], 5);
  std::vector<float> want, got(3000, -1);
  parts(want, 5);
  s->restore(c, {{got.data(), 4000}, {got.data() + 1000, 4000}, {got.data() + 2000, 4000}});
  EXPECT_EQ(got, want);
}

TEST_F(SnapshotStoreTest, ASlotBeingWrittenIsSkippedForTheOlderOne) {
  auto s = store();
  save(*s, 4);
  save(*s, 5);
  poke(own(slot_of(5)), kSnapshotHeaderBytes - 8, 0);  // the valid flag, as a writer killed mid-copy leaves it
  const SnapshotChoice c = store()->find_newest(12000, kRun);
  EXPECT_EQ(c.step, 4) << c.why;
}

TEST_F(SnapshotStoreTest, AFlippedPayloadByteTaintsItsStep) {
  auto s = store();
  save(*s, 4);
  save(*s, 5);
  poke(own(slot_of(5)), kSnapshotHeaderBytes + 17, 0x55);
  const SnapshotChoice c = store()->find_newest(12000, kRun);
  EXPECT_EQ(c.step, 4) << c.why;
  EXPECT_NE(c.why.find("step 5: a slot failed its checksum"), std::string::npos) << c.why;
  const auto slots = list_snapshot_slots(prefix_ + "-", true);
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_EQ(slots[slot_of(4) == 0 ? 1 : 0].status, "payload checksum mismatch");
}

TEST_F(SnapshotStoreTest, ADamagedHeaderTaintsEveryStep) {
  auto s = store();
  save(*s, 4);
  save(*s, 5);
  poke(own(slot_of(4)), 8, 0x7f);  // the step field: the header's own checksum fails
  const SnapshotChoice c = store()->find_newest(12000, kRun);
  EXPECT_EQ(c.step, -1) << c.why;
  EXPECT_NE(c.why.find("failed its checksum"), std::string::npos) << c.why;
}

TEST_F(SnapshotStoreTest, ASnapshotOfAnotherSizeIsNotThisRunsAndRemovalClearsAll) {
  auto s = store();
  save(*s, 4);
  EXPECT_EQ(store()->find_newest(8000, kRun).step, -1);
  s->remove_held();
  EXPECT_TRUE(list_snapshot_slots(prefix_ + "-", false).empty());
}

// Two runs in the same directory share its segment names: a snapshot records the run that wrote
// it, and another run (a new one, or one started with --overwrite) never takes it for its own;
// nor does a run whose mesh places its ranks elsewhere.
TEST_F(SnapshotStoreTest, ASnapshotOfAnotherRunOrMeshPlaceIsNotUsed) {
  auto s = store();
  save(*s, 4);
  save(*s, 5);
  const SnapshotChoice other = store()->find_newest(12000, "fedcba9876543210fedcba9876543210");
  EXPECT_EQ(other.step, -1) << other.why;
  EXPECT_EQ(store({{"dp"}, {{0}}})->find_newest(12000, kRun).step, -1);
  const SnapshotChoice mine = store()->find_newest(12000, kRun);
  EXPECT_EQ(mine.step, 5) << mine.why;
  EXPECT_EQ(mine.run_id, kRun);
  for (const auto& slot : list_snapshot_slots(prefix_ + "-", true)) EXPECT_EQ(slot.run_id, kRun) << slot.name;
}

// Rank 0's segment renamed to rank 1's name (as two ranks' segments swapped in /dev/shm are) is
// still rank 0's state, and its header says so: it is not taken for rank 1's.
TEST_F(SnapshotStoreTest, ASlotUnderAnotherRanksNameSaysWhoseStateItIs) {
  auto s = store();
  save(*s, 4);
  const std::string renamed = prefix_ + "-rank1-own-slot" + std::to_string(slot_of(4));
  std::filesystem::rename("/dev/shm/" + own(slot_of(4)), "/dev/shm/" + renamed);
  bool listed = false;
  for (const auto& slot : list_snapshot_slots(prefix_ + "-", true)) {
    if (slot.name != renamed) continue;
    listed = true;
    EXPECT_NE(slot.status.find("holds rank 0's state"), std::string::npos) << slot.status;
    EXPECT_NE(slot.status.find("not what its name says"), std::string::npos) << slot.status;
  }
  EXPECT_TRUE(listed);
}

// A slot of the format before runs and owners were recorded is refused, not misread, and does not
// count as damaged memory.
TEST_F(SnapshotStoreTest, ASlotOfTheOlderFormatIsRefused) {
  auto s = store();
  save(*s, 4);
  poke(own(slot_of(4)), 7, '1');  // "SLMSNAP1"
  const auto slots = list_snapshot_slots(prefix_ + "-", true);
  ASSERT_EQ(slots.size(), 2u);
  bool refused = false;
  for (const auto& slot : slots) refused |= slot.status.rfind("written in another snapshot format (SLMSNAP1", 0) == 0;
  EXPECT_TRUE(refused);
  const SnapshotChoice c = store()->find_newest(12000, kRun);
  EXPECT_EQ(c.step, -1) << c.why;
  EXPECT_EQ(c.why.find("checksum"), std::string::npos) << c.why;
}

TEST_F(SnapshotStoreTest, MappedBytesAreThePlansFigure) {
  const int64_t before = memory_.tracker().live()[MemCategory::snapshot];
  {
    auto s = store();
    s->prepare(12000);
    save(*s, 1);
    EXPECT_EQ(memory_.tracker().live()[MemCategory::snapshot] - before, snapshot_bytes_held({1, 0}, 0, 12000));
  }
  EXPECT_EQ(memory_.tracker().live()[MemCategory::snapshot], before);
  // Partner copies double it; parity adds a parity segment and its receive buffers on its holders only.
  EXPECT_EQ(snapshot_bytes_held({2, 0}, 1, 12000), 2 * snapshot_bytes_held({1, 0}, 0, 12000));
  EXPECT_GT(snapshot_bytes_held({4, 2}, 2, 12000), snapshot_bytes_held({4, 2}, 1, 12000));
  EXPECT_EQ(snapshot_bytes_held({4, 2}, 1, 12000), snapshot_bytes_held({1, 0}, 0, 12000));
  EXPECT_THROW((SnapshotScheme{2, 2}.check()), std::invalid_argument);  // no rank outside the group
}

}  // namespace
}  // namespace shardlm::ckpt
