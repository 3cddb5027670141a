// The communicator interface (c10d style): a group of ranks and asynchronous collectives over
// it. Backends: MpiCommunicator (mpi_backend.h), SingleRankCommunicator (single_rank.h);
// make_communicator() (factory.h) picks one. comm knows nothing of models: buffers are bytes,
// counts are elements of a DType.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/work.h"
#include "tensor/dtype.h"

namespace shardlm::comm {

// Caller-owned working memory for a reduction (the MPI backend's chunked schedules stage peers'
// contributions in it). Empty, or smaller than scratch_bytes() asks: the backend takes its own
// from a pool it keeps (MemCategory::comm). A plan gives every reduction its scratch, so the
// memory a step uses is the plan's figure.
struct Scratch {
  void* data = nullptr;
  int64_t bytes = 0;
};

// Rules common to every collective:
//  - Asynchronous: the call issues the collective and returns its Work; the buffers must stay
//    untouched (send) / unread (recv) until the Work completes.
//  - Every rank of the communicator issues the same collectives in the same order with the same
//    count and dtype (MPI's rule). Issue them from one thread, or order the issuing threads
//    yourself; the communicator serialises concurrent calls but cannot order them. Several
//    collectives may be in flight at once (e.g. the all-gather of unit i+1 while the
//    reduce-scatter of unit i runs), and different communicators may be used from different
//    threads concurrently.
//  - `label` says what the collective is for ("all_gather unit h.3 step 7"); it is only used in
//    error messages (TimeoutError).
//  - Counts are in elements; 0 is allowed (the Work is complete at once on every rank).
//  - DTypes: reductions (reduce_scatter, all_reduce) take fp32 and bf16; the data-movement
//    collectives (all_gather, broadcast, all_to_all, all_to_all_v, send, recv) take any DType.
//
// Reduction is a sum. bf16 (stored as uint16, the upper half of an IEEE fp32) has no MPI sum, so
// the backends add bf16 values by widening each to fp32 (exact), adding in fp32 and rounding the
// fp32 result back to bf16 to nearest, ties to even (NaN stays NaN, overflow becomes ±inf).
// How many roundings a result goes through depends on the algorithm (see mpi_backend.h): with
// `direct` each output element is the fp32 sum of all ranks' values in rank order 0..size−1,
// rounded once; with `ring` and `native` partial sums are rounded at every step. Floating-point
// addition is not associative, so sums (fp32 too) depend on the order of the ranks'
// contributions, which is fixed for a given algorithm and size: the same inputs give bit-identical
// results run after run, and all_reduce gives every rank the same bits.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "mpi" or "single".
  virtual std::string backend() const = 0;

