#include "data/tokenize.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace shardlm::data {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tokenize: " + msg); }

// Appends the tokens of the inputs to one shard, refusing to go past the token limit.
class TokenSink {
 public:
  TokenSink(TokenShardWriter& out, int64_t max_tokens) : out_(out), max_tokens_(max_tokens) {}

  void append(const std::vector<int32_t>& ids, const std::string& file, int64_t byte) {
    if (static_cast<int64_t>(ids.size()) > max_tokens_ - out_.size())
      fail(file + ": the inputs make more than " + std::to_string(max_tokens_) +
           " tokens (by byte " + std::to_string(byte) + " of this file), the most a token file holds");
    out_.append(std::span<const int32_t>(ids));
  }

 private:
  TokenShardWriter& out_;
  const int64_t max_tokens_;
};

// Encodes one file a chunk at a time: each chunk's text up to the tokenizer's stable prefix is
// encoded now, the rest waits for more. Returns the file's size in bytes.
int64_t tokenize_file(const std::string& path, const Tokenizer& tokenizer, const TokenizeLimits& limits,
                      TokenSink& sink) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open input file " + path);
  std::string pending;  // read, not yet encoded
  std::vector<char> chunk(static_cast<size_t>(limits.read_bytes));
  int64_t read = 0;
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    if (in.bad()) fail("cannot read input file " + path);
    const auto got = static_cast<size_t>(in.gcount());
    pending.append(chunk.data(), got);
    read += static_cast<int64_t>(got);
    const size_t ready = tokenizer.stable_prefix(pending);
    sink.append(tokenizer.encode(std::string_view(pending).substr(0, ready)), path, read);
    pending.erase(0, ready);
    if (static_cast<int64_t>(pending.size()) > limits.max_unbroken_bytes)
      fail(path + ": bytes " + std::to_string(read - static_cast<int64_t>(pending.size())) + " to " +
           std::to_string(read) + " (more than " + std::to_string(limits.max_unbroken_bytes) +
           ") hold no place where the " + tokenizer.name() + " tokenizer can break them; is it text?");
  }
  sink.append(tokenizer.encode(pending), path, read);
  return read;
}

}  // namespace

TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, double val_fraction, const TokenizeLimits& limits) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    fail("val_fraction " + std::to_string(val_fraction) + " is not in [0, 1)");
  if (tokenizer.vocab_size() > 65536)
    fail("tokenizer " + tokenizer.name() + " has " + std::to_string(tokenizer.vocab_size()) +
         " ids; shards hold uint16 ids");
  if (inputs.empty()) fail("no input files");
  if (limits.max_tokens < 1 || limits.max_tokens > kShardMaxTokens || limits.max_unbroken_bytes < 1 ||
      limits.read_bytes < 1)
    fail("limits out of range");
  const auto t0 = std::chrono::steady_clock::now();
  TokenizeStats st;
  st.train_path = out_prefix + "_train.bin";
  st.val_path = out_prefix + "_val.bin";
  const std::filesystem::path parent = std::filesystem::path(st.train_path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) fail("cannot create folder " + parent.string() + ": " + ec.message());
  }
  // Every token goes to the train shard; the validation tail moves to its own at the end.
  TokenShardWriter train(st.train_path), val(st.val_path);
  TokenSink sink(train, limits.max_tokens);
  for (size_t f = 0; f < inputs.size(); ++f) {
    if (f > 0 && tokenizer.eot() >= 0) sink.append({tokenizer.eot()}, inputs[f], 0);
    st.bytes += tokenize_file(inputs[f], tokenizer, limits, sink);
    ++st.files;
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.tokens = train.size();
  st.val_tokens = static_cast<int64_t>(std::floor(static_cast<double>(st.tokens) * val_fraction));
  st.train_tokens = st.tokens - st.val_tokens;
  train.move_tail(st.val_tokens, val);
  train.commit();
  val.commit();
  return st;
}

}  // namespace shardlm::data
