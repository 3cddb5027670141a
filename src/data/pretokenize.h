// Pre-tokenization: the split of text into the pieces a byte-level BPE encodes one by one, as
// GPT-2's and LLaMA 3's tokenizers split it (their regexes, matched by hand over UTF-8 code
// points; data/unicode.h classes them). Internal to data/.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

namespace shardlm::data {

enum class Pretokenizer {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  gpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  // (LLaMA 3's, also OpenAI's cl100k_base)
  llama3,
};

// The end of the piece that starts at s[i] (i < n).
size_t next_piece(Pretokenizer p, const unsigned char* s, size_t n, size_t i);

// The length of the longest prefix of `text` whose pieces no text after it can change, and which
// split alone gives the same pieces: the end of the last piece that ends 8 bytes or more before
// the end (the most matching reads past a piece is a whitespace code point and another) and is
// not whitespace (the end of the text joins a whitespace piece to the whitespace before it). 0
// where there is none.
size_t stable_prefix(Pretokenizer p, std::string_view text);

// The pieces of `text` (views into it; together they cover it exactly). Invalid UTF-8 bytes count
// as single code points of the "other" class.
std::vector<std::string_view> pretokenize(Pretokenizer p, std::string_view text);

}  // namespace shardlm::data
