// What the two kinds of BPE tokenizer share (internal to data/): the merge table, the merge loop,
// and reading the files. Byte-level BPE (GPT-2's, LLaMA 3's) is bpe_tokenizer.cc; SentencePiece's
// BPE as Hugging Face writes it (LLaMA 2's, Mistral's) is sentencepiece_bpe.cc.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/tokenizer.h"

namespace shardlm::data::bpe {

struct Merge {
  int32_t rank;
  int32_t id;  // the merged token
};

// Token pair -> merge.
class MergeTable {
 public:
  // A repeated pair keeps its last rank, as Hugging Face's tokenizers do.
  void set(int32_t a, int32_t b, Merge m) { merges_[key(a, b)] = m; }
  const Merge* find(int32_t a, int32_t b) const {
    const auto it = merges_.find(key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

 private:
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  std::unordered_map<uint64_t, Merge> merges_;
};

// Buffers one encode call reuses from piece to piece.
struct Scratch {
  struct Candidate {
    int32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<int32_t> id, prev, next;
  std::vector<Candidate> heap;
};

// Merges the tokens in `sc.id` (one piece's symbols, at least one) and appends the result to
// `out`: the adjacent pair of lowest merge rank first, ties going to the leftmost pair, as Hugging
// Face's tokenizers merge. O(n log n) in the piece's length.
void merge(const MergeTable& merges, Scratch& sc, std::vector<int32_t>& out);

// A file's bytes; an error names `what` and `path`, and ends with `fetch_hint`.
std::string read_file(const std::string& path, const std::string& what, const std::string& fetch_hint);
nlohmann::json parse_json(const std::string& text, const std::string& path);

// tokenizer.json's model.merges: "a b" strings, or [a, b] pairs (the newer format).
std::vector<std::pair<std::string, std::string>> merges_of(const nlohmann::json& merges, const std::string& path);

// tokenizer.json's added_tokens: content -> id.
std::map<std::string, int64_t> added_tokens_of(const nlohmann::json& j, const std::string& path);

// Of the added tokens: the one tokenize puts between documents (<|endoftext|>, else
// <|begin_of_text|>, else <s>; -1 for none), and those a model ends its text with (<|endoftext|>,
// <|end_of_text|>, <|eot_id|>, </s>).
int32_t document_separator(const std::map<std::string, int64_t>& added);
std::vector<int32_t> end_tokens(const std::map<std::string, int64_t>& added);

// Whether a tokenizer.json is SentencePiece's BPE (byte fallback, "▁" for a space) rather than a
// byte-level one.
bool is_sentencepiece_bpe(const nlohmann::json& j);

// The tokenizer of a SentencePiece-style tokenizer.json `j` read from `path`. Errors are
// std::runtime_error with one line naming the file and the field.
std::unique_ptr<Tokenizer> read_sentencepiece_bpe(const nlohmann::json& j, const std::string& path,
                                                  const std::string& name);

}  // namespace shardlm::data::bpe
