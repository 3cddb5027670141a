#include "tensor/memory.h"

#include <cstdlib>
#include <map>
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

namespace {

// Freed blocks by rounded size, for reuse. Blocks live until the process ends.
class BlockCache {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static constexpr bool kEnabled = false;  // let the sanitizers see every free
#else
  static constexpr bool kEnabled = true;
#endif

 public:
  static BlockCache& global() {
    static BlockCache* cache = new BlockCache;  // never destroyed: buffers may outlive statics
    return *cache;
  }
  void* take(size_t rounded) {
    if (!kEnabled) {
      void* p = std::aligned_alloc(64, rounded);
      if (!p) throw std::bad_alloc();
      return p;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(rounded);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void give(void* p, size_t rounded) {
    if (!kEnabled) return std::free(p);
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(rounded, p);
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
};

size_t rounded_size(size_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

Buffer::Buffer(MemCategory category, size_t bytes, Fill fill) : bytes_(bytes), category_(category) {
  if (bytes == 0) return;
  data_ = BlockCache::global().take(rounded_size(bytes));
  if (fill == Fill::zero) std::memset(data_, 0, rounded_size(bytes));
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
  BlockCache::global().give(data_, rounded_size(bytes_));
  MemoryTracker::global().on_free(category_, static_cast<int64_t>(bytes_));
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace shardlm
