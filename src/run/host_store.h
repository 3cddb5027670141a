// A device backend's offload tier: each file is a host buffer, pinned where the backend can (so
// the copies run at the link's speed), and its reads and writes are the backend's uploads and
// downloads on its copy lane, after the kernels issued before them (kernels::Backend::Lane; a file
// changes only by a download, which comes after every upload from it on the same lane). The
// buffers are charged to a pool of the store's own (category staging), so the run's tracker keeps
// counting what the device holds, as the plan's figures do; host_bytes() says what the tier holds.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tensor/memory.h"
#include "tensor/offload_store.h"

namespace shardlm::run {

class HostStore final : public OffloadStore {
 public:
  explicit HostStore(const kernels::Backend& backend) : backend_(backend) {}
  ~HostStore() override;
  int create(const std::string& name, int64_t bytes) override;
  void read(int file, int64_t offset, void* dst, int64_t bytes) override;
  void write(int file, int64_t offset, const void* src, int64_t bytes) override;
  std::string where() const override;
  int64_t bytes_read() const override { return read_; }
  int64_t bytes_written() const override { return written_; }
  int64_t host_bytes() const { return pool_.tracker().live().total; }

 private:
  char* at(int file, int64_t offset, int64_t bytes, const char* what);
  const kernels::Backend& backend_;
  MemoryPool pool_;  // declared before the files: they go first
  std::vector<Buffer> files_;
  std::vector<std::string> names_;
  std::vector<bool> pinned_;
  std::mutex mu_;  // create() against the copy stream's lookups
  std::atomic<int64_t> read_{0}, written_{0};
};

}  // namespace shardlm::run
