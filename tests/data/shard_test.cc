// Token shards: llm.c layout, round trip, validation errors, atomic writes.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "data/sampler.h"
#include "data/shard.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::read_file;
using testing::TempDir;
using testing::write_file;

// The error message of constructing a TokenShard from path ("" if none).
std::string open_error(const std::string& path) {
  try {
    TokenShard s(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string header_bytes(int32_t magic, int32_t version, int32_t count) {
  std::string h(1024, '\0');
  int32_t v[3] = {magic, version, count};
  std::memcpy(h.data(), v, sizeof(v));
  return h;
}

TEST(TokenShard, RoundTripAndLayout) {
  TempDir dir;
  std::mt19937 rng(1);
  std::vector<int32_t> tokens(10000);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 50257);
  tokens[0] = 0;
  tokens[1] = 65535;
  const std::string path = dir.file("a.bin");
  write_token_shard(path, tokens);
  // llm.c's layout, byte for byte.
  const std::string raw = read_file(path);
  ASSERT_EQ(raw.size(), 1024u + 2 * tokens.size());
  int32_t header[256];
  std::memcpy(header, raw.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 10000);
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header[i], 0);
  EXPECT_EQ(static_cast<unsigned char>(raw[1024 + 2]), 0xFF);
  EXPECT_EQ(static_cast<unsigned char>(raw[1024 + 3]), 0xFF);

  TokenShard shard(path);
  EXPECT_EQ(shard.path(), path);
  ASSERT_EQ(shard.size(), 10000);
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(shard[static_cast<int64_t>(i)], tokens[i]) << i;
  EXPECT_NO_THROW(shard.validate_tokens(65536));

  // Moving keeps the mapping.
  TokenShard moved(std::move(shard));
  EXPECT_EQ(moved.size(), 10000);
  EXPECT_EQ(moved[1], 65535);
  TokenShard other(path);
  other = std::move(moved);
  EXPECT_EQ(other[1], 65535);
}

TEST(TokenShard, EmptyShard) {
  TempDir dir;
  write_token_shard(dir.file("e.bin"), std::vector<uint16_t>{});
  TokenShard s(dir.file("e.bin"));
  EXPECT_EQ(s.size(), 0);
  EXPECT_NO_THROW(s.validate_tokens(1));
}

TEST(TokenShard, ErrorsNameTheFileAndTheProblem) {
  TempDir dir;
  const std::string missing = dir.file("missing.bin");
  std::string e = open_error(missing);
  EXPECT_NE(e.find(missing), std::string::npos) << e;
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;

  const std::string tiny = dir.file("tiny.bin");
  write_file(tiny, std::string(100, 'x'));
  e = open_error(tiny);
  EXPECT_NE(e.find(tiny), std::string::npos) << e;
  EXPECT_NE(e.find("shorter than the 1024-byte header"), std::string::npos) << e;

  const std::string magic = dir.file("magic.bin");
  write_file(magic, header_bytes(12345, 1, 0));
  e = open_error(magic);
  EXPECT_NE(e.find(magic), std::string::npos) << e;
  EXPECT_NE(e.find("bad magic 12345"), std::string::npos) << e;

  const std::string version = dir.file("version.bin");
  write_file(version, header_bytes(20240520, 2, 0));
  e = open_error(version);
  EXPECT_NE(e.find(version), std::string::npos) << e;
  EXPECT_NE(e.find("unsupported version 2"), std::string::npos) << e;

  const std::string truncated = dir.file("truncated.bin");
  write_token_shard(truncated, std::vector<int32_t>(100, 7));
  std::filesystem::resize_file(truncated, 1024 + 2 * 100 - 1);
  e = open_error(truncated);
  EXPECT_NE(e.find(truncated), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;

  const std::string trailing = dir.file("trailing.bin");
  write_file(trailing, header_bytes(20240520, 1, 2) + std::string(6, '\0'));
  e = open_error(trailing);
  EXPECT_NE(e.find(trailing), std::string::npos) << e;
  EXPECT_NE(e.find("trailing"), std::string::npos) << e;

  for (const std::string& p : {missing, tiny, magic, version, truncated, trailing})
    EXPECT_EQ(open_error(p).find('\n'), std::string::npos) << "one line for " << p;
}

// llm.c's LLaMA 3 files (magic 20240801, version 7) hold uint32 ids, past uint16's range: read as
// written, their size checked at 4 bytes a token, another version named.
TEST(TokenShard, ReadsLlama3sUint32Files) {
  TempDir dir;
  const std::vector<uint32_t> ids{0, 128000, 70000, 5, 128255, 65536};
  std::string body(ids.size() * 4, '\0');
  std::memcpy(body.data(), ids.data(), body.size());
  const std::string path = dir.file("l3.bin");
  write_file(path, header_bytes(20240801, 7, 6) + body);
  const TokenShard s(path);
  EXPECT_EQ(s.size(), 6);
  EXPECT_EQ(s.token_bytes(), 4);
  EXPECT_EQ(s.read(0, 6), (std::vector<int32_t>{0, 128000, 70000, 5, 128255, 65536}));
  EXPECT_EQ(s.read(2, 3), (std::vector<int32_t>{70000, 5, 128255}));
  EXPECT_NO_THROW(s.validate_tokens(128256));
  try {
    s.validate_tokens(100000);
    FAIL() << "128000 passed a vocabulary of 100000";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 128000 at position 1 is >= the vocabulary size 100000"),
              std::string::npos) << e.what();
  }
  const std::string as_uint16 = dir.file("short.bin");  // six tokens' worth of uint16s
  write_file(as_uint16, header_bytes(20240801, 7, 6) + body.substr(0, 12));
  EXPECT_NE(open_error(as_uint16).find("truncated: header says 6 tokens (1048 bytes)"), std::string::npos)
      << open_error(as_uint16);
  const std::string version = dir.file("v1.bin");
  write_file(version, header_bytes(20240801, 1, 0));
  EXPECT_NE(open_error(version).find("unsupported version 1 (expected 7"), std::string::npos) << open_error(version);
}

TEST(TokenShard, ValidateTokensReportsFirstBadIdAndPosition) {
  TempDir dir;
  std::vector<int32_t> tokens(100, 5);
  tokens[7] = 50257;
  tokens[9] = 60000;
  write_token_shard(dir.file("v.bin"), tokens);
  TokenShard s(dir.file("v.bin"));
  EXPECT_NO_THROW(s.validate_tokens(60001));
  try {
    s.validate_tokens(50257);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(dir.file("v.bin")), std::string::npos) << m;
    EXPECT_NE(m.find("token id 50257 at position 7"), std::string::npos) << m;
  }
}

