#include "ckpt/json_no_duplicates.h"

#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace shardlm::ckpt {

using nlohmann::json;

namespace {

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

// An object being parsed: the key it is the value of ("" at the top or in an array), the keys
// seen in it so far, and the last of them (the key of a nested object that starts next).
struct OpenObject {
  std::string name;
  std::set<std::string> keys;
  std::string last_key;
};

}  // namespace

json parse_json_no_duplicates(std::string_view text) {
  std::vector<OpenObject> open;
  std::string twice;
  const json::parser_callback_t note_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open.push_back({open.empty() ? "" : open.back().last_key, {}, {}});
    } else if (event == json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == json::parse_event_t::array_start && !open.empty()) {
      open.back().last_key.clear();  // objects inside an array are no key's direct value
    } else if (event == json::parse_event_t::key && !open.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!open.back().keys.insert(key).second && twice.empty())
        twice = "key '" + key + "' appears twice" + (open.back().name.empty() ? "" : ", in '" + open.back().name + "'");
      open.back().last_key = key;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), note_keys);
  } catch (const json::exception& e) {
    throw std::runtime_error("is not valid JSON (" + one_line(e.what()) + ")");
  }
  if (!twice.empty()) throw std::runtime_error(twice);
  return j;
}

json read_json_no_duplicates(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot read");
  std::stringstream text;
  text << f.rdbuf();
  if (f.bad()) throw std::runtime_error(path + ": cannot read");
  try {
    return parse_json_no_duplicates(text.str());
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

}  // namespace shardlm::ckpt
