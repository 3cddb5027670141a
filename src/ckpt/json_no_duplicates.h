// JSON as the checkpoint and Hugging Face readers take it: nlohmann's parser keeps the last of
// two equal keys in an object without a word, so a file saying {"step": 4, "step": 9} would be
// read as whichever came last. These refuse it instead.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace shardlm::ckpt {

// Throws std::runtime_error whose message is one line: "is not valid JSON (<parser's reason>)"
// or "key 'K' appears twice" (", in 'PARENT'" where the object is a value of key PARENT).
nlohmann::json parse_json_no_duplicates(std::string_view text);

// The whole file through parse_json_no_duplicates. Messages are "PATH: cannot read",
// "PATH: is not valid JSON (…)", "PATH: key 'K' appears twice …".
nlohmann::json read_json_no_duplicates(const std::string& path);

}  // namespace shardlm::ckpt
