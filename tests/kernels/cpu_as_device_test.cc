// The CPU backend as a device keeps its buffers out of the host code's reach: reading or writing
// one in place faults, as it would on a GPU, while the backend's own calls (uploads, downloads,
// kernels) reach it. So a device path that passes under SHARDLM_TEST_CPU_AS_DEVICE touches device
// memory only through the backend.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/backend.h"

namespace shardlm::kernels {
namespace {

class CpuAsDeviceTest : public ::testing::Test {
 protected:
  MemoryPool memory_;
  std::unique_ptr<Backend> device_ = make_cpu_backend(memory_, true);
};

TEST_F(CpuAsDeviceTest, TheHostReadsADeviceBufferOnlyThroughDownload) {
  ASSERT_FALSE(device_->host_memory());
  Buffer b = device_->alloc(MemCategory::params, 4 * sizeof(float), Buffer::Fill::zero);
  const std::vector<float> up = {1, 2, 3, 4};
  device_->upload(b.data(), up.data(), 16);
  device_->scale(b.f32(), 4, 2.0f);  // a kernel reaches it
  std::vector<float> down(4);
  device_->download(down.data(), b.data(), 16);
  EXPECT_EQ(down, (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(device_->sum_squares(b.f32(), 4), 120.0);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  volatile float* in_place = b.f32();
  EXPECT_DEATH((void)in_place[1], "");   // host code reading it in place
  EXPECT_DEATH(in_place[0] = 5.0f, "");  // or writing it
  // Downloading into a device buffer as if it were host memory faults too.
  Buffer other = device_->alloc(MemCategory::params, 16, Buffer::Fill::zero);
  EXPECT_DEATH(device_->download(other.data(), b.data(), 16), "");
}

TEST_F(CpuAsDeviceTest, ABufferClosesAgainOnceEveryCallOnItHasReturned) {
  Buffer b = device_->alloc(MemCategory::workspace, 8 << 10, Buffer::Fill::zero);  // two pages
  device_->zero(b.data(), b.bytes());
  device_->copy(b.as<char>() + 4096, b.data(), 64);  // both pointers in one buffer: opened twice
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  volatile char* tail = b.as<char>() + 5000;
  EXPECT_DEATH((void)*tail, "");
}

TEST(CpuBackendTest, TheHostBackendsBuffersAreHostMemory) {
  MemoryPool memory;
  const std::unique_ptr<Backend> cpu = make_cpu_backend(memory);
  Buffer b = cpu->alloc(MemCategory::params, 16, Buffer::Fill::zero);
  b.f32()[2] = 3.0f;
  EXPECT_EQ(cpu->sum_squares(b.f32(), 4), 9.0);
}

}  // namespace
}  // namespace shardlm::kernels
