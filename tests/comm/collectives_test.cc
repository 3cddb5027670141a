// Every collective of MpiCommunicator, with every algorithm, on fp32 and bf16, at the world size
// mpirun gave (the suite runs at N = 1, 2, 3 and 4), against the serial expectation.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "comm/mpi_backend.h"
#include "comm/test_util.h"

namespace shardlm::comm {
namespace {

using testing::test_memory;
using testing::decode;
using testing::encode;
using testing::kTestTimeout;
using testing::small_int;

struct Case {
  Algorithm algo;
  DType dtype;
  int64_t count;
  bool tiny_chunks;  // 256-byte chunks, window 3: many chunks in flight, slots reused
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(to_string(c.algo)) + "_" + to_string(c.dtype) + "_" + std::to_string(c.count) +
         (c.tiny_chunks ? "_tiny" : "");
}

std::vector<Case> cases(std::initializer_list<Algorithm> algos) {
  std::vector<Case> out;
  for (Algorithm a : algos) {
    for (DType d : {DType::fp32, DType::bf16}) {
      for (int64_t n : {int64_t(1), int64_t(7), testing::kLargeCount}) out.push_back({a, d, n, false});
      if (a == Algorithm::direct || a == Algorithm::ring) {
        for (int64_t n : {int64_t(7), int64_t(1000)}) out.push_back({a, d, n, true});
      }
    }
  }
  return out;
}

MpiOptions options_for(const Case& c) {
  MpiOptions o;
  o.all_gather = o.reduce_scatter = o.all_reduce = o.all_to_all = c.algo;
  if (c.tiny_chunks) {
    o.chunk_bytes = 256;
    o.window = 3;
  }
  return o;
}

class CollectiveTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    comm_ = std::make_unique<MpiCommunicator>(test_memory(), options_for(GetParam()));
    r_ = comm_->rank();
    n_ = comm_->size();
  }
  DType dtype() const { return GetParam().dtype; }
  int64_t count() const { return GetParam().count; }
  int64_t es() const { return dtype_size(dtype()); }
  std::unique_ptr<MpiCommunicator> comm_;
  int r_ = 0, n_ = 1;
};

class AllGatherTest : public CollectiveTest {};
class ReduceScatterTest : public CollectiveTest {};
class AllReduceTest : public CollectiveTest {};
class AllToAllTest : public CollectiveTest {};

TEST_P(AllGatherTest, GathersRankMajor) {
  const int64_t c = count();
  std::vector<float> mine(c);
  for (int64_t i = 0; i < c; ++i) mine[i] = small_int(r_, i);
  auto send = encode(mine, dtype());
  std::vector<uint8_t> recv(n_ * c * es(), 0xAB);
  comm_->all_gather(send.data(), recv.data(), c, dtype(), "ag test")->wait(kTestTimeout);
  auto got = decode(recv, dtype());
  for (int q = 0; q < n_; ++q)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(got[q * c + i], small_int(q, i)) << "rank " << q << " i " << i;
}

TEST_P(AllGatherTest, InPlace) {
  const int64_t c = count();
  std::vector<float> all(n_ * c, -99.0f);
  for (int64_t i = 0; i < c; ++i) all[r_ * c + i] = small_int(r_, i, 1);
  auto buf = encode(all, dtype());
  comm_->all_gather(buf.data() + r_ * c * es(), buf.data(), c, dtype(), "ag in place")->wait(kTestTimeout);
  auto got = decode(buf, dtype());
  for (int q = 0; q < n_; ++q)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(got[q * c + i], small_int(q, i, 1));
}

TEST_P(ReduceScatterTest, SumsOwnBlock) {
  const int64_t c = count();
  std::vector<float> mine(n_ * c);
  for (int64_t i = 0; i < n_ * c; ++i) mine[i] = small_int(r_, i);
  auto send = encode(mine, dtype());
  std::vector<uint8_t> recv(c * es(), 0xAB);
  comm_->reduce_scatter(send.data(), recv.data(), c, dtype(), "rs test")->wait(kTestTimeout);
  auto got = decode(recv, dtype());
  for (int64_t i = 0; i < c; ++i) {
    float want = 0;
    for (int q = 0; q < n_; ++q) want += small_int(q, r_ * c + i);
    ASSERT_EQ(got[i], want) << "i " << i;
  }
  // The send buffer is untouched.
  EXPECT_EQ(decode(send, dtype()), decode(encode(mine, dtype()), dtype()));
}

