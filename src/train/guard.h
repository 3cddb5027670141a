// Ways a run ends early, decided identically on every rank so that all ranks stop at the same
// step: a step whose loss or gradient norm went non-finite (the executor has already left the
// parameters untouched), and a stop signal (SIGINT / SIGTERM) received by any rank.
#pragma once

#include <cstdint>
#include <string>

#include "run/executor.h"

namespace shardlm::train {

// The exit status of a run stopped by a non-finite step (a signal gives 128 + its number).
inline constexpr int kNonFiniteExitCode = 3;

// --on-nonfinite: `stop` ends the run at the first non-finite step; `skip` drops that step's
// update (as a loss scaler does) and ends the run after `max_skipped` such steps in a row.
class NonFiniteGuard {
 public:
  NonFiniteGuard(const std::string& mode, int64_t max_skipped) : skip_(mode == "skip"), max_skipped_(max_skipped) {}
  // Counts the step; returns the one-line reason to stop the run, or "" to go on.
  std::string after_step(int64_t step, const run::StepResult& r);
  int64_t skipped_total() const { return total_; }
  int64_t skipped_in_a_row() const { return in_a_row_; }

 private:
  bool skip_;
  int64_t max_skipped_, total_ = 0, in_a_row_ = 0;
};

// "step 3: non-finite loss on rank 1, non-finite gradient norm on ranks 0, 1"
std::string describe_nonfinite(int64_t step, const run::StepResult& r);

// While alive, SIGINT and SIGTERM only set a flag (the step in progress finishes); a second
// signal ends the process at once. The previous handlers come back on destruction.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received, or 0.
  static int pending();
};

}  // namespace shardlm::train
