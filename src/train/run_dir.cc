#include "train/run_dir.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <stdexcept>
#include <sys/file.h>
#include <thread>
#include <unistd.h>

#include "files/replace_file.h"
#include "tensor/file_lock.h"
#include "train/resume_check.h"

namespace shardlm::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const char* const kRunRecord = "run.json";

std::string errno_text() { return std::strerror(errno); }

// Writes all of [data, data + n) or throws naming the file and the reason.
void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw std::runtime_error(path + ": cannot write: " + errno_text());
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// The holder's "pid P on HOST" from the lock file. The holder writes it just after taking the
// lock, so an empty file is read again for a moment.
std::string lock_holder(int fd) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    char text[256] = {};
    const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
    std::string s(text, n > 0 ? static_cast<size_t>(n) : 0);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    if (!s.empty()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "pid unknown";
}

// Takes DIR/.lock (flock: released by the kernel when the holder exits or dies) and writes this
// process's pid into it. Returns the open descriptor, which holds the lock until closed.
int lock_dir(const std::string& dir) {
  const std::string path = dir + "/.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("run directory " + dir + ": cannot open " + path + ": " + errno_text());
  int err = 0;
  switch (lock_exclusive(fd, err)) {
    case FileLock::held:
      break;
    case FileLock::unsupported:
      std::cerr << "shardlm: warning: run directory " << dir << ": its filesystem keeps no file locks ("
                << std::strerror(err) << "), so a second run on it would not be refused; give each run its own --out\n";
      break;
    case FileLock::busy: {
      const std::string holder = lock_holder(fd);
      ::close(fd);
      throw std::runtime_error(fmt::format("run directory {} is in use by another run ({}, holding {}); wait for it to "
                                           "end or choose another --out",
                                           dir, holder, path));
    }
    case FileLock::failed:
      ::close(fd);
      throw std::runtime_error("run directory " + dir + ": cannot lock " + path + ": " + std::strerror(err));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host);
  try {
    if (::ftruncate(fd, 0) != 0) throw std::runtime_error(path + ": cannot write: " + errno_text());
    write_all(fd, me.data(), me.size(), path);
    // Durable now, not at close: ranks on other machines read it at start (check_out_shared).
    if (::fdatasync(fd) != 0) throw std::runtime_error(path + ": cannot write: " + errno_text());
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

// Whether `path` lies in directory `dir` (both resolved, so "runs/a/ckpt/../ckpt/step_2" is).
bool is_inside(const fs::path& path, const fs::path& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  const fs::path d = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) return false;
  const auto [d_end, p_at] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  return d_end == d.end() && p_at != p.end();
}

// 32 hex digits from the system's random source: two runs never share one.
std::string new_run_id() {
  std::random_device source;
  std::string id;
  for (int i = 0; i < 4; ++i) id += fmt::format("{:08x}", static_cast<uint32_t>(source()));
  return id;
}

bool is_run_id(const std::string& id) {
  return id.size() == 32 && id.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// DIR/run.json's run id and settings; "" and null when DIR has none.
std::pair<std::string, json> read_run_record(const std::string& dir) {
  const fs::path path = fs::path(dir) / kRunRecord;
  std::error_code ec;
  if (!fs::exists(path, ec)) return {"", json()};
  try {
    std::ifstream f(path);
    const json j = json::parse(f);
    const std::string id = j.at("run_id").get<std::string>();
    if (is_run_id(id) && j.at("run").is_object()) return {id, j["run"]};
  } catch (const std::exception&) {
  }
  throw std::runtime_error(path.string() + ": not a run record ({\"run_id\": 32 hex digits, \"run\": {settings}}), which "
                           "says whose run directory this is; --overwrite to replace the run, or choose another --out");
}

// Whether DIR has a checkpoint: ckpt/latest or a ckpt/step_N directory (temporary ones aside).
bool has_checkpoints(const std::string& dir) {
  static const std::regex step(R"(step_\d+)");
  std::error_code ec;
  const fs::path ckpt = fs::path(dir) / "ckpt";
  if (fs::exists(ckpt / "latest", ec)) return true;
  for (const auto& entry : fs::directory_iterator(ckpt, ec))
    if (std::regex_match(entry.path().filename().string(), step)) return true;
  return false;
}

bool holds_a_run(const std::string& dir) {
  std::error_code ec;
  const fs::path metrics = fs::path(dir) / "metrics.jsonl";
  const bool has_metrics = fs::is_regular_file(metrics, ec) && fs::file_size(metrics, ec) > 0;
  return has_metrics || fs::exists(fs::path(dir) / "ckpt", ec);
}

void remove_path(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw std::runtime_error("cannot remove " + p.string() + ": " + ec.message());
}

// What a checkpoint write of a dead process left behind (ckpt/step_N.tmp-PID, .old-PID where
// the final name could not be swapped atomically, latest.tmp-PID-RANDOM), and the temporary files of
// metrics.jsonl's and run.json's rewrites: only the lock holder's ranks write here, so none of
// them belongs to a living run.
void remove_leftovers(const std::string& dir) {
  static const std::regex leftover(R"((step_\d+\.(tmp|old)-\d+|latest\.tmp-\d+(-[0-9a-f]+)?))");
  std::error_code ec;
  const fs::path ckpt = fs::path(dir) / "ckpt";
  for (const auto& entry : fs::directory_iterator(ckpt, ec))  // none when there is no ckpt/
    if (std::regex_match(entry.path().filename().string(), leftover)) remove_path(entry.path());
  for (const auto& entry : fs::directory_iterator(dir, ec))
    for (const std::string rewritten : {"metrics.jsonl", kRunRecord})
      if (entry.path().filename().string().rfind(rewritten + ".tmp-", 0) == 0) remove_path(entry.path());
}

std::vector<std::string> read_lines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) lines.push_back(line);
  if (f.bad()) throw std::runtime_error(path + ": cannot read: " + errno_text());
  return lines;
}