  // recv[r·count_per_rank …] = rank r's send, for every r (rank-major). In place allowed:
  // send == recv + rank()·count_per_rank·dtype_size.
  virtual std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count_per_rank,
                                           DType dtype, const std::string& label) = 0;

  // send holds size()·count_per_rank elements; rank r receives the sum over ranks of block r.
  // In place allowed: recv == send + rank()·count_per_rank·dtype_size (the other blocks of send
  // are left unchanged).
  // `scratch` must stay untouched until the Work completes.
  virtual std::shared_ptr<Work> reduce_scatter(const void* send, void* recv,
                                               int64_t count_per_rank, DType dtype,
                                               const std::string& label, Scratch scratch) = 0;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count_per_rank,
                                       DType dtype, const std::string& label) {
    return reduce_scatter(send, recv, count_per_rank, dtype, label, Scratch{});
  }

  // buf = sum over ranks of buf, in place; every rank gets the same bits.
  virtual std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype,
                                           const std::string& label, Scratch scratch) = 0;
  std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype, const std::string& label) {
    return all_reduce(buf, count, dtype, label, Scratch{});
  }

  // Bytes of Scratch a reduction of `count` elements (per rank for reduce_scatter, in all for
  // all_reduce) takes in a group of `group_size` ranks split from this communicator (same
  // options); 0 where it needs none.
  virtual int64_t scratch_bytes(Reduction op, int64_t count, DType dtype, int group_size) const = 0;

  // buf on every rank = buf on `root`.
  virtual std::shared_ptr<Work> broadcast(void* buf, int64_t count, DType dtype, int root,
                                          const std::string& label) = 0;

  virtual std::shared_ptr<Work> barrier(const std::string& label) = 0;

  // recv[r·count_per_rank …] = block rank() of rank r's send. send and recv must not overlap.
  virtual std::shared_ptr<Work> all_to_all(const void* send, void* recv, int64_t count_per_rank,
                                           DType dtype, const std::string& label) = 0;

  // The variable-count all-to-all (MPI_Alltoallv; expert parallelism's token exchange): to each
  // rank j this rank sends send_counts[j] elements from send + send_displs[j] and receives
  // recv_counts[j] elements from j into recv + recv_displs[j] (counts and displacements in
  // elements, each vector of size() entries, all ≥ 0). Counts may be zero, and differ from rank to
  // rank; the collective is called on every rank all the same. Rank i's send_counts[j] must equal
  // rank j's recv_counts[i] (exchange the counts first, see exchange_counts). A mismatch is the
  // caller's error, reported where the backend can: with `direct`, a message shorter than
  // expected is an Error naming the peer, a longer one MPI's truncation Error, one expected from
  // a peer that sends none a TimeoutError; `native` leaves it to MPI. The recv ranges must not
  // overlap each other or the send ranges. Counts and displacements up
  // to 2^31−1 elements each on every algorithm; larger ones only with `direct` (native refuses
  // them, naming the field).
  virtual std::shared_ptr<Work> all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                             const std::vector<int64_t>& send_displs, void* recv,
                                             const std::vector<int64_t>& recv_counts,
                                             const std::vector<int64_t>& recv_displs, DType dtype,
                                             const std::string& label) = 0;

  // Point to point; a send matches the recv on `peer` with the same tag (0 ≤ tag < 2^15), in
  // order. Independent of the collectives (they never match user sends).
  virtual std::shared_ptr<Work> send(const void* buf, int64_t count, DType dtype, int peer,
                                     int tag, const std::string& label) = 0;
  virtual std::shared_ptr<Work> recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                                     const std::string& label) = 0;

  // Sub-communicator of the ranks that pass the same `color` (≥ 0), ranked by (key, rank).
  // A collective call on every rank of this communicator (blocking, like MPI_Comm_split). A
  // negative color returns nullptr for that rank. Hybrid shard with groups of G consecutive
  // ranks: split(rank / G, rank) is the shard group, split(rank % G, rank) the replicate group.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // The machine this rank is on, as the launcher placed the ranks: an id that ranks sharing
  // memory have in common and ranks on different machines do not (the lowest job-wide rank on
  // the machine). Not the kernel a process runs on: hosts that are containers or network
  // namespaces of one kernel are machines of their own when the launcher started them as such.
  // A collective call on every rank of this communicator (blocking, like split).
  virtual int machine() = 0;
};

// Bytes of `count` elements of `dtype`.
inline int64_t bytes_of(int64_t count, DType dtype) { return count * dtype_size(dtype); }

// The usual way into all_to_all_v: every rank tells every other how many elements it will send
// it. Returns recv_counts (entry j: what rank j sends this rank), through a fixed-count all_to_all
// of the counts; blocks until done or `timeout`. Collective: every rank calls it.
std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts,
                                     const std::string& label,
                                     std::chrono::milliseconds timeout = kDefaultTimeout);
// Packed displacements of `counts`: the exclusive prefix sum (0, c0, c0 + c1, …).
std::vector<int64_t> packed_displs(const std::vector<int64_t>& counts);

// Throws Error, one line naming `what`, the field and the entry, unless the vectors of an
// all_to_all_v over `size` ranks each have `size` entries, none negative (the backends' shared
// check).
void check_all_to_all_v(const char* what, int size, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& send_displs, const std::vector<int64_t>& recv_counts,
                        const std::vector<int64_t>& recv_displs);

}  // namespace shardlm::comm
