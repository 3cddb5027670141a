// Tokenizers without a reference implementation: known ids, pre-tokenization, byte-exact
// round trips (invalid UTF-8 included), the byte tokenizer, load errors.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include <functional>
#include <nlohmann/json.hpp>

#include "data/pretokenize.h"
#include "data/tokenizer.h"
#include "data/unicode.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::data_dir;
using testing::gpt2;
using testing::TempDir;
using testing::write_file;

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

using P = std::vector<std::string>;

TEST(Gpt2Pretokenize, MatchesTheRegex) {
  EXPECT_EQ(pieces("Hello world's  end\n\nx"), (P{"Hello", " world", "'s", " ", " end", "\n", "\n", "x"}));
  EXPECT_EQ(pieces("a   "), (P{"a", "   "}));
  EXPECT_EQ(pieces(" 123abc"), (P{" 123", "abc"}));
  // At a space the contraction alternatives do not apply: " '" is a space + other run.
  EXPECT_EQ(pieces("I'M you'll we've 're"), (P{"I", "'", "M", " you", "'ll", " we", "'ve", " '", "re"}));
  EXPECT_EQ(pieces("x!!! y"), (P{"x", "!!!", " y"}));
  EXPECT_EQ(pieces("\t\tx"), (P{"\t", "\t", "x"}));
  EXPECT_EQ(pieces(" \n"), (P{" \n"}));
  EXPECT_EQ(pieces("a \nb"), (P{"a", " ", "\n", "b"}));
  EXPECT_EQ(pieces("e\xCC\x81x"), (P{"e", "\xCC\x81", "x"}));           // combining acute: other
  EXPECT_EQ(pieces("\xD0\x9F\xD1\x80\xD0\xB8 42"), (P{"\xD0\x9F\xD1\x80\xD0\xB8", " 42"}));  // "При 42"
  EXPECT_EQ(pieces("a\xFF" "b"), (P{"a", "\xFF", "b"}));                 // invalid byte: other
  EXPECT_EQ(pieces(" \xFF\xFE!"), (P{" \xFF\xFE!"}));
  EXPECT_EQ(pieces("a\xC2\xA0" "b"), (P{"a", "\xC2\xA0", "b"}));         // NBSP is \s
  EXPECT_EQ(pieces(""), P{});
}

// LLaMA 3's split, each case as JavaScript's regex engine splits it with the pattern (its (?i:...)
// spelled out): a letter run takes one code point before it that is no newline, letter or number;
// numbers go three at a time; other runs take the newlines after them; whitespace ends at its
// last newline.
TEST(Llama3Pretokenize, MatchesTheRegex) {
  const auto split = [](std::string_view text) {
    std::vector<std::string> out;
    for (std::string_view p : pretokenize(Pretokenizer::llama3, text)) out.emplace_back(p);
    return out;
  };
  EXPECT_EQ(split("Hello world's  end\n\nx"), (P{"Hello", " world", "'s", " ", " end", "\n\n", "x"}));
  EXPECT_EQ(split("I'M you'LL we've 're"), (P{"I", "'M", " you", "'LL", " we", "'ve", " '", "re"}));
  EXPECT_EQ(split("12345 678"), (P{"123", "45", " ", "678"}));
  EXPECT_EQ(split("(hello) \tworld"), (P{"(hello", ")", " ", "\tworld"}));
  EXPECT_EQ(split("x...\n\n  y"), (P{"x", "...\n\n", " ", " y"}));
  EXPECT_EQ(split("a \n  b"), (P{"a", " \n", " ", " b"}));
  EXPECT_EQ(split("\n\nHi"), (P{"\n\n", "Hi"}));
  EXPECT_EQ(split("a  \t"), (P{"a", "  \t"}));
  EXPECT_EQ(split(" ?!"), (P{" ?!"}));
  EXPECT_EQ(split("a\r\n\r\nb"), (P{"a", "\r\n\r\n", "b"}));
  EXPECT_EQ(split("'s's"), (P{"'s", "'s"}));
  EXPECT_EQ(split("x\xC2\xA0y"), (P{"x", "\xC2\xA0y"}));  // NBSP before a letter
  EXPECT_EQ(split("e\xCC\x81x"), (P{"e", "\xCC\x81x"}));  // a combining mark (other) before one
  EXPECT_EQ(split(""), P{});
}

