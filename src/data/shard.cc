#include "data/shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "files/replace_file.h"

namespace shardlm::data {

static_assert(std::endian::native == std::endian::little, "shards are little-endian; add byte swapping");

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("token shard " + path + ": " + what);
}

std::string errno_text() { return std::strerror(errno); }

// Widens n little-endian uint16 ids, read into the front of `ids`' bytes, to int32 in place
// (from the last, so no id is overwritten before it is read; through memcpy, the bytes being
// int32 objects).
void widen_in_place(int32_t* ids, int64_t n) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(ids);
  for (int64_t i = n - 1; i >= 0; --i) {
    uint16_t id;
    std::memcpy(&id, bytes + 2 * i, sizeof id);
    ids[i] = id;
  }
}

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

}  // namespace

TokenShardWriter::TokenShardWriter(std::string path, int token_bytes)
    : path_(std::move(path)), token_bytes_(token_bytes) {
  if (token_bytes != 2 && token_bytes != 4) fail(path_, "token_bytes " + std::to_string(token_bytes) + " is not 2 or 4");
  fd_ = files::create_temporary(path_, tmp_, O_RDWR);
  if (fd_ < 0) fail(tmp_, "cannot create: " + errno_text());
  const int32_t header[kShardHeaderInts] = {token_bytes == 2 ? kShardMagic : kShardMagicU32,
                                            token_bytes == 2 ? kShardVersion : kShardVersionU32, 0};
  try {
    write_all(fd_, header, sizeof(header), tmp_);
  } catch (...) {
    discard();
    throw;
  }
}

TokenShardWriter::~TokenShardWriter() { discard(); }

void TokenShardWriter::discard() {
  if (fd_ < 0 && !parked_) return;
  if (fd_ >= 0) ::close(fd_);
  ::unlink(tmp_.c_str());
  fd_ = -1;
  parked_ = false;
}

void TokenShardWriter::park() {
  if (fd_ < 0) return;
  if (::close(std::exchange(fd_, -1)) != 0) {
    ::unlink(tmp_.c_str());
    fail(tmp_, "close failed: " + errno_text());
  }
  parked_ = true;
}

void TokenShardWriter::unpark() {
  if (!parked_) return;
  parked_ = false;
  fd_ = ::open(tmp_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd_ < 0 || ::lseek(fd_, 0, SEEK_END) < 0) {
    const std::string err = errno_text();
    discard();
    fail(tmp_, "cannot reopen: " + err);
  }
}

// `count` ids already in the file's layout (token_bytes_ each).
void TokenShardWriter::write_ids(const void* ids, int64_t count) {
  unpark();
  if (fd_ < 0) fail(path_, "written after commit");
  if (count > kShardMaxTokens - count_)
    fail(path_, std::to_string(count_ + count) + " tokens do not fit the header's int32 count");
  write_all(fd_, ids, static_cast<size_t>(count) * static_cast<size_t>(token_bytes_), tmp_);
  count_ += count;
}

void TokenShardWriter::append(std::span<const uint16_t> tokens) {
  if (token_bytes_ == 2) return write_ids(tokens.data(), static_cast<int64_t>(tokens.size()));
  const std::vector<int32_t> wide(tokens.begin(), tokens.end());
  write_ids(wide.data(), static_cast<int64_t>(wide.size()));
}

void TokenShardWriter::append(std::span<const int32_t> tokens) {
  const int32_t most = token_bytes_ == 2 ? 0xFFFF : INT32_MAX;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] > most)
      fail(path_, "token " + std::to_string(tokens[i]) + " at position " + std::to_string(count_ + static_cast<int64_t>(i)) +
                      " does not fit " + (token_bytes_ == 2 ? "uint16" : "an id"));
  if (token_bytes_ == 4) return write_ids(tokens.data(), static_cast<int64_t>(tokens.size()));
  const std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
  write_ids(narrow.data(), static_cast<int64_t>(narrow.size()));
}

void TokenShardWriter::move_tail(int64_t n, TokenShardWriter& to) {
  move_tail(n, [&](std::span<const int32_t> tokens) { to.append(tokens); });
}

void TokenShardWriter::move_tail(int64_t n, const std::function<void(std::span<const int32_t>)>& to) {
  unpark();
  if (n < 0 || n > count_) fail(path_, "cannot move " + std::to_string(n) + " of its " + std::to_string(count_) + " tokens");
  const int64_t keep = count_ - n;
  std::vector<int32_t> ids(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 20)));
  for (int64_t first = keep; first < count_; first += static_cast<int64_t>(ids.size())) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(ids.size()), count_ - first);
    const size_t len_bytes = static_cast<size_t>(len) * static_cast<size_t>(token_bytes_);
    if (::pread(fd_, ids.data(), len_bytes, kShardHeaderBytes + first * static_cast<off_t>(token_bytes_)) !=
        static_cast<ssize_t>(len_bytes))
      fail(tmp_, "cannot read back: " + errno_text());
    if (token_bytes_ == 2) widen_in_place(ids.data(), len);
    to(std::span<const int32_t>(ids.data(), static_cast<size_t>(len)));
  }
  if (::ftruncate(fd_, kShardHeaderBytes + keep * static_cast<off_t>(token_bytes_)) != 0 || ::lseek(fd_, 0, SEEK_END) < 0)
    fail(tmp_, "cannot truncate: " + errno_text());
  count_ = keep;
}