// Replaces `path` by `lines` through a temporary file renamed over it, so that a crash leaves
// either the old log or the new one.
void rewrite_atomically(const std::string& path, const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  files::replace_file(path, text);
}

void cut_metrics(const std::string& path, int64_t step) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  const auto lines = read_lines(path);
  const auto kept = metrics_before(lines, step);
  if (kept != lines) rewrite_atomically(path, kept);
}

}  // namespace

std::vector<std::string> metrics_before(const std::vector<std::string>& lines, int64_t step) {
  std::vector<std::string> kept;
  for (const auto& line : lines) {
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      continue;
    }
    if (row.is_object() && row.contains("step") && row["step"].is_number_integer()) {
      // A training row's "step" is the step's index; an evaluation's ("val_loss") counts the
      // steps done before it, so the evaluation at `step` belongs to the saved run.
      const int64_t s = row["step"].get<int64_t>();
      const bool evaluation = row.contains("val_loss");
      if (s > step || (s == step && !evaluation)) break;
    }
    kept.push_back(line);
  }
  return kept;
}

std::unique_ptr<RunDirectory> RunDirectory::open(const std::string& dir) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw std::runtime_error("run directory " + dir + ": cannot create it: " + (ec ? ec.message() : "not a directory"));
  const int fd = lock_dir(dir);
  std::unique_ptr<RunDirectory> run(new RunDirectory(dir, fd));  // from here on, the lock is released on throw
  run->created_ = !existed;
  try {
    std::tie(run->held_id_, run->held_run_) = read_run_record(dir);
  } catch (const std::runtime_error& e) {
    run->unreadable_record_ = e.what();  // refused in admit() unless --overwrite replaces the run
  }
  return run;
}

void RunDirectory::admit(const TrainConfig& cfg, int world_size, Start start) {
  if (!unreadable_record_.empty() && !cfg.overwrite) throw std::runtime_error(unreadable_record_);
  resumed_step_ = start.resumed_step;
  run_ = run_identity(cfg, world_size);
  // Resuming DIR's own checkpoint or snapshot continues DIR's run; any other run into a directory
  // holding a run would mix two runs' records.
  const bool continues_dir = start.resumed_step >= 0 && (start.from_snapshot || is_inside(cfg.resume, fs::path(path_) / "ckpt"));
  if (continues_dir) {
    run_id_ = held_id_.empty() ? new_run_id() : held_id_;  // a directory of an older shardlm gets one now
    return;
  }
  if (holds_a_run(path_)) {
    if (cfg.overwrite) replace_ = true;
    else if (start.auto_found_nothing) admit_restart(cfg, world_size);
    else
      throw std::runtime_error("run directory " + path_ + " holds a run (metrics.jsonl or ckpt/)" +
                               (start.resumed_step >= 0 ? ", not the run --resume " + cfg.resume + " continues" : "") +
                               "; --resume " + path_ + " (its latest checkpoint) to continue it, --overwrite to replace it, or "
                               "choose another --out");
  }
  run_id_ = restart_ ? held_id_ : new_run_id();
}

