// The tokens of one split of a corpus (train or val), as one sequence: PREFIX_SPLIT.bin, or where
// there is none, every PREFIX_SPLIT_<digits>.bin in name order. llm.c writes large corpora as
// numbered shards (FineWeb-10B: fineweb_train_000001.bin ... _000099.bin, 100 M tokens each), and
// one file of the format holds at most 2^31 tokens; so `--data PREFIX` trains on llm.c's shards
// as they are, and on corpora of any size. A window may span two files (each of llm.c's starts
// with an end-of-text token, as between the documents within one).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/shard.h"

namespace shardlm::data {

// The files of PREFIX's split `split` ("train", "val"): PREFIX_SPLIT.bin where it exists, else the
// numbered ones in name order, else PREFIX_SPLIT.bin alone (opening it then names what is missing).
std::vector<std::string> split_files(const std::string& prefix, const std::string& split);

// `path` where it is a file; else, where PREFIX = `path` has a `split` (split_files), its files;
// else `path` (opening it then names it as missing). `eval --data` takes a file or a prefix.
std::vector<std::string> file_or_split(const std::string& path, const std::string& split);

// Every PREFIX_SPLIT_<digits>.bin, in name order.
std::vector<std::string> numbered_split_files(const std::string& prefix, const std::string& split);

// Tokens [first, end) of `total` that rank `rank` of `ranks` takes where each takes one
// contiguous share, in rank order; the shares' sizes differ by at most one.
struct TokenRange {
  int64_t first = 0, end = 0;
};
TokenRange share_of(int64_t total, int rank, int ranks);

// Read as TokenShard reads (pread; errors name the file).
class TokenCorpus {
 public:
  explicit TokenCorpus(const std::vector<std::string>& paths);  // at least one
  explicit TokenCorpus(const std::string& path) : TokenCorpus(std::vector<std::string>{path}) {}

  // The file, or "DIR/fineweb_train_*.bin (99 files)": for messages.
  const std::string& path() const { return name_; }
  int64_t size() const { return starts_.back(); }
  size_t files() const { return shards_.size(); }

  // Tokens [first, first + count), across files where the range spans them. Errors as
  // TokenShard::read's: std::out_of_range naming the corpus outside [0, size()).
  void read(int64_t first, int64_t count, int32_t* out) const;
  std::vector<int32_t> read(int64_t first, int64_t count) const;

  // Throws std::runtime_error naming the file, the first token id >= vocab_size and its position
  // in that file. A scan of every token, or of tokens [first, first + count).
  void validate_tokens(int32_t vocab_size) const { validate_tokens(vocab_size, 0, size()); }
  void validate_tokens(int32_t vocab_size, int64_t first, int64_t count) const;

 private:
  std::vector<TokenShard> shards_;
  std::vector<int64_t> starts_;  // starts_[i]: the first token of shards_[i]; the last entry the total
  std::string name_;
};

}  // namespace shardlm::data
