// The tokenize driver: files -> train/val shards.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <filesystem>
#include <random>
#include <vector>

#include "data/corpus.h"
#include "data/shard.h"
#include "data/tokenize.h"
#include "data_test_util.h"
#include <nlohmann/json.hpp>
#include <zlib.h>
#include <zstd.h>

namespace shardlm::data {
namespace {

using testing::data_dir;
using testing::gpt2;
using testing::TempDir;
using testing::write_file;

std::vector<int32_t> read_tokens(const std::string& path) {
  TokenShard s(path);
  return s.read(0, s.size());
}

TEST(Tokenize, BytesJoinsFilesWithNothing) {
  TempDir dir;
  write_file(dir.file("a.txt"), "abc");
  write_file(dir.file("b.txt"), "de");
  auto tok = make_tokenizer("bytes", "");
  const TokenizeStats st =
      tokenize_files({dir.file("a.txt"), dir.file("b.txt")}, dir.file("out/t"), *tok, {.val_fraction = 0.4});
  EXPECT_EQ(st.files, 2);
  EXPECT_EQ(st.bytes, 5);
  EXPECT_EQ(st.tokens, 5);
  EXPECT_EQ(st.val_tokens, 2);
  EXPECT_EQ(st.train_tokens, 3);
  EXPECT_EQ(st.train_files, std::vector<std::string>{dir.file("out/t_train.bin")});
  EXPECT_EQ(st.val_files, std::vector<std::string>{dir.file("out/t_val.bin")});
  EXPECT_EQ(read_tokens(st.train_files[0]), (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(read_tokens(st.val_files[0]), (std::vector<int32_t>{'d', 'e'}));
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
  std::vector<int32_t> got = read_tokens(st.train_files[0]);
  const std::vector<int32_t> val = read_tokens(st.val_files[0]);
  got.insert(got.end(), val.begin(), val.end());
  EXPECT_EQ(got, want);
  EXPECT_EQ(val, std::vector<int32_t>{995});
}

TEST(Tokenize, Errors) {
  TempDir dir;
  auto tok = make_tokenizer("bytes", "");
  write_file(dir.file("a.txt"), "abc");
  try {
    tokenize_files({dir.file("a.txt"), dir.file("nope.txt")}, dir.file("t"), *tok, {.val_fraction = 0.1});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("nope.txt")), std::string::npos) << e.what();
  }
  EXPECT_THROW(tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok, {.val_fraction = 1.0}), std::runtime_error);
  EXPECT_THROW(tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok, {.val_fraction = -0.1}), std::runtime_error);
  EXPECT_THROW(tokenize_files({}, dir.file("t"), *tok, {.val_fraction = 0.1}), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("t_train.bin")));
}

// Nothing written: no shard, no temporary file.
void expect_no_output(const TempDir& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().extension(), ".txt") << e.path() << " was left behind";
}

