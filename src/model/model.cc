#include "model/model.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

namespace shardlm::model {

const char* to_string(Family f) {
  switch (f) {
    case Family::gpt2: return "gpt2";
    case Family::llama: return "llama";
    case Family::moe: return "moe";
    case Family::dit: return "dit";
  }
  return "?";
}

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
    case Recompute::selective_op: return "selective-op";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full, Recompute::selective_op})
    if (name == to_string(r)) return r;
  throw std::invalid_argument("recompute: unknown '" + name + "' (expected none, selective, full or selective-op)");
}

int ring_backward_stage_count(int cp) { return cp >= 3 ? 2 * cp : 2 * cp - 1; }

RingBackwardStage ring_backward_stage(int stage, int cp) {
  using Role = RingBackwardStage::Role;
  if (cp >= 3 && stage == 2 * cp - 1) return {Role::send_kept, cp};
  if (stage == 2 * cp - 2) return {Role::compute, cp};
  if (stage == 0) return {Role::home, 1};
  if (stage % 2 == 1) return {Role::compute, (stage + 1) / 2};
  return {Role::fold, stage / 2 + 1};
}

const char* to_string(ContextImpl c) { return c == ContextImpl::ring ? "ring" : "all-to-all"; }

ContextImpl parse_context_impl(const std::string& name) {
  for (ContextImpl c : {ContextImpl::ring, ContextImpl::all_to_all})
    if (name == to_string(c)) return c;
  throw std::invalid_argument("cp-impl (--cp-impl): unknown '" + name + "' (expected ring or all-to-all)");
}

int64_t context_chunk_rows(int64_t seq, int cp, ContextImpl impl) {
  if (cp == 1) return seq;
  return impl == ContextImpl::ring ? seq / (2 * cp) : seq / cp;
}

std::vector<int64_t> context_chunk_starts(int64_t seq, int cp, int index, ContextImpl impl) {
  if (cp == 1) return {0};
  const int64_t rows = context_chunk_rows(seq, cp, impl);
  if (impl == ContextImpl::all_to_all) return {index * rows};
  return {index * rows, (2 * cp - 1 - index) * rows};
}

const char* to_string_act_quant(const ActQuant& q) { return q.on() ? "int8" : "none"; }

void validate_act_quant(const ModelConfig& c, const ActQuant& q, int cp, ContextImpl impl) {
  if (!q.on()) return;
  const int64_t qkv = (c.n_head + 2 * c.n_kv_head) * c.head_size();
  std::vector<std::pair<const char*, int64_t>> widths = {{"n_embd", c.n_embd}, {"the q|k|v row", qkv}};
  // Split by heads over cp ranks, a rank keeps q|k|v rows of its heads only.
  if (cp > 1 && impl == ContextImpl::all_to_all) widths.push_back({"a cp rank's q|k|v row (--cp-impl all-to-all)", qkv / cp});
  if (c.family != Family::moe || c.moe_every > 1) widths.push_back({"ffn_dim", c.ffn_dim});  // a dense MLP
  if (c.family == Family::moe) widths.push_back({"moe_ffn_dim", c.moe_ffn_dim});
  for (const auto& [name, w] : widths)
    if (w % q.group != 0)
      throw std::invalid_argument("act_quant_group (--act-quant-group): " + std::to_string(q.group) + " does not divide " +
                                  name + " (" + std::to_string(w) + "); a group lies inside one row's features");
}

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0) throw std::invalid_argument(std::string("model: ") + field + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_kv_head, "n_kv_head");
  positive(n_embd, "n_embd");
  positive(ffn_dim, "ffn_dim");
  positive(max_seq, "max_seq");
  // Far above any real model, low enough that element and byte counts of a layer or a batch's
  // activations stay inside int64 (a config.json asking for more is a typo or an attack).
  auto at_most = [](int64_t v, int64_t limit, const char* field) {
    if (v > limit)
      throw std::invalid_argument(std::string("model: ") + field + " is " + std::to_string(v) + ", above the limit " +
                                  std::to_string(limit));
  };
  at_most(n_layer, int64_t{1} << 20, "n_layer");
  at_most(n_embd, int64_t{1} << 20, "n_embd");
  at_most(ffn_dim, int64_t{1} << 22, "ffn_dim");
  at_most(vocab_size, int64_t{1} << 24, "vocab_size");
  at_most(max_seq, int64_t{1} << 24, "max_seq");
  if (n_embd % n_head != 0)
    throw std::invalid_argument("model: n_embd (" + std::to_string(n_embd) + ") is not divisible by n_head (" +
                                std::to_string(n_head) + ")");
  if (n_head % n_kv_head != 0)
    throw std::invalid_argument("model: n_kv_head (" + std::to_string(n_kv_head) + ") does not divide n_head (" +
                                std::to_string(n_head) + ")");
  if (family == Family::gpt2 && n_kv_head != n_head)
    throw std::invalid_argument("model: n_kv_head must equal n_head for gpt2 (grouped-query attention is llama's)");
  if (family == Family::gpt2 && !tie_embeddings)
    throw std::invalid_argument("model: gpt2 ties its head to the embedding (tie_embeddings must be true)");
  validate_moe();
  validate_dit();
  if (family != Family::gpt2 && family != Family::dit && head_size() % 2 != 0)
    throw std::invalid_argument("model: head size n_embd/n_head (" + std::to_string(head_size()) +
                                ") must be even for rotary embeddings");
  if (head_size() > 256)
    throw std::invalid_argument("model: head size n_embd/n_head (" + std::to_string(head_size()) + ") exceeds 256");
  if (!(rope_theta > 0) || !std::isfinite(rope_theta)) throw std::invalid_argument("model: rope_theta must be positive and finite");
  validate_rope_scaling();
  if (!(norm_eps > 0) || !std::isfinite(norm_eps)) throw std::invalid_argument("model: norm_eps must be positive and finite");
  // GPT-2's layer norm epsilon is the kernels' constant: a model asking for another is not this one.
  if (family == Family::gpt2 && norm_eps != 1e-5) {
    char got[32];
    std::snprintf(got, sizeof got, "%g", norm_eps);
    throw std::invalid_argument(std::string("model: gpt2's layer norm epsilon is 1e-05 (norm_eps, --norm-eps, is llama's), got ") + got);
  }
}

