// `shardlm simulate`: its output, its bad input (one line each), and its trace against a real
// run's (the same tasks on the same streams in the same order).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "run/test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using shardlm::testing::expect_one_line_error;
using shardlm::testing::Result;

Result shardlm(const std::string& args) { return shardlm::testing::shardlm(args); }

class Simulate : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("shardlm_simulate_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    shardlm::testing::make_corpus(dir_);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  // One step of `small` trained with a plan's flags on `ranks` ranks into DIR/name: the allocator's
  // peak (the step's metrics row; the last is the evaluation's) is within `budget`.
  static void expect_trains_within(int ranks, const std::string& flags, const std::string& name, int64_t budget) {
    const std::string train = "train --model small --threads 1 " + flags + " --data " + (dir_ / "tok").string() + " --out " +
                              (dir_ / name).string() + " --steps 1 --eval-windows 1 --sample-tokens 0 --peak-gflops 100 --quiet";
    const Result run = ranks > 1 ? shardlm::testing::mpirun(ranks, train) : shardlm(train);
    ASSERT_EQ(run.code, 0) << run.out;
    const auto rows = shardlm::testing::read_metrics(dir_ / name / "metrics.jsonl");
    ASSERT_FALSE(rows.empty());
    ASSERT_TRUE(rows.front().contains("mem")) << rows.front().dump();
    EXPECT_LE(rows.front()["mem"]["total"].get<int64_t>(), budget) << flags;
  }
  static fs::path dir_;
};
fs::path Simulate::dir_;

const std::string kSmall = "simulate --model tiny --batch 2 --seq 32 --threads 1 ";

// The flags of plan's first-ranked configuration: its row is labelled [1], the flags listed below
// the table under that label.
std::string first_ranked_flags(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("\n +1 [^\n]* \\[1\\]\n")) ||
      !std::regex_search(out, m, std::regex("\n  \\[1\\] (--strategy [^\n]*)")))
    return "";
  return m[1];
}

TEST_F(Simulate, BadInputIsOneLine) {
  expect_one_line_error(shardlm(kSmall + "--ranks 0"), {"--ranks", "0"});
  expect_one_line_error(shardlm(kSmall + "--hardware no-such-gpu"), {"unknown preset 'no-such-gpu'", "h100-80gb-datasheet"});
  const fs::path missing = dir_ / "absent.json";
  expect_one_line_error(shardlm(kSmall + "--hardware " + missing.string()), {missing.string(), "cannot read"});
  std::ofstream(dir_ / "cut.json") << "{\"name\": \"x\", ";
  expect_one_line_error(shardlm(kSmall + "--hardware " + (dir_ / "cut.json").string()), {"cut.json", "not valid JSON"});
  // A profile missing one figure names it.
  json j = json::parse(std::ifstream(std::string(std::getenv("SHARDLM_SOURCE_DIR")) + "/configs/hardware/h100-80gb-datasheet.json"));
  j.erase("memory_bw");
  std::ofstream(dir_ / "partial.json") << j.dump();
  expect_one_line_error(shardlm(kSmall + "--hardware " + (dir_ / "partial.json").string()), {"partial.json", "memory_bw", "missing"});
  // Free communication (bus_bw 1e30 above the memory's 3e12) is refused by simulate and plan; a
  // number beyond a double's range gave the JSON parser's raw message.
  j = json::parse(std::ifstream(std::string(std::getenv("SHARDLM_SOURCE_DIR")) + "/configs/hardware/h100-80gb-datasheet.json"));
  j["intra_node"]["all_reduce"]["bus_bw"]["value"] = 1e30;
  std::ofstream(dir_ / "free.json") << j.dump();
  for (const std::string& cmd : {kSmall, std::string("plan --model tiny --ranks 2 --global-batch 128 --seq 32 ")})
    expect_one_line_error(shardlm(cmd + "--hardware " + (dir_ / "free.json").string()),
                          {"free.json", "intra_node.all_reduce.bus_bw", "1e+30", "memory_bw"});
  std::string text = j.dump();
  text.replace(text.find("1e+30"), 5, "1e400");
  std::ofstream(dir_ / "huge.json") << text;
  expect_one_line_error(shardlm(kSmall + "--hardware " + (dir_ / "huge.json").string()),
                        {"huge.json", "intra_node.all_reduce.bus_bw.value", "1e400"});
}

std::string first_line(const std::string& out) { return out.substr(0, out.find('\n')); }

// simulate and plan say first where the profile's figures come from: its file, its source, the
// date; a datasheet profile adds that its predictions run optimistic (and by how much). --json
// carries the same as fields. Every preset in configs/hardware.
TEST_F(Simulate, FirstLineNamesTheProfilesFileSourceAndDate) {
  const fs::path presets = fs::path(std::getenv("SHARDLM_SOURCE_DIR")) / "configs" / "hardware";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(presets)) {
    if (entry.path().extension() != ".json") continue;
    const std::string name = entry.path().stem().string();
    SCOPED_TRACE(name);
    const json provenance = json::parse(std::ifstream(entry.path()))["provenance"];
    const std::string source = provenance["source"], date = provenance["date"];
    const Result r = shardlm(kSmall + "--hardware " + name);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string line = first_line(r.out);
    EXPECT_EQ(line.rfind("hardware: ", 0), 0u) << line;
    EXPECT_NE(line.find("configs/hardware/" + name + ".json"), std::string::npos) << line;
    EXPECT_NE(line.find(date), std::string::npos) << line;
    const char* says = source == "measured" ? "measured on the hardware it describes"
                       : source == "derived" ? "derived from a measured profile"
                                             : "datasheet figures, nothing measured";
    EXPECT_NE(line.find(says), std::string::npos) << line;
    const std::string second = r.out.substr(line.size() + 1, r.out.find('\n', line.size() + 1) - line.size() - 1);
    EXPECT_EQ(second.rfind("caution: a datasheet profile's predictions run optimistic", 0) == 0, source == "datasheet")
        << second;
    const Result j = shardlm(kSmall + "--json --hardware " + name);
    ASSERT_EQ(j.code, 0) << j.out;
    const json o = json::parse(j.out);
    EXPECT_EQ(o["hardware_source"], source);
    EXPECT_EQ(o["hardware_date"], date);
    EXPECT_NE(o["hardware_file"].get<std::string>().find(name + ".json"), std::string::npos);
    ++checked;
  }
  EXPECT_GE(checked, 6);
  // The datasheet caution states the published-run table's finding.
  const Result p = shardlm("plan --model tiny --ranks 2 --threads 1 --global-batch 128 --seq 32 --top 1 "
                           "--hardware h100-80gb-datasheet");
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_NE(first_line(p.out).find("h100-80gb-datasheet.json (h100-80gb-datasheet): datasheet figures"), std::string::npos)
      << p.out;
  EXPECT_NE(p.out.find("\ncaution: a datasheet profile's predictions run optimistic: on the published-run table"),
            std::string::npos) << p.out;
  EXPECT_NE(p.out.find("H100 rows +58%"), std::string::npos) << p.out;
  // A profile without its provenance is refused in one line naming the file and the field.
  json bare = json::parse(std::ifstream(presets / "h100-80gb.json"));
  bare["provenance"].erase("date");
  std::ofstream(dir_ / "undated.json") << bare.dump();
  expect_one_line_error(shardlm(kSmall + "--hardware " + (dir_ / "undated.json").string()),
                        {"undated.json", "provenance.date", "missing"});
}

