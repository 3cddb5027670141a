#include "layers/gpt2.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu.h"

namespace shardlm::layers {

namespace k = shardlm::kernels;

Dims dims_of(const model::ModelConfig& c, int64_t B, int64_t T) {
  return Dims{B, T, c.n_embd, c.n_head, c.vocab_size, c.padded_vocab()};
}

EmbeddingView embedding_view(const model::UnitDesc& u, float* flat) {
  return {flat + u.param("wte.weight").offset, flat + u.param("wpe.weight").offset};
}

BlockView block_view(const model::UnitDesc& u, float* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("ln_1.weight"),        at("ln_1.bias"),        at("attn.c_attn.weight"), at("attn.c_attn.bias"),
          at("attn.c_proj.weight"), at("attn.c_proj.bias"), at("ln_2.weight"),        at("ln_2.bias"),
          at("mlp.c_fc.weight"),    at("mlp.c_fc.bias"),    at("mlp.c_proj.weight"),  at("mlp.c_proj.bias")};
}

FinalNormView final_norm_view(const model::UnitDesc& u, float* flat) {
  return {flat + u.param("ln_f.weight").offset, flat + u.param("ln_f.bias").offset};
}

// Hands out consecutive, 64-byte aligned slices of one buffer.
namespace {
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <class T>
  T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += (n * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    return p;
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

// Lays out the activations; with base == nullptr it only measures.
template <class Fn>
int64_t carve_activations(char* base, const model::ModelConfig& c, int64_t B, int64_t T, Fn&& per_block,
                          Activations* acts) {
  const int64_t BT = B * T, C = c.n_embd;
  Carver cv(base);
  int32_t* inputs = cv.take<int32_t>(BT);
  int32_t* targets = cv.take<int32_t>(BT);
  float* embedded = cv.take<float>(BT * C);
  for (int l = 0; l < c.n_layer; ++l) {
    BlockActivations a;
    a.ln1 = cv.take<float>(BT * C);
    a.ln1_mean = cv.take<float>(BT);
    a.ln1_rstd = cv.take<float>(BT);
    a.qkv = cv.take<float>(BT * 3 * C);
    a.atty = cv.take<float>(BT * C);
    a.lse = cv.take<float>(B * c.n_head * T);
    a.res1 = cv.take<float>(BT * C);
    a.ln2 = cv.take<float>(BT * C);
    a.ln2_mean = cv.take<float>(BT);
    a.ln2_rstd = cv.take<float>(BT);
    a.fch = cv.take<float>(BT * 4 * C);
    a.fch_gelu = cv.take<float>(BT * 4 * C);
    a.out = cv.take<float>(BT * C);
    per_block(a);
  }
  float* lnf = cv.take<float>(BT * C);
  float* lnf_mean = cv.take<float>(BT);
  float* lnf_rstd = cv.take<float>(BT);
  if (acts) {
    acts->inputs = inputs, acts->targets = targets, acts->embedded = embedded;
    acts->lnf = lnf, acts->lnf_mean = lnf_mean, acts->lnf_rstd = lnf_rstd;
  }
  return cv.used();
}
}  // namespace

Activations::Activations(const model::ModelDesc& desc, int64_t B_, int64_t T_) : B(B_), T(T_) {
  const int64_t bytes = carve_activations(nullptr, desc.config, B, T, [](BlockActivations&) {}, nullptr);
  buffer_ = Buffer(MemCategory::activations, bytes);
  carve_activations(buffer_.as<char>(), desc.config, B, T, [&](BlockActivations& a) { blocks_.push_back(a); },
                    this);
}

BackwardWorkspace::BackwardWorkspace(const model::ModelDesc& desc, int64_t B, int64_t T, int threads) {
  const auto& c = desc.config;
  const int64_t BT = B * T, C = c.n_embd;
  head_chunk = std::min<int64_t>(BT, 256);
  auto carve = [&](char* base) {
    Carver cv(base);
    dresidual = cv.take<float>(BT * C);
    dln = cv.take<float>(BT * C);
    datty = cv.take<float>(BT * C);
    dqkv = cv.take<float>(BT * 3 * C);
    dfch = cv.take<float>(BT * 4 * C);
    dfch_gelu = cv.take<float>(BT * 4 * C);
    attention_scratch = cv.take<float>(k::attention_backward_scratch(B, T, c.n_head, c.head_size(), threads));
    head_scratch = cv.take<float>(k::head_scratch(head_chunk, c.padded_vocab()));
    return cv.used();
  };
  buffer_ = Buffer(MemCategory::workspace, carve(nullptr));
  carve(buffer_.as<char>());
}

void embedding_forward(const EmbeddingView& p, const int32_t* tokens, float* out, const Dims& d) {
  k::embedding_forward(out, tokens, p.wte, p.wpe, d.B, d.T, d.C);
}

void embedding_backward(const EmbeddingView& g, const int32_t* tokens, const float* dout, const Dims& d) {
  k::embedding_backward(g.wte, g.wpe, dout, tokens, d.B, d.T, d.C);
}

void block_forward(const BlockView& p, const float* in, BlockActivations& a, const Dims& d) {
  const int64_t BT = d.BT(), C = d.C;
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, in, p.ln1_w, p.ln1_b, BT, C);
  k::linear_forward(a.qkv, a.ln1, p.qkv_w, p.qkv_b, BT, C, 3 * C);
  k::attention_forward(a.atty, a.lse, a.qkv, d.B, d.T, d.NH, C / d.NH);
  k::linear_forward(a.res1, a.atty, p.proj_w, p.proj_b, BT, C, C);
  k::residual_forward(a.res1, a.res1, in, BT * C);
  k::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, p.ln2_w, p.ln2_b, BT, C);
  k::linear_forward(a.fch, a.ln2, p.fc_w, p.fc_b, BT, C, 4 * C);
  k::gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
  k::linear_forward(a.out, a.fch_gelu, p.fcproj_w, p.fcproj_b, BT, 4 * C, C);
  k::residual_forward(a.out, a.out, a.res1, BT * C);
}

