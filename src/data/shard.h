// Token shards in llm.c's .bin layout: a header of 256 little-endian int32 (magic, version, token
// count, the rest 0), then the tokens, little-endian: GPT-2's (magic 20240520, version 1) as
// uint16, LLaMA 3's (magic 20240801, version 7: a vocabulary of 128256) as uint32. Both are read
// and written (tokenize writes the first where the vocabulary fits uint16).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace shardlm::data {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShardMagicU32 = 20240801;  // llm.c's llama-3 files
constexpr int32_t kShardVersionU32 = 7;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
constexpr int64_t kShardMaxTokens = 2147483647;  // the header's int32 count

// Writes a temporary file of its own beside PATH (files/replace_file.h), then renames it to PATH, so PATH is either absent, the old file, or the
// whole new file; `token_bytes` 2 is GPT-2's layout, 4 LLaMA 3's. Throws std::runtime_error
// (naming the file) on an I/O error, a token that does not fit the layout, or more tokens than an
// int32 count can hold.
void write_token_shard(const std::string& path, std::span<const int32_t> tokens, int token_bytes = 2);
void write_token_shard(const std::string& path, std::span<const uint16_t> tokens);

// A shard written as its tokens come, for inputs too large to hold (tokenize streams them):
// a temporary file of its own beside PATH until commit() writes the count into the header, fsyncs
// and renames it to PATH. A writer destroyed before commit() removes its temporary file; PATH is never touched until then. Errors
// are std::runtime_error naming the file.
class TokenShardWriter {
 public:
  // token_bytes: 2 (GPT-2's layout, uint16 ids) or 4 (LLaMA 3's, uint32 ids).
  explicit TokenShardWriter(std::string path, int token_bytes = 2);
  ~TokenShardWriter();
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;

  int64_t size() const { return count_; }
  // Each id must fit the layout, and the shard at most kShardMaxTokens.
  void append(std::span<const int32_t> tokens);
  void append(std::span<const uint16_t> tokens);
  // Moves the last n tokens (n <= size()) to the end of `to`: hands them, in order and a piece at
  // a time, to `to`, then cuts them off.
  void move_tail(int64_t n, TokenShardWriter& to);
  void move_tail(int64_t n, const std::function<void(std::span<const int32_t>)>& to);
  void commit();
  // Closes the file until it is next used (append, move_tail and commit reopen it): a corpus
  // written as many numbered files keeps one descriptor open, not one a file.
  void park();

 private:
  void discard();
  void unpark();
  void write_ids(const void* ids, int64_t count);
  std::string path_, tmp_;
  int token_bytes_;
  int fd_ = -1;
  bool parked_ = false;
  int64_t count_ = 0;
};

// A shard open for reading. The constructor validates the header and the size; each problem
// (missing file, shorter than the header, wrong magic, wrong version, size not matching the
// token count) is a std::runtime_error with one line naming the file.
//
// Tokens are read with pread, not through a memory map: a mapped file truncated while the run
// uses it kills the process with SIGBUS and no message, where a read that comes back short is an
// error naming the file. A file replaced by rename keeps being read as opened (the descriptor
// holds the old inode).
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return ntokens_; }
  int token_bytes() const { return token_bytes_; }  // 2 (GPT-2's layout) or 4 (LLaMA 3's)

  // Copies tokens [first, first + count) to out. Throws std::out_of_range naming the file for a
  // range outside [0, size()), std::runtime_error naming the file when the file has become
  // shorter than its header says (truncated after it was opened) or the read fails. A uint32
  // id past INT32_MAX reads as a negative one, which validate_tokens refuses.
  void read(int64_t first, int64_t count, int32_t* out) const;
  std::vector<int32_t> read(int64_t first, int64_t count) const;
  int32_t operator[](int64_t i) const;  // one token; for tests and spot checks

  // Throws std::runtime_error naming the file, the first token id >= vocab_size and its
  // position. A scan of the whole shard, or of tokens [first, first + count).
  void validate_tokens(int32_t vocab_size) const { validate_tokens(vocab_size, 0, ntokens_); }
  void validate_tokens(int32_t vocab_size, int64_t first, int64_t count) const;

 private:
  void release();
  std::string path_;
  int fd_ = -1;
  int64_t ntokens_ = 0;
  int token_bytes_ = 2;
};

// Calls fn(at, tokens, n) over tokens [first, end) of a shard (or TokenCorpus) in consecutive
// chunks of at most `chunk` tokens, `at` the chunk's first token.
template <class Tokens, class Fn>
void for_each_chunk(const Tokens& shard, int64_t first, int64_t end, Fn&& fn, int64_t chunk = int64_t{1} << 20) {
  std::vector<int32_t> buf(static_cast<size_t>(std::max<int64_t>(std::min(chunk, end - first), 0)));
  for (int64_t at = first; at < end; at += chunk) {
    const int64_t n = std::min(chunk, end - at);
    shard.read(at, n, buf.data());
    fn(at, static_cast<const int32_t*>(buf.data()), n);
  }
}

template <class Tokens, class Fn>
void for_each_chunk(const Tokens& shard, Fn&& fn, int64_t chunk = int64_t{1} << 20) {
  for_each_chunk(shard, 0, shard.size(), std::forward<Fn>(fn), chunk);
}

}  // namespace shardlm::data
