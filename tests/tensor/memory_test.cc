#include "tensor/memory.h"

#include <gtest/gtest.h>

namespace shardlm {
namespace {

TEST(MemoryTracker, CountsLiveBytesPerCategory) {
  auto& t = MemoryTracker::global();
  const MemSnapshot before = t.live();
  {
    Buffer p(MemCategory::params, 1000);
    Buffer g(MemCategory::grads, 24);
    const MemSnapshot now = t.live();
    EXPECT_EQ(now[MemCategory::params] - before[MemCategory::params], 1000);
    EXPECT_EQ(now[MemCategory::grads] - before[MemCategory::grads], 24);
    EXPECT_EQ(now.total - before.total, 1024);
  }
  EXPECT_EQ(t.live().total, before.total);
}

TEST(MemoryTracker, PeakIsTheSnapshotAtTheHighestTotal) {
  auto& t = MemoryTracker::global();
  t.reset_peak();
  const MemSnapshot base = t.live();
  {
    Buffer a(MemCategory::activations, 4096);
    Buffer w(MemCategory::workspace, 1024);
  }  // peak: 4096 activations + 1024 workspace
  {
    Buffer o(MemCategory::optimizer, 2048);
  }  // lower total: must not replace the peak
  const MemSnapshot peak = t.peak();
  EXPECT_EQ(peak.total - base.total, 5120);
  EXPECT_EQ(peak[MemCategory::activations] - base[MemCategory::activations], 4096);
  EXPECT_EQ(peak[MemCategory::optimizer], base[MemCategory::optimizer]);
}

TEST(Buffer, IsZeroedAlignedAndMovable) {
  Buffer a(MemCategory::params, 100);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.as<unsigned char>()[i], 0);
  const int64_t live = MemoryTracker::global().live().total;
  Buffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.bytes(), 100u);
  EXPECT_EQ(MemoryTracker::global().live().total, live);  // a move charges nothing
}

}  // namespace
}  // namespace shardlm
