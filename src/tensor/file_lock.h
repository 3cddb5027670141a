// An exclusive, non-blocking flock that tells "someone else holds it" apart from "this
// filesystem keeps no locks": some NFS mounts (no lock daemon: ENOLCK) and Lustre mounted without
// `flock` (ENOSYS) refuse flock outright, and a run there should go on unlocked, saying so,
// rather than be refused.
#pragma once

#include <sys/file.h>

#include <cerrno>

namespace shardlm {

enum class FileLock { held, busy, unsupported, failed };

// `err`: errno where failed.
inline FileLock lock_exclusive(int fd, int& err) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return FileLock::held;
  err = errno;
  if (err == EWOULDBLOCK) return FileLock::busy;
  if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP) return FileLock::unsupported;
  return FileLock::failed;
}

}  // namespace shardlm
