#include "train/guard.h"

#include <atomic>
#include <csignal>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <iterator>
#include <pthread.h>
#include <thread>
#include <unistd.h>

namespace shardlm::train {

namespace {

std::string ranks_text(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

}  // namespace

std::string describe_nonfinite(int64_t step, const run::StepResult& r) {
  std::string s = fmt::format("step {}: ", step);
  if (!r.nonfinite_loss.empty()) s += "non-finite loss on " + ranks_text(r.nonfinite_loss);
  if (!r.nonfinite_loss.empty() && !r.nonfinite_grads.empty()) s += ", ";
  if (!r.nonfinite_grads.empty()) s += "non-finite gradient norm on " + ranks_text(r.nonfinite_grads);
  return s;
}

std::string NonFiniteGuard::after_step(int64_t step, const run::StepResult& r) {
  if (!r.nonfinite()) {
    in_a_row_ = 0;
    return "";
  }
  ++total_;
  ++in_a_row_;
  if (!skip_) return describe_nonfinite(step, r) + "; stopped before the optimizer applied it (--on-nonfinite stop)";
  if (in_a_row_ < max_skipped_) return "";
  return describe_nonfinite(step, r) + fmt::format("; {} updates skipped in a row (--max-skipped-steps {}): stopping",
                                                   in_a_row_, max_skipped_);
}

namespace {

std::atomic<int> g_signal{0};
// SIGUSR1: the signal Slurm's --signal=USR1@SECONDS sends ahead of a job's time limit (its default),
// which mpirun forwards to the ranks; its default action ends the process with nothing saved.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1};
struct sigaction g_old[std::size(kStopSignals)];

// Async-signal-safe: an atomic store, or for a second signal the default action re-raised.
void on_signal(int sig) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, sig)) return;
  std::signal(sig, SIG_DFL);
  ::raise(sig);
}

// On the signal thread, where `sig` is blocked: what its disposition would have done.
void act_on(int sig, siginfo_t& info) {
  struct sigaction now = {};
  sigaction(sig, nullptr, &now);
  if (now.sa_handler == SIG_IGN) return;
  if (now.sa_handler == SIG_DFL) {  // the process ends by the signal, as it would have
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
    return;
  }
  if (now.sa_flags & SA_SIGINFO) now.sa_sigaction(sig, &info, nullptr);
  else now.sa_handler(sig);  // on_signal's re-raise leaves the signal pending here: taken next
}

}  // namespace

void route_stop_signals() {
  sigset_t stop;
  sigemptyset(&stop);
  for (const int sig : kStopSignals) sigaddset(&stop, sig);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // inherited by every thread made from here on
  std::thread([stop] {
    for (;;) {
      siginfo_t info;
      if (const int sig = sigwaitinfo(&stop, &info); sig > 0) act_on(sig, info);
    }
  }).detach();
}

StopSignals::StopSignals() {
  g_signal = 0;
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking calls (file writes, MPI progress) carry on after the flag is set
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &sa, &g_old[i]);
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &g_old[i], nullptr);
}

int StopSignals::pending() { return g_signal.load(); }

}  // namespace shardlm::train
