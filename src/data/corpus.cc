#include "data/corpus.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

namespace shardlm::data {

namespace fs = std::filesystem;

std::vector<std::string> numbered_split_files(const std::string& prefix, const std::string& split) {
  const fs::path p(prefix);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const std::string lead = p.filename().string() + "_" + split + "_";
  std::vector<std::string> numbered;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= lead.size() + 4 || name.compare(0, lead.size(), lead) != 0 ||
        name.compare(name.size() - 4, 4, ".bin") != 0)
      continue;
    const std::string digits = name.substr(lead.size(), name.size() - lead.size() - 4);
    if (digits.find_first_not_of("0123456789") == std::string::npos) numbered.push_back((dir / name).string());
  }
  std::sort(numbered.begin(), numbered.end());
  return numbered;
}

std::vector<std::string> split_files(const std::string& prefix, const std::string& split) {
  const std::string whole = prefix + "_" + split + ".bin";
  if (fs::exists(whole)) return {whole};
  std::vector<std::string> numbered = numbered_split_files(prefix, split);
  if (numbered.empty()) return {whole};
  return numbered;
}

std::vector<std::string> file_or_split(const std::string& path, const std::string& split) {
  if (fs::is_regular_file(path)) return {path};
  std::vector<std::string> files = split_files(path, split);
  return fs::exists(files.front()) ? files : std::vector<std::string>{path};
}

TokenRange share_of(int64_t total, int rank, int ranks) {
  const auto start = [&](int64_t r) { return total / ranks * r + total % ranks * r / ranks; };  // total * r / ranks
  return {start(rank), start(rank + 1)};
}

TokenCorpus::TokenCorpus(const std::vector<std::string>& paths) {
  if (paths.empty()) throw std::invalid_argument("TokenCorpus: no files");
  starts_.push_back(0);
  for (const std::string& path : paths) {
    shards_.emplace_back(path);
    starts_.push_back(starts_.back() + shards_.back().size());
  }
  if (paths.size() == 1) {
    name_ = paths[0];
  } else {  // DIR/fineweb_train_000001.bin → DIR/fineweb_train_*.bin
    const std::string& first = paths[0];
    const size_t digits_end = first.size() - 4, digits_start = first.find_last_not_of("0123456789", digits_end - 1) + 1;
    name_ = first.substr(0, digits_start) + "*.bin (" + std::to_string(paths.size()) + " files)";
  }
}

void TokenCorpus::read(int64_t first, int64_t count, int32_t* out) const {
  if (first < 0 || count < 0 || first > size() - count)
    throw std::out_of_range("token shard " + name_ + ": tokens [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") are not within its " + std::to_string(size()));
  // The file holding `first`: the last whose start is at most it.
  size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), first) - starts_.begin()) - 1;
  while (count > 0) {
    const int64_t at = first - starts_[i], n = std::min(count, shards_[i].size() - at);
    shards_[i].read(at, n, out);
    out += n, first += n, count -= n, ++i;
  }
}

std::vector<int32_t> TokenCorpus::read(int64_t first, int64_t count) const {
  std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(count, 0)));
  read(first, count, out.data());
  return out;
}

void TokenCorpus::validate_tokens(int32_t vocab_size, int64_t first, int64_t count) const {
  const int64_t end = first + count;
  for (size_t i = 0; i < shards_.size(); ++i) {
    const int64_t from = std::max(first, starts_[i]), to = std::min(end, starts_[i + 1]);
    if (from < to) shards_[i].validate_tokens(vocab_size, from - starts_[i], to - from);
  }
}

}  // namespace shardlm::data
