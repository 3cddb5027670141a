// Collectives under MPI_THREAD_MULTIPLE, the way the executor uses them: a comm thread issues and
// waits while another thread computes and tests; communicators used from different threads at
// once; progress of one collective made by waiting on another. (Also the ThreadSanitizer target.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/mpi_backend.h"
#include "comm/test_util.h"

namespace shardlm::comm {
namespace {

using testing::test_memory;
using testing::kTestTimeout;
using testing::small_int;

// An in-order queue of tasks run by one thread, like the executor's comm stream.
class Stream {
 public:
  Stream() : t_([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    t_.join();
  }
  void push(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        f = std::move(q_.front());
        q_.pop_front();
      }
      f();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::thread t_;
};

// A flag one thread raises and another waits for (an executor's event).
struct Event {
  std::mutex mu;
  std::condition_variable cv;
  bool set = false;
  void raise() {
    {
      std::lock_guard<std::mutex> l(mu);
      set = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [this] { return set; });
  }
};

TEST(Threads, CommStreamGathersAndReducesWhileComputeRuns) {
  MpiCommunicator comm(test_memory());
  const int n = comm.size(), r = comm.rank();
  const int units = 6;
  const int64_t c = 50021;
  std::vector<std::vector<float>> shard(units, std::vector<float>(c)), full(units, std::vector<float>(n * c));
  std::vector<std::vector<float>> grad(units, std::vector<float>(n * c)), gshard(units, std::vector<float>(c));
  for (int u = 0; u < units; ++u)
    for (int64_t i = 0; i < c; ++i) shard[u][i] = small_int(r, i, u);
  std::vector<Event> gathered(units), reduced(units);
  std::atomic<double> sink{0};
  {
    Stream comm_stream;
    // Forward: the comm stream gathers every unit, one ahead of compute.
    for (int u = 0; u < units; ++u) {
      comm_stream.push([&, u] {
        comm.all_gather(shard[u].data(), full[u].data(), c, DType::fp32, "ag unit " + std::to_string(u))
            ->wait(kTestTimeout);
        gathered[u].raise();
      });
    }
    for (int u = 0; u < units; ++u) {
      gathered[u].wait();
      double s = 0;  // "compute" on the gathered unit, and make its gradient
      for (int64_t i = 0; i < n * c; ++i) {
        s += full[u][i];
        grad[u][i] = full[u][i] * 2;
      }
      sink = sink + s;
      comm_stream.push([&, u] {
        auto w = comm.reduce_scatter(grad[u].data(), gshard[u].data(), c, DType::fp32,
                                     "rs unit " + std::to_string(u));
        w->wait(kTestTimeout);
        reduced[u].raise();
      });
    }
    for (int u = 0; u < units; ++u) reduced[u].wait();
  }
  for (int u = 0; u < units; ++u)
    for (int64_t i = 0; i < c; ++i) {
      // grad block r on every rank = 2 · (rank r's shard), summed over n ranks.
      ASSERT_EQ(gshard[u][i], 2.0f * n * small_int(r, i, u)) << "unit " << u;
    }
}

TEST(Threads, ComputeThreadTestsWhileCommThreadWaits) {
  MpiCommunicator comm(test_memory());
  const int64_t c = 1 << 20;
  std::vector<float> buf(c);
  for (int64_t i = 0; i < c; ++i) buf[i] = small_int(comm.rank(), i);
  for (int rep = 0; rep < 4; ++rep) {
    auto w = comm.all_reduce(buf.data(), c, DType::fp32, "ar rep " + std::to_string(rep));
    std::thread waiter([&] { w->wait(kTestTimeout); });
    while (!w->is_completed()) std::this_thread::yield();
    waiter.join();
  }
  float want = 0;
  for (int q = 0; q < comm.size(); ++q) want += small_int(q, 5);
  const float scale = static_cast<float>(std::pow(comm.size(), 3));
  EXPECT_EQ(buf[5], want * scale);
}

TEST(Threads, CommunicatorsOnSeparateThreads) {
  MpiCommunicator a(test_memory()), b(test_memory());  // made in the same order on every rank
  const int n = a.size();
  auto body = [n](MpiCommunicator& comm, int salt) {
    const int64_t c = 30011;
    for (int it = 0; it < 10; ++it) {
      std::vector<float> v(c);
      for (int64_t i = 0; i < c; ++i) v[i] = small_int(comm.rank(), i, salt + it);
      comm.all_reduce(v.data(), c, DType::fp32, "threaded ar")->wait(kTestTimeout);
      for (int64_t i = 0; i < c; i += 101) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += small_int(q, i, salt + it);
        if (v[i] != want) return false;
      }
    }
    return true;
  };
  bool ok_a = false, ok_b = false;
  std::thread ta([&] { ok_a = body(a, 0); });
  std::thread tb([&] { ok_b = body(b, 100); });
  ta.join();
  tb.join();
  EXPECT_TRUE(ok_a);
  EXPECT_TRUE(ok_b);
}

TEST(Threads, WaitingOnOneCollectiveProgressesTheOthers) {
  // Two point-to-point collectives in flight, waited on in opposite orders by even and odd
  // ranks, with small chunks so each needs many rounds. Without shared progress each rank would
  // sit on the collective its peer is not driving.
  MpiOptions o;
  o.reduce_scatter = o.all_gather = Algorithm::ring;
  o.chunk_bytes = 4096;
  o.window = 2;
  MpiCommunicator comm(test_memory(), o);
  const int n = comm.size(), r = comm.rank();
  const int64_t c = 200003;
  std::vector<float> send(n * c), rs(c), mine(c), ag(n * c);
  for (int64_t i = 0; i < n * c; ++i) send[i] = small_int(r, i);
  for (int64_t i = 0; i < c; ++i) mine[i] = small_int(r, i, 1);
  auto w1 = comm.reduce_scatter(send.data(), rs.data(), c, DType::fp32, "rs");
  auto w2 = comm.all_gather(mine.data(), ag.data(), c, DType::fp32, "ag");
  if (r % 2 == 0) {
    w1->wait(kTestTimeout);
    w2->wait(kTestTimeout);
  } else {
    w2->wait(kTestTimeout);
    w1->wait(kTestTimeout);
  }
  for (int64_t i = 0; i < c; ++i) {
    float want = 0;
    for (int q = 0; q < n; ++q) want += small_int(q, r * c + i);
    ASSERT_EQ(rs[i], want);
  }
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(ag[q * c + i], small_int(q, i, 1));
}

TEST(Threads, DroppedWorkStillCompletes) {
  MpiOptions o;
  o.reduce_scatter = Algorithm::direct;
  o.chunk_bytes = 4096;
  MpiCommunicator comm(test_memory(), o);
  const int n = comm.size(), r = comm.rank();
  const int64_t c = 100003;
  std::vector<float> send(n * c), out(c, -1000.0f);
  for (int64_t i = 0; i < n * c; ++i) send[i] = small_int(r, i);
  comm.reduce_scatter(send.data(), out.data(), c, DType::fp32, "dropped");  // handle dropped
  auto finished = [&] {
    for (int64_t i = 0; i < c; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += small_int(q, r * c + i);
      if (out[i] != want) return 0;
    }
    return 1;
  };
  // Waiting on other collectives drives the dropped one to completion.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int all_done = 0;
  while (!all_done && std::chrono::steady_clock::now() < deadline) {
    comm.barrier("drive")->wait(kTestTimeout);
    int done = finished();
    MPI_Allreduce(&done, &all_done, 1, MPI_INT, MPI_MIN, comm.mpi_comm());
  }
  EXPECT_TRUE(all_done);
}

}  // namespace
}  // namespace shardlm::comm
