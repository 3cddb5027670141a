// GPT-2 byte-level BPE.
//
// Pre-tokenization is GPT-2's regex, matched by hand over UTF-8 code points (see
// next_piece). Each piece's bytes start as one token per byte and are merged by BPE: the
// adjacent pair with the lowest merge rank is merged first, ties going to the leftmost pair.
// That is OpenAI's original encoder.py (which merges every occurrence of the best pair in a
// left-to-right pass before looking again) as long as no merge uses a token created by a
// later merge, which the loader checks.
//
// The npm gpt-3-encoder (the reference the parity tests run) keys its merge ranks by the
// string `${a},${b}`, so 11 non-merges containing a comma (e.g. `",` + `"`) look like merges
// to it. We key by the pair, as OpenAI's encoder.py and tiktoken do. In practice the two
// agree: those pairs never become adjacent before the real merge makes the same token (no
// difference over all 1.1M strings of up to 6 chars from  " , ] } ) ' . [ a  and space).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "data/tokenizer.h"
#include "data/unicode.h"

namespace shardlm::data {
namespace {

// ---- pre-tokenization --------------------------------------------------------------------

// End of the regex match that starts at s[i] (i < n). The alternatives, in the regex's order:
//   1  's 't 're 've 'm 'll 'd
//   2  ' '? letter+        3  ' '? number+        4  ' '? other+
//   5  space+ not followed by a non-space: a run of spaces that ends the text is taken
//      whole; one followed by a non-space char gives back its last char (if it has >= 2)
//   6  space+ (only reached for a lone space char followed by a non-space)
size_t next_piece(const unsigned char* s, size_t n, size_t i) {
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
  if (cp.cls != CharClass::kSpace) {  // alternatives 2-4
    const CharClass run = cp.cls;
    size_t e = j + cp.len;
    while (e < n) {
      const CodePoint c = decode_utf8(s, n, e);
      if (c.cls != run) break;
      e += c.len;
    }
    return e;
  }
  // Alternatives 5 and 6: a run of whitespace starting at i.
  size_t e = i, last = i;
  int count = 0;
  while (e < n) {
    const CodePoint c = decode_utf8(s, n, e);
    if (c.cls != CharClass::kSpace) break;
    last = e;
    e += c.len;
    ++count;
  }
  if (e == n || count == 1) return e;
  return last;
}

// Whether the piece [i, e) that next_piece returned is whitespace only (alternatives 5 and 6):
// every other piece that starts with whitespace is a space followed by a non-space run.
bool is_whitespace_piece(const unsigned char* s, size_t n, size_t i, size_t e) {
  const CodePoint first = decode_utf8(s, n, i);
  return first.cls == CharClass::kSpace && (i + first.len == e || decode_utf8(s, n, i + first.len).cls == CharClass::kSpace);
}

// ---- GPT-2's byte <-> unicode mapping ----------------------------------------------------

// bytes_to_unicode(): printable bytes (! to ~, ¡ to ¬, ® to ÿ) stand for themselves; the
// other 68 bytes map, in order, to U+0100, U+0101, ...
std::array<uint32_t, 256> byte_to_unicode() {
  std::array<uint32_t, 256> m{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    m[b] = printable ? b : next++;
  }
  return m;
}

// Reverse of byte_to_unicode: code point -> byte, -1 where none.
std::array<int, 324> unicode_to_byte() {
  std::array<int, 324> m;
  m.fill(-1);
  const auto fwd = byte_to_unicode();
  for (int b = 0; b < 256; ++b) m[fwd[b]] = b;
  return m;
}

// ---- the tokenizer -----------------------------------------------------------------------

struct Merge {
  int32_t rank;
  int32_t id;  // the merged token
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw std::runtime_error("cannot open " + std::string(what) + " " + path + ": " + std::strerror(errno) +
                             " (run scripts/fetch_data.sh)");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw std::runtime_error("cannot read " + std::string(what) + " " + path);
  return ss.str();
}

class Gpt2Tokenizer final : public Tokenizer {
 public:
  Gpt2Tokenizer(const std::string& encoder_path, const std::string& bpe_path) {
    load_encoder(encoder_path);
    load_merges(bpe_path);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 4 + 16);
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    // Cache of piece -> ids for this call (views into text; ids in cache_ids).
    std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;
    std::vector<int32_t> cache_ids;
    Scratch scratch;
    size_t i = 0;
    while (i < n) {
      const size_t e = next_piece(s, n, i);
      const size_t len = e - i;
      if (len == 1) {
        out.push_back(byte_id_[s[i]]);
      } else if (len > kMaxCached) {
        bpe(s + i, len, scratch, out);
      } else {
        const std::string_view piece(text.data() + i, len);
        auto it = cache.find(piece);
        if (it != cache.end()) {
          out.insert(out.end(), cache_ids.begin() + it->second.first,
                     cache_ids.begin() + it->second.first + it->second.second);
        } else {
          const size_t before = out.size();
          bpe(s + i, len, scratch, out);
          const auto start = static_cast<uint32_t>(cache_ids.size());
          cache_ids.insert(cache_ids.end(), out.begin() + before, out.end());
          cache.emplace(piece, std::make_pair(start, static_cast<uint32_t>(out.size() - before)));
        }
      }
      i = e;
    }
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    size_t total = 0;
    for (int32_t id : ids) total += token(id).size();
    out.reserve(total);
    for (int32_t id : ids) out += token(id);
    return out;
  }

