// The tokenize driver: text files -> PREFIX_train.bin and PREFIX_val.bin token files, or llm.c's
// numbered shards (PREFIX_train_000000.bin ...) for corpora past one file's 2^31 tokens.
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
  std::vector<std::string> train_files;  // PREFIX_train.bin, or PREFIX_train_000000.bin ...
  std::vector<std::string> val_files;    // likewise
  double seconds = 0;        // wall time of reading + encoding
};

// What keeps tokenize's time, memory and output finite whatever the input (/dev/zero included).
// Tests make them small so that reaching them takes kilobytes, not gigabytes.
struct TokenizeLimits {
  // All tokens, separators included. 0: what the output holds, one file's count (2^31 - 1), or
  // with shard_tokens a million files of it (the six digits of their numbers).
  int64_t max_tokens = 0;
  int64_t max_unbroken_bytes = int64_t{16} << 20;  // text the tokenizer may hold waiting for a break
  int64_t read_bytes = int64_t{1} << 20;     // read (and encoded) at a time
  int64_t max_line_bytes = int64_t{1} << 30;  // a JSON Lines record (one document) at most
};

struct TokenizeOptions {
  double val_fraction = 0.1;  // the last floor(tokens * val_fraction) tokens are validation
  int64_t shard_tokens = 0;   // > 0: numbered files of at most this many tokens, not one a split
  int threads = 1;            // encoding that many pieces of read_bytes at once
  std::string text_field = "text";  // the field of a JSON Lines record that holds its document
  TokenizeLimits limits = {};
};

// Encodes each input file as a whole, in the order given, and joins them with the tokenizer's
// eot() between consecutive files (gpt2: 50256). A file named *.jsonl is JSON Lines, as corpora
// such as FineWeb, C4 and OpenWebText are distributed: each non-blank line an object whose string
// field `text_field` is a document of its own, joined to the next by eot() as files are (the other
// fields are ignored). A tokenizer without one (bytes: eot() == -1) joins them with nothing. The last floor(tokens * val_fraction) tokens go to
// PREFIX_val.bin, the rest to PREFIX_train.bin; with shard_tokens > 0, to numbered files of at
// most that many tokens each instead, PREFIX_val_000000.bin ... and PREFIX_train_000000.bin ...
// (train's --data PREFIX reads either). Every file is written atomically, the parent folder
// created; then any other file of the prefix's splits (what train would read with them: an old
// run's shards, or the whole file that would hide the new shards) is removed. Inputs are read a
// piece at a time and each piece is encoded up to the tokenizer's stable prefix
// (Tokenizer::stable_prefix), on `threads` threads at once, so memory stays bounded and the tokens
// are those of encoding each file at once, whatever the threads.
// Throws std::runtime_error (one line naming the file) on a read error, a JSON Lines line that
// is not UTF-8, not an object with that string field or longer than limits.max_line_bytes
// (FILE:LINE), if val_fraction is not in [0, 1), if the inputs make more than the limit's tokens,
// or if a file or a record's text holds more than limits.max_unbroken_bytes without a place the
// tokenizer can break (not text).
// Nothing is written then.
TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, const TokenizeOptions& options = {});

}  // namespace shardlm::data
