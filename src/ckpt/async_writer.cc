#include "ckpt/async_writer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace shardlm::ckpt {

AsyncRankWriter::AsyncRankWriter(MemoryPool& memory, const model::ModelDesc& desc, const ShardedLayout& layout,
                                 int rank)
    : desc_(desc), layout_(layout), rank_(rank) {
  for (int k = 0; k < kNumKinds; ++k)
    if (const int64_t n = written_elements(layout_, k, rank_); n > 0)
      // Zeroed: its pages fault in now, not in a save.
      staging_[k] = Buffer(memory, MemCategory::staging, sizeof(float) * n);
  io_ = Buffer(memory, MemCategory::staging, kCheckpointIoBytes);  // large blocks are 2 MiB aligned (tensor/memory.cc)
}

AsyncRankWriter::~AsyncRankWriter() {
  if (thread_.joinable()) thread_.join();
}

int64_t AsyncRankWriter::staging_bytes() const {
  int64_t n = 0;
  for (const Buffer& b : staging_) n += static_cast<int64_t>(b.bytes());
  return n + static_cast<int64_t>(io_.bytes());
}

namespace {
// `progress`, after sleeping whenever the write is ahead of an even pace over `spread`.
SafetensorsWriter::Progress paced(SafetensorsWriter::Progress progress, std::chrono::milliseconds spread) {
  if (spread.count() <= 0) return progress;
  const auto t0 = std::chrono::steady_clock::now();
  return [=](const void* piece, size_t n, uint64_t written, uint64_t total) {
    if (progress) progress(piece, n, written, total);
    std::this_thread::sleep_until(t0 + spread * (static_cast<double>(written) / static_cast<double>(total)));
  };
}
}  // namespace

void AsyncRankWriter::start(const std::string& dir, const RankBuffers& bufs, SafetensorsWriter::Progress progress,
                            std::chrono::milliseconds spread) {
  if (state() != State::idle) throw std::logic_error("AsyncRankWriter::start: the previous write was not collected");
  if (thread_.joinable()) thread_.join();
  RankBuffers copy{};
  for (int k = 0; k < kNumKinds; ++k) {
    if (!bufs[k] || !staging_[k].data()) continue;
    std::memcpy(staging_[k].data(), bufs[k], staging_[k].bytes());
    copy[k] = staging_[k].f32();
  }
  state_.store(State::writing, std::memory_order_release);
  thread_ = std::thread([this, dir, copy, progress = paced(std::move(progress), spread)] {
    // Below the compute threads: the write waits for the disk most of the time, and what CPU it
    // needs (copies into the block buffer, the checksum) should not stretch a training step.
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
    try {
      result_ = write_rank_file(dir, desc_, layout_, rank_, copy, progress, {static_cast<char*>(io_.data()), io_.bytes()});
      state_.store(State::written, std::memory_order_release);
    } catch (const std::exception& e) {
      error_ = e.what();
      if (error_.empty()) error_ = "checkpoint: background write failed";
      state_.store(State::failed, std::memory_order_release);
    }
  });
}

void AsyncRankWriter::wait() {
  if (thread_.joinable()) thread_.join();
}

FileSummary AsyncRankWriter::take_result() {
  wait();
  if (state() != State::written) throw std::logic_error("AsyncRankWriter::take_result: no written file");
  state_.store(State::idle, std::memory_order_release);
  return result_;
}

std::string AsyncRankWriter::take_error() {
  wait();
  if (state() != State::failed) throw std::logic_error("AsyncRankWriter::take_error: no failed write");
  state_.store(State::idle, std::memory_order_release);
  return error_;
}

}  // namespace shardlm::ckpt
