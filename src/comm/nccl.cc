#include "comm/nccl.h"

#if SHARDLM_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <mutex>
#include <sstream>

namespace shardlm::comm {

namespace {

std::string quoted(const char* collective, const std::string& label) {
  return std::string(collective) + " \"" + label + "\"";
}

void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error("nccl: " + what + ": CUDA error: " + cudaGetErrorString(e));
}

void check_nccl(ncclResult_t r, const std::string& what, ncclComm_t comm) {
  if (r == ncclSuccess) return;
  std::string msg = "nccl: " + what + " failed: " + ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(comm); last && *last) msg += " (" + std::string(last) + ")";
  throw Error(msg);
}

ncclDataType_t reduction_type(DType t, const char* collective) {
  switch (t) {
    case DType::fp32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    default: throw Error(std::string("nccl: ") + collective + " sums fp32 and bf16 only, not " + to_string(t));
  }
}

// What a communicator and its Works share: a Work may outlive the communicator that issued it,
// and polls the communicator's asynchronous error.
struct Handle {
  std::mutex mu;
  ncclComm_t comm = nullptr;  // null once released
  cudaStream_t stream = nullptr;
  int device = 0;
  // Collectives still queued when the communicator goes mean an error path (a timeout, a failure
  // elsewhere on the way out): they are aborted (ncclCommAbort stops NCCL's kernels), where
  // ncclCommDestroy, or a later cudaFree's device synchronisation, would wait for them for ever.
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    if (!comm) return;
    const bool busy = stream && cudaStreamQuery(stream) == cudaErrorNotReady;
    (void)cudaGetLastError();
    if (busy)
      ncclCommAbort(comm);
    else
      ncclCommDestroy(comm);
    comm = nullptr;
  }
  ~Handle() {
    release();
    if (stream) cudaStreamDestroy(stream);
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(const char* collective, const std::string& label, int rank, int size, WaitPolicy policy,
           std::shared_ptr<Handle> handle, cudaEvent_t done)
      : Work(collective, label, rank, size, "nccl", policy), handle_(std::move(handle)), done_(done) {}
  ~NcclWork() override { cudaEventDestroy(done_); }  // released once the event has happened

 protected:
  bool test() override {
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaSuccess) return true;
    const std::string what = quoted(collective().c_str(), label()) + " on rank " + std::to_string(rank());
    if (e != cudaErrorNotReady) check_cuda(e, what);
    std::lock_guard<std::mutex> lock(handle_->mu);
    if (!handle_->comm) throw Error("nccl: " + what + ": its communicator was destroyed (aborted) before it completed");
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(handle_->comm, &async), "ncclCommGetAsyncError", handle_->comm);
    if (async != ncclSuccess && async != ncclInProgress) check_nccl(async, what, handle_->comm);
    return false;
  }

 private:
  std::shared_ptr<Handle> handle_;
  cudaEvent_t done_;
};

}  // namespace

// The communicator itself (see nccl.h for how a collective runs).
class NcclCommunicator final : public Communicator {
 public:
  // `machine`: this rank's machine as the bootstrap communicator found it (NCCL has no query of
  // its own that follows the launcher's placement).
  NcclCommunicator(ncclComm_t comm, int device, cudaStream_t compute, WaitPolicy policy, int machine)
      : handle_(std::make_shared<Handle>()), compute_(compute), policy_(policy), machine_(machine) {
    handle_->comm = comm;
    handle_->device = device;
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&handle_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_nccl(ncclCommUserRank(comm, &rank_), "ncclCommUserRank", comm);
    check_nccl(ncclCommCount(comm, &size_), "ncclCommCount", comm);
    check_cuda(cudaMalloc(&one_, sizeof(float)), "cudaMalloc (barrier)");
  }
  ~NcclCommunicator() override {
    handle_->release();  // first: cudaFree synchronises the device
    if (one_) cudaFree(one_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                   const std::string& label) override {
    const size_t bytes = size_t(bytes_of(count_per_rank, dtype));
    if (bytes == 0) return done("all_gather", label);
    return launch("all_gather", label, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(send, recv, bytes, ncclUint8, c, s);
    });
  }

