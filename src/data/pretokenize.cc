#include "data/pretokenize.h"

#include "data/unicode.h"

namespace shardlm::data {
namespace {

bool is_newline(unsigned char c) { return c == '\r' || c == '\n'; }

// The end of the run of code points of class `cls` that starts at s[i], at most `most` of them.
size_t end_of_run(const unsigned char* s, size_t n, size_t i, CharClass cls, size_t most = SIZE_MAX) {
  size_t e = i;
  for (size_t count = 0; e < n && count < most; ++count) {
    const CodePoint c = decode_utf8(s, n, e);
    if (c.cls != cls) break;
    e += c.len;
  }
  return e;
}

// The whitespace alternatives \s+(?!\S)|\s+ at s[i], a whitespace code point: a run that ends
// the text is taken whole; one followed by a non-space gives its last code point back to the
// piece after it (if it has two or more).
size_t whitespace_piece(const unsigned char* s, size_t n, size_t i) {
  size_t e = i, last = i;
  int count = 0;
  while (e < n) {
    const CodePoint c = decode_utf8(s, n, e);
    if (c.cls != CharClass::kSpace) break;
    last = e;
    e += c.len;
    ++count;
  }
  return e == n || count == 1 ? e : last;
}

// GPT-2. The alternatives, in the regex's order:
//   1  's 't 're 've 'm 'll 'd
//   2  ' '? letter+        3  ' '? number+        4  ' '? other+
//   5, 6  whitespace (whitespace_piece)
size_t next_piece_gpt2(const unsigned char* s, size_t n, size_t i) {
  if (s[i] == '\'' && i + 1 < n) {
    const unsigned char c = s[i + 1];
    if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
    if (i + 2 < n) {
      const unsigned char c2 = s[i + 2];
      if ((c == 'r' && c2 == 'e') || (c == 'v' && c2 == 'e') || (c == 'l' && c2 == 'l')) return i + 3;
    }
  }
  CodePoint cp = decode_utf8(s, n, i);
  size_t j = i;  // where the letter/number/other run starts
  if (s[i] == ' ' && i + 1 < n) {
    const CodePoint nx = decode_utf8(s, n, i + 1);
    if (nx.cls != CharClass::kSpace) {
      j = i + 1;
      cp = nx;
    }
  }
  if (cp.cls != CharClass::kSpace) return end_of_run(s, n, j + cp.len, cp.cls);  // alternatives 2-4
  return whitespace_piece(s, n, i);
}

// LLaMA 3. The alternatives, in the regex's order:
//   1  's 't 're 've 'm 'll 'd, in either case
//   2  one code point that is no newline, letter or number (a space, a tab, punctuation), then letter+
//   3  one to three numbers
//   4  ' '? other+ then any \r and \n
//   5  whitespace up to and with its last \r or \n
//   6, 7  whitespace (whitespace_piece)
size_t next_piece_llama3(const unsigned char* s, size_t n, size_t i) {
  const auto lower = [](unsigned char c) { return static_cast<unsigned char>(c >= 'A' && c <= 'Z' ? c + 32 : c); };
  if (s[i] == '\'' && i + 1 < n) {
    const unsigned char c = lower(s[i + 1]);
    if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
    if (i + 2 < n) {
      const unsigned char c2 = lower(s[i + 2]);
      if ((c == 'r' && c2 == 'e') || (c == 'v' && c2 == 'e') || (c == 'l' && c2 == 'l')) return i + 3;
    }
  }
  const CodePoint first = decode_utf8(s, n, i);
  if (first.cls == CharClass::kLetter) return end_of_run(s, n, i, CharClass::kLetter);
  if (first.cls == CharClass::kNumber) return end_of_run(s, n, i, CharClass::kNumber, 3);
  const size_t second = i + first.len;
  if (!is_newline(s[i]) && second < n && decode_utf8(s, n, second).cls == CharClass::kLetter)
    return end_of_run(s, n, second, CharClass::kLetter);
  const size_t other = s[i] == ' ' && second < n ? second : i;
  if (decode_utf8(s, n, other).cls == CharClass::kOther) {
    size_t e = end_of_run(s, n, other, CharClass::kOther);
    while (e < n && is_newline(s[e])) ++e;
    return e;
  }
  size_t after_newline = 0;  // alternative 5
  for (size_t e = i; e < n;) {
    const CodePoint c = decode_utf8(s, n, e);
    if (c.cls != CharClass::kSpace) break;
    e += c.len;
    if (is_newline(s[e - 1])) after_newline = e;
  }
  return after_newline > 0 ? after_newline : whitespace_piece(s, n, i);
}

// Whether the piece [i, e) is whitespace only: every other piece's first or second code point
// is not whitespace.
bool is_whitespace_piece(const unsigned char* s, size_t n, size_t i, size_t e) {
  const CodePoint first = decode_utf8(s, n, i);
  return first.cls == CharClass::kSpace && (i + first.len == e || decode_utf8(s, n, i + first.len).cls == CharClass::kSpace);
}

}  // namespace

size_t next_piece(Pretokenizer p, const unsigned char* s, size_t n, size_t i) {
  return p == Pretokenizer::gpt2 ? next_piece_gpt2(s, n, i) : next_piece_llama3(s, n, i);
}

size_t stable_prefix(Pretokenizer p, std::string_view text) {
  constexpr size_t kLookahead = 8;
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t stable = 0;
  for (size_t i = 0; i < n;) {
    const size_t e = next_piece(p, s, n, i);
    if (e + kLookahead > n) break;
    if (!is_whitespace_piece(s, n, i, e)) stable = e;
    i = e;
  }
  return stable;
}

std::vector<std::string_view> pretokenize(Pretokenizer p, std::string_view text) {
  std::vector<std::string_view> pieces;
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const size_t e = next_piece(p, s, text.size(), i);
    pieces.push_back(text.substr(i, e - i));
    i = e;
  }
  return pieces;
}

}  // namespace shardlm::data
