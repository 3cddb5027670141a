#include "model/gpt2.h"

#include <cmath>
#include <stdexcept>

namespace shardlm::model {

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0) throw std::invalid_argument(std::string("model: ") + field + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_embd, "n_embd");
  positive(max_seq, "max_seq");
  if (n_embd % n_head != 0)
    throw std::invalid_argument("model: n_embd (" + std::to_string(n_embd) + ") is not divisible by n_head (" +
                                std::to_string(n_head) + ")");
  if (vocab_size > 65536)
    throw std::invalid_argument("model: vocab_size " + std::to_string(vocab_size) + " does not fit uint16 token files");
}

ModelConfig model_preset(const std::string& name, int64_t vocab_size) {
  ModelConfig c;
  c.vocab_size = vocab_size;
  if (name == "tiny") {
    c.n_layer = 2, c.n_head = 4, c.n_embd = 64, c.max_seq = 256;
  } else if (name == "small") {
    c.n_layer = 6, c.n_head = 6, c.n_embd = 384, c.max_seq = 1024;
  } else if (name == "gpt2-124m") {
    c.n_layer = 12, c.n_head = 12, c.n_embd = 768, c.max_seq = 1024;
  } else {
    throw std::invalid_argument("model: unknown preset '" + name + "' (expected tiny, small or gpt2-124m)");
  }
  return c;
}

const ParamSpec& UnitDesc::param(const std::string& suffix) const {
  for (const auto& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return p;
  throw std::out_of_range("unit " + name + " has no parameter " + suffix);
}

namespace {

void add_param(UnitDesc& u, std::string name, std::vector<int64_t> shape, bool decay, ParamInit init) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t d : p.shape) p.numel *= d;
  p.offset = u.numel;
  p.decay = decay;
  p.init = init;
  u.numel += p.numel;
  u.params.push_back(std::move(p));
}

}  // namespace

ModelDesc describe(const ModelConfig& config) {
  config.validate();
  const int64_t C = config.n_embd, L = config.n_layer;
  // GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L), norms at 1.
  const ParamInit normal{0.02f, 0.0f}, zero{0.0f, 0.0f}, one{0.0f, 1.0f};
  const ParamInit residual{0.02f / std::sqrt(2.0f * static_cast<float>(L)), 0.0f};

  ModelDesc d;
  d.config = config;
  UnitDesc emb;
  emb.kind = UnitKind::embedding;
  emb.name = "embedding";
  add_param(emb, "wte.weight", {config.padded_vocab(), C}, true, normal);
  add_param(emb, "wpe.weight", {config.max_seq, C}, true, {0.01f, 0.0f});
  d.units.push_back(std::move(emb));

  for (int l = 0; l < L; ++l) {
    UnitDesc b;
    b.kind = UnitKind::block;
    b.layer = l;
    b.name = "h." + std::to_string(l);
    const std::string p = b.name + ".";
    add_param(b, p + "ln_1.weight", {C}, false, one);
    add_param(b, p + "ln_1.bias", {C}, false, zero);
    add_param(b, p + "attn.c_attn.weight", {C, 3 * C}, true, normal);
    add_param(b, p + "attn.c_attn.bias", {3 * C}, false, zero);
    add_param(b, p + "attn.c_proj.weight", {C, C}, true, residual);
    add_param(b, p + "attn.c_proj.bias", {C}, false, zero);
    add_param(b, p + "ln_2.weight", {C}, false, one);
    add_param(b, p + "ln_2.bias", {C}, false, zero);
    add_param(b, p + "mlp.c_fc.weight", {C, 4 * C}, true, normal);
    add_param(b, p + "mlp.c_fc.bias", {4 * C}, false, zero);
    add_param(b, p + "mlp.c_proj.weight", {4 * C, C}, true, residual);
    add_param(b, p + "mlp.c_proj.bias", {C}, false, zero);
    d.units.push_back(std::move(b));
  }

  UnitDesc fin;
  fin.kind = UnitKind::final_norm;
  fin.name = "final_norm";
  add_param(fin, "ln_f.weight", {C}, false, one);
  add_param(fin, "ln_f.bias", {C}, false, zero);
  d.units.push_back(std::move(fin));
  return d;
}

int64_t ModelDesc::num_params() const {
  int64_t n = 0;
  for (const auto& u : units) n += u.numel;
  return n;
}

int64_t ModelDesc::num_params_exported() const {
  return num_params() - (config.padded_vocab() - config.vocab_size) * config.n_embd;
}

double ModelDesc::train_flops(int64_t B, int64_t T) const {
  const double tokens = static_cast<double>(B) * T;
  const double matmul_params = static_cast<double>(num_params_exported() - config.max_seq * config.n_embd);
  const double attention = 6.0 * config.n_layer * static_cast<double>(T) * config.n_embd;
  return 6.0 * matmul_params * tokens + attention * tokens;
}

int64_t ModelDesc::activation_bytes(int64_t B, int64_t T) const {
  const int64_t C = config.n_embd, NH = config.n_head, BT = B * T;
  // Per block: ln_1 out, ln_1 mean/rstd, qkv, attention out, lse, residual 1, ln_2 out,
  // ln_2 mean/rstd, fc pre-GELU, fc post-GELU, residual 2.
  const int64_t per_block = BT * (C + 2 + 3 * C + C + C + C + 2 + 4 * C + 4 * C + C) + B * NH * T;
  // Embedding output; final norm out + mean/rstd; the token ids and targets.
  const int64_t rest = BT * C + BT * (C + 2);
  return 4 * (config.n_layer * per_block + rest) + 2 * 4 * BT;
}

FlatLayout flat_layout(const ModelDesc& desc, int64_t world_size) {
  const int64_t multiple = 16 * world_size;
  FlatLayout layout;
  for (const auto& u : desc.units) {
    UnitSpan s;
    s.offset = layout.total;
    s.numel = u.numel;
    s.padded = (u.numel + multiple - 1) / multiple * multiple;
    layout.total += s.padded;
    layout.units.push_back(s);
  }
  return layout;
}

}  // namespace shardlm::model
