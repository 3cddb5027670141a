#include "ckpt/llmc_model.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <vector>

#include "ckpt/hf_export.h"
#include "ckpt/safetensors.h"
#include "files/replace_file.h"

namespace shardlm::ckpt {

namespace fs = std::filesystem;

namespace {

constexpr int32_t kModelMagic = 20240326;
constexpr int32_t kStateMagic = 20240327;  // llm.c's optimizer state file, not a model
constexpr int32_t kFp32Version = 3, kBf16Version = 5;
constexpr int kHeaderInts = 256;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("llm.c model: " + path + ": " + what);
}

// llm.c's parameter kinds in file order, with the shardlm GPT-2 parameter each is.
struct Kind {
  const char* name;
  const char* param;  // after "h.N." for a per-layer kind
  bool per_layer;
  bool transposed;  // llm.c holds (out, in), shardlm (in, out)
};
constexpr Kind kKinds[] = {
    {"wte", "wte.weight", false, false},          {"wpe", "wpe.weight", false, false},
    {"ln1w", "ln_1.weight", true, false},         {"ln1b", "ln_1.bias", true, false},
    {"qkvw", "attn.c_attn.weight", true, true},   {"qkvb", "attn.c_attn.bias", true, false},
    {"attprojw", "attn.c_proj.weight", true, true}, {"attprojb", "attn.c_proj.bias", true, false},
    {"ln2w", "ln_2.weight", true, false},         {"ln2b", "ln_2.bias", true, false},
    {"fcw", "mlp.c_fc.weight", true, true},       {"fcb", "mlp.c_fc.bias", true, false},
    {"fcprojw", "mlp.c_proj.weight", true, true}, {"fcprojb", "mlp.c_proj.bias", true, false},
    {"lnfw", "ln_f.weight", false, false},        {"lnfb", "ln_f.bias", false, false}};

// One tensor of the file and the parameter it is: `rows` x `cols` as the model holds it (rows
// it exports: wte's vocabulary without padding), `file_rows` x `cols` in the file before any
// transposition (wte: the file's padded vocabulary).
struct Piece {
  std::string name;  // "qkvw of layer 3", for errors
  int64_t offset;    // of the parameter in the model's flat buffer
  int64_t rows, cols, file_rows;
  bool transposed;
  int64_t file_numel() const { return file_rows * cols; }
};

std::vector<Piece> pieces(const model::ModelDesc& desc, const model::FlatLayout& layout, int64_t file_vocab_rows) {
  std::map<std::string, std::pair<size_t, const model::ParamSpec*>> by_name;
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (const auto& p : desc.units[u].params) by_name[p.name] = {u, &p};
  std::vector<Piece> out;
  for (const Kind& k : kKinds)
    for (int64_t l = 0; l < (k.per_layer ? desc.config.n_layer : 1); ++l) {
      const std::string name = k.per_layer ? "h." + std::to_string(l) + "." + k.param : k.param;
      const auto [u, p] = by_name.at(name);
      const std::vector<int64_t> shape = p->exported_shape();
      const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
      const bool wte = name == "wte.weight";
      out.push_back({std::string(k.name) + (k.per_layer ? " of layer " + std::to_string(l) : ""),
                     layout.units[u].offset + p->offset, rows, cols, wte ? file_vocab_rows : rows, k.transposed});
    }
  return out;
}

struct Header {
  int32_t magic, version, max_seq, vocab, layers, heads, channels, padded_vocab;
};

Header read_header(std::FILE* f, const std::string& path) {
  int32_t h[kHeaderInts];
  if (std::fread(h, sizeof(int32_t), kHeaderInts, f) != kHeaderInts)
    fail(path, "is shorter than llm.c's header of 256 int32");
  if (h[0] == kStateMagic) fail(path, "is llm.c's optimizer state file (magic 20240327), not its model file");
  if (h[0] != kModelMagic)
    fail(path, "is not an llm.c GPT-2 model file (magic " + std::to_string(h[0]) + ", expected 20240326)");
  if (h[1] != kFp32Version && h[1] != kBf16Version)
    fail(path, "header: version " + std::to_string(h[1]) + " (shardlm reads 3, fp32, and 5, bf16)");
  const char* names[] = {"max_seq_len", "vocab_size", "num_layers", "num_heads", "channels", "padded_vocab_size"};
  for (int i = 0; i < 6; ++i)
    if (h[2 + i] <= 0) fail(path, std::string("header: ") + names[i] + " is " + std::to_string(h[2 + i]) + ", must be > 0");
  if (h[7] < h[3])
    fail(path, "header: padded_vocab_size " + std::to_string(h[7]) + " is below vocab_size " + std::to_string(h[3]));
  return {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
}

model::ModelConfig config_of(const Header& h) {
  model::ModelConfig c = model::model_preset("gpt2-124m");
  c.n_layer = h.layers, c.n_head = c.n_kv_head = h.heads, c.n_embd = h.channels;
  c.ffn_dim = 4 * c.n_embd, c.max_seq = h.max_seq, c.vocab_size = h.vocab;
  return c;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open_for_reading(const std::string& path) {
  if (!fs::is_regular_file(path)) fail(path, "is not a file");
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) fail(path, std::string("cannot be opened: ") + std::strerror(errno));
  return f;
}

}  // namespace

bool is_llmc_model(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  File f(std::fopen(path.c_str(), "rb"));
  int32_t magic = 0;
  return f && std::fread(&magic, sizeof magic, 1, f.get()) == 1 && magic == kModelMagic;
}

model::ModelConfig read_llmc_config(const std::string& path) {
  File f = open_for_reading(path);
  const Header h = read_header(f.get(), path);
  model::ModelConfig c = config_of(h);
  try {
    c.validate();
  } catch (const std::exception& e) {
    fail(path, std::string("header: ") + e.what());
  }
  int64_t numel = 0;
  const model::ModelDesc desc = model::describe(c);
  for (const Piece& p : pieces(desc, model::flat_layout(desc), h.padded_vocab)) numel += p.file_numel();
  const int64_t want = 4 * kHeaderInts + numel * (h.version == kBf16Version ? 2 : 4);
  const auto have = static_cast<int64_t>(fs::file_size(path));
  if (have != want)
    fail(path, "holds " + std::to_string(have) + " bytes, but the model its header describes takes " +
                   std::to_string(want) + " (a truncated or foreign file)");
  return c;
}

void read_llmc_weights(const std::string& path, const model::ModelDesc& desc, const model::FlatLayout& layout,
                       float* params) {
  File f = open_for_reading(path);
  const Header h = read_header(f.get(), path);
  std::fill(params, params + layout.total, 0.0f);  // padding
  const int width = h.version == kBf16Version ? 2 : 4;
  std::vector<unsigned char> raw;
  std::vector<float> values;
  for (const Piece& p : pieces(desc, layout, h.padded_vocab)) {
    raw.resize(static_cast<size_t>(p.file_numel()) * width);
    if (std::fread(raw.data(), 1, raw.size(), f.get()) != raw.size()) fail(path, "ends inside " + p.name);
    values.resize(p.file_numel());
    for (int64_t i = 0; i < p.file_numel(); ++i) {
      if (width == 4) {
        std::memcpy(&values[i], raw.data() + 4 * i, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, raw.data() + 2 * i, 2);
        values[i] = std::bit_cast<float>(uint32_t(b) << 16);
      }
    }
    // Rows past the vocabulary are padding: neither read nor checked.
    for (int64_t i = 0; i < p.rows * p.cols; ++i)
      if (!std::isfinite(values[i]))
        fail(path, p.name + " holds a non-finite value (" + std::to_string(values[i]) + " at element " +
                       std::to_string(i) + ")");
    float* param = params + p.offset;
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t c = 0; c < p.cols; ++c) param[r * p.cols + c] = p.transposed ? values[c * p.rows + r] : values[r * p.cols + c];
  }
}

