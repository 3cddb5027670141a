// Preloaded into shardlm by NoFileLocksSlow (LD_PRELOAD): flock answers as on a filesystem that
// keeps no file locks (Lustre mounted without `flock`: ENOSYS).
#include <cerrno>

extern "C" int flock(int, int) {
  errno = ENOSYS;
  return -1;
}
