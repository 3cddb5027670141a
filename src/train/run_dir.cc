#include "train/run_dir.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <stdexcept>
#include <sys/file.h>
#include <thread>
#include <unistd.h>

namespace shardlm::train {

namespace fs = std::filesystem;

namespace {

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
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = err == EWOULDBLOCK ? lock_holder(fd) : "";
    ::close(fd);
    if (err != EWOULDBLOCK) throw std::runtime_error("run directory " + dir + ": cannot lock " + path + ": " + std::strerror(err));
    throw std::runtime_error(fmt::format("run directory {} is in use by another run ({}, holding {}); wait for it to end "
                                         "or choose another --out",
                                         dir, holder, path));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host);
  try {
    if (::ftruncate(fd, 0) != 0) throw std::runtime_error(path + ": cannot write: " + errno_text());
    write_all(fd, me.data(), me.size(), path);
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
// the final name could not be swapped atomically, latest.tmp-PID): only the lock holder's ranks
// write checkpoints here, so none of them belongs to a living run.
void remove_leftovers(const std::string& dir) {
  static const std::regex leftover(R"((step_\d+\.(tmp|old)|latest\.tmp)-\d+)");
  std::error_code ec;
  const fs::path ckpt = fs::path(dir) / "ckpt";
  if (!fs::is_directory(ckpt, ec)) return;
  for (const auto& entry : fs::directory_iterator(ckpt, ec))
    if (std::regex_match(entry.path().filename().string(), leftover)) remove_path(entry.path());
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().rfind("metrics.jsonl.tmp-", 0) == 0) remove_path(entry.path());
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
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(tmp + ": cannot create: " + errno_text());
  try {
    std::string text;
    for (const auto& l : lines) text += l + "\n";
    write_all(fd, text.data(), text.size(), tmp);
    if (::fsync(fd) != 0) throw std::runtime_error(tmp + ": cannot write: " + errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot replace " + path + ": " + why);
  }
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

std::unique_ptr<RunDirectory> RunDirectory::open(const TrainConfig& cfg, int64_t resumed_step, bool from_snapshot) {
  const std::string& dir = cfg.out;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw std::runtime_error("run directory " + dir + ": cannot create it: " + (ec ? ec.message() : "not a directory"));
  const int fd = lock_dir(dir);
  std::unique_ptr<RunDirectory> run(new RunDirectory(dir, fd));  // from here on, the lock is released on throw
  run->resumed_step_ = resumed_step;
  // Resuming DIR's own checkpoint continues DIR's run; any other run into a directory holding a
  // run would mix two runs' records.
  const bool continues_dir = resumed_step >= 0 && (from_snapshot || is_inside(cfg.resume, fs::path(dir) / "ckpt"));
  if (!continues_dir && holds_a_run(dir)) {
    if (!cfg.overwrite)
      throw std::runtime_error("run directory " + dir + " holds a run (metrics.jsonl or ckpt/)" +
                               (resumed_step >= 0 ? ", not the run --resume " + cfg.resume + " continues" : "") +
                               "; --resume " + dir + " (its latest checkpoint) to continue it, --overwrite to replace it, or "
                               "choose another --out");
    run->replace_ = true;
  }
  return run;
}

void RunDirectory::prepare() {
  if (replace_) {
    remove_path(fs::path(path_) / "ckpt");
    remove_path(fs::path(path_) / "metrics.jsonl");
  }
  remove_leftovers(path_);
  if (resumed_step_ >= 0) cut_metrics(metrics_path(), resumed_step_);
}

RunDirectory::~RunDirectory() { ::close(lock_fd_); }

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