TEST_P(ReduceScatterTest, InPlace) {
  const int64_t c = count();
  std::vector<float> mine(n_ * c);
  for (int64_t i = 0; i < n_ * c; ++i) mine[i] = small_int(r_, i, 2);
  auto buf = encode(mine, dtype());
  comm_->reduce_scatter(buf.data(), buf.data() + r_ * c * es(), c, dtype(), "rs in place")->wait(kTestTimeout);
  auto got = decode(buf, dtype());
  for (int64_t i = 0; i < n_ * c; ++i) {
    float want = mine[i];
    if (i / c == r_) {
      want = 0;
      for (int q = 0; q < n_; ++q) want += small_int(q, i, 2);
    }
    ASSERT_EQ(got[i], want) << "i " << i;
  }
}

TEST_P(AllReduceTest, SumsInPlace) {
  const int64_t c = count();
  std::vector<float> mine(c);
  for (int64_t i = 0; i < c; ++i) mine[i] = small_int(r_, i, 3);
  auto buf = encode(mine, dtype());
  comm_->all_reduce(buf.data(), c, dtype(), "ar test")->wait(kTestTimeout);
  auto got = decode(buf, dtype());
  for (int64_t i = 0; i < c; ++i) {
    float want = 0;
    for (int q = 0; q < n_; ++q) want += small_int(q, i, 3);
    ASSERT_EQ(got[i], want) << "i " << i;
  }
}

TEST_P(AllToAllTest, ExchangesBlocks) {
  const int64_t c = count();
  std::vector<float> mine(n_ * c);
  for (int64_t i = 0; i < n_ * c; ++i) mine[i] = small_int(r_, i, 4);
  auto send = encode(mine, dtype());
  std::vector<uint8_t> recv(n_ * c * es(), 0xAB);
  comm_->all_to_all(send.data(), recv.data(), c, dtype(), "a2a test")->wait(kTestTimeout);
  auto got = decode(recv, dtype());
  for (int q = 0; q < n_; ++q)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(got[q * c + i], small_int(q, r_ * c + i, 4));
}

INSTANTIATE_TEST_SUITE_P(Algos, AllGatherTest,
                         ::testing::ValuesIn(cases({Algorithm::native, Algorithm::direct, Algorithm::ring,
                                                    Algorithm::automatic})),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Algos, ReduceScatterTest,
                         ::testing::ValuesIn(cases({Algorithm::native, Algorithm::direct, Algorithm::ring,
                                                    Algorithm::via_all_reduce, Algorithm::automatic})),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Algos, AllReduceTest,
                         ::testing::ValuesIn(cases({Algorithm::native, Algorithm::direct, Algorithm::ring,
                                                    Algorithm::automatic})),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Algos, AllToAllTest,
                         ::testing::ValuesIn(cases({Algorithm::native, Algorithm::direct, Algorithm::automatic})),
                         case_name);

// ---- Collectives with one algorithm only.

class MpiBasics : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = std::make_unique<MpiCommunicator>(test_memory());
    r_ = comm_->rank();
    n_ = comm_->size();
  }
  std::unique_ptr<MpiCommunicator> comm_;
  int r_ = 0, n_ = 1;
};

TEST(Broadcast, FromEveryRootWithEveryAlgorithm) {
  for (Algorithm a : {Algorithm::native, Algorithm::direct, Algorithm::automatic}) {
    MpiOptions o;
    o.broadcast = a;
    MpiCommunicator comm(test_memory(), o);
    const int n = comm.size(), r = comm.rank();
    for (DType d : {DType::fp32, DType::bf16}) {
      for (int root = 0; root < n; ++root) {
        for (int64_t c : {int64_t(1), int64_t(7), testing::kLargeCount}) {
          std::vector<float> v(c, -77.0f);
          if (r == root)
            for (int64_t i = 0; i < c; ++i) v[i] = small_int(root, i);
          auto buf = encode(v, d);
          comm.broadcast(buf.data(), c, d, root, "bcast test")->wait(kTestTimeout);
          auto got = decode(buf, d);
          for (int64_t i = 0; i < c; ++i) ASSERT_EQ(got[i], small_int(root, i)) << to_string(a) << " root " << root;
        }
      }
    }
  }
}

TEST_F(MpiBasics, BarrierCompletes) {
  for (int i = 0; i < 5; ++i) comm_->barrier("barrier test")->wait(kTestTimeout);
}

