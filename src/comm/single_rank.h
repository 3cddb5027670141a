// A communicator of one rank, for single-process runs and tests: every collective is a local
// copy (or nothing) and is complete when it returns; no MPI is involved.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/options.h"
#include "tensor/memory.h"

namespace shardlm::comm {

class SingleRankCommunicator final : public Communicator {
 public:
  // Messages to oneself are staged in buffers from `memory` (which must outlive it).
  explicit SingleRankCommunicator(MemoryPool& memory);
  ~SingleRankCommunicator() override;

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count_per_rank,
                                   DType dtype, const std::string& label) override;
  using Communicator::all_reduce;
  using Communicator::reduce_scatter;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count_per_rank,
                                       DType dtype, const std::string& label, Scratch scratch) override;
  std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype, const std::string& label,
                                   Scratch scratch) override;
  int64_t scratch_bytes(Reduction, int64_t, DType, int) const override { return 0; }
  std::shared_ptr<Work> broadcast(void* buf, int64_t count, DType dtype, int root,
                                  const std::string& label) override;
  std::shared_ptr<Work> barrier(const std::string& label) override;
  std::shared_ptr<Work> all_to_all(const void* send, void* recv, int64_t count_per_rank,
                                   DType dtype, const std::string& label) override;
  // A copy of send_counts[0] elements; send_counts[0] must equal recv_counts[0].
  std::shared_ptr<Work> all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                     const std::vector<int64_t>& send_displs, void* recv,
                                     const std::vector<int64_t>& recv_counts,
                                     const std::vector<int64_t>& recv_displs, DType dtype,
                                     const std::string& label) override;
  // Messages to oneself (peer 0): a send is copied into a staging buffer (MemCategory::comm)
  // unless a matching recv is already waiting; a recv completes when a send with its tag has
  // been made, in order. A recv that no send matches times out in wait().
  std::shared_ptr<Work> send(const void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  std::shared_ptr<Work> recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  // A new single-rank communicator (nullptr for a negative color).
  std::unique_ptr<Communicator> split(int color, int key) override;
  // The one rank's machine: 0.
  int machine() override { return 0; }

 private:
  struct Mailbox;
  MemoryPool& memory_;
  std::shared_ptr<Mailbox> mailbox_;
};

}  // namespace shardlm::comm
