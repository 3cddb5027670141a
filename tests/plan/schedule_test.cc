#include "plan/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace shardlm::plan {
namespace {

struct Built {
  std::string what;
  Schedule schedule;
};

// Every schedule builder over ranks P <= 16, micro-batches M <= 64 and virtual stages V <= 4,
// sampled so that the small shapes (where the warm-up and the cool-down meet) are all there.
std::vector<Built> every_schedule() {
  std::vector<int> ranks, micro;
  for (int p = 1; p <= 16; ++p) ranks.push_back(p);
  for (int m = 1; m <= 64; m += m < 12 ? 1 : 7) micro.push_back(m);
  micro.push_back(64);
  std::vector<Built> all;
  auto add = [&](const std::string& what, const std::function<Schedule()>& build) { all.push_back({what, build()}); };
  for (int m : micro) {
    add("one-stage M=" + std::to_string(m), [&] { return one_stage(m); });
    add("one-stage forward-only M=" + std::to_string(m), [&] { return one_stage(m, Backward::none); });
  }
  for (int p : ranks)
    for (int m : micro) {
      const std::string pm = " P=" + std::to_string(p) + " M=" + std::to_string(m);
      add("gpipe" + pm, [&] { return gpipe(p, m); });
      add("1f1b" + pm, [&] { return one_f_one_b(p, m); });
      add("zb-h1" + pm, [&] { return zb_h1(p, m); });
    }
  for (int p : ranks)
    for (int v = 1; v <= 4; ++v)
      for (int k = 1; k * p <= 64; k += k < 4 ? 1 : 3)
        add("interleaved-1f1b P=" + std::to_string(p) + " V=" + std::to_string(v) + " M=" + std::to_string(k * p),
            [&] { return interleaved_one_f_one_b(p, v, k * p); });
  return all;
}

// Each action once, on its stage's rank, no deadlock, and each rank's activations in flight as
// the builder states them (the checker counts them from the action lists).
TEST(Schedule, EveryScheduleRunsEachActionOnceWithoutDeadlockAndHoldsWhatItStates) {
  int checked = 0;
  for (const Built& b : every_schedule()) {
    const ScheduleCheck c = check_schedule(b.schedule);
    ASSERT_TRUE(c.ok()) << b.what << ": " << c.error << "\n" << schedule_grid(b.schedule);
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

// The figures the papers give: GPipe holds every micro-batch, 1F1B rank r at most P - r, ZB-H1
// every rank P (1F1B's first rank's), interleaved 1F1B rank 0 (V - 1)·P + 2·P - 1 stages (of 1/V
// of a rank's layers each); all of them at most M.
TEST(Schedule, ActivationsInFlightFollowThePublishedFormulas) {
  for (int p = 1; p <= 16; ++p)
    for (int m = 1; m <= 64; m += 3) {
      const Schedule g = gpipe(p, m), f = one_f_one_b(p, m), z = zb_h1(p, m);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(check_schedule(g).peak_in_flight[r], m);
        EXPECT_EQ(check_schedule(f).peak_in_flight[r], std::min(p - r, m)) << "P=" << p << " M=" << m << " rank " << r;
        EXPECT_EQ(check_schedule(z).peak_in_flight[r], std::min(p, m)) << "P=" << p << " M=" << m << " rank " << r;
      }
    }
  for (int p = 2; p <= 8; ++p)
    for (int v = 1; v <= 4; ++v) {
      const int m = 4 * p;
      EXPECT_EQ(check_schedule(interleaved_one_f_one_b(p, v, m)).peak_in_flight[0], std::min((v - 1) * p + 2 * p - 1, m * v))
          << "P=" << p << " V=" << v;
    }
}

// Unit-time slots: GPipe and 1F1B take 2·(M + P - 1) slots (a bubble of P - 1 forwards and
// backwards), ZB-H1 with its weight gradients 3·M + 2·(P - 1) at most and more than 3·M.
TEST(Schedule, StepLengthsShowEachSchedulesBubble) {
  for (int p = 1; p <= 16; ++p)
    for (int m : {1, 2, 5, 16, 33, 64}) {
      EXPECT_EQ(check_schedule(gpipe(p, m)).slots, 2 * (m + p - 1)) << "P=" << p << " M=" << m;
      EXPECT_EQ(check_schedule(one_f_one_b(p, m)).slots, 2 * (m + p - 1)) << "P=" << p << " M=" << m;
      const int zb = check_schedule(zb_h1(p, m)).slots;
      EXPECT_LE(zb, 3 * m + 2 * (p - 1)) << "P=" << p << " M=" << m;
      EXPECT_GE(zb, 3 * m) << "P=" << p << " M=" << m;
    }
}

// The one-stage schedule is today's order: each micro-batch's forward, then its backward; and it
// is 1F1B on one rank.
TEST(Schedule, OneStageIsEachMicroBatchsForwardThenBackward) {
  const Schedule s = one_stage(3);
  const std::vector<Action> want = {{0, 0, Phase::forward}, {0, 0, Phase::backward}, {1, 0, Phase::forward},
                                    {1, 0, Phase::backward}, {2, 0, Phase::forward}, {2, 0, Phase::backward}};
  ASSERT_EQ(s.actions.size(), 1u);
  EXPECT_EQ(s.actions[0], want);
  EXPECT_EQ(one_f_one_b(1, 3).actions, s.actions);
  const Schedule eval = one_stage(2, Backward::none);
  EXPECT_EQ(eval.actions[0], (std::vector<Action>{{0, 0, Phase::forward}, {1, 0, Phase::forward}}));
  EXPECT_EQ(check_schedule(eval).peak_in_flight[0], 0);
}

TEST(Schedule, InterleavedStagesSitOnRanksRoundRobin) {
  const Schedule s = interleaved_one_f_one_b(4, 2, 8);
  ASSERT_EQ(s.stages, 8);
  for (int st = 0; st < 8; ++st) EXPECT_EQ(s.rank_of_stage[st], st % 4);
  // Rank 0 runs micro-batches 0..3 through stage 0, then through stage 4, before micro-batch 4.
  for (int k = 0; k < 8; ++k) {
    EXPECT_EQ(s.actions[0][k].phase, Phase::forward);
    EXPECT_EQ(s.actions[0][k].micro, k % 4);
    EXPECT_EQ(s.actions[0][k].stage, k < 4 ? 0 : 4);
  }
  EXPECT_THROW(interleaved_one_f_one_b(4, 2, 6), std::invalid_argument);
}

TEST(Schedule, CheckerCatchesADuplicateAMissingAndAMisplacedAction) {
  Schedule dup = one_f_one_b(4, 8);
  dup.actions[2][3] = dup.actions[2][1];
  EXPECT_NE(check_schedule(dup).error.find("twice"), std::string::npos) << check_schedule(dup).error;

  Schedule missing = gpipe(3, 4);
  missing.actions[1].pop_back();
  EXPECT_NE(check_schedule(missing).error.find("actions of the"), std::string::npos) << check_schedule(missing).error;

  Schedule misplaced = gpipe(2, 2);
  std::swap(misplaced.actions[0][0], misplaced.actions[1][0]);
  EXPECT_NE(check_schedule(misplaced).error.find("whose stage is on rank"), std::string::npos) << check_schedule(misplaced).error;

  Schedule wrong_phase = one_f_one_b(2, 2);
  wrong_phase.actions[0].back().phase = Phase::backward_weight;
  EXPECT_FALSE(check_schedule(wrong_phase).ok());
}

// A cycle of waits: the last rank runs micro-batch 1's forward before micro-batch 0's backward
// while rank 0 wants micro-batch 0's backward before it sends micro-batch 1 on; and a weight
// gradient listed before its own input gradient.
TEST(Schedule, CheckerCatchesACycleOfWaits) {
  Schedule s = gpipe(2, 2);
  s.actions[0] = {{0, 0, Phase::forward}, {0, 0, Phase::backward}, {1, 0, Phase::forward}, {1, 0, Phase::backward}};
  s.actions[1] = {{0, 1, Phase::forward}, {1, 1, Phase::forward}, {0, 1, Phase::backward}, {1, 1, Phase::backward}};
  const ScheduleCheck c = check_schedule(s);
  EXPECT_NE(c.error.find("deadlock"), std::string::npos) << c.error;
  EXPECT_NE(schedule_grid(s).find("unsound"), std::string::npos);

  Schedule z = zb_h1(2, 3);
  auto& line = z.actions[1];
  const auto w = std::find(line.begin(), line.end(), Action{0, 1, Phase::backward_weight});
  const auto b = std::find(line.begin(), line.end(), Action{0, 1, Phase::backward_input});
  std::iter_swap(w, b);
  EXPECT_NE(check_schedule(z).error.find("deadlock"), std::string::npos) << check_schedule(z).error;
}

TEST(Schedule, CheckerHoldsAScheduleToItsStatedInFlight) {
  Schedule s = one_f_one_b(4, 8);
  s.stated_in_flight[1] = 2;  // it holds 3
  EXPECT_NE(check_schedule(s).error.find("states 2"), std::string::npos) << check_schedule(s).error;
}

TEST(Schedule, GridDrawsARowPerRankWithTheBubble) {
  const std::string grid = schedule_grid(one_f_one_b(2, 2));
  // rank 0: F0 F1 . B0 . B1    rank 1: . F0 B0 F1 B1 .
  EXPECT_NE(grid.find("rank 0 | F0 F1 .  B0 .  B1"), std::string::npos) << grid;
  EXPECT_NE(grid.find("rank 1 | .  F0 B0 F1 B1 ."), std::string::npos) << grid;
  const std::string zb = schedule_grid(zb_h1(2, 2));
  EXPECT_NE(zb.find("W0"), std::string::npos) << zb;
  EXPECT_NE(schedule_grid(interleaved_one_f_one_b(2, 2, 2)).find("F0.2"), std::string::npos);
}

}  // namespace
}  // namespace shardlm::plan
