// main() of comm_tests, run as `mpirun -np N comm_tests`. Every rank runs every test; only rank
// 0 prints gtest's report, other ranks print their failures (prefixed with their rank). After
// each test the ranks compare notes, so rank 0 names tests that failed elsewhere, and the process
// exits non-zero on every rank if any rank failed any test.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "comm/mpi_backend.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.message());
  }

 private:
  int rank_;
};

class RankAgreement : public ::testing::EmptyTestEventListener {
 public:
  RankAgreement(int rank, int size) : rank_(rank), size_(size) {}
  void OnTestEnd(const ::testing::TestInfo& info) override {
    int failed = info.result()->Failed() ? 1 : 0;
    std::vector<int> all(size_);
    MPI_Gather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank_ != 0) return;
    for (int r = 1; r < size_; ++r) {
      if (all[r]) {
        std::printf("[  FAILED  ] %s.%s on rank %d (see its output)\n", info.test_suite_name(),
                    info.name(), r);
      }
    }
    std::fflush(stdout);
  }

 private:
  int rank_, size_;
};

}  // namespace

int main(int argc, char** argv) {
  shardlm::comm::init_mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  listeners.Append(new RankAgreement(rank, size));
  int rc = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("comm_tests: %d ranks, %s\n", size, any ? "FAILED on some rank" : "all ranks passed");
  }
  shardlm::comm::finalize_mpi();
  return any ? 1 : 0;
}
