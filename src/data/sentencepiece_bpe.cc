// SentencePiece's BPE as a Hugging Face tokenizer.json holds it (LLaMA 2's, Mistral's, Mixtral's,
// TinyLlama's): text is normalized by writing each space as "▁" (U+2581) and putting one "▁" before
// the whole text (the Prepend and Replace normalizers); its code points are the initial symbols, a
// code point with no token of its own being its UTF-8 bytes' tokens <0x00> … <0xFF> (byte
// fallback); symbols are merged by rank as byte-level BPE merges bytes (bpe_core.h). Decoding
// writes "▁" back as a space and drops the one put before the text.
//
// There is no pre-tokenizer: the whole text is one piece. Pieces are cut anyway where no merge can
// join the two sides (a merge makes a token): before a "▁" that follows a code point no token holds
// before a "▁" (LLaMA 2's and Mistral's vocabularies put "▁" only at a token's start or in runs of
// "▁", so every space after a word is such a cut), and on both sides of an ASCII character with no
// token whose byte token no merge takes ("\n"). The pieces encode alone to the ids of the whole,
// repeated words are merged once, and a stream is encoded a piece at a time.
//
// Invalid UTF-8 bytes (which Hugging Face's tokenizers cannot be given) are each their byte's
// token, so every byte string encodes and decodes back, but U+2581, which decodes as a space.
#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "data/bpe_core.h"
#include "data/unicode.h"

namespace shardlm::data::bpe {
namespace {

constexpr uint32_t kSpaceMark = 0x2581;  // ▁
constexpr const char* kSpaceMarkUtf8 = "\xE2\x96\x81";

// What the reader builds the tokenizer from.
struct Vocabulary {
  std::string name;
  std::vector<std::string> decoded;              // id -> the bytes it decodes to
  std::unordered_map<uint32_t, int32_t> symbol;  // code point -> its token (spaces as "▁")
  std::array<int32_t, 256> byte_token{};         // byte -> <0xXX>
  std::unordered_set<uint32_t> joins_mark;       // code points some token has before a "▁"
  std::array<bool, 128> isolated{};              // ASCII with no token, whose byte tokens never merge ("\n")
  MergeTable merges;
  int32_t eot = -1, bos = -1;
  std::vector<int32_t> ends;
};

class SentencePieceBpe final : public Tokenizer {
 public:
  explicit SentencePieceBpe(Vocabulary v) : v_(std::move(v)) {}

