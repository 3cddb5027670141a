#include "data/tokenize.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <thread>

#include "data/corpus.h"
#include "data/input_bytes.h"
#include "data/unicode.h"

namespace shardlm::data {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tokenize: " + msg); }

// Bytes [first, end) of `where` (a file; FILE:LINE with `of` naming the record's field), more than
// the limit, hold no place the tokenizer can break: encoding them is one pre-tokenizer piece, whose
// time and memory grow without bound (60 MB of letters: 24 s and 1.9 GB).
[[noreturn]] void fail_unbroken(const std::string& where, int64_t first, int64_t end, const std::string& of,
                                const Tokenizer& tokenizer, const TokenizeLimits& limits) {
  fail(where + ": bytes " + std::to_string(first) + " to " + std::to_string(end) + of + " (more than " +
       std::to_string(limits.max_unbroken_bytes) + ") hold no place where the " + tokenizer.name() +
       " tokenizer can break them; is it text?");
}

// The files of one split: PREFIX_SPLIT.bin, or with shard_tokens > 0 numbered ones of at most
// shard_tokens tokens each, a new one begun when the last is full. Uncommitted files are removed
// when the writer goes (TokenShardWriter).
class SplitWriter {
 public:
  // token_bytes: the files' layout (data/shard.h).
  SplitWriter(std::string prefix, std::string split, int64_t shard_tokens, int token_bytes)
      : prefix_(std::move(prefix)), split_(std::move(split)), shard_tokens_(shard_tokens), token_bytes_(token_bytes) {
    begin_file();
  }

  int64_t size() const { return full_files_tokens() + files_.back()->size(); }
  int64_t capacity() const { return shard_tokens_ > 0 ? shard_tokens_ * kMaxFiles : kShardMaxTokens; }

  template <class Id>
  void append(std::span<const Id> tokens) {
    while (!tokens.empty()) {
      if (files_.back()->size() == file_tokens()) {
        files_.back()->park();
        begin_file();
      }
      const size_t n = static_cast<size_t>(std::min<int64_t>(file_tokens() - files_.back()->size(), tokens.size()));
      files_.back()->append(tokens.first(n));
      tokens = tokens.subspan(n);
    }
  }

  // Moves the last n tokens (n <= size()) to the end of `to`, in order; files left empty go.
  void move_tail(int64_t n, SplitWriter& to) {
    size_t first = files_.size() - 1;  // the first file holding some of the tail
    for (int64_t below = files_.back()->size(); below < n; below += files_[first]->size()) --first;
    int64_t from_first = n;
    for (size_t k = first + 1; k < files_.size(); ++k) from_first -= files_[k]->size();
    const auto into = [&](std::span<const int32_t> tokens) { to.append(tokens); };
    for (size_t k = first; k < files_.size(); ++k) {
      files_[k]->move_tail(k == first ? from_first : files_[k]->size(), into);
      files_[k]->park();
    }
    files_.resize(std::max<size_t>(files_[first]->size() > 0 ? first + 1 : first, 1));
  }

  // Commits every file (one at least, empty or not); returns their paths.
  std::vector<std::string> commit() {
    std::vector<std::string> paths;
    for (size_t k = 0; k < files_.size(); ++k) {
      files_[k]->commit();  // one descriptor at a time
      paths.push_back(name(k));
    }
    return paths;
  }

 private:
  static constexpr int64_t kMaxFiles = 1000000;  // six digits

  int64_t file_tokens() const { return shard_tokens_ > 0 ? shard_tokens_ : kShardMaxTokens; }
  int64_t full_files_tokens() const { return static_cast<int64_t>(files_.size() - 1) * file_tokens(); }
  std::string name(size_t k) const {
    if (shard_tokens_ == 0) return prefix_ + "_" + split_ + ".bin";
    char number[24];
    std::snprintf(number, sizeof number, "%06zu", k);
    return prefix_ + "_" + split_ + "_" + number + ".bin";
  }
  void begin_file() { files_.push_back(std::make_unique<TokenShardWriter>(name(files_.size()), token_bytes_)); }

  std::string prefix_, split_;
  int64_t shard_tokens_;
  int token_bytes_;
  std::vector<std::unique_ptr<TokenShardWriter>> files_;
};

// Appends the tokens of the inputs to the train split, refusing to go past the token limit.
class TokenSink {
 public:
  TokenSink(SplitWriter& out, int64_t max_tokens) : out_(out), max_tokens_(max_tokens) {}

