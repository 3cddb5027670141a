// Byte-level BPE: GPT-2's (encoder.json + vocab.bpe), and Hugging Face tokenizer.json files of the
// same kind (LLaMA 3's).
//
// Text is split into pieces (data/pretokenize.h). Each piece's bytes start as one token per byte
// and are merged by BPE: the adjacent pair with the lowest merge rank first, ties going to the
// leftmost pair, as Hugging Face's tokenizers merge. OpenAI's encoder.py (GPT-2's reference)
// merges every occurrence of the best pair in a left-to-right pass before looking again, which is
// the same as long as no merge uses a token created by a later merge: the GPT-2 loader checks
// that. LLaMA 3's merges are not in that order (a sixth of them use a later merge's token), and
// are Hugging Face's to begin with; its tokenizer.json also sets ignore_merges: a piece that is a
// token whole is that token.
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
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "data/bpe_core.h"
#include "data/pretokenize.h"
#include "data/tokenizer.h"
#include "data/unicode.h"

namespace shardlm::data {
namespace {

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

// What a loader reads from the files; the tokenizer is built from it.
struct Vocabulary {
  std::string name;
  Pretokenizer pretokenizer = Pretokenizer::gpt2;
  std::vector<std::string> tokens;               // id -> bytes (a special token: its text)
  std::unordered_map<std::string, int32_t> ids;  // bytes -> id, of the tokens BPE may produce
  bpe::MergeTable merges;
  std::array<int32_t, 256> byte_id{};
  int32_t eot = -1;
  int32_t bos = -1;
  std::vector<int32_t> ends;
  bool ignore_merges = false;  // a piece that is a token whole is that token

  // Token string as the files store it (bytes mapped to unicode) -> raw bytes.
  bool unmap(const std::string& text, std::string& bytes) const {
    bytes.clear();
    const auto* u = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t i = 0; i < text.size();) {
      const CodePoint cp = decode_utf8(u, text.size(), i);
      if (cp.cp >= unicode_to_byte_.size() || unicode_to_byte_[cp.cp] < 0) return false;
      bytes.push_back(static_cast<char>(unicode_to_byte_[cp.cp]));
      i += cp.len;
    }
    return true;
  }

  // The id of the token the files spell `text`, whose bytes go to `bytes`; `where` prefixes an error.
  int32_t id_of(const std::string& text, const std::string& where, std::string& bytes) const {
    if (!unmap(text, bytes)) throw std::runtime_error(where + "'" + text + "' is not in the byte-to-unicode alphabet");
    const auto it = ids.find(bytes);
    if (it == ids.end()) throw std::runtime_error(where + "token '" + text + "' is not in the vocabulary");
    return it->second;
  }

  // `vocab` (a JSON object of token -> id) and `specials` (text -> id: tokens kept as their text,
  // which BPE never produces; each a key of vocab or a token of its own) number the tokens
  // 0 .. size - 1, each id once.
  void read_tokens(const nlohmann::json& vocab, const std::string& path, const std::map<std::string, int64_t>& specials) {
    if (!vocab.is_object() || vocab.empty()) throw std::runtime_error(path + ": expected a JSON object of token -> id");
    size_t size = vocab.size();
    for (const auto& [text, id] : specials) size += !vocab.contains(text);
    tokens.assign(size, std::string());
    std::vector<bool> seen(size, false);
    const auto place = [&](int64_t id, const std::string& token) {
      if (id < 0 || id >= static_cast<int64_t>(size) || seen[id])
        throw std::runtime_error(path + ": ids are not 0.." + std::to_string(size - 1) + " each once (token " + token +
                                 " has id " + std::to_string(id) + ")");
      seen[id] = true;
    };
    std::string bytes;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer())
        throw std::runtime_error(path + ": id of token " + it.key() + " is not an integer");
      if (specials.count(it.key())) continue;  // placed below, at the id the specials give it
      const int64_t id = it.value().get<int64_t>();
      place(id, it.key());
      if (!unmap(it.key(), bytes))
        throw std::runtime_error(path + ": token " + it.key() + " is not in the byte-to-unicode alphabet");
      tokens[id] = bytes;
      if (!ids.emplace(bytes, static_cast<int32_t>(id)).second)
        throw std::runtime_error(path + ": two tokens have the bytes of " + it.key());
    }
    for (const auto& [text, id] : specials) {
      place(id, text);
      tokens[id] = text;
    }
    for (int b = 0; b < 256; ++b) {
      const auto it = ids.find(std::string(1, static_cast<char>(b)));
      if (it == ids.end()) throw std::runtime_error(path + ": no token for byte " + std::to_string(b));
      byte_id[b] = it->second;
    }
  }

  // Merge r of `pairs` joins tokens a and b; `where(r)` prefixes an error about it. With
  // `in_pass_order`, refuses a merge that uses a token a later merge creates (see the top).
  void read_merges(const std::vector<std::pair<std::string, std::string>>& pairs,
                   const std::function<std::string(size_t)>& where, bool in_pass_order) {
    struct Parsed {
      int32_t a, b, ab;
    };
    std::vector<Parsed> parsed;
    std::string raw_a, raw_b;
    for (size_t r = 0; r < pairs.size(); ++r) {
      const int32_t a = id_of(pairs[r].first, where(r), raw_a), b = id_of(pairs[r].second, where(r), raw_b);
      const auto it = ids.find(raw_a + raw_b);
      if (it == ids.end())
        throw std::runtime_error(where(r) + "merged token '" + pairs[r].first + pairs[r].second + "' is not in the vocabulary");
      parsed.push_back({a, b, it->second});
    }
    if (parsed.empty()) throw std::runtime_error(where(0) + "no merges");
    std::vector<int32_t> created(tokens.size(), -1);  // highest rank creating each token
    for (size_t r = 0; r < parsed.size(); ++r) created[parsed[r].ab] = static_cast<int32_t>(r);
    for (size_t r = 0; r < parsed.size(); ++r) {
      const Parsed& p = parsed[r];
      if (in_pass_order && (created[p.a] >= static_cast<int32_t>(r) || created[p.b] >= static_cast<int32_t>(r)))
        throw std::runtime_error(where(r) + "merge uses a token that a later merge creates (unsupported order)");
      merges.set(p.a, p.b, {static_cast<int32_t>(r), p.ab});
    }
  }

 private:
  const std::array<int, 324> unicode_to_byte_ = unicode_to_byte();
};