TEST(Pretokenize, PiecesCoverRandomBytes) {
  std::mt19937_64 rng(7);
  for (int k = 0; k < 300; ++k) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    for (const Pretokenizer split : {Pretokenizer::gpt2, Pretokenizer::llama3}) {
      std::string joined;
      for (std::string_view p : pretokenize(split, s)) {
        ASSERT_FALSE(p.empty());
        joined += p;
      }
      ASSERT_EQ(joined, s);
    }
  }
}

TEST(Unicode, Classes) {
  EXPECT_EQ(char_class('a'), CharClass::kLetter);
  EXPECT_EQ(char_class('7'), CharClass::kNumber);
  EXPECT_EQ(char_class(' '), CharClass::kSpace);
  EXPECT_EQ(char_class('\t'), CharClass::kSpace);
  EXPECT_EQ(char_class('\''), CharClass::kOther);
  EXPECT_EQ(char_class(0x4E2D), CharClass::kLetter);   // 中
  EXPECT_EQ(char_class(0x0663), CharClass::kNumber);   // Arabic-Indic 3
  EXPECT_EQ(char_class(0x216B), CharClass::kNumber);   // Roman numeral twelve (Nl)
  EXPECT_EQ(char_class(0x00BD), CharClass::kNumber);   // ½ (No)
  EXPECT_EQ(char_class(0x3000), CharClass::kSpace);    // ideographic space
  EXPECT_EQ(char_class(0xFEFF), CharClass::kSpace);    // JavaScript's \s has it
  EXPECT_EQ(char_class(0x0085), CharClass::kOther);    // ... and not NEL
  EXPECT_EQ(char_class(0x0301), CharClass::kOther);    // combining mark
  EXPECT_EQ(char_class(0x1F600), CharClass::kOther);   // emoji
  EXPECT_EQ(char_class(0x1D518), CharClass::kLetter);  // mathematical fraktur U
  EXPECT_EQ(char_class(0x20000), CharClass::kLetter);  // CJK extension B
  EXPECT_EQ(char_class(0x1D7D8), CharClass::kNumber);  // mathematical double-struck 0
  EXPECT_EQ(char_class(0x110000), CharClass::kOther);
}

TEST(Unicode, DecodeRejectsMalformed) {
  auto dec = [](std::string s) {
    return decode_utf8(reinterpret_cast<const unsigned char*>(s.data()), s.size(), 0);
  };
  EXPECT_EQ(dec("\xE2\x82\xAC").cp, 0x20ACu);
  EXPECT_EQ(dec("\xF0\x9F\x98\x80").len, 4u);
  for (const char* bad : {"\xC0\x80", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xE2\x82", "\x80",
                          "\xF8\x88\x80\x80\x80", "\xC2" "A"}) {
    const CodePoint cp = dec(bad);
    EXPECT_EQ(cp.cp, kInvalidCodePoint) << bad;
    EXPECT_EQ(cp.len, 1u);
    EXPECT_EQ(cp.cls, CharClass::kOther);
  }
}

TEST(Gpt2Tokenizer, KnownIds) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->name(), "gpt2");
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eot(), 50256);
  EXPECT_EQ(tok->end_tokens(), std::vector<int32_t>{50256});
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok->encode(" the"), std::vector<int32_t>{262});
  EXPECT_EQ(tok->encode("\n\n"), std::vector<int32_t>{628});
  EXPECT_EQ(tok->encode("In the beginning God created the heaven and the earth."),
            (std::vector<int32_t>{818, 262, 3726, 1793, 2727, 262, 9538, 290, 262, 4534, 13}));
  // The special token is never produced from text.
  EXPECT_EQ(tok->encode("<|endoftext|>"), (std::vector<int32_t>{27, 91, 437, 1659, 5239, 91, 29}));
  EXPECT_EQ(tok->decode_token(50256), "<|endoftext|>");
  EXPECT_EQ(tok->decode_token(198), "\n");
  EXPECT_EQ(tok->decode({15496, 995, 50256}), "Hello world<|endoftext|>");
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_THROW(tok->decode_token(50257), std::out_of_range);
  EXPECT_THROW(tok->decode({-1}), std::out_of_range);
}

void expect_round_trip(const Tokenizer& tok, const std::string& s) {
  const std::vector<int32_t> ids = tok.encode(s);
  for (int32_t id : ids) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, tok.vocab_size());
    ASSERT_NE(id, tok.eot());
  }
  ASSERT_EQ(tok.decode(ids), s) << "round trip failed for ";
}

