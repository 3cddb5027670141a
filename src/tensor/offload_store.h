// Where offloaded state and saved activations live between their uses (--offload, a
// --memory-budget placement): fixed-size scratch "files" read and written at offsets, from the
// copy stream and, between steps, the caller's thread. A host-memory backend's tier is the disk
// (tensor/disk_store.h); a device's is host memory (run/host_store.h).
#pragma once

#include <cstdint>
#include <string>

namespace shardlm {

class OffloadStore {
 public:
  virtual ~OffloadStore() = default;
  // Makes file `name` of `bytes` bytes (a multiple of kDiskAlign), zero-filled; returns its handle.
  virtual int create(const std::string& name, int64_t bytes) = 0;
  // Moves `bytes` between the file at `offset` and the backend's memory at dst / src.
  virtual void read(int file, int64_t offset, void* dst, int64_t bytes) = 0;
  virtual void write(int file, int64_t offset, const void* src, int64_t bytes) = 0;
  // Where the files are and how they move, for the run's header ("on disk under DIR (io_uring,
  // O_DIRECT)", "in host memory ...").
  virtual std::string where() const = 0;
  // Bytes moved since the store was made.
  virtual int64_t bytes_read() const = 0;
  virtual int64_t bytes_written() const = 0;
};

}  // namespace shardlm