// The planner on the preset a user types, for a run with published figures: Llama 3 8B on 64 H100s
// at 4M tokens a step, T=8192 (torchtitan: 33-39% bf16 MFU). The first-ranked configuration lies in
// the published band (33-45%); the datasheet preset's above it.
TEST_F(Simulate, PlanOnTheH100PresetRanksLlama3_8bInThePublishedMfuBand) {
  const std::string plan = "plan --model llama3-8b --ranks 64 --global-batch 4194304 --seq 8192 --top 1 --hardware ";
  const std::regex first_mfu("\n +1 +[0-9.]+ +[0-9]+ +([0-9.]+)% ");
  std::smatch m;
  const Result measured = shardlm(plan + "h100-80gb");
  ASSERT_EQ(measured.code, 0) << measured.out;
  ASSERT_TRUE(std::regex_search(measured.out, m, first_mfu)) << measured.out;
  EXPECT_GE(std::stod(m[1]), 33) << measured.out;
  EXPECT_LE(std::stod(m[1]), 45) << measured.out;
  const Result datasheet = shardlm(plan + "h100-80gb-datasheet");
  ASSERT_EQ(datasheet.code, 0) << datasheet.out;
  ASSERT_TRUE(std::regex_search(datasheet.out, m, first_mfu)) << datasheet.out;
  EXPECT_GT(std::stod(m[1]), 45) << datasheet.out;
}

// plan's table: strategy, micro-batch, accumulation, recompute and memory in columns; each
// configuration's full flags once, below, under the label its row carries.
TEST_F(Simulate, PlanTableKeepsFlagsBelowTheRows) {
  const Result r = shardlm("plan --model llama3-8b --ranks 64 --global-batch 4194304 --seq 8192 --top 5 --hardware h100-80gb");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("  strategy   batch  accum  recompute  flags\n"), std::string::npos) << r.out;
  const std::regex row("\n +([0-9]+) +[0-9.]+ +[0-9]+ +[0-9.]+% +[0-9.]+ +[0-9]+  (fsdp|hybrid [0-9]+) +([0-9]+) +([0-9]+)  "
                       "([a-z-]+[^\n]*?) +\\[([0-9]+)\\](?=\n)");
  int rows = 0;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), row); it != std::sregex_iterator(); ++it, ++rows) {
    const std::smatch& x = *it;
    // The row's columns agree with its flags, listed once below.
    const std::string label = "\n  [" + std::string(x[6]) + "] ";
    const size_t at = r.out.find(label);
    ASSERT_NE(at, std::string::npos) << label << r.out;
    EXPECT_EQ(r.out.find(label, at + 1), std::string::npos) << label;
    const std::string flags = r.out.substr(at + label.size(), r.out.find('\n', at + 1) - at - label.size());
    EXPECT_NE(flags.find("--strategy " + std::string(x[2]).substr(0, std::string(x[2]).find(' '))), std::string::npos) << flags;
    EXPECT_NE(flags.find("--batch " + std::string(x[3]) + " --grad-accum " + std::string(x[4])), std::string::npos) << flags;
    EXPECT_NE(flags.find("--recompute " + std::string(x[5]).substr(0, std::string(x[5]).find(' '))), std::string::npos) << flags;
    // No row carries a flag list: the rows stay narrow whatever units are kept gathered.
    EXPECT_EQ(std::string(x[0]).find("--"), std::string::npos) << x[0];
  }
  EXPECT_EQ(rows, 5) << r.out;
  EXPECT_NE(r.out.find("--keep-gathered layers.0,embedding"), std::string::npos) << r.out;
}

// A billion micro-steps: the plan lists four (its middle one repeats), so explain and simulate
// answer at once, with the memory of four and the time of a billion.
TEST_F(Simulate, GradAccumOfABillionIsAPlanOfFourMicroSteps) {
  const std::string plan = "--model small --batch 2 --seq 64 --strategy fsdp --ranks 2 --threads 1 --grad-accum ";
  const Result explain = shardlm("explain " + plan + "1000000000");
  ASSERT_EQ(explain.code, 0) << explain.out;
  EXPECT_NE(explain.out.find("the tasks of [m2] run 999999997 times"), std::string::npos) << explain.out;
  const Result billion = shardlm("simulate --hardware h100-80gb-datasheet --json " + plan + "1000000000");
  ASSERT_EQ(billion.code, 0) << billion.out;
  const Result four = shardlm("simulate --hardware h100-80gb-datasheet --json " + plan + "4");
  ASSERT_EQ(four.code, 0) << four.out;
  const json b = json::parse(billion.out), f = json::parse(four.out);
  EXPECT_EQ(b["mem"]["total"], f["mem"]["total"]);
  EXPECT_GT(b["step_ms"].get<double>(), 1e8 * f["step_ms"].get<double>());
}

// Hybrid shard without --shard-group shards inside a node, as train does inside a machine: on
// 8-GPU nodes, 8 ranks (the same step as --shard-group 8); ranks that do not fill whole nodes are
// refused in one line.
TEST_F(Simulate, HybridWithoutAShardGroupShardsInsideANode) {
  const std::string hybrid = "simulate --model tiny --batch 2 --seq 32 --hardware h100-80gb-datasheet --strategy hybrid --ranks ";
  const Result node = shardlm(hybrid + "16");
  ASSERT_EQ(node.code, 0) << node.out;
  EXPECT_NE(node.out.find("strategy hybrid (shard group 8), 16 rank(s)"), std::string::npos) << node.out;
  const Result given = shardlm(hybrid + "16 --shard-group 8 --json"), defaulted = shardlm(hybrid + "16 --json");
  ASSERT_EQ(given.code, 0) << given.out;
  EXPECT_EQ(json::parse(defaulted.out)["mem"], json::parse(given.out)["mem"]);
  EXPECT_EQ(json::parse(defaulted.out)["step_ms"], json::parse(given.out)["step_ms"]);
  expect_one_line_error(shardlm(hybrid + "12"), {"12 ranks do not fill nodes of 8", "devices_per_node", "--shard-group"});
  const Result inside = shardlm(hybrid + "4");  // one node: every rank
  EXPECT_NE(inside.out.find("strategy hybrid (shard group 4)"), std::string::npos) << inside.out;
}

