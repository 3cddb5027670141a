#include "tensor/memory.h"

#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <cstdlib>
#include <map>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
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
    case MemCategory::snapshot: return "snapshot";
    case MemCategory::staging: return "staging";
  }
  return "?";
}

void MemoryTracker::on_alloc(MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.bytes[static_cast<int>(c)] += bytes;
  live_.total += bytes;
  if (live_.total > peak_.total) peak_ = live_;
  if (live_.total > run_peak_) run_peak_ = live_.total;
  const int i = static_cast<int>(c);
  if (live_.bytes[i] > peak_each_.bytes[i]) {
    peak_each_.total += live_.bytes[i] - peak_each_.bytes[i];
    peak_each_.bytes[i] = live_.bytes[i];
  }
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

MemSnapshot MemoryTracker::peak_each() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_each_;
}

int64_t MemoryTracker::run_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return run_peak_;
}

void MemoryTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = peak_each_ = live_;
}

// Freed blocks by rounded size, for reuse; freed when the pool goes.
class BlockCache {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static constexpr bool kEnabled = false;  // let the sanitizers see every free
#else
  static constexpr bool kEnabled = true;
#endif

 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache() {
    for (auto& [rounded, block] : free_) std::free(block.p);
  }
  // Frees every cached block (their pages go back to the system).
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rounded, block] : free_) std::free(block.p);
    free_.clear();
    cached_ = 0;
  }
  void* take(size_t rounded) {
    if (kEnabled) {
      std::lock_guard<std::mutex> lock(mu_);
      if (void* p = take_cached(rounded)) return p;
    }
    return fresh(rounded);
  }
  // Keeps the block unless the cache would then hold more than `limit` bytes (counted as the
  // tracker counts them, unrounded, so a set of blocks freed together always fits back); evicts
  // the largest blocks first (a step's sizes repeat, so what is evicted stopped being asked for).
  void give(void* p, size_t rounded, size_t bytes, int64_t limit) {
    if (!kEnabled) return std::free(p);
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(rounded, Block{p, bytes});
    cached_ += static_cast<int64_t>(bytes);
    while (cached_ > limit && !free_.empty()) {
      auto last = std::prev(free_.end());
      cached_ -= static_cast<int64_t>(last->second.bytes);
      std::free(last->second.p);
      free_.erase(last);
    }
  }
  // Large blocks are 2 MiB aligned and asked to be backed by huge pages: a first touch then
  // faults once per 2 MiB instead of once per 4 KiB, which under a hypervisor is most of the cost
  // of a freshly allocated gradient or gathered buffer.
  static void* fresh(size_t rounded) {
    const bool huge = rounded >= kHugeFrom;
    // 4 KiB: what direct I/O asks of a buffer (the disk tier reads and writes plan buffers).
    const size_t alignment = huge ? kHugePage : rounded >= 4096 ? 4096 : 64;
    void* p = std::aligned_alloc(alignment, (rounded + alignment - 1) / alignment * alignment);
    if (!p) throw std::bad_alloc();
    if (huge) madvise(p, rounded, MADV_HUGEPAGE);
    return p;
  }
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kHugeFrom = size_t{4} << 20;

  void* take_cached(size_t rounded) {
    auto it = free_.find(rounded);
    if (it == free_.end()) return nullptr;
    void* p = it->second.p;
    cached_ -= static_cast<int64_t>(it->second.bytes);
    free_.erase(it);
    return p;
  }

 private:
  std::mutex mu_;
  struct Block {
    void* p;
    size_t bytes;  // as the tracker counted it
  };
  std::multimap<size_t, Block> free_;
  int64_t cached_ = 0;
};

namespace {
size_t rounded_size(size_t bytes) { return (bytes + 63) / 64 * 64; }
}  // namespace

MemoryPool::MemoryPool() : cache_(std::make_unique<BlockCache>()) {}
MemoryPool::~MemoryPool() = default;

void* MemoryPool::take(size_t bytes) { return cache_->take(rounded_size(bytes)); }

void MemoryPool::give(void* data, size_t bytes) {
  // Phases of a step (blocks, head, evaluation) free sets of sizes the others do not ask for; a
  // margin of 5% of the peak + 64 MiB keeps them all cached without letting the cache grow past it.
  const int64_t peak = tracker_.run_peak();
  cache_->give(data, rounded_size(bytes), bytes, peak - tracker_.live().total + peak / 20 + (64 << 20));
}

Buffer::Buffer(MemoryPool& pool, MemCategory category, size_t bytes, Fill fill)
    : bytes_(bytes), category_(category), pool_(&pool) {
  if (bytes == 0) return;
  data_ = pool.take(bytes);
  if (fill == Fill::zero) std::memset(data_, 0, rounded_size(bytes));
  pool.tracker().on_alloc(category_, static_cast<int64_t>(bytes_));
}

Buffer Buffer::adopt(MemoryPool& pool, MemCategory category, void* data, size_t bytes, Owner& owner) {
  Buffer b;
  b.category_ = category;
  if (!data) return b;
  b.data_ = data;
  b.bytes_ = bytes;
  b.pool_ = &pool;
  b.owner_ = &owner;
  pool.tracker().on_alloc(category, static_cast<int64_t>(bytes));
  return b;
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      category_(o.category_),
      pool_(std::exchange(o.pool_, nullptr)),
      owner_(std::exchange(o.owner_, nullptr)) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
    pool_ = std::exchange(o.pool_, nullptr);
    owner_ = std::exchange(o.owner_, nullptr);
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  pool_->tracker().on_free(category_, static_cast<int64_t>(bytes_));
  if (owner_) {
    owner_->give_back(data_, bytes_);
  } else {
    pool_->give(data_, bytes_);
  }
  data_ = nullptr;
  bytes_ = 0;
  pool_ = nullptr;
  owner_ = nullptr;
}

// Under AddressSanitizer the block's bytes outside live parts are poisoned, so a kernel that writes
// past its buffer into a free stretch or a part's 4 KiB padding is caught as with separate blocks.
namespace {
#if defined(__SANITIZE_ADDRESS__)
void poison(void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void unpoison(void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
void poison(void*, size_t) {}
void unpoison(void*, size_t) {}
#endif
}  // namespace

Arena::~Arena() { drop(); }

void Arena::drop() {
  if (!block_) return;
  unpoison(block_, static_cast<size_t>(bytes_));
  pool_.give(block_, static_cast<size_t>(bytes_));
  block_ = nullptr;
  bytes_ = 0;
}

void Arena::reserve(int64_t bytes) {
  if (bytes <= bytes_) return;
  drop();
  block_ = static_cast<char*>(pool_.take(static_cast<size_t>(bytes)));
  // The blocks cached so far (start-up's, and the block just dropped) were cached for reuse by
  // step buffers, which the arena now holds: keeping them would only add to the resident set.
  pool_.cache_->clear();
  bytes_ = bytes;
  poison(block_, static_cast<size_t>(bytes_));
}

void Arena::give_back(void* data, size_t bytes) { poison(data, bytes); }

Buffer Arena::part(MemCategory category, int64_t offset, size_t bytes, Buffer::Fill fill) {
  if (offset < 0 || offset + static_cast<int64_t>(bytes) > bytes_)
    throw std::logic_error("arena: a part of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                           " outside the block of " + std::to_string(bytes_));
  if (bytes == 0) return Buffer();
  unpoison(block_ + offset, bytes);
  if (fill == Buffer::Fill::zero) std::memset(block_ + offset, 0, bytes);
  return Buffer::adopt(pool_, category, block_ + offset, bytes, *this);
}

}  // namespace shardlm
