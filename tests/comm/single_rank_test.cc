// The single-rank backend (no MPI involved) and the factory's choice.
#include "comm/single_rank.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm/factory.h"
#include "comm/nccl.h"
#include "comm/test_util.h"
#include "tensor/memory.h"

namespace shardlm::comm {
namespace {

// A build without NCCL (no CUDA, or no nccl.h / libnccl) refuses it with one line, before any
// collective. (tests/cuda/nccl_test.cc runs the NCCL backend where there is one.)
TEST(NcclBackend, RefusedWithOneLineWhereNotBuilt) {
  if (nccl_built()) GTEST_SKIP() << "this build has NCCL: see cuda_tests' NcclTest";
  MemoryPool memory;
  SingleRankCommunicator bootstrap(memory);
  try {
    make_nccl_communicator(bootstrap, nullptr);
    ADD_FAILURE() << "made an NCCL communicator in a build without NCCL";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "nccl: this build has no NCCL (configure with -DSHARDLM_CUDA=ON where CMake finds nccl.h and libnccl)");
  }
}

TEST(SingleRank, CollectivesAreCopies) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.backend(), "single");
  EXPECT_EQ(c.machine(), 0);
  std::vector<float> a = {1, 2, 3, 4, 5, 6, 7}, b(7, 0);
  auto w = c.all_gather(a.data(), b.data(), 7, DType::fp32, "ag");
  EXPECT_TRUE(w->is_completed());
  w->wait();
  EXPECT_EQ(a, b);
  std::fill(b.begin(), b.end(), 0.0f);
  c.reduce_scatter(a.data(), b.data(), 7, DType::fp32, "rs")->wait();
  EXPECT_EQ(a, b);
  std::fill(b.begin(), b.end(), 0.0f);
  c.all_to_all(a.data(), b.data(), 7, DType::fp32, "a2a")->wait();
  EXPECT_EQ(a, b);
  c.all_reduce(a.data(), 7, DType::bf16, "ar")->wait();
  c.broadcast(a.data(), 7, DType::fp32, 0, "bc")->wait();
  c.barrier("b")->wait();
  EXPECT_EQ(a, b);
  // In place.
  c.all_gather(a.data(), a.data(), 7, DType::fp32, "ag in place")->wait();
  c.reduce_scatter(a.data(), a.data(), 7, DType::fp32, "rs in place")->wait();
  EXPECT_EQ(a, b);
}

TEST(SingleRank, RejectsWhatMpiWouldReject) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  int8_t x[8] = {};
  EXPECT_THROW(c.all_reduce(x, 8, DType::int8, "ar"), Error);
  EXPECT_THROW(c.broadcast(x, 8, DType::int8, 1, "bc"), Error);
  EXPECT_THROW(c.send(x, 8, DType::int8, 1, 0, "s"), Error);
  EXPECT_THROW(c.recv(x, 8, DType::int8, 0, -1, "r"), Error);
  EXPECT_EQ(c.split(-1, 0), nullptr);
  auto sub = c.split(3, 0);
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->size(), 1);
}

// all_to_all_v on one rank: the self block moves from its send to its recv displacement, any
// dtype; the counts are checked as MPI's backend checks them.
TEST(SingleRank, AllToAllVCopiesTheSelfBlock) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  for (DType d : {DType::fp32, DType::bf16, DType::fp16, DType::int8}) {
    const int64_t es = dtype_size(d);
    std::vector<uint8_t> send(10 * es), recv(12 * es, 0xAB);
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(i * 7 + 1);
    // Elements 3..8 of send land at 5..10 of recv; the rest of recv stays as it was.
    auto w = c.all_to_all_v(send.data(), {6}, {3}, recv.data(), {6}, {5}, d, "a2av");
    EXPECT_TRUE(w->is_completed());
    for (int64_t k = 0; k < 12 * es; ++k) {
      const bool moved = k >= 5 * es && k < 11 * es;
      ASSERT_EQ(recv[k], moved ? send[k - 2 * es] : 0xAB) << to_string(d) << " byte " << k;
    }
    // Zero elements: nothing moves (send's first element would differ from what recv holds).
    const std::vector<uint8_t> before = recv;
    c.all_to_all_v(send.data(), {0}, {0}, recv.data(), {0}, {5}, d, "empty")->wait();
    EXPECT_EQ(recv, before);
  }
  EXPECT_EQ(exchange_counts(c, {42}, "counts"), std::vector<int64_t>{42});
  EXPECT_EQ(packed_displs({3, 0, 5, 2}), (std::vector<int64_t>{0, 3, 3, 8}));
  float x[4] = {};
  EXPECT_THROW(c.all_to_all_v(x, {1, 1}, {0, 1}, x, {1}, {0}, DType::fp32, "two ranks' counts"), Error);
  EXPECT_THROW(c.all_to_all_v(x, {-1}, {0}, x, {-1}, {0}, DType::fp32, "negative"), Error);
  EXPECT_THROW(c.all_to_all_v(x, {2}, {0}, x + 2, {1}, {0}, DType::fp32, "sends more than it takes"), Error);
  EXPECT_THROW(exchange_counts(c, {1, 2}, "counts"), Error);
}

