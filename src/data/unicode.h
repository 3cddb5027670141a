// Code point classes and UTF-8 decoding for the GPT-2 pre-tokenizer (internal to data/).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace shardlm::data {

// The classes GPT-2's pre-tokenizer regex distinguishes: \p{L}, \p{N}, \s, and the rest.
enum class CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

// Class of a Unicode code point (anything above U+10FFFF, and surrogates, are kOther).
CharClass char_class(uint32_t cp);

// Unicode version of the generated table (src/data/unicode_classes.cc).
const char* unicode_table_version();

// One decoded code point: its value, its length in bytes and its class. An invalid or
// truncated UTF-8 sequence yields its first byte alone as a code point of class kOther
// (cp = 0xFFFFFFFF), so every byte of the input belongs to exactly one code point.
struct CodePoint {
  uint32_t cp;
  uint32_t len;
  CharClass cls;
};
constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFFu;

namespace unicode_detail {
extern const std::array<CharClass, 128> kAsciiClasses;  // char_class of U+0000 .. U+007F
CodePoint decode_utf8_multibyte(const unsigned char* s, size_t n, size_t i);
}  // namespace unicode_detail

// Decodes the code point starting at s[i] (requires i < n). Rejects overlong forms,
// surrogates and values above U+10FFFF, as strict UTF-8 does. Inline for ASCII, the bulk of
// most text (the pre-tokenizer decodes every byte at least once).
inline CodePoint decode_utf8(const unsigned char* s, size_t n, size_t i) {
  const unsigned char b0 = s[i];
  if (b0 < 0x80) return {b0, 1, unicode_detail::kAsciiClasses[b0]};
  return unicode_detail::decode_utf8_multibyte(s, n, i);
}

namespace unicode_detail {
struct ClassRange {
  uint32_t lo, hi;  // inclusive
  CharClass cls;
};
extern const char* const kUnicodeVersion;
extern const int kNumClassRanges;
extern const ClassRange kClassRanges[];
}  // namespace unicode_detail

}  // namespace shardlm::data
