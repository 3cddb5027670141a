#include "comm/staged.h"

#include <algorithm>
#include <stdexcept>

namespace shardlm::comm {

namespace {

// The inner collective's Work, plus what finishing a staged one takes: its host staging kept
// alive until then, and the copy of the result back to device memory, made once, by whichever
// thread sees the inner collective complete.
class StagedWork final : public Work {
 public:
  StagedWork(const std::string& collective, const std::string& label, int rank, int size, const std::string& backend,
             std::shared_ptr<Work> inner, Buffer host, const DeviceCopier& copier, void* device_dst,
             size_t host_offset, size_t bytes)
      : Work(collective, label, rank, size, backend, {}),
        inner_(std::move(inner)),
        host_(std::move(host)),
        copier_(copier),
        device_dst_(device_dst),
        host_offset_(host_offset),
        bytes_(bytes) {}

 protected:
  bool test() override {
    if (!inner_->is_completed()) return false;  // throws the inner collective's error
    if (device_dst_ && bytes_ > 0) copier_.to_device(device_dst_, host_.as<char>() + host_offset_, bytes_);
    host_ = Buffer();
    return true;
  }
  std::vector<int> waiting_for_locked() override { return waiting_for_of(*inner_); }

 private:
  std::shared_ptr<Work> inner_;
  Buffer host_;
  const DeviceCopier& copier_;
  void* device_dst_;
  size_t host_offset_, bytes_;
};

}  // namespace

StagedCommunicator::StagedCommunicator(Communicator& inner, const DeviceCopier& copier, MemoryPool& memory)
    : inner_(inner), copier_(copier), memory_(memory) {}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> inner, const DeviceCopier& copier,
                                       MemoryPool& memory)
    : owned_(std::move(inner)), inner_(*owned_), copier_(copier), memory_(memory) {
  if (!owned_) throw Error("staged communicator: no inner communicator");
}

StagedCommunicator::~StagedCommunicator() = default;

Buffer StagedCommunicator::host(size_t bytes) const {
  return bytes == 0 ? Buffer() : Buffer(memory_, MemCategory::comm, bytes, Buffer::Fill::none);
}

std::shared_ptr<Work> StagedCommunicator::staged(const char* collective, const std::string& label, Buffer host,
                                                 std::shared_ptr<Work> inner, void* device_dst, size_t host_offset,
                                                 size_t bytes) {
  return std::make_shared<StagedWork>(collective, label, rank(), size(), backend(), std::move(inner),
                                      std::move(host), copier_, device_dst, host_offset, bytes);
}

// In place on the host whatever the caller asked: this rank's block is staged at its own slot.
std::shared_ptr<Work> StagedCommunicator::all_gather(const void* send, void* recv, int64_t count_per_rank,
                                                     DType dtype, const std::string& label) {
  const size_t block = bytes_of(count_per_rank, dtype), all = block * size();
  Buffer h = host(all);
  char* own = h.as<char>() + block * rank();
  if (block > 0) copier_.to_host(own, send, block);
  auto w = inner_.all_gather(own, h.data(), count_per_rank, dtype, label);
  return staged("all_gather", label, std::move(h), std::move(w), recv, 0, all);
}

std::shared_ptr<Work> StagedCommunicator::reduce_scatter(const void* send, void* recv, int64_t count_per_rank,
                                                         DType dtype, const std::string& label, Scratch) {
  const size_t block = bytes_of(count_per_rank, dtype), all = block * size();
  Buffer h = host(all);
  if (all > 0) copier_.to_host(h.data(), send, all);
  char* own = h.as<char>() + block * rank();
  auto w = inner_.reduce_scatter(h.data(), own, count_per_rank, dtype, label, Scratch{});
  return staged("reduce_scatter", label, std::move(h), std::move(w), recv, block * rank(), block);
}

