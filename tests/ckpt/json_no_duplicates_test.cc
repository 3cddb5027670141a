// nlohmann's parser keeps one of two equal keys without a word; the checkpoint and Hugging Face
// readers refuse such a file (an index.json with "step" twice was read as either).
#include "ckpt/json_no_duplicates.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace shardlm::ckpt {
namespace {

std::string error_of(const std::string& text) {
  try {
    parse_json_no_duplicates(text);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(JsonNoDuplicates, RefusesAKeyTwiceInOneObjectAtAnyDepth) {
  EXPECT_EQ(error_of(R"({"step": 4, "step": 9})"), "key 'step' appears twice");
  EXPECT_EQ(error_of(R"({"rng": {"seed": 1, "seed": 2}})"), "key 'seed' appears twice, in 'rng'");
  EXPECT_EQ(error_of(R"({"files": [{"name": "a"}, {"name": "b", "name": "c"}]})"), "key 'name' appears twice");
  EXPECT_EQ(error_of(R"({"a": {"b": {}}, "c": {"d": 1, "e": {"f": [1, 2]}, "d": 2}})"), "key 'd' appears twice, in 'c'");
}

TEST(JsonNoDuplicates, AcceptsEqualKeysInDifferentObjects) {
  const std::string text = R"({"a": {"x": 1}, "b": {"x": 2, "a": {"x": 3}}, "l": [{"x": 4}, {"x": 5}], "x": 6})";
  EXPECT_EQ(error_of(text), "");
  const nlohmann::json j = parse_json_no_duplicates(text);
  EXPECT_EQ(j["b"]["a"]["x"], 3);
  EXPECT_EQ(j["l"][1]["x"], 5);
  EXPECT_EQ(j["x"], 6);
}

TEST(JsonNoDuplicates, InvalidJsonAndFilesNameTheirPath) {
  EXPECT_EQ(error_of(R"({"a": )").rfind("is not valid JSON (", 0), 0u);
  const std::filesystem::path p = std::filesystem::temp_directory_path() / ("shardlm_json_" + std::to_string(::getpid()));
  std::ofstream(p) << R"({"format": "x", "format": "y"})";
  try {
    read_json_no_duplicates(p.string());
    ADD_FAILURE() << "read a duplicated key";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), p.string() + ": key 'format' appears twice");
  }
  std::filesystem::remove(p);
  EXPECT_THROW(read_json_no_duplicates(p.string()), std::runtime_error);
}

}  // namespace
}  // namespace shardlm::ckpt
