#include "report/run_data.h"

#include <algorithm>
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

// The training rows' fields drawn against steps, and those of them with statistics.
const std::vector<std::string> kDrawn = {"loss",         "lr",      "grad_norm",       "tokens_per_s",    "step_ms",
                                         "compute_ms",   "mfu",     "comm_exposed_ms", "aux_loss",        "z_loss",
                                         "expert_load_max", "expert_load_min", "dropped_frac"};
const std::vector<std::string> kStatistics = {"tokens_per_s", "step_ms", "compute_ms", "mfu", "comm_exposed_ms",
                                              "expert_load_imbalance"};

// The most problems listed for one metrics.jsonl: a file damaged throughout is one count beyond.
constexpr size_t kMaxListed = 20;

std::vector<std::string> memory_keys() {
  std::vector<std::string> keys = kMemCategories;
  keys.push_back("total");
  return keys;
}

std::string kind_of(fs::file_type t) {
  switch (t) {
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::directory: return "a directory";
    default: return "not a file";
  }
}

// A JSON value as a problem quotes it: short.
std::string quoted(const json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// A JSON file's object, or null with a problem noted (absent files are noted by the caller's choice).
json read_object(const fs::path& path, std::vector<std::string>& problems, bool note_absent) {
  if (!fs::exists(path)) {
    if (note_absent) problems.push_back(path.string() + ": not there");
    return nullptr;
  }
  require_regular_file(path.string(), path.string());
  std::ifstream f(path);
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    problems.push_back(path.string() + ": not a JSON object; left out");
    return nullptr;
  }
  return j;
}

// A metrics.jsonl's problems: the first kMaxListed in full, then how many more.
class Problems {
 public:
  explicit Problems(std::vector<std::string>& out) : out_(out) {}
  void add(std::string sentence) {
    if (listed_++ < kMaxListed) out_.push_back(std::move(sentence));
  }
  void finish(const fs::path& path) {
    if (listed_ > kMaxListed) out_.push_back(fmt::format("{}: {} more problems like these, not listed", path.string(), listed_ - kMaxListed));
  }

 private:
  std::vector<std::string>& out_;
  size_t listed_ = 0;
};

enum class Kind { bad, training, evaluation };

// What a line is, noting why when it is neither row.
Kind kind_of_row(const json& row, const std::string& where, Problems* problems) {
  const char* why = nullptr;
  if (row.is_discarded()) why = "not JSON (cut short?)";
  else if (!row.is_object() || !row.contains("step") || !row["step"].is_number()) why = "no numeric \"step\"";
  else if (row.contains("loss")) return Kind::training;
  else if (row.contains("val_loss")) return Kind::evaluation;
  else why = "neither \"loss\" nor \"val_loss\"";
  if (problems) problems->add(fmt::format("{}: {}; skipped", where, why));
  return Kind::bad;
}

void note_type_problems(const json& row, Kind kind, const std::string& where, Problems& problems) {
  std::vector<std::string> found;
  if (kind == Kind::evaluation) {
    found = type_problems(row, {"val_loss"}, "", {}, where);
  } else {
    found = type_problems(row, kDrawn, "mem", memory_keys(), where);
    if (row.contains("skipped") && !row["skipped"].is_boolean() && !row["skipped"].is_null())
      found.push_back(fmt::format("{}: \"skipped\" is {}, not true or false; not marked", where, quoted(row["skipped"])));
  }
  for (auto& p : found) problems.add(std::move(p));
}

SeriesBuilder& by_step(RunData& run, const std::string& key) {
  return run.by_step.try_emplace(key, key == "grad_norm").first->second;  // drawn on a log axis
}

void add_training_row(RunData& run, json row) {
  const double x = number(row, "step") + 1;
  for (const std::string& key : kDrawn) by_step(run, key).add(x, number(row, key.c_str()));
  for (const std::string& key : memory_keys()) by_step(run, "mem." + key).add(x, number(row, "mem", key.c_str()));
  const double tokens = number(row, "tokens_per_s") * number(row, "step_ms") * 1e-3;
  if (std::isfinite(tokens)) {
    run.tokens += std::round(tokens);  // a step's tokens are a whole number
    run.loss_by_tokens.add(run.tokens, number(row, "loss"));
  }
  for (const std::string& key : kStatistics) run.samples[key].add(number(row, key.c_str()));
  const auto skipped = row.find("skipped");
  if (skipped != row.end() && skipped->is_boolean() && skipped->get<bool>()) {
    if (run.skipped_at.size() < kMaxMarked) run.skipped_at.push_back(x);
    ++run.skipped;
  }
  run.moe = run.moe || row.contains("aux_loss");
  const double mem = number(row, "mem", "total");
  if (std::isfinite(mem) && !(number(run.peak_step, "mem", "total") >= mem)) run.peak_step = row;
  const double step_ms = number(row, "step_ms");
  if (run.steps > 0 && std::isfinite(step_ms) && !(number(run.slowest_step, "step_ms") >= step_ms)) run.slowest_step = row;
  ++run.steps;
  run.last_step = std::move(row);
}

void add_evaluation_row(RunData& run, json row) {
  run.val_loss.add(number(row, "step"), number(row, "val_loss"));
  run.last_eval = std::move(row);
}

// Reads up to `max_lines` lines (-1: all), handing each non-empty one to `take(line_no, line)`;
// returns the lines read. One line at a time: memory does not grow with the file.
template <class Take>
int64_t for_each_line(const fs::path& path, int64_t max_lines, Take take) {
  std::ifstream f(path);
  std::string line;
  int64_t line_no = 0;
  while ((max_lines < 0 || line_no < max_lines) && std::getline(f, line)) {
    ++line_no;
    if (!line.empty()) take(line_no, line);
  }
  return line_no;
}