TEST(TokenShard, AtomicWrite) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  // A file (or a link) at PATH.tmp is not the writer's: it is neither written through nor removed.
  write_file(dir.file("victim"), "precious");
  std::filesystem::create_symlink(dir.file("victim"), path + ".tmp");
  write_token_shard(path, std::vector<int32_t>{1, 2, 3});
  EXPECT_EQ(read_file(dir.file("victim")), "precious");
  EXPECT_TRUE(std::filesystem::is_symlink(path + ".tmp"));
  std::filesystem::remove(path + ".tmp");
  EXPECT_EQ(TokenShard(path).size(), 3);

  // Overwriting replaces the whole file.
  write_token_shard(path, std::vector<int32_t>(50, 9));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  TokenShard s(path);
  EXPECT_EQ(s.size(), 50);
  EXPECT_EQ(s[49], 9);

  // A token that does not fit: nothing is written, the old file stays intact.
  EXPECT_THROW(write_token_shard(path, std::vector<int32_t>{1, 70000}), std::runtime_error);
  EXPECT_THROW(write_token_shard(path, std::vector<int32_t>{-1}), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_EQ(TokenShard(path).size(), 50);

  // An unwritable place: an error naming the file, no file left behind.
  const std::string nowhere = dir.file("no/such/dir/x.bin");
  try {
    write_token_shard(nowhere, std::vector<int32_t>{1});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(nowhere), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(nowhere));
}