// --offload: the copy stream's busy and exposed time, priced at the profile's disk figures
// (cpu-local has them), in the text and in --json; a profile without them says copies cost nothing.
TEST_F(Simulate, OffloadPrintsTheDiskStreamsBusyAndExposedTime) {
  const std::string plan = "--model small --batch 2 --seq 64 --threads 1 --offload params,grads,optimizer ";
  const Result r = shardlm("simulate --hardware cpu-local " + plan);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("disk (--offload params,grads,optimizer): "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" ms of reloads and write-backs ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; disk read "), std::string::npos) << r.out;
  const Result j = shardlm("simulate --hardware cpu-local --json " + plan);
  ASSERT_EQ(j.code, 0) << j.out;
  const json o = json::parse(j.out);
  EXPECT_GT(o.at("disk_busy_ms").get<double>(), 0);
  EXPECT_GE(o.at("disk_exposed_ms").get<double>(), 0);
  EXPECT_LE(o.at("disk_exposed_ms").get<double>(), o.at("comm_exposed_ms").get<double>() + 1e-9);
  const Result gpu = shardlm("simulate --hardware h100-80gb-datasheet " + plan);
  ASSERT_EQ(gpu.code, 0) << gpu.out;
  EXPECT_NE(gpu.out.find("the profile has no disk figures: copies priced at nothing"), std::string::npos) << gpu.out;
  const Result resident = shardlm("simulate --hardware cpu-local --json --model small --batch 2 --seq 64 --threads 1");
  ASSERT_EQ(resident.code, 0) << resident.out;
  EXPECT_FALSE(json::parse(resident.out).contains("disk_busy_ms"));
}

// --offload-prefetch auto: simulate tries each read-ahead depth under the budget and keeps the
// fastest, which is the fastest of the depths given one by one (the same figure to the
// microsecond); train takes it from --hardware, and without one, or in explain, says in one line
// what is missing; train refuses a --hardware it would not use. (gpt2-124m at 40% of its resident
// peak: a depth of 4 does not fit there.)
TEST_F(Simulate, OffloadPrefetchAutoKeepsTheFastestDepthUnderTheBudget) {
  const std::string plan = "simulate --hardware cpu-local --model gpt2-124m --vocab 50257 --batch 4 --seq 256 --threads 2 "
                           "--memory-budget 1064197324 --json";
  double best = -1;
  int best_depth = -1;
  for (int d = 0; d <= 4; ++d) {
    const Result r = shardlm(plan + " --offload-prefetch " + std::to_string(d));
    if (r.code != 0) {  // a deeper read-ahead's windows do not fit the budget
      EXPECT_NE(r.out.find("--memory-budget"), std::string::npos) << r.out;
      continue;
    }
    const double ms = json::parse(r.out).at("step_ms").get<double>();
    if (best < 0 || ms < best) best = ms, best_depth = d;
  }
  ASSERT_GE(best_depth, 0);
  const Result a = shardlm(plan + " --offload-prefetch auto");
  ASSERT_EQ(a.code, 0) << a.out;
  const json j = json::parse(a.out);
  EXPECT_EQ(j.at("offload_prefetch").get<int>(), best_depth);
  EXPECT_NEAR(j.at("step_ms").get<double>(), best, 1e-3);
  const Result text = shardlm(plan.substr(0, plan.size() - 7) + " --offload-prefetch auto");
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("offload read-ahead: " + std::to_string(best_depth) + " (auto: predicted on cpu-local; 0: "),
            std::string::npos) << text.out;

  const std::string data = (dir_ / "tok").string();
  const std::string train = "train --model tiny --data " + data + " --batch 2 --seq 32 --steps 1 --eval-every 0 "
                            "--sample-tokens 0 --quiet --overwrite --offload params --offload-prefetch auto --out " +
                            (dir_ / "auto").string();
  expect_one_line_error(shardlm(train), {"--offload-prefetch auto: needs --hardware PROFILE"});
  const Result trained = shardlm(train + " --hardware cpu-local");
  EXPECT_EQ(trained.code, 0) << trained.out;
  expect_one_line_error(shardlm(train + " --hardware no-such-preset"), {"no-such-preset"});
  const std::string fixed_depth = train.substr(0, train.find(" --offload-prefetch auto")) + " --offload-prefetch 1" +
                                  train.substr(train.find(" --offload-prefetch auto") + 24);
  expect_one_line_error(shardlm(fixed_depth + " --hardware cpu-local"), {"--hardware", "only to choose"});
  expect_one_line_error(shardlm("explain --model tiny --offload params --offload-prefetch auto"),
                        {"--offload-prefetch auto: the depth is chosen by simulating"});
}

// --json holds the figures metrics.jsonl has, and its memory is the plan's: what `explain` prints
// on the CPU profile (what `train` runs here); a bf16 (GPU) profile prices activations in bf16.
TEST_F(Simulate, JsonIsThePlansMemoryAndATime) {
  const std::string plan = "--model small --batch 2 --seq 64 --strategy fsdp --ranks 4 --threads 1";
  const Result r = shardlm("simulate --hardware h100-80gb-datasheet --json " + plan);
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  for (const char* k : {"step_ms", "tokens_per_s", "mfu", "comm_exposed_ms"}) EXPECT_TRUE(j.at(k).is_number()) << k;
  EXPECT_GT(j["step_ms"].get<double>(), 0);
  EXPECT_GT(j["mfu"].get<double>(), 0);
  EXPECT_LT(j["mfu"].get<double>(), 1);
  EXPECT_NEAR(j["tokens_per_s"].get<double>(), 4 * 2 * 64 / (j["step_ms"].get<double>() * 1e-3), 1e-6 * j["tokens_per_s"].get<double>());
  const Result cpu = shardlm("simulate --hardware cpu-local --json " + plan);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  const json jc = json::parse(cpu.out);
  const Result e = shardlm("explain " + plan);
  ASSERT_EQ(e.code, 0) << e.out;
  for (const char* cat : {"params", "grads", "optimizer", "activations", "comm", "workspace", "snapshot", "staging"}) {
    const std::regex line(std::string("  ") + cat + ": static [0-9]+, at peak ([0-9]+)");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(e.out, m, line)) << cat;
    EXPECT_EQ(jc["mem"][cat].get<int64_t>(), std::stoll(m[1])) << cat;
    if (std::string(cat) != "activations" && std::string(cat) != "workspace") {
      EXPECT_EQ(j["mem"][cat].get<int64_t>(), std::stoll(m[1])) << cat;
    }
  }
  // Half the bytes, give or take each slice's rounding to 64 bytes.
  const double bf16_share = j["mem"]["activations"].get<double>() / jc["mem"]["activations"].get<double>();
  EXPECT_NEAR(bf16_share, 0.5, 0.01);
  const Result human = shardlm("simulate --hardware h100-80gb-datasheet " + plan);
  ASSERT_EQ(human.code, 0) << human.out;
  for (const char* s : {"step ", "tokens/s", "MFU", "comm exposed", "params:", "total:"})
    EXPECT_NE(human.out.find(s), std::string::npos) << s << " in " << human.out;
}

