// Stop signals are taken on a thread of their own, never on a compute thread: oneDNN's JIT GEMMs
// move the stack pointer into their heap workspace, and a handler run there at that moment wrote
// its frame over the heap (a stopped run aborted with "corrupted size vs. prev_size" about once
// in a hundred). Each case runs in a fresh process (a death test re-executes the binary), as
// route_stop_signals must come before any thread.
#include <gtest/gtest.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kernels/cpu.h"
#include "train/guard.h"

namespace shardlm::train {
namespace {

thread_local bool t_computes = false;
std::atomic<long> g_taken{0};
std::atomic<long> g_on_compute_thread{0};

void count(int) {
  g_taken.fetch_add(1);
  if (t_computes) g_on_compute_thread.fetch_add(1);
}

// Exit status: 0, or what went wrong (a handler on a compute thread, no signal taken, a wrong
// product). Without the routing the storm's handlers land on the GEMM threads, and often the
// heap is corrupted first (abort).
[[noreturn]] void storm_during_gemms() {
  route_stop_signals();
  kernels::init_compute(2);
#pragma omp parallel num_threads(2)
  t_computes = true;
  struct sigaction sa = {};
  sa.sa_handler = count;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  std::atomic<bool> done{false};
  std::thread sender([&done] {
    while (!done) ::kill(::getpid(), SIGTERM);
  });
  const int64_t M = 64, N = 256, K = 64;  // tiny's MLP in its backward
  bool right = true;
  for (int it = 0; it < 4000 && right; ++it) {
    std::vector<float> a(M * K, 1.0f), b(K * N, 1.0f), c(M * N, 0.0f);
    std::vector<char> neighbour(100 + it % 900);  // small blocks around the GEMM's workspace
    kernels::matmul(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
    for (float v : c) right = right && v == static_cast<float>(K);
  }
  done = true;
  sender.join();
  std::_Exit(g_on_compute_thread > 0 ? 2 : g_taken == 0 ? 3 : !right ? 4 : 0);
}

TEST(StopSignalsDeathTest, AStormDuringGemmsIsTakenOffTheComputeThreads) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(storm_during_gemms(), ::testing::ExitedWithCode(0), "");
}

// Outside a StopSignals' life the signals do what they did before: the default ends the process
// by the signal, an ignored one stays ignored.
[[noreturn]] void term_by_default() {
  route_stop_signals();
  ::kill(::getpid(), SIGTERM);
  for (;;) pause();
}

// A SIGTERM handled after the SIGINT marks that the signal thread has acted on it: of two
// pending signals sigwaitinfo takes the lower-numbered first, and acts on one before the next.
[[noreturn]] void ignored_int_then_exit() {
  signal(SIGINT, SIG_IGN);
  struct sigaction sa = {};
  sa.sa_handler = count;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  route_stop_signals();
  ::kill(::getpid(), SIGINT);
  ::kill(::getpid(), SIGTERM);
  for (int i = 0; i < 10000 && g_taken == 0; ++i) usleep(1000);
  std::_Exit(g_taken > 0 ? 0 : 6);
}

TEST(StopSignalsDeathTest, OutsideARunTheyKeepTheirDispositions) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(term_by_default(), ::testing::KilledBySignal(SIGTERM), "");
  EXPECT_EXIT(ignored_int_then_exit(), ::testing::ExitedWithCode(0), "");
}

// Within one: the first signal is a request (the flag), a second ends the process by it.
[[noreturn]] void two_signals_in_a_run() {
  route_stop_signals();
  const StopSignals signals;
  ::kill(::getpid(), SIGINT);
  for (int i = 0; i < 1000 && StopSignals::pending() == 0; ++i) usleep(1000);
  if (StopSignals::pending() != SIGINT) std::_Exit(5);
  ::kill(::getpid(), SIGTERM);
  for (;;) pause();
}

TEST(StopSignalsDeathTest, InARunTheFirstIsARequestAndTheSecondEndsIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(two_signals_in_a_run(), ::testing::KilledBySignal(SIGTERM), "");
}

}  // namespace
}  // namespace shardlm::train
