// The staged communicator (device -> host -> MPI -> device) over a stand-in device: a copier
// that counts what it moves. Every collective must give the device buffers the bits the inner
// communicator gives host buffers, and results reach the device only when the Work completes.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "comm/mpi_backend.h"
#include "comm/staged.h"
#include "comm/test_util.h"

namespace shardlm::comm {
namespace {

using testing::kTestTimeout;
using testing::small_int;
using testing::test_memory;

// "Device" memory is host memory here; what matters is that every byte crosses the copier.
class CountingCopier final : public DeviceCopier {
 public:
  void to_host(void* dst, const void* src, size_t bytes) const override {
    std::memcpy(dst, src, bytes);
    down += bytes;
  }
  void to_device(void* dst, const void* src, size_t bytes) const override {
    std::memcpy(dst, src, bytes);
    up += bytes;
  }
  mutable std::atomic<int64_t> down{0}, up{0};
};

std::vector<float> values(int r, int64_t n, int salt) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = small_int(r, i, salt) + 0.1f * static_cast<float>(i % 7);
  return v;
}

TEST(Staged, CollectivesMatchTheInnerCommunicator) {
  MpiCommunicator world(test_memory());
  CountingCopier copier;
  StagedCommunicator staged(world, copier, test_memory());
  const int n = world.size(), r = world.rank();
  EXPECT_EQ(staged.rank(), r);
  EXPECT_EQ(staged.size(), n);
  EXPECT_EQ(staged.backend(), "mpi+staged");
  EXPECT_EQ(staged.scratch_bytes(Reduction::all_reduce, 1000, DType::fp32, n), 0);
  const int64_t c = 1009;

  // all_gather, then in place.
  {
    const std::vector<float> mine = values(r, c, 1);
    std::vector<float> want(n * c), got(n * c, -1);
    world.all_gather(mine.data(), want.data(), c, DType::fp32, "ag host")->wait(kTestTimeout);
    staged.all_gather(mine.data(), got.data(), c, DType::fp32, "ag staged")->wait(kTestTimeout);
    EXPECT_EQ(got, want);
    std::vector<float> inplace(n * c, -1);
    std::copy(mine.begin(), mine.end(), inplace.begin() + r * c);
    staged.all_gather(inplace.data() + r * c, inplace.data(), c, DType::fp32, "ag in place")->wait(kTestTimeout);
    EXPECT_EQ(inplace, want);
  }
  // reduce_scatter (fp32, then bf16 in place) and all_reduce: the inner's bits.
  {
    const std::vector<float> send = values(r, n * c, 2);
    std::vector<float> want(c), got(c, -1);
    world.reduce_scatter(send.data(), want.data(), c, DType::fp32, "rs host")->wait(kTestTimeout);
    staged.reduce_scatter(send.data(), got.data(), c, DType::fp32, "rs staged", Scratch{})->wait(kTestTimeout);
    EXPECT_EQ(got, want);

    std::vector<uint16_t> b(n * c), hb(n * c);
    for (int64_t i = 0; i < n * c; ++i) b[i] = hb[i] = float_to_bf16(send[i]);
    world.reduce_scatter(hb.data(), hb.data() + r * c, c, DType::bf16, "rs bf16 host")->wait(kTestTimeout);
    staged.reduce_scatter(b.data(), b.data() + r * c, c, DType::bf16, "rs bf16 staged")->wait(kTestTimeout);
    EXPECT_EQ(b, hb);  // this rank's block reduced, the others untouched

    std::vector<float> ar_want = values(r, c, 3), ar_got = ar_want;
    world.all_reduce(ar_want.data(), c, DType::fp32, "ar host")->wait(kTestTimeout);
    staged.all_reduce(ar_got.data(), c, DType::fp32, "ar staged")->wait(kTestTimeout);
    EXPECT_EQ(ar_got, ar_want);
  }
  // broadcast from the last rank, all_to_all.
  {
    std::vector<float> buf = values(r, c, 4);
    const std::vector<float> root = values(n - 1, c, 4);
    staged.broadcast(buf.data(), c, DType::fp32, n - 1, "bcast staged")->wait(kTestTimeout);
    EXPECT_EQ(buf, root);

    const std::vector<float> send = values(r, n * c, 5);
    std::vector<float> want(n * c), got(n * c, -1);
    world.all_to_all(send.data(), want.data(), c, DType::fp32, "a2a host")->wait(kTestTimeout);
    staged.all_to_all(send.data(), got.data(), c, DType::fp32, "a2a staged")->wait(kTestTimeout);
    EXPECT_EQ(got, want);
  }
  staged.barrier("staged barrier")->wait(kTestTimeout);
  EXPECT_GT(copier.down.load(), 0);
  EXPECT_GT(copier.up.load(), 0);
}

// Variable counts with a gap in the receive buffer that no peer writes: it comes back unchanged.
TEST(Staged, AllToAllVLeavesGapsAlone) {
  MpiCommunicator world(test_memory());
  CountingCopier copier;
  StagedCommunicator staged(world, copier, test_memory());
  const int n = world.size(), r = world.rank();
  // Rank r sends j + 1 elements to rank j; receive ranges are packed with one spare element after each.
  std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
  int64_t out = 0, in = 0;
  for (int j = 0; j < n; ++j) {
    sc[j] = j + 1, sd[j] = out, out += sc[j];
    rc[j] = r + 1, rd[j] = in, in += rc[j] + 1;
  }
  std::vector<float> send(out), recv(in, -7);
  for (int64_t i = 0; i < out; ++i) send[i] = static_cast<float>(r * 1000 + i);
  staged.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd, DType::fp32, "a2av staged")->wait(kTestTimeout);
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < rc[j]; ++i) ASSERT_EQ(recv[rd[j] + i], static_cast<float>(j * 1000 + r * (r + 1) / 2 + i)) << j << " " << i;
    ASSERT_EQ(recv[rd[j] + rc[j]], -7) << "gap after rank " << j;
  }
}

