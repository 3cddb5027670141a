// The tokenize driver: text files -> PREFIX_train.bin and PREFIX_val.bin token shards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/shard.h"
#include "data/tokenizer.h"

namespace shardlm::data {

struct TokenizeStats {
  int64_t files = 0;
  int64_t bytes = 0;         // input bytes
  int64_t tokens = 0;        // all tokens, separators included
  int64_t train_tokens = 0;  // the first tokens - val_tokens
  int64_t val_tokens = 0;    // the last floor(tokens * val_fraction)
  std::string train_path;    // PREFIX_train.bin
  std::string val_path;      // PREFIX_val.bin
  double seconds = 0;        // wall time of reading + encoding
};

// What keeps tokenize's time, memory and output finite whatever the input (/dev/zero included).
// Tests make them small so that reaching them takes kilobytes, not gigabytes.
struct TokenizeLimits {
  int64_t max_tokens = kShardMaxTokens;      // all tokens, separators included: the format's count
  int64_t max_unbroken_bytes = int64_t{16} << 20;  // text the tokenizer may hold waiting for a break
  int64_t read_bytes = int64_t{1} << 20;     // read (and encoded) at a time
};

// Encodes each input file as a whole, in the order given, and joins them with the tokenizer's
// eot() between consecutive files (gpt2: 50256). A tokenizer without one (bytes: eot() == -1)
// joins the files with nothing. The last floor(tokens * val_fraction) tokens go to
// PREFIX_val.bin, the rest to PREFIX_train.bin (both written atomically; the parent folder
// is created). Inputs are read and encoded a piece at a time (Tokenizer::stable_prefix), so
// memory stays bounded and the tokens are those of encoding each file at once.
// Throws std::runtime_error (one line naming the file) on a read error, if val_fraction is not
// in [0, 1), if the vocabulary does not fit uint16, if the inputs make more than
// limits.max_tokens tokens, or if a file holds more than limits.max_unbroken_bytes without a
// place the tokenizer can break (not text). Nothing is written then.
TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, double val_fraction = 0.1,
                             const TokenizeLimits& limits = {});

}  // namespace shardlm::data
