#include "comm/single_rank.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>

#include "comm/reduce.h"
#include "tensor/memory.h"

namespace shardlm::comm {

namespace {

constexpr const char* kBackend = "single";

std::shared_ptr<Work> done(const char* collective, const std::string& label) {
  return std::make_shared<CompletedWork>(collective, label, 0, 1, kBackend);
}

void copy(void* dst, const void* src, int64_t count, DType dtype) {
  if (dst != src && count > 0) std::memcpy(dst, src, bytes_of(count, dtype));
}

void check_count(int64_t count, const char* what) {
  if (count < 0) throw Error(std::string("comm: ") + what + ": negative count");
}

void check_peer(int peer, int tag, const char* what) {
  if (peer != 0) throw Error(std::string("comm: ") + what + ": peer out of range (single rank)");
  if (tag < 0 || tag > 32767) throw Error(std::string("comm: ") + what + ": tag must be in [0, 32767]");
}

class RecvWork final : public Work {
 public:
  RecvWork(const std::string& label) : Work("recv", label, 0, 1, kBackend, WaitPolicy{}) {}
  std::atomic<bool> filled{false};

 protected:
  bool test() override { return filled.load(std::memory_order_acquire); }
};

}  // namespace

struct SingleRankCommunicator::Mailbox {
  struct Message {
    int tag;
    Buffer data;
  };
  struct Waiting {
    int tag;
    void* buf;
    int64_t bytes;
    std::shared_ptr<RecvWork> work;
  };
  std::mutex mu;
  std::deque<Message> messages;
  std::deque<Waiting> waiting;
};

SingleRankCommunicator::SingleRankCommunicator(MemoryPool& memory)
    : memory_(memory), mailbox_(std::make_shared<Mailbox>()) {}
SingleRankCommunicator::~SingleRankCommunicator() = default;

std::shared_ptr<Work> SingleRankCommunicator::all_gather(const void* send, void* recv,
                                                         int64_t count_per_rank, DType dtype,
                                                         const std::string& label) {
  check_count(count_per_rank, "all_gather");
  copy(recv, send, count_per_rank, dtype);
  return done("all_gather", label);
}

std::shared_ptr<Work> SingleRankCommunicator::reduce_scatter(const void* send, void* recv,
                                                             int64_t count_per_rank, DType dtype,
                                                             const std::string& label, Scratch) {
  check_count(count_per_rank, "reduce_scatter");
  if (!reducible(dtype))
    throw Error(std::string("comm: reduce_scatter of ") + to_string(dtype) + " is not supported");
  copy(recv, send, count_per_rank, dtype);
  return done("reduce_scatter", label);
}

std::shared_ptr<Work> SingleRankCommunicator::all_reduce(void*, int64_t count, DType dtype,
                                                         const std::string& label, Scratch) {
  check_count(count, "all_reduce");
  if (!reducible(dtype))
    throw Error(std::string("comm: all_reduce of ") + to_string(dtype) + " is not supported");
  return done("all_reduce", label);
}

std::shared_ptr<Work> SingleRankCommunicator::broadcast(void*, int64_t count, DType, int root,
                                                        const std::string& label) {
  check_count(count, "broadcast");
  if (root != 0) throw Error("comm: broadcast root out of range (single rank)");
  return done("broadcast", label);
}

std::shared_ptr<Work> SingleRankCommunicator::barrier(const std::string& label) {
  return done("barrier", label);
}

std::shared_ptr<Work> SingleRankCommunicator::all_to_all(const void* send, void* recv,
                                                         int64_t count_per_rank, DType dtype,
                                                         const std::string& label) {
  check_count(count_per_rank, "all_to_all");
  copy(recv, send, count_per_rank, dtype);
  return done("all_to_all", label);
}

std::shared_ptr<Work> SingleRankCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                                           const std::vector<int64_t>& send_displs, void* recv,
                                                           const std::vector<int64_t>& recv_counts,
                                                           const std::vector<int64_t>& recv_displs, DType dtype,
                                                           const std::string& label) {
  check_all_to_all_v("all_to_all_v", 1, send_counts, send_displs, recv_counts, recv_displs);
  if (send_counts[0] != recv_counts[0])
    throw Error("comm: all_to_all_v: send_counts[0] = " + std::to_string(send_counts[0]) + " but recv_counts[0] = " +
                std::to_string(recv_counts[0]) + " (a single rank sends only to itself)");
  const int64_t es = dtype_size(dtype);
  copy(static_cast<char*>(recv) + recv_displs[0] * es, static_cast<const char*>(send) + send_displs[0] * es,
       send_counts[0], dtype);
  return done("all_to_all_v", label);
}

std::shared_ptr<Work> SingleRankCommunicator::send(const void* buf, int64_t count, DType dtype,
                                                   int peer, int tag, const std::string& label) {
  check_count(count, "send");
  check_peer(peer, tag, "send");
  const int64_t bytes = bytes_of(count, dtype);
  std::lock_guard<std::mutex> lock(mailbox_->mu);
  for (auto it = mailbox_->waiting.begin(); it != mailbox_->waiting.end(); ++it) {
    if (it->tag != tag) continue;
    if (it->bytes < bytes) throw Error("comm: send of more elements than the matching recv takes");
    if (bytes > 0) std::memcpy(it->buf, buf, bytes);
    it->work->filled.store(true, std::memory_order_release);
    mailbox_->waiting.erase(it);
    return done("send", label);
  }
  Mailbox::Message m{tag, Buffer(memory_, MemCategory::comm, bytes)};
  if (bytes > 0) std::memcpy(m.data.data(), buf, bytes);
  mailbox_->messages.push_back(std::move(m));
  return done("send", label);
}

std::shared_ptr<Work> SingleRankCommunicator::recv(void* buf, int64_t count, DType dtype, int peer,
                                                   int tag, const std::string& label) {
  check_count(count, "recv");
  check_peer(peer, tag, "recv");
  const int64_t bytes = bytes_of(count, dtype);
  std::lock_guard<std::mutex> lock(mailbox_->mu);
  for (auto it = mailbox_->messages.begin(); it != mailbox_->messages.end(); ++it) {
    if (it->tag != tag) continue;
    if (static_cast<int64_t>(it->data.bytes()) > bytes)
      throw Error("comm: recv of fewer elements than the matching send gives");
    if (it->data.bytes() > 0) std::memcpy(buf, it->data.data(), it->data.bytes());
    mailbox_->messages.erase(it);
    return done("recv", label);
  }
  auto w = std::make_shared<RecvWork>(label);
  mailbox_->waiting.push_back({tag, buf, bytes, w});
  return w;
}

std::unique_ptr<Communicator> SingleRankCommunicator::split(int color, int) {
  if (color < 0) return nullptr;
  return std::make_unique<SingleRankCommunicator>(memory_);
}

}  // namespace shardlm::comm