// --device cuda: simulate and explain both count the CUDA kernels' own scratch (model::KernelScratch
// in the tasks' workspace), the same bytes, which a GPU run's allocator reaches (docs/cuda.md
// section 11); the CPU's plan has none.
TEST_F(Simulate, OnTheCudaDeviceTheKernelsScratchIsInTheWorkspace) {
  const std::string plan = "--model small --batch 2 --seq 64 --strategy ddp --threads 1";
  const auto workspace = [](const std::string& out) {
    std::smatch m;
    return std::regex_search(out, m, std::regex("  workspace: static [0-9]+, at peak ([0-9]+)")) ? std::stoll(m[1]) : -1LL;
  };
  const Result cpu = shardlm("explain " + plan), gpu = shardlm("explain --device cuda " + plan);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  ASSERT_EQ(gpu.code, 0) << gpu.out;
  EXPECT_GT(workspace(gpu.out), workspace(cpu.out));
  const Result sim = shardlm("simulate --hardware cpu-local --json --device cuda " + plan);
  ASSERT_EQ(sim.code, 0) << sim.out;
  EXPECT_EQ(json::parse(sim.out)["mem"]["workspace"].get<int64_t>(), workspace(gpu.out));
}

// --moe-imbalance RUN takes the run's measured figure: the median over its steps of the trainer's
// expert_load_imbalance (the busiest expert's rows over the mean, per routing), priced as that number.
TEST_F(Simulate, MoeImbalanceFromARunIsItsMeasuredLoad) {
  const fs::path run = dir_ / "moe_run";
  const Result trained = shardlm("train --model moe-tiny --batch 2 --seq 32 --steps 3 --threads 1 --eval-every 0 "
                                 "--save-every 0 --data " + (dir_ / "tok").string() + " --out " + run.string());
  ASSERT_EQ(trained.code, 0) << trained.out;
  std::vector<double> measured;
  std::ifstream metrics(run / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const json row = json::parse(line);
    if (!row.contains("loss")) continue;
    const double x = row.at("expert_load_imbalance").get<double>();
    // Each routing's busiest expert holds at least the mean rows (B·T·k/E = 2·32·2/4 = 32,
    // dropless) and at most the step's expert_load_max.
    EXPECT_GE(x, 1.0);
    EXPECT_LE(x, row.at("expert_load_max").get<double>() / 32 + 1e-12);
    measured.push_back(x);
  }
  ASSERT_EQ(measured.size(), 3u);
  std::sort(measured.begin(), measured.end());
  const std::string plan = "simulate --json --model moe-tiny --batch 2 --seq 32 --threads 1 --ranks 2 --ep 2 "
                           "--strategy fsdp --moe-imbalance ";
  const Result from_run = shardlm(plan + run.string());
  ASSERT_EQ(from_run.code, 0) << from_run.out;
  const json r = json::parse(from_run.out);
  EXPECT_DOUBLE_EQ(r["moe_imbalance"].get<double>(), measured[1]);
  std::ostringstream number;
  number.precision(17);
  number << measured[1];
  const Result as_number = shardlm(plan + number.str());
  ASSERT_EQ(as_number.code, 0) << as_number.out;
  EXPECT_NEAR(json::parse(as_number.out)["step_ms"].get<double>(), r["step_ms"].get<double>(), 1e-9 * r["step_ms"].get<double>());
  EXPECT_GT(r["exchange_busy_ms"].get<double>(), 0);
  expect_one_line_error(shardlm(plan + (dir_ / "no_run").string()), {"--moe-imbalance", "no_run", "cannot be read"});
  fs::create_directories(dir_ / "dense_run");
  std::ofstream(dir_ / "dense_run" / "metrics.jsonl") << "{\"step\": 0, \"loss\": 10.9}\n";
  expect_one_line_error(shardlm(plan + (dir_ / "dense_run").string()), {"dense_run", "no step records expert_load_imbalance"});
}

// Mixtral 8x7B at 64 and 256 ranks of h100-80gb-datasheet with its experts over ep 8: simulate answers with
// the step time, memory per rank and the all-to-all's share of the step (BENCHMARKS.md quotes them).
TEST_F(Simulate, MixtralPrintsItsAllToAllShare) {
  for (int ranks : {64, 256}) {
    const std::string plan = "--model mixtral-8x7b --strategy fsdp --ep 8 --batch 1 --seq 4096 --recompute full "
                             "--param-dtype bf16 --reduce-dtype bf16 --hardware h100-80gb-datasheet --ranks " + std::to_string(ranks);
    const Result human = shardlm("simulate " + plan);
    ASSERT_EQ(human.code, 0) << human.out;
    for (const std::regex& want : {std::regex("step [0-9.]+ ms"), std::regex("total: [0-9]+ \\([0-9.]+ GiB\\)"),
                                  std::regex("all-to-all \\(ep 8 exchanges\\): [0-9.]+ ms in exchange tasks \\([0-9.]+% of the "
                                             "step\\), [0-9.]+ ms exposed \\([0-9.]+% of the step\\); expert load max/mean 1 "
                                             "\\(default")})
      EXPECT_TRUE(std::regex_search(human.out, want)) << human.out;
    const Result j = shardlm("simulate --json " + plan);
    ASSERT_EQ(j.code, 0) << j.out;
    const json r = json::parse(j.out);
    EXPECT_GT(r["exchange_busy_ms"].get<double>(), 0);
    EXPECT_LE(r["exchange_exposed_ms"].get<double>(), r["comm_exposed_ms"].get<double>() + 1e-9);
    EXPECT_EQ(r["moe_imbalance"].get<double>(), 1);
    // The busiest rank's load lengthens its exchanges.
    const Result skewed = shardlm("simulate --json --moe-imbalance 2 " + plan);
    ASSERT_EQ(skewed.code, 0) << skewed.out;
    const json k = json::parse(skewed.out);
    EXPECT_NEAR(k["exchange_busy_ms"].get<double>(), 2 * r["exchange_busy_ms"].get<double>(),
                0.05 * r["exchange_busy_ms"].get<double>());
    EXPECT_GT(k["step_ms"].get<double>(), r["step_ms"].get<double>());
  }
  expect_one_line_error(shardlm("simulate --model mixtral-8x7b --ep 8 --ranks 64 --moe-imbalance 0.5"),
                        {"--moe-imbalance", "0.5"});
  expect_one_line_error(shardlm(kSmall + "--moe-imbalance 1.5"), {"--moe-imbalance", "no experts"});
  const Result one = shardlm("simulate --model moe-tiny --batch 1 --seq 32 --ranks 2");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_NE(one.out.find("all-to-all: none (ep 1"), std::string::npos) << one.out;
}

