// The handle of an asynchronous collective (c10d's Work): test it without blocking, or wait for
// it with a timeout. Every collective of a Communicator returns one.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/options.h"

namespace shardlm::comm {

// A communication failure: misuse (bad arguments, unsupported dtype) or an error MPI returned.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A collective did not finish in time. what() is one line naming the collective, the caller's
// label, the rank, the timeout and, where the algorithm can tell, the (world) ranks whose messages
// have not come or whose receives of this rank's messages have not been posted — the ones that
// stalled, as far as this rank can tell, e.g.
//   comm timeout: all_gather "all_gather unit h.3 step 7" on rank 1 of 4 (mpi) did not complete
//   within 5000 ms; still waiting for rank 3
class TimeoutError : public Error {
 public:
  TimeoutError(const std::string& collective, const std::string& label, int rank, int size,
               const std::string& backend, std::chrono::milliseconds timeout,
               std::vector<int> waiting_for = {});
  const std::string& collective() const { return collective_; }
  const std::string& label() const { return label_; }
  int rank() const { return rank_; }
  // World ranks this rank was still waiting for (empty: the algorithm cannot tell).
  const std::vector<int>& waiting_for() const { return waiting_for_; }

 private:
  std::string collective_, label_;
  int rank_;
  std::vector<int> waiting_for_;
};

// Thread safety: is_completed() and wait() may be called from any thread, also concurrently;
// a Work is tested by one thread at a time (MPI forbids two threads testing one request).
// Once is_completed() returned true or wait() returned, the receive buffers hold the result and
// the send buffers may be reused, in the calling thread (the completion is a release/acquire).
//
// Lifetime: the buffers given to a collective must stay alive until it completes. A Work may be
// dropped before it completes; the collective still finishes (it keeps being progressed by the
// backend), but then nothing tells the caller when its buffers are free. After a TimeoutError
// the collective is still pending: wait again, or end the job (abort_job).
class Work {
 public:
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Advances the collective (one MPI test) and says whether it has finished. Never blocks: if
  // another thread is testing this Work at the moment, answers from the last known state.
  // Throws the collective's error (below) once it has failed.
  bool is_completed();

  // Tests until the collective has finished (see WaitPolicy for how), or throws TimeoutError
  // once `timeout` has passed. An error the collective meets (one MPI returned, a peer's message
  // of the wrong length) ends it: it is thrown as comm::Error by this Work's wait() and
  // is_completed(), every time, and never by another Work that happened to progress this one.
  void wait(std::chrono::milliseconds timeout = kDefaultTimeout);

  const std::string& collective() const { return collective_; }
  const std::string& label() const { return label_; }
  int rank() const { return rank_; }

 protected:
  Work(std::string collective, std::string label, int rank, int size, std::string backend,
       WaitPolicy policy);
  // One progress step; returns true once complete. Called with the Work's mutex held, never
  // again after it returned true.
  virtual bool test() = 0;
  // The world ranks whose messages have not arrived, as far as this rank can tell (called with
  // the mutex held, after a timeout).
  virtual std::vector<int> waiting_for_locked() { return {}; }
  // What `other` is waiting for (its waiting_for_locked, under its own mutex): for a Work that
  // wraps another's (comm/staged.h), so its timeout names the same ranks.
  static std::vector<int> waiting_for_of(Work& other) {
    std::lock_guard<std::mutex> lock(other.mu_);
    return other.waiting_for_locked();
  }

 private:
  friend class ProgressRegistry;
  bool poll_locked();  // mu_ held; true once finished, failed included (never throws)
  bool try_poll();     // non-blocking: false if another thread holds mu_
  void rethrow_failure() const;  // after done_: the error the collective failed with, if any

  std::string collective_, label_, backend_;
  int rank_, size_;
  WaitPolicy policy_;
  std::mutex mu_;
  std::atomic<bool> done_{false};
  std::exception_ptr failure_;  // written before done_ is set
};

// A Work that was complete when it was made (single-rank copies, zero-sized collectives).
class CompletedWork final : public Work {
 public:
  CompletedWork(std::string collective, std::string label, int rank, int size,
                std::string backend)
      : Work(std::move(collective), std::move(label), rank, size, std::move(backend), {}) {}

 protected:
  bool test() override { return true; }
};

}  // namespace shardlm::comm