TEST(Gpt2Tokenizer, InvalidUtf8RoundTripsByteForByte) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  for (const std::string& s :
       {std::string("\xFF"), std::string("\xC0\x80"), std::string("\xED\xA0\x80 surrogate"),
        std::string("\xF4\x90\x80\x80"), std::string("cut \xE2\x82"), std::string("abc\x80" "def"),
        std::string("\xFE\xFF\xFE\xFF"), std::string("caf\xC3 \xA9"), std::string("x\0y\0", 4),
        std::string(" \xF0\x9F\x98 'S \xF0\x9F\x98\x80\x80"), std::string("\xC2\xC2\xA0\xA0")})
    expect_round_trip(*tok, s);
}

TEST(Gpt2Tokenizer, RandomBytesRoundTrip) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  std::mt19937_64 rng(42);
  const std::vector<std::string> frags = {"a", "Z", " ", "  ", "\n", "'s", "\xC3\xA9", "\xE4\xB8\xAD", "1",
                                          "\xF0\x9F\x98\x80", "!", "\t", "\xC2\xA0"};
  for (int k = 0; k < 400; ++k) {
    std::string s;
    const int n = static_cast<int>(rng() % 64);
    for (int i = 0; i < n; ++i) {
      const uint64_t r = rng();
      if (k % 2 == 0 || r % 3 == 0)
        s.push_back(static_cast<char>(r >> 8));  // any byte
      else
        s += frags[(r >> 8) % frags.size()];
    }
    expect_round_trip(*tok, s);
  }
}

// Encoding a stream a chunk at a time: the stable prefix of what has been read, encoded now,
// followed by the rest encoded with all that comes after it, is the encoding of the whole text.
class StablePrefix : public ::testing::TestWithParam<std::string> {};