  std::vector<int32_t> encode(std::string_view text) const override { return encode_from(text, true); }
  std::vector<int32_t> encode_continuation(std::string_view text) const override { return encode_from(text, false); }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) out += token(id);
    if (!out.empty() && out[0] == ' ') out.erase(0, 1);  // the "▁" put before the text
    return out;
  }
  std::string decode_token(int32_t id) const override { return token(id); }
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.decoded.size()); }
  int32_t eot() const override { return v_.eot; }
  int32_t bos() const override { return v_.bos; }
  std::vector<int32_t> end_tokens() const override { return v_.ends; }
  std::string name() const override { return v_.name; }

  size_t stable_prefix(std::string_view text) const override {
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    if (n > 0 && isolated(s[n - 1])) return n;
    for (size_t i = n; i-- > 1;)
      if (cut_at(s, n, i)) return i;
    return 0;
  }

 private:
  static constexpr size_t kMaxCached = 64;

  const std::string& token(int32_t id) const {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range(v_.name + " tokenizer: token id " + std::to_string(id) + " is not in [0, " +
                              std::to_string(vocab_size()) + ")");
    return v_.decoded[id];
  }

  // The code point that ends at s[i] (i > 0): the one decode_utf8 reads there, else the byte alone.
  static CodePoint ending_at(const unsigned char* s, size_t i) {
    size_t start = i - 1;
    while (start > 0 && i - start < 4 && (s[start] & 0xC0) == 0x80) --start;
    const CodePoint cp = decode_utf8(s, i, start);
    return start + cp.len == i ? cp : CodePoint{kInvalidCodePoint, 1, CharClass::kOther};
  }

  // Whether the text may be cut before the "▁" (a space or U+2581) starting at s[i], i > 0.
  bool cut_before(const unsigned char* s, size_t i) const {
    if (s[i - 1] == ' ' || (i >= 3 && s[i - 3] == 0xE2 && s[i - 2] == 0x96 && s[i - 1] == 0x81)) return false;
    return v_.joins_mark.empty() || !v_.joins_mark.count(ending_at(s, i).cp);
  }

  static bool mark_at(const unsigned char* s, size_t n, size_t i) {
    return s[i] == ' ' || (s[i] == 0xE2 && i + 2 < n && s[i + 1] == 0x96 && s[i + 2] == 0x81);
  }

  bool isolated(unsigned char b) const { return b < 128 && v_.isolated[b]; }

  // Whether no merge can join s[i - 1] and s[i] (0 < i < n), both ends of code points there: the
  // cut before a "▁" above, or either side a byte that is its byte token alone.
  bool cut_at(const unsigned char* s, size_t n, size_t i) const {
    return isolated(s[i - 1]) || isolated(s[i]) || (mark_at(s, n, i) && cut_before(s, i));
  }

  // Appends the initial symbols of the code point at s[i] and returns its length.
  size_t add_symbols(const unsigned char* s, size_t n, size_t i, std::vector<int32_t>& symbols) const {
    const CodePoint cp = decode_utf8(s, n, i);
    if (cp.cp != kInvalidCodePoint) {
      const auto it = v_.symbol.find(cp.cp == ' ' ? kSpaceMark : cp.cp);
      if (it != v_.symbol.end()) {
        symbols.push_back(it->second);
        return cp.len;
      }
    }
    for (uint32_t k = 0; k < cp.len; ++k) symbols.push_back(v_.byte_token[s[i + k]]);
    return cp.len;
  }

  void encode_piece(const unsigned char* s, size_t n, size_t from, size_t to, bool mark_first, Scratch& sc,
                    std::vector<int32_t>& out) const {
    sc.id.clear();
    if (mark_first) sc.id.push_back(v_.symbol.at(kSpaceMark));
    for (size_t i = from; i < to;) i += add_symbols(s, n, i, sc.id);
    merge(v_.merges, sc, out);
  }

  std::vector<int32_t> encode_from(std::string_view text, bool at_start) const {
    std::vector<int32_t> out;
    if (text.empty()) return out;
    out.reserve(text.size() / 3 + 16);
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;  // piece -> ids in cache_ids
    std::vector<int32_t> cache_ids;
    Scratch sc;
    // A space, a "▁" or an ASCII byte is never inside a code point (none is a continuation byte),
    // so the cuts can be looked for byte by byte.
    for (size_t start = 0, i = 1; start < n; ++i) {
      if (i < n && !cut_at(s, n, i)) continue;
      const std::string_view piece = text.substr(start, i - start);
      if (start == 0 && at_start) {
        encode_piece(s, n, start, i, true, sc, out);
      } else if (piece.size() > kMaxCached) {
        encode_piece(s, n, start, i, false, sc, out);
      } else if (const auto it = cache.find(piece); it != cache.end()) {
        out.insert(out.end(), cache_ids.begin() + it->second.first, cache_ids.begin() + it->second.first + it->second.second);
      } else {
        const size_t before = out.size();
        encode_piece(s, n, start, i, false, sc, out);
        const auto at = static_cast<uint32_t>(cache_ids.size());
        cache_ids.insert(cache_ids.end(), out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
        cache.emplace(piece, std::make_pair(at, static_cast<uint32_t>(out.size() - before)));
      }
      start = i;
    }
    return out;
  }

  const Vocabulary v_;
};

bool is_type(const nlohmann::json& o, const char* type) {
  return o.is_object() && o.contains("type") && o["type"] == type;
}