void ModelConfig::validate_rope_scaling() const {
  const RopeScaling& r = rope_scaling;
  if (r == RopeScaling{}) return;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("model: rope_scaling " + msg); };
  if (family != Family::llama) fail("is LLaMA's (Llama 3.1); " + std::string(to_string(family)) + " has none");
  if (!(r.factor >= 1) || !std::isfinite(r.factor))
    fail("factor must be finite and >= 1, got " + std::to_string(r.factor));
  if (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor) || !std::isfinite(r.high_freq_factor))
    fail("needs 0 < low_freq_factor < high_freq_factor, got " + std::to_string(r.low_freq_factor) + " and " +
         std::to_string(r.high_freq_factor));
  if (r.original_max_seq <= 0)
    fail("original_max_position_embeddings must be positive, got " + std::to_string(r.original_max_seq));
}

// One line naming the field (and its flag) for each refused mixture-of-experts setting.
void ModelConfig::validate_moe() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("model: " + msg); };
  if (family != Family::moe) {
    if (n_experts != 0 || top_k != 0 || moe_ffn_dim != 0 || moe_every != 1 || capacity_factor != 0)
      fail(std::string("n_experts, top_k, moe_ffn_dim, moe_every and capacity_factor (--experts, --top-k, --moe-ffn-dim, "
                       "--moe-every, --capacity-factor) are mixture-of-experts settings; a ") +
           to_string(family) + " model has no experts (use a moe model, e.g. --model moe-tiny)");
    return;
  }
  if (n_experts < 1 || n_experts > 4096)
    fail("n_experts (--experts) must be in [1, 4096], got " + std::to_string(n_experts));
  if (top_k < 1 || top_k > n_experts)
    fail("top_k (--top-k) must be in [1, n_experts = " + std::to_string(n_experts) + "], got " + std::to_string(top_k));
  if (moe_ffn_dim < 1 || moe_ffn_dim > (int64_t{1} << 22))
    fail("moe_ffn_dim (--moe-ffn-dim) must be in [1, 4194304], got " + std::to_string(moe_ffn_dim));
  if (moe_every < 1 || moe_every > n_layer)
    fail("moe_every (--moe-every) must be in [1, n_layer = " + std::to_string(n_layer) + "], got " +
         std::to_string(moe_every));
  if (!std::isfinite(capacity_factor) || capacity_factor < 0)
    fail("capacity_factor (--capacity-factor) must be > 0 (omit it for dropless routing), got " +
         std::to_string(capacity_factor));
  if (!std::isfinite(aux_loss_coef) || aux_loss_coef < 0)
    fail("aux_loss_coef (--aux-loss-coef) must be finite and >= 0, got " + std::to_string(aux_loss_coef));
  if (!std::isfinite(z_loss_coef) || z_loss_coef < 0)
    fail("z_loss_coef (--z-loss-coef) must be finite and >= 0, got " + std::to_string(z_loss_coef));
  // Each expert's w1, w3, w2 together a multiple of 16 elements: a range of whole experts is then a
  // range a sharding of the unit can split at.
  if (3 * moe_ffn_dim * n_embd % 16 != 0)
    fail("an expert's parameters (3 moe_ffn_dim n_embd = " + std::to_string(3 * moe_ffn_dim * n_embd) +
         ") must be a multiple of 16");
}