TEST_P(StablePrefix, LetsAStreamBeEncodedInChunks) {
  const Tokenizer* tok = testing::loaded_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  std::mt19937_64 rng(11);
  const std::vector<std::string> frags = {"a",  "Z", " ",  "   ", "\n", "\n\n", "'s", "'re", "'", "\xC3\xA9", "\xE4\xB8\xAD",
                                          "1",  "42", "\xF0\x9F\x98\x80", "!", "\t", "\xC2\xA0", "\xCC\x81", "\r\n", "'S",
                                          "12345", "...", "(", "\x0b"};
  for (int k = 0; k < 300; ++k) {
    std::string s;
    const int n = static_cast<int>(rng() % 80);
    for (int i = 0; i < n; ++i) {
      const uint64_t r = rng();
      if (r % 5 == 0)
        s.push_back(static_cast<char>(r >> 8));  // any byte, a code point cut in two included
      else
        s += frags[(r >> 8) % frags.size()];
    }
    const std::vector<int32_t> whole = tok->encode(s);
    for (size_t read = 0; read <= s.size(); ++read) {
      const size_t stable = tok->stable_prefix(std::string_view(s).substr(0, read));
      ASSERT_LE(stable, read);
      std::vector<int32_t> ids = tok->encode(std::string_view(s).substr(0, stable));
      const std::string_view after = std::string_view(s).substr(stable);
      const std::vector<int32_t> rest = stable == 0 ? tok->encode(after) : tok->encode_continuation(after);
      ids.insert(ids.end(), rest.begin(), rest.end());
      ASSERT_EQ(ids, whole) << "text " << k << " cut at " << stable << " of the first " << read << " bytes";
    }
  }
  // Pieces that end well before the end are stable; the last piece never is.
  EXPECT_GT(tok->stable_prefix("a b c d e f g h i j k l m n o p"), 0u);
  EXPECT_EQ(tok->stable_prefix("abcdefghijklmnopqrstuvwxyz"), 0u);  // one piece: more may join it
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, StablePrefix, ::testing::Values("gpt2", "llama3", "mistral", "llama2"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(Gpt2Tokenizer, LongPiecesAreFast) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  // Each is one pre-token piece; BPE over it must not be quadratic.
  expect_round_trip(*tok, std::string(200000, ' '));
  expect_round_trip(*tok, std::string(200000, 'a'));
  std::string mixed;
  for (int i = 0; i < 20000; ++i) mixed += "\xF0\x9F\x98\x80\xFF";
  expect_round_trip(*tok, mixed);
}

TEST(Gpt2Tokenizer, ConcurrentEncodeGivesSameIds) {
  const Tokenizer* tok = gpt2();
  ASSERT_NE(tok, nullptr);
  std::string text;
  for (int i = 0; i < 200; ++i) text += "And it came to pass, in the " + std::to_string(i) + "th year, that they're here.\n";
  const std::vector<int32_t> want = tok->encode(text);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = tok->encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

TEST(Gpt2Tokenizer, LoadErrorsNameTheFile) {
  TempDir dir;
  try {
    make_tokenizer("gpt2", dir.path());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path() + "/gpt2/encoder.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fetch_data.sh"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line";
  }
  std::filesystem::create_directories(dir.path() + "/gpt2");
  const std::string enc = dir.path() + "/gpt2/encoder.json", bpe = dir.path() + "/gpt2/vocab.bpe";
  write_file(enc, "{\"a\": 0, ");
  try {
    make_tokenizer("gpt2", dir.path());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(enc), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
  }
  // A valid byte-level vocabulary, and merges that are wrong in several ways.
  {
    std::string json = "{";
    // bytes_to_unicode as in GPT-2.
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? b : next++;
      std::string u;
      if (cp < 0x80) {
        u = std::string(1, static_cast<char>(cp));
      } else {
        u.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        u.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      if (u == "\"" || u == "\\") u = "\\" + u;
      json += "\"" + u + "\": " + std::to_string(b) + ", ";
    }
    json += "\"ab\": 256, \"<|endoftext|>\": 257}";
    write_file(enc, json);
  }
  write_file(bpe, "#version: 0.2\na b\n");
  {
    auto tok = make_tokenizer("gpt2", dir.path());
    EXPECT_EQ(tok->vocab_size(), 258);
    EXPECT_EQ(tok->eot(), 257);
    EXPECT_EQ(tok->encode("abab b"), (std::vector<int32_t>{256, 256, ' ', 'b'}));
  }
  for (const auto& [content, line] : {std::pair<std::string, std::string>{"#version: 0.2\na b\nab c\n", ":3:"},
                                      {"#version: 0.2\na\n", ":2:"},
                                      {"#version: 0.2\na b c\n", ":2:"}}) {
    write_file(bpe, content);
    try {
      make_tokenizer("gpt2", dir.path());
      FAIL() << "expected an error for " << content;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(bpe + line), std::string::npos) << e.what();
    }
  }
}

// LLaMA 3's tokenizer.json: 128000 BPE tokens and 256 special ones, which decode to their text
// and which encode never produces from text; <|begin_of_text|> is what tokenize puts between files.
TEST(Llama3Tokenizer, KnownIds) {
  const Tokenizer* tok = testing::loaded_tokenizer("llama3");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->name(), "llama3");
  EXPECT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->eot(), 128000);
  EXPECT_EQ(tok->end_tokens(), (std::vector<int32_t>{128001, 128009}));  // <|end_of_text|>, <|eot_id|>
  EXPECT_EQ(tok->encode("Hello, my dog is cute"), (std::vector<int32_t>{9906, 11, 856, 5679, 374, 19369}));
  EXPECT_EQ(tok->decode({128000, 9906, 128001}), "<|begin_of_text|>Hello<|end_of_text|>");
  for (const int32_t id : tok->encode("<|end_of_text|>")) EXPECT_LT(id, 128000);  // text, not the special token
  EXPECT_THROW(tok->decode({128256}), std::out_of_range);
  // A prompt begins with <|begin_of_text|>, as LLaMA 3 models are given one; GPT-2's does not.
  EXPECT_EQ(encode_prompt(*tok, "Hello"), (std::vector<int32_t>{128000, 9906}));
  EXPECT_TRUE(encode_prompt(*tok, "").empty());
  const Tokenizer* gpt2 = testing::gpt2();
  ASSERT_NE(gpt2, nullptr);
  EXPECT_EQ(encode_prompt(*gpt2, "Hello"), gpt2->encode("Hello"));
}

