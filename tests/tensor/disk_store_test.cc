// DiskStore on each I/O path it can take: io_uring or pread/pwrite, direct or buffered. Data
// round-trips across many chunks, files start zeroed, go at the end, and each failure is one line
// naming the file.
#include "tensor/disk_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <numeric>
#include <vector>

#include "tensor/memory.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

struct Path {
  bool uring, direct;
};

class DiskStorePaths : public ::testing::TestWithParam<Path> {
 protected:
  fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_" + std::to_string(::getpid()));
  void TearDown() override { fs::remove_all(dir); }
};

TEST_P(DiskStorePaths, RoundTripsAcrossChunksAndRemovesItsFiles) {
  const Path p = GetParam();
  MemoryPool pool;
  const int64_t bytes = 5 * (int64_t{1} << 20) + 3 * kDiskAlign;  // several 1 MiB chunks and a tail
  std::string path;
  {
    DiskStore store(dir.string(), {p.uring, p.direct, {}});
    const std::string how = store.describe();
    EXPECT_NE(how.find(p.uring ? "io_uring" : "pread/pwrite"), std::string::npos) << how;
    EXPECT_NE(how.find(p.direct ? "O_DIRECT" : "buffered"), std::string::npos) << how;
    const int f = store.create("rank-00000.params", bytes + kDiskAlign);
    path = store.path(f);
    Buffer a(pool, MemCategory::params, bytes), b(pool, MemCategory::params, bytes);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kDiskAlign, 0u);
    store.read(f, kDiskAlign, b.data(), bytes);
    for (int64_t i = 0; i < bytes / 4; ++i) ASSERT_EQ(b.f32()[i], 0.0f) << "a new file is not zero at " << i;
    std::iota(a.f32(), a.f32() + bytes / 4, 1.0f);
    store.write(f, kDiskAlign, a.data(), bytes);
    store.read(f, kDiskAlign, b.data(), bytes);
    for (int64_t i = 0; i < bytes / 4; ++i) ASSERT_EQ(b.f32()[i], a.f32()[i]) << i;
    EXPECT_EQ(store.bytes_written(), 2 * bytes + kDiskAlign);
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path)) << "the store left its file";
  EXPECT_FALSE(fs::exists(dir)) << "the store left the directory it made";
}

INSTANTIATE_TEST_SUITE_P(Io, DiskStorePaths,
                         ::testing::Values(Path{true, true}, Path{true, false}, Path{false, true}, Path{false, false}),
                         [](const auto& i) {
                           return std::string(i.param.uring ? "uring" : "plain") + (i.param.direct ? "_direct" : "_buffered");
                         });

TEST(DiskStore, ATruncatedOrDeletedFileIsNamed) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_f_" + std::to_string(::getpid()));
  MemoryPool pool;
  Buffer b(pool, MemCategory::params, 2 * kDiskAlign);
  {
    DiskStore store(dir.string());
    const int f = store.create("a", 4 * kDiskAlign);
    fs::resize_file(store.path(f), kDiskAlign);
    try {
      store.read(f, 2 * kDiskAlign, b.data(), 2 * kDiskAlign);
      FAIL() << "read past a truncated end";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "offload file " + store.path(f) +
                                           ": is 4096 bytes, should be 16384 (truncated while the run was using it)");
    }
    const int g = store.create("b", 4 * kDiskAlign);
    fs::remove(store.path(g));
    try {
      store.write(g, 0, b.data(), 2 * kDiskAlign);
      FAIL() << "wrote to a deleted file";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "offload file " + store.path(g) + ": deleted while the run was using it");
    }
  }
  fs::remove_all(dir);
}

// A file cut short after the store checked it and before its read (a run's file truncated
// mid-transfer; the read_fault seam runs between the two) is named the same way, on both I/O paths:
// it had come out as "read ended early at byte ... (truncated?)" when the truncation won the race.
TEST(DiskStore, AFileTruncatedDuringAReadIsNamedAsTruncated) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_t_" + std::to_string(::getpid()));
  MemoryPool pool;
  Buffer b(pool, MemCategory::params, 2 * kDiskAlign);
  for (bool uring : {true, false}) {
    std::string path;
    DiskStoreOptions o;
    o.try_uring = uring;
    o.read_fault = [&](const std::string& p, int64_t, int64_t) { return fs::resize_file(p, kDiskAlign), false; };
    DiskStore store(dir.string(), o);
    const int f = store.create("a", 4 * kDiskAlign);
    path = store.path(f);
    try {
      store.read(f, 2 * kDiskAlign, b.data(), 2 * kDiskAlign);
      FAIL() << "read past a truncated end";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "offload file " + path + ": is 4096 bytes, should be 16384 (truncated while the run was using it)")
          << (uring ? "io_uring" : "pread");
    }
  }
  fs::remove_all(dir);
}

// The read_fault seam: the read it picks (here the second unit's, at 8 KiB) fails as an EIO would,
// naming the file; the reads it does not pick, and every write, go through.
TEST(DiskStore, AReadTheFaultPicksFailsNamingTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_r_" + std::to_string(::getpid()));
  MemoryPool pool;
  Buffer b(pool, MemCategory::params, 2 * kDiskAlign);
  {
    DiskStoreOptions o;
    int asked = 0;
    o.read_fault = [&](const std::string&, int64_t offset, int64_t) { return ++asked, offset == 2 * kDiskAlign; };
    DiskStore store(dir.string(), o);
    const int f = store.create("a", 4 * kDiskAlign);
    store.write(f, 2 * kDiskAlign, b.data(), 2 * kDiskAlign);
    store.read(f, 0, b.data(), 2 * kDiskAlign);
    EXPECT_EQ(asked, 1);
    try {
      store.read(f, 2 * kDiskAlign, b.data(), 2 * kDiskAlign);
      FAIL() << "the picked read went through";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "offload file " + store.path(f) + ": read failed: Input/output error");
    }
    EXPECT_EQ(store.bytes_read(), 2 * kDiskAlign);
  }
  fs::remove_all(dir);
}

// Two live runs given the same directory would replace each other's files: the second is refused.
TEST(DiskStore, ASecondLiveStoreOfTheSameOwnerIsRefused) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_l_" + std::to_string(::getpid()));
  {
    DiskStore first(dir.string(), {}, "rank-00000");
    try {
      DiskStore second(dir.string(), {}, "rank-00000");
      FAIL() << "two stores of one owner in one directory";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("rank-00000.lock is held by another live run"), std::string::npos) << e.what();
    }
    DiskStore other_rank(dir.string(), {}, "rank-00001");
  }
  DiskStore again(dir.string(), {}, "rank-00000");  // the first is gone: its lock with it
}

}  // namespace
}  // namespace shardlm