// LLaMA 2's normalizer: Prepend "▁", then Replace " " with "▁".
bool is_legacy_normalizer(const nlohmann::json& n) {
  if (!is_type(n, "Sequence") || !n.contains("normalizers") || !n["normalizers"].is_array() || n["normalizers"].size() != 2)
    return false;
  const nlohmann::json& prepend = n["normalizers"][0];
  const nlohmann::json& replace = n["normalizers"][1];
  return is_type(prepend, "Prepend") && prepend.value("prepend", "") == kSpaceMarkUtf8 && is_type(replace, "Replace") &&
         replace.contains("pattern") && replace["pattern"] == nlohmann::json{{"String", " "}} &&
         replace.value("content", "") == kSpaceMarkUtf8;
}

// The code point a token string is, or kInvalidCodePoint where it is not exactly one.
uint32_t single_code_point(const std::string& t) {
  const auto* u = reinterpret_cast<const unsigned char*>(t.data());
  if (t.empty()) return kInvalidCodePoint;
  const CodePoint cp = decode_utf8(u, t.size(), 0);
  return cp.len == t.size() ? cp.cp : kInvalidCodePoint;
}

// "<0x41>" -> 0x41, or -1.
int byte_of_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  const std::string hex = t.substr(3, 2);
  if (hex.find_first_not_of("0123456789ABCDEF") != std::string::npos) return -1;
  return std::stoi(hex, nullptr, 16);
}

// The text a token decodes to: "▁" as a space, a byte token as its byte.
std::string decoded_text(const std::string& t) {
  if (const int b = byte_of_token(t); b >= 0) return std::string(1, static_cast<char>(b));
  std::string out;
  for (size_t i = 0; i < t.size();)
    if (t.compare(i, 3, kSpaceMarkUtf8) == 0) {
      out += ' ';
      i += 3;
    } else {
      out += t[i++];
    }
  return out;
}

}  // namespace

bool is_sentencepiece_bpe(const nlohmann::json& j) {
  const nlohmann::json n = j.value("normalizer", nlohmann::json());
  const nlohmann::json p = j.value("pre_tokenizer", nlohmann::json());
  return is_legacy_normalizer(n) || is_type(p, "Metaspace");
}