void write_llmc_model(const std::string& path, const model::ModelDesc& desc, const model::FlatLayout& layout,
                      const float* params, bool bf16) {
  const model::ModelConfig& c = desc.config;
  if (c.family != model::Family::gpt2)
    fail(path, std::string("llm.c's model file holds GPT-2 models; this one is ") + model::to_string(c.family));
  if (c.ffn_dim != 4 * c.n_embd)
    fail(path, "llm.c's GPT-2 MLP is 4 x n_embd = " + std::to_string(4 * c.n_embd) + " wide; this one is " +
                   std::to_string(c.ffn_dim));
  std::string tmp;
  const int fd = files::create_temporary(path, tmp, O_WRONLY);
  File f(fd < 0 ? nullptr : ::fdopen(fd, "wb"));
  if (!f) {
    if (fd >= 0) ::close(fd), ::unlink(tmp.c_str());
    fail(path, "cannot create " + tmp + ": " + std::strerror(errno));
  }
  try {
    int32_t h[kHeaderInts] = {kModelMagic, bf16 ? kBf16Version : kFp32Version, static_cast<int32_t>(c.max_seq),
                              static_cast<int32_t>(c.vocab_size), static_cast<int32_t>(c.n_layer),
                              static_cast<int32_t>(c.n_head), static_cast<int32_t>(c.n_embd),
                              static_cast<int32_t>(c.padded_vocab())};
    bool ok = std::fwrite(h, sizeof h, 1, f.get()) == 1;
    std::vector<float> values;
    std::vector<uint16_t> halves;
    for (const Piece& p : pieces(desc, layout, c.padded_vocab())) {
      values.assign(p.file_numel(), 0.0f);  // wte's padding rows stay zero
      const float* param = params + p.offset;
      for (int64_t r = 0; r < p.rows; ++r)
        for (int64_t col = 0; col < p.cols; ++col)
          (p.transposed ? values[col * p.rows + r] : values[r * p.cols + col]) = param[r * p.cols + col];
      if (bf16) {
        halves.resize(values.size());
        for (size_t i = 0; i < values.size(); ++i) halves[i] = to_bf16(values[i]);
        ok = ok && std::fwrite(halves.data(), 2, halves.size(), f.get()) == halves.size();
      } else {
        ok = ok && std::fwrite(values.data(), 4, values.size(), f.get()) == values.size();
      }
    }
    if (!ok || std::fflush(f.get()) != 0 || ::fsync(::fileno(f.get())) != 0)
      fail(path, "cannot write " + tmp + ": " + std::strerror(errno));
    if (std::fclose(f.release()) != 0) fail(path, "cannot write " + tmp + ": " + std::strerror(errno));
    if (std::rename(tmp.c_str(), path.c_str()) != 0) fail(path, "cannot rename " + tmp + " into place: " + std::strerror(errno));
    const fs::path parent = fs::path(path).parent_path();
    fsync_dir(parent.empty() ? "." : parent.string());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
}

}  // namespace shardlm::ckpt
