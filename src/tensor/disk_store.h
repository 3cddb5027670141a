// The disk tier: scratch files holding state that does not stay in memory (--offload). Each file
// is created fresh (an old one of the same name is replaced: offload files are never trusted
// across runs) and removed when the store goes, on error exits too (a process killed with -9
// leaves them, and the next run replaces them).
//
// I/O is direct (O_DIRECT) so the page cache neither hides the disk's cost nor holds a second
// copy of what was offloaded, issued through io_uring in chunks kept in flight together. Where
// the kernel refuses io_uring (old kernels, seccomp in containers) plain pread/pwrite do the same
// work; where the filesystem refuses O_DIRECT (tmpfs) the file is opened buffered. describe()
// says which. Offsets, lengths and buffer addresses must be multiples of kDiskAlign (Buffers of
// >= 4 KiB from a MemoryPool are).
//
// Every failure throws std::runtime_error with one line naming the file: a write refused (disk
// full, file size limit), a read error, a file deleted or truncated under the run, or bytes read
// back that are not what was written there (each write's XXH3 checksum is kept and a read of the
// same range compares against it; a range never written must read as the zeros of creation). The
// size check alone misses a truncation that lands between it and a write past the cut: that
// write extends the file again and leaves zeros behind it, which a later read would take for data.
// Reads are of ranges written whole before (or never written): a read that covers part of an
// earlier write is a caller's error (std::logic_error).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensor/offload_store.h"

namespace shardlm {

inline constexpr int64_t kDiskAlign = 4096;
inline int64_t disk_aligned(int64_t bytes) { return (bytes + kDiskAlign - 1) / kDiskAlign * kDiskAlign; }

struct DiskStoreOptions {
  bool try_uring = true;   // false: pread/pwrite only
  bool try_direct = true;  // false: buffered files only
  // Test seam (faults enter as data, never from the environment): asked before each read of
  // `bytes` at `offset` of a file; true makes that read fail as a disk's I/O error (EIO) would.
  std::function<bool(const std::string& path, int64_t offset, int64_t bytes)> read_fault;
  // Whether the directory goes with the store (when empty). Unset: when the store made it. Set by
  // a caller whose processes share one directory: it is theirs if it was not there before any of
  // them started, whichever happened to make it.
  std::optional<bool> remove_dir;
};

class DiskStore final : public OffloadStore {
 public:
  // Files go in `dir` (created if missing; removed at the end, when empty, if it is the store's:
  // DiskStoreOptions::remove_dir). `owner` names the store's lock file (DIR/OWNER.lock,
  // held with flock for the store's life and released by the kernel however the process ends):
  // a second live run given the same directory and owner is refused instead of replacing the
  // first one's files.
  explicit DiskStore(std::string dir, DiskStoreOptions options = {}, const std::string& owner = "store");
  ~DiskStore() override;
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  // Creates file `name` in the directory, replacing any old one, and writes `bytes` (a multiple of
  // kDiskAlign) of zeros to it, so running out of space shows at once; returns its handle.
  int create(const std::string& name, int64_t bytes) override;
  void read(int file, int64_t offset, void* dst, int64_t bytes) override;
  void write(int file, int64_t offset, const void* src, int64_t bytes) override;
  const std::string& path(int file) const { return files_.at(file).path; }
  const std::string& dir() const { return dir_; }
  // "io_uring, O_DIRECT", "pread/pwrite, buffered (the filesystem refused O_DIRECT)", ...
  std::string describe() const;
  std::string where() const override { return "on disk under " + dir_ + " (" + describe() + ")"; }
  int64_t bytes_read() const override { return read_; }
  int64_t bytes_written() const override { return written_; }

 private:
  struct Written {
    int64_t bytes;
    uint64_t checksum;  // of the transfer (disk_store.cc: transfer_checksum)
  };
  struct File {
    std::string path;
    int fd = -1;
    int64_t bytes = 0;
    int64_t whole = 0;  // the size it must have: `bytes` once written out at creation
    bool direct = false;
    std::map<int64_t, Written> written;  // by offset: each write since creation, none overlapping
  };
  void transfer(bool is_write, int file, int64_t offset, void* buf, int64_t bytes);
  // `sums`: each chunk's checksum, filled where it is not empty (chunk_checksum).
  void transfer_uring(bool is_write, File& f, int64_t offset, char* buf, int64_t bytes, std::vector<uint64_t>& sums);
  void transfer_plain(bool is_write, File& f, int64_t offset, char* buf, int64_t bytes);
  void check_file(const File& f) const;
  static std::map<int64_t, Written>::const_iterator first_ending_past(const File& f, int64_t offset);
  void record_write(File& f, int64_t offset, int64_t bytes, uint64_t checksum);
  void verify_read(const File& f, int64_t offset, const void* dst, int64_t bytes, uint64_t checksum) const;

  std::string dir_;
  DiskStoreOptions options_;
  std::string lock_path_;
  int lock_fd_ = -1;
  std::vector<File> files_;
  struct Ring;
  std::unique_ptr<Ring> ring_;  // null: io_uring refused, pread/pwrite
  std::string uring_refused_;   // why, for describe()
  bool direct_refused_ = false;
  bool remove_dir_ = false;  // the directory is the store's (or its caller's run's): rmdir at the end
  bool unlocked_ = false;  // the filesystem keeps no locks: a second run on the dir is not refused
  std::mutex mu_;  // one ring, used by the copy stream and, between steps, the caller's thread
  int64_t read_ = 0, written_ = 0;
};

}  // namespace shardlm
