// Tokenizers: byte-level BPE (GPT-2's encoder.json + vocab.bpe; a Hugging Face tokenizer.json such as
// LLaMA 3's), SentencePiece's BPE as a Hugging Face tokenizer.json holds it (LLaMA 2's, Mistral's,
// Mixtral's) and a byte tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shardlm::data {

// encode/decode are const and safe to call from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer();
  // Text to ids. Never produces eot(): the end-of-text token is only inserted by the
  // tokenize driver between files. Any byte string is accepted (invalid UTF-8 included).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The ids of text that continues a text encoded up to one of its stable_prefix points: as
  // encode, less what a tokenizer puts at the start of a text (SentencePiece's "▁" for a space
  // before the first word).
  virtual std::vector<int32_t> encode_continuation(std::string_view text) const { return encode(text); }
  // Ids to bytes, exactly: decode(encode(x)) == x for every byte string x (SentencePiece's: every x
  // without U+2581, which it writes spaces as).
  // Throws std::out_of_range for an id outside [0, vocab_size()).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // The bytes of one token (eot() decodes to "<|endoftext|>" for gpt2).
  virtual std::string decode_token(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;  // 50257 for gpt2, 256 for bytes
  // End-of-text id (50256 for gpt2), or -1 where the tokenizer has none (bytes: every id is
  // a byte, so there is no id left for it; the tokenize driver then joins files with nothing).
  virtual int32_t eot() const = 0;
  // The id a prompt begins with, as the model's authors begin one (<|begin_of_text|>, <s>), or -1.
  virtual int32_t bos() const { return -1; }
  // The ids a model ends its text with, where generation stops as Hugging Face's does (gpt2's
  // <|endoftext|>; LLaMA 3's <|end_of_text|> and <|eot_id|>; </s>); none for bytes.
  virtual std::vector<int32_t> end_tokens() const { return {}; }
  virtual std::string name() const = 0;  // "gpt2" | "llama3" | "mistral" | "bytes" | a user's name
  // The length n of the longest prefix of `text` whose encoding nothing after it can change:
  // encode(text[0, n)) followed by encode_continuation(text[n, ...) + more) is encode(text + more)
  // for every `more` where n > 0 (and so with encode_continuation for both). Lets a stream be encoded a chunk
  // at a time. bytes: all of it; gpt2: up to the end of the last pre-tokenizer piece that ends 8
  // bytes or more before the end (the most the pre-tokenizer looks past a piece) and is not
  // whitespace (0 if there is none); SentencePiece's: up to the last space after a word.
  virtual size_t stable_prefix(std::string_view text) const = 0;
};

// A prompt as a model of this tokenizer is given it to continue: after bos() where it has one
// (LLaMA 3's <|begin_of_text|>, LLaMA 2's and Mistral's <s>, as Meta's and Hugging Face's encoders begin it and
// as llm.c's LLaMA 3 data begins each document: LLaMA models degrade without it); GPT-2's is its
// text alone, as Hugging Face's GPT-2 encoder gives it. An empty prompt is empty.
std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view prompt);

// "gpt2": loads data_dir/gpt2/encoder.json and data_dir/gpt2/vocab.bpe (made by
// scripts/fetch_data.sh). "bytes": one token per byte, ids 0..255; data_dir is unused. Any other
// name: data_dir/NAME/tokenizer.json, a Hugging Face tokenizer file (scripts/fetch_data.sh --llama
// fetches LLaMA 3's and Mistral's; a model's own, e.g. LLaMA 2's, can be copied there). Errors are
// std::runtime_error with one line naming the file (or the unusable name).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& data_dir);
// The tokenizer `name` of a model at `model_dir`: a Hugging Face directory's own files where it
// has them (tokenizer.json; for gpt2 vocab.json and merges.txt, GPT-2's encoder.json and vocab.bpe
// by Hugging Face's names), else make_tokenizer(name, data_dir).
std::unique_ptr<Tokenizer> make_model_tokenizer(const std::string& name, const std::string& model_dir,
                                                const std::string& data_dir);
// Where make_tokenizer(name, data_dir) reads a tokenizer.json: data_dir/NAME/tokenizer.json.
std::string hf_tokenizer_file(const std::string& name, const std::string& data_dir);

// Where make_tokenizer("gpt2", data_dir) reads its files: {encoder.json, vocab.bpe} under
// data_dir/gpt2/ (ckpt export copies them as Hugging Face's vocab.json and merges.txt).
struct Gpt2Files {
  std::string encoder_json, vocab_bpe;
};
Gpt2Files gpt2_files(const std::string& data_dir);

// The GPT-2 tokenizer from explicit file paths.
std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& encoder_json_path,
                                               const std::string& vocab_bpe_path);

// A Hugging Face tokenizer.json, named `name`: a byte-level BPE (GPT-2's or LLaMA 3's
// pre-tokenizer, no normalizer), or SentencePiece's BPE (byte fallback; a space written "▁" and
// one put before the text, by the Prepend and Replace normalizers; a Metaspace pre-tokenizer, the
// other layout such files come in, is refused).
// Its added tokens decode to their text and are never produced by encode(); eot() is
// <|endoftext|>, else <|begin_of_text|> (what llm.c's LLaMA 3 files start each document with),
// else <s>, else -1; end_tokens() those of <|endoftext|>, <|end_of_text|>, <|eot_id|> and </s> it
// has. Errors are std::runtime_error with one line naming the file and field.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const std::string& name);

// GPT-2's pre-tokenization, exposed for tests: splits text into the pieces the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matches (each piece a view into text; together they cover text exactly). Invalid UTF-8
// bytes count as single code points of the "other" class.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace shardlm::data