void block_backward(const BlockView& p, const BlockView& g, const float* in, const BlockActivations& a,
                    BackwardWorkspace& ws, const Dims& d) {
  const int64_t BT = d.BT(), C = d.C;
  float* dres = ws.dresidual;  // d out on entry; the residual passes it through unchanged
  std::memset(ws.dfch_gelu, 0, sizeof(float) * BT * 4 * C);
  std::memset(ws.dfch, 0, sizeof(float) * BT * 4 * C);
  std::memset(ws.dln, 0, sizeof(float) * BT * C);
  k::linear_backward(ws.dfch_gelu, g.fcproj_w, g.fcproj_b, dres, a.fch_gelu, p.fcproj_w, BT, 4 * C, C);
  k::gelu_backward(ws.dfch, ws.dfch_gelu, a.fch, BT * 4 * C);
  k::linear_backward(ws.dln, g.fc_w, g.fc_b, ws.dfch, a.ln2, p.fc_w, BT, C, 4 * C);
  k::layernorm_backward(dres, g.ln2_w, g.ln2_b, ws.dln, a.res1, p.ln2_w, a.ln2_mean, a.ln2_rstd, BT, C);
  // dres now holds d res1.
  std::memset(ws.datty, 0, sizeof(float) * BT * C);
  std::memset(ws.dqkv, 0, sizeof(float) * BT * 3 * C);
  std::memset(ws.dln, 0, sizeof(float) * BT * C);
  k::linear_backward(ws.datty, g.proj_w, g.proj_b, dres, a.atty, p.proj_w, BT, C, C);
  k::attention_backward(ws.dqkv, ws.datty, a.qkv, a.atty, a.lse, d.B, d.T, d.NH, C / d.NH, ws.attention_scratch);
  k::linear_backward(ws.dln, g.qkv_w, g.qkv_b, ws.dqkv, a.ln1, p.qkv_w, BT, C, 3 * C);
  k::layernorm_backward(dres, g.ln1_w, g.ln1_b, ws.dln, in, p.ln1_w, a.ln1_mean, a.ln1_rstd, BT, C);
  // dres now holds d in.
}

void final_norm_forward(const FinalNormView& p, const float* in, Activations& acts, const Dims& d) {
  k::layernorm_forward(acts.lnf, acts.lnf_mean, acts.lnf_rstd, in, p.lnf_w, p.lnf_b, d.BT(), d.C);
}

double head_loss(const FinalNormView& p, const EmbeddingView& emb, const float* in, Activations& acts,
                 const Dims& d, BackwardWorkspace& ws, const FinalNormView* g, const EmbeddingView* emb_g,
                 float grad_scale) {
  const int64_t BT = d.BT(), C = d.C;
  if (!g) {
    return k::lm_head_cross_entropy(nullptr, nullptr, acts.lnf, emb.wte, acts.targets, BT, C, d.V, d.Vp, 0.0f,
                                    ws.head_chunk, ws.head_scratch, nullptr);
  }
  std::memset(ws.dln, 0, sizeof(float) * BT * C);
  const double loss = k::lm_head_cross_entropy(ws.dln, emb_g->wte, acts.lnf, emb.wte, acts.targets, BT, C, d.V,
                                               d.Vp, grad_scale, ws.head_chunk, ws.head_scratch, nullptr);
  std::memset(ws.dresidual, 0, sizeof(float) * BT * C);
  k::layernorm_backward(ws.dresidual, g->lnf_w, g->lnf_b, ws.dln, in, p.lnf_w, acts.lnf_mean, acts.lnf_rstd, BT, C);
  return loss;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t hash_name(const std::string& s) {  // FNV-1a: stable across builds and platforms
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}
// A standard normal from one 64-bit draw (Box-Muller on its two 32-bit halves).
float normal_from(uint64_t r) {
  const double u1 = (static_cast<double>(r >> 32) + 1.0) / 4294967297.0;
  const double u2 = static_cast<double>(r & 0xffffffffull) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}
}  // namespace

void init_unit(const model::UnitDesc& u, const model::ModelConfig& cfg, uint64_t seed, float* dst, int64_t begin,
               int64_t end) {
  for (const auto& p : u.params) {
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
    if (lo >= hi) continue;
    // wte rows past the real vocabulary are padding: zero, so they never win a softmax.
    int64_t real = p.numel;
    if (p.name == "wte.weight") real = cfg.vocab_size * cfg.n_embd;
    const uint64_t key = splitmix64(seed ^ hash_name(p.name));
#pragma omp parallel for schedule(static)
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t e = i - p.offset;
      float v = 0.0f;
      if (e < real) v = p.init.std > 0 ? p.init.std * normal_from(splitmix64(key + static_cast<uint64_t>(e))) : p.init.value;
      dst[i - begin] = v;
    }
  }
}

}  // namespace shardlm::layers