TEST(SingleRank, SendToSelfMatchesByTagInOrder) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  std::vector<float> a = {1, 2, 3}, b = {4, 5, 6}, r1(3), r2(3), r3(3);
  // Send first: buffered (charged to comm) until the recv.
  const int64_t comm_before = memory.tracker().live()[MemCategory::comm];
  c.send(a.data(), 3, DType::fp32, 0, 7, "s1")->wait();
  EXPECT_EQ(memory.tracker().live()[MemCategory::comm] - comm_before, 12);
  c.send(b.data(), 3, DType::fp32, 0, 7, "s2")->wait();
  c.recv(r1.data(), 3, DType::fp32, 0, 7, "r1")->wait();
  c.recv(r2.data(), 3, DType::fp32, 0, 7, "r2")->wait();
  EXPECT_EQ(r1, a);
  EXPECT_EQ(r2, b);
  EXPECT_EQ(memory.tracker().live()[MemCategory::comm], comm_before);
  // Recv first: completes when the send is made, from another thread here.
  auto w = c.recv(r3.data(), 3, DType::fp32, 0, 9, "r3");
  EXPECT_FALSE(w->is_completed());
  std::thread t([&] { c.send(b.data(), 3, DType::fp32, 0, 9, "s3")->wait(); });
  w->wait(testing::kTestTimeout);
  t.join();
  EXPECT_EQ(r3, b);
}

TEST(SingleRank, UnmatchedRecvTimesOut) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  float x[2];
  auto w = c.recv(x, 2, DType::fp32, 0, 1, "lonely recv step 3");
  try {
    w->wait(std::chrono::milliseconds(50));
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("recv"), std::string::npos);
    EXPECT_NE(what.find("lonely recv step 3"), std::string::npos);
    EXPECT_NE(what.find("rank 0 of 1 (single)"), std::string::npos);
    EXPECT_NE(what.find("50 ms"), std::string::npos);
  }
  // Sending later completes it.
  c.send(x, 2, DType::fp32, 0, 1, "late send")->wait();
  EXPECT_TRUE(w->is_completed());
}

TEST(SingleRank, HugeTimeoutIsNoTimeout) {
  MemoryPool memory;
  SingleRankCommunicator c(memory);
  float x[2] = {1, 2}, y[2] = {0, 0};
  auto w = c.recv(y, 2, DType::fp32, 0, 4, "recv");
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.send(x, 2, DType::fp32, 0, 4, "send")->wait();
  });
  w->wait(std::chrono::milliseconds::max());
  t.join();
  EXPECT_EQ(y[1], 2.0f);
}

TEST(Factory, PicksMpiUnderALauncher) {
  // This binary runs under mpirun (MPI is initialised), so the factory must pick MPI.
  MemoryPool memory;
  auto c = make_communicator(memory, {}, false);
  EXPECT_EQ(c->backend(), "mpi");
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_TRUE(launched_by_mpi([](const char* name) { return std::getenv(name); }));
  }
  EXPECT_FALSE(launched_by_mpi([](const char*) -> const char* { return nullptr; }));
  EXPECT_TRUE(launched_by_mpi([](const char* name) -> const char* { return std::string(name) == "SLURM_NTASKS" ? "4" : nullptr; }));
}

TEST(Options, FromSettings) {
  std::map<std::string, std::string> table{{"SHARDLM_COMM_ALGOS", "reduce_scatter=ring,all_reduce=native"},
                                           {"SHARDLM_COMM_CHUNK_KB", "64"}};
  auto lookup = [&](const char* name) -> const char* {
    auto it = table.find(name);
    return it == table.end() ? nullptr : it->second.c_str();
  };
  MpiOptions o = mpi_options_from(lookup);
  EXPECT_EQ(o.reduce_scatter, Algorithm::ring);
  EXPECT_EQ(o.all_reduce, Algorithm::native);
  EXPECT_EQ(o.all_gather, Algorithm::automatic);
  EXPECT_EQ(o.chunk_bytes, 64 * 1024);
  table["SHARDLM_COMM_ALGOS"] = "reduce_scatter=fastest";
  EXPECT_THROW(mpi_options_from(lookup), std::invalid_argument);
  table["SHARDLM_COMM_ALGOS"] = "";
  table["SHARDLM_COMM_WINDOW"] = "-1";
  EXPECT_THROW(mpi_options_from(lookup), std::invalid_argument);
}

}  // namespace
}  // namespace shardlm::comm
