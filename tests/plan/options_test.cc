#include "plan/options.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace shardlm::plan {
namespace {

// Settings away from every default, so that a copy that drops one shows.
PlanOptions chosen() {
  PlanOptions v;
  v.strategy = "hybrid", v.shard_group = 2, v.ep = 2, v.cp = 2, v.cp_impl = "all-to-all";
  v.batch = 3, v.seq = 128, v.grad_accum = 5;
  v.prefetch_forward = 2, v.prefetch_backward = 3, v.max_gathers_in_flight = 4;
  v.bucket_mb = 50, v.gather_bucket_mb = 100, v.keep_gathered = "h.1,h.2";
  v.memory_budget = "1000000", v.offload_prefetch = 3;
  v.param_dtype = "bf16", v.reduce_dtype = "bf16";
  v.recompute = "full", v.recompute_blocks = 3;
  v.act_quant = "int8", v.act_quant_group = 32, v.act_quant_rounding = "stochastic";
  v.reduce_each_micro_step = true;
  return v;
}

// The words of a reproduce line as flag -> value ("on" for a switch).
std::map<std::string, std::string> words_of(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i].rfind("--", 0) != 0) continue;
    const bool has_value = i + 1 < words.size() && words[i + 1].rfind("--", 0) != 0;
    out[words[i].substr(2)] = has_value ? words[i + 1] : "on";
  }
  return out;
}

TEST(PlanOptions, EachFlagIsDeclaredOnceWithHelpAndGroup) {
  std::set<std::string> flags;
  for (const PlanOption& o : plan_options()) {
    EXPECT_TRUE(flags.insert(o.flag).second) << "--" << o.flag << " is declared twice";
    EXPECT_FALSE(o.help.empty()) << o.flag;
    EXPECT_FALSE(std::string(o.group).empty()) << o.flag;
    EXPECT_EQ(o.reproduce_at > 0, o.reproduce != nullptr) << o.flag;
  }
}

// What the planner chooses comes back out of its PlanConfig as the settings that made it.
TEST(PlanOptions, ChosenSettingsSurviveThePlanConfig) {
  const PlanOptions v = chosen();
  PlanConfig c;
  c.world = 8;
  apply_plan_options(v, c);
  PlanOptions back;
  take_plan_options(c, back);
  for (const PlanOption& o : plan_options())
    if (o.from_plan) EXPECT_EQ(option_text(o, back), option_text(o, v)) << "--" << o.flag;
}

// The line `plan` prints gives each option it prints the value that was chosen, and each option
// with a reproduce entry is printed by a strategy it applies to.
TEST(PlanOptions, ReproduceLineRestoresEachPrintedOption) {
  std::set<std::string> seen;
  for (const char* strategy : {"hybrid", "zero1"}) {
    PlanOptions v = chosen();
    v.strategy = strategy;
    PlanConfig c;
    c.world = 8;
    apply_plan_options(v, c);
    const std::string line = reproduce_flags(c);
    const auto words = words_of(line);
    EXPECT_EQ(line.rfind(std::string("--strategy ") + strategy + " ", 0), 0u) << line;
    size_t known = 0;
    for (const PlanOption& o : plan_options()) {
      const auto at = words.find(o.flag);
      if (!o.reproduce || at == words.end()) continue;
      EXPECT_EQ(at->second, option_text(o, v)) << "--" << o.flag << " in " << line;
      seen.insert(o.flag);
      ++known;
    }
    EXPECT_EQ(known, words.size()) << "a flag no option declares: " << line;
  }
  for (const PlanOption& o : plan_options())
    if (o.reproduce) EXPECT_TRUE(seen.count(o.flag)) << "--" << o.flag << " never printed";
}

TEST(PlanOptions, ChecksNameTheFlag) {
  PlanOptions v;
  v.gather_bucket_mb = -1;
  try {
    check_plan_options(v);
    FAIL() << "a negative --gather-bucket-mb passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--gather-bucket-mb: must be >= 0, got -1");
  }
  v = PlanOptions{};
  v.param_dtype = "fp16";
  EXPECT_THROW(check_plan_options(v), std::invalid_argument);
  v = PlanOptions{};
  v.offload = "params,disk";
  PlanConfig c;
  try {
    apply_plan_options(v, c);
    FAIL() << "an unknown --offload kind passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("--offload: unknown kind 'disk'", 0), 0u) << e.what();
  }
  EXPECT_NO_THROW(check_plan_options(PlanOptions{}));
}

}  // namespace
}  // namespace shardlm::plan
