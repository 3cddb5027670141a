// --memory-budget with real runs: `train` under a budget between the full-offload peak and the
// resident one keeps the allocator's measured peak within it and gives exactly the resident run's
// losses; bad sizes are refused with one line naming the flag; `explain` and `simulate` show the
// placement.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "test_util.h"

namespace shardlm {
namespace {

using testing::Result;
using testing::shardlm;
using testing::step_losses;

// The runs' model: tiny over the test corpus's 256-token vocabulary.
const std::string kExplain = "explain --model tiny --vocab 256 --batch 2 --seq 32 --threads 1";

// "total at peak: N" of `explain` with these flags.
int64_t explained_peak(const std::string& flags) { return testing::explained_memory(kExplain + flags).total; }

TEST(BudgetSlow, ATrainRunUnderABudgetStaysWithinItAndKeepsTheLossesExact) {
  testing::TinyRuns runs;
  runs.flags = "--lr 3e-3 --eps 1e-6";
  ASSERT_EQ(runs.create("budget").code, 0);
  const int64_t resident = explained_peak(""), full = explained_peak(" --offload params,grads,optimizer");
  ASSERT_LT(full, resident);
  const int64_t budget = full + (resident - full) / 2;
  const Result shown = shardlm(kExplain + " --memory-budget " + std::to_string(budget));
  ASSERT_EQ(shown.code, 0) << shown.out;
  EXPECT_NE(shown.out.find("state per unit"), std::string::npos) << shown.out;
  EXPECT_NE(shown.out.find("disk"), std::string::npos) << shown.out;
  EXPECT_NE(shown.out.find("ram"), std::string::npos) << shown.out;

  const Result a = shardlm(runs.args("resident", 4, 2));
  ASSERT_EQ(a.code, 0) << a.out;
  const Result b = shardlm(runs.args("budget", 4, 2) + " --memory-budget " + std::to_string(budget));
  ASSERT_EQ(b.code, 0) << b.out;
  const auto want = step_losses(runs.out("resident") / "metrics.jsonl");
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(step_losses(runs.out("budget") / "metrics.jsonl"), want);  // exact
  int rows = 0;
  for (const auto& row : testing::read_metrics(runs.out("budget") / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    ++rows;
    const int64_t measured = row["mem"]["total"].get<int64_t>();
    EXPECT_LE(measured, budget) << "step " << row["step"];
    EXPECT_LT(measured, resident) << "step " << row["step"];
    // The windows are really used: the offloaded state's bytes are gone from between steps.
    EXPECT_LT(row["mem_between_steps"]["total"].get<int64_t>(), resident) << "step " << row["step"];
    std::printf("tiny B2 T32: resident peak %lld, full offload %lld, budget %lld, measured peak %lld\n",
                static_cast<long long>(resident), static_cast<long long>(full), static_cast<long long>(budget),
                static_cast<long long>(measured));
  }
  EXPECT_EQ(rows, 4);
  runs.remove();
}

// A budget whole units do not meet exactly (30% of the way from the full offload's peak to the
// resident one) keeps the head of an offloaded part in memory with what they leave: `explain`
// shows the share, and the runs (one process, and fsdp at 2 ranks) stay within the budget with the
// resident runs' losses exactly.
TEST(BudgetSlow, WhatWholeUnitsLeaveOfABudgetKeepsAHeadOfAPartAndTheLossesExact) {
  testing::TinyRuns runs;
  runs.flags = "--lr 3e-3 --eps 1e-6";
  ASSERT_EQ(runs.create("budget_heads").code, 0);
  for (int ranks : {1, 2}) {
    const std::string world = ranks > 1 ? " --ranks 2 --strategy fsdp" : "";
    const int64_t resident = explained_peak(world), full = explained_peak(world + " --offload params,grads,optimizer");
    const int64_t budget = full + (resident - full) * 3 / 10;
    const Result shown = shardlm(kExplain + world + " --memory-budget " + std::to_string(budget));
    ASSERT_EQ(shown.code, 0) << shown.out;
    EXPECT_TRUE(std::regex_search(shown.out, std::regex("disk \\([0-9]+% ram\\)"))) << shown.out;
    auto run = [&](const std::string& name, const std::string& flags) {
      const std::string a = runs.args(name, 4, 2) + (ranks > 1 ? " --strategy fsdp" : "") + flags;
      return ranks > 1 ? testing::mpirun(ranks, a) : shardlm(a);
    };
    const std::string res = "resident_" + std::to_string(ranks), heads = "heads_" + std::to_string(ranks);
    const Result a = run(res, "");
    ASSERT_EQ(a.code, 0) << a.out;
    const Result b = run(heads, " --memory-budget " + std::to_string(budget));
    ASSERT_EQ(b.code, 0) << b.out;
    const auto want = step_losses(runs.out(res) / "metrics.jsonl");
    ASSERT_EQ(want.size(), 4u);
    EXPECT_EQ(step_losses(runs.out(heads) / "metrics.jsonl"), want) << ranks;  // exact
    for (const auto& row : testing::read_metrics(runs.out(heads) / "metrics.jsonl"))
      if (row.contains("loss")) { EXPECT_LE(row["mem"]["total"].get<int64_t>(), budget) << ranks << " step " << row["step"]; }
  }
  runs.remove();
}

// small B4 T256 (over the test corpus): its saved activations are most of the peak once the state
// is on disk, so a budget between the peak with everything on disk and the one with only the state
// there moves saved activations to the activations file; the run stays within the budget and its
// losses are exactly the resident run's.
TEST(BudgetSlow, ABudgetUnderTheStateOffloadPeakMovesSavedActivations) {
  testing::TinyRuns runs;
  runs.flags = "--lr 3e-3 --eps 1e-6 --seq 256";
  ASSERT_EQ(runs.create("budget_activations").code, 0);
  const std::string explain = "explain --model small --vocab 256 --batch 4 --seq 256 --threads 1";
  auto peak_of = [&](const std::string& flags) { return testing::explained_memory(explain + flags).total; };
  const int64_t state = peak_of(" --offload params,grads,optimizer"),
                everything = peak_of(" --offload params,grads,optimizer,activations");
  ASSERT_LT(everything, state);
  const int64_t budget = everything + (state - everything) / 2;
  const Result shown = shardlm(explain + " --memory-budget " + std::to_string(budget));
  ASSERT_EQ(shown.code, 0) << shown.out;
  EXPECT_TRUE(std::regex_search(shown.out, std::regex("h\\.0 +(ram|disk) / disk / disk / disk"))) << shown.out;
  std::smatch m;  // the activations' own peak the plan accounts, which the allocator must reach
  ASSERT_TRUE(std::regex_search(shown.out, m, std::regex("activations: static 0, at peak [0-9]+ \\([^)]*\\), own peak ([0-9]+)"))) << shown.out;
  const int64_t planned_activations = std::stoll(m[1]);

  const Result a = shardlm(runs.args("resident", 3, 4, "small"));
  ASSERT_EQ(a.code, 0) << a.out;
  const Result b = shardlm(runs.args("budget", 3, 4, "small") + " --memory-budget " + std::to_string(budget));
  ASSERT_EQ(b.code, 0) << b.out;
  const auto want = step_losses(runs.out("resident") / "metrics.jsonl");
  ASSERT_EQ(want.size(), 3u);
  EXPECT_EQ(step_losses(runs.out("budget") / "metrics.jsonl"), want);  // exact
  for (const auto& row : testing::read_metrics(runs.out("budget") / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    EXPECT_LE(row["mem"]["total"].get<int64_t>(), budget) << "step " << row["step"];
    EXPECT_EQ(row["mem_max"]["activations"].get<int64_t>(), planned_activations) << "step " << row["step"];
  }
  runs.remove();
}

TEST(Budget, BadSizesAreRefusedWithOneLineNamingTheFlag) {
  for (const char* bad : {"lots", "8XB", "0", "-1"}) {
    const Result r = shardlm(std::string("explain --model tiny --batch 2 --seq 32 --memory-budget ") + bad);
    EXPECT_NE(r.code, 0) << bad;
    EXPECT_NE(r.out.find("--memory-budget"), std::string::npos) << r.out;
  }
  const Result r = shardlm("explain --model tiny --batch 2 --seq 32 --memory-budget 1000");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("smallest peak reachable"), std::string::npos) << r.out;
  const Result s = shardlm("simulate --model tiny --batch 2 --seq 32 --memory-budget 1000");
  EXPECT_NE(s.code, 0);
  EXPECT_NE(s.out.find("--memory-budget"), std::string::npos) << s.out;
}

TEST(Budget, SimulatePredictsThePlacementAndPeak) {
  const int64_t resident = explained_peak(""), full = explained_peak(" --offload params,grads,optimizer");
  const int64_t budget = full + (resident - full) / 2;
  const Result r = shardlm("simulate --model tiny --vocab 256 --batch 2 --seq 32 --threads 1 --hardware cpu-local --memory-budget " +
                           std::to_string(budget));
  ASSERT_EQ(r.code, 0) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("accounted peak ([0-9]+)"))) << r.out;
  EXPECT_LE(std::stoll(m[1]), budget) << r.out;
  EXPECT_LT(std::stoll(m[1]), resident) << r.out;
  EXPECT_NE(r.out.find("state placement (--memory-budget " + std::to_string(budget)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("optimizer"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace shardlm
