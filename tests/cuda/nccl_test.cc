// comm::make_nccl_communicator (comm/nccl.h) at world size 1, on device buffers of the CUDA
// backend and ordered after its stream: every collective against its expected result, in place and
// not, through a split communicator too; the refusals (a message to oneself, integer sums, a bad
// root); and the timeout of a collective held back by the compute stream. Skips where no GPU is
// present or the build has no NCCL. (Several ranks need one GPU each: not on the machines at hand.)
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/nccl.h"
#include "comm/single_rank.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

namespace {

using namespace shardlm;
using comm::Communicator;
using std::chrono::milliseconds;

class NcclTest : public ::testing::Test {
 public:  // every_collective() uses the helpers
  void SetUp() override {
    if (!kernels::cuda_device_present()) GTEST_SKIP() << "no CUDA device present: NCCL tests skipped";
    if (!comm::nccl_built()) GTEST_SKIP() << "this build has no NCCL: NCCL tests skipped";
    gpu = kernels::make_cuda_backend(memory, {.bf16_gemm = false});
    bootstrap = std::make_unique<comm::SingleRankCommunicator>(memory);
    nccl = comm::make_nccl_communicator(*bootstrap, gpu->stream_handle());
  }
  // Device buffer holding `v`, uploaded on the compute stream (not synchronised: the collectives
  // must order themselves after it).
  Buffer device(const std::vector<float>& v) {
    Buffer b = gpu->alloc(MemCategory::comm, v.size() * sizeof(float), Buffer::Fill::none);
    gpu->upload(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  }
  std::vector<float> host(const Buffer& b, size_t n) {
    std::vector<float> v(n);
    gpu->download(v.data(), b.data(), n * sizeof(float));
    return v;
  }
  static std::vector<float> iota(size_t n, float first) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = first + 0.25f * float(i);
    return v;
  }

