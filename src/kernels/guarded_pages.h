// The CPU-as-device backend's "device memory": host pages the host code cannot reach. Each buffer
// is a mapping of its own, kept PROT_NONE except while a backend call (a kernel, an upload, a
// download, a copy) works on it, so host code that reads or writes a device buffer in place
// faults here as it would on a GPU, instead of passing because the memory happens to be the host's.
//
// Granularity: a call opens only the mappings its pointers fall in, each counted (two threads'
// calls may share a buffer), and the last to leave closes it again: two mprotect calls per buffer
// per backend call. Their cost grows with the buffer's pages, and every kernel on a unit's weights
// points into the whole flat parameter buffer: tiny's steps (B4 T64, one thread) take 21.6 ms
// instead of 3.7, small's 1760 ms instead of 302 (the kernel's page-table walk is 60% of the
// time). The tests' tiny models afford it; opening only the bytes a call reaches (its shapes
// give them) would cost in proportion to the work. A whole arena toggled around every call would
// let host code on another thread through while any kernel runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "tensor/memory.h"

namespace shardlm::kernels {

class GuardedPages final : public Buffer::Owner {
 public:
  GuardedPages() = default;
  GuardedPages(const GuardedPages&) = delete;
  GuardedPages& operator=(const GuardedPages&) = delete;

  // A zero-filled buffer of its own pages, closed; charged to `pool` like any buffer.
  Buffer alloc(MemoryPool& pool, MemCategory category, size_t bytes);
  void give_back(void* data, size_t bytes) override;

  // Whether p lies in a live buffer of these pages.
  bool holds(const void* p) const;

  // Opens, for its lifetime, the buffers of the pointers given (pointers elsewhere, and
  // non-pointer arguments, are ignored).
  class Open {
   public:
    Open() = default;
    Open(const GuardedPages* pages, std::vector<uintptr_t> bases) : pages_(pages), bases_(std::move(bases)) {}
    ~Open();
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;
    Open(Open&& o) noexcept : pages_(o.pages_), bases_(std::move(o.bases_)) { o.pages_ = nullptr; }

   private:
    const GuardedPages* pages_ = nullptr;
    std::vector<uintptr_t> bases_;
  };
  template <class... A>
  Open open(const A&... args) const {
    std::vector<uintptr_t> bases;
    (add(bases, args), ...);
    return Open(this, std::move(bases));
  }
  // The pointers of a host array of `n` device pointers (the experts' weights).
  template <class T>
  Open open_each(T* const* ptrs, int64_t n) const {
    std::vector<uintptr_t> bases;
    for (int64_t i = 0; i < n; ++i) add(bases, ptrs[i]);
    return Open(this, std::move(bases));
  }

 private:
  struct Mapping {
    size_t bytes;  // whole pages
    int opened = 0;
  };
  template <class T>
  void add(std::vector<uintptr_t>& bases, const T& arg) const {
    if constexpr (std::is_pointer_v<T>) {
      if (arg == nullptr) return;
      const uintptr_t b = enter(reinterpret_cast<const void*>(arg));
      if (b != 0) bases.push_back(b);
    }
  }
  uintptr_t enter(const void* p) const;  // the mapping's base, opened once more (0: not ours)
  void leave(uintptr_t base) const;

  mutable std::mutex mu_;
  mutable std::map<uintptr_t, Mapping> maps_;  // by base address
};

}  // namespace shardlm::kernels