  void append(const std::vector<int32_t>& ids, const std::string& file, int64_t byte) {
    if (static_cast<int64_t>(ids.size()) > max_tokens_ - out_.size())
      fail(file + ": the inputs make more than " + std::to_string(max_tokens_) + " tokens (by byte " +
           std::to_string(byte) + " of this file), the most " +
           (max_tokens_ == kShardMaxTokens ? "a token file holds; --shard-tokens N writes numbered files of N each"
                                           : "tokenize writes"));
    out_.append(std::span<const int32_t>(ids));
  }

 private:
  SplitWriter& out_;
  const int64_t max_tokens_;
};

// Removes the files of PREFIX's split that train would read besides `kept` (the whole file, and
// numbered ones), so what it reads is what was just written.
void remove_others(const std::string& prefix, const std::string& split, const std::vector<std::string>& kept) {
  std::vector<std::string> found = numbered_split_files(prefix, split);
  found.push_back(prefix + "_" + split + ".bin");
  for (const std::string& f : found)
    if (std::find(kept.begin(), kept.end(), f) == kept.end()) {
      std::error_code ec;
      std::filesystem::remove(f, ec);
      if (ec) fail("cannot remove " + f + " (an older file of this prefix, which train would read): " + ec.message());
    }
}

// Encodes text pieces `threads` at a time, each on a thread of its own, and hands their tokens
// to the sink in the order the pieces came (tokens already known, eot, wait their turn).
class OrderedEncoder {
 public:
  OrderedEncoder(const Tokenizer& tokenizer, TokenSink& sink, int threads)
      : tokenizer_(tokenizer), sink_(sink), threads_(threads) {}

  // `byte`: where in `file` the piece ends, for the sink's messages. `continues`: the text goes on
  // from the piece before, cut at one of its stable_prefix points.
  void add_text(std::string text, const std::string& file, int64_t byte, bool continues) {
    std::vector<std::string> one;
    one.push_back(std::move(text));
    waiting_.push_back({std::move(one), {}, file, byte, continues});
    if (static_cast<int>(waiting_.size()) >= threads_) flush();
  }
  // Whole documents, encoded one after another with the tokenizer's eot between them.
  void add_documents(std::vector<std::string> docs, const std::string& file, int64_t byte) {
    waiting_.push_back({std::move(docs), {}, file, byte});
    if (static_cast<int>(waiting_.size()) >= threads_) flush();
  }
  void add_tokens(std::vector<int32_t> ids, const std::string& file, int64_t byte) {
    waiting_.push_back({{}, std::move(ids), file, byte});
  }

