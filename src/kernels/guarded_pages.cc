#include "kernels/guarded_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace shardlm::kernels {

namespace {
size_t whole_pages(size_t bytes) {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

void protect(uintptr_t base, size_t bytes, int prot) {
  if (::mprotect(reinterpret_cast<void*>(base), bytes, prot) != 0)
    throw std::runtime_error(std::string("cpu-as-device: mprotect failed: ") + std::strerror(errno));
}
}  // namespace

Buffer GuardedPages::alloc(MemoryPool& pool, MemCategory category, size_t bytes) {
  if (bytes == 0) return Buffer();
  const size_t len = whole_pages(bytes);
  void* p = ::mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  {
    std::lock_guard<std::mutex> lock(mu_);
    maps_[reinterpret_cast<uintptr_t>(p)] = {len, 0};
  }
  return Buffer::adopt(pool, category, p, bytes, *this);
}

void GuardedPages::give_back(void* data, size_t) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = maps_.find(reinterpret_cast<uintptr_t>(data));
  if (it == maps_.end()) return;
  ::munmap(data, it->second.bytes);
  maps_.erase(it);
}

bool GuardedPages::holds(const void* p) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = maps_.upper_bound(a);
  if (it == maps_.begin()) return false;
  --it;
  return a < it->first + it->second.bytes;
}

uintptr_t GuardedPages::enter(const void* p) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = maps_.upper_bound(a);
  if (it == maps_.begin()) return 0;
  --it;
  if (a >= it->first + it->second.bytes) return 0;
  if (it->second.opened++ == 0) protect(it->first, it->second.bytes, PROT_READ | PROT_WRITE);
  return it->first;
}

void GuardedPages::leave(uintptr_t base) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = maps_.find(base);
  if (it == maps_.end()) return;  // freed while open (a call's own scratch): its pages are gone
  if (--it->second.opened == 0) protect(it->first, it->second.bytes, PROT_NONE);
}

GuardedPages::Open::~Open() {
  if (pages_ == nullptr) return;
  for (uintptr_t b : bases_) pages_->leave(b);
}

}  // namespace shardlm::kernels
