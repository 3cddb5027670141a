// A communicator over memory the host cannot address directly (a GPU's), by staging: each
// collective copies its send buffer to host memory, runs on an inner communicator over host
// memory (MPI), and copies the result back. This is how ranks that share one GPU (where NCCL
// refuses to run) train together; it costs two copies per collective and no overlap of those
// copies with the collective.
//
// comm knows nothing of kernels: the copies go through a DeviceCopier, which whoever owns the
// device memory supplies (run/ adapts its kernels::Backend to one).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "tensor/memory.h"

namespace shardlm::comm {

// Copies between host memory and a device's. Callable from any thread the owner has set up
// for the device (the executor's stream threads are).
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // Returns once the bytes are in host memory (so every earlier write of the device's to
  // `device_src` that the copier's ordering covers is in them).
  virtual void to_host(void* host_dst, const void* device_src, size_t bytes) const = 0;
  // Returns once `host_src` may be reused; the device sees the bytes before any work issued
  // after the call.
  virtual void to_device(void* device_dst, const void* host_src, size_t bytes) const = 0;
};

// Every buffer handed to a StagedCommunicator's collectives is device memory (the copier's); the
// inner communicator only ever sees host staging buffers, from `memory`, charged to
// MemCategory::comm while a collective holds them (per collective, so several may be in flight).
// Results reach the device when the Work completes (its wait() or is_completed() makes the copy,
// on the calling thread). A reduction's Scratch is ignored: the inner communicator takes its own
// host scratch (scratch_bytes() says 0, so a plan gives the device none).
// Error and timeout lines are the inner communicator's, its backend named "<inner>+staged".
class StagedCommunicator final : public Communicator {
 public:
  // Wraps `inner` (borrowed: it must outlive this one). `copier` and `memory` must outlive it too.
  StagedCommunicator(Communicator& inner, const DeviceCopier& copier, MemoryPool& memory);
  // Wraps and owns `inner`.
  StagedCommunicator(std::unique_ptr<Communicator> inner, const DeviceCopier& copier, MemoryPool& memory);
  ~StagedCommunicator() override;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return inner_.backend() + "+staged"; }
  Communicator& inner() const { return inner_; }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                   const std::string& label) override;
  using Communicator::all_reduce;
  using Communicator::reduce_scatter;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                       const std::string& label, Scratch scratch) override;
  std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype, const std::string& label,
                                   Scratch scratch) override;
  int64_t scratch_bytes(Reduction, int64_t, DType, int) const override { return 0; }
  std::shared_ptr<Work> broadcast(void* buf, int64_t count, DType dtype, int root,
                                  const std::string& label) override;
  std::shared_ptr<Work> barrier(const std::string& label) override { return inner_.barrier(label); }
  std::shared_ptr<Work> all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                   const std::string& label) override;
  std::shared_ptr<Work> all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                     const std::vector<int64_t>& send_displs, void* recv,
                                     const std::vector<int64_t>& recv_counts,
                                     const std::vector<int64_t>& recv_displs, DType dtype,
                                     const std::string& label) override;
  std::shared_ptr<Work> send(const void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  std::shared_ptr<Work> recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  // A StagedCommunicator over the inner communicator's split (same copier and memory).
  std::unique_ptr<Communicator> split(int color, int key) override;
  int machine() override { return inner_.machine(); }

 private:
  std::shared_ptr<Work> staged(const char* collective, const std::string& label, Buffer host,
                               std::shared_ptr<Work> inner, void* device_dst, size_t host_offset, size_t bytes);
  Buffer host(size_t bytes) const;

  std::unique_ptr<Communicator> owned_;
  Communicator& inner_;
  const DeviceCopier& copier_;
  MemoryPool& memory_;
};

}  // namespace shardlm::comm