  void flush() {
    std::vector<std::exception_ptr> errors(waiting_.size());  // rethrown once every thread is joined
    const auto encode_at = [&](size_t i) {
      try {
        encode(waiting_[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    std::vector<std::thread> helpers;
    for (size_t i = 1; i < waiting_.size(); ++i)
      if (!waiting_[i].docs.empty()) helpers.emplace_back(encode_at, i);
    if (!waiting_.empty()) encode_at(0);
    for (std::thread& t : helpers) t.join();
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
    for (const Piece& p : waiting_) sink_.append(p.ids, p.file, p.byte);
    waiting_.clear();
  }

 private:
  struct Piece {
    std::vector<std::string> docs;
    std::vector<int32_t> ids;
    std::string file;
    int64_t byte = 0;
    bool continues = false;  // the first text goes on from the piece before
  };
  void encode(Piece& p) const {
    for (size_t d = 0; d < p.docs.size(); ++d) {
      if (d > 0 && tokenizer_.eot() >= 0) p.ids.push_back(tokenizer_.eot());
      const std::vector<int32_t> ids =
          d == 0 && p.continues ? tokenizer_.encode_continuation(p.docs[d]) : tokenizer_.encode(p.docs[d]);
      p.ids.insert(p.ids.end(), ids.begin(), ids.end());
    }
  }

  const Tokenizer& tokenizer_;
  TokenSink& sink_;
  const int threads_;
  std::vector<Piece> waiting_;
};

// Reads one file a chunk at a time: each chunk's text up to the tokenizer's stable prefix is
// encoded now, the rest waits for more. Returns the file's size in bytes.
int64_t tokenize_file(const std::string& path, const Tokenizer& tokenizer, const TokenizeLimits& limits,
                      OrderedEncoder& encoder) {
  InputBytes in(path);
  std::string pending;     // read, not yet encoded
  bool continues = false;  // some of the file has been encoded
  std::vector<char> chunk(static_cast<size_t>(limits.read_bytes));
  int64_t read = 0;
  while (const size_t got = in.read(chunk.data(), chunk.size())) {
    pending.append(chunk.data(), got);
    read += static_cast<int64_t>(got);
    const size_t ready = tokenizer.stable_prefix(pending);
    encoder.add_text(pending.substr(0, ready), path, read, continues);
    continues = continues || ready > 0;
    pending.erase(0, ready);
    if (static_cast<int64_t>(pending.size()) > limits.max_unbroken_bytes)
      fail_unbroken(path, read - static_cast<int64_t>(pending.size()), read, "", tokenizer, limits);
  }
  encoder.add_text(std::move(pending), path, read, continues);
  return read;
}

// Reads a file a line at a time (the last one may lack its newline), refusing a line longer than
// `max_line` bytes.
class LineReader {
 public:
  LineReader(const std::string& path, int64_t read_bytes, int64_t max_line)
      : path_(path), in_(path), chunk_(static_cast<size_t>(read_bytes)), max_line_(max_line) {}
  // The next line without its newline; false at the end.
  bool next(std::string& line) {
    while (true) {
      const size_t nl = buffer_.find('\n', scanned_);
      if (nl != std::string::npos) {
        line.assign(buffer_, start_, nl - start_);
        start_ = scanned_ = nl + 1;
        ++number_;
        return true;
      }
      // The lines already handed out go only now, once per read: erasing each as it went moved
      // the rest of the buffer once per line.
      buffer_.erase(0, start_);
      start_ = 0;
      scanned_ = buffer_.size();
      if (static_cast<int64_t>(buffer_.size()) > max_line_)
        fail(path_ + ":" + std::to_string(number_ + 1) + ": a line longer than " + std::to_string(max_line_) +
             " bytes; is it JSON Lines?");
      const size_t got = at_end_ ? 0 : in_.read(chunk_.data(), chunk_.size());
      if (got == 0) {
        at_end_ = true;
        if (buffer_.empty()) return false;
        line = std::move(buffer_);
        buffer_.clear();
        scanned_ = 0;
        ++number_;
        return true;
      }
      buffer_.append(chunk_.data(), got);
      bytes_ += static_cast<int64_t>(got);
    }
  }
  int64_t line_number() const { return number_; }
  int64_t bytes_read() const { return bytes_; }

 private:
  std::string path_;
  InputBytes in_;
  bool at_end_ = false;
  std::vector<char> chunk_;
  int64_t max_line_;
  std::string buffer_;
  size_t start_ = 0;    // where buffer_'s next line begins
  size_t scanned_ = 0;  // buffer_ from start_ to here holds no newline
  int64_t number_ = 0, bytes_ = 0;
};

// A document refused as tokenize_file refuses a stream: scanned read_bytes at a time, it may not
// hold more than max_unbroken_bytes past its last stable_prefix point. Only a document longer than
// the limit is scanned.
void check_breaks(std::string_view doc, const std::string& where, const std::string& of, const Tokenizer& tokenizer,
                  const TokenizeLimits& limits) {
  const auto size = static_cast<int64_t>(doc.size());
  int64_t first = 0;  // the text from here on waits for a break
  for (int64_t end = 0; end < size && size - first > limits.max_unbroken_bytes;) {
    end = std::min(size, end + limits.read_bytes);
    first += static_cast<int64_t>(tokenizer.stable_prefix(doc.substr(first, end - first)));
    if (end - first > limits.max_unbroken_bytes) fail_unbroken(where, first, end, of, tokenizer, limits);
  }
}

// The offset of the first byte of `line` that is no part of a UTF-8 character, or npos.
size_t first_non_utf8(const std::string& line) {
  const auto* s = reinterpret_cast<const unsigned char*>(line.data());
  for (size_t i = 0; i < line.size();) {
    const CodePoint c = decode_utf8(s, line.size(), i);
    if (c.cp == kInvalidCodePoint) return i;
    i += c.len;
  }
  return std::string::npos;
}

// A line that is not a JSON object. nlohmann refuses text that is not UTF-8, and a \u escape of
// half a surrogate pair, as it refuses any other malformed line: those are said as what they are.
[[noreturn]] void fail_not_an_object(const std::string& line, const std::string& where, const char* parse_error) {
  if (const size_t at = first_non_utf8(line); at != std::string::npos) {
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(line[at]));
    fail(where + ": not UTF-8 (byte " + byte + " at offset " + std::to_string(at) +
         " of the line); JSON Lines are UTF-8 text");
  }
  if (parse_error != nullptr && std::strstr(parse_error, "surrogate") != nullptr)
    fail(where + ": a \\u escape of half a UTF-16 surrogate pair (U+D800..U+DFFF without its other half), no character");
  fail(where + ": not a JSON object (JSON Lines: one object a line)");
}

// The record a non-blank line holds.
nlohmann::json parse_record(const std::string& line, const std::string& where) {
  nlohmann::json record;
  try {
    record = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    fail_not_an_object(line, where, e.what());
  }
  if (!record.is_object()) fail_not_an_object(line, where, nullptr);
  return record;
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

// A JSON Lines file: each non-blank line an object whose string field `field` is a document.
// Documents are encoded whole, a piece of about read_bytes of them at a time, with eot between
// them (and before the first, unless it opens the corpus). Returns the file's size in bytes.
int64_t tokenize_jsonl(const std::string& path, const std::string& field, bool first_in_corpus,
                       const Tokenizer& tokenizer, const TokenizeLimits& limits, OrderedEncoder& encoder) {
  LineReader lines(path, limits.read_bytes, limits.max_line_bytes);
  std::vector<std::string> docs;
  int64_t piece_bytes = 0;
  bool first = first_in_corpus;
  const auto send = [&] {
    if (docs.empty()) return;
    if (!first && tokenizer.eot() >= 0) encoder.add_tokens({tokenizer.eot()}, path, lines.bytes_read());
    first = false;
    encoder.add_documents(std::move(docs), path, lines.bytes_read());
    docs.clear();
    piece_bytes = 0;
  };
  std::string line;
  while (lines.next(line)) {
    if (blank(line)) continue;
    const std::string where = path + ":" + std::to_string(lines.line_number());
    nlohmann::json record = parse_record(line, where);
    const auto text = record.find(field);
    if (text == record.end() || !text->is_string())
      fail(where + ": no string field '" + field + "' (--text-field names the field holding each document)");
    std::string& doc = text->get_ref<std::string&>();
    check_breaks(doc, where, " of its '" + field + "'", tokenizer, limits);
    docs.push_back(std::move(doc));
    piece_bytes += static_cast<int64_t>(docs.back().size());
    if (piece_bytes >= limits.read_bytes) send();
  }
  send();
  return lines.bytes_read();
}

// JSON Lines by its name, compression aside: *.jsonl, and *.json as C4 and Dolma name theirs.
bool is_jsonl(const std::string& path) {
  const std::string name = InputBytes::content_name(path);
  return name.ends_with(".jsonl") || name.ends_with(".json");
}

}  // namespace

TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, const TokenizeOptions& options) {
  const double val_fraction = options.val_fraction;
  const int64_t shard_tokens = options.shard_tokens;
  const TokenizeLimits& limits = options.limits;
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    fail("val_fraction " + std::to_string(val_fraction) + " is not in [0, 1)");
  if (inputs.empty()) fail("no input files");
  if (shard_tokens < 0 || shard_tokens > kShardMaxTokens)
    fail("shard_tokens " + std::to_string(shard_tokens) + " is not in [1, 2^31 - 1] (0: one file a split)");
  if (options.threads < 1) fail("threads " + std::to_string(options.threads) + " is not at least 1");
  if (limits.max_tokens < 0 || limits.max_unbroken_bytes < 1 || limits.read_bytes < 1 || limits.max_line_bytes < 1)
    fail("limits out of range");
  const auto t0 = std::chrono::steady_clock::now();
  const std::filesystem::path parent = std::filesystem::path(out_prefix).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) fail("cannot create folder " + parent.string() + ": " + ec.message());
  }
  // Every token goes to the train split; the validation tail moves to its own at the end.
  // LLaMA 3's ids (128256 of them) are written in llm.c's uint32 layout, GPT-2's in its uint16 one.
  const int token_bytes = tokenizer.vocab_size() > 65536 ? 4 : 2;
  SplitWriter train(out_prefix, "train", shard_tokens, token_bytes), val(out_prefix, "val", shard_tokens, token_bytes);
  TokenSink sink(train, std::min(limits.max_tokens > 0 ? limits.max_tokens : INT64_MAX, train.capacity()));
  OrderedEncoder encoder(tokenizer, sink, options.threads);
  TokenizeStats st;
  for (size_t f = 0; f < inputs.size(); ++f) {
    if (is_jsonl(inputs[f])) {
      st.bytes += tokenize_jsonl(inputs[f], options.text_field, f == 0, tokenizer, limits, encoder);
    } else {
      if (f > 0 && tokenizer.eot() >= 0) encoder.add_tokens({tokenizer.eot()}, inputs[f], 0);
      st.bytes += tokenize_file(inputs[f], tokenizer, limits, encoder);
    }
    ++st.files;
  }
  encoder.flush();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.tokens = train.size();
  st.val_tokens = static_cast<int64_t>(std::floor(static_cast<double>(st.tokens) * val_fraction));
  st.train_tokens = st.tokens - st.val_tokens;
  train.move_tail(st.val_tokens, val);
  st.train_files = train.commit();
  st.val_files = val.commit();
  remove_others(out_prefix, "train", st.train_files);
  remove_others(out_prefix, "val", st.val_files);
  return st;
}

}  // namespace shardlm::data