std::shared_ptr<Work> StagedCommunicator::all_reduce(void* buf, int64_t count, DType dtype, const std::string& label,
                                                     Scratch) {
  const size_t bytes = bytes_of(count, dtype);
  Buffer h = host(bytes);
  if (bytes > 0) copier_.to_host(h.data(), buf, bytes);
  auto w = inner_.all_reduce(h.data(), count, dtype, label, Scratch{});
  return staged("all_reduce", label, std::move(h), std::move(w), buf, 0, bytes);
}

std::shared_ptr<Work> StagedCommunicator::broadcast(void* buf, int64_t count, DType dtype, int root,
                                                    const std::string& label) {
  const size_t bytes = bytes_of(count, dtype);
  Buffer h = host(bytes);
  if (bytes > 0 && rank() == root) copier_.to_host(h.data(), buf, bytes);
  auto w = inner_.broadcast(h.data(), count, dtype, root, label);
  // The root's device buffer already holds the values.
  return staged("broadcast", label, std::move(h), std::move(w), rank() == root ? nullptr : buf, 0, bytes);
}

std::shared_ptr<Work> StagedCommunicator::all_to_all(const void* send, void* recv, int64_t count_per_rank,
                                                     DType dtype, const std::string& label) {
  const size_t all = bytes_of(count_per_rank, dtype) * size();
  Buffer h = host(2 * all);  // [send | recv]
  if (all > 0) copier_.to_host(h.data(), send, all);
  auto w = inner_.all_to_all(h.data(), h.as<char>() + all, count_per_rank, dtype, label);
  return staged("all_to_all", label, std::move(h), std::move(w), recv, all, all);
}

std::shared_ptr<Work> StagedCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                                       const std::vector<int64_t>& send_displs, void* recv,
                                                       const std::vector<int64_t>& recv_counts,
                                                       const std::vector<int64_t>& recv_displs, DType dtype,
                                                       const std::string& label) {
  check_all_to_all_v("staged all_to_all_v", size(), send_counts, send_displs, recv_counts, recv_displs);
  // Each side staged over the extent its ranges span. The receive extent is read first so the
  // bytes between ranges, which no peer writes, go back to the device unchanged.
  auto extent = [&](const std::vector<int64_t>& counts, const std::vector<int64_t>& displs) {
    int64_t end = 0;
    for (int j = 0; j < size(); ++j)
      if (counts[j] > 0) end = std::max(end, displs[j] + counts[j]);
    return static_cast<size_t>(bytes_of(end, dtype));
  };
  const size_t out = extent(send_counts, send_displs), in = extent(recv_counts, recv_displs);
  Buffer h = host(out + in);
  if (out > 0) copier_.to_host(h.data(), send, out);
  if (in > 0) copier_.to_host(h.as<char>() + out, recv, in);
  auto w = inner_.all_to_all_v(h.data(), send_counts, send_displs, h.as<char>() + out, recv_counts, recv_displs,
                               dtype, label);
  return staged("all_to_all_v", label, std::move(h), std::move(w), recv, out, in);
}

std::shared_ptr<Work> StagedCommunicator::send(const void* buf, int64_t count, DType dtype, int peer, int tag,
                                               const std::string& label) {
  const size_t bytes = bytes_of(count, dtype);
  Buffer h = host(bytes);
  if (bytes > 0) copier_.to_host(h.data(), buf, bytes);
  auto w = inner_.send(h.data(), count, dtype, peer, tag, label);
  return staged("send", label, std::move(h), std::move(w), nullptr, 0, 0);
}

std::shared_ptr<Work> StagedCommunicator::recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                                               const std::string& label) {
  const size_t bytes = bytes_of(count, dtype);
  Buffer h = host(bytes);
  auto w = inner_.recv(h.data(), count, dtype, peer, tag, label);
  return staged("recv", label, std::move(h), std::move(w), buf, 0, bytes);
}

std::unique_ptr<Communicator> StagedCommunicator::split(int color, int key) {
  std::unique_ptr<Communicator> part = inner_.split(color, key);
  if (!part) return nullptr;
  return std::make_unique<StagedCommunicator>(std::move(part), copier_, memory_);
}

}  // namespace shardlm::comm