// What tokenize_files throws, or "" if it returns.
std::string tokenize_error(const std::vector<std::string>& inputs, const std::string& prefix, const Tokenizer& tok,
                           const TokenizeLimits& limits, int64_t shard_tokens = 0) {
  try {
    tokenize_files(inputs, prefix, tok, {.shard_tokens = shard_tokens, .limits = limits});
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// The format's token limit (an int32 count, 2^31 - 1) made small: the input is read until the
// limit, then refused with one line naming the file and the limit; /dev/zero stops there too.
TEST(Tokenize, StopsAtTheTokenLimitWithOneLine) {
  TempDir dir;
  auto tok = make_tokenizer("bytes", "");
  write_file(dir.file("a.txt"), std::string(600, 'a'));
  write_file(dir.file("b.txt"), std::string(600, 'b'));
  const TokenizeLimits limits{.max_tokens = 1000, .max_unbroken_bytes = 1 << 20, .read_bytes = 256};
  for (const std::vector<std::string>& inputs :
       {std::vector<std::string>{dir.file("a.txt"), dir.file("b.txt")}, std::vector<std::string>{"/dev/zero"}}) {
    const std::string err = tokenize_error(inputs, dir.file("t"), *tok, limits);
    EXPECT_NE(err.find(inputs.back()), std::string::npos) << err;
    EXPECT_NE(err.find("more than 1000 tokens"), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    expect_no_output(dir);
  }
  // Exactly the limit is written whole.
  const TokenizeStats st = tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok,
                                          {.val_fraction = 0.5, .limits = {.max_tokens = 600, .read_bytes = 7}});
  EXPECT_EQ(st.tokens, 600);
  EXPECT_EQ(read_tokens(st.train_files[0]), std::vector<int32_t>(300, 'a'));
  EXPECT_EQ(read_tokens(st.val_files[0]), std::vector<int32_t>(300, 'a'));
}

// Text is read and encoded in small chunks, and the shards hold the tokens of encoding each file
// whole (what tokenize wrote when it read whole files); LLaMA 3's ids in llm.c's uint32 layout.
class TokenizeInChunks : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizeInChunks, GivesTheTokensOfTheWholeFile) {
  const Tokenizer* tok = testing::loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  TempDir dir;
  std::string text = testing::read_file(data_dir() + "/kjv/kjv.txt").substr(0, 20000);
  std::mt19937_64 rng(5);
  const std::vector<std::string> odd = {"   ", "\n\n\n", "'s", "\xE4\xB8\xAD\xE6\x96\x87", "\xF0\x9F\x98\x80", "\xC2\xA0", "1234"};
  for (int i = 0; i < 2000; ++i) text.insert(rng() % text.size(), odd[rng() % odd.size()]);
  write_file(dir.file("a.txt"), text);
  std::vector<int32_t> want = tok->encode(text);
  const int64_t val = static_cast<int64_t>(want.size()) / 10;
  for (const auto& [read_bytes, threads] : {std::pair{1, 1}, {13, 1}, {4096, 1}, {13, 3}, {4096, 4}}) {
    const TokenizeStats st = tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok,
                                            {.threads = threads, .limits = {.read_bytes = read_bytes}});
    EXPECT_EQ(st.bytes, static_cast<int64_t>(text.size()));
    EXPECT_EQ(st.val_tokens, val);
    std::vector<int32_t> got = read_tokens(st.train_files[0]);
    const std::vector<int32_t> tail = read_tokens(st.val_files[0]);
    EXPECT_EQ(static_cast<int64_t>(tail.size()), val);
    got.insert(got.end(), tail.begin(), tail.end());
    EXPECT_EQ(got, want) << "read " << read_bytes << " bytes at a time, " << threads << " thread(s)";
    EXPECT_EQ(TokenShard(st.train_files[0]).token_bytes(), GetParam() == "llama3" ? 4 : 2);
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizeInChunks, ::testing::Values("gpt2", "llama3", "mistral"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Bytes with no place to break (one pre-tokenizer piece, e.g. /dev/zero's NULs) are refused
// once there are more than the limit of them, naming the file: the tokenizer cannot stream them.
TEST(Tokenize, TextWithoutBreaksIsRefusedAtItsLimit) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  TempDir dir;
  write_file(dir.file("a.txt"), "Some words, then " + std::string(5000, 'x'));
  const TokenizeLimits limits{.max_tokens = kShardMaxTokens, .max_unbroken_bytes = 1000, .read_bytes = 100};
  for (const std::string& in : {dir.file("a.txt"), std::string("/dev/zero")}) {
    const std::string err = tokenize_error({in}, dir.file("t"), *tok, limits);
    EXPECT_NE(err.find(in), std::string::npos) << err;
    EXPECT_NE(err.find("more than 1000"), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    expect_no_output(dir);
  }
  // Under the limit the same file is one token run, as when read whole.
  const TokenizeStats st = tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok,
                                          {.limits = {.max_unbroken_bytes = 6000, .read_bytes = 100}});
  EXPECT_EQ(st.tokens, static_cast<int64_t>(tok->encode(testing::read_file(dir.file("a.txt"))).size()));
}

// The same limit holds for a JSON Lines record's text, naming the file and line: one record of
// letters (60 MB of them took 24 s and 1.9 GB as one pre-tokenizer piece) is refused as a text
// file of them is. A long record with places to break is a document like any other.
TEST(Tokenize, JsonLinesTextWithoutBreaksIsRefusedAtItsLimit) {
  for (const char* name : {"gpt2", "mistral"}) {
    SCOPED_TRACE(name);
    const Tokenizer* tok = testing::loaded_tokenizer(name);
    ASSERT_NE(tok, nullptr);
    TempDir dir;
    const std::string unbroken = "Some words, then " + std::string(5000, 'x');
    std::string words;
    for (int i = 0; i < 500; ++i) words += "word" + std::to_string(i) + " ";
    write_file(dir.file("c.jsonl"), nlohmann::json{{"text", words}}.dump() + "\n" + nlohmann::json{{"text", unbroken}}.dump());
    const TokenizeLimits limits{.max_unbroken_bytes = 1000, .read_bytes = 100};
    const std::string err = tokenize_error({dir.file("c.jsonl")}, dir.file("t"), *tok, limits);
    EXPECT_NE(err.find(dir.file("c.jsonl") + ":2: "), std::string::npos) << err;
    EXPECT_NE(err.find("more than 1000"), std::string::npos) << err;
    EXPECT_NE(err.find(std::string(name) + " tokenizer can break"), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      EXPECT_EQ(e.path().extension(), ".jsonl") << e.path() << " was left behind";
    // Under the limit the same records are their documents' tokens.
    const TokenizeStats st = tokenize_files({dir.file("c.jsonl")}, dir.file("t"), *tok,
                                            {.val_fraction = 0, .limits = {.max_unbroken_bytes = 6000, .read_bytes = 100}});
    std::vector<int32_t> want = tok->encode(words);
    if (tok->eot() >= 0) want.push_back(tok->eot());
    const std::vector<int32_t> second = tok->encode(unbroken);
    want.insert(want.end(), second.begin(), second.end());
    EXPECT_EQ(read_tokens(st.train_files[0]), want);
  }
}

// The tokens of numbered files, in name order, as one sequence.
std::vector<int32_t> read_all(const std::vector<std::string>& paths) {
  std::vector<int32_t> all;
  for (const std::string& p : paths) {
    const std::vector<int32_t> t = read_tokens(p);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

// With shard_tokens, each split is numbered files of at most that many tokens (llm.c's layout,
// which train reads as one sequence), holding the tokens of the whole files in the same order:
// 1000 tokens, the last 250 for validation, files of 128: the cut falls inside train's sixth
// file and the validation tail spans three.
TEST(Tokenize, NumberedShardsHoldTheTokensOfTheWholeFiles) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i * 7 % 26);
  write_file(dir.file("a.txt"), text);
  auto tok = make_tokenizer("bytes", "");
  const TokenizeStats whole = tokenize_files({dir.file("a.txt")}, dir.file("w"), *tok, {.val_fraction = 0.25});
  const TokenizeStats cut =
      tokenize_files({dir.file("a.txt")}, dir.file("c"), *tok, {.val_fraction = 0.25, .shard_tokens = 128});
  EXPECT_EQ(cut.train_tokens, 750);
  EXPECT_EQ(cut.val_tokens, 250);
  ASSERT_EQ(cut.train_files.size(), 6u);
  ASSERT_EQ(cut.val_files.size(), 2u);
  EXPECT_EQ(cut.train_files[5], dir.file("c_train_000005.bin"));
  EXPECT_EQ(cut.val_files[0], dir.file("c_val_000000.bin"));
  for (size_t k = 0; k < 5; ++k) EXPECT_EQ(TokenShard(cut.train_files[k]).size(), 128) << k;
  EXPECT_EQ(TokenShard(cut.train_files[5]).size(), 110);
  EXPECT_EQ(TokenShard(cut.val_files[0]).size(), 128);
  EXPECT_EQ(read_all(cut.train_files), read_tokens(whole.train_files[0]));
  EXPECT_EQ(read_all(cut.val_files), read_tokens(whole.val_files[0]));
  EXPECT_EQ(split_files(dir.file("c"), "train"), cut.train_files);
}

// What train would read under a prefix is what tokenize last wrote there: a whole file that
// would hide new shards goes, shards past the new count go, and shards go for a whole file.
TEST(Tokenize, RewritingAPrefixLeavesNoOlderFileForTrainToRead) {
  TempDir dir;
  write_file(dir.file("a.txt"), std::string(1000, 'x'));
  auto tok = make_tokenizer("bytes", "");
  const std::string prefix = dir.file("t");
  tokenize_files({dir.file("a.txt")}, prefix, *tok, {.val_fraction = 0.1});
  const TokenizeStats many = tokenize_files({dir.file("a.txt")}, prefix, *tok, {.val_fraction = 0.1, .shard_tokens = 100});
  EXPECT_FALSE(std::filesystem::exists(prefix + "_train.bin"));
  EXPECT_EQ(split_files(prefix, "train"), many.train_files);
  ASSERT_EQ(many.train_files.size(), 9u);
  const TokenizeStats few = tokenize_files({dir.file("a.txt")}, prefix, *tok, {.val_fraction = 0.1, .shard_tokens = 500});
  EXPECT_EQ(numbered_split_files(prefix, "train"), few.train_files);
  EXPECT_EQ(numbered_split_files(prefix, "val"), few.val_files);
  ASSERT_EQ(few.train_files.size(), 2u);
  tokenize_files({dir.file("a.txt")}, prefix, *tok, {.val_fraction = 0.1});
  EXPECT_TRUE(numbered_split_files(prefix, "train").empty());
  EXPECT_TRUE(numbered_split_files(prefix, "val").empty());
  EXPECT_TRUE(std::filesystem::exists(prefix + "_val.bin"));
}

// The token limit holds over all the numbered files, and a refused run leaves none of them.
TEST(Tokenize, NumberedShardsStopAtTheTokenLimitLeavingNoFile) {
  TempDir dir;
  write_file(dir.file("a.txt"), std::string(1000, 'x'));
  auto tok = make_tokenizer("bytes", "");
  const std::string err =
      tokenize_error({dir.file("a.txt")}, dir.file("t"), *tok, {.max_tokens = 900, .read_bytes = 64}, 100);
  EXPECT_NE(err.find("more than 900 tokens"), std::string::npos) << err;
  expect_no_output(dir);
}

// A split of more files than the process may hold open is written: each full file is closed
// until the end (a 100 B-token corpus in llm.c's 100 M-token shards is 1000 files, and the usual
// limit is 1024 descriptors).
TEST(Tokenize, NumberedShardsPastTheOpenFileLimit) {
  TempDir dir;
  write_file(dir.file("a.txt"), std::string(3000, 'x'));
  auto tok = make_tokenizer("bytes", "");
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  rlimit few = before;
  few.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &few), 0);
  std::string error;
  TokenizeStats st;
  try {
    st = tokenize_files({dir.file("a.txt")}, dir.file("t"), *tok, {.val_fraction = 0.1, .shard_tokens = 10});
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &before), 0);
  ASSERT_EQ(error, "");
  EXPECT_EQ(st.train_files.size(), 270u);
  EXPECT_EQ(st.val_files.size(), 30u);
  EXPECT_EQ(read_all(st.train_files), std::vector<int32_t>(2700, 'x'));
}

// Text written without spaces (Chinese) streams a line at a time with a SentencePiece tokenizer:
// "\n" has no token of its own and its byte token merges with nothing, so a line ends a piece
// (it once had to wait for a space, and such a file past the limit was refused).
TEST(Tokenize, SentencePieceTextWithoutSpacesStreamsByLine) {
  for (const char* name : {"mistral", "llama2"}) {
    const Tokenizer* tok = testing::loaded_tokenizer(name);
    ASSERT_NE(tok, nullptr);
    std::string line = "\xE4\xB8\xAD\xE6\x96\x87\xE6\xB2\xA1\xE6\x9C\x89\xE7\xA9\xBA\xE6\xA0\xBC";  // 中文没有空格
    std::string text;
    for (int i = 0; i < 400; ++i) text += line + (i % 3 ? "\n" : "\n\n") + line.substr(0, 3 * (i % 6));
    EXPECT_EQ(tok->stable_prefix(line + "\n"), line.size() + 1) << name;
    EXPECT_EQ(tok->stable_prefix(line + "\n" + line), line.size() + 1) << name;
    TempDir dir;
    write_file(dir.file("zh.txt"), text);
    const TokenizeStats st = tokenize_files({dir.file("zh.txt")}, dir.file("t"), *tok,
                                            {.val_fraction = 0, .limits = {.max_unbroken_bytes = 1000, .read_bytes = 100}});
    EXPECT_EQ(read_all(st.train_files), tok->encode(text)) << name;
  }
}

// JSON Lines (FineWeb's, C4's, OpenWebText's form): each record's text is a document, joined to the
// next with eot as files are, so the tokens are those of the same documents given as text files
// — whatever the threads and however the records fall into pieces. JSON escapes (\u00e9, a
// surrogate pair for an emoji) are the document's UTF-8; other fields and blank lines are skipped.
class TokenizeJsonLines : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizeJsonLines, RecordsAreDocumentsAsFilesAre) {
  const Tokenizer* tok = testing::loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  TempDir dir;
  std::vector<std::string> docs = {"In the beginning God created the heaven and the earth.\n", "caf\xc3\xa9 \xf0\x9f\x98\x80 ok",
                                   "  leading spaces\n\nand a blank line", ""};
  for (int i = 0; i < 40; ++i) docs.push_back("record " + std::to_string(i) + " says: " + std::string(i * 7 % 50, 'x'));
  std::string jsonl;
  std::vector<std::string> as_files;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (i == 2) jsonl += "\n  \n";  // blank lines
    jsonl += i == 1 ? R"({"id": 1, "text": "caf\u00e9 \ud83d\ude00 ok", "url": "x"})"
                    : nlohmann::json{{"meta", {{"n", i}}}, {"text", docs[i]}}.dump();
    jsonl += "\n";
    as_files.push_back(dir.file("doc" + std::to_string(i) + ".txt"));
    write_file(as_files.back(), docs[i]);
  }
  jsonl.pop_back();  // the last record without its newline
  write_file(dir.file("c.jsonl"), jsonl);
  write_file(dir.file("tail.txt"), "and a text file after it");
  as_files.push_back(dir.file("tail.txt"));
  const std::vector<int32_t> want = read_all(tokenize_files(as_files, dir.file("files"), *tok, {.val_fraction = 0}).train_files);
  for (int threads : {1, 3})
    for (int64_t piece : {int64_t{1} << 20, int64_t{64}}) {
      const TokenizeStats st = tokenize_files({dir.file("c.jsonl"), dir.file("tail.txt")}, dir.file("j"), *tok,
                                              {.val_fraction = 0, .threads = threads, .limits = {.read_bytes = piece}});
      EXPECT_EQ(read_all(st.train_files), want) << threads << " threads, pieces of " << piece;
      EXPECT_EQ(st.files, 2);
    }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizeJsonLines, ::testing::Values("gpt2", "llama3", "mistral"),
                         [](const auto& info) { return info.param; });

