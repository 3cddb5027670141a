#include "report/run_data.h"

#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <limits>
#include <stdexcept>

namespace shardlm::report {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A JSON file's object, or null with a problem noted (absent files are noted by the caller's choice).
json read_object(const fs::path& path, std::vector<std::string>& problems, bool note_absent) {
  if (!fs::exists(path)) {
    if (note_absent) problems.push_back(path.string() + ": not there");
    return nullptr;
  }
  std::ifstream f(path);
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    problems.push_back(path.string() + ": not a JSON object; left out");
    return nullptr;
  }
  return j;
}

// A later row of a step already seen means the run went back to it (a restart that kept the log):
// the rows from that step on are the old timeline's and give way, so the run is one curve.
void add_step(std::vector<json>& steps, json row) {
  const double step = number(row, "step");
  while (!steps.empty() && number(steps.back(), "step") >= step) steps.pop_back();
  steps.push_back(std::move(row));
}

void read_metrics(const fs::path& path, RunData& run) {
  std::ifstream f(path);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.empty()) continue;
    json row = json::parse(line, nullptr, false);
    if (row.is_discarded() || !row.is_object() || !row.contains("step") || !row["step"].is_number()) {
      run.problems.push_back(fmt::format("{} line {}: {} ; skipped", path.string(), line_no,
                                         row.is_discarded() ? "not JSON (cut short?)" : "no numeric \"step\""));
      continue;
    }
    if (row.contains("loss")) add_step(run.steps, std::move(row));
    else if (row.contains("val_loss")) run.evals.push_back(std::move(row));
    else run.problems.push_back(fmt::format("{} line {}: neither \"loss\" nor \"val_loss\"; skipped", path.string(), line_no));
  }
}

}  // namespace

double number(const json& row, const char* key) {
  if (!row.is_object()) return kNaN;
  const auto it = row.find(key);
  return it != row.end() && it->is_number() ? it->get<double>() : kNaN;
}

double number(const json& row, const char* outer, const char* inner) {
  if (!row.is_object()) return kNaN;
  const auto it = row.find(outer);
  return it != row.end() ? number(*it, inner) : kNaN;
}

std::vector<double> cumulative_tokens(const RunData& run) {
  std::vector<double> out;
  double sum = 0;
  for (const json& r : run.steps) {
    const double t = number(r, "tokens_per_s") * number(r, "step_ms") * 1e-3;
    if (std::isfinite(t)) sum += std::round(t);  // a step's tokens are a whole number
    out.push_back(std::isfinite(t) ? sum : kNaN);
  }
  return out;
}

RunData load_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw std::runtime_error("report: " + dir + ": no such directory");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error("report: " + dir + ": not a directory (give a run directory, train's --out)");
  const fs::path d(dir);
  if (!fs::exists(d / "metrics.jsonl") && !fs::exists(d / "run.json"))
    throw std::runtime_error("report: " + dir + ": not a shardlm run directory (no metrics.jsonl or run.json; give train's --out)");
  RunData run;
  run.dir = dir;
  run.name = fs::absolute(d).lexically_normal().filename().string();
  if (run.name.empty()) run.name = fs::absolute(d).lexically_normal().parent_path().filename().string();
  if (fs::exists(d / "metrics.jsonl")) read_metrics(d / "metrics.jsonl", run);
  else run.problems.push_back((d / "metrics.jsonl").string() + ": not there (the run has recorded no step yet)");
  run.info = read_object(d / "run_info.json", run.problems, true);
  run.identity = read_object(d / "run.json", run.problems, false);
  return run;
}

}  // namespace shardlm::report
