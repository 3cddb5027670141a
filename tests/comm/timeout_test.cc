// A rank that skips a collective: the others' wait(short timeout) throws TimeoutError naming the
// collective, the label and the rank. The skipping rank then joins late, after the others have
// caught the error (they tell it so through a second communicator), so every rank finishes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "comm/mpi_backend.h"
#include "comm/test_util.h"

namespace shardlm::comm {
namespace {

using testing::test_memory;
using testing::kTestTimeout;

struct TimeoutCase {
  const char* collective;
  Algorithm algo;
};

class TimeoutTest : public ::testing::TestWithParam<TimeoutCase> {};

std::shared_ptr<Work> issue(Communicator& c, const std::string& which, std::vector<float>& a,
                            std::vector<float>& b, const std::string& label) {
  const int64_t n = 4096;
  if (which == "all_reduce") return c.all_reduce(a.data(), n * c.size(), DType::fp32, label);
  if (which == "all_gather") return c.all_gather(a.data(), b.data(), n, DType::fp32, label);
  if (which == "reduce_scatter") return c.reduce_scatter(a.data(), b.data(), n, DType::fp32, label);
  if (which == "all_to_all") return c.all_to_all(a.data(), b.data(), n, DType::fp32, label);
  if (which == "all_to_all_v") {  // uneven, and nothing at all to the last rank
    std::vector<int64_t> counts(c.size());
    for (int j = 0; j < c.size(); ++j) counts[j] = j == c.size() - 1 ? 0 : n - j;
    const std::vector<int64_t> recv_counts(c.size(), c.rank() == c.size() - 1 ? 0 : n - c.rank());
    return c.all_to_all_v(a.data(), counts, packed_displs(counts), b.data(), recv_counts, packed_displs(recv_counts),
                          DType::fp32, label);
  }
  if (which == "broadcast") return c.broadcast(a.data(), n, DType::fp32, c.size() - 1, label);
  return c.barrier(label);
}

TEST_P(TimeoutTest, SkippedCollectiveTimesOutWithItsName) {
  const TimeoutCase tc = GetParam();
  MpiOptions o;
  o.all_gather = o.reduce_scatter = o.all_reduce = o.all_to_all = o.broadcast = tc.algo;
  MpiCommunicator comm(test_memory(), o);
  MpiCommunicator signal(test_memory());  // a second channel, free of the pending collective
  const int n = comm.size(), r = comm.rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const int skipper = n - 1;
  std::vector<float> a(4096 * n, 1.0f), b(4096 * n, 0.0f);
  const std::string label = std::string(tc.collective) + " unit h.3 step 7";

  if (r != skipper) {
    auto w = issue(comm, tc.collective, a, b, label);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w->wait(std::chrono::milliseconds(300));
      ADD_FAILURE() << "wait returned although rank " << skipper << " never joined";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(tc.collective), std::string::npos) << what;
      EXPECT_NE(what.find(label), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + std::to_string(r) + " of " + std::to_string(n)), std::string::npos) << what;
      EXPECT_NE(what.find("300 ms"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
      EXPECT_EQ(e.collective(), tc.collective);
      EXPECT_EQ(e.label(), label);
      EXPECT_EQ(e.rank(), r);
      if (std::string(tc.collective) == "all_to_all_v" && tc.algo == Algorithm::direct) {
        const auto& missing = e.waiting_for();  // direct knows whose message has not come
        EXPECT_NE(std::find(missing.begin(), missing.end(), skipper), missing.end()) << what;
      }
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 0.3);
    EXPECT_LT(waited, 10.0);
    EXPECT_FALSE(w->is_completed());
    signal.barrier("caught")->wait(kTestTimeout);
    w->wait(kTestTimeout);  // the skipper has joined: it completes now
  } else {
    signal.barrier("caught")->wait(kTestTimeout);
    issue(comm, tc.collective, a, b, label)->wait(kTestTimeout);
  }
  comm.barrier("after")->wait(kTestTimeout);
}

INSTANTIATE_TEST_SUITE_P(
    Collectives, TimeoutTest,
    ::testing::Values(TimeoutCase{"all_reduce", Algorithm::native}, TimeoutCase{"all_reduce", Algorithm::direct},
                      TimeoutCase{"all_reduce", Algorithm::ring}, TimeoutCase{"all_gather", Algorithm::direct},
                      TimeoutCase{"all_gather", Algorithm::native}, TimeoutCase{"reduce_scatter", Algorithm::direct},
                      TimeoutCase{"reduce_scatter", Algorithm::native}, TimeoutCase{"all_to_all", Algorithm::direct},
                      TimeoutCase{"all_to_all_v", Algorithm::direct}, TimeoutCase{"all_to_all_v", Algorithm::native},
                      TimeoutCase{"broadcast", Algorithm::native}, TimeoutCase{"broadcast", Algorithm::direct},
                      TimeoutCase{"barrier", Algorithm::native}),
    [](const ::testing::TestParamInfo<TimeoutCase>& i) {
      return std::string(i.param.collective) + "_" + to_string(i.param.algo);
    });

}  // namespace
}  // namespace shardlm::comm
