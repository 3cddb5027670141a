// The tokenize driver: files -> train/val shards.
#include <gtest/gtest.h>

#include <vector>

#include "data/shard.h"
#include "data/tokenize.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::gpt2;
using testing::TempDir;
using testing::write_file;

std::vector<int32_t> read_tokens(const std::string& path) {
  TokenShard s(path);
  const std::vector<uint16_t> t = s.read(0, s.size());
  return std::vector<int32_t>(t.begin(), t.end());
}

TEST(Tokenize, BytesJoinsFilesWithNothing) {
  TempDir dir;
  write_file(dir.file("a.txt"), "abc");
  write_file(dir.file("b.txt"), "de");
  auto tok = make_tokenizer("bytes", "");
  const TokenizeStats st = tokenize_files({dir.file("a.txt"), dir.file("b.txt")}, dir.file("out/t"), *tok, 0.4);
  EXPECT_EQ(st.files, 2);
  EXPECT_EQ(st.bytes, 5);
  EXPECT_EQ(st.tokens, 5);
  EXPECT_EQ(st.val_tokens, 2);
  EXPECT_EQ(st.train_tokens, 3);
  EXPECT_EQ(st.train_path, dir.file("out/t_train.bin"));
  EXPECT_EQ(st.val_path, dir.file("out/t_val.bin"));
  EXPECT_EQ(read_tokens(st.train_path), (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(read_tokens(st.val_path), (std::vector<int32_t>{'d', 'e'}));
}

TEST(Tokenize, Gpt2SeparatesFilesWithEot) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  TempDir dir;
  const std::string a = "In the beginning God created the heaven and the earth.\n";
  const std::string b = "Hello world";
  write_file(dir.file("a.txt"), a);
  write_file(dir.file("b.txt"), b);
  const TokenizeStats st = tokenize_files({dir.file("a.txt"), dir.file("b.txt")}, dir.file("kjv"), *tok);
  std::vector<int32_t> want = tok->encode(a);
  want.push_back(50256);
  const std::vector<int32_t> eb = tok->encode(b);
  want.insert(want.end(), eb.begin(), eb.end());
  ASSERT_EQ(st.tokens, static_cast<int64_t>(want.size()));  // 12 + 1 + 2 = 15
  EXPECT_EQ(st.val_tokens, 1);                               // floor(15 * 0.1)
  std::vector<int32_t> got = read_tokens(st.train_path);
  const std::vector<int32_t> val = read_tokens(st.val_path);
  got.insert(got.end(), val.begin(), val.end());
  EXPECT_EQ(got, want);
  EXPECT_EQ(val, std::vector<int32_t>{995});
}

TEST(Tokenize, Errors) {
  TempDir dir;
  auto tok = make_tokenizer("bytes", "");
  write_file(dir.file("a.txt"), "abc");
  try {
    tokenize_files({dir.file("a.txt"), dir.file("nope.txt")}, dir.file("t"), *tok, 0.1);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("nope.txt")), std::string::npos) << e.what();
  }
  EXPECT_THROW(tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok, 1.0), std::runtime_error);
  EXPECT_THROW(tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok, -0.1), std::runtime_error);
  EXPECT_THROW(tokenize_files({}, dir.file("t"), *tok, 0.1), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("t_train.bin")));
}

}  // namespace
}  // namespace shardlm::data
