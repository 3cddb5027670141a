// A rank's checkpoint file written in the background (--async-save).
//
// start() copies the rank's shard into staging buffers and returns; a thread then writes the copy
// with write_rank_file, so the file holds the bytes a synchronous save writes, while the training
// thread goes on updating the state. The staging buffers (MemCategory::staging) are allocated once,
// when the writer is made, and kept for the run: the plan's static `staging` figure is what the
// allocator holds from the first step on.
//
// The file is written with O_DIRECT through a block buffer of its own (also staging, also in the
// plan's figure): a buffered write's copy into the page cache cost this machine ~1.7 ms per MB of
// CPU taken from the training steps.
//
// The writer only writes: whether every rank's file is durable, and the commit (index.json,
// latest), is the caller's business, decided collectively from state() at step boundaries.
// One write at a time: start() while a write is in flight is a logic error (wait() first).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "ckpt/sharded.h"
#include "tensor/memory.h"

namespace shardlm::ckpt {

class AsyncRankWriter {
 public:
  enum class State : int { idle, writing, written, failed };

  // `desc` and `memory` must outlive the writer. Allocates the staging copy of what `rank` writes
  // from `memory`.
  AsyncRankWriter(MemoryPool& memory, const model::ModelDesc& desc, const ShardedLayout& layout, int rank);
  ~AsyncRankWriter();  // waits for a write in flight (its result is dropped)
  AsyncRankWriter(const AsyncRankWriter&) = delete;
  AsyncRankWriter& operator=(const AsyncRankWriter&) = delete;

  // Copies `bufs` (as write_rank_file takes them) into staging and starts writing the copy into
  // `dir`. `progress` runs on the writing thread (fault injection). `spread`: the write is paced
  // to take about that long (never ahead of written/total × spread), so that its memory traffic
  // and the kernel's writeback share the steps of that time thinly instead of crowding the first
  // few; zero writes as fast as it can.
  void start(const std::string& dir, const RankBuffers& bufs, SafetensorsWriter::Progress progress = {},
             std::chrono::milliseconds spread = {});
  State state() const { return state_.load(std::memory_order_acquire); }
  // Blocks until the write in flight (if any) has ended.
  void wait();
  // After `written`: the file's size and checksum. After `failed`: the error, one line. Both
  // return the writer to idle.
  FileSummary take_result();
  std::string take_error();
  int64_t staging_bytes() const;

 private:
  const model::ModelDesc& desc_;
  ShardedLayout layout_;
  int rank_;
  std::array<Buffer, kNumKinds> staging_;
  Buffer io_;  // the O_DIRECT block buffer the file goes out through (kCheckpointIoBytes)
  std::thread thread_;
  std::atomic<State> state_{State::idle};
  FileSummary result_;  // written by the thread before it publishes `written`
  std::string error_;   // likewise before `failed`
};

}  // namespace shardlm::ckpt
