// What a run directory holds, read for the report: metrics.jsonl's rows (training steps and
// evaluations), run_info.json (command line, commit, machine, the plan's memory) and run.json.
// metrics.jsonl is streamed a line at a time and reduced as it is read (each chart's series to a
// bounded number of points, each statistic to a bounded sample), so a run of a million steps
// costs about what one of a few thousand does. Reading never throws for damaged content: a line
// that is not JSON, a missing file or field, a value of the wrong type is recorded in `problems`
// and the page says so; a directory that holds no run, or an input that is not a regular file (a
// FIFO, a device: it could be read forever), throws.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "report/svg.h"

namespace shardlm::report {

// A field's values for its statistics (median, p10 – p90, min – max) over the steps after the
// first (it carries start-up), or the first alone when it is all. Every finite value is kept while
// there are at most kMaxKept, then every 2nd, 4th ... one: a deterministic thinning of the whole
// run whose quantiles stay the run's, in bounded memory. The count, min and max are exact.
class Sample {
 public:
  static constexpr size_t kMaxKept = size_t{1} << 16;
  void add(double v);
  std::vector<double> values() const;
  std::vector<double> all_values() const;  // the first step's too
  // The lowest and highest of the values (all of them, not the thinned ones); NaN when none.
  double min() const;
  double max() const;
  int64_t count() const { return rows_ > 1 ? finite_ : (first_finite_ ? 1 : 0); }  // the steps they stand for

 private:
  std::vector<double> kept_;
  double first_ = 0;
  bool first_finite_ = false;
  int64_t rows_ = 0, finite_ = 0, stride_ = 1;
  double lo_ = std::numeric_limits<double>::infinity(), hi_ = -std::numeric_limits<double>::infinity();
};

struct RunData {
  std::string dir;
  std::string name;  // the directory's last component, for legends
  int64_t steps = 0;  // training rows ("loss" present), a restart's superseded ones left out
  nlohmann::json last_step, last_eval;  // the last training and evaluation row; null: none
  nlohmann::json peak_step;             // the training row of the largest mem.total; null: none
  // The training row of the largest step_ms after the first (start-up); null: none. A straggler
  // (a slowed link, a busy host) shows here with the exposed communication it caused.
  nlohmann::json slowest_step;
  // Against steps done (a row's "step" + 1): each drawn field of the training rows by name,
  // "mem.CATEGORY" for memory ("mem.total" too).
  std::map<std::string, SeriesBuilder> by_step;
  SeriesBuilder loss_by_tokens;  // loss against the tokens trained up to the step
  SeriesBuilder val_loss;        // evaluations: val_loss against the steps done before them
  std::map<std::string, Sample> samples;  // the throughput fields' statistics, and expert_load_imbalance
  double tokens = 0;                      // tokens trained
  std::vector<double> skipped_at;         // steps done at skipped updates (the first kMaxMarked)
  int64_t skipped = 0;                    // skipped updates, all of them
  bool moe = false;                       // a row carries the routers' figures
  nlohmann::json info;                    // run_info.json, or null
  nlohmann::json identity;                // run.json, or null
  std::vector<std::string> problems;      // what could not be read, one sentence each
};

// The memory categories in the order the allocator lists them (tensor/memory.h); the report
// reads them by name from metrics.jsonl, so a category added there shows once listed here.
inline const std::vector<std::string> kMemCategories = {"params", "grads", "optimizer", "activations", "comm",
                                                        "workspace", "staging", "snapshot"};

// The most skipped updates marked on the charts (the summary counts them all).
inline constexpr size_t kMaxMarked = 500;

// Reads DIR. Throws std::runtime_error with one line when DIR does not exist, is not a directory,
// holds neither metrics.jsonl nor run.json (an empty directory, another tool's), or one of its
// files is not a regular file.
RunData load_run(const std::string& dir);

// Throws one line ("report: WHAT: not a regular file (a FIFO) ...") when PATH exists and is not a
// regular file (links followed); `what` names it as the user gave it (a flag, a path).
void require_regular_file(const std::string& path, const std::string& what);

// A number field of a row; NaN when absent or not a number (JSON null is how a NaN loss is written).
double number(const nlohmann::json& row, const char* key);
// A nested number (row[outer][inner]); NaN when absent.
double number(const nlohmann::json& row, const char* outer, const char* inner);
// A text field as text (another type as its JSON), `fallback` when absent.
std::string text(const nlohmann::json& obj, const char* key, const std::string& fallback);

// The problems of an object's number fields (`keys`, and `outer`.INNER for each of `inner`): one
// sentence each, "WHERE: "KEY" is VALUE, not a number"; absent and null fields are none.
std::vector<std::string> type_problems(const nlohmann::json& obj, const std::vector<std::string>& keys,
                                       const std::string& outer, const std::vector<std::string>& inner,
                                       const std::string& where);

}  // namespace shardlm::report