int64_t ModelConfig::patch_tokens() const {
  if (patch_f <= 0 || patch_h <= 0 || patch_w <= 0) return 0;
  return (frames / patch_f) * (height / patch_h) * (width / patch_w);
}

// One line naming the field (and its flag) for each refused diffusion-transformer setting.
void ModelConfig::validate_dit() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("model: " + msg); };
  const bool any = frames || height || width || channels || patch_f || patch_h || patch_w || num_classes || cond_drop;
  if (family != Family::dit) {
    if (any)
      fail(std::string("frames, height, width, channels, patch, num_classes and cond_drop are diffusion-transformer "
                       "settings; a ") + to_string(family) + " model has no latents (use a dit model, e.g. --model dit-tiny)");
    return;
  }
  const std::pair<const char*, int64_t> sizes[] = {{"frames", frames}, {"height", height}, {"width", width},
                                                   {"channels", channels}, {"num_classes", num_classes}};
  for (const auto& [name, v] : sizes)
    if (v < 1 || v > (int64_t{1} << 16)) fail(std::string(name) + " must be in [1, 65536], got " + std::to_string(v));
  const std::pair<const char*, int64_t> patch[] = {{"frames", frames}, {"height", height}, {"width", width}};
  const int64_t p[] = {patch_f, patch_h, patch_w};
  for (int i = 0; i < 3; ++i)
    if (p[i] < 1 || patch[i].second % p[i] != 0)
      fail("patch (--patch " + std::to_string(patch_f) + "," + std::to_string(patch_h) + "," + std::to_string(patch_w) +
           "): " + std::to_string(p[i]) + " does not divide " + patch[i].first + " (" + std::to_string(patch[i].second) + ")");
  if (max_seq != patch_tokens())
    fail("max_seq (" + std::to_string(max_seq) + ") must be the patch count (" + std::to_string(patch_tokens()) + ")");
  if (!(cond_drop >= 0 && cond_drop < 1)) fail("cond_drop (--cond-drop) must be in [0, 1), got " + std::to_string(cond_drop));
  if (causal) fail("a dit model's attention is bidirectional (causal must be false)");
  if (n_kv_head != n_head) fail("n_kv_head must equal n_head for dit");
  if (ffn_dim != 4 * n_embd) fail("ffn_dim must be 4 n_embd for dit (its MLP ratio)");
}

DitSample dit_sample(const ModelConfig& c) {
  const int64_t latents = detail::slice(c.latent_values(), 4);
  DitSample s;
  s.latents = 0;
  s.noise = latents;
  s.time = 2 * latents;
  s.label = s.time + 64;
  s.bytes = s.label + 64;
  return s;
}

