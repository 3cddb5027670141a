#include "tensor/memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace shardlm {

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::params: return "params";
    case MemCategory::grads: return "grads";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::comm: return "comm";
    case MemCategory::workspace: return "workspace";
  }
  return "?";
}

MemoryTracker& MemoryTracker::global() {
  static MemoryTracker tracker;
  return tracker;
}

void MemoryTracker::on_alloc(MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.bytes[static_cast<int>(c)] += bytes;
  live_.total += bytes;
  if (live_.total > peak_.total) peak_ = live_;
}

void MemoryTracker::on_free(MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.bytes[static_cast<int>(c)] -= bytes;
  live_.total -= bytes;
}

MemSnapshot MemoryTracker::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_;
}

MemSnapshot MemoryTracker::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void MemoryTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = live_;
}

Buffer::Buffer(MemCategory category, size_t bytes) : bytes_(bytes), category_(category) {
  if (bytes == 0) return;
  size_t rounded = (bytes + 63) / 64 * 64;
  data_ = std::aligned_alloc(64, rounded);
  if (!data_) throw std::bad_alloc();
  std::memset(data_, 0, rounded);
  MemoryTracker::global().on_alloc(category_, static_cast<int64_t>(bytes_));
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), category_(o.category_) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  std::free(data_);
  MemoryTracker::global().on_free(category_, static_cast<int64_t>(bytes_));
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace shardlm