void RunDirectory::admit_restart(const TrainConfig& cfg, int world_size) {
  const std::string record = (fs::path(path_) / kRunRecord).string();
  if (held_id_.empty())
    throw std::runtime_error("run directory " + path_ + " holds a run (metrics.jsonl or ckpt/) with no checkpoint or "
                             "snapshot to resume and no " + kRunRecord + " saying it is this run's; --overwrite to "
                             "replace it, or choose another --out");
  if (has_checkpoints(path_))
    throw std::runtime_error("run directory " + path_ + " holds checkpoints (ckpt/) that --resume auto could not use; "
                             "--resume " + path_ + "/ckpt/step_N to name one, --overwrite to replace the run, or choose "
                             "another --out");
  TrainConfig asked = cfg;
  asked.resume = "auto";
  try {
    check_resume_matches(asked, world_size, held_run_, record);
  } catch (const std::exception& e) {
    throw std::runtime_error("run directory " + path_ + " holds another run, which --resume auto does not restart (" +
                             e.what() + "); --overwrite to replace it, or choose another --out");
  }
  // The run DIR holds is this one, killed before it saved anything: it starts over from step 0.
  restart_ = true;
  resumed_step_ = 0;
}

void RunDirectory::prepare() {
  if (replace_) {
    remove_path(fs::path(path_) / "ckpt");
    remove_path(fs::path(path_) / "metrics.jsonl");
  }
  remove_leftovers(path_);
  if (resumed_step_ >= 0) cut_metrics(metrics_path(), resumed_step_);
  rewrite_atomically((fs::path(path_) / kRunRecord).string(), {json{{"run_id", run_id_}, {"run", run_}}.dump()});
  prepared_ = true;
}

RunDirectory::~RunDirectory() {
  // A run refused before it started leaves no directory it made: only its lock file is there.
  if (created_ && !prepared_) {
    std::error_code ec;
    fs::remove(fs::path(path_) / ".lock", ec);
    fs::remove(path_, ec);  // not when something else appeared in it meanwhile
  }
  ::close(lock_fd_);
}

// ---------------------------------------------------------------------------------------------

CheckedLog::Buffer::Buffer() : space_(1 << 16) { setp(space_.data(), space_.data() + space_.size()); }

CheckedLog::Buffer::~Buffer() { close_quietly(); }

void CheckedLog::Buffer::open(const std::string& path) {
  close_quietly();
  path_ = path;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(path + ": cannot open for writing: " + errno_text());
}

void CheckedLog::Buffer::close_quietly() {
  if (fd_ < 0) return;
  try {
    drain();
  } catch (const std::exception&) {
    // Destruction on an error path: the error that ended the run has been reported already.
  }
  ::close(fd_);
  fd_ = -1;
}

void CheckedLog::Buffer::drain() {
  const size_t n = static_cast<size_t>(pptr() - pbase());
  setp(space_.data(), space_.data() + space_.size());  // dropped on failure too: never retried half
  if (n == 0) return;
  if (fd_ < 0) throw std::runtime_error(path_ + ": cannot write: not open");
  // A write that fails part-way (disk full) is cut back off, so that the log still ends with the
  // last whole line (the buffer is flushed line by line).
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  try {
    write_all(fd_, space_.data(), n, path_);
  } catch (...) {
    if (before >= 0 && ::ftruncate(fd_, before) != 0) {
      // Not a regular file (a pipe, /dev/full): nothing to cut back.
    }
    throw;
  }
}

int CheckedLog::Buffer::overflow(int c) {
  drain();
  if (c != traits_type::eof()) {
    *pptr() = traits_type::to_char_type(c);
    pbump(1);
  }
  return traits_type::not_eof(c);
}

int CheckedLog::Buffer::sync() {
  drain();
  return 0;
}

CheckedLog::CheckedLog() : std::ostream(nullptr) {
  rdbuf(&buf_);
  exceptions(std::ios::badbit);
}

CheckedLog::~CheckedLog() { buf_.close_quietly(); }

void CheckedLog::open(const std::string& path) { buf_.open(path); }

}  // namespace shardlm::train
