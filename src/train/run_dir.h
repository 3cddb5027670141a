// The run directory (--out) belongs to one run at a time, and what it holds is that run's:
//  - DIR/.lock is held with flock() while a run lives (the kernel releases it when the process
//    dies, however it dies) and holds the holder's pid, so a second run on DIR fails at once
//    naming it (where the filesystem keeps no locks, the run goes on unlocked and warns);
//  - DIR/run.json says whose DIR is: the id of the run that started it (kept by every resume of
//    it, new for a run that replaces it) and that run's settings (resume_check.h's run_identity);
//  - a directory that already holds a run (a non-empty metrics.jsonl or a ckpt/) is refused unless
//    the run resumes one of its checkpoints (--resume DIR/ckpt/step_N: metrics.jsonl is cut back to
//    the resumed step, so no step appears twice), its snapshot, or — --resume auto with nothing to
//    resume from — restarts from step 0 the run DIR/run.json names, of the same settings, that was
//    killed before it saved anything; or overwrites it (--overwrite: the old metrics.jsonl and
//    ckpt/ are removed);
//  - temporary checkpoint directories a dead run left (ckpt/step_N.tmp-PID, .old-PID) are removed;
//  - metrics.jsonl is written through CheckedLog: a failed write (disk full) stops the run with a
//    line naming the file and the reason instead of leaving a log cut mid-line behind exit 0.
// Rank 0 owns the directory; the other ranks only check at start that they see it (its .lock:
// agreement.h's check_out_shared) and write their checkpoint files into ckpt/step_N.tmp-PID.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <streambuf>
#include <string>
#include <vector>

#include "train/config.h"

namespace shardlm::train {

class RunDirectory {
 public:
  // Creates DIR, takes its lock and reads whose it is (DIR/run.json); changes nothing else, so
  // that a run refused by a later start-up check leaves DIR as it was (a DIR it created is removed
  // again when the RunDirectory goes before prepare()). Throws std::runtime_error
  // naming the directory (and the holder's pid when it is locked).
  // A run.json it cannot read is refused by admit(), unless --overwrite replaces the run.
  static std::unique_ptr<RunDirectory> open(const std::string& dir);

  // The id of the run DIR holds (its run.json), "" when none recorded itself there.
  const std::string& held_run_id() const { return held_id_; }

  // How a run starts in DIR.
  struct Start {
    int64_t resumed_step = -1;  // the step it resumes from (a checkpoint's or snapshot's), -1: none
    bool from_snapshot = false;  // it resumes DIR's own in-memory snapshot (--resume auto)
    bool auto_found_nothing = false;  // --resume auto found no snapshot or checkpoint to resume
  };
  // Admits run `cfg` (as asked, on `world_size` ranks) into DIR, or throws one line naming DIR
  // when DIR holds another run (see above) or a run.json that does not say whose it is; decides
  // this run's id: DIR's run's when this run continues it, else a new one.
  void admit(const TrainConfig& cfg, int world_size, Start start);
  // This run's id (after admit).
  const std::string& run_id() const { return run_id_; }
  // Whether this run restarts DIR's run from step 0 (--resume auto; nothing of it was saved).
  bool restarts() const { return restart_; }

  // Once the run is sure to start: removes the old run (--overwrite) and dead runs' leftovers,
  // cuts metrics.jsonl back to the resumed step (all of it for a restart) and records the run in
  // DIR/run.json.
  void prepare();
  ~RunDirectory();  // closes the lock file: the lock goes with it
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }
  std::string metrics_path() const { return path_ + "/metrics.jsonl"; }

 private:
  RunDirectory(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  // Refuses `cfg`'s run unless --resume auto may restart the run DIR holds: DIR/run.json names a
  // run of the same settings and no checkpoint of it exists.
  void admit_restart(const TrainConfig& cfg, int world_size);
  std::string path_;
  int lock_fd_;
  std::string held_id_;
  nlohmann::json held_run_;  // the settings run.json records
  std::string unreadable_record_;  // why DIR/run.json could not be read ("" when it could)
  std::string run_id_;
  nlohmann::json run_;       // this run's settings, for run.json
  int64_t resumed_step_ = -1;
  bool replace_ = false;  // a new run with --overwrite into a directory holding a run
  bool restart_ = false;
  bool created_ = false;   // open() made DIR: a run refused before prepare() removes it again
  bool prepared_ = false;
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
