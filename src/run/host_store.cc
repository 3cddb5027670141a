#include "run/host_store.h"

#include <cstdio>
#include <stdexcept>

namespace shardlm::run {

HostStore::~HostStore() {
  backend_.synchronize();  // no copy from or to a file is still in flight
  for (size_t f = 0; f < files_.size(); ++f)
    if (pinned_[f]) backend_.unpin_host(files_[f].data());
  files_.clear();  // before the pool they are charged to
}

int HostStore::create(const std::string& name, int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("host offload store: " + name + ": negative size");
  std::lock_guard<std::mutex> lock(mu_);
  files_.emplace_back(pool_, MemCategory::staging, static_cast<size_t>(bytes), Buffer::Fill::zero);
  names_.push_back(name);
  pinned_.push_back(backend_.pin_host(files_.back().data(), static_cast<size_t>(bytes)));
  return static_cast<int>(files_.size()) - 1;
}

char* HostStore::at(int file, int64_t offset, int64_t bytes, const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file < 0 || file >= static_cast<int>(files_.size()))
    throw std::logic_error(std::string("host offload store: ") + what + " of file " + std::to_string(file) +
                           ", which was never made");
  const Buffer& f = files_[file];
  if (offset < 0 || bytes < 0 || offset + bytes > static_cast<int64_t>(f.bytes()))
    throw std::logic_error(std::string("host offload store: ") + what + " of " + std::to_string(bytes) + " bytes at " +
                           std::to_string(offset) + " past the end of " + names_[file] + " (" +
                           std::to_string(f.bytes()) + " bytes)");
  return f.as<char>() + offset;
}

// Each copy runs on the copy lane after every kernel issued before it (the one that wrote what a
// write takes, the last reader of the memory a read fills), and the kernels after it do not wait
// for it: a task that reads what it filled waits for its mark (run::Executor).
void HostStore::read(int file, int64_t offset, void* dst, int64_t bytes) {
  using Lane = kernels::Backend::Lane;
  const char* src = at(file, offset, bytes, "read");
  backend_.wait(Lane::copy, backend_.mark(Lane::compute));
  backend_.upload_on(Lane::copy, dst, src, static_cast<size_t>(bytes));
  read_ += bytes;
}

// Returns once the bytes are in the file, as a disk write does: the memory they came from may be
// reused as soon as the task ends.
void HostStore::write(int file, int64_t offset, const void* src, int64_t bytes) {
  using Lane = kernels::Backend::Lane;
  char* dst = at(file, offset, bytes, "write");
  backend_.wait(Lane::copy, backend_.mark(Lane::compute));
  backend_.download_on(Lane::copy, dst, src, static_cast<size_t>(bytes));
  written_ += bytes;
}

std::string HostStore::where() const {
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.1f", host_bytes() / 1048576.0);
  bool all_pinned = true;
  for (bool p : pinned_) all_pinned = all_pinned && p;
  return std::string("in host memory (") + mib + " MiB, " + (all_pinned ? "pinned" : "pageable") + ", copied by the " +
         backend_.name() + " backend)";
}

}  // namespace shardlm::run
