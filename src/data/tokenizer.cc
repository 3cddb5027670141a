#include "data/tokenizer.h"

#include <filesystem>
#include <stdexcept>

namespace shardlm::data {

Tokenizer::~Tokenizer() = default;

namespace {

// One token per byte: id == byte value. There is no end-of-text id (eot() == -1).
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      check(ids[i]);
      out[i] = static_cast<char>(ids[i]);
    }
    return out;
  }
  std::string decode_token(int32_t id) const override {
    check(id);
    return std::string(1, static_cast<char>(id));
  }
  int32_t vocab_size() const override { return 256; }
  int32_t eot() const override { return -1; }
  std::string name() const override { return "bytes"; }
  size_t stable_prefix(std::string_view text) const override { return text.size(); }

 private:
  static void check(int32_t id) {
    if (id < 0 || id > 255)
      throw std::out_of_range("bytes tokenizer: token id " + std::to_string(id) + " is not in [0, 256)");
  }
};

}  // namespace

Gpt2Files gpt2_files(const std::string& data_dir) {
  const std::string dir = (data_dir.empty() ? std::string(".") : data_dir) + "/gpt2/";
  return {dir + "encoder.json", dir + "vocab.bpe"};
}

std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view prompt) {
  std::vector<int32_t> ids = tokenizer.encode(prompt);
  if (tokenizer.bos() >= 0 && !ids.empty()) ids.insert(ids.begin(), tokenizer.bos());
  return ids;
}

std::string hf_tokenizer_file(const std::string& name, const std::string& data_dir) {
  return (data_dir.empty() ? std::string(".") : data_dir) + "/" + name + "/tokenizer.json";
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& data_dir) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") {
    const Gpt2Files f = gpt2_files(data_dir);
    return load_gpt2_tokenizer(f.encoder_json, f.vocab_bpe);
  }
  const bool plain = !name.empty() && name != "." && name != ".." &&
                     name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") ==
                         std::string::npos;
  if (!plain)
    throw std::runtime_error("tokenizer '" + name + "': not a name shardlm can look up (gpt2, bytes, or a directory "
                             "name under the data directory holding a tokenizer.json, as llama3 and mistral)");
  const std::string file = hf_tokenizer_file(name, data_dir);
  if (!std::filesystem::exists(file))
    throw std::runtime_error("tokenizer '" + name + "': no " + file +
                             (name == "llama3" || name == "mistral" || name == "llama2"
                                  ? " (run scripts/fetch_data.sh --llama, or copy the model's tokenizer.json there)"
                                  : " (copy the model's Hugging Face tokenizer.json there; the data or checkpoint names "
                                    "it, and its token ids can still be trained on and evaluated)"));
  return load_hf_tokenizer(file, name);
}

std::unique_ptr<Tokenizer> make_model_tokenizer(const std::string& name, const std::string& model_dir,
                                                const std::string& data_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!model_dir.empty() && fs::is_directory(model_dir, ec) && name != "bytes") {
    const std::string json = model_dir + "/tokenizer.json", vocab = model_dir + "/vocab.json",
                      merges = model_dir + "/merges.txt";
    if (name == "gpt2" && fs::exists(vocab) && fs::exists(merges)) return load_gpt2_tokenizer(vocab, merges);
    if (fs::exists(json)) return load_hf_tokenizer(json, name);
  }
  return make_tokenizer(name, data_dir);
}

}  // namespace shardlm::data
