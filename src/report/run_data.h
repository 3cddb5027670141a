// What a run directory holds, read for the report: metrics.jsonl's rows (training steps and
// evaluations), run_info.json (command line, commit, machine, the plan's memory) and run.json.
// Reading never throws for damaged content: a line that is not JSON, a missing file or field is
// recorded in `problems` and the page says so; only a directory that holds no run at all throws.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace shardlm::report {

struct RunData {
  std::string dir;
  std::string name;                  // the directory's last component, for legends
  std::vector<nlohmann::json> steps;  // training rows ("loss" present), one per step, in step order
  std::vector<nlohmann::json> evals;  // evaluation rows ("val_loss")
  nlohmann::json info;                // run_info.json, or null
  nlohmann::json identity;            // run.json, or null
  std::vector<std::string> problems;  // what could not be read, one sentence each
};

// Reads DIR. Throws std::runtime_error with one line when DIR does not exist, is not a directory,
// or holds neither metrics.jsonl nor run.json (an empty directory, another tool's).
RunData load_run(const std::string& dir);

// A number field of a row; NaN when absent or not a number (JSON null is how a NaN loss is written).
double number(const nlohmann::json& row, const char* key);
// A nested number (row[outer][inner]); NaN when absent.
double number(const nlohmann::json& row, const char* outer, const char* inner);

// Cumulative tokens trained after each of run.steps (tokens_per_s × step_ms, summed).
std::vector<double> cumulative_tokens(const RunData& run);

}  // namespace shardlm::report
