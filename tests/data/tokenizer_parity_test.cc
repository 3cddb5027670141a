// Parity of the C++ tokenizers with references run by node through tests/data/tokenizer_parity.js
// (GPT-2's with the npm gpt-3-encoder, LLaMA 3's and Mistral's with transformers.js's tokenizers, LLaMA 2's with llama-tokenizer-js): the whole KJV (in ~20 KB pieces: the JavaScript encoder
// is quadratic in a string's length), hard strings, random strings, and the code point
// classes of the pre-tokenizer regex. Needs node and scripts/fetch_data.sh; without them
// these tests FAIL (they do not skip).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "data/unicode.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::data_dir;
using testing::loaded_tokenizer;
using testing::kFetchHint;
using testing::read_file;
using testing::source_dir;
using testing::TempDir;
using testing::write_file;

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'')
      q += "'\\''";
    else
      q += c;
  }
  q += '\'';
  return q;
}

std::string node_binary() {
  if (const char* e = std::getenv("SHARDLM_NODE"); e && *e) return e;
  return "node";
}

// Runs tokenizer_parity.js with args; returns "" or an error message.
std::string run_node(const std::vector<std::string>& args, const TempDir& dir) {
  const std::string script = source_dir() + "/tests/data/tokenizer_parity.js";
  const std::string err_file = dir.file("node_stderr.txt");
  std::string cmd = shell_quote(node_binary());
  cmd += ' ';
  cmd += shell_quote(script);
  for (const auto& a : args) {
    cmd += ' ';
    cmd += shell_quote(a);
  }
  cmd += " 2>";
  cmd += shell_quote(err_file);
  const int rc = std::system(cmd.c_str());
  if (rc != 0)
    return "node failed (exit status " + std::to_string(rc) + "): " + cmd + "\n" + read_file(err_file) +
           "\nIs node installed (or SHARDLM_NODE set)? Else " + kFetchHint;
  return "";
}

// The reference's ids for each string, or a failure: for "gpt2" the npm gpt-3-encoder, for
// "llama3" and "mistral" transformers.js's tokenizers (@lenml/tokenizers) reading
// data/NAME/tokenizer.json, for "llama2" llama-tokenizer-js.
::testing::AssertionResult js_encode(const std::string& tokenizer, const std::vector<std::string>& inputs,
                                     std::vector<std::vector<int32_t>>* out) {
  const std::string modules = source_dir() + "/third_party/node_modules/";
  const std::string pkg = modules + (tokenizer == "gpt2"     ? "gpt-3-encoder"
                                     : tokenizer == "llama2" ? "llama-tokenizer-js"
                                                             : "@lenml/tokenizers");
  const std::string entry = tokenizer == "gpt2" ? "/Encoder.js" : tokenizer == "llama2" ? "/llama-tokenizer.js" : "/dist/main.js";
  if (!std::filesystem::exists(pkg + entry))
    return ::testing::AssertionFailure() << "the reference npm package is not at " << pkg << ": " << kFetchHint;
  TempDir dir;
  write_file(dir.file("in.json"), nlohmann::json(inputs).dump());
  const std::vector<std::string> args =
      tokenizer == "gpt2"     ? std::vector<std::string>{"encode", pkg, dir.file("in.json"), dir.file("out.json")}
      : tokenizer == "llama2" ? std::vector<std::string>{"encode-llama-js", pkg, dir.file("in.json"), dir.file("out.json")}
                              : std::vector<std::string>{"encode-hf", pkg, hf_tokenizer_file(tokenizer, data_dir()),
                                                         dir.file("in.json"), dir.file("out.json")};
  if (std::string err = run_node(args, dir); !err.empty()) return ::testing::AssertionFailure() << err;
  *out = nlohmann::json::parse(read_file(dir.file("out.json"))).get<std::vector<std::vector<int32_t>>>();
  if (out->size() != inputs.size()) return ::testing::AssertionFailure() << "node returned a wrong count";
  return ::testing::AssertionSuccess();
}

std::string show(const Tokenizer& tok, const std::vector<int32_t>& ids, size_t from, size_t to) {
  std::string s;
  for (size_t i = from; i < std::min(to, ids.size()); ++i) {
    s += std::to_string(ids[i]);
    if (ids[i] >= 0 && ids[i] < tok.vocab_size()) s += ::testing::PrintToString(tok.decode_token(ids[i]));
    s += " ";
  }
  return s;
}

