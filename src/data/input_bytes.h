// An input file's bytes as they were before compression: tokenize reads corpora as they are
// distributed (C4's and Dolma's *.json.gz, SlimPajama's and the Pile's *.jsonl.zst) without a
// decompressed copy on disk.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace shardlm::data {

class InputBytes {
 public:
  // PATH ending in .gz is gzip (its members one after another, as `cat a.gz b.gz` makes), .zst
  // zstd (its frames likewise), anything else is read as it is. Throws std::runtime_error
  // "cannot open input file PATH: REASON".
  explicit InputBytes(const std::string& path);
  ~InputBytes();
  InputBytes(const InputBytes&) = delete;
  InputBytes& operator=(const InputBytes&) = delete;

  // Up to n bytes into buf; 0 at the end. Throws std::runtime_error naming the file on a read
  // error or data that is not what its name says (not gzip, corrupt, truncated).
  size_t read(char* buf, size_t n);

  // The name without its compression suffix ("c4.json.gz" -> "c4.json"): what the content is.
  static std::string content_name(const std::string& path);

  class Source;

 private:
  std::unique_ptr<Source> source_;
};

}  // namespace shardlm::data