// A later row of a step already seen means the run went back to it (a restart that kept the log):
// the rows from that step on are the old timeline's and give way, so the run is one curve. Which
// training rows stay (each one below every later step); empty when all do.
std::vector<bool> rows_kept(const std::vector<double>& steps) {
  std::vector<bool> kept(steps.size(), true);
  bool any_superseded = false;
  double later = std::numeric_limits<double>::infinity();
  for (size_t i = steps.size(); i-- > 0;) {
    kept[i] = steps[i] < later;
    any_superseded = any_superseded || !kept[i];
    later = std::min(later, steps[i]);
  }
  return any_superseded ? kept : std::vector<bool>{};
}

void read_metrics(const fs::path& path, RunData& run) {
  Problems problems(run.problems);
  std::vector<double> steps;  // of the training rows, to find what a restart superseded
  const int64_t lines = for_each_line(path, -1, [&](int64_t line_no, const std::string& line) {
    json row = json::parse(line, nullptr, false);
    const std::string where = fmt::format("{} line {}", path.string(), line_no);
    const Kind kind = kind_of_row(row, where, &problems);
    if (kind == Kind::bad) return;
    note_type_problems(row, kind, where, problems);
    if (kind == Kind::evaluation) return add_evaluation_row(run, std::move(row));
    steps.push_back(number(row, "step"));
    add_training_row(run, std::move(row));
  });
  problems.finish(path);
  const std::vector<bool> kept = rows_kept(steps);
  if (kept.empty()) return;
  // Rare (a restart over logged steps): read again, drawing only the rows that stay.
  RunData again;
  again.dir = run.dir, again.name = run.name, again.problems = std::move(run.problems);
  run = std::move(again);
  size_t training = 0;
  for_each_line(path, lines, [&](int64_t, const std::string& line) {
    json row = json::parse(line, nullptr, false);
    const Kind kind = kind_of_row(row, "", nullptr);
    if (kind == Kind::evaluation) add_evaluation_row(run, std::move(row));
    if (kind == Kind::training && training < kept.size() && kept[training++]) add_training_row(run, std::move(row));
  });
}

}  // namespace

void Sample::add(double v) {
  if (rows_++ == 0) {
    first_ = v, first_finite_ = std::isfinite(v);
    return;
  }
  if (!std::isfinite(v)) return;
  lo_ = std::min(lo_, v), hi_ = std::max(hi_, v);
  if (finite_++ % stride_ != 0) return;
  kept_.push_back(v);
  if (kept_.size() <= kMaxKept) return;
  size_t n = 0;
  for (size_t i = 0; i < kept_.size(); i += 2) kept_[n++] = kept_[i];
  kept_.resize(n);
  stride_ *= 2;
}

std::vector<double> Sample::values() const {
  if (rows_ > 1) return kept_;
  return first_finite_ ? std::vector<double>{first_} : std::vector<double>{};
}

double Sample::min() const {
  if (rows_ > 1) return finite_ ? lo_ : kNaN;
  return first_finite_ ? first_ : kNaN;
}

double Sample::max() const {
  if (rows_ > 1) return finite_ ? hi_ : kNaN;
  return first_finite_ ? first_ : kNaN;
}

std::vector<double> Sample::all_values() const {
  std::vector<double> v = kept_;
  if (first_finite_) v.insert(v.begin(), first_);
  return v;
}

void require_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || st.type() == fs::file_type::not_found || st.type() == fs::file_type::regular) return;
  throw std::runtime_error(fmt::format("report: {}: not a regular file ({}); the report reads regular files only", what,
                                       kind_of(st.type())));
}

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

std::string text(const json& obj, const char* key, const std::string& fallback) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  const json& v = obj[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

std::vector<std::string> type_problems(const json& obj, const std::vector<std::string>& keys, const std::string& outer,
                                       const std::vector<std::string>& inner, const std::string& where) {
  std::vector<std::string> out;
  if (!obj.is_object()) return out;
  auto check = [&](const json& v, const std::string& name) {
    if (!v.is_number() && !v.is_null()) out.push_back(fmt::format("{}: \"{}\" is {}, not a number; left out", where, name, quoted(v)));
  };
  for (const std::string& k : keys)
    if (const auto it = obj.find(k); it != obj.end()) check(*it, k);
  const auto nested = outer.empty() ? obj.end() : obj.find(outer);
  if (nested == obj.end() || nested->is_null()) return out;
  if (!nested->is_object()) {
    out.push_back(fmt::format("{}: \"{}\" is {}, not an object; left out", where, outer, quoted(*nested)));
    return out;
  }
  for (const std::string& k : inner)
    if (const auto it = nested->find(k); it != nested->end()) check(*it, outer + "." + k);
  return out;
}

RunData load_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw std::runtime_error("report: " + dir + ": no such directory");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error("report: " + dir + ": not a directory (give a run directory, train's --out)");
  const fs::path d(dir);
  if (!fs::exists(d / "metrics.jsonl") && !fs::exists(d / "run.json"))
    throw std::runtime_error("report: " + dir + ": not a shardlm run directory (no metrics.jsonl or run.json; give train's --out)");
  for (const char* file : {"metrics.jsonl", "run_info.json", "run.json"}) require_regular_file((d / file).string(), (d / file).string());
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
