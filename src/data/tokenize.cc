#include "data/tokenize.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "data/shard.h"

namespace shardlm::data {

TokenizeStats tokenize_files(const std::vector<std::string>& inputs, const std::string& out_prefix,
                             const Tokenizer& tokenizer, double val_fraction) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw std::runtime_error("tokenize: val_fraction " + std::to_string(val_fraction) + " is not in [0, 1)");
  if (tokenizer.vocab_size() > 65536)
    throw std::runtime_error("tokenize: tokenizer " + tokenizer.name() + " has " +
                             std::to_string(tokenizer.vocab_size()) + " ids; shards hold uint16 ids");
  if (inputs.empty()) throw std::runtime_error("tokenize: no input files");
  const auto t0 = std::chrono::steady_clock::now();
  TokenizeStats st;
  std::vector<int32_t> all;
  for (size_t f = 0; f < inputs.size(); ++f) {
    std::ifstream in(inputs[f], std::ios::binary);
    if (!in) throw std::runtime_error("tokenize: cannot open input file " + inputs[f]);
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) throw std::runtime_error("tokenize: cannot read input file " + inputs[f]);
    const std::string text = ss.str();
    if (f > 0 && tokenizer.eot() >= 0) all.push_back(tokenizer.eot());
    const std::vector<int32_t> ids = tokenizer.encode(text);
    all.insert(all.end(), ids.begin(), ids.end());
    st.bytes += static_cast<int64_t>(text.size());
    ++st.files;
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.tokens = static_cast<int64_t>(all.size());
  st.val_tokens = static_cast<int64_t>(std::floor(static_cast<double>(st.tokens) * val_fraction));
  st.train_tokens = st.tokens - st.val_tokens;
  st.train_path = out_prefix + "_train.bin";
  st.val_path = out_prefix + "_val.bin";
  const std::filesystem::path parent = std::filesystem::path(st.train_path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) throw std::runtime_error("tokenize: cannot create folder " + parent.string() + ": " + ec.message());
  }
  const std::span<const int32_t> span(all);
  write_token_shard(st.train_path, span.first(static_cast<size_t>(st.train_tokens)));
  write_token_shard(st.val_path, span.subspan(static_cast<size_t>(st.train_tokens)));
  return st;
}

}  // namespace shardlm::data