namespace {

struct Preset {
  ModelConfig config;
  bool own_vocab;  // the real shapes carry their vocabulary; trainable presets take the data's
};

ModelConfig gpt2(int64_t L, int64_t NH, int64_t C, int64_t T) {
  ModelConfig c;
  c.family = Family::gpt2;
  c.n_layer = L, c.n_head = c.n_kv_head = NH, c.n_embd = C, c.ffn_dim = 4 * C, c.max_seq = T;
  return c;
}

ModelConfig llama(int64_t L, int64_t NH, int64_t NKV, int64_t C, int64_t F, int64_t T, double theta, double eps,
                  int64_t V) {
  ModelConfig c;
  c.family = Family::llama;
  c.n_layer = L, c.n_head = NH, c.n_kv_head = NKV, c.n_embd = C, c.ffn_dim = F, c.max_seq = T;
  c.rope_theta = theta, c.norm_eps = eps, c.tie_embeddings = false, c.vocab_size = V;
  return c;
}

ModelConfig moe(ModelConfig c, int64_t E, int64_t k, int64_t FE) {
  c.family = Family::moe;
  c.n_experts = E, c.top_k = k, c.moe_ffn_dim = FE;
  return c;
}

// A DiT over F x H x W x channels latents in patches of pf x ph x pw, adaLN-Zero blocks of width C.
ModelConfig dit(int64_t L, int64_t NH, int64_t C, int64_t F, int64_t H, int64_t W, int64_t channels,
                int64_t pf, int64_t ph, int64_t pw, int64_t classes) {
  ModelConfig c;
  c.family = Family::dit;
  c.n_layer = L, c.n_head = c.n_kv_head = NH, c.n_embd = C, c.ffn_dim = 4 * C;
  c.frames = F, c.height = H, c.width = W, c.channels = channels;
  c.patch_f = pf, c.patch_h = ph, c.patch_w = pw;
  c.num_classes = classes, c.cond_drop = 0.1;
  c.max_seq = c.patch_tokens();
  c.vocab_size = 1;  // no vocabulary: the head predicts latents
  c.tie_embeddings = false, c.causal = false;
  c.norm_eps = 1e-6;  // the DiT paper's LayerNorm
  return c;
}

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> table = [] {
    std::map<std::string, Preset> t;
    t["tiny"] = {gpt2(2, 4, 64, 256), false};
    t["small"] = {gpt2(6, 6, 384, 1024), false};
    t["gpt2-124m"] = {gpt2(12, 12, 768, 1024), false};
    t["llama-tiny"] = {llama(2, 4, 2, 64, 160, 256, 10000, 1e-5, 0), false};
    t["llama-small"] = {llama(6, 6, 2, 384, 1024, 1024, 10000, 1e-5, 0), false};
    t["llama2-7b"] = {llama(32, 32, 32, 4096, 11008, 4096, 10000, 1e-5, 32000), true};
    t["llama2-13b"] = {llama(40, 40, 40, 5120, 13824, 4096, 10000, 1e-5, 32000), true};
    t["llama2-70b"] = {llama(80, 64, 8, 8192, 28672, 4096, 10000, 1e-5, 32000), true};
    t["llama3-8b"] = {llama(32, 32, 8, 4096, 14336, 8192, 500000, 1e-5, 128256), true};
    t["llama3-70b"] = {llama(80, 64, 8, 8192, 28672, 8192, 500000, 1e-5, 128256), true};
    t["llama3.1-8b"] = {llama(32, 32, 8, 4096, 14336, 131072, 500000, 1e-5, 128256), true};
    t["llama3.1-8b"].config.rope_scaling = {8, 1, 4, 8192};
    t["llama3.2-1b"] = {llama(16, 32, 8, 2048, 8192, 131072, 500000, 1e-5, 128256), true};
    t["llama3.2-1b"].config.rope_scaling = {32, 1, 4, 8192};
    t["llama3.2-1b"].config.tie_embeddings = true;
    // Mistral 7B: max_seq its sliding window, within which its attention is full causal attention.
    t["mistral-7b"] = {llama(32, 32, 8, 4096, 14336, 4096, 10000, 1e-5, 32000), true};
    t["moe-tiny"] = {moe(t["llama-tiny"].config, 4, 2, 128), false};
    t["moe-small"] = {moe(t["llama-small"].config, 8, 2, 512), false};
    t["mixtral-8x7b"] = {moe(llama(32, 32, 8, 4096, 14336, 32768, 1e6, 1e-5, 32000), 8, 2, 14336), true};
    t["mixtral-8x22b"] = {moe(llama(56, 48, 8, 6144, 16384, 65536, 1e6, 1e-5, 32000), 8, 2, 16384), true};
    ModelConfig g3 = gpt2(96, 96, 12288, 2048);
    g3.vocab_size = 50257;
    t["gpt3-175b"] = {g3, true};
    t["dit-tiny"] = {dit(2, 4, 64, 1, 16, 16, 4, 1, 2, 2, 10), true};
    return t;
  }();
  return table;
}

}  // namespace