// A shard written as its tokens come: appended in parts, its tail moved to a second shard, both
// exist only once committed; a writer dropped before commit leaves the old file as it was.
TEST(TokenShardWriter, AppendsMovesTheTailAndCommits) {
  TempDir dir;
  const std::string a = dir.file("a.bin"), b = dir.file("b.bin");
  write_token_shard(a, std::vector<int32_t>{7});
  {
    TokenShardWriter wa(a), wb(b);
    wa.append(std::vector<int32_t>{1, 2, 3});
    wa.append(std::vector<uint16_t>{4, 5});
    EXPECT_EQ(wa.size(), 5);
    EXPECT_THROW(wa.append(std::vector<int32_t>{65536}), std::runtime_error);
    EXPECT_THROW(wa.move_tail(6, wb), std::runtime_error);
    wa.move_tail(2, wb);
    wa.append(std::vector<int32_t>{6});
    EXPECT_EQ(wa.size(), 4);
    EXPECT_EQ(TokenShard(a).size(), 1);  // not committed yet
    EXPECT_FALSE(std::filesystem::exists(b));
    wa.commit();
    wb.commit();
  }
  EXPECT_EQ(TokenShard(a).read(0, 4), (std::vector<int32_t>{1, 2, 3, 6}));
  EXPECT_EQ(TokenShard(b).read(0, 2), (std::vector<int32_t>{4, 5}));
  {
    TokenShardWriter dropped(a);
    dropped.append(std::vector<int32_t>{9, 9});
  }
  EXPECT_FALSE(std::filesystem::exists(a + ".tmp"));
  EXPECT_EQ(TokenShard(a).size(), 4);
}

// LLaMA 3's layout (uint32 ids, magic 20240801): ids past uint16 are written and read back, its
// tail moves to a shard of the same layout, and a negative id is refused naming the file.
TEST(TokenShardWriter, WritesLlama3sUint32Layout) {
  TempDir dir;
  const std::string a = dir.file("a.bin"), b = dir.file("b.bin");
  {
    TokenShardWriter wa(a, 4), wb(b, 4);
    wa.append(std::vector<int32_t>{1, 70000, 128255});
    wa.append(std::vector<uint16_t>{65535, 2});
    EXPECT_THROW(wa.append(std::vector<int32_t>{-1}), std::runtime_error);
    wa.move_tail(3, wb);
    wa.commit();
    wb.commit();
  }
  EXPECT_EQ(TokenShard(a).token_bytes(), 4);
  EXPECT_EQ(TokenShard(a).read(0, 2), (std::vector<int32_t>{1, 70000}));
  EXPECT_EQ(TokenShard(b).read(0, 3), (std::vector<int32_t>{128255, 65535, 2}));
  EXPECT_EQ(std::filesystem::file_size(b), static_cast<uintmax_t>(kShardHeaderBytes + 3 * 4));
  EXPECT_THROW(TokenShardWriter(a, 3), std::runtime_error);
}

// A mapped shard truncated while in use killed the process with SIGBUS and no message; reads
// that come back short are one line naming the file, whichever reader meets them.
TEST(TokenShard, TruncatedWhileOpenIsAClearError) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  std::vector<int32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 1000);
  write_token_shard(path, tokens);
  const TokenCorpus s(path);  // as training reads it
  std::vector<int32_t> in(4 * 64), tg(4 * 64);
  ASSERT_NO_THROW(sample_batch(s, 1, 0, 0, 4, 64, in.data(), tg.data()));
  std::filesystem::resize_file(path, 1024 + 2 * 10);  // 10 tokens left of 5000
  auto expect_clear = [&](auto&& read) {
    try {
      read();
      FAIL() << "expected an error";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(path), std::string::npos) << m;
      EXPECT_NE(m.find("truncated"), std::string::npos) << m;
      EXPECT_NE(m.find("1044 bytes"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  };
  expect_clear([&] { sample_batch(s, 1, 1, 0, 4, 64, in.data(), tg.data()); });
  expect_clear([&] { eval_batch(s, 10, 2, 64, in.data(), tg.data()); });
  expect_clear([&] { s.validate_tokens(1000); });
  // Reopening checks the header against the new size.
  EXPECT_NE(open_error(path).find("truncated"), std::string::npos);
}

TEST(TokenShard, ReadsOutsideTheShardAreRefused) {
  TempDir dir;
  write_token_shard(dir.file("r.bin"), std::vector<int32_t>{1, 2, 3});
  TokenShard s(dir.file("r.bin"));
  EXPECT_EQ(s.read(1, 2), (std::vector<int32_t>{2, 3}));
  EXPECT_THROW(s.read(2, 2), std::out_of_range);
  EXPECT_THROW(s.read(-1, 1), std::out_of_range);
  EXPECT_THROW(s.read(0, -1), std::out_of_range);
}

}  // namespace
}  // namespace shardlm::data
