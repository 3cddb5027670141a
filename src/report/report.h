// `shardlm report`: one self-contained HTML page about a training run — loss curves, throughput,
// memory against the plan, where a step's time went (from the trace), the simulator's prediction
// beside the measurement, other runs overlaid, and the run's configuration. No script and no
// network: plain HTML, CSS and inline SVG, so the page opens from a file anywhere.
#pragma once

#include <string>
#include <vector>

namespace shardlm::report {

struct ReportOptions {
  std::string run_dir;
  std::string out;                   // "" : RUN_DIR/report.html
  std::vector<std::string> compare;  // other run directories, overlaid
  std::string simulated;             // `shardlm simulate --json` output, "" : none
  std::vector<std::string> traces;   // Chrome traces; none given: the one run_info.json names, or RUN_DIR/trace.json
  bool overwrite = false;            // replace an existing `out` that is not a report (or is a link)
};

// The page. Throws std::runtime_error (one line) only when a run directory holds no run at all;
// anything missing or damaged inside one is reported in the page.
std::string render_report(const ReportOptions& opt);
// Renders and writes the page (replace_file: a temporary file of its own renamed into place, so a
// reader never sees half a page and writers never collide); returns its path. Refuses, with one
// line and before writing anything, an `out` that is a directory, a file the report reads (by
// identity: links and other spellings of the name too), a path inside a checkpoint, or an existing
// file that is not a report (a page the report wrote carries a marker) unless `overwrite`.
// Throws one line naming the file when it cannot be written.
std::string write_report(const ReportOptions& opt);

}  // namespace shardlm::report