ModelConfig model_preset(const std::string& name, int64_t vocab_size) {
  const auto& t = presets();
  auto it = t.find(name);
  if (it == t.end()) {
    std::string names;
    for (const auto& [n, p] : t) names += (names.empty() ? "" : ", ") + n;
    throw std::invalid_argument("model: unknown preset '" + name + "' (expected " + names + ")");
  }
  ModelConfig c = it->second.config;
  if (!it->second.own_vocab) c.vocab_size = vocab_size;
  return c;
}

bool preset_has_own_vocab(const std::string& name) {
  auto it = presets().find(name);
  return it != presets().end() && it->second.own_vocab;
}

std::vector<int64_t> ParamSpec::exported_shape() const {
  std::vector<int64_t> s = shape;
  if (exported_rows >= 0) s[0] = exported_rows;
  return s;
}

int64_t ParamSpec::exported_numel() const {
  return exported_rows >= 0 ? numel / shape[0] * exported_rows : numel;
}

int64_t UnitCosts::kept_bytes(Recompute mode) const {
  switch (mode) {
    case Recompute::none: return saved_bytes + recomputable_bytes;
    case Recompute::selective:
    case Recompute::selective_op: return saved_bytes;
    case Recompute::full: return 0;
  }
  return 0;
}

double UnitCosts::recompute_flops(Recompute mode) const {
  switch (mode) {
    case Recompute::none: return 0;
    case Recompute::selective: return selective_recompute_flops;
    case Recompute::full: return forward_flops;
    case Recompute::selective_op: return op_recompute_flops;
  }
  return 0;
}