  using Communicator::all_reduce;
  using Communicator::reduce_scatter;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                       const std::string& label, Scratch) override {
    const ncclDataType_t t = reduction_type(dtype, "reduce_scatter");
    if (count_per_rank == 0) return done("reduce_scatter", label);
    return launch("reduce_scatter", label, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(send, recv, size_t(count_per_rank), t, ncclSum, c, s);
    });
  }
  std::shared_ptr<Work> all_reduce(void* buf, int64_t count, DType dtype, const std::string& label,
                                   Scratch) override {
    const ncclDataType_t t = reduction_type(dtype, "all_reduce");
    if (count == 0) return done("all_reduce", label);
    return launch("all_reduce", label, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(buf, buf, size_t(count), t, ncclSum, c, s);
    });
  }
  int64_t scratch_bytes(Reduction, int64_t, DType, int) const override { return 0; }

  std::shared_ptr<Work> broadcast(void* buf, int64_t count, DType dtype, int root, const std::string& label) override {
    if (root < 0 || root >= size_)
      throw Error("nccl: broadcast \"" + label + "\": root " + std::to_string(root) + " is not a rank of " +
                  std::to_string(size_));
    const size_t bytes = size_t(bytes_of(count, dtype));
    if (bytes == 0) return done("broadcast", label);
    return launch("broadcast", label, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, root, c, s);
    });
  }

  std::shared_ptr<Work> barrier(const std::string& label) override {
    return launch("barrier", label, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(one_, one_, 1, ncclFloat32, ncclSum, c, s);
    });
  }

  std::shared_ptr<Work> all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                                   const std::string& label) override {
    std::vector<int64_t> counts(size_, count_per_rank), displs(size_);
    for (int r = 0; r < size_; ++r) displs[r] = r * count_per_rank;
    return exchange("all_to_all", send, counts, displs, recv, counts, displs, dtype, label);
  }
  std::shared_ptr<Work> all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                     const std::vector<int64_t>& send_displs, void* recv,
                                     const std::vector<int64_t>& recv_counts,
                                     const std::vector<int64_t>& recv_displs, DType dtype,
                                     const std::string& label) override {
    check_all_to_all_v("nccl all_to_all_v", size_, send_counts, send_displs, recv_counts, recv_displs);
    return exchange("all_to_all_v", send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype, label);
  }

  std::shared_ptr<Work> send(const void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override {
    check_peer("send", peer, tag, label);
    const size_t bytes = size_t(bytes_of(count, dtype));
    if (bytes == 0) return done("send", label);
    return launch("send", label, [&](ncclComm_t c, cudaStream_t s) { return ncclSend(buf, bytes, ncclUint8, peer, c, s); });
  }
  std::shared_ptr<Work> recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                             const std::string& label) override {
    check_peer("recv", peer, tag, label);
    const size_t bytes = size_t(bytes_of(count, dtype));
    if (bytes == 0) return done("recv", label);
    return launch("recv", label, [&](ncclComm_t c, cudaStream_t s) { return ncclRecv(buf, bytes, ncclUint8, peer, c, s); });
  }

  int machine() override { return machine_; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    ncclComm_t sub = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      check_cuda(cudaSetDevice(handle_->device), "cudaSetDevice");
      check_nccl(ncclCommSplit(handle_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr),
                 "ncclCommSplit(color " + std::to_string(color) + ", key " + std::to_string(key) + ") on rank " +
                     std::to_string(rank_),
                 handle_->comm);
    }
    if (color < 0 || sub == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(sub, handle_->device, compute_, policy_, machine_);
  }

 private:
  std::shared_ptr<Work> done(const char* collective, const std::string& label) const {
    return std::make_shared<CompletedWork>(collective, label, rank_, size_, "nccl");
  }

  void check_peer(const char* what, int peer, int tag, const std::string& label) const {
    if (peer < 0 || peer >= size_ || tag < 0 || tag >= (1 << 15))
      throw Error(std::string("nccl: ") + what + " \"" + label + "\": peer " + std::to_string(peer) + " / tag " +
                  std::to_string(tag) + " out of range (" + std::to_string(size_) + " ranks, tags below 32768)");
    // Both halves of a message to oneself would be queued one after the other on this
    // communicator's stream, the first waiting for the second: refused rather than hung.
    if (peer == rank_)
      throw Error(std::string("nccl: ") + what + " \"" + label + "\": a message to oneself (rank " +
                  std::to_string(peer) + ") cannot be matched on one stream");
  }

  // Issues `call` on this communicator's stream after everything issued so far on the compute
  // stream; the Work completes with an event recorded after it.
  template <class Call>
  std::shared_ptr<Work> launch(const char* collective, const std::string& label, Call&& call) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string what = quoted(collective, label) + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
    check_cuda(cudaSetDevice(handle_->device), "cudaSetDevice");
    cudaEvent_t ready = nullptr, finished = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    // Destroying an event right after the wait is fine: the wait keeps the state recorded.
    const cudaError_t recorded = cudaEventRecord(ready, compute_);
    const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(handle_->stream, ready, 0) : recorded;
    cudaEventDestroy(ready);
    check_cuda(waited, what + ": ordering after the compute stream");
    check_nccl(call(handle_->comm, handle_->stream), what, handle_->comm);
    check_cuda(cudaEventCreateWithFlags(&finished, cudaEventDisableTiming), "cudaEventCreate");
    if (const cudaError_t e = cudaEventRecord(finished, handle_->stream); e != cudaSuccess) {
      cudaEventDestroy(finished);
      check_cuda(e, what + ": completion event");
    }
    return std::make_shared<NcclWork>(collective, label, rank_, size_, policy_, handle_, finished);
  }

  // One group of ncclSend / ncclRecv (a rank's own block is a device copy on the stream).
  std::shared_ptr<Work> exchange(const char* collective, const void* send, const std::vector<int64_t>& send_counts,
                                 const std::vector<int64_t>& send_displs, void* recv,
                                 const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                 DType dtype, const std::string& label) {
    const size_t es = size_t(dtype_size(dtype));
    if (send_counts[rank_] != recv_counts[rank_])
      throw Error(std::string("nccl: ") + collective + " \"" + label + "\": rank " + std::to_string(rank_) + " sends " +
                  std::to_string(send_counts[rank_]) + " elements to itself but expects " +
                  std::to_string(recv_counts[rank_]));
    return launch(collective, label, [&](ncclComm_t c, cudaStream_t s) -> ncclResult_t {
      const char* in = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      if (send_counts[rank_] > 0) {
        const cudaError_t e = cudaMemcpyAsync(out + recv_displs[rank_] * es, in + send_displs[rank_] * es,
                                              size_t(send_counts[rank_]) * es, cudaMemcpyDeviceToDevice, s);
        if (e != cudaSuccess) check_cuda(e, std::string(collective) + " \"" + label + "\": own block");
      }
      if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
      ncclResult_t r = ncclSuccess;
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        if (p == rank_) continue;
        if (send_counts[p] > 0) r = ncclSend(in + send_displs[p] * es, size_t(send_counts[p]) * es, ncclUint8, p, c, s);
        if (r == ncclSuccess && recv_counts[p] > 0)
          r = ncclRecv(out + recv_displs[p] * es, size_t(recv_counts[p]) * es, ncclUint8, p, c, s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  std::shared_ptr<Handle> handle_;
  cudaStream_t compute_;
  WaitPolicy policy_;
  int machine_ = 0;
  int rank_ = 0, size_ = 1;
  float* one_ = nullptr;  // barrier's value (its sum is never read)
  std::mutex mu_;         // issues one call at a time (NCCL's order on a communicator is issue order)
};

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, void* compute_stream, WaitPolicy wait,
                                                     std::chrono::milliseconds timeout) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  int devices = 0, device = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    throw Error("nccl: rank " + std::to_string(rank) + " has no CUDA device (" +
                (e == cudaSuccess ? std::string("none found") : std::string(cudaGetErrorString(e))) + ")");
  }
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  // Every rank learns every rank's GPU, so that all refuse together (none waits in NCCL's init).
  std::vector<char> uuids(size_t(size) * 16);
  std::memcpy(uuids.data() + size_t(rank) * 16, prop.uuid.bytes, 16);
  bootstrap.all_gather(uuids.data() + size_t(rank) * 16, uuids.data(), 16, DType::int8, "nccl: GPU of each rank")
      ->wait(timeout);
  for (int a = 0; a < size; ++a)
    for (int b = a + 1; b < size; ++b)
      if (std::memcmp(uuids.data() + size_t(a) * 16, uuids.data() + size_t(b) * 16, 16) == 0)
        throw Error("nccl: ranks " + std::to_string(a) + " and " + std::to_string(b) +
                    " are on the same GPU; NCCL needs one GPU per rank (ranks sharing a GPU stage their "
                    "collectives through host memory)");
  const int machine = bootstrap.machine();
  ncclUniqueId id{};
  if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
  bootstrap.broadcast(&id, sizeof id, DType::int8, 0, "nccl: unique id")->wait(timeout);
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, size, id, rank),
             "ncclCommInitRank on rank " + std::to_string(rank) + " of " + std::to_string(size), nullptr);
  return std::make_unique<NcclCommunicator>(comm, device, static_cast<cudaStream_t>(compute_stream), wait, machine);
}

}  // namespace shardlm::comm

#else  // no NCCL in this build

namespace shardlm::comm {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, void*, WaitPolicy, std::chrono::milliseconds) {
  throw Error("nccl: this build has no NCCL (configure with -DSHARDLM_CUDA=ON where CMake finds nccl.h and libnccl)");
}

}  // namespace shardlm::comm

#endif