TEST_F(MpiBasics, SendRecvRing) {
  // Each rank sends its rank-stamped buffer to the right and receives from the left, twice with
  // different tags posted in opposite orders.
  if (n_ < 2) GTEST_SKIP() << "needs 2 ranks";
  const int right = (r_ + 1) % n_, left = (r_ + n_ - 1) % n_;
  const int64_t c = testing::kLargeCount;
  std::vector<float> a(c), b(c);
  for (int64_t i = 0; i < c; ++i) {
    a[i] = small_int(r_, i);
    b[i] = small_int(r_, i, 9);
  }
  std::vector<float> ra(c, 0), rb(c, 0);
  auto recv_b = comm_->recv(rb.data(), c, DType::fp32, left, 2, "recv b");
  auto recv_a = comm_->recv(ra.data(), c, DType::fp32, left, 1, "recv a");
  auto send_a = comm_->send(a.data(), c, DType::fp32, right, 1, "send a");
  auto send_b = comm_->send(b.data(), c, DType::fp32, right, 2, "send b");
  for (auto& w : {recv_a, recv_b, send_a, send_b}) w->wait(kTestTimeout);
  for (int64_t i = 0; i < c; ++i) {
    ASSERT_EQ(ra[i], small_int(left, i));
    ASSERT_EQ(rb[i], small_int(left, i, 9));
  }
}

// A rank that does not issue a collective: every survivor's TimeoutError names it (direct: it
// alone; ring: at least its two neighbours name it, a rank further round waits on a survivor).
// Then the late rank issues it and the collective completes on every rank.
TEST(Stall, ATimeoutNamesTheRankThatDidNotIssue) {
  for (Algorithm a : {Algorithm::direct, Algorithm::ring}) {
    MpiOptions o;
    o.all_gather = o.reduce_scatter = o.all_reduce = a;
    MpiCommunicator comm(test_memory(), o);
    const int n = comm.size(), r = comm.rank(), late = n - 1;
    if (n < 2) GTEST_SKIP() << "needs 2 ranks";
    const int64_t c = testing::kLargeCount;  // too long to go eagerly: sends wait for the receive
    for (int op = 0; op < 3; ++op) {
      std::vector<float> send(c * n, 1.0f), recv(c * n, 0.0f);
      auto issue = [&] {
        if (op == 0) return comm.all_gather(send.data(), recv.data(), c, DType::fp32, "stalled ag");
        if (op == 1) return comm.reduce_scatter(send.data(), recv.data(), c, DType::fp32, "stalled rs");
        return comm.all_reduce(send.data(), c * n, DType::fp32, "stalled ar");
      };
      const std::string what = std::string(to_string(a)) + " op " + std::to_string(op);
      int token = 0;
      if (r == late) {  // issues only once every survivor has timed out
        for (int q = 0; q < n - 1; ++q) comm.recv(&token, 1, DType::fp32, q, 3, "timed out")->wait(kTestTimeout);
        issue()->wait(kTestTimeout);
        continue;
      }
      // A survivor descheduled for long enough is itself missing from another's view at first:
      // wait again (the collective stays pending) until only what the late rank causes is left.
      auto w = issue();
      auto settled = [&](const std::vector<int>& got) {
        const bool names_late = std::find(got.begin(), got.end(), late) != got.end();
        if (a == Algorithm::direct) return got == std::vector<int>{late};
        return names_late || (r != 0 && r != late - 1);  // ring: the late rank's neighbours name it
      };
      std::string last;
      bool ok = false;
      for (int attempt = 0; attempt < 100 && !ok; ++attempt) {
        try {
          w->wait(std::chrono::milliseconds(200));
          ADD_FAILURE() << what << ": completed without rank " << late;
          break;
        } catch (const TimeoutError& e) {
          last = e.what();
          ok = settled(e.waiting_for()) && last.find("still waiting for rank") != std::string::npos;
        }
      }
      EXPECT_TRUE(ok) << what << ": " << last;
      comm.send(&token, 1, DType::fp32, late, 3, "timed out")->wait(kTestTimeout);
      w->wait(kTestTimeout);
    }
  }
}