// moe-small with its sequences split over cp (and beside ep): simulate prices the block's
// exchanges, the routing counts over cp among them, and prints their share; explain names the
// counts exchange.
TEST_F(Simulate, MixtureOfExpertsUnderContextParallelismPrintsItsExchanges) {
  for (const std::string flags : {"--cp 2", "--cp 2 --cp-impl all-to-all", "--cp 2 --ep 2"}) {
    const std::string plan = "--model moe-small --strategy fsdp --batch 1 --seq 256 --ranks 4 " + flags;
    const Result human = shardlm("simulate --hardware cpu-local " + plan);
    ASSERT_EQ(human.code, 0) << human.out;
    EXPECT_TRUE(std::regex_search(human.out, std::regex("exchanges \\(cp 2 [a-z-]+(, ep 2)?\\): [0-9.]+ ms in exchange tasks")))
        << human.out;
    const Result j = shardlm("simulate --json --hardware cpu-local " + plan);
    ASSERT_EQ(j.code, 0) << j.out;
    const json r = json::parse(j.out);
    EXPECT_GT(r["exchange_busy_ms"].get<double>(), 0) << flags;
    EXPECT_EQ(r["cp"].get<int>(), 2) << flags;
    const Result explained = shardlm("explain " + plan);
    ASSERT_EQ(explained.code, 0) << explained.out;
    EXPECT_NE(explained.out.find("(cp) routing counts of the cp group"), std::string::npos) << flags;
  }
}

// Per stream, the names of the slices of one step, in time order.
std::map<int, std::vector<std::string>> stream_tasks(const fs::path& trace, int pid, int step) {
  const json t = json::parse(std::ifstream(trace));
  std::vector<json> xs;
  for (const json& e : t.at("traceEvents"))
    if (e["ph"] == "X" && e["pid"] == pid && e["args"]["step"] == step) xs.push_back(e);
  std::stable_sort(xs.begin(), xs.end(), [](const json& a, const json& b) { return a["ts"].get<double>() < b["ts"].get<double>(); });
  std::map<int, std::vector<std::string>> out;
  for (const json& e : xs) out[e["tid"].get<int>()].push_back(e["name"].get<std::string>());
  return out;
}

// The same plan run for real (2 ranks, FSDP) and simulated: both traces hold the same tasks on
// the same streams in the same order.
TEST_F(Simulate, TraceMatchesARealRun) {
  const std::string plan = "--model tiny --batch 2 --seq 32 --threads 1 --strategy fsdp --grad-accum 2";
  const Result real = shardlm::testing::mpirun(
      2, "train " + plan + " --data " + (dir_ / "tok").string() + " --out " + (dir_ / "run").string() +
             " --steps 1 --eval-windows 1 --sample-tokens 0 --peak-gflops 100 --quiet --trace " + (dir_ / "real.json").string());
  ASSERT_EQ(real.code, 0) << real.out;
  const Result sim = shardlm("simulate " + plan + " --ranks 2 --trace " + (dir_ / "sim.json").string());
  ASSERT_EQ(sim.code, 0) << sim.out;
  const auto measured = stream_tasks(dir_ / "real.json", 0, 0), predicted = stream_tasks(dir_ / "sim.json", 0, 0);
  ASSERT_EQ(measured.size(), 2u);  // compute and comm
  EXPECT_EQ(predicted, measured);
  // The simulated trace also carries the memory counters.
  const json t = json::parse(std::ifstream(dir_ / "sim.json"));
  EXPECT_TRUE(std::any_of(t["traceEvents"].begin(), t["traceEvents"].end(), [](const json& e) { return e["ph"] == "C"; }));
}

// Measures this machine, so release-only: under a sanitizer the memory bandwidth calibrate
// measures is the instrumented loop's, below what MPI's uninstrumented copies reach, and the
// profile is refused (a bus bandwidth above the memory bandwidth).
class SimulateSlow : public Simulate {};

// calibrate writes a profile (at 1 and 2 ranks) that simulate reads. One rank times no
// collective: its profile prices one rank, and simulate refuses it for two (it priced their
// collectives at the memory bandwidth with no latency).
TEST_F(SimulateSlow, CalibrateWritesAProfileSimulateReads) {
  const std::string quick = " --threads 1 --sizes-kib 1024,16384,65536 --iters 3 --gemm-models tiny";
  const Result one = shardlm("calibrate --out " + (dir_ / "cal1.json").string() + quick);
  ASSERT_EQ(one.code, 0) << one.out;
  const Result two = shardlm::testing::mpirun(2, "calibrate --out " + (dir_ / "cal2.json").string() + quick);
  ASSERT_EQ(two.code, 0) << two.out;
  for (const auto& [f, ranks] : {std::pair{"cal1.json", 1}, std::pair{"cal2.json", 2}}) {
    const Result r = shardlm(kSmall + "--ranks " + std::to_string(ranks) + " --json --hardware " + (dir_ / f).string());
    ASSERT_EQ(r.code, 0) << f << ": " << r.out;
    EXPECT_GT(json::parse(r.out)["step_ms"].get<double>(), 0) << f;
  }
  expect_one_line_error(shardlm(kSmall + "--ranks 2 --hardware " + (dir_ / "cal1.json").string()),
                        {"cal1.json", "collectives_measured"});
  const json j = json::parse(std::ifstream(dir_ / "cal2.json"));
  EXPECT_GT(j["intra_node"]["all_reduce"]["bus_bw"]["value"].get<double>(), 0);
  // The all-to-all is measured too, its latency per peer message (sim prices latency·(n−1)).
  for (const char* tier : {"intra_node", "inter_node"}) {
    EXPECT_GT(j[tier]["all_to_all"]["bus_bw"]["value"].get<double>(), 0) << tier;
    EXPECT_GE(j[tier]["all_to_all"]["latency_s"]["value"].get<double>(), 0) << tier;
  }
  EXPECT_NE(j["intra_node"]["all_to_all"]["bus_bw"]["source"].get<std::string>().find("measured by shardlm calibrate"),
            std::string::npos);
  EXPECT_NE(j["intra_node"]["all_to_all"]["latency_s"]["source"].get<std::string>().find("per peer message"),
            std::string::npos);
  EXPECT_NE(j["peak_flops"]["source"].get<std::string>().find("calibrate"), std::string::npos);
  // tiny's block (qkv, projection, MLP up and down: 4 shapes) and head GEMMs, and its attention.
  EXPECT_EQ(j["gemm_rates"]["value"].size(), 5u);
  EXPECT_EQ(j["attention_rates"]["value"].size(), 1u);
  EXPECT_GT(j["pointwise_bw"]["value"].get<double>(), 0);
}

