#include "data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace shardlm::data {

static_assert(std::endian::native == std::endian::little, "shards are little-endian; add byte swapping");

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("token shard " + path + ": " + what);
}

std::string errno_text() { return std::strerror(errno); }

// Writes all bytes or throws.
void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path, "write failed: " + errno_text());
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void write_shard_u16(const std::string& path, const uint16_t* tokens, size_t n) {
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail(path, std::to_string(n) + " tokens do not fit the header's int32 count");
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(n);
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, "cannot create: " + errno_text());
  try {
    write_all(fd, header, sizeof(header), tmp);
    write_all(fd, tokens, n * sizeof(uint16_t), tmp);
    if (::fsync(fd) != 0) fail(tmp, "fsync failed: " + errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail(tmp, "close failed: " + errno_text());
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp.c_str());
    fail(path, "cannot rename " + tmp + " to it: " + err);
  }
}

}  // namespace

void write_token_shard(const std::string& path, std::span<const uint16_t> tokens) {
  write_shard_u16(path, tokens.data(), tokens.size());
}

void write_token_shard(const std::string& path, std::span<const int32_t> tokens) {
  std::vector<uint16_t> t(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > 0xFFFF)
      fail(path, "token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                     " does not fit uint16");
    t[i] = static_cast<uint16_t>(tokens[i]);
  }
  write_shard_u16(path, t.data(), t.size());
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    fail(path, "cannot stat: " + err);
  }
  const int64_t bytes = st.st_size;
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  if (bytes < kShardHeaderBytes) {
    ::close(fd);
    fail(path, "file is " + std::to_string(bytes) + " bytes, shorter than the " +
                   std::to_string(kShardHeaderBytes) + "-byte header");
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, fd, 0);
  const std::string err = errno_text();
  ::close(fd);
  if (map == MAP_FAILED) fail(path, "mmap failed: " + err);
  map_ = map;
  map_bytes_ = static_cast<size_t>(bytes);
  try {
    const auto* header = static_cast<const int32_t*>(map_);
    if (header[0] != kShardMagic)
      fail(path, "bad magic " + std::to_string(header[0]) + " (expected " + std::to_string(kShardMagic) +
                     "; not an llm.c token shard)");
    if (header[1] != kShardVersion)
      fail(path, "unsupported version " + std::to_string(header[1]) + " (expected " +
                     std::to_string(kShardVersion) + ": uint16 tokens)");
    const int64_t n = header[2];
    if (n < 0) fail(path, "negative token count " + std::to_string(n));
    const int64_t expect = kShardHeaderBytes + 2 * n;
    if (bytes < expect)
      fail(path, "truncated: header says " + std::to_string(n) + " tokens (" + std::to_string(expect) +
                     " bytes) but the file has " + std::to_string(bytes) + " bytes");
    if (bytes > expect)
      fail(path, "header says " + std::to_string(n) + " tokens (" + std::to_string(expect) +
                     " bytes) but the file has " + std::to_string(bytes) + " bytes (trailing data)");
    ntokens_ = n;
    tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) + kShardHeaderBytes);
  } catch (...) {
    release();
    throw;
  }
}

TokenShard::~TokenShard() { release(); }

void TokenShard::release() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  ntokens_ = 0;
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)), map_(o.map_), map_bytes_(o.map_bytes_), tokens_(o.tokens_), ntokens_(o.ntokens_) {
  o.map_ = nullptr;
  o.map_bytes_ = 0;
  o.tokens_ = nullptr;
  o.ntokens_ = 0;
}

TokenShard& TokenShard::operator=(TokenShard&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    tokens_ = o.tokens_;
    ntokens_ = o.ntokens_;
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.tokens_ = nullptr;
    o.ntokens_ = 0;
  }
  return *this;
}

void TokenShard::validate_tokens(int32_t vocab_size) const {
  for (int64_t i = 0; i < ntokens_; ++i) {
    if (static_cast<int32_t>(tokens_[i]) >= vocab_size)
      fail(path_, "token id " + std::to_string(tokens_[i]) + " at position " + std::to_string(i) +
                      " is >= the vocabulary size " + std::to_string(vocab_size));
  }
}

}  // namespace shardlm::data
