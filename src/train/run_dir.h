// The run directory (--out) belongs to one run at a time, and what it holds is that run's:
//  - DIR/.lock is held with flock() while a run lives (the kernel releases it when the process
//    dies, however it dies) and holds the holder's pid, so a second run on DIR fails at once
//    naming it;
//  - a directory that already holds a run (a non-empty metrics.jsonl or a ckpt/) is refused unless
//    the run resumes one of its checkpoints (--resume DIR/ckpt/step_N: metrics.jsonl is cut back to
//    the resumed step, so no step appears twice) or overwrites it (--overwrite: the old
//    metrics.jsonl and ckpt/ are removed);
//  - temporary checkpoint directories a dead run left (ckpt/step_N.tmp-PID, .old-PID) are removed;
//  - metrics.jsonl is written through CheckedLog: a failed write (disk full) stops the run with a
//    line naming the file and the reason instead of leaving a log cut mid-line behind exit 0.
// Rank 0 owns the directory; the other ranks never touch it.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <streambuf>
#include <string>
#include <vector>

#include "train/config.h"

namespace shardlm::train {

class RunDirectory {
 public:
  // Creates DIR, takes its lock and refuses a directory holding another run; changes nothing
  // else yet, so that a run refused by a later start-up check leaves DIR as it was.
  // `resumed_step` is the step the run resumes from (the checkpoint's state.json step), or -1
  // for a new run; `from_snapshot`: it resumes DIR's own in-memory snapshot (--resume auto), which
  // continues DIR's run like one of its checkpoints. Throws std::runtime_error naming the
  // directory (and the holder's pid when it is locked).
  static std::unique_ptr<RunDirectory> open(const TrainConfig& cfg, int64_t resumed_step, bool from_snapshot = false);
  // Once the run is sure to start: removes the old run (--overwrite) and dead runs' leftovers,
  // and cuts metrics.jsonl back to the resumed step.
  void prepare();
  ~RunDirectory();  // closes the lock file: the lock goes with it
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }
  std::string metrics_path() const { return path_ + "/metrics.jsonl"; }

 private:
  RunDirectory(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  std::string path_;
  int lock_fd_;
  int64_t resumed_step_ = -1;
  bool replace_ = false;  // a new run with --overwrite into a directory holding a run
};

// Keeps the lines of a metrics log that happened before step `step` of a run resumed there: it
// stops at the first training row of a step >= `step` (or any row past it), and drops lines that
// are not JSON (a line a killed run left half-written). Rows without "step" are kept.
std::vector<std::string> metrics_before(const std::vector<std::string>& lines, int64_t step);

// An output stream onto a file opened for appending whose writes are checked: a write or flush
// that fails throws std::runtime_error "PATH: cannot write: REASON" (with exceptions(badbit), the
// stream passes its buffer's exception on unchanged).
class CheckedLog : public std::ostream {
 public:
  CheckedLog();
  ~CheckedLog() override;
  // Opens (creating) `path` for appending; throws naming it and the reason.
  void open(const std::string& path);

 private:
  class Buffer : public std::streambuf {
   public:
    Buffer();
    ~Buffer() override;
    void open(const std::string& path);
    void close_quietly();

   protected:
    int overflow(int c) override;
    int sync() override;

   private:
    void drain();  // writes [pbase, pptr) whole or throws
    int fd_ = -1;
    std::string path_;
    std::vector<char> space_;
  };
  Buffer buf_;
};

}  // namespace shardlm::train
