#include "tensor/disk_store.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "tensor/file_lock.h"

namespace shardlm {

namespace {
// Each transfer is cut into chunks of this size, up to kDepth of them in flight at once: enough
// to keep an NVMe queue busy without one huge request the kernel splits anyway.
constexpr int64_t kChunk = int64_t{1} << 20;
constexpr unsigned kDepth = 16;

std::runtime_error fail(const std::string& path, const std::string& what) {
  return std::runtime_error("offload file " + path + ": " + what);
}
std::string errno_text(int err) { return std::strerror(err); }

int64_t chunks_of(int64_t bytes) { return (bytes + kChunk - 1) / kChunk; }
// A chunk's checksum: XXH3 of the chunk-th kChunk piece of a transfer's buffer. The io_uring path
// takes each while other chunks are in flight, so the disk's wait hides it.
uint64_t chunk_checksum(const char* buf, int64_t bytes, int64_t chunk) {
  const int64_t at = chunk * kChunk;
  return XXH3_64bits(buf + at, static_cast<size_t>(std::min(kChunk, bytes - at)));
}
// A transfer's: XXH3 of its chunks' in order, so a write and a read of the same range agree
// whichever path each took.
uint64_t transfer_checksum(const std::vector<uint64_t>& chunks) {
  return XXH3_64bits(chunks.data(), chunks.size() * sizeof(uint64_t));
}
}  // namespace

struct DiskStore::Ring {
  io_uring ring{};
  ~Ring() { io_uring_queue_exit(&ring); }
};

DiskStore::DiskStore(std::string dir, DiskStoreOptions options, const std::string& owner)
    : dir_(std::move(dir)), options_(options) {
  std::error_code ec;
  const bool made = std::filesystem::create_directories(dir_, ec);
  if (ec) throw std::runtime_error("offload dir " + dir_ + ": cannot create it: " + ec.message());
  remove_dir_ = options_.remove_dir.value_or(made);
  lock_path_ = (std::filesystem::path(dir_) / (owner + ".lock")).string();
  lock_fd_ = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) throw std::runtime_error("offload dir " + dir_ + ": cannot create " + lock_path_ + ": " + errno_text(errno));
  int err = 0;
  switch (lock_exclusive(lock_fd_, err)) {
    case FileLock::held:
      break;
    case FileLock::unsupported:
      unlocked_ = true;
      break;
    case FileLock::busy:
      ::close(lock_fd_);
      throw std::runtime_error("offload dir " + dir_ + ": " + lock_path_ +
                               " is held by another live run; give each run its own --offload-dir");
    case FileLock::failed:
      ::close(lock_fd_);
      throw std::runtime_error("offload dir " + dir_ + ": cannot lock " + lock_path_ + ": " + errno_text(err));
  }
  if (!options_.try_uring) {
    uring_refused_ = "not asked for";
    return;
  }
  auto ring = std::make_unique<Ring>();
  if (const int rc = io_uring_queue_init(kDepth, &ring->ring, 0); rc < 0) {
    uring_refused_ = "the kernel refused io_uring: " + errno_text(-rc);
    return;
  }
  ring_ = std::move(ring);
}

DiskStore::~DiskStore() {
  for (File& f : files_) {
    if (f.fd >= 0) ::close(f.fd);
    ::unlink(f.path.c_str());
  }
  if (lock_fd_ >= 0) {
    ::unlink(lock_path_.c_str());
    ::close(lock_fd_);
  }
  if (remove_dir_) ::rmdir(dir_.c_str());  // only if empty: the directory may hold other things
}

std::string DiskStore::describe() const {
  std::string s = ring_ ? "io_uring" : "pread/pwrite (" + uring_refused_ + ")";
  s += direct_refused_ ? ", buffered (the filesystem refused O_DIRECT)" : options_.try_direct ? ", O_DIRECT" : ", buffered";
  return unlocked_ ? s + ", unlocked (the filesystem keeps no file locks)" : s;
}