const ParamSpec& UnitDesc::param(const std::string& suffix) const {
  for (const auto& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return p;
  throw std::out_of_range("unit " + name + " has no parameter " + suffix);
}

bool UnitDesc::has_param(const std::string& suffix) const {
  for (const auto& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  return false;
}

int64_t ValueDesc::bytes(const Shape& s, int64_t C) const {
  if (tokens && sample_bytes > 0) return s.B * sample_bytes;
  return tokens ? 2 * detail::slice(s.B * s.T, 4) : detail::slice(s.B * s.T * C, s.elem);
}

ModelDesc describe(const ModelConfig& config) {
  config.validate();
  switch (config.family) {
    case Family::gpt2: return describe_gpt2(config);
    case Family::llama: return describe_llama(config);
    case Family::moe: return describe_moe(config);
    case Family::dit: return describe_dit(config);
  }
  return describe_llama(config);
}

int64_t ModelDesc::num_params() const {
  int64_t n = 0;
  for (const auto& u : units) n += u.numel;
  return n;
}

int64_t ModelDesc::num_params_exported() const {
  int64_t n = 0;
  for (const auto& u : units)
    for (const auto& p : u.params) n += p.exported_numel();
  return n;
}

UnitCosts ModelDesc::costs(int unit, const Shape& s) const {
  const UnitDesc& u = units.at(unit);
  UnitCosts k;
  switch (config.family) {
    case Family::gpt2: k = gpt2_costs(*this, u, s); break;
    case Family::llama: k = llama_costs(*this, u, s); break;
    case Family::moe: k = moe_costs(*this, u, s); break;
    case Family::dit: k = dit_costs(*this, u, s); break;
  }
  detail::add_kernel_scratch(*this, u, s, k);
  return k;
}

double ModelDesc::train_flops(int64_t B, int64_t T) const {
  double f = 0;
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    const UnitCosts c = costs(u, {B, T, 4, 1});
    f += c.forward_flops + c.backward_flops;
  }
  return f;
}

FlatLayout flat_layout(const ModelDesc& desc, int64_t shard_size) {
  const int64_t multiple = 16 * shard_size;
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

namespace detail {

void add_param(UnitDesc& u, std::string name, std::vector<int64_t> shape, bool decay, ParamInit init,
               int64_t exported_rows) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t d : p.shape) p.numel *= d;
  p.offset = u.numel;
  p.decay = decay;
  p.init = init;
  p.exported_rows = exported_rows;
  u.numel += p.numel;
  u.params.push_back(std::move(p));
}

int64_t attention_backward_scratch_floats(int64_t HS, int threads) {
  const int64_t tile = 64;
  return (2 * tile * HS + 2 * tile * tile + tile + tile) * (threads < 1 ? 1 : threads);
}

int64_t head_chunk_rows(int64_t BT) { return BT < 256 ? BT : 256; }

void split_attention_over_context(UnitCosts& k, const Shape& s, int64_t qkv, int64_t C, double qkv_flops) {
  const int64_t BT = s.B * s.T, header = exchange_header_bytes(s.cp);
  auto exchange = [&](int64_t width) {
    const int64_t payload = BT * width * s.elem;
    return Exchange{Split::sequence, header + payload, payload * (s.cp - 1) / s.cp};
  };
  k.exchanges = {exchange(qkv), exchange(C)};
  const double rest = k.forward_flops - qkv_flops - k.attention_flops;
  k.stage_share = {qkv_flops / k.forward_flops, k.attention_flops / k.forward_flops, rest / k.forward_flops};
  k.saved_bytes += slice(BT * C, s.elem);
  k.forward_workspace += slice(BT * qkv, s.elem);
  k.backward_workspace += slice(BT * C, s.elem) + slice(BT * qkv, s.elem);
}

void ring_attention_over_context(UnitCosts& k, const Shape& s, int64_t kv, double qkv_flops) {
  using Route = Exchange::Route;
  const int64_t block = s.B * s.T * kv * s.elem;
  auto step = [&](Route route, int64_t bytes, int after, int forwards) {
    return Exchange{Split::sequence, bytes, bytes, route, after, 0, forwards};
  };
  k.exchanges = {step(Route::none, 0, 1, 0)};
  for (int e = 0; e + 1 < s.cp; ++e) k.exchanges.push_back(step(Route::ring_next, block, 2, e > 0 ? 1 : 0));
  // Every attending stage has the same share: the load-balanced chunks give each (query,
  // key/value) pair of ranks the work of two full chunk-by-chunk products.
  const double attention = k.attention_flops / s.cp, rest = k.forward_flops - qkv_flops - k.attention_flops;
  k.stage_share.assign(s.cp + 1, attention / k.forward_flops);
  k.stage_share.front() = qkv_flops / k.forward_flops;
  k.stage_share.back() += rest / k.forward_flops;
  // The backward (ring_backward_stage): two chains to rank me − 1, each a block a step. Each
  // accumulator leaves after the fold (or compute P) two stages back, so it travels while this
  // rank computes its next block; each key/value block after the first sends on what the chain
  // received two stages back, once the stage three back is done (at most three blocks alive).
  using Role = RingBackwardStage::Role;
  const int P = static_cast<int>(s.cp), S = ring_backward_stage_count(P);
  k.backward_exchanges.assign(S - 1, step(Route::none, 0, 1, 0));
  k.backward_stage_share.assign(S, 0.0);
  for (int b = 0; b < S; ++b) {
    const RingBackwardStage st = ring_backward_stage(b, P);
    if (st.role == Role::compute) k.backward_stage_share[b] = attention + (st.block == P ? rest : 0);
    if (st.role == Role::home) k.backward_stage_share[b] = qkv_flops;
    if (b + 1 == S) continue;  // the first stage: nothing comes in
    if (st.role == Role::home || st.role == Role::fold) {  // block t's accumulator from rank me + 1
      Exchange x = step(Route::ring_prev, block, 2, 0);
      x.written_from = st.block + 1 == P ? 0 : 3;  // compute P's alone; else compute t + 1's, then its fold
      x.carries = "a key/value block's gradient accumulator";
      k.backward_exchanges[b] = x;
    } else if (st.role == Role::compute && st.block > 1 && st.block < P) {  // block t's keys and values
      Exchange x = st.block + 1 == P ? step(Route::ring_prev, block, 2, 0) : step(Route::ring_prev, block, 3, 2);
      x.carries = "a key/value block";
      k.backward_exchanges[b] = x;
    }
  }
  double total = 0;
  for (double v : k.backward_stage_share) total += v;
  for (double& v : k.backward_stage_share) v /= total;
  k.saved_bytes += slice(block / s.elem, s.elem);  // the last key/value block, where the backward starts
}

}  // namespace detail

}  // namespace shardlm::model
