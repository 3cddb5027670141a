// Token shards in llm.c's .bin layout: a header of 256 little-endian int32 (magic 20240520,
// version 1, token count, the rest 0), then the tokens as little-endian uint16.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace shardlm::data {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

// Writes PATH.tmp, then renames it to PATH, so PATH is either absent, the old file, or the
// whole new file. Throws std::runtime_error (naming the file) on an I/O error, a token that
// does not fit uint16, or more tokens than an int32 count can hold.
void write_token_shard(const std::string& path, std::span<const int32_t> tokens);
void write_token_shard(const std::string& path, std::span<const uint16_t> tokens);

// A shard mapped read-only into memory. The constructor validates the header and the size;
// each problem (missing file, shorter than the header, wrong magic, wrong version, size not
// matching the token count) is a std::runtime_error with one line naming the file.
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
  const uint16_t* data() const { return tokens_; }
  uint16_t operator[](int64_t i) const { return tokens_[i]; }

  // Throws std::runtime_error naming the file, the first token id >= vocab_size and its
  // position. A scan of the whole shard (about 1 GB/s).
  void validate_tokens(int32_t vocab_size) const;

 private:
  void release();
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t ntokens_ = 0;
};

}  // namespace shardlm::data
