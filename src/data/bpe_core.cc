#include "data/bpe_core.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

namespace shardlm::data::bpe {

// Symbols in a linked list, candidate pairs in a min-heap ordered by (rank, position); an entry is
// stale once either of its symbols has changed.
void merge(const MergeTable& merges, Scratch& sc, std::vector<int32_t>& out) {
  auto& id = sc.id;
  auto& prev = sc.prev;
  auto& next = sc.next;
  auto& heap = sc.heap;
  const auto m = static_cast<int32_t>(id.size());
  prev.resize(m);
  next.resize(m);
  heap.clear();
  for (int32_t k = 0; k < m; ++k) {
    prev[k] = k - 1;
    next[k] = k + 1 < m ? k + 1 : -1;
  }
  const auto push = [&](int32_t l) {
    if (l < 0) return;
    const int32_t r = next[l];
    if (r < 0) return;
    if (const Merge* mg = merges.find(id[l], id[r])) {
      heap.push_back({mg->rank, l, id[l], id[r]});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (int32_t k = 0; k + 1 < m; ++k) push(k);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Scratch::Candidate c = heap.back();
    heap.pop_back();
    const int32_t l = c.pos;
    const int32_t r = next[l];
    if (id[l] != c.left || r < 0 || id[r] != c.right) continue;  // stale
    id[l] = merges.find(c.left, c.right)->id;
    id[r] = -1;
    next[l] = next[r];
    if (next[r] >= 0) prev[next[r]] = l;
    push(prev[l]);
    push(l);
  }
  for (int32_t k = 0; k >= 0 && m > 0; k = next[k]) out.push_back(id[k]);
}

std::string read_file(const std::string& path, const std::string& what, const std::string& fetch_hint) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + what + " " + path + ": " + std::strerror(errno) + fetch_hint);
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw std::runtime_error("cannot read " + what + " " + path);
  return ss.str();
}

nlohmann::json parse_json(const std::string& text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": invalid JSON: " + e.what());
  }
}

std::vector<std::pair<std::string, std::string>> merges_of(const nlohmann::json& merges, const std::string& path) {
  if (!merges.is_array()) throw std::runtime_error(path + ": model.merges is not a list");
  std::vector<std::pair<std::string, std::string>> pairs;
  for (size_t r = 0; r < merges.size(); ++r) {
    const nlohmann::json& m = merges[r];
    const std::string text = m.is_string() ? m.get<std::string>() : "";
    const size_t space = text.find(' ');
    if (m.is_string() && space != std::string::npos && text.find(' ', space + 1) == std::string::npos)
      pairs.emplace_back(text.substr(0, space), text.substr(space + 1));
    else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
      pairs.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    else
      throw std::runtime_error(path + ": model.merges[" + std::to_string(r) + "] is not two tokens");
  }
  return pairs;
}

std::map<std::string, int64_t> added_tokens_of(const nlohmann::json& j, const std::string& path) {
  std::map<std::string, int64_t> added;
  for (const nlohmann::json& t : j.value("added_tokens", nlohmann::json::array())) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
        !t["content"].is_string())
      throw std::runtime_error(path + ": added_tokens: an entry without an integer id and a content string");
    added[t["content"].get<std::string>()] = t["id"].get<int64_t>();
  }
  return added;
}

int32_t document_separator(const std::map<std::string, int64_t>& added) {
  for (const char* separator : {"<|endoftext|>", "<|begin_of_text|>", "<s>"})
    if (added.count(separator)) return static_cast<int32_t>(added.at(separator));
  return -1;
}

std::vector<int32_t> end_tokens(const std::map<std::string, int64_t>& added) {
  std::vector<int32_t> ids;
  for (const char* end : {"<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>"})
    if (added.count(end)) ids.push_back(static_cast<int32_t>(added.at(end)));
  return ids;
}

}  // namespace shardlm::data::bpe
