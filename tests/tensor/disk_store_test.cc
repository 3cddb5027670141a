// DiskStore on each I/O path it can take: io_uring or pread/pwrite, direct or buffered. Data
// round-trips across many chunks, files start zeroed, go at the end, and each failure is one line
// naming the file.
#include "tensor/disk_store.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
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
    DiskStoreOptions o;
    o.try_uring = p.uring, o.try_direct = p.direct;
    DiskStore store(dir.string(), o);
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

// A directory that was there before the store (the user's --offload-dir) is left in place, empty
// as it was; only the store's files go. One the caller says is its own goes, whoever made it.
TEST(DiskStore, LeavesADirectoryItDidNotMake) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_disk_store_own_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    DiskStore store(dir.string());
    store.create("a", kDiskAlign);
  }
  EXPECT_TRUE(fs::is_directory(dir)) << "the store removed a directory it did not make";
  EXPECT_TRUE(fs::is_empty(dir));
  {
    DiskStoreOptions o;
    o.remove_dir = true;  // the caller's processes made it between them
    DiskStore store(dir.string(), o);
    store.create("a", kDiskAlign);
  }
  EXPECT_FALSE(fs::exists(dir)) << "the store left a directory its caller said was the run's";
  fs::remove_all(dir);
}

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

// What a truncation racing a write leaves: the size check before the write passed, the cut landed,
// and the write past it made the file whole again with zeros between the cut and itself. The size
// is right, so only the checksum of what was written there can tell: a read of either written
// range that lost bytes is named, as is one whose bytes another process changed in place. A range
// never written reads as creation's zeros; a read of part of a write is the caller's error.
TEST_P(DiskStorePaths, BytesThatAreNotWhatWasWrittenAreNamed) {
  DiskStoreOptions o;
  o.try_uring = GetParam().uring, o.try_direct = GetParam().direct;
  MemoryPool pool;
  Buffer a(pool, MemCategory::params, 2 * kDiskAlign), got(pool, MemCategory::params, 2 * kDiskAlign);
  auto* p = static_cast<unsigned char*>(a.data());
  std::iota(p, p + 2 * kDiskAlign, static_cast<unsigned char>(1));
  DiskStore store(dir.string(), o);
  const int f = store.create("a", 6 * kDiskAlign);
  const std::string path = store.path(f);
  store.write(f, 0, a.data(), 2 * kDiskAlign);
  store.write(f, 2 * kDiskAlign, a.data(), 2 * kDiskAlign);
  store.read(f, 4 * kDiskAlign, got.data(), 2 * kDiskAlign);  // never written: zeros, and no complaint
  EXPECT_THROW(store.read(f, 0, got.data(), kDiskAlign), std::logic_error);
  const std::string changed = ") read back are not what was written there (checksum): changed while the run was using it";
  auto expect_named = [&](int64_t offset, const std::string& range) {
    try {
      store.read(f, offset, got.data(), 2 * kDiskAlign);
      FAIL() << "read " << range << " of a damaged file";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "offload file " + path + ": bytes " + range + changed);
    }
  };
  // Another process changes one byte in place: the size and every other byte are as written.
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const unsigned char x = 0;
  ASSERT_EQ(::pwrite(fd, &x, 1, 2 * kDiskAlign + 5), 1);
  expect_named(2 * kDiskAlign, "[8192, 16384");
  store.read(f, 0, got.data(), 2 * kDiskAlign);  // the other range is intact
  EXPECT_EQ(std::memcmp(got.data(), a.data(), 2 * kDiskAlign), 0);
  // The race's outcome: cut to one page, then a write of the last page makes it whole again.
  fs::resize_file(path, kDiskAlign);
  std::vector<unsigned char> page(kDiskAlign, 7);
  ASSERT_EQ(::pwrite(fd, page.data(), kDiskAlign, 5 * kDiskAlign), kDiskAlign);
  ::close(fd);
  ASSERT_EQ(static_cast<int64_t>(fs::file_size(path)), 6 * kDiskAlign);
  expect_named(0, "[0, 8192");
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