TEST_F(MpiBasics, ZeroCountsCompleteAtOnce) {
  float x = 1;
  EXPECT_TRUE(comm_->all_gather(&x, &x, 0, DType::fp32, "zero")->is_completed());
  EXPECT_TRUE(comm_->reduce_scatter(&x, &x, 0, DType::fp32, "zero")->is_completed());
  EXPECT_TRUE(comm_->all_reduce(&x, 0, DType::bf16, "zero")->is_completed());
  EXPECT_TRUE(comm_->all_to_all(&x, &x, 0, DType::fp32, "zero")->is_completed());
  EXPECT_TRUE(comm_->broadcast(&x, 0, DType::fp32, 0, "zero")->is_completed());
}

TEST_F(MpiBasics, RejectsWhatItCannotDo) {
  int8_t x[64] = {};
  EXPECT_THROW(comm_->all_reduce(x, 4, DType::int8, "int8 sum"), Error);
  EXPECT_THROW(comm_->reduce_scatter(x, x, 4, DType::fp16, "fp16 sum"), Error);
  EXPECT_THROW(comm_->broadcast(x, 4, DType::fp32, n_, "bad root"), Error);
  EXPECT_THROW(comm_->send(x, 4, DType::fp32, n_, 0, "bad peer"), Error);
  EXPECT_THROW(comm_->send(x, 4, DType::fp32, 0, 40000, "bad tag"), Error);
  MpiOptions o;
  o.all_to_all = Algorithm::ring;
  MpiCommunicator ring_a2a(test_memory(), o);
  if (n_ > 1) {
    EXPECT_THROW(ring_a2a.all_to_all(x, x + 32, 1, DType::fp32, "ring a2a"), Error);
  }
}

TEST_F(MpiBasics, MovesAnyDtype) {
  const int64_t c = 5;
  std::vector<int8_t> send(c), recv(n_ * c, 0);
  for (int64_t i = 0; i < c; ++i) send[i] = static_cast<int8_t>(r_ * 10 + i);
  comm_->all_gather(send.data(), recv.data(), c, DType::int8, "int8 ag")->wait(kTestTimeout);
  for (int q = 0; q < n_; ++q)
    for (int64_t i = 0; i < c; ++i) ASSERT_EQ(recv[q * c + i], q * 10 + i);
}

// ---- The order of summation each algorithm documents, checked bit for bit on values whose sums
// round.

float noisy(int r, int64_t i) {
  uint32_t h = static_cast<uint32_t>(r * 2654435761u) ^ static_cast<uint32_t>(i * 40503u + 0x9e3779b9u);
  h ^= h >> 15;
  h *= 0x2c1b3c6du;
  h ^= h >> 12;
  return (static_cast<float>(h % 2000001) / 1000000.0f - 1.0f) * (1.0f + (h % 7));
}

// What element i of the reduced block b holds, for the given algorithm (see mpi_backend.h):
// direct adds the ranks in order 0..n−1 in fp32 and rounds once; ring starts at rank b+1 and
// rounds (bf16) after every addition.
float expected_sum(Algorithm a, DType d, int n, int b, const std::vector<std::vector<float>>& x, int64_t i) {
  auto round = [d](float v) { return d == DType::bf16 ? bf16_to_float(float_to_bf16(v)) : v; };
  if (a == Algorithm::direct) {
    float acc = x[0][i];
    for (int q = 1; q < n; ++q) acc += x[q][i];
    return round(acc);
  }
  float acc = x[(b + 1) % n][i];
  for (int k = 2; k <= n; ++k) acc = round(acc + x[(b + k) % n][i]);
  return acc;
}