// Compares C++ and JS ids string by string; returns how many strings differed.
int compare(const Tokenizer& tok, const std::vector<std::string>& inputs, const std::vector<std::vector<int32_t>>& js,
            const char* what) {
  int bad = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const std::vector<int32_t> ours = tok.encode(inputs[k]);
    if (ours == js[k]) continue;
    if (++bad > 5) continue;
    size_t d = 0;
    while (d < ours.size() && d < js[k].size() && ours[d] == js[k][d]) ++d;
    const size_t from = d > 4 ? d - 4 : 0;
    ADD_FAILURE() << what << " #" << k << " differs at token " << d << " (" << ours.size() << " vs " << js[k].size()
                  << " tokens)\n  C++: " << show(tok, ours, from, d + 6) << "\n  JS:  " << show(tok, js[k], from, d + 6)
                  << "\n  input: " << ::testing::PrintToString(inputs[k].substr(0, 300));
  }
  return bad;
}

// Cuts text into pieces of about `target` bytes, each ending just after a '\n' that follows
// a non-space and precedes a non-space, where GPT-2's and LLaMA 3's pre-tokenizers always have a
// boundary.
// So encoding the pieces one by one gives the ids of the whole text.
std::vector<std::string> cut(const std::string& text, size_t target) {
  auto space = [](char c) { return c == '\n' || c == ' ' || c == '\t' || c == '\r'; };
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t e = std::min(text.size(), i + target);
    while (e < text.size() && !(text[e - 1] == '\n' && e >= 2 && !space(text[e - 2]) && !space(text[e]))) ++e;
    out.push_back(text.substr(i, e - i));
    i = e;
  }
  return out;
}

// Each test runs for GPT-2's tokenizer, LLaMA 3's, Mistral's and LLaMA 2's.
class TokenizerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParity, WholeKjv) {
  const Tokenizer* tok = loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const std::string path = data_dir() + "/kjv/kjv.txt";
  const std::string text = read_file(path);
  ASSERT_GT(text.size(), 4000000u) << path << " is missing or short: " << kFetchHint;
  const std::vector<std::string> chunks = cut(text, 20000);
  std::vector<std::vector<int32_t>> js;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(js_encode(GetParam(), chunks, &js));
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(compare(*tok, chunks, js, "KJV chunk"), 0);
  // The whole text at once gives the concatenation. (A SentencePiece tokenizer puts a "▁" before
  // each text it encodes, the reference's chunks too: its whole text is the C++ chunks', each after
  // the first encoded as a continuation, and the chunks are checked one by one above.)
  std::vector<int32_t> joined;
  const bool sentencepiece = GetParam() == "mistral" || GetParam() == "llama2";
  for (size_t k = 0; k < chunks.size(); ++k) {
    const std::vector<int32_t> ids = !sentencepiece ? js[k] : k == 0 ? tok->encode(chunks[k]) : tok->encode_continuation(chunks[k]);
    joined.insert(joined.end(), ids.begin(), ids.end());
  }
  const auto t2 = std::chrono::steady_clock::now();
  const std::vector<int32_t> whole = tok->encode(text);
  const auto t3 = std::chrono::steady_clock::now();
  EXPECT_EQ(whole.size(), joined.size());
  EXPECT_TRUE(whole == joined);
  EXPECT_EQ(tok->decode(whole), text);
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::printf("KJV, %s: %zu bytes, %zu chunks, %zu tokens; node %.2fs, C++ chunked %.2fs, C++ whole %.2fs (%.1f MB/s)\n",
              GetParam().c_str(), text.size(), chunks.size(), whole.size(), secs(t0, t1), secs(t1, t2), secs(t2, t3),
              text.size() / secs(t2, t3) / 1e6);
}

