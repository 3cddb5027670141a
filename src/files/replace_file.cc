#include "files/replace_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>

namespace shardlm::files {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

std::string temporary_name(const std::string& target, unsigned random, uint64_t count) {
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, ".tmp-%ld-%x%04x", static_cast<long>(::getpid()), random,
                static_cast<unsigned>(count & 0xffff));
  return target + suffix;
}

}  // namespace

void write_all(int fd, std::string_view text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(n == 0 ? "nothing written" : errno_text());
    done += static_cast<size_t>(n);
  }
}

int create_temporary(const std::string& target, std::string& tmp, int flags) {
  // Threads of one process differ by the counter, processes by the pid; the random part keeps a
  // name someone planted (a link) from being the only one tried.
  static std::atomic<uint64_t> counter{0};
  std::random_device entropy;
  for (int attempt = 0; attempt < 100; ++attempt) {
    tmp = temporary_name(target, entropy(), counter++);
    const int fd = ::open(tmp.c_str(), flags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

void commit_temporary(int fd, const std::string& tmp, const std::string& target) {
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = ::close(fd) == 0;
  if (!synced) errno = sync_errno;
  if (!synced || !closed || ::rename(tmp.c_str(), target.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot write " + target + ": " + why);
  }
}

void replace_file(const std::string& path, const std::string& text) {
  struct stat st{};
  if (fs::path(path).filename().empty() || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
    throw std::runtime_error(path + " is a directory; give a file name");
  std::string tmp;
  const int fd = create_temporary(path, tmp, O_WRONLY);
  if (fd < 0) throw std::runtime_error("cannot write " + path + ": " + errno_text());
  try {
    write_all(fd, text);
  } catch (const std::exception& e) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot write " + path + ": " + e.what());
  }
  commit_temporary(fd, tmp, path);
}

}  // namespace shardlm::files
