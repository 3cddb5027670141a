#include "run/stream_runner.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace shardlm::run {

namespace {

using Clock = std::chrono::steady_clock;
using Lane = kernels::Backend::Lane;

// What the streams share: runs finished per task, the copy stream's marks, the first failure.
class Streams {
 public:
  Streams(const plan::Plan& plan, const kernels::Backend& backend, const TaskBody& body)
      : plan_(plan), backend_(backend), body_(body), done_(plan.tasks.size(), 0), marks_(plan.tasks.size()) {
    copy_stream_ = static_cast<int>(std::find(plan.streams.begin(), plan.streams.end(), "copy") - plan.streams.begin());
  }

  void run(int stream) {
    for (plan::StreamWalk walk(plan_, stream); !walk.done(); walk.next()) {
      const plan::Task& task = plan_.tasks[walk.task()];
      const double waited = wait_deps(task, walk.run());
      if (waited < 0) return;
      if (stream != copy_stream_) wait_for_copies(task, walk.run());
      body_(task, plan_.step_micro(task, walk.run()), waited);
      finish(task, stream);
    }
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = e;
    stop_ = true;
    cv_.notify_all();
  }
  std::exception_ptr failure() const { return failure_; }

 private:
  // Waits for a task's dependencies; returns ms spent waiting (-1: the run stopped).
  double wait_deps(const plan::Task& task, int64_t run) {
    const auto t0 = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    for (int dep : task.deps) {
      const plan::Plan::Wait w = plan_.wait_for(task, run, dep);
      cv_.wait(lock, [&] { return done_[w.task] >= w.runs || stop_; });
      if (stop_) return -1.0;
    }
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }

  // The copy stream's tasks run on the backend's copy lane: what reads their result waits for
  // their mark, recorded as each ends (the latest run's, which covers the earlier ones).
  void wait_for_copies(const plan::Task& task, int64_t run) {
    for (int dep : task.deps) {
      const plan::Plan::Wait w = plan_.wait_for(task, run, dep);
      if (plan_.tasks[w.task].stream != copy_stream_) continue;
      kernels::Backend::Mark m;
      {
        std::lock_guard<std::mutex> lock(mu_);
        m = marks_[w.task];
      }
      backend_.wait(Lane::compute, m);
    }
  }

  void finish(const plan::Task& task, int stream) {
    if (stream == copy_stream_) {
      kernels::Backend::Mark m = backend_.mark(Lane::copy);
      std::lock_guard<std::mutex> lock(mu_);
      marks_[task.id] = std::move(m);
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++done_[task.id];
    cv_.notify_all();
  }

  const plan::Plan& plan_;
  const kernels::Backend& backend_;
  const TaskBody& body_;
  int copy_stream_;
  std::vector<int64_t> done_;
  std::vector<kernels::Backend::Mark> marks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr failure_;
  bool stop_ = false;
};

}  // namespace

void run_streams(const plan::Plan& plan, const kernels::Backend& backend, const TaskBody& body) {
  Streams streams(plan, backend, body);
  std::vector<std::thread> others;
  for (int s = 1; s < static_cast<int>(plan.streams.size()); ++s)
    others.emplace_back([&, s] {
      try {
        // These threads only cast for bf16 collectives: one OpenMP thread, so they never compete
        // with the compute stream's pool; denormals flushed as on every compute thread.
        backend.init_compute(1);
        streams.run(s);
      } catch (...) {
        streams.fail(std::current_exception());
      }
    });
  try {
    streams.run(plan::kCompute);
  } catch (...) {
    streams.fail(std::current_exception());
  }
  for (auto& t : others) t.join();
  if (streams.failure()) std::rethrow_exception(streams.failure());
}

}  // namespace shardlm::run