  MemoryPool memory;
  std::unique_ptr<kernels::Backend> gpu;
  std::unique_ptr<Communicator> bootstrap, nccl;
};

// Every collective at world size 1 on `c`: the results a one-rank group must give.
void every_collective(NcclTest& t, Communicator& c) {
  ASSERT_EQ(c.size(), 1);
  ASSERT_EQ(c.rank(), 0);
  EXPECT_EQ(c.backend(), "nccl");
  EXPECT_EQ(c.scratch_bytes(comm::Reduction::all_reduce, 1000, DType::fp32, 1), 0);
  const size_t n = 1000;
  const auto x = NcclTest::iota(n, 1.0f), zeros = std::vector<float>(n, 0.0f);

  // Out of place and in place (send == recv + rank·count).
  Buffer send = t.device(x), recv = t.device(zeros);
  c.all_gather(send.data(), recv.data(), n, DType::fp32, "all_gather")->wait();
  EXPECT_EQ(t.host(recv, n), x);
  Buffer inplace = t.device(x);
  c.all_gather(inplace.data(), inplace.data(), n, DType::fp32, "all_gather in place")->wait();
  EXPECT_EQ(t.host(inplace, n), x);

  recv = t.device(zeros);
  c.reduce_scatter(send.data(), recv.data(), n, DType::fp32, "reduce_scatter")->wait();
  EXPECT_EQ(t.host(recv, n), x);
  inplace = t.device(x);
  c.reduce_scatter(inplace.data(), inplace.data(), n, DType::fp32, "reduce_scatter in place")->wait();
  EXPECT_EQ(t.host(inplace, n), x);

  Buffer buf = t.device(x);
  c.all_reduce(buf.data(), n, DType::fp32, "all_reduce")->wait();
  EXPECT_EQ(t.host(buf, n), x);
  // bf16: 2n bf16 values in the n floats' bytes; a one-rank sum leaves every bit as it was.
  c.all_reduce(buf.data(), 2 * n, DType::bf16, "all_reduce bf16")->wait();
  EXPECT_EQ(t.host(buf, n), x);
  c.reduce_scatter(buf.data(), buf.data(), 2 * n, DType::bf16, "reduce_scatter bf16")->wait();
  EXPECT_EQ(t.host(buf, n), x);

  c.broadcast(buf.data(), n, DType::fp32, 0, "broadcast")->wait();
  EXPECT_EQ(t.host(buf, n), x);
  EXPECT_THROW(c.broadcast(buf.data(), n, DType::fp32, 1, "broadcast from rank 1"), comm::Error);

  c.barrier("barrier")->wait();

  recv = t.device(zeros);
  c.all_to_all(send.data(), recv.data(), n, DType::fp32, "all_to_all")->wait();
  EXPECT_EQ(t.host(recv, n), x);
  // all_to_all_v: 300 elements from offset 100 to offset 500; the rest of recv is left alone.
  recv = t.device(zeros);
  c.all_to_all_v(send.data(), {300}, {100}, recv.data(), {300}, {500}, DType::fp32, "all_to_all_v")->wait();
  std::vector<float> want = zeros;
  std::copy(x.begin() + 100, x.begin() + 400, want.begin() + 500);
  EXPECT_EQ(t.host(recv, n), want);
  EXPECT_THROW(c.all_to_all_v(send.data(), {300}, {0}, recv.data(), {200}, {0}, DType::fp32, "mismatch"), comm::Error);

  // Zero counts are complete at once; integer sums and messages to oneself are refused.
  EXPECT_TRUE(c.all_reduce(buf.data(), 0, DType::fp32, "empty")->is_completed());
  EXPECT_THROW(c.all_reduce(buf.data(), n, DType::int8, "int8 sum"), comm::Error);
  EXPECT_THROW(c.send(buf.data(), n, DType::fp32, 0, 0, "to myself"), comm::Error);
  EXPECT_THROW(c.recv(buf.data(), n, DType::fp32, 0, 0, "from myself"), comm::Error);
  EXPECT_THROW(c.send(buf.data(), n, DType::fp32, 1, 0, "to nobody"), comm::Error);
}

TEST_F(NcclTest, EveryCollectiveAtWorldSizeOne) { every_collective(*this, *nccl); }

TEST_F(NcclTest, EveryCollectiveThroughSplit) {
  auto sub = nccl->split(0, 0);
  ASSERT_NE(sub, nullptr);
  every_collective(*this, *sub);
  auto subsub = sub->split(3, 7);
  ASSERT_NE(subsub, nullptr);
  every_collective(*this, *subsub);
  EXPECT_EQ(nccl->split(-1, 0), nullptr);
}

// Several collectives in flight at once on one communicator, then waited in reverse order.
TEST_F(NcclTest, SeveralInFlight) {
  const size_t n = 1 << 16;
  std::vector<Buffer> bufs;
  std::vector<std::shared_ptr<comm::Work>> works;
  for (int i = 0; i < 8; ++i) {
    bufs.push_back(device(iota(n, float(i))));
    works.push_back(nccl->all_reduce(bufs.back().data(), n, DType::fp32, "in flight " + std::to_string(i)));
  }
  for (int i = 7; i >= 0; --i) works[i]->wait();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(host(bufs[i], n), iota(n, float(i))) << i;
}

// A Work may outlive its communicator: once the collective is done, its wait still answers (the
// communicator's NCCL handle is released only after its last Work).
TEST_F(NcclTest, WorkOutlivesItsCommunicator) {
  auto sub = nccl->split(0, 0);
  ASSERT_NE(sub, nullptr);
  const std::vector<float> x = iota(1 << 12, -2.0f);
  Buffer buf = device(x);
  auto w = sub->all_reduce(buf.data(), x.size(), DType::fp32, "outlives");
  sub->barrier("before going")->wait();
  sub.reset();
  w->wait(milliseconds(60'000));
  EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(host(buf, x.size()), x);
}

// A collective waits for the compute stream: while the stream is held by a host function, the
// Work stays incomplete and wait() ends in TimeoutError naming the collective and the backend;
// once the stream moves on, the same Work completes with the value written before it was issued.
TEST_F(NcclTest, OrderedAfterComputeStreamAndTimesOut) {
  static std::atomic<bool> release{false};
  release = false;
  const std::vector<float> x = iota(4096, 3.0f), zeros(4096, 0.0f);
  Buffer src = device(x), send = device(zeros), recv = device(zeros);
  auto stream = static_cast<cudaStream_t>(gpu->stream_handle());
  ASSERT_EQ(cudaLaunchHostFunc(
                stream, [](void*) { while (!release.load()) std::this_thread::sleep_for(milliseconds(1)); }, nullptr),
            cudaSuccess);
  gpu->copy(send.data(), src.data(), x.size() * sizeof(float));  // queued behind the held stream
  auto w = nccl->all_gather(send.data(), recv.data(), x.size(), DType::fp32, "held back");
  EXPECT_FALSE(w->is_completed());
  try {
    w->wait(milliseconds(50));
    ADD_FAILURE() << "wait returned while the compute stream was held";
  } catch (const comm::TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_gather \"held back\" on rank 0 of 1 (nccl) did not complete within 50 ms"), std::string::npos)
        << what;
  }
  release = true;
  w->wait(milliseconds(60'000));
  EXPECT_EQ(host(recv, x.size()), x);  // the gather read what the compute stream wrote before it
}

}  // namespace