  std::string decode_token(int32_t id) const override { return token(id); }
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  int32_t eot() const override { return eot_; }
  std::string name() const override { return "gpt2"; }

  size_t stable_prefix(std::string_view text) const override {
    // next_piece reads at most a whitespace char (3 bytes) and a code point (4) past the piece
    // it returns, so a piece ending kLookahead bytes before the end is the one the whole text
    // has. Encoded alone, the prefix must also split the same way: it may not end in a
    // whitespace piece, which the end of the text would join to the whitespace before it.
    constexpr size_t kLookahead = 8;
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    size_t stable = 0;
    for (size_t i = 0; i < n;) {
      const size_t e = next_piece(s, n, i);
      if (e + kLookahead > n) break;
      if (!is_whitespace_piece(s, n, i, e)) stable = e;
      i = e;
    }
    return stable;
  }

 private:
  static constexpr size_t kMaxCached = 64;  // longer pieces (long space runs, ...) are rare

  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  struct Scratch {
    std::vector<int32_t> id, prev, next;
    std::vector<Cand> heap;
  };

  const std::string& token(int32_t id) const {
    if (id < 0 || id >= static_cast<int32_t>(tokens_.size()))
      throw std::out_of_range("gpt2 tokenizer: token id " + std::to_string(id) + " is not in [0, " +
                              std::to_string(tokens_.size()) + ")");
    return tokens_[id];
  }