// calibrate on a device (here the CPU answering that its memory is not the host's, the seam that
// stands in for a GPU) writes a per-device profile that simulate reads for one rank, the same at
// any --threads; several ranks are refused, by calibrate and by simulate, in one line.
TEST_F(SimulateSlow, CalibrateOnADeviceWritesAProfileSimulateReads) {
  const std::string seam = "SHARDLM_TEST_CPU_AS_DEVICE=1 " + shardlm::testing::shardlm_binary() + " ";
  const std::string file = (dir_ / "dev.json").string(), quick = " --iters 1 --gemm-models tiny:2x32";
  const Result cal = shardlm::testing::run_command(seam + "calibrate --out " + file + quick);
  ASSERT_EQ(cal.code, 0) << cal.out;
  EXPECT_NE(cal.out.find("the CPU as a device"), std::string::npos) << cal.out;
  const json j = json::parse(std::ifstream(file));
  EXPECT_EQ(j["per_thread"], false);
  EXPECT_GT(j["host_link_bw"]["value"].get<double>(), 0);
  EXPECT_EQ(j["gemm_rates"]["value"].size(), 5u);
  std::vector<double> steps;
  for (int threads : {1, 2}) {
    const Result r = shardlm("simulate --model tiny --batch 2 --seq 32 --json --threads " + std::to_string(threads) +
                             " --hardware " + file);
    ASSERT_EQ(r.code, 0) << r.out;
    steps.push_back(json::parse(r.out)["step_ms"].get<double>());
  }
  EXPECT_GT(steps[0], 0);
  EXPECT_DOUBLE_EQ(steps[1], steps[0]);
  expect_one_line_error(shardlm(kSmall + "--ranks 2 --hardware " + file), {"dev.json", "collectives_measured"});
  const Result two = shardlm::testing::mpirun(2, "calibrate --out " + (dir_ / "dev2.json").string() + quick,
                                              "-x SHARDLM_TEST_CPU_AS_DEVICE=1");
  EXPECT_NE(two.code, 0) << two.out;
  EXPECT_NE(two.out.find("one rank only"), std::string::npos) << two.out;
  EXPECT_FALSE(fs::exists(dir_ / "dev2.json"));
}

// The planner under a budget that rules out DDP (below DDP's least memory: batch 1, full
// recompute, 25 MB buckets): its best configuration is another strategy and fits when run.
TEST_F(Simulate, PlannerPicksAConfigurationThatFitsWhenRun) {
  const Result ddp = shardlm("simulate --model small --ranks 2 --threads 1 --strategy ddp --batch 1 --seq 64 --recompute full --json");
  ASSERT_EQ(ddp.code, 0) << ddp.out;
  const int64_t budget = json::parse(ddp.out)["mem"]["total"].get<int64_t>() - 1;
  const Result p = shardlm("plan --model small --ranks 2 --threads 1 --seq 64 --global-batch 256 --top 1 --memory-per-rank " +
                           std::to_string(budget));
  ASSERT_EQ(p.code, 0) << p.out;
  const std::string flags = first_ranked_flags(p.out);
  ASSERT_FALSE(flags.empty()) << p.out;
  EXPECT_EQ(flags.find("--strategy ddp"), std::string::npos) << flags;
  expect_trains_within(2, flags, "planned", budget);
  // Bad budgets and a model that fits nowhere: one line each.
  expect_one_line_error(shardlm("plan --model small --ranks 2 --global-batch 256 --seq 64 --memory-per-rank 0"), {"--memory-per-rank", "0"});
  expect_one_line_error(shardlm("plan --model small --ranks 2 --global-batch 256 --seq 64 --memory-per-rank 1000"),
                        {"no configuration", "1000"});
  expect_one_line_error(shardlm("plan --model small --ranks 2 --global-batch 256 --seq 64 --memory-per-rank 2TB2"),
                        {"--memory-per-rank", "2TB2"});
  // A size with a unit, as --memory-budget takes: 1 GiB is what the byte count says.
  const Result gib = shardlm("plan --model small --ranks 2 --threads 1 --global-batch 256 --seq 64 --top 1 --memory-per-rank 1GiB");
  const Result bytes = shardlm("plan --model small --ranks 2 --threads 1 --global-batch 256 --seq 64 --top 1 --memory-per-rank 1073741824");
  ASSERT_EQ(gib.code, 0) << gib.out;
  auto budget_and_top = [](const std::string& out) {  // the search's counts may vary with its threads
    return out.substr(out.find(" fit "), out.find(" per rank") - out.find(" fit ")) + out.substr(out.find("\n   1 "));
  };
  EXPECT_EQ(budget_and_top(gib.out), budget_and_top(bytes.out));
}

// --search-cp searches cp beside cp 1 (without it only where nothing fits): more configurations,
// every one accounted for on the first line (pruned, bounded, invalid or built).
TEST_F(Simulate, PlanSearchesContextParallelismWhenAsked) {
  const std::string plan = "plan --model llama-tiny --ranks 4 --threads 1 --seq 256 --global-batch 4096 --hardware h100-80gb-datasheet --top 3";
  auto counts = [](const std::string& out) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(out, m,
                                  std::regex("(\\d+) configurations \\((\\d+) pruned by memory or its bound unbuilt, (\\d+) by a "
                                             "bound on step time unbuilt, (\\d+) invalid, (\\d+) built")))
        << out;
    std::vector<int64_t> v;
    for (size_t i = 1; i < m.size(); ++i) v.push_back(std::stoll(m[i]));
    return v;
  };
  const Result without = shardlm(plan), with = shardlm(plan + " --search-cp");
  ASSERT_EQ(without.code, 0) << without.out;
  ASSERT_EQ(with.code, 0) << with.out;
  const std::vector<int64_t> a = counts(without.out), b = counts(with.out);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_GT(b[0], 2 * a[0]);
  EXPECT_EQ(b[1] + b[2] + b[3] + b[4], b[0]) << with.out;
  EXPECT_EQ(without.out.find("--cp "), std::string::npos) << without.out;
}