TEST(SummationOrder, DirectAndRingAreBitExact) {
  for (Algorithm a : {Algorithm::direct, Algorithm::ring}) {
    for (DType d : {DType::fp32, DType::bf16}) {
      MpiOptions o;
      o.reduce_scatter = o.all_reduce = a;
      o.chunk_bytes = 4096;
      MpiCommunicator comm(test_memory(), o);
      const int n = comm.size(), r = comm.rank();
      const int64_t c = 10007;
      // x[q] = rank q's buffer (as the dtype holds it), n·c elements.
      std::vector<std::vector<float>> x(n);
      for (int q = 0; q < n; ++q) {
        std::vector<float> v(n * c);
        for (int64_t i = 0; i < n * c; ++i) v[i] = noisy(q, i);
        x[q] = decode(encode(v, d), d);
      }
      auto send = encode(x[r], d);
      std::vector<uint8_t> recv(c * dtype_size(d));
      comm.reduce_scatter(send.data(), recv.data(), c, d, "order rs")->wait(kTestTimeout);
      auto got = decode(recv, d);
      std::vector<std::vector<float>> xb(n, std::vector<float>(c));
      for (int q = 0; q < n; ++q)
        for (int64_t i = 0; i < c; ++i) xb[q][i] = x[q][r * c + i];
      for (int64_t i = 0; i < c; ++i)
        ASSERT_EQ(got[i], expected_sum(a, d, n, r, xb, i)) << to_string(a) << " " << to_string(d) << " i " << i;

      // all_reduce over n·c elements: blocks of the even split; every rank gets the same bits.
      auto buf = encode(x[r], d);
      comm.all_reduce(buf.data(), n * c, d, "order ar")->wait(kTestTimeout);
      auto all = decode(buf, d);
      for (int b = 0; b < n; ++b) {
        const int64_t lo = n * c * b / n, hi = n * c * (b + 1) / n;
        std::vector<std::vector<float>> xs(n, std::vector<float>(hi - lo));
        for (int q = 0; q < n; ++q)
          for (int64_t i = lo; i < hi; ++i) xs[q][i - lo] = x[q][i];
        for (int64_t i = lo; i < hi; ++i)
          ASSERT_EQ(all[i], expected_sum(a, d, n, b, xs, i - lo)) << to_string(a) << " " << to_string(d);
      }
    }
  }
}

TEST(SummationOrder, NativeIsCloseAndIdenticalOnEveryRank) {
  for (DType d : {DType::fp32, DType::bf16}) {
    MpiOptions o;
    o.all_reduce = Algorithm::native;
    MpiCommunicator comm(test_memory(), o);
    const int n = comm.size(), r = comm.rank();
    const int64_t c = 100003;
    std::vector<float> v(c);
    for (int64_t i = 0; i < c; ++i) v[i] = noisy(r, i);
    auto buf = encode(v, d);
    comm.all_reduce(buf.data(), c, d, "native ar")->wait(kTestTimeout);
    auto got = decode(buf, d);
    for (int64_t i = 0; i < c; ++i) {
      double want = 0, mag = 0;
      for (int q = 0; q < n; ++q) {
        const float xq = decode(encode({noisy(q, i)}, d), d)[0];
        want += xq;
        mag += std::abs(xq);
      }
      const double tol = (d == DType::bf16 ? n * 0.0079 : 1e-6) * (mag + 1e-30);
      ASSERT_NEAR(got[i], want, tol) << to_string(d) << " i " << i;
    }
    // Same bits on every rank: rank 0 broadcasts its result, everyone compares.
    auto ref = buf;
    comm.broadcast(ref.data(), c, d, 0, "ref")->wait(kTestTimeout);
    EXPECT_EQ(ref, buf);
  }
}

// ---- all_to_all_v: uneven counts (zeros among them), any dtype, blocks laid out apart and in
// reverse rank order, on the world and on split sub-communicators.

// Elements rank q sends rank r: uneven, zero for some pairs at every size ≥ 2, and none at all
// to `starved` (an expert rank that receives nothing) when it is a rank of the group.
int64_t v_count(int q, int r, int64_t scale, int starved) {
  if (r == starved) return 0;
  return ((q * 2 + r * 3 + 1) % 4) * scale + (q == r ? 1 : 0);
}

// Byte b of element i of what rank q sends rank r: distinct per pair, position and byte.
uint8_t v_byte(int q, int r, int64_t i, int b) {
  return static_cast<uint8_t>(q * 61 + r * 17 + i * 7 + b * 3 + 1);
}

// Lays each peer's block `gap` elements apart, the last peer's first, so that displacements
// are neither packed nor ascending with the rank.
std::vector<int64_t> spread_displs(const std::vector<int64_t>& counts, int64_t gap, int64_t& total) {
  std::vector<int64_t> displs(counts.size());
  int64_t at = gap;
  for (int j = static_cast<int>(counts.size()) - 1; j >= 0; --j) {
    displs[j] = at;
    at += counts[j] + gap;
  }
  total = at;
  return displs;
}

constexpr uint8_t kUntouched = 0xAB;