// A receive's device buffer is written when its Work completes, not before; a split of a staged
// communicator stages too; a timeout names the inner communicator's missing rank.
TEST(Staged, ReceiveLandsOnCompletionAndSplitStagesToo) {
  MpiCommunicator world(test_memory());
  if (world.size() < 2) GTEST_SKIP() << "needs two ranks";
  CountingCopier copier;
  StagedCommunicator staged(world, copier, test_memory());
  const int r = world.rank();
  const int64_t c = 257;
  if (r == 0) {
    std::vector<float> buf(c, -1);
    auto w = staged.recv(buf.data(), c, DType::fp32, 1, 3, "recv staged");
    try {
      w->wait(std::chrono::milliseconds(200));
      ADD_FAILURE() << "the receive completed before its send";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("(mpi+staged)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(buf, std::vector<float>(c, -1));  // nothing landed yet
    world.barrier("sender may go")->wait(kTestTimeout);
    w->wait(kTestTimeout);
    EXPECT_EQ(buf, values(1, c, 6));
  } else if (r == 1) {
    world.barrier("sender may go")->wait(kTestTimeout);
    const std::vector<float> v = values(1, c, 6);
    staged.send(v.data(), c, DType::fp32, 0, 3, "send staged")->wait(kTestTimeout);
  } else {
    world.barrier("sender may go")->wait(kTestTimeout);
  }

  auto pairs = staged.split(r / 2, r);
  ASSERT_TRUE(pairs);
  EXPECT_EQ(pairs->backend(), "mpi+staged");
  const int64_t before = copier.down.load();
  std::vector<float> sum = values(r, c, 7);
  pairs->all_reduce(sum.data(), c, DType::fp32, "ar pair")->wait(kTestTimeout);
  EXPECT_GT(copier.down.load(), before);
  const int first = r / 2 * 2, last = std::min(first + 2, world.size());
  for (int64_t i = 0; i < c; ++i) {
    float want = 0;
    for (int q = first; q < last; ++q) want += values(q, c, 7)[i];
    ASSERT_EQ(sum[i], want) << i;
  }
}

}  // namespace
}  // namespace shardlm::comm