std::unique_ptr<Tokenizer> read_sentencepiece_bpe(const nlohmann::json& j, const std::string& path,
                                                  const std::string& name) {
  const auto fail = [&](const std::string& field, const std::string& why) {
    throw std::runtime_error(path + ": " + field + ": " + why);
  };
  const nlohmann::json& model = j["model"];
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
    fail("pre_tokenizer", "shardlm reads SentencePiece's BPE as LLaMA 2's tokenizer.json writes it, with no pre-tokenizer "
                          "(its normalizers put the \"▁\"), not " + j["pre_tokenizer"].dump().substr(0, 200));
  if (!is_legacy_normalizer(j.value("normalizer", nlohmann::json())))
    fail("normalizer", "shardlm reads SentencePiece's BPE as LLaMA 2's tokenizer.json writes it (Prepend \"▁\", then "
                       "Replace \" \" with \"▁\"), not " + j["normalizer"].dump().substr(0, 200));
  if (model.value("byte_fallback", false) != true)
    fail("model.byte_fallback", "is not true: without it a code point with no token is <unk>, and the text cannot be "
                                "decoded back");
  for (const char* field : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(field) && !model[field].is_null())
      fail(std::string("model.") + field, "is set (" + model[field].dump() + "); SentencePiece's BPE has none");

  Vocabulary v;
  v.name = name;
  const std::map<std::string, int64_t> added = added_tokens_of(j, path);
  const nlohmann::json vocab = model.value("vocab", nlohmann::json());
  if (!vocab.is_object() || vocab.empty()) fail("model.vocab", "expected a JSON object of token -> id");
  size_t size = vocab.size();
  for (const auto& [text, id] : added) size += !vocab.contains(text);
  v.decoded.assign(size, std::string());
  std::vector<bool> seen(size, false);
  std::unordered_map<std::string, int32_t> ids;  // token string -> id, of the tokens merges may make
  v.byte_token.fill(-1);
  const auto place = [&](int64_t id, const std::string& text) {
    if (id < 0 || id >= static_cast<int64_t>(size) || seen[id])
      fail("model.vocab", "ids are not 0.." + std::to_string(size - 1) + " each once (token " + text + " has id " +
                              std::to_string(id) + ")");
    seen[id] = true;
  };
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) fail("model.vocab", "id of token " + it.key() + " is not an integer");
    if (added.count(it.key())) continue;  // placed below, as its text
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    place(id, it.key());
    v.decoded[id] = decoded_text(it.key());
    ids.emplace(it.key(), id);
    if (const int b = byte_of_token(it.key()); b >= 0) v.byte_token[b] = id;
    if (const uint32_t cp = single_code_point(it.key()); cp != kInvalidCodePoint) v.symbol.emplace(cp, id);
    for (size_t at = it.key().find(kSpaceMarkUtf8, 1); at != std::string::npos; at = it.key().find(kSpaceMarkUtf8, at + 1)) {
      const auto* u = reinterpret_cast<const unsigned char*>(it.key().data());
      size_t start = at - 1;
      while (start > 0 && (u[start] & 0xC0) == 0x80) --start;
      const uint32_t cp = decode_utf8(u, at, start).cp;
      if (cp != kSpaceMark) v.joins_mark.insert(cp);
    }
  }
  for (const auto& [text, id] : added) {
    place(id, text);
    v.decoded[id] = text;
  }
  for (int b = 0; b < 256; ++b)
    if (v.byte_token[b] < 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      fail("model.vocab", std::string("no token ") + hex + " for byte fallback");
    }
  if (!v.symbol.count(kSpaceMark)) fail("model.vocab", "no token \"▁\" for a space");

  const auto pairs = merges_of(model.value("merges", nlohmann::json()), path);
  if (pairs.empty()) fail("model.merges", "no merges");
  for (size_t r = 0; r < pairs.size(); ++r) {
    const auto id_of = [&](const std::string& t) {
      const auto it = ids.find(t);
      if (it == ids.end()) fail("model.merges[" + std::to_string(r) + "]", "token '" + t + "' is not in the vocabulary");
      return it->second;
    };
    const int32_t a = id_of(pairs[r].first), b = id_of(pairs[r].second), ab = id_of(pairs[r].first + pairs[r].second);
    v.merges.set(a, b, {static_cast<int32_t>(r), ab});
  }

  // A byte token that no merge takes is a piece of its own: text may be cut on both sides of an
  // ASCII character without a token (LLaMA 2's and Mistral's "\n", so text without spaces, as
  // Chinese is written, still streams a line at a time).
  bool byte_merges = false;
  for (const auto& [left, right] : pairs)
    for (const std::string* t : {&left, &right}) byte_merges = byte_merges || byte_of_token(*t) >= 0;
  for (int c = 0; c < 128; ++c) v.isolated[c] = !byte_merges && c != ' ' && !v.symbol.count(static_cast<uint32_t>(c));
  v.eot = document_separator(added);
  v.ends = end_tokens(added);
  // The token the post-processor begins a text with (LLaMA 2's: <s>).
  const nlohmann::json post = j.value("post_processor", nlohmann::json());
  if (is_type(post, "TemplateProcessing") && post.contains("single") && post["single"].is_array() &&
      !post["single"].empty() && post["single"][0].contains("SpecialToken")) {
    const std::string first = post["single"][0]["SpecialToken"].value("id", "");
    if (!added.count(first)) fail("post_processor.single", "begins with '" + first + "', which is not an added token");
    v.bos = static_cast<int32_t>(added.at(first));
  }
  return std::make_unique<SentencePieceBpe>(std::move(v));
}

}  // namespace shardlm::data::bpe
