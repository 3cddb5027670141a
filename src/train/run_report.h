// What a run records for its report (DIR/run_info.json) and the report's refresh (DIR/report.html,
// report/report.h), both on rank 0. run_info.json holds what metrics.jsonl cannot: each start's
// command line and step, the commit the binary was built at, the machine, the settings and the
// plan's predicted memory per rank, and where the trace goes.
#pragma once

#include <cstdint>
#include <string>

#include "plan/plan.h"
#include "train/config.h"

namespace shardlm::train {

struct RunInfo {
  int ranks = 1;
  int64_t start_step = 0;  // 0, or the step a resume starts at
  double peak_gflops = 0;  // what MFU is measured against
  int64_t tokens_per_step = 0;
};

// Writes DIR/run_info.json (through a temporary file and a rename), keeping the starts an earlier
// run_info.json of this directory recorded before `info.start_step` (a resume adds its own). The
// file serves only the report: a failure is one warning line on stderr, and training goes on.
void write_run_info(const TrainConfig& cfg, const plan::Plan& plan, const RunInfo& info);
// The same, throwing one line naming the file.
void write_run_info_or_throw(const TrainConfig& cfg, const plan::Plan& plan, const RunInfo& info);

// Rewrites DIR/report.html unless --no-report. A report that cannot be written does not stop
// training: it is one warning line on stderr (the run's metrics are intact).
void refresh_report(const TrainConfig& cfg);

}  // namespace shardlm::train