// --search-act-quant searches int8 activations beside fp32: under a budget that fp32 activations
// fit only by rebuilding blocks whole (one sequence, the budget int8's peak keeping everything),
// the first row compresses and is predicted faster than without the flag; its flags train within
// the budget. Without the flag no row compresses; a group that splits a row is one line.
TEST_F(Simulate, PlanSearchesActivationCompressionWhenAsked) {
  const Result int8 = shardlm("simulate --model small --vocab 256 --ranks 1 --threads 1 --batch 1 --seq 256 --act-quant int8 --json");
  ASSERT_EQ(int8.code, 0) << int8.out;
  const int64_t budget = json::parse(int8.out)["mem"]["total"].get<int64_t>();
  const std::string plan = "plan --model small --vocab 256 --ranks 1 --threads 1 --seq 256 --global-batch 256 --top 1 "
                           "--memory-per-rank " + std::to_string(budget);
  const Result without = shardlm(plan), with = shardlm(plan + " --search-act-quant");
  ASSERT_EQ(without.code, 0) << without.out;
  ASSERT_EQ(with.code, 0) << with.out;
  EXPECT_EQ(without.out.find("--act-quant"), std::string::npos) << without.out;
  EXPECT_NE(with.out.find("activations: each configuration searched in fp32 and as int8 (group 64, nearest rounding)"),
            std::string::npos) << with.out;
  const std::regex first("\n +1 +([0-9.]+) ");
  std::smatch a, b;
  ASSERT_TRUE(std::regex_search(without.out, a, first)) << without.out;
  ASSERT_TRUE(std::regex_search(with.out, b, first)) << with.out;
  EXPECT_LT(std::stod(b[1]), std::stod(a[1])) << with.out;
  const std::string flags = first_ranked_flags(with.out);
  EXPECT_NE(flags.find("--act-quant int8 --act-quant-group 64 --act-quant-rounding nearest"), std::string::npos) << flags;
  expect_trains_within(1, flags, "planned_int8", budget);
  expect_one_line_error(shardlm(plan + " --search-act-quant --act-quant-group 100"), {"act_quant_group", "100", "n_embd"});
  // A GPU's profile is searched as int8 too: its rows train with --device cuda, which has the kernels.
  const Result gpu = shardlm("plan --model small --ranks 8 --seq 1024 --global-batch 65536 --hardware h100-80gb-datasheet "
                             "--search-act-quant");
  EXPECT_EQ(gpu.code, 0) << gpu.out;
  EXPECT_NE(gpu.out.find("searched in fp32 and as int8"), std::string::npos) << gpu.out;
}

// With --disk-per-rank, under a budget nothing fits in memory (small over the corpus's 256 tokens:
// 192 MB at least), plan offers disk-tier configurations; the first one's flags train within the
// budget. --largest-model reports a depth and the flags to train it. A profile without disk
// figures, and --largest-model with --run, are refused in one line.
TEST_F(Simulate, PlannerOffersTheDiskTierAndTheLargestModel) {
  const std::string plan = "plan --model small --vocab 256 --ranks 1 --threads 1 --seq 256 --global-batch 1024 --top 1 ";
  const int64_t budget = 150000000;
  const Result p = shardlm(plan + "--memory-per-rank " + std::to_string(budget) + " --disk-per-rank 1GiB");
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_NE(p.out.find("disk tier: nothing fits in memory"), std::string::npos) << p.out;
  const std::string flags = first_ranked_flags(p.out);
  ASSERT_FALSE(flags.empty()) << p.out;
  EXPECT_NE(flags.find("--memory-budget " + std::to_string(budget)), std::string::npos) << flags;
  expect_trains_within(1, flags, "planned_disk", budget);

  const Result l = shardlm(plan + "--memory-per-rank " + std::to_string(budget) + " --disk-per-rank 1GiB --largest-model");
  ASSERT_EQ(l.code, 0) << l.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(l.out, m, std::regex("n_layer ([0-9]+) \\(([0-9.]+) B parameters\\)"))) << l.out;
  EXPECT_GT(std::stoi(m[1]), 6) << l.out;  // deeper than small itself, which fits only with the disk tier
  EXPECT_NE(l.out.find("fastest: step "), std::string::npos) << l.out;
  EXPECT_NE(l.out.find("--n-layer " + std::string(m[1]) + " --strategy ddp"), std::string::npos) << l.out;

  expect_one_line_error(shardlm(plan + "--disk-per-rank 1GB --hardware h100-80gb-datasheet"), {"--disk-per-rank", "no disk figures"});
  expect_one_line_error(shardlm(plan + "--disk-per-rank lots"), {"--disk-per-rank", "lots"});
  expect_one_line_error(shardlm(plan + "--memory-per-rank 150000000 --largest-model --run"), {"--largest-model", "--run"});
}

// plan --run trains the best configuration here and prints predicted against measured.
TEST_F(Simulate, PlanRunTrainsTheBest) {
  const Result r = shardlm::testing::mpirun(
      2, "plan --model tiny --ranks 2 --threads 1 --seq 32 --global-batch 256 --top 1 --run --run-steps 3 --data " +
             (dir_ / "tok").string() + " --out " + (dir_ / "planrun").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("predicted [0-9.]+ ms/step, measured [0-9.]+ ms/step"))) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "planrun" / "metrics.jsonl"));
  expect_one_line_error(shardlm("plan --model tiny --ranks 2 --global-batch 256 --seq 32 --run"), {"--data"});
}

}  // namespace