// Runs one all_to_all_v on `comm` and checks every received byte and that the gaps are
// untouched; returns the Work's outcome to the caller through gtest assertions.
void exchange_and_check(Communicator& comm, DType d, int64_t scale, int starved, int64_t gap,
                        const std::string& what) {
  const int n = comm.size(), r = comm.rank();
  const int64_t es = dtype_size(d);
  std::vector<int64_t> send_counts(n), recv_counts(n);
  for (int j = 0; j < n; ++j) {
    send_counts[j] = v_count(r, j, scale, starved);
    recv_counts[j] = v_count(j, r, scale, starved);
  }
  int64_t send_total = 0, recv_total = 0;
  const auto send_displs = spread_displs(send_counts, gap, send_total);
  const auto recv_displs = spread_displs(recv_counts, gap, recv_total);
  std::vector<uint8_t> send(send_total * es, 0), recv(recv_total * es, kUntouched);
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < send_counts[j]; ++i)
      for (int b = 0; b < es; ++b) send[(send_displs[j] + i) * es + b] = v_byte(r, j, i, b);
  comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, d, "a2av " + what)
      ->wait(kTestTimeout);
  std::vector<uint8_t> want(recv_total * es, kUntouched);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < recv_counts[q]; ++i)
      for (int b = 0; b < es; ++b) want[(recv_displs[q] + i) * es + b] = v_byte(q, r, i, b);
  if (r == starved) {
    EXPECT_EQ(std::count(recv.begin(), recv.end(), kUntouched), int64_t(recv.size())) << what;
  }
  for (size_t k = 0; k < want.size(); ++k)
    ASSERT_EQ(recv[k], want[k]) << what << ": byte " << k << " on rank " << r << " of " << n;
}

struct VCase {
  Algorithm algo;
  DType dtype;
  int64_t scale;
};

class AllToAllVTest : public ::testing::TestWithParam<VCase> {
 protected:
  MpiOptions options() const {
    MpiOptions o;
    o.all_to_all = GetParam().algo;
    return o;
  }
  std::string what() const {
    return std::string(to_string(GetParam().algo)) + " " + to_string(GetParam().dtype) + " x" +
           std::to_string(GetParam().scale);
  }
};

TEST_P(AllToAllVTest, UnevenCountsLandAtTheirDisplacements) {
  MpiCommunicator comm(test_memory(), options());
  const VCase& c = GetParam();
  exchange_and_check(comm, c.dtype, c.scale, -1, 3, what() + " no starved rank");
  exchange_and_check(comm, c.dtype, c.scale, comm.size() - 1, 3, what() + " last rank starved");
  exchange_and_check(comm, c.dtype, c.scale, 0, 0, what() + " rank 0 starved, packed");
}

// Split into the even and the odd ranks (at 3 ranks: a group of 2 and a group of 1, at 4 two of
// 2): each group exchanges among itself only.
TEST_P(AllToAllVTest, OnSplitSubCommunicators) {
  MpiCommunicator world(test_memory(), options());
  auto group = world.split(world.rank() % 2, world.rank());
  ASSERT_TRUE(group);
  EXPECT_EQ(group->size(), (world.size() - world.rank() % 2 + 1) / 2);
  const VCase& c = GetParam();
  exchange_and_check(*group, c.dtype, c.scale, group->size() - 1, 2, what() + " split");
  // The world still exchanges afterwards with the same tags' sequence.
  exchange_and_check(world, c.dtype, c.scale, -1, 1, what() + " world after split");
}

std::vector<VCase> v_cases() {
  std::vector<VCase> out;
  for (Algorithm a : {Algorithm::native, Algorithm::direct, Algorithm::automatic})
    for (DType d : {DType::fp32, DType::bf16, DType::fp16, DType::int8})
      for (int64_t scale : {int64_t(1), int64_t(20011)}) out.push_back({a, d, scale});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Algos, AllToAllVTest, ::testing::ValuesIn(v_cases()),
                         [](const ::testing::TestParamInfo<VCase>& i) {
                           return std::string(to_string(i.param.algo)) + "_" + to_string(i.param.dtype) + "_" +
                                  std::to_string(i.param.scale);
                         });

