// Memory accounting: every byte the engine allocates is tagged with a category, and the
// tracker keeps live bytes per category plus a snapshot taken when the total last peaked.
// `mem` in metrics.jsonl and the plan's memory figures are read from here, never estimated.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace shardlm {

// snapshot: in-memory snapshots' shared memory (ckpt/snapshot.h), held between steps.
// staging: a copy of the rank's shard that a checkpoint writes in the background (--async-save),
// and the writer's direct-I/O block buffer (kCheckpointIoBytes).
enum class MemCategory : int { params, grads, optimizer, activations, comm, workspace, snapshot, staging };

// The background checkpoint writer's block buffer: the file goes out through it with O_DIRECT.
inline constexpr int64_t kCheckpointIoBytes = int64_t{8} << 20;
inline constexpr int kNumMemCategories = 8;
const char* to_string(MemCategory c);

// Bytes per category at one moment; `total` is their sum.
struct MemSnapshot {
  std::array<int64_t, kNumMemCategories> bytes{};
  int64_t total = 0;
  int64_t operator[](MemCategory c) const { return bytes[static_cast<int>(c)]; }
};

// One run's accounting (a MemoryPool's), thread-safe. Allocation is rare (buffers are made once
// per run or step), so a mutex is cheap and keeps the peak snapshot consistent with the live counts.
class MemoryTracker {
 public:
  void on_alloc(MemCategory c, int64_t bytes);
  void on_free(MemCategory c, int64_t bytes);
  MemSnapshot live() const;
  // Per-category bytes at the moment `total` was highest since the last reset_peak().
  MemSnapshot peak() const;
  // Each category's own highest bytes since the last reset_peak() (they need not coincide;
  // `total` is their sum).
  MemSnapshot peak_each() const;
  // Starts a new peak window (e.g. one training step) at the current live bytes.
  void reset_peak();
  // The highest total since the tracker was made (never reset).
  int64_t run_peak() const;

 private:
  mutable std::mutex mu_;
  MemSnapshot live_, peak_, peak_each_;
  int64_t run_peak_ = 0;
};

class BlockCache;

// Where a run's buffers come from and what they are charged to: the tracker, and a cache of freed
// host blocks keyed by size. A step frees and re-allocates the same gathered-unit and gradient
// buffers every time, and fresh pages from the kernel would cost a page fault per 4 KiB each time.
// The tracker counts bytes in use, not bytes cached, so the cache holds at most run_peak() − live
// bytes plus a margin (5% of the peak + 64 MiB): what is resident stays within that margin of the
// accounted peak.
//
// Made by whoever owns a run (the command, a test) and passed to what allocates (the backend, the
// communicator, the checkpoint writers). Every Buffer charged to a pool must be released before
// the pool is destroyed. Not copyable or movable: buffers point to it.
class MemoryPool {
 public:
  MemoryPool();
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  MemoryTracker& tracker() { return tracker_; }
  const MemoryTracker& tracker() const { return tracker_; }

 private:
  friend class Buffer;
  friend class Arena;
  void* take(size_t bytes);
  void give(void* data, size_t bytes);

  MemoryTracker tracker_;
  std::unique_ptr<BlockCache> cache_;
};

// An owning, 64-byte (from 4 KiB up, 4 KiB: direct I/O) aligned allocation charged to one category of a MemoryPool. Move-only.
// Zero-filled unless asked not to be (buffers a collective overwrites whole).
class Buffer {
 public:
  enum class Fill { zero, none };
  Buffer() = default;
  Buffer(MemoryPool& pool, MemCategory category, size_t bytes, Fill fill = Fill::zero);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Memory another allocator owns (the CUDA backend's device blocks, a shared-memory mapping):
  // charged to the pool's tracker like any buffer, and handed to `owner.give_back(data, bytes)`
  // instead of the host cache on release. The owner must outlive the buffer.
  class Owner {
   public:
    virtual void give_back(void* data, size_t bytes) = 0;

   protected:
    ~Owner() = default;
  };
  static Buffer adopt(MemoryPool& pool, MemCategory category, void* data, size_t bytes, Owner& owner);

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  float* f32() const { return static_cast<float*>(data_); }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::workspace;
  MemoryPool* pool_ = nullptr;
  Owner* owner_ = nullptr;  // null: a host block of pool_'s cache
};

// One host block whose parts are handed out as Buffers at offsets a plan laid out
// (plan/arena.h): each part is charged to its category while it lives, the block itself to
// nothing. Kept from step to step, so its pages stay mapped and are never faulted in again.
// Not thread-safe: the caller serialises part() and reserve(); parts are released anywhere.
class Arena final : public Buffer::Owner {
 public:
  explicit Arena(MemoryPool& pool) : pool_(pool) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Makes the block at least `bytes` long, replacing a shorter one; no part may be alive then.
  void reserve(int64_t bytes);
  // `bytes` at `offset` of the block (offset + bytes within it), as a buffer of `category`.
  Buffer part(MemCategory category, int64_t offset, size_t bytes, Buffer::Fill fill);
  int64_t bytes() const { return bytes_; }

 private:
  void give_back(void* data, size_t bytes) override;  // the bytes stay in the block
  void drop();
  MemoryPool& pool_;
  char* block_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace shardlm