TEST(Tokenize, JsonLinesErrorsNameTheFileAndLine) {
  TempDir dir;
  auto tok = make_tokenizer("bytes", "");
  const auto error_of = [&](const std::string& content, TokenizeOptions o = {}) {
    write_file(dir.file("bad.jsonl"), content);
    try {
      tokenize_files({dir.file("bad.jsonl")}, dir.file("t"), *tok, o);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string at = "tokenize: " + dir.file("bad.jsonl");
  EXPECT_EQ(error_of("{\"text\": \"a\"}\n{\"text\": \"b\"\n"), at + ":2: not a JSON object (JSON Lines: one object a line)");
  EXPECT_EQ(error_of("[1, 2]"), at + ":1: not a JSON object (JSON Lines: one object a line)");
  EXPECT_EQ(error_of("{\"text\": \"a\"}\n\n{\"body\": \"b\"}"),
            at + ":3: no string field 'text' (--text-field names the field holding each document)");
  EXPECT_EQ(error_of("{\"text\": 7}"), at + ":1: no string field 'text' (--text-field names the field holding each document)");
  // Text that is not UTF-8 (a raw byte, or an escape of half a surrogate pair) says so: nlohmann
  // refuses both, which read as "not a JSON object".
  EXPECT_EQ(error_of("{\"text\": \"a\"}\n{\"text\": \"a\xff\"}"),
            at + ":2: not UTF-8 (byte 0xff at offset 11 of the line); JSON Lines are UTF-8 text");
  EXPECT_EQ(error_of("{\"text\": \"caf\xc3\"}"), at + ":1: not UTF-8 (byte 0xc3 at offset 13 of the line); JSON Lines are UTF-8 text");
  for (const std::string lone : {"\\ud800", "\\ud83dx", "\\udc00"})
    EXPECT_EQ(error_of("{\"text\": \"a" + lone + "\"}"),
              at + ":1: a \\u escape of half a UTF-16 surrogate pair (U+D800..U+DFFF without its other half), no character")
        << lone;
  EXPECT_EQ(error_of("{\"text\": \"a\"}\n" + std::string(300, ' '), {.limits = {.read_bytes = 64, .max_line_bytes = 200}}),
            at + ":2: a line longer than 200 bytes; is it JSON Lines?");
  EXPECT_FALSE(std::filesystem::exists(dir.file("t_train.bin")));
  // A line of blanks is no record.
  EXPECT_EQ(tokenize_files({dir.file("bad.jsonl")}, dir.file("t"), *tok, {.val_fraction = 0}).tokens, 1);
}


// gzip of `parts`, each a member of its own (as `cat a.gz b.gz` makes).
void write_gzip(const std::string& path, const std::vector<std::string>& parts) {
  std::string all;
  for (const std::string& part : parts) {
    const std::string one = path + ".part";
    gzFile f = gzopen(one.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, part.data(), static_cast<unsigned>(part.size())), static_cast<int>(part.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
    all += testing::read_file(one);
    std::filesystem::remove(one);
  }
  write_file(path, all);
}

// zstd of `parts`, each a frame of its own.
std::string zstd_frames(const std::vector<std::string>& parts) {
  std::string all;
  for (const std::string& part : parts) {
    std::string frame(ZSTD_compressBound(part.size()), '\0');
    const size_t n = ZSTD_compress(frame.data(), frame.size(), part.data(), part.size(), 3);
    EXPECT_FALSE(ZSTD_isError(n));
    all += frame.substr(0, n);
  }
  return all;
}

// Corpora as they are distributed: gzip (C4's *.json.gz: JSON Lines by that name too) and zstd
// (*.jsonl.zst), several members or frames, read in small pieces, give the tokens of the
// uncompressed files; damaged or mislabelled data is one line naming the file.
TEST(Tokenize, CompressedInputsGiveTheTokensOfTheirContent) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  TempDir dir;
  std::string jsonl, text;
  for (int i = 0; i < 200; ++i) {
    jsonl += nlohmann::json{{"text", "document " + std::to_string(i) + " of the corpus."}}.dump() + "\n";
    text += "line " + std::to_string(i) + " of a text file.\n";
  }
  const std::string half_j = jsonl.substr(0, jsonl.size() / 2 + 7), half_t = text.substr(0, text.size() / 3);
  write_file(dir.file("c.jsonl"), jsonl);
  write_file(dir.file("t.txt"), text);
  write_gzip(dir.file("c.json.gz"), {half_j, jsonl.substr(half_j.size())});
  write_gzip(dir.file("t.txt.gz"), {half_t, text.substr(half_t.size())});
  write_file(dir.file("c.jsonl.zst"), zstd_frames({half_j, jsonl.substr(half_j.size())}));
  write_file(dir.file("t.txt.zst"), zstd_frames({half_t, text.substr(half_t.size())}));
  const TokenizeOptions small{.val_fraction = 0, .limits = {.read_bytes = 100}};
  const auto tokens = [&](const std::vector<std::string>& in) {
    return read_all(tokenize_files(in, dir.file("out"), *tok, small).train_files);
  };
  const std::vector<int32_t> want = tokens({dir.file("c.jsonl"), dir.file("t.txt")});
  EXPECT_EQ(tokens({dir.file("c.json.gz"), dir.file("t.txt.gz")}), want);
  EXPECT_EQ(tokens({dir.file("c.jsonl.zst"), dir.file("t.txt.zst")}), want);

  const auto error_of = [&](const std::string& name, const std::string& bytes) {
    write_file(dir.file(name), bytes);
    try {
      tokenize_files({dir.file(name)}, dir.file("bad"), *tok, small);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string gz = testing::read_file(dir.file("t.txt.gz")), zst = testing::read_file(dir.file("t.txt.zst"));
  const std::string at = "tokenize: " + dir.path() + "/";
  EXPECT_EQ(error_of("plain.txt.gz", text), at + "plain.txt.gz: is not gzip data (its name ends in .gz)");
  EXPECT_NE(error_of("cut.txt.gz", gz.substr(0, gz.size() - 20)).find(at + "cut.txt.gz: truncated gzip data"), std::string::npos);
  std::string flipped = gz;
  flipped[gz.size() / 2] ^= 0x5a;
  EXPECT_NE(error_of("flip.txt.gz", flipped).find(at + "flip.txt.gz: corrupt gzip data"), std::string::npos);
  EXPECT_EQ(error_of("cut.txt.zst", zst.substr(0, zst.size() - 20)),
            at + "cut.txt.zst: truncated zstd data (the last frame ends early)");
  EXPECT_NE(error_of("plain.txt.zst", text).find(at + "plain.txt.zst: corrupt zstd data: "), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.file("bad_train.bin")));
}

}  // namespace
}  // namespace shardlm::data