// The pattern expert parallelism uses: exchange the counts, then the tokens, packed.
TEST_F(MpiBasics, AllToAllVAfterExchangingCounts) {
  std::vector<int64_t> send_counts(n_);
  for (int j = 0; j < n_; ++j) send_counts[j] = v_count(r_, j, 5, n_ > 1 ? 1 : -1);
  const std::vector<int64_t> recv_counts = exchange_counts(*comm_, send_counts, "counts");
  for (int q = 0; q < n_; ++q) ASSERT_EQ(recv_counts[q], v_count(q, r_, 5, n_ > 1 ? 1 : -1)) << "from rank " << q;
  const auto send_displs = packed_displs(send_counts), recv_displs = packed_displs(recv_counts);
  EXPECT_EQ(send_displs[0], 0);
  if (n_ > 1) {
    EXPECT_EQ(send_displs[1], send_counts[0]);
  }
  std::vector<float> send(send_displs.back() + send_counts.back()), recv(recv_displs.back() + recv_counts.back(), -1);
  for (int j = 0; j < n_; ++j)
    for (int64_t i = 0; i < send_counts[j]; ++i) send[send_displs[j] + i] = small_int(r_, i, j);
  comm_->all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, DType::fp32, "tokens")
      ->wait(kTestTimeout);
  for (int q = 0; q < n_; ++q)
    for (int64_t i = 0; i < recv_counts[q]; ++i) ASSERT_EQ(recv[recv_displs[q] + i], small_int(q, i, r_));
}

TEST_F(MpiBasics, AllToAllVOfNothingCompletesAtOnce) {
  const std::vector<int64_t> zeros(n_, 0);
  float x = 1;
  EXPECT_TRUE(comm_->all_to_all_v(&x, zeros, zeros, &x, zeros, zeros, DType::bf16, "nothing")->is_completed());
}

TEST_F(MpiBasics, AllToAllVRejectsBadCounts) {
  float x[8] = {};
  const std::vector<int64_t> zeros(n_, 0), short_v(n_ + 1, 0);
  auto message = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { comm_->all_to_all_v(x, short_v, zeros, x, zeros, zeros, DType::fp32, "l"); })
                .find("send_counts has " + std::to_string(n_ + 1) + " entries"),
            std::string::npos);
  std::vector<int64_t> negative = zeros;
  negative[n_ - 1] = -2;
  EXPECT_NE(message([&] { comm_->all_to_all_v(x, zeros, zeros, x, zeros, negative, DType::fp32, "l"); })
                .find("recv_displs[" + std::to_string(n_ - 1) + "] is negative"),
            std::string::npos);
  std::vector<int64_t> to_self = zeros;
  to_self[r_] = 2;
  EXPECT_NE(message([&] { comm_->all_to_all_v(x, to_self, zeros, x + 4, zeros, zeros, DType::fp32, "l"); })
                .find("send_counts[" + std::to_string(r_) + "] = 2 but recv_counts"),
            std::string::npos);
  if (n_ > 1) {  // native takes int counts: a larger one is refused before anything is sent
    MpiOptions o;
    o.all_to_all = Algorithm::native;
    MpiCommunicator native(test_memory(), o);
    std::vector<int64_t> huge = zeros;
    huge[(r_ + 1) % n_] = int64_t(INT_MAX) + 1;
    EXPECT_NE(message([&] { native.all_to_all_v(x, zeros, zeros, x, zeros, huge, DType::int8, "l"); })
                  .find("recv_displs[" + std::to_string((r_ + 1) % n_) + "] = 2147483648 elements is over INT_MAX"),
              std::string::npos);
    o.all_to_all = Algorithm::ring;
    MpiCommunicator ring(test_memory(), o);
    EXPECT_NE(message([&] { ring.all_to_all_v(x, zeros, zeros, x, zeros, zeros, DType::fp32, "l"); }).find("ring"),
              std::string::npos);
  }
}

// Counts that disagree: rank 0 expects 8 elements from rank 1, which sends 5. direct reports it
// on rank 0 instead of leaving 3 elements stale.
TEST_F(MpiBasics, AllToAllVReportsAPeerThatSentFewer) {
  if (n_ < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<int64_t> send_counts(n_, 0), recv_counts(n_, 0);
  if (r_ == 1) send_counts[0] = 5;
  if (r_ == 0) recv_counts[1] = 8;
  std::vector<float> send(8, 1.0f), recv(8, 0.0f);
  auto w = comm_->all_to_all_v(send.data(), send_counts, std::vector<int64_t>(n_, 0), recv.data(), recv_counts,
                               std::vector<int64_t>(n_, 0), DType::fp32, "disagreeing counts");
  if (r_ != 0) {
    w->wait(kTestTimeout);
    return;
  }
  try {
    w->wait(kTestTimeout);
    ADD_FAILURE() << "a short message went unnoticed";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 sent 5 elements where 8 were expected"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm::comm