int DiskStore::create(const std::string& name, int64_t bytes) {
  if (bytes % kDiskAlign != 0) throw std::logic_error("disk store: " + name + "'s size is not a multiple of 4 KiB");
  File f;
  f.path = (std::filesystem::path(dir_) / name).string();
  ::unlink(f.path.c_str());  // never reuse what an earlier run left
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (options_.try_direct && !direct_refused_) {
    f.fd = ::open(f.path.c_str(), flags | O_DIRECT, 0600);
    if (f.fd >= 0) f.direct = true;
    else if (errno == EINVAL) direct_refused_ = true;
    else throw fail(f.path, "cannot create: " + errno_text(errno));
  }
  if (f.fd < 0) {
    f.fd = ::open(f.path.c_str(), flags, 0600);
    if (f.fd < 0) throw fail(f.path, "cannot create: " + errno_text(errno));
  }
  f.bytes = bytes;
  files_.push_back(f);
  const int id = static_cast<int>(files_.size()) - 1;
  // Written through, so a disk too small fails here, before the first step.
  void* zeros = std::aligned_alloc(kDiskAlign, kChunk);
  if (!zeros) throw std::bad_alloc();
  std::memset(zeros, 0, kChunk);
  try {
    for (int64_t at = 0; at < bytes; at += kChunk) write(id, at, zeros, std::min(kChunk, bytes - at));
  } catch (...) {
    std::free(zeros);
    throw;
  }
  std::free(zeros);
  files_[id].whole = bytes;
  return id;
}

void DiskStore::read(int file, int64_t offset, void* dst, int64_t bytes) { transfer(false, file, offset, dst, bytes); }

void DiskStore::write(int file, int64_t offset, const void* src, int64_t bytes) {
  transfer(true, file, offset, const_cast<void*>(src), bytes);
}

// A file removed or cut short under the run is named before its data is trusted: the open
// descriptor would still read a deleted file's blocks, and a short read of a truncated one would
// leave stale memory in a window.
void DiskStore::check_file(const File& f) const {
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw fail(f.path, "cannot stat: " + errno_text(errno));
  if (st.st_nlink == 0) throw fail(f.path, "deleted while the run was using it");
  // The file was written out whole at creation: any shorter is a truncation, and a write past a
  // truncated end would silently leave a hole of zeros behind it.
  if (st.st_size < f.whole)
    throw fail(f.path, "is " + std::to_string(st.st_size) + " bytes, should be " + std::to_string(f.whole) +
                           " (truncated while the run was using it)");
}

void DiskStore::transfer(bool is_write, int file, int64_t offset, void* buf, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  File& f = files_.at(file);
  if (offset < 0 || bytes < 0 || offset + bytes > f.bytes)
    throw std::logic_error("disk store: " + f.path + ": [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                           ") is outside the file");
  if (f.direct && (offset % kDiskAlign || bytes % kDiskAlign || reinterpret_cast<uintptr_t>(buf) % kDiskAlign))
    throw std::logic_error("disk store: " + f.path + ": a direct transfer that is not 4 KiB aligned");
  if (bytes == 0) return;
  check_file(f);
  if (!is_write && options_.read_fault && options_.read_fault(f.path, offset, bytes))
    throw fail(f.path, "read failed: " + errno_text(EIO));
  char* data = static_cast<char*>(buf);
  // Creation's zeros are not checksummed: a range never written since is checked as zeros.
  std::vector<uint64_t> sums(f.whole > 0 ? chunks_of(bytes) : 0);
  if (ring_) {
    transfer_uring(is_write, f, offset, data, bytes, sums);
  } else {
    auto sum_chunks = [&] {
      for (size_t c = 0; c < sums.size(); ++c) sums[c] = chunk_checksum(data, bytes, static_cast<int64_t>(c));
    };
    if (is_write) sum_chunks();  // what goes out
    transfer_plain(is_write, f, offset, data, bytes);
    if (!is_write) sum_chunks();  // what came in
  }
  (is_write ? written_ : read_) += bytes;
  if (sums.empty()) return;
  if (is_write) record_write(f, offset, bytes, transfer_checksum(sums));
  else verify_read(f, offset, data, bytes, transfer_checksum(sums));
}

// The first write recorded in `f` that ends past `offset` (the writes do not overlap).
std::map<int64_t, DiskStore::Written>::const_iterator DiskStore::first_ending_past(const File& f, int64_t offset) {
  auto it = f.written.upper_bound(offset);
  if (it != f.written.begin() && std::prev(it)->first + std::prev(it)->second.bytes > offset) --it;
  return it;
}

void DiskStore::record_write(File& f, int64_t offset, int64_t bytes, uint64_t checksum) {
  auto it = first_ending_past(f, offset);
  while (it != f.written.end() && it->first < offset + bytes) it = f.written.erase(it);
  f.written.emplace(offset, Written{bytes, checksum});
}