class ByteLevelBpe final : public Tokenizer {
 public:
  explicit ByteLevelBpe(Vocabulary v) : v_(std::move(v)) {}

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 4 + 16);
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    // Cache of piece -> ids for this call (views into text; ids in cache_ids).
    std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;
    std::vector<int32_t> cache_ids;
    bpe::Scratch scratch;
    size_t i = 0;
    while (i < n) {
      const size_t e = next_piece(v_.pretokenizer, s, n, i);
      const size_t len = e - i;
      if (len == 1) {
        out.push_back(v_.byte_id[s[i]]);
      } else if (len > kMaxCached) {
        encode_piece(s + i, len, scratch, out);
      } else {
        const std::string_view piece(text.data() + i, len);
        auto it = cache.find(piece);
        if (it != cache.end()) {
          out.insert(out.end(), cache_ids.begin() + it->second.first,
                     cache_ids.begin() + it->second.first + it->second.second);
        } else {
          const size_t before = out.size();
          encode_piece(s + i, len, scratch, out);
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
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.tokens.size()); }
  int32_t eot() const override { return v_.eot; }
  int32_t bos() const override { return v_.bos; }
  std::vector<int32_t> end_tokens() const override { return v_.ends; }
  std::string name() const override { return v_.name; }
  size_t stable_prefix(std::string_view text) const override { return data::stable_prefix(v_.pretokenizer, text); }

 private:
  static constexpr size_t kMaxCached = 64;  // longer pieces (long space runs, ...) are rare

  const std::string& token(int32_t id) const {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range(v_.name + " tokenizer: token id " + std::to_string(id) + " is not in [0, " +
                              std::to_string(vocab_size()) + ")");
    return v_.tokens[id];
  }

  void encode_piece(const unsigned char* p, size_t n, bpe::Scratch& sc, std::vector<int32_t>& out) const {
    if (v_.ignore_merges)
      if (const auto it = v_.ids.find(std::string(reinterpret_cast<const char*>(p), n)); it != v_.ids.end()) {
        out.push_back(it->second);
        return;
      }
    sc.id.resize(n);
    for (size_t k = 0; k < n; ++k) sc.id[k] = v_.byte_id[p[k]];
    bpe::merge(v_.merges, sc, out);
  }

  const Vocabulary v_;
};

constexpr const char* kFetchGpt2 = " (run scripts/fetch_data.sh)";

// vocab.bpe: a "#version" line, then a merge a line: two tokens and a space between.
std::vector<std::pair<std::string, std::string>> read_merge_lines(const std::string& path, std::vector<int>& linenos) {
  std::istringstream in(bpe::read_file(path, "GPT-2 merges file", kFetchGpt2));
  std::vector<std::pair<std::string, std::string>> pairs;
  std::string line, extra;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line[0] == '#')) continue;
    std::istringstream ls(line);
    std::string a, b;
    if (!(ls >> a >> b) || (ls >> extra))
      throw std::runtime_error(path + ":" + std::to_string(lineno) + ": expected two tokens separated by a space");
    pairs.emplace_back(a, b);
    linenos.push_back(lineno);
  }
  return pairs;
}

