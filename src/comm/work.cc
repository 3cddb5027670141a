#include "comm/work.h"

#include <algorithm>
#include <sstream>
#include <thread>

namespace shardlm::comm {

namespace {
std::string timeout_message(const std::string& collective, const std::string& label, int rank,
                            int size, const std::string& backend,
                            std::chrono::milliseconds timeout, const std::vector<int>& waiting_for) {
  std::ostringstream os;
  os << "comm timeout: " << collective << " \"" << label << "\" on rank " << rank << " of "
     << size << " (" << backend << ") did not complete within " << timeout.count() << " ms";
  for (size_t i = 0; i < waiting_for.size(); ++i)
    os << (i == 0 ? (waiting_for.size() == 1 ? "; still waiting for rank " : "; still waiting for ranks ") : ", ")
       << waiting_for[i];
  return os.str();
}
}  // namespace

TimeoutError::TimeoutError(const std::string& collective, const std::string& label, int rank,
                           int size, const std::string& backend,
                           std::chrono::milliseconds timeout, std::vector<int> waiting_for)
    : Error(timeout_message(collective, label, rank, size, backend, timeout, waiting_for)),
      collective_(collective),
      label_(label),
      rank_(rank),
      waiting_for_(std::move(waiting_for)) {}

Work::Work(std::string collective, std::string label, int rank, int size, std::string backend,
           WaitPolicy policy)
    : collective_(std::move(collective)),
      label_(std::move(label)),
      backend_(std::move(backend)),
      rank_(rank),
      size_(size),
      policy_(policy) {}

bool Work::poll_locked() {
  if (done_.load(std::memory_order_acquire)) return true;
  bool finished = false;
  try {
    finished = test();
  } catch (...) {
    failure_ = std::current_exception();  // this Work's waiter reports it, not whoever polled
    finished = true;
  }
  if (finished) done_.store(true, std::memory_order_release);
  return finished;
}

void Work::rethrow_failure() const {
  if (failure_) std::rethrow_exception(failure_);
}

bool Work::try_poll() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return done_.load(std::memory_order_acquire);
  return poll_locked();
}

bool Work::is_completed() {
  if (!done_.load(std::memory_order_acquire) && !try_poll()) return false;
  rethrow_failure();
  return true;
}

void Work::wait(std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto sleep = std::chrono::microseconds(1);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (poll_locked()) {
        rethrow_failure();
        return;
      }
    }
    // Elapsed time in the timeout's unit, so that a huge timeout cannot overflow.
    const auto elapsed = clock::now() - start;
    if (std::chrono::duration_cast<std::chrono::milliseconds>(elapsed) >= timeout) {
      std::vector<int> missing;
      {
        std::lock_guard<std::mutex> lock(mu_);
        missing = waiting_for_locked();
      }
      throw TimeoutError(collective_, label_, rank_, size_, backend_, timeout, std::move(missing));
    }
    if (elapsed < policy_.spin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, policy_.max_sleep);
    }
  }
}

}  // namespace shardlm::comm
