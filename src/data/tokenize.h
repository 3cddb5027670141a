// The tokenize driver: text files -> PREFIX_train.bin and PREFIX_val.bin token shards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// Encodes each input file whole, in the order given, and joins them with the tokenizer's
// eot() between consecutive files (gpt2: 50256). A tokenizer without one (bytes: eot() == -1)
// joins the files with nothing. The last floor(tokens * val_fraction) tokens go to
// PREFIX_val.bin, the rest to PREFIX_train.bin (both written atomically; the parent folder
// is created). Throws std::runtime_error naming the file on a read error, if val_fraction
// is not in [0, 1), or if the vocabulary does not fit uint16.
TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, double val_fraction = 0.1);

}  // namespace shardlm::data