void DiskStore::verify_read(const File& f, int64_t offset, const void* dst, int64_t bytes, uint64_t checksum) const {
  auto changed = [&] {
    return fail(f.path, "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                            ") read back are not what was written there (checksum): changed while the run was using it");
  };
  const auto it = first_ending_past(f, offset);
  const bool overlaps = it != f.written.end() && it->first < offset + bytes;
  if (overlaps && (it->first != offset || it->second.bytes != bytes))
    throw std::logic_error("disk store: " + f.path + ": a read of [" + std::to_string(offset) + ", +" +
                           std::to_string(bytes) + ") that is not one earlier write");
  if (overlaps) {
    if (checksum != it->second.checksum) throw changed();
    return;
  }
  static const char zeros[kDiskAlign] = {};
  const char* p = static_cast<const char*>(dst);
  for (int64_t at = 0; at < bytes; at += kDiskAlign)
    if (std::memcmp(p + at, zeros, static_cast<size_t>(std::min(kDiskAlign, bytes - at))) != 0) throw changed();
}

void DiskStore::transfer_plain(bool is_write, File& f, int64_t offset, char* buf, int64_t bytes) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = is_write ? ::pwrite(f.fd, buf + done, bytes - done, offset + done)
                               : ::pread(f.fd, buf + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail(f.path, std::string(is_write ? "write" : "read") + " failed: " + errno_text(errno));
    if (n == 0) {
      if (!is_write) check_file(f);  // cut short since the check before it: say so
      throw fail(f.path, is_write ? "write made no progress (disk full?)"
                                  : "read ended early at byte " + std::to_string(offset + done) + " (truncated?)");
    }
    done += n;
  }
}

// Chunks of the transfer, up to kDepth in flight; a short completion (rare: a signal, a
// filesystem boundary) is finished with plain calls.
void DiskStore::transfer_uring(bool is_write, File& f, int64_t offset, char* buf, int64_t bytes,
                               std::vector<uint64_t>& sums) {
  io_uring* ring = &ring_->ring;
  const int64_t chunks = chunks_of(bytes);
  const bool summing = !sums.empty();
  int64_t next = 0, completed = 0;
  std::string error;
  std::vector<int64_t> shortfall;  // chunk index, resumed below
  std::vector<int64_t> got(chunks, 0);
  while (completed < chunks) {
    unsigned queued = 0;
    while (next < chunks && next - completed < kDepth) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (!sqe) break;
      const int64_t at = next * kChunk, len = std::min(kChunk, bytes - at);
      if (is_write && summing) sums[next] = chunk_checksum(buf, bytes, next);  // while earlier chunks fly
      if (is_write) io_uring_prep_write(sqe, f.fd, buf + at, static_cast<unsigned>(len), offset + at);
      else io_uring_prep_read(sqe, f.fd, buf + at, static_cast<unsigned>(len), offset + at);
      io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(next));
      ++next, ++queued;
    }
    if (queued) {
      const int rc = io_uring_submit(ring);
      if (rc < 0) throw fail(f.path, "io_uring submit failed: " + errno_text(-rc));
    }
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(ring, &cqe);
    while (rc == -EINTR) rc = io_uring_wait_cqe(ring, &cqe);
    if (rc < 0) throw fail(f.path, "io_uring wait failed: " + errno_text(-rc));
    const int64_t c = static_cast<int64_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(ring, cqe);
    ++completed;
    const int64_t len = std::min(kChunk, bytes - c * kChunk);
    if (res < 0 && error.empty()) error = std::string(is_write ? "write" : "read") + " failed: " + errno_text(-res);
    else if (res >= 0 && res < len) shortfall.push_back(c), got[c] = res;
    else if (res == len && !is_write && summing) sums[c] = chunk_checksum(buf, bytes, c);  // while later ones fly
  }
  if (!error.empty()) throw fail(f.path, error);
  for (int64_t c : shortfall) {
    const int64_t at = c * kChunk + got[c], len = std::min(kChunk, bytes - c * kChunk) - got[c];
    transfer_plain(is_write, f, offset + at, buf + at, len);
    if (!is_write && summing) sums[c] = chunk_checksum(buf, bytes, c);
  }
}

}  // namespace shardlm