// Mistral 7B's tokenizer.json (Mixtral 8x7B's too): SentencePiece's BPE, a space written "▁" and
// one put before the text, code points with no token of their own as byte tokens <0x00> … <0xFF>.
// <s> is what tokenize puts between files and what a prompt begins with.
TEST(SentencePieceTokenizer, KnownIds) {
  const Tokenizer* tok = testing::loaded_tokenizer("mistral");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->name(), "mistral");
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->eot(), 1);
  EXPECT_EQ(tok->bos(), 1);
  EXPECT_EQ(tok->end_tokens(), std::vector<int32_t>{2});  // </s>
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{22557, 1526}));
  EXPECT_EQ(tok->encode(" Hello"), (std::vector<int32_t>{28705, 22557}));  // "▁▁Hello"
  EXPECT_EQ(tok->encode_continuation(" Hello"), std::vector<int32_t>{22557});
  EXPECT_EQ(tok->encode("a\nb"), (std::vector<int32_t>{264, 13, 28726}));  // "\n" is <0x0A>
  EXPECT_EQ(tok->encode("In the beginning God created the heaven and the earth."),
            (std::vector<int32_t>{560, 272, 5398, 2499, 3859, 272, 14591, 304, 272, 6340, 28723}));
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_EQ(tok->decode({1, 22557, 1526, 2}), "<s> Hello world</s>");  // as Hugging Face decodes them
  EXPECT_EQ(tok->decode({22557, 1526}), "Hello world");
  EXPECT_EQ(tok->decode_token(1526), " world");
  EXPECT_EQ(tok->decode_token(13), "\n");
  for (const int32_t id : tok->encode("</s><s>")) EXPECT_GT(id, 2);  // text, not the special tokens
  EXPECT_EQ(encode_prompt(*tok, "Hello"), (std::vector<int32_t>{1, 22557}));
  EXPECT_THROW(tok->decode({32000}), std::out_of_range);
  // Any byte string comes back, invalid UTF-8 included; U+2581 is the one code point that does not
  // (SentencePiece writes spaces as it), and comes back a space.
  for (const std::string& s : {std::string("\xFF"), std::string("cut \xE2\x82"), std::string("x\0y\0", 4),
                               std::string("  two  spaces  "), std::string(" "), std::string("\xC2\xC2\xA0\xA0 a"),
                               std::string(300, ' '), std::string("\xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87")})
    expect_round_trip(*tok, s);
  EXPECT_EQ(tok->decode(tok->encode("a\xE2\x96\x81" "b")), "a b");
  std::mt19937_64 rng(7);
  for (int k = 0; k < 200; ++k) {
    std::string s;
    for (int i = static_cast<int>(rng() % 64); i > 0; --i) s.push_back(k % 2 ? static_cast<char>(rng()) : " ab\xC3\xA9"[rng() % 5]);
    if (s.find("\xE2\x96\x81") == std::string::npos) expect_round_trip(*tok, s);
  }
}

// LLaMA 2's (data/llama2/tokenizer.json, written from llama-tokenizer-js's vocabulary and merges):
// the same kind of file with another vocabulary ("▁" is 29871).
TEST(SentencePieceTokenizer, Llama2KnownIds) {
  const Tokenizer* tok = testing::loaded_tokenizer("llama2");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->encode("Hello world!"), (std::vector<int32_t>{15043, 3186, 29991}));
  EXPECT_EQ(tok->encode(" Hello"), (std::vector<int32_t>{29871, 15043}));
  EXPECT_EQ(tok->encode("caf\xC3\xA9 \xF0\x9F\x98\x80"), (std::vector<int32_t>{274, 28059, 29871, 243, 162, 155, 131}));
  EXPECT_EQ(encode_prompt(*tok, "Hello world!"), (std::vector<int32_t>{1, 15043, 3186, 29991}));
  EXPECT_EQ(tok->decode({1, 15043, 3186, 29991}), "<s> Hello world!");
  EXPECT_EQ(tok->end_tokens(), std::vector<int32_t>{2});
}

// Long runs of one code point (one piece each) encode in O(n log n).
TEST(SentencePieceTokenizer, LongPiecesAreFast) {
  const Tokenizer* tok = testing::loaded_tokenizer("mistral");
  ASSERT_NE(tok, nullptr);
  expect_round_trip(*tok, std::string(200000, ' '));
  expect_round_trip(*tok, std::string(200000, 'a'));
  std::string mixed;
  for (int i = 0; i < 20000; ++i) mixed += "\xF0\x9F\x98\x80\xFF";
  expect_round_trip(*tok, mixed);
}

