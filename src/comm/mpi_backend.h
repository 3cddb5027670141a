// The MPI backend: MpiCommunicator (the process set-up, init_mpi / finalize_mpi / abort_job, is
// declared in comm/process.h, free of MPI's headers), whose collectives are nonblocking MPI calls or point-to-point schedules built on MPI_Isend /
// MPI_Irecv, chosen per collective by measurement (bench/comm_bench.cc).
//
// Progress. Open MPI moves nonblocking operations only inside MPI calls, and our schedules
// advance only when they are tested. Every test of any MPI Work (Work::is_completed, each poll of
// Work::wait) therefore also gives one progress step to every other pending schedule of the
// process, whichever thread tests and whichever communicator it belongs to. A thread that waits
// on a collective (the executor's comm thread) thus drives all collectives in flight while other
// threads compute; nothing moves while no thread tests any Work.
//
// Algorithms (MpiOptions; `automatic` resolves as below). Chosen from bench/comm_bench.cc on this
// machine (2 shared cores, Open MPI 4.1.4, shared memory with CMA single-copy), fp32, 2–4 ranks,
// 4/16/64 MiB. Open MPI's nonblocking reductions are far off: MPI_Ireduce_scatter_block
// (= its blocking twin) reached 0.1–0.15 GB/s bus bandwidth at 16–64 MiB, MPI_Iallreduce
// 0.2–0.35 GB/s at 64 MiB, against 1.5–4.5 GB/s for the point-to-point schedules here:
//   all_gather      direct   each rank copies its block into place and sends it from there to
//                            every peer (≈ MPI_Allgather; 5–20% ahead of ring; beats
//                            MPI_Iallgather)
//   reduce_scatter  direct   chunked pairwise exchange, each chunk summed on arrival (ties with
//                            ring at 2–3 ranks, ring up to 20% ahead at 4 oversubscribed ranks
//                            and 64 MiB; 10–30× MPI_Ireduce_scatter_block at ≥ 16 MiB)
//   all_reduce      direct   direct reduce-scatter in place, then direct all-gather (ties with
//                            ring; ≥ 10× MPI_Iallreduce at 64 MiB)
//   all_to_all      direct   (ties with MPI_Ialltoall / MPI_Alltoall); all_to_all_v follows the
//                            all_to_all setting (native: MPI_Ialltoallv)
//   broadcast       direct   the root sends to every rank (≥ MPI_Ibcast)
//   barrier, send, recv: MPI_Ibarrier, MPI_Isend, MPI_Irecv.
// Where direct and ring tie, direct wins on accuracy: a bf16 sum is rounded once, not at every
// hop. Above kDirectMaxRanks ranks, automatic picks ring for all_gather, reduce_scatter and
// all_reduce and native for all_to_all and broadcast: direct keeps size−1 messages per rank in
// flight and its reduce-scatter staging grows with size (not measured at that scale here).
//
// bf16 sums: `direct` adds each element's size contributions in fp32 in rank order and rounds
// once; `ring` forwards bf16 partial sums, so each hop rounds (size−1 roundings, order starting
// at the rank after the block's owner); `native` uses a user-defined MPI_Op (commutative) that
// widens both operands to fp32, adds and rounds to nearest even, in whatever order Open MPI's
// algorithm combines them.
#pragma once

#include <mpi.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "comm/communicator.h"
#include "comm/options.h"
#include "comm/process.h"
#include "tensor/memory.h"

namespace shardlm::comm {

inline constexpr int kDirectMaxRanks = 16;

class StagingPool;

class MpiCommunicator final : public Communicator {
 public:
  // A communicator over a duplicate of `comm` (by default every rank of the job). Needs
  // init_mpi(). Collective over `comm` (MPI_Comm_dup). Destroy it only once its collectives have
  // completed (the point-to-point schedules still post messages on it until then). Its staging
  // buffers, and those of the communicators split from it, come from `memory` (which must
  // outlive them).
  explicit MpiCommunicator(MemoryPool& memory, MpiOptions options = {}, MPI_Comm comm = MPI_COMM_WORLD);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count_per_rank,
                                   DType dtype, const std::string& label) override;
  using Communicator::all_reduce;
  using Communicator::reduce_scatter;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count_per_rank,
                                       DType dtype, const std::string& label, Scratch scratch) override;
  std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype, const std::string& label,
                                   Scratch scratch) override;
  int64_t scratch_bytes(Reduction op, int64_t count, DType dtype, int group_size) const override {
    return mpi_scratch_bytes(options_, op, count, dtype, group_size);
  }
  std::shared_ptr<Work> broadcast(void* buf, int64_t count, DType dtype, int root,
                                  const std::string& label) override;
  std::shared_ptr<Work> barrier(const std::string& label) override;
  std::shared_ptr<Work> all_to_all(const void* send, void* recv, int64_t count_per_rank,
                                   DType dtype, const std::string& label) override;
  // Runs with the all_to_all algorithm (MpiOptions::all_to_all): direct (one message per peer
  // with a non-zero count, split at 2^30 elements, so any count fits; a peer that sends fewer
  // elements than recv_counts says is an Error naming it) or native (MPI_Ialltoallv; counts and
  // displacements over INT_MAX elements are refused). Neither stages anything.
  std::shared_ptr<Work> all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                     const std::vector<int64_t>& send_displs, void* recv,
                                     const std::vector<int64_t>& recv_counts,
                                     const std::vector<int64_t>& recv_displs, DType dtype,
                                     const std::string& label) override;
  std::shared_ptr<Work> send(const void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  std::shared_ptr<Work> recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  // The lowest MPI_COMM_WORLD rank of this rank's MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)
  // group: Open MPI groups there the ranks whose daemon is on one node, the node --host or the
  // hostfile named.
  int machine() override;

  const MpiOptions& options() const { return options_; }
  // The algorithm `automatic` stands for on this communicator (resolve_algorithm).
  Algorithm resolve(const std::string& collective, Algorithm requested) const {
    return resolve_algorithm(collective, requested, size_);
  }
  // The MPI communicator the collectives run on (user sends and receives too).
  MPI_Comm mpi_comm() const { return comm_; }
  // Frees the idle staging buffers the point-to-point algorithms keep for reuse when a caller
  // gives no Scratch (charged to MemCategory::comm while kept).
  void release_staging();

 private:
  struct Adopt {};
  MpiCommunicator(Adopt, MPI_Comm owned, MpiOptions options, MemoryPool& memory);
  void set_up();
  int next_tag_base();
  MPI_Op sum_op(DType t) const;  // MPI's own for fp32, bf16_sum_ for bf16

  MpiOptions options_;
  MemoryPool& memory_;
  MPI_Comm comm_ = MPI_COMM_NULL;      // collectives and user point-to-point
  MPI_Comm sched_comm_ = MPI_COMM_NULL;  // the point-to-point algorithms' own messages
  int rank_ = 0, size_ = 1;
  int tag_blocks_ = 1;
  std::mutex issue_mu_;
  uint64_t seq_ = 0;
  std::shared_ptr<StagingPool> pool_;
  MPI_Op bf16_sum_ = MPI_OP_NULL;  // this communicator's own: no process-wide op to create and free
};

}  // namespace shardlm::comm
