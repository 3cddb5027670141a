#include "tensor/memory.h"

#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>

namespace shardlm {
namespace {

TEST(MemoryTracker, CountsLiveBytesPerCategory) {
  MemoryPool pool;
  const MemoryTracker& t = pool.tracker();
  {
    Buffer p(pool, MemCategory::params, 1000);
    Buffer g(pool, MemCategory::grads, 24);
    const MemSnapshot now = t.live();
    EXPECT_EQ(now[MemCategory::params], 1000);
    EXPECT_EQ(now[MemCategory::grads], 24);
    EXPECT_EQ(now.total, 1024);
  }
  EXPECT_EQ(t.live().total, 0);
  EXPECT_EQ(t.run_peak(), 1024);
}

TEST(MemoryTracker, PeakIsTheSnapshotAtTheHighestTotal) {
  MemoryPool pool;
  MemoryTracker& t = pool.tracker();
  Buffer held(pool, MemCategory::params, 512);
  t.reset_peak();
  {
    Buffer a(pool, MemCategory::activations, 4096);
    Buffer w(pool, MemCategory::workspace, 1024);
  }  // peak: 4096 activations + 1024 workspace
  {
    Buffer o(pool, MemCategory::optimizer, 2048);
  }  // lower total: must not replace the peak
  const MemSnapshot peak = t.peak();
  EXPECT_EQ(peak.total, 512 + 5120);
  EXPECT_EQ(peak[MemCategory::activations], 4096);
  EXPECT_EQ(peak[MemCategory::optimizer], 0);
  EXPECT_EQ(t.peak_each()[MemCategory::optimizer], 2048);
}

TEST(MemoryPool, EachPoolCountsOnlyItsOwnBuffers) {
  MemoryPool a, b;
  Buffer x(a, MemCategory::comm, 100);
  Buffer y(b, MemCategory::comm, 300);
  EXPECT_EQ(a.tracker().live()[MemCategory::comm], 100);
  EXPECT_EQ(b.tracker().live()[MemCategory::comm], 300);
  x = Buffer();
  EXPECT_EQ(a.tracker().live().total, 0);
  EXPECT_EQ(b.tracker().live().total, 300);
}

TEST(MemoryPool, AFreedBlockIsReusedForTheSameSize) {
  MemoryPool pool;
  [[maybe_unused]] void* first = nullptr;  // a sanitizer's allocator does not reuse it
  {
    Buffer a(pool, MemCategory::grads, 1 << 20);
    first = a.data();
  }
  Buffer b(pool, MemCategory::grads, 1 << 20);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  EXPECT_EQ(b.data(), first);
#endif
  for (int i = 0; i < (1 << 20); i += 4096) ASSERT_EQ(b.as<unsigned char>()[i], 0) << "a reused block is zeroed";
}

TEST(Buffer, IsZeroedAlignedAndMovable) {
  MemoryPool pool;
  Buffer a(pool, MemCategory::params, 100);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.as<unsigned char>()[i], 0);
  const int64_t live = pool.tracker().live().total;
  Buffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.bytes(), 100u);
  EXPECT_EQ(pool.tracker().live().total, live);  // a move charges nothing
}

// An arena's parts are charged to their categories while they live and the block to nothing;
// a part sits at its offset of the block, zero-filled when asked; one outside the block is refused;
// a longer reserve replaces the block, a shorter one keeps it.
TEST(Arena, PartsAreChargedToTheirCategoriesAndTheBlockToNothing) {
  MemoryPool pool;
  Arena arena(pool);
  arena.reserve(3 << 20);
  EXPECT_EQ(arena.bytes(), 3 << 20);
  EXPECT_EQ(pool.tracker().live().total, 0);
  {
    Buffer a = arena.part(MemCategory::activations, 0, 100, Buffer::Fill::none);
    std::memset(a.data(), 7, 100);
    Buffer b = arena.part(MemCategory::grads, 1 << 20, 4096, Buffer::Fill::zero);
    EXPECT_EQ(static_cast<char*>(b.data()) - static_cast<char*>(a.data()), 1 << 20);
    for (int i = 0; i < 4096; ++i) ASSERT_EQ(b.as<unsigned char>()[i], 0);
    EXPECT_EQ(pool.tracker().live()[MemCategory::activations], 100);
    EXPECT_EQ(pool.tracker().live()[MemCategory::grads], 4096);
    EXPECT_EQ(pool.tracker().live().total, 4196);
    Buffer again = arena.part(MemCategory::workspace, 0, 100, Buffer::Fill::zero);  // after a is gone, in a plan
    EXPECT_EQ(again.data(), a.data());
    EXPECT_EQ(again.as<unsigned char>()[99], 0);
    a = Buffer();
    again = Buffer();
  }
  EXPECT_EQ(pool.tracker().live().total, 0);
  EXPECT_THROW(arena.part(MemCategory::params, (3 << 20) - 100, 101, Buffer::Fill::none), std::logic_error);
  EXPECT_THROW(arena.part(MemCategory::params, -4096, 10, Buffer::Fill::none), std::logic_error);
  arena.reserve(1 << 20);
  EXPECT_EQ(arena.bytes(), 3 << 20);
  arena.reserve(5 << 20);
  EXPECT_EQ(arena.bytes(), 5 << 20);
  Buffer last = arena.part(MemCategory::params, (5 << 20) - 64, 64, Buffer::Fill::zero);
  EXPECT_EQ(pool.tracker().live()[MemCategory::params], 64);
}

}  // namespace
}  // namespace shardlm
