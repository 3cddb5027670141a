#include "report/replace_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <random>
#include <stdexcept>

namespace shardlm::report {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// PATH.tmp-PID-RANDOM, created with O_EXCL|O_NOFOLLOW: if the name exists (another writer's, or a
// link) another is drawn. Threads of one process differ by the counter, processes by the pid.
int create_temporary(const std::string& path, std::string& tmp) {
  static std::atomic<uint64_t> counter{0};
  std::random_device entropy;
  for (int attempt = 0; attempt < 100; ++attempt) {
    tmp = fmt::format("{}.tmp-{}-{:x}{:04x}", path, ::getpid(), entropy(), counter++ & 0xffff);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(errno_text());
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) throw std::runtime_error(errno_text());
}

}  // namespace

void replace_file(const std::string& path, const std::string& text) {
  struct stat st{};
  if (fs::path(path).filename().empty() || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
    throw std::runtime_error(path + " is a directory; give a file name");
  std::string tmp;
  const int fd = create_temporary(path, tmp);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot write {}: {}", path, errno_text()));
  try {
    write_all(fd, text);
  } catch (const std::exception& e) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot write {}: {}", path, e.what()));
  }
  if (::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot write {}: {}", path, why));
  }
}

}  // namespace shardlm::report
