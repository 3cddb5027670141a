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

// Every schedule builder over every ranks P <= 16 and micro-batches M <= 64, interleaved 1F1B
// with virtual stages V <= 4 over every M it takes (a multiple of P), zbv with its fixed two.
std::vector<Built> every_schedule() {
  std::vector<Built> all;
  auto add = [&](const std::string& what, const std::function<Schedule()>& build) { all.push_back({what, build()}); };
  for (int m = 1; m <= 64; ++m) {
    add("one-stage M=" + std::to_string(m), [&] { return one_stage(m); });
    add("one-stage forward-only M=" + std::to_string(m), [&] { return one_stage(m, Backward::none); });
  }
  for (int p = 1; p <= 16; ++p)
    for (int m = 1; m <= 64; ++m) {
      const std::string pm = " P=" + std::to_string(p) + " M=" + std::to_string(m);
      add("gpipe" + pm, [&] { return gpipe(p, m); });
      add("1f1b" + pm, [&] { return one_f_one_b(p, m); });
      add("zb-h1" + pm, [&] { return zb_h1(p, m); });
      add("zbv" + pm, [&] { return zbv(p, m); });
    }
  for (int p = 1; p <= 16; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m = p; m <= 64; m += p)
        add("interleaved-1f1b P=" + std::to_string(p) + " V=" + std::to_string(v) + " M=" + std::to_string(m),
            [&] { return interleaved_one_f_one_b(p, v, m); });
  return all;
}

// The actions a schedule's ranks leave idle over its step: slots times ranks, less its actions.
int idle_slots(const Schedule& s) {
  int idle = check_schedule(s).slots * s.ranks;
  for (const auto& line : s.actions) idle -= static_cast<int>(line.size());
  return idle;
}