// A tokenizer.json shardlm cannot encode as its authors do is refused in one line naming the file
// and the field (LLaMA 3's, each time with one thing changed).
// Loads `real` (a tokenizer.json's text) with `change` made to it, which must be refused in one line
// naming the file and `field`.
void expect_refused(const std::string& real, const std::function<void(nlohmann::json&)>& change,
                    const std::string& field) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  nlohmann::json j = nlohmann::json::parse(real);
  change(j);
  write_file(path, j.dump());
  try {
    load_hf_tokenizer(path, "changed");
    ADD_FAILURE() << "expected an error naming " << field;
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(path + ": " + field, 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(HfTokenizer, LoadErrorsNameTheFileAndTheField) {
  const std::string real = testing::read_file(hf_tokenizer_file("llama3", data_dir()));
  ASSERT_FALSE(real.empty()) << testing::kFetchHint;
  TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  const auto refused = [&](const std::function<void(nlohmann::json&)>& change, const std::string& field) {
    expect_refused(real, change, field);
  };
  refused([](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer");
  refused([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+"; }, "pre_tokenizer");
  refused([](nlohmann::json& j) { j["model"]["type"] = "Unigram"; }, "model.type");
  refused([](nlohmann::json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback");
  refused([](nlohmann::json& j) { j["normalizer"] = {{"type", "NFC"}}; }, "normalizer");
  refused([](nlohmann::json& j) { j["model"]["merges"][5] = "a"; }, "model.merges[5]");
  refused([](nlohmann::json& j) { j["model"]["merges"][7] = "Ġ zzzzzzzz"; }, "model.merges[7]");
  refused([](nlohmann::json& j) { j["added_tokens"][0].erase("id"); }, "added_tokens");
  refused([](nlohmann::json& j) { j["model"]["ignore_merges"] = "yes"; }, "not a tokenizer.json shardlm can read");
  refused([](nlohmann::json& j) { j["model"]["type"] = 7; }, "not a tokenizer.json shardlm can read");
  refused([](nlohmann::json& j) { j["model"]["vocab"]["!"] = "zero"; }, "id of token !");
  write_file(path, real.substr(0, 1000));
  EXPECT_THROW(load_hf_tokenizer(path, "llama3"), std::runtime_error);
  try {
    make_tokenizer("llama3", dir.path());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path() + "/llama3/tokenizer.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fetch_data.sh --llama"), std::string::npos) << e.what();
  }
}

// The same for a SentencePiece tokenizer.json (Mistral's).
TEST(SentencePieceTokenizer, LoadErrorsNameTheFileAndTheField) {
  const std::string real = testing::read_file(hf_tokenizer_file("mistral", data_dir()));
  ASSERT_FALSE(real.empty()) << testing::kFetchHint;
  const auto refused = [&](const std::function<void(nlohmann::json&)>& change, const std::string& field) {
    expect_refused(real, change, field);
  };
  refused([](nlohmann::json& j) { j["model"]["byte_fallback"] = false; }, "model.byte_fallback");
  refused([](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout");
  refused([](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}}; },
          "pre_tokenizer");
  refused([](nlohmann::json& j) { j["normalizer"]["normalizers"][1]["content"] = "_"; }, "normalizer");
  refused([](nlohmann::json& j) {
    auto& vocab = j["model"]["vocab"];
    vocab["<0x0a>"] = vocab["<0x0A>"];
    vocab.erase("<0x0A>");
  }, "model.vocab");
  refused([](nlohmann::json& j) { j["model"]["vocab"]["\xE2\x96\x81"] = 5; }, "model.vocab");
  refused([](nlohmann::json& j) { j["model"]["merges"][3] = "\xE2\x96\x81 zzzzzz"; }, "model.merges[3]");
  refused([](nlohmann::json& j) { j["model"]["merges"] = nlohmann::json::array(); }, "model.merges");
  refused([](nlohmann::json& j) { j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>"; },
          "post_processor.single");
  refused([](nlohmann::json& j) { j["added_tokens"][0].erase("id"); }, "added_tokens");
}

TEST(MakeTokenizer, UnknownName) {
  try {
    make_tokenizer("sentencepiece", "data");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("sentencepiece"), std::string::npos);
  }
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  auto tok = make_tokenizer("bytes", "");
  EXPECT_EQ(tok->name(), "bytes");
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_EQ(tok->eot(), -1);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int32_t> ids = tok->encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok->decode(ids), all);
  EXPECT_EQ(tok->decode_token(65), "A");
  std::mt19937_64 rng(3);
  std::string s(5000, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  EXPECT_EQ(tok->decode(tok->encode(s)), s);
  EXPECT_THROW(tok->decode({256}), std::out_of_range);
  EXPECT_THROW(tok->decode_token(-1), std::out_of_range);
}

}  // namespace
}  // namespace shardlm::data
