// Ways a run ends early, decided identically on every rank so that all ranks stop at the same
// step: a step whose loss or gradient norm went non-finite (the executor has already left the
// parameters untouched), and a stop signal (SIGINT / SIGTERM / SIGUSR1) received by any rank.
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

// Call first in main, before any thread exists: SIGINT, SIGTERM and SIGUSR1 are then blocked in every
// thread the process makes, and one thread that runs no kernels takes them and does what their
// disposition says (runs the handler, ends the process by the signal, or drops an ignored one).
// Why: oneDNN's JIT GEMM kernels move the stack pointer into their heap workspace while they run,
// so a handler run on a compute thread at that moment writes its signal frame over the heap
// (seen as "corrupted size vs. prev_size" a few steps later). Any handler added later must be for
// a signal routed here too.
void route_stop_signals();

// While alive, SIGINT, SIGTERM and SIGUSR1 only set a flag (the step in progress finishes); a second
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