void TokenShardWriter::commit() {
  unpark();
  if (fd_ < 0) fail(path_, "committed twice");
  const int32_t count = static_cast<int32_t>(count_);
  try {
    if (::pwrite(fd_, &count, sizeof(count), 2 * sizeof(int32_t)) != static_cast<ssize_t>(sizeof(count)))
      fail(tmp_, "cannot write the header: " + errno_text());
    if (::fsync(fd_) != 0) fail(tmp_, "fsync failed: " + errno_text());
  } catch (...) {
    discard();
    throw;
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    ::unlink(tmp_.c_str());
    fail(tmp_, "close failed: " + errno_text());
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp_.c_str());
    fail(path_, "cannot rename " + tmp_ + " to it: " + err);
  }
}

void write_token_shard(const std::string& path, std::span<const uint16_t> tokens) {
  TokenShardWriter w(path);
  w.append(tokens);
  w.commit();
}

void write_token_shard(const std::string& path, std::span<const int32_t> tokens, int token_bytes) {
  TokenShardWriter w(path, token_bytes);
  w.append(tokens);
  w.commit();
}

namespace {

struct Header {
  int64_t tokens = 0;
  int token_bytes = 2;
};

// The header's token count and width, after checking magic, version and that the file holds
// exactly that many tokens.
Header read_header(int fd, int64_t bytes, const std::string& path) {
  int32_t header[kShardHeaderInts];
  if (::pread(fd, header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header)))
    fail(path, "cannot read the header: " + errno_text());
  Header h;
  if (header[0] == kShardMagicU32) {
    h.token_bytes = 4;
    if (header[1] != kShardVersionU32)
      fail(path, "unsupported version " + std::to_string(header[1]) + " (expected " +
                     std::to_string(kShardVersionU32) + ": uint32 tokens, llm.c's llama-3 files)");
  } else if (header[0] == kShardMagic) {
    if (header[1] != kShardVersion)
      fail(path, "unsupported version " + std::to_string(header[1]) + " (expected " + std::to_string(kShardVersion) +
                     ": uint16 tokens)");
  } else {
    fail(path, "bad magic " + std::to_string(header[0]) + " (expected " + std::to_string(kShardMagic) + " or " +
                   std::to_string(kShardMagicU32) + "; not an llm.c token shard)");
  }
  h.tokens = header[2];
  if (h.tokens < 0) fail(path, "negative token count " + std::to_string(h.tokens));
  const int64_t expect = kShardHeaderBytes + h.token_bytes * h.tokens;
  if (bytes < expect)
    fail(path, "truncated: header says " + std::to_string(h.tokens) + " tokens (" + std::to_string(expect) +
                   " bytes) but the file has " + std::to_string(bytes) + " bytes");
  if (bytes > expect)
    fail(path, "header says " + std::to_string(h.tokens) + " tokens (" + std::to_string(expect) +
                   " bytes) but the file has " + std::to_string(bytes) + " bytes (trailing data)");
  return h;
}

}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, "cannot open: " + errno_text());
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) fail(path, "cannot stat: " + errno_text());
    if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
    if (st.st_size < kShardHeaderBytes)
      fail(path, "file is " + std::to_string(st.st_size) + " bytes, shorter than the " +
                     std::to_string(kShardHeaderBytes) + "-byte header");
    const Header h = read_header(fd_, st.st_size, path);
    ntokens_ = h.tokens;
    token_bytes_ = h.token_bytes;
  } catch (...) {
    release();
    throw;
  }
}

TokenShard::~TokenShard() { release(); }

void TokenShard::release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ntokens_ = 0;
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)), fd_(o.fd_), ntokens_(o.ntokens_), token_bytes_(o.token_bytes_) {
  o.fd_ = -1;
  o.ntokens_ = 0;
}

TokenShard& TokenShard::operator=(TokenShard&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    ntokens_ = o.ntokens_;
    token_bytes_ = o.token_bytes_;
    o.fd_ = -1;
    o.ntokens_ = 0;
  }
  return *this;
}

void TokenShard::read(int64_t first, int64_t count, int32_t* out) const {
  if (first < 0 || count < 0 || first > ntokens_ - count)
    throw std::out_of_range("token shard " + path_ + ": tokens [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") are not within its " + std::to_string(ntokens_));
  char* dst = reinterpret_cast<char*>(out);
  size_t left = static_cast<size_t>(count) * static_cast<size_t>(token_bytes_);
  off_t at = kShardHeaderBytes + first * static_cast<off_t>(token_bytes_);
  while (left > 0) {
    const ssize_t got = ::pread(fd_, dst, left, at);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path_, "read failed at byte " + std::to_string(at) + ": " + errno_text());
    if (got == 0) {
      struct stat st;
      const std::string now = ::fstat(fd_, &st) == 0 ? std::to_string(st.st_size) + " bytes" : "shorter";
      fail(path_, "the file is now " + now + " but its header says " + std::to_string(ntokens_) + " tokens (" +
                      std::to_string(kShardHeaderBytes + token_bytes_ * ntokens_) +
                      " bytes): it was truncated while in use");
    }
    dst += got;
    at += got;
    left -= static_cast<size_t>(got);
  }
  if (token_bytes_ == 2) widen_in_place(out, count);
}

std::vector<int32_t> TokenShard::read(int64_t first, int64_t count) const {
  std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(count, 0)));
  read(first, count, out.data());
  return out;
}

int32_t TokenShard::operator[](int64_t i) const {
  int32_t t = 0;
  read(i, 1, &t);
  return t;
}

void TokenShard::validate_tokens(int32_t vocab_size, int64_t first, int64_t count) const {
  for_each_chunk(*this, first, first + count, [&](int64_t at, const int32_t* t, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      if (static_cast<uint32_t>(t[i]) >= static_cast<uint32_t>(vocab_size))
        fail(path_, "token id " + std::to_string(static_cast<uint32_t>(t[i])) + " at position " + std::to_string(at + i) +
                        " is >= the vocabulary size " + std::to_string(vocab_size));
  });
}

}  // namespace shardlm::data