// tokenizer.json's pre_tokenizer, as one of the splits shardlm has.
Pretokenizer pretokenizer_of(const nlohmann::json& j, const std::string& path) {
  constexpr const char* kLlama3Pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const auto is = [](const nlohmann::json& o, const char* key, const nlohmann::json& value) {
    return o.is_object() && o.contains(key) && o[key] == value;
  };
  const auto byte_level = [&](const nlohmann::json& o, bool use_regex) {
    return is(o, "type", "ByteLevel") && is(o, "add_prefix_space", false) && is(o, "use_regex", use_regex);
  };
  const nlohmann::json& p = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json();
  if (byte_level(p, true)) return Pretokenizer::gpt2;
  if (is(p, "type", "Sequence") && p.contains("pretokenizers") && p["pretokenizers"].size() == 2) {
    const nlohmann::json& split = p["pretokenizers"][0];
    if (is(split, "type", "Split") && split.contains("pattern") && is(split["pattern"], "Regex", kLlama3Pattern) &&
        is(split, "behavior", "Isolated") && is(split, "invert", false) && byte_level(p["pretokenizers"][1], false))
      return Pretokenizer::llama3;
  }
  throw std::runtime_error(path + ": pre_tokenizer: shardlm splits text as GPT-2's byte-level tokenizer and LLaMA 3's "
                           "(a Split on its pattern, then ByteLevel) do, not as " + p.dump().substr(0, 200));
}

// load_hf_tokenizer, but a field of another type throws nlohmann::json's own exception.
std::unique_ptr<Tokenizer> read_hf_tokenizer(const std::string& path, const std::string& name) {
  const nlohmann::json j = bpe::parse_json(bpe::read_file(path, "tokenizer file", ""), path);
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw std::runtime_error(path + ": no model object (a Hugging Face tokenizer.json has one)");
  const nlohmann::json& model = j["model"];
  if (model.value("type", "") != "BPE")
    throw std::runtime_error(path + ": model.type: shardlm reads BPE tokenizers, not '" + model.value("type", "") + "'");
  if (bpe::is_sentencepiece_bpe(j)) return bpe::read_sentencepiece_bpe(j, path, name);
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    throw std::runtime_error(path + ": normalizer: shardlm reads byte-level tokenizers that encode the text as it is, not " +
                             j["normalizer"].dump().substr(0, 200));
  if (model.contains("byte_fallback") && model["byte_fallback"] == true)
    throw std::runtime_error(path + ": model.byte_fallback: a byte-level BPE has a token for every byte; byte fallback "
                             "belongs to SentencePiece's BPE, whose normalizer or pre_tokenizer writes spaces as U+2581");
  Vocabulary v;
  v.name = name;
  v.pretokenizer = pretokenizer_of(j, path);
  v.ignore_merges = model.value("ignore_merges", false);
  // Added tokens (<|begin_of_text|>, ...) follow the BPE vocabulary or take an entry of it.
  const std::map<std::string, int64_t> specials = bpe::added_tokens_of(j, path);
  v.read_tokens(model.contains("vocab") ? model["vocab"] : nlohmann::json(), path, specials);
  v.eot = bpe::document_separator(specials);
  v.ends = bpe::end_tokens(specials);
  if (specials.count("<|begin_of_text|>")) v.bos = static_cast<int32_t>(specials.at("<|begin_of_text|>"));
  v.read_merges(bpe::merges_of(model.contains("merges") ? model["merges"] : nlohmann::json(), path),
                [&](size_t r) { return path + ": model.merges[" + std::to_string(r) + "]: "; }, false);
  return std::make_unique<ByteLevelBpe>(std::move(v));
}

}  // namespace

std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& encoder_json_path,
                                               const std::string& vocab_bpe_path) {
  Vocabulary v;
  v.name = "gpt2";
  const nlohmann::json encoder =
      bpe::parse_json(bpe::read_file(encoder_json_path, "GPT-2 encoder file", kFetchGpt2), encoder_json_path);
  std::map<std::string, int64_t> specials;
  const std::string eot = "<|endoftext|>";
  if (encoder.is_object() && encoder.contains(eot) && encoder[eot].is_number_integer()) {
    specials[eot] = encoder[eot].get<int64_t>();
    v.eot = static_cast<int32_t>(specials[eot]);
    v.ends = {v.eot};
  }
  v.read_tokens(encoder, encoder_json_path, specials);
  std::vector<int> linenos;
  const auto pairs = read_merge_lines(vocab_bpe_path, linenos);
  v.read_merges(
      pairs, [&](size_t r) { return vocab_bpe_path + (r < linenos.size() ? ":" + std::to_string(linenos[r]) : "") + ": "; },
      true);
  return std::make_unique<ByteLevelBpe>(std::move(v));
}

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const std::string& name) {
  try {
    return read_hf_tokenizer(path, name);
  } catch (const nlohmann::json::exception& e) {  // a field of another type than the format's
    throw std::runtime_error(path + ": not a tokenizer.json shardlm can read: " + e.what());
  }
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) { return pretokenize(Pretokenizer::gpt2, text); }

}  // namespace shardlm::data