std::vector<std::string> hard_strings() {
  std::vector<std::string> s = {
      "",
      "Hello world",
      "  leading spaces",
      "trailing spaces   ",
      "a  b   c    d",
      "\n",
      "\n\n\n",
      "a\n\nb",
      "a \n b",
      " \n \n ",
      "\t\tindent\n\t\t\tdeeper",
      "tab\there",
      "mixed \t \n\r\n end",
      "\r\n\r\n",
      "\x0b\x0c vertical tab and form feed",
      "I'm, you're, he's, they've, we'll, she'd, don't",
      "I'M YOU'RE HE'S THEY'VE WE'LL SHE'D DON'T",
      "'s's'S 'll'LL 're'Re 'VE",
      "rock'n'roll O'Neil's ''''",
      "'",
      "'s",
      " 's",
      "x'",
      "12345 678 9.0 1,000,000 3.14159",
      " 2024-05-20T12:34:56Z",
      "\xD9\xA3\xD9\xA4\xD9\xA5 \xD9\xA1\xD9\xA2",                   // Arabic-Indic digits
      "\xE2\x85\xAB \xC2\xB2 \xC2\xBD \xE2\x85\x93",                   // Roman twelve, superscript 2, 1/2, 1/3
      "x1y2z3 a1 1a",
      "\xE0\xA5\xA7\xE0\xA5\xA8\xE0\xA5\xA9",                           // Devanagari digits
      "\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82, \xD0\xBC\xD0\xB8\xD1\x80! \xD0\x81\xD0\xB6\xD0\xB8\xD0\xBA",
      "\xCE\x93\xCE\xB5\xCE\xB9\xCE\xAC \xCF\x83\xCE\xBF\xCF\x85 \xCE\x9A\xCF\x8C\xCF\x83\xCE\xBC\xCE\xB5",
      "\xD7\xA9\xD7\x9C\xD7\x95\xD7\x9D \xD7\xA2\xD7\x95\xD7\x9C\xD7\x9D",
      "\xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7 \xD8\xA8\xD8\xA7\xD9\x84\xD8\xB9\xD8\xA7\xD9\x84\xD9\x85",
      "\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8\xE0\xA5\x8D\xE0\xA4\xA4\xE0\xA5\x87 \xE0\xA4\xA6\xE0\xA5\x81\xE0\xA4\xA8"
      "\xE0\xA4\xBF\xE0\xA4\xAF\xE0\xA4\xBE",                           // Hindi, with vowel signs (marks)
      "\xE3\x81\x93\xE3\x82\x93\xE3\x81\xAB\xE3\x81\xA1\xE3\x81\xAF\xE4\xB8\x96\xE7\x95\x8C",
      "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C\xE3\x80\x82",
      "\xEC\x95\x88\xEB\x85\x95\xED\x95\x98\xEC\x84\xB8\xEC\x9A\x94 \xEC\x84\xB8\xEA\xB3\x84",
      "\xE0\xB8\xA0\xE0\xB8\xB2\xE0\xB8\xA9\xE0\xB8\xB2\xE0\xB9\x84\xE0\xB8\x97\xE0\xB8\xA2",  // Thai
      "\xE1\x83\xA5\xE1\x83\x90\xE1\x83\xA0\xE1\x83\x97\xE1\x83\xA3\xE1\x83\x9A\xE1\x83\x98",  // Georgian
      "\xC7\x84\xC7\x85\xC7\x86 \xC3\x9F\xE1\xBA\x9E",                 // titlecase digraphs, sharp s
      "\xF0\x9F\x98\x80\xF0\x9F\x98\x83 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD "
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7 \xF0\x9F\x87\xBA\xF0\x9F\x87\xB8",
      "I \xE2\x9D\xA4\xEF\xB8\x8F NY",
      "a\xF0\x9F\x98\x80" "b \xF0\x9F\x98\x80\xF0\x9F\x98\x80\xF0\x9F\x98\x80",
      "e\xCC\x81 cafe\xCC\x81 n\xCC\x83 \xCC\x81\xCC\x81x",            // combining marks
      "Z\xCC\xA4\xCD\x94\xCD\xA7\xCC\x91\xCC\x93" "a\xCC\x88\xCD\x96\xCC\xAD" "lgo",  // zalgo
      "\xE6\xBC\xA2\xE5\xAD\x97\xE3\x83\x86\xE3\x82\xB9\xE3\x83\x88\xE3\x80\x80\xE5\x85\xA8\xE8\xA7\x92",
      "a\xC2\xA0" "b \xC2\xA0 c",                                          // NBSP
      "a\xE2\x80\x83" "b",                                                 // em space
      "x\xE3\x80\x80\xE3\x80\x80y",                                       // ideographic spaces
      "a\xE2\x80\xA8" "b\xE2\x80\xA9" "c",                                 // line/paragraph separators
      "a\xEF\xBB\xBF" "b \xEF\xBB\xBF",                                    // BOM: \s in JavaScript
      "a\xC2\x85" "b",                                                     // NEL: not \s in JavaScript
      "a\xE1\xA0\x8E" "b",                                                 // Mongolian vowel separator
      "\xE2\x80\x8B zero width\xE2\x80\x8B",
      "!!! ??? ... --- *** ~~~ ___",
      "{\"a\": [1, 2], \"b\": null, \"c\": {\"d\": \"e\"}}",
      "\",\" \"],\" \"),\" '',' \".\",\" \"},\" ],[ \",\"\",\"",           // the comma pairs gpt-3-encoder mis-keys
      "<|endoftext|>",
      "x<|endoftext|>y",
      "C++ && || -> :: <<= >>=",
      "https://example.com/path?q=1&r=2#frag",
      "e-mail: foo@bar.com, $3.50, 100%, #hashtag, @mention",
      "\"quoted\", 'single', `back`",
      std::string("\x01\x02\x7f nul\0 inside", 15),
      "\x1c\x1d\x1e\x1f separators",
      "\xF0\x9D\x94\x98\xF0\x9D\x94\xAB\xF0\x9D\x94\xA6 \xF0\x90\x8D\x88 \xF0\x9D\x9F\x98\xF0\x9D\x9F\x99 "
      "\xF0\xA0\x80\x80\xF0\xA0\x80\x81",                                  // supplementary letters, digits
      "And God said, Let there be light: and there was light.",
      // LLaMA 3 tokens its merges do not reach (588 of them), which ignore_merges takes whole:
      // " việc", " Việt", " nhiều", " jeho", "ektedir", " ایران"
      " vi\xE1\xBB\x87" "c Vi\xE1\xBB\x87t nhi\xE1\xBB\x81u jeho\nektedir \xD8\xA7\xDB\x8C\xD8\xB1\xD8\xA7\xD9\x86",
      std::string(300, ' '),
      std::string(300, '\n'),
      "a" + std::string(200, ' ') + "b",
      std::string(1000, 'a'),
      std::string(500, '7'),
      " " + std::string(50, '!') + " " + std::string(50, '\t') + "x",
  };
  std::string emoji;
  for (int i = 0; i < 100; ++i) emoji += "\xF0\x9F\x98\x80";
  s.push_back(emoji);
  return s;
}

