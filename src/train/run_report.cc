#include "train/run_report.h"

#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <unistd.h>

#include "files/replace_file.h"
#include "report/report.h"
#include "shardlm_git_commit.h"  // written by the build (cmake/git_commit.cmake)

namespace shardlm::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A field of /proc/cpuinfo or /proc/meminfo ("" where the file or field is absent: not Linux).
std::string proc_field(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const auto start = line.find_first_not_of(" \t", colon + 1);
      return start == std::string::npos ? "" : line.substr(start);
    }
  return "";
}

json machine() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return {{"host", host},
          {"cpu", proc_field("/proc/cpuinfo", "model name")},
          {"logical cores", std::thread::hardware_concurrency()},
          {"memory", proc_field("/proc/meminfo", "MemTotal")}};
}

json mem_json(const MemSnapshot& s) {
  json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

// A float setting as typed (0.001, not the double nearest the float, 0.0010000000474974513).
double shown(float v) { return std::stod(fmt::format("{}", v)); }

// The strategy is the plan's, which can differ from the one asked (fsdp on one rank runs as ddp);
// hybrid's with its shard group.
std::string strategy_run(const TrainConfig& c, const plan::Plan& plan) {
  const std::string ran = plan::strategy_text(plan.config);
  return plan.config.strategy == plan::parse_strategy(c.strategy) ? ran : fmt::format("{} (asked {})", ran, c.strategy);
}

// "cosine to 6e-05 from step 100" (the decay's first step: warmup, then the stable phase), or "none".
std::string lr_decay_text(const TrainConfig& c) {
  if (c.lr_decay == "none") return c.lr_decay;
  return fmt::format("{} to {} from step {}", c.lr_decay, shown(c.min_lr), c.lr_schedule().decay_start());
}

json settings(const TrainConfig& c, const plan::Plan& plan, const RunInfo& info) {
  return {{"model", c.model},         {"strategy", strategy_run(c, plan)},
          {"ranks", info.ranks},      {"machines", describe(c.machines)}, {"threads", c.threads},
          {"batch", c.batch},         {"seq", c.seq},           {"grad_accum", c.grad_accum},   {"steps", c.steps},
          {"lr", shown(c.lr)},        {"warmup", c.warmup},     {"lr_decay", lr_decay_text(c)},
          {"recompute", c.recompute_text()},                        {"param_dtype", c.param_dtype},
          {"reduce_dtype", c.reduce_dtype}, {"device", c.device}, {"ep", c.ep},                 {"data", c.data},
          {"act_quant", c.act_quant == "none" ? c.act_quant
                                              : fmt::format("{} (group {}, {})", c.act_quant, c.act_quant_group,
                                                            c.act_quant_rounding)},
          {"tokens_per_step", info.tokens_per_step}, {"peak_gflops", info.peak_gflops}};
}

// The starts an earlier run_info.json recorded, up to this start's step: a resume continues them.
json earlier_starts(const fs::path& path, int64_t before) {
  json kept = json::array();
  std::ifstream f(path);
  if (!f) return kept;
  const json old = json::parse(f, nullptr, false);
  if (old.is_discarded() || !old.is_object() || !old.contains("starts") || !old["starts"].is_array()) return kept;
  for (const json& s : old["starts"])
    if (s.is_object() && s.value("step", int64_t{-1}) < before) kept.push_back(s);
  return kept;
}

}  // namespace

void write_run_info(const TrainConfig& cfg, const plan::Plan& plan, const RunInfo& info) {
  try {
    write_run_info_or_throw(cfg, plan, info);
  } catch (const std::exception& e) {
    std::cerr << "shardlm: warning: the report's run_info.json was not written: " << e.what() << "\n";
  }
}

void write_run_info_or_throw(const TrainConfig& cfg, const plan::Plan& plan, const RunInfo& info) {
  const fs::path path = fs::path(cfg.out) / "run_info.json";
  json starts = info.start_step > 0 ? earlier_starts(path, info.start_step) : json::array();
  starts.push_back({{"step", info.start_step}, {"command_line", cfg.command_line}});
  std::error_code ec;
  const json j{{"starts", starts},
               {"git_commit", SHARDLM_GIT_COMMIT},
               {"machine", machine()},
               {"config", settings(cfg, plan, info)},
               {"plan_mem", mem_json(plan.peak_memory())},
               {"plan_mem_max", mem_json(plan.max_memory())},
               {"trace", cfg.trace.empty() ? "" : fs::absolute(cfg.trace, ec).string()}};
  files::replace_file(path.string(), j.dump(1) + "\n");  // as the page is written: no fixed temporary name
}

void refresh_report(const TrainConfig& cfg) {
  if (cfg.no_report) return;
  try {
    report::ReportOptions opt;
    opt.run_dir = cfg.out;
    report::write_report(opt);
  } catch (const std::exception& e) {
    std::cerr << "shardlm: warning: the report was not written: " << e.what() << "\n";
  }
}

}  // namespace shardlm::train