  const Merge* find_merge(int32_t a, int32_t b) const {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  // BPE of one piece (n >= 2 bytes): symbols in a linked list, candidate pairs in a min-heap
  // ordered by (rank, position); an entry is stale once either of its symbols has changed.
  void bpe(const unsigned char* p, size_t n, Scratch& sc, std::vector<int32_t>& out) const {
    auto& id = sc.id;
    auto& prev = sc.prev;
    auto& next = sc.next;
    auto& heap = sc.heap;
    id.resize(n);
    prev.resize(n);
    next.resize(n);
    heap.clear();
    const int32_t m = static_cast<int32_t>(n);
    for (int32_t k = 0; k < m; ++k) {
      id[k] = byte_id_[p[k]];
      prev[k] = k - 1;
      next[k] = k + 1 < m ? k + 1 : -1;
    }
    auto push = [&](int32_t l) {
      if (l < 0) return;
      const int32_t r = next[l];
      if (r < 0) return;
      if (const Merge* mg = find_merge(id[l], id[r])) {
        heap.push_back({mg->rank, l, id[l], id[r]});
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
    };
    for (int32_t k = 0; k + 1 < m; ++k) push(k);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const Cand c = heap.back();
      heap.pop_back();
      const int32_t l = c.pos;
      const int32_t r = next[l];
      if (id[l] != c.left || r < 0 || id[r] != c.right) continue;  // stale
      id[l] = find_merge(c.left, c.right)->id;
      id[r] = -1;
      next[l] = next[r];
      if (next[r] >= 0) prev[next[r]] = l;
      push(prev[l]);
      push(l);
    }
    for (int32_t k = 0; k >= 0; k = next[k]) out.push_back(id[k]);
  }

  // Token string as stored in the files (bytes mapped to unicode) -> raw bytes.
  bool unmap(const std::string& s, std::string& bytes) const {
    bytes.clear();
    const auto* u = reinterpret_cast<const unsigned char*>(s.data());
    size_t i = 0;
    while (i < s.size()) {
      const CodePoint cp = decode_utf8(u, s.size(), i);
      if (cp.cp >= unicode_to_byte_.size() || unicode_to_byte_[cp.cp] < 0) return false;
      bytes.push_back(static_cast<char>(unicode_to_byte_[cp.cp]));
      i += cp.len;
    }
    return true;
  }

  void load_encoder(const std::string& path) {
    const std::string text = read_file(path, "GPT-2 encoder file");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ": invalid JSON: " + e.what());
    }
    if (!j.is_object() || j.empty()) throw std::runtime_error(path + ": expected a JSON object of token -> id");
    tokens_.assign(j.size(), std::string());
    std::vector<bool> seen(j.size(), false);
    std::string bytes;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_number_integer())
        throw std::runtime_error(path + ": id of token " + it.key() + " is not an integer");
      const int64_t id = it.value().get<int64_t>();
      if (id < 0 || id >= static_cast<int64_t>(j.size()) || seen[id])
        throw std::runtime_error(path + ": ids are not 0.." + std::to_string(j.size() - 1) +
                                 " each once (token " + it.key() + " has id " + std::to_string(id) + ")");
      seen[id] = true;
      if (it.key() == "<|endoftext|>") {
        eot_ = static_cast<int32_t>(id);
        tokens_[id] = it.key();
        continue;
      }
      if (!unmap(it.key(), bytes))
        throw std::runtime_error(path + ": token " + it.key() + " is not in GPT-2's byte-to-unicode alphabet");
      tokens_[id] = bytes;
      if (!ids_.emplace(bytes, static_cast<int32_t>(id)).second)
        throw std::runtime_error(path + ": two tokens have the bytes of " + it.key());
    }
    for (int b = 0; b < 256; ++b) {
      auto it = ids_.find(std::string(1, static_cast<char>(b)));
      if (it == ids_.end()) throw std::runtime_error(path + ": no token for byte " + std::to_string(b));
      byte_id_[b] = it->second;
    }
  }

  void load_merges(const std::string& path) {
    const std::string text = read_file(path, "GPT-2 merges file");
    std::istringstream in(text);
    struct Parsed {
      int32_t a, b, ab, lineno;
    };
    std::vector<Parsed> parsed;
    std::string line, a, b, extra;
    for (int lineno = 1; std::getline(in, line); ++lineno) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (lineno == 1 && line[0] == '#')) continue;
      const std::string where = path + ":" + std::to_string(lineno) + ": ";
      std::istringstream ls(line);
      std::string sa, sb;
      if (!(ls >> sa >> sb) || (ls >> extra))
        throw std::runtime_error(where + "expected two tokens separated by a space");
      auto lookup = [&](const std::string& s, std::string& raw) {
        if (!unmap(s, raw)) throw std::runtime_error(where + "'" + s + "' is not in GPT-2's byte-to-unicode alphabet");
        auto it = ids_.find(raw);
        if (it == ids_.end()) throw std::runtime_error(where + "token '" + s + "' is not in encoder.json");
        return it->second;
      };
      const int32_t ia = lookup(sa, a), ib = lookup(sb, b);
      auto it = ids_.find(a + b);
      if (it == ids_.end()) throw std::runtime_error(where + "merged token '" + sa + sb + "' is not in encoder.json");
      parsed.push_back({ia, ib, it->second, lineno});
    }
    if (parsed.empty()) throw std::runtime_error(path + ": no merges");
    // The heap order in bpe() equals the original pass-by-pass merging only if every merge
    // comes after all merges that create its two tokens; GPT-2's file has that order.
    std::vector<int32_t> created(tokens_.size(), -1);  // highest rank creating each token
    for (size_t r = 0; r < parsed.size(); ++r) created[parsed[r].ab] = static_cast<int32_t>(r);
    for (size_t r = 0; r < parsed.size(); ++r) {
      const Parsed& p = parsed[r];
      if (created[p.a] >= static_cast<int32_t>(r) || created[p.b] >= static_cast<int32_t>(r))
        throw std::runtime_error(path + ":" + std::to_string(p.lineno) +
                                 ": merge uses a token that a later merge creates (unsupported order)");
      merges_[pair_key(p.a, p.b)] = Merge{static_cast<int32_t>(r), p.ab};  // a repeated pair keeps the last rank
    }
  }

  std::vector<std::string> tokens_;                  // id -> bytes
  std::unordered_map<std::string, int32_t> ids_;     // bytes -> id (not eot)
  std::unordered_map<uint64_t, Merge> merges_;       // (a, b) -> rank, merged id
  std::array<int32_t, 256> byte_id_{};
  int32_t eot_ = -1;
  const std::array<int, 324> unicode_to_byte_ = unicode_to_byte();
};

}  // namespace

std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& encoder_json_path,
                                               const std::string& vocab_bpe_path) {
  return std::make_unique<Gpt2Tokenizer>(encoder_json_path, vocab_bpe_path);
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = 0;
  while (i < text.size()) {
    const size_t e = next_piece(s, text.size(), i);
    pieces.push_back(text.substr(i, e - i));
    i = e;
  }
  return pieces;
}

}  // namespace shardlm::data