TEST_P(TokenizerParity, HardStrings) {
  const Tokenizer* tok = loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const std::vector<std::string> inputs = hard_strings();
  std::vector<std::vector<int32_t>> js;
  ASSERT_TRUE(js_encode(GetParam(), inputs, &js));
  EXPECT_EQ(compare(*tok, inputs, js, "hard string"), 0);
}

TEST_P(TokenizerParity, RandomStrings) {
  const Tokenizer* tok = loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const std::vector<std::string> frags = {
      "a", "Z", "the", "The", "\xC3\xA9", "\xC3\x9F", "\xD1\x8F", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80", "1", "42",
      "\xD9\xA3", "\xC2\xBD", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\xC2\xA0", "\xE3\x80\x80", "\xEF\xBB\xBF",
      "\xC2\x85", "'", "'s", "'S", "'ll", "'re", "'ve", "'m", "'d", "'t", ",", ".", "!", "\"", "-", "_", "]", ")",
      "}", "e\xCC\x81", "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD", "\xE2\x80\x8B", "<|endoftext|>", "#", "$", "%", "\x1f"};
  std::mt19937_64 rng(2024);
  std::vector<std::string> inputs;
  for (int k = 0; k < 3000; ++k) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) s += frags[rng() % frags.size()];
    inputs.push_back(std::move(s));
  }
  std::vector<std::vector<int32_t>> js;
  ASSERT_TRUE(js_encode(GetParam(), inputs, &js));
  EXPECT_EQ(compare(*tok, inputs, js, "random string"), 0);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizerParity, ::testing::Values("gpt2", "llama3", "mistral", "llama2"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Our generated class table against the JavaScript engine's \p{L}, \p{N} and \s, for every
// code point. Node may know a newer Unicode than the table: a code point it calls a letter
// or number that the table calls other is allowed (new assignments); nothing else is.
TEST(TokenizerClasses, UnicodeClassesMatchJavaScript) {
  TempDir dir;
  ASSERT_EQ(run_node({"classes", dir.file("classes.txt")}, dir), "");
  const std::string js = read_file(dir.file("classes.txt"));
  ASSERT_EQ(js.size(), 0x110000u);
  int newer = 0, bad = 0;
  for (uint32_t cp = 0; cp < 0x110000; ++cp) {
    const char ours = "OLNS"[static_cast<int>(char_class(cp))];
    if (ours == js[cp]) continue;
    if (ours == 'O' && (js[cp] == 'L' || js[cp] == 'N')) {
      ++newer;
      continue;
    }
    if (++bad <= 10) ADD_FAILURE() << "U+" << std::hex << cp << ": ours " << ours << ", JavaScript " << js[cp];
  }
  EXPECT_EQ(bad, 0);
  std::printf("Unicode table %s; %d code points are letters/numbers only in node's newer Unicode\n",
              unicode_table_version(), newer);
}

}  // namespace
}  // namespace shardlm::data