namespace {

// `simulate --collective`: nccl-tests' table. busbw = algbw × 2(n−1)/n for all-reduce, (n−1)/n
// for the others; the nodes a group spans are counted from the profile (8 devices a node); one
// node prices on NVLink (A100 ~230 GB/s), two on the 8 NICs (8 × 24 = 192 GB/s), below the fabric.
TEST(SimulateCollective, PrintsTimeAlgbwBusbwPerSize) {
  struct Case {
    const char* op;
    int ranks;
    double factor;
  };
  for (const Case k : {Case{"all-reduce", 8, 2.0 * 7 / 8}, Case{"all-gather", 16, 15.0 / 16},
                       Case{"reduce-scatter", 24, 23.0 / 24}, Case{"all-to-all", 32, 31.0 / 32}}) {
    const Result r = shardlm(std::string("simulate --hardware a100-80gb-datasheet --json --collective ") + k.op +
                             " --bytes 1K:1G --ranks " + std::to_string(k.ranks));
    ASSERT_EQ(r.code, 0) << r.out;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["nodes"].get<int>(), (k.ranks + 7) / 8) << k.op;
    EXPECT_EQ(j["per_node"].get<int>(), 8) << k.op;
    const auto& rows = j["rows"];
    ASSERT_EQ(rows.size(), 21u) << k.op;  // 1 KiB, 2 KiB, ..., 1 GiB
    int64_t last = 512;
    for (const auto& row : rows) {
      EXPECT_EQ(row["bytes"].get<int64_t>(), 2 * last);
      last = row["bytes"].get<int64_t>();
      const double t = row["time_us"].get<double>() * 1e-6;
      EXPECT_NEAR(row["algbw_gbs"].get<double>(), last / t / 1e9, 1e-9 * last / t);
      EXPECT_NEAR(row["busbw_gbs"].get<double>(), row["algbw_gbs"].get<double>() * k.factor, 1e-9 * last / t);
    }
    const double big = rows.back()["busbw_gbs"].get<double>();
    if (k.ranks == 8) {
      EXPECT_NEAR(big, 230, 5) << k.op;
    }
    if (k.ranks == 16 || k.ranks == 24) {
      EXPECT_NEAR(big, 192, 5) << k.op;
    }
    // All-to-all across 4 nodes: each GPU's own NIC, 24 GB/s × 4/3 (NVIDIA/nccl-tests issue 130).
    if (k.ranks == 32) {
      EXPECT_NEAR(big, 24.0 * 4 / 3 * 31 / 32, 1) << k.op;
    }
  }
  // The human table: a header naming the span, one row per size, 8 B to 8 GiB by default.
  const Result human = shardlm("simulate --hardware h100-80gb-datasheet --collective all-reduce --ranks 8");
  ASSERT_EQ(human.code, 0) << human.out;
  EXPECT_NE(human.out.find("1 node(s) x 8 rank(s) a node"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("nvls"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find(" 8589934592 "), std::string::npos) << human.out;
  // The profile's provenance and, a datasheet profile's, its caution; the table's header; a row a size.
  EXPECT_EQ(std::count(human.out.begin(), human.out.end(), '\n'), 2 + 3 + 31);
  // Across 16 nodes the small sizes run NCCL's LL protocol, named after the algorithm.
  const Result nodes = shardlm("simulate --hardware h100-80gb-datasheet --collective all-reduce --ranks 128 --bytes 8:1G");
  ASSERT_EQ(nodes.code, 0) << nodes.out;
  EXPECT_NE(nodes.out.find(" 8  tree/LL "), std::string::npos) << nodes.out;
  EXPECT_EQ(nodes.out.find("/LL", nodes.out.find(" 1073741824 ")), std::string::npos) << nodes.out;
}

TEST(SimulateCollective, BadInputIsOneLine) {
  const std::string base = "simulate --hardware a100-80gb-datasheet --ranks 16 ";
  expect_one_line_error(shardlm(base + "--collective broadcast"), {"--collective", "broadcast", "all-reduce"});
  expect_one_line_error(shardlm(base + "--collective all-reduce --bytes 12X"), {"--bytes", "12X"});
  expect_one_line_error(shardlm(base + "--collective all-reduce --bytes 1G:1K"), {"--bytes", "MAX is below MIN"});
  expect_one_line_error(shardlm(base + "--collective all-reduce --bytes 0"), {"--bytes", "must be in"});
  expect_one_line_error(shardlm(base + "--collective all-gather --algo tree"), {"--algo tree", "all-reduce"});
  expect_one_line_error(shardlm(base + "--collective all-reduce --algo fast"), {"--algo", "fast"});
  expect_one_line_error(shardlm("simulate --model tiny --bytes 8"), {"--bytes", "--collective"});
}

}  // namespace

namespace {

// `simulate --mtbf-hours`: the goodput report, human and JSON, its intervals in whole steps;
// a profile without storage figures needs --storage-gbs, said in one line.
TEST(SimulateGoodput, ReportsTheFractionAndTheIntervals) {
  // Parity groups of 8 ranks each fill a node: a lost node takes a group, so only the failures
  // that leave the node (15%) are the snapshots'.
  const std::string run = "simulate --model llama2-7b --ranks 1024 --hardware h100-80gb-datasheet --batch 2 --seq 4096 "
                          "--param-dtype bf16 --reduce-dtype bf16 --mtbf-hours 6300 --snapshot-parity 8 ";
  const Result r = shardlm(run + "--json");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  const json& g = j["goodput"];
  EXPECT_GT(g["fraction"].get<double>(), 0.9);
  EXPECT_LT(g["fraction"].get<double>(), 1);
  EXPECT_NEAR(g["tokens_per_s"].get<double>(), j["tokens_per_s"].get<double>() * g["fraction"].get<double>(), 1);
  const json& c = g["checkpoint"];
  EXPECT_NEAR(c["interval_s"].get<double>(), c["every_steps"].get<double>() * j["step_ms"].get<double>() * 1e-3, 1e-6);
  // 128 nodes at 6300 h: a failure every 49 h, 85% of them (not recovered by a snapshot) to disk.
  EXPECT_NEAR(c["failures_per_hour"].get<double>(), 128 / 6300.0 * 0.85, 1e-9);
  EXPECT_NEAR(c["interval_s"].get<double>(), c["young_s"].get<double>(), 0.05 * c["young_s"].get<double>());
  EXPECT_EQ(g["snapshot_survives"].get<double>(), 0.15);
  // Partner copies go to the next node: all but the failures that may take several nodes.
  const Result copies = shardlm(run.substr(0, run.find("--snapshot-parity")) + "--json");
  ASSERT_EQ(copies.code, 0) << copies.out;
  const json jc = json::parse(copies.out);
  const json& gc = jc["goodput"];
  EXPECT_EQ(gc["snapshot_survives"].get<double>(), 0.92);
  EXPECT_NEAR(gc["checkpoint"]["failures_per_hour"].get<double>(), 128 / 6300.0 * 0.08, 1e-9);
  EXPECT_GT(gc["fraction"].get<double>(), g["fraction"].get<double>());
  const Result human = shardlm(run);
  ASSERT_EQ(human.code, 0) << human.out;
  for (const char* s : {"goodput under failures:", "disk checkpoint:", "Young", "in-memory snapshot"})
    EXPECT_NE(human.out.find(s), std::string::npos) << s << " in " << human.out;
  expect_one_line_error(shardlm("simulate --model tiny --ranks 2 --mtbf-hours 100"), {"storage_bw", "--storage-gbs"});
  const Result cpu = shardlm("simulate --model tiny --ranks 2 --mtbf-hours 100 --storage-gbs 0.5 --json");
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  EXPECT_GT(json::parse(cpu.out)["goodput"]["fraction"].get<double>(), 0);
}

// `plan --mtbf-hours` ranks by tokens/s × goodput: a column of each, in decreasing order of the product.
TEST(SimulateGoodput, PlanRanksByGoodTokens) {
  const Result r = shardlm("plan --model llama2-7b --ranks 64 --hardware h100-80gb-datasheet --global-batch 524288 --seq 4096 "
                           "--top 8 --mtbf-hours 50");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ranked by tokens/s x goodput"), std::string::npos) << r.out;
  const std::regex row(R"(\n +[0-9]+ +[0-9.]+ +([0-9]+) +[0-9.]+% +[0-9.]+ +[0-9]+ +([0-9.]+)% +([0-9]+) +(fsdp|hybrid|zero1|zero2|ddp) )");
  double last = 1e300;
  int rows = 0;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), row); it != std::sregex_iterator(); ++it) {
    const double tokens = std::stod((*it)[1]), kept = std::stod((*it)[2]) / 100, good = std::stod((*it)[3]);
    EXPECT_NEAR(good, tokens * kept, 0.0001 * tokens + 1);
    EXPECT_LE(good, last + 1);
    last = good;
    ++rows;
  }
  EXPECT_EQ(rows, 8) << r.out;
}

}  // namespace