// The one line an std::invalid_argument from `build` says ("" when it does not throw).
std::string refusal(const std::function<void()>& build) {
  try {
    build();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
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
  EXPECT_GT(checked, 5000);
}

// The figures the papers give: GPipe holds every micro-batch, 1F1B rank r at most P - r (so rank
// 0 at most P), ZB-H1 every rank P (1F1B's first rank's), interleaved 1F1B rank 0 (V - 1)·P +
// 2·P - 1 stages (of 1/V of a rank's layers each), ZB-V every rank at most 2P stages of half a
// 1F1B stage (1F1B's first rank's memory) and exactly what its warm-up runs; all of them at most
// M micro-batches of each stage.
TEST(Schedule, ActivationsInFlightFollowThePublishedFormulas) {
  for (int p = 1; p <= 16; ++p)
    for (int m = 1; m <= 64; ++m) {
      const ScheduleCheck g = check_schedule(gpipe(p, m)), f = check_schedule(one_f_one_b(p, m)),
                          z = check_schedule(zb_h1(p, m)), v = check_schedule(zbv(p, m));
      const std::string pm = "P=" + std::to_string(p) + " M=" + std::to_string(m);
      EXPECT_LE(f.peak_in_flight[0], p) << pm;
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(g.peak_in_flight[r], m) << pm;
        EXPECT_EQ(f.peak_in_flight[r], std::min(p - r, m)) << pm << " rank " << r;
        EXPECT_EQ(z.peak_in_flight[r], std::min(p, m)) << pm << " rank " << r;
        EXPECT_EQ(v.peak_in_flight[r], std::min(m, 2 * p - 1 - r) + std::min(m, r + 1)) << pm << " rank " << r;
        EXPECT_LE(v.peak_in_flight[r], std::min(2 * p, 2 * m)) << pm << " rank " << r;
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
// backwards), ZB-H1 with its weight gradients 3·M + 2·(P - 1) at most and more than 3·M, ZB-V
// 6·M + P - 1 (M >= 2P - 1), interleaved 1F1B 2·(M·V + P - 1).
TEST(Schedule, StepLengthsShowEachSchedulesBubble) {
  for (int p = 1; p <= 16; ++p)
    for (int m : {1, 2, 5, 16, 33, 64}) {
      EXPECT_EQ(check_schedule(gpipe(p, m)).slots, 2 * (m + p - 1)) << "P=" << p << " M=" << m;
      EXPECT_EQ(check_schedule(one_f_one_b(p, m)).slots, 2 * (m + p - 1)) << "P=" << p << " M=" << m;
      const int zb = check_schedule(zb_h1(p, m)).slots;
      EXPECT_LE(zb, 3 * m + 2 * (p - 1)) << "P=" << p << " M=" << m;
      EXPECT_GE(zb, 3 * m) << "P=" << p << " M=" << m;
      // ZB-V idles only while the work has not reached a rank yet or has left it: P - 1 slots.
      if (m >= 2 * p - 1) EXPECT_EQ(check_schedule(zbv(p, m)).slots, 6 * m + p - 1) << "P=" << p << " M=" << m;
    }
  // Interleaved 1F1B's bubble is 1F1B's in slots of a V-th of a stage.
  for (int p = 1; p <= 16; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m = p; m <= 64; m += p)
        EXPECT_EQ(check_schedule(interleaved_one_f_one_b(p, v, m)).slots, 2 * (m * v + p - 1)) << "P=" << p << " V=" << v << " M=" << m;
}

// The point of zero bubble: on 4 ranks with 8 micro-batches ZB-V leaves fewer slots idle than
// 1F1B, both counted and as a share of the step (its slots are shorter: half a stage, a backward
// split in two).
TEST(Schedule, ZbvLeavesFewerIdleSlotsThanOneFOneB) {
  const Schedule v = zbv(4, 8), f = one_f_one_b(4, 8);
  const int v_idle = idle_slots(v), f_idle = idle_slots(f);
  EXPECT_LT(v_idle, f_idle) << schedule_grid(v) << schedule_grid(f);
  EXPECT_LT(static_cast<double>(v_idle) / (check_schedule(v).slots * 4), static_cast<double>(f_idle) / (check_schedule(f).slots * 4));
  EXPECT_EQ(f_idle, 4 * 2 * 3);  // 2·(P - 1) idle slots a rank
}

// The V: rank r holds stages r and 2P - 1 - r, so the first and the last stage share rank 0 and
// the turn (stages P - 1 and P) stays on the last rank; rank 0 starts its warm-up with 2P - 1
// forwards of stage 0, and each rank ends on weight gradients.
TEST(Schedule, ZbvHoldsTwoStagesARankInAV) {
  const Schedule s = zbv(4, 8);
  ASSERT_EQ(s.stages, 8);
  EXPECT_EQ(s.rank_of_stage, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(s.backward, Backward::split);
  for (int k = 0; k < 7; ++k) EXPECT_EQ(s.actions[0][k], (Action{k, 0, Phase::forward}));
  EXPECT_EQ(s.actions[0][7], (Action{0, 7, Phase::forward}));
  EXPECT_EQ(s.actions[0][8], (Action{0, 7, Phase::backward_input}));
  for (const auto& line : s.actions) EXPECT_EQ(line.back().phase, Phase::backward_weight);
  // One micro-batch on one rank: down through stage 0 and back through stage 1.
  EXPECT_EQ(zbv(1, 1).actions[0], (std::vector<Action>{{0, 0, Phase::forward},
                                                       {0, 1, Phase::forward},
                                                       {0, 1, Phase::backward_input},
                                                       {0, 1, Phase::backward_weight},
                                                       {0, 0, Phase::backward_input},
                                                       {0, 0, Phase::backward_weight}}));
}

// Each name builds its schedule; an unknown name, virtual stages for a schedule without them, and
// an interleaved step whose micro-batches do not fill its groups are refused in one line naming
// the flag.
TEST(Schedule, ScheduleByNameBuildsEachScheduleAndRefusesInOneLineNamingTheFlag) {
  EXPECT_EQ(schedule_by_name("gpipe", 4, 1, 8), gpipe(4, 8));
  EXPECT_EQ(schedule_by_name("1f1b", 4, 1, 8), one_f_one_b(4, 8));
  EXPECT_EQ(schedule_by_name("zb-h1", 4, 1, 8), zb_h1(4, 8));
  EXPECT_EQ(schedule_by_name("zbv", 4, 1, 3), zbv(4, 3));
  EXPECT_EQ(schedule_by_name("zbv", 4, 2, 3), zbv(4, 3));
  EXPECT_EQ(schedule_by_name("interleaved-1f1b", 4, 2, 8), interleaved_one_f_one_b(4, 2, 8));
  const std::vector<std::pair<std::string, std::function<void()>>> refused = {
      {"--pp-schedule", [] { schedule_by_name("pipedream", 4, 1, 8); }},
      {"--pp-schedule", [] { schedule_by_name("", 4, 1, 8); }},
      {"--pp-virtual", [] { schedule_by_name("gpipe", 4, 2, 8); }},
      {"--pp-virtual", [] { schedule_by_name("1f1b", 4, 2, 8); }},
      {"--pp-virtual", [] { schedule_by_name("zb-h1", 4, 3, 8); }},
      {"--pp-virtual", [] { schedule_by_name("zbv", 4, 3, 8); }},
      {"--pp-virtual", [] { schedule_by_name("interleaved-1f1b", 4, 0, 8); }},
      {"--grad-accum", [] { schedule_by_name("interleaved-1f1b", 4, 2, 6); }},
      {"--grad-accum", [] { interleaved_one_f_one_b(4, 2, 2); }},
  };
  for (const auto& [flag, build] : refused) {
    const std::string why = refusal(build);
    EXPECT_NE(why.find(flag), std::string::npos) << "'" << why << "' should name " << flag;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  EXPECT_NE(refusal([] { schedule_by_name("pipedream", 4, 1, 8); }).find("'pipedream'"), std::string::npos);
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
  // ZB-V on 2 ranks, 1 micro-batch: down and back up the V, then the drain's weight gradients.
  const std::string v = schedule_grid(zbv(2, 1));
  EXPECT_NE(v.find("rank 0 | F0.0 .    .    F0.3 B0.3 W0.3 .    .    B0.0 W0.0"), std::string::npos) << v;
  EXPECT_NE(v.find("rank 1 | .    F0.1 F0.2 .    .    B0.2 W0.2 B0.1 W0.1 .   "), std::string::npos) << v;
}

}  // namespace
}  // namespace shardlm::plan
