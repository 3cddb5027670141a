// DiT's unit kinds (model/dit.cc describes them): patch embedding of the noised latents, adaLN-Zero
// block, final adaLN layer with the rectified-flow loss. GEMMs and attention go through the
// backend; the per-sample broadcasts (modulation, gates), the affine-free norm, SiLU and the patch
// reshuffles are loops over host memory here, so the family runs on a host backend only (carved()
// refuses another with one line) until a device backend has kernels for them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "layers/layers.h"

namespace shardlm::layers {

namespace {

using model::DitSample;
using model::kDitTimeFeatures;

float* mut(const float* p) { return const_cast<float*>(p); }

struct Dims {
  int64_t B, T, BT, C, NH, HS, F, P;
};
Dims dims(const model::ModelDesc& d, int64_t B, int64_t T) {
  const auto& c = d.config;
  return {B, T, B * T, c.n_embd, c.n_head, c.head_size(), c.ffn_dim, c.patch_values()};
}
Dims dims(const UnitArgs& a) { return dims(*a.desc, a.B, a.T); }

// ---- the batch: B samples laid out as model::DitSample

struct Samples {
  const char* base;
  DitSample at;
  const float* x0(int64_t b) const { return reinterpret_cast<const float*>(base + b * at.bytes + at.latents); }
  const float* noise(int64_t b) const { return reinterpret_cast<const float*>(base + b * at.bytes + at.noise); }
  float time(int64_t b) const { return *reinterpret_cast<const float*>(base + b * at.bytes + at.time); }
  int32_t label(int64_t b) const { return *reinterpret_cast<const int32_t*>(base + b * at.bytes + at.label); }
};
Samples samples(const UnitArgs& a) {
  if (!a.batch) throw std::logic_error("dit: a unit task without its batch");
  return {a.batch, model::dit_sample(a.desc->config)};
}

// ---- patches
// Token (f, h, w) of a sample covers frames f·pf.., rows h·ph.., columns w·pw.. of its (C, F, H, W)
// latents. The patch embedding reads a patch in Conv3d's weight order (c, a, i, j); the final
// linear writes it in (a, i, j, c), the DiT paper's unpatchify order.

// Calls visit(token, in_index, out_index, latent_index) for each value of one sample.
template <class Visit>
void each_patch_value(const model::ModelConfig& c, Visit visit) {
  const int64_t pf = c.patch_f, ph = c.patch_h, pw = c.patch_w, C = c.channels;
  const int64_t nf = c.frames / pf, nh = c.height / ph, nw = c.width / pw;
  for (int64_t f = 0; f < nf; ++f)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t w = 0; w < nw; ++w) {
        const int64_t token = (f * nh + h) * nw + w;
        for (int64_t ch = 0; ch < C; ++ch)
          for (int64_t a = 0; a < pf; ++a)
            for (int64_t i = 0; i < ph; ++i)
              for (int64_t j = 0; j < pw; ++j) {
                const int64_t in = ((ch * pf + a) * ph + i) * pw + j, out = ((a * ph + i) * pw + j) * C + ch;
                const int64_t latent = ((ch * c.frames + f * pf + a) * c.height + h * ph + i) * c.width + w * pw + j;
                visit(token, in, out, latent);
              }
      }
}

// x_t = (1 − t)·x0 + t·noise of every sample, as patches (B·T, P) in the embedding's order.
void noised_patches(const UnitArgs& a, const Dims& d, float* patches) {
  const Samples s = samples(a);
  for (int64_t b = 0; b < d.B; ++b) {
    const float t = s.time(b), *x0 = s.x0(b), *noise = s.noise(b);
    float* row = patches + b * d.T * d.P;
    each_patch_value(a.desc->config, [&](int64_t token, int64_t in, int64_t, int64_t latent) {
      row[token * d.P + in] = (1.0f - t) * x0[latent] + t * noise[latent];
    });
  }
}

// ---- the conditioning (the embedding's parameters, borrowed)

struct CondParams {
  const float *t0_w, *t0_b, *t2_w, *t2_b, *table;
};
template <class P>
CondParams cond_view(const model::UnitDesc& emb, P* flat) {
  auto at = [&](const char* s) { return flat + emb.param(s).offset; };
  return {at("t_embedder.mlp.0.weight"), at("t_embedder.mlp.0.bias"), at("t_embedder.mlp.2.weight"),
          at("t_embedder.mlp.2.bias"), at("y_embedder.embedding_table.weight")};
}

struct Cond {
  float *freq, *h1, *s1, *c, *sc;  // time features (B, 256); MLP pre- and post-SiLU; c; SiLU(c): (B, C)
};
Cond carve_cond(Carver& cv, int64_t B, int64_t C) {
  return {cv.take<float>(B * kDitTimeFeatures), cv.take<float>(B * C), cv.take<float>(B * C), cv.take<float>(B * C),
          cv.take<float>(B * C)};
}
struct CondGrads {
  float *dsc, *dc, *ds1, *dh1;  // (B, C) each
};
CondGrads carve_cond_grads(Carver& cv, int64_t B, int64_t C) {
  return {cv.take<float>(B * C), cv.take<float>(B * C), cv.take<float>(B * C), cv.take<float>(B * C)};
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }
float silu_grad(float x) {
  const float s = 1.0f / (1.0f + std::exp(-x));
  return s * (1.0f + x * (1.0f - s));
}

// DiT's timestep features of t·1000 (the scale its 1000-step schedule had): cos then sin of the
// time at frequencies 10000^(−i/128), in double so that they do not depend on rounding order.
void time_features(float* out, double t) {
  const int64_t half = kDitTimeFeatures / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double arg = t * 1000.0 * std::exp(-std::log(10000.0) * static_cast<double>(i) / static_cast<double>(half));
    out[i] = static_cast<float>(std::cos(arg));
    out[half + i] = static_cast<float>(std::sin(arg));
  }
}

// c = MLP(time features) + the label's row, and SiLU(c), for every sample.
void cond_forward(const UnitArgs& a, const Cond& k, int64_t B, int64_t C) {
  const kernels::Backend& be = *a.backend;
  const CondParams p = cond_view(a.desc->units[a.unit->borrows], a.borrowed_params);
  const Samples s = samples(a);
  for (int64_t b = 0; b < B; ++b) time_features(k.freq + b * kDitTimeFeatures, s.time(b));
  be.linear_forward(k.h1, k.freq, p.t0_w, p.t0_b, B, kDitTimeFeatures, C);
  for (int64_t i = 0; i < B * C; ++i) k.s1[i] = silu(k.h1[i]);
  be.linear_forward(k.c, k.s1, p.t2_w, p.t2_b, B, C, C);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t y = s.label(b);
    if (y < 0 || y > a.desc->config.num_classes)
      throw std::invalid_argument("dit: label " + std::to_string(y) + " is outside [0, num_classes = " +
                                  std::to_string(a.desc->config.num_classes) + "] (num_classes: the null class)");
    for (int64_t j = 0; j < C; ++j) k.c[b * C + j] += p.table[y * C + j];
  }
  for (int64_t i = 0; i < B * C; ++i) k.sc[i] = silu(k.c[i]);
}

// From d SiLU(c) (g.dsc) into the borrowed embedding's gradients: the label's row and the MLP.
void cond_backward(const UnitArgs& a, const Cond& k, const CondGrads& g, int64_t B, int64_t C) {
  const kernels::Backend& be = *a.backend;
  const model::UnitDesc& emb = a.desc->units[a.unit->borrows];
  const CondParams p = cond_view(emb, a.borrowed_params);
  const CondParams dp = cond_view(emb, a.borrowed_grads);
  const Samples s = samples(a);
  for (int64_t i = 0; i < B * C; ++i) g.dc[i] = g.dsc[i] * silu_grad(k.c[i]);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < C; ++j) mut(dp.table)[s.label(b) * C + j] += g.dc[b * C + j];
  be.zero(g.ds1, sizeof(float) * B * C);
  be.linear_backward(g.ds1, mut(dp.t2_w), mut(dp.t2_b), g.dc, k.s1, p.t2_w, B, C, C);
  for (int64_t i = 0; i < B * C; ++i) g.dh1[i] = g.ds1[i] * silu_grad(k.h1[i]);
  be.linear_backward(nullptr, mut(dp.t0_w), mut(dp.t0_b), g.dh1, k.freq, p.t0_w, B, kDitTimeFeatures, C);
}

// ---- pointwise pieces over (B, T, C) rows, one modulation row per sample

// LayerNorm without affine: out = (x − mean) · rstd.
void norm_forward(float* out, float* mean, float* rstd, const float* x, int64_t N, int64_t C, double eps) {
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x + r * C;
    double m = 0, v = 0;
    for (int64_t j = 0; j < C; ++j) m += xr[j];
    m /= static_cast<double>(C);
    for (int64_t j = 0; j < C; ++j) v += (xr[j] - m) * (xr[j] - m);
    v /= static_cast<double>(C);
    const double s = 1.0 / std::sqrt(v + eps);
    for (int64_t j = 0; j < C; ++j) out[r * C + j] = static_cast<float>((xr[j] - m) * s);
    mean[r] = static_cast<float>(m), rstd[r] = static_cast<float>(s);
  }
}

// dx += rstd · (dn − mean(dn) − n · mean(dn · n)), n the norm's output.
void norm_backward(float* dx, const float* dn, const float* n, const float* rstd, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r) {
    const float *g = dn + r * C, *nr = n + r * C;
    double sg = 0, sgn = 0;
    for (int64_t j = 0; j < C; ++j) sg += g[j], sgn += static_cast<double>(g[j]) * nr[j];
    const double mg = sg / static_cast<double>(C), mgn = sgn / static_cast<double>(C);
    for (int64_t j = 0; j < C; ++j) dx[r * C + j] += static_cast<float>(rstd[r] * (g[j] - mg - nr[j] * mgn));
  }
}

// m = n · (1 + scale) + shift, scale and shift rows of `mod` (stride ld) per sample.
void modulate(float* m, const float* n, const float* shift, const float* scale, int64_t ld, const Dims& d) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t) {
      const int64_t r = (b * d.T + t) * d.C;
      for (int64_t j = 0; j < d.C; ++j) m[r + j] = n[r + j] * (1.0f + scale[b * ld + j]) + shift[b * ld + j];
    }
}

// From d m: d n = d m · (1 + scale) and the rows' sums into d shift and d scale (stride ld).
void modulate_backward(float* dn, float* dshift, float* dscale, const float* dm, const float* n, const float* scale,
                       int64_t ld, const Dims& d) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < d.C; ++j) {
      double sh = 0, sc = 0;
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t i = (b * d.T + t) * d.C + j;
        sh += dm[i], sc += static_cast<double>(dm[i]) * n[i];
        dn[i] = dm[i] * (1.0f + scale[b * ld + j]);
      }
      dshift[b * ld + j] = static_cast<float>(sh), dscale[b * ld + j] = static_cast<float>(sc);
    }
}

// out = x + gate · y, gate a row per sample.
void gated_residual(float* out, const float* x, const float* gate, const float* y, int64_t ld, const Dims& d) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t) {
      const int64_t r = (b * d.T + t) * d.C;
      for (int64_t j = 0; j < d.C; ++j) out[r + j] = x[r + j] + gate[b * ld + j] * y[r + j];
    }
}

// From d out: d y = d out · gate, d gate = Σ_t d out · y (d x is d out itself).
void gated_residual_backward(float* dy, float* dgate, const float* dout, const float* gate, const float* y, int64_t ld,
                             const Dims& d) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j = 0; j < d.C; ++j) {
      double s = 0;
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t i = (b * d.T + t) * d.C + j;
        s += static_cast<double>(dout[i]) * y[i];
        dy[i] = dout[i] * gate[b * ld + j];
      }
      dgate[b * ld + j] = static_cast<float>(s);
    }
}

void refuse_device(const kernels::Backend& be) {
  if (!be.host_memory())
    throw std::invalid_argument(std::string("dit: the dit family runs on a host backend for now (its modulation and "
                                            "patch loops read host memory); the ") + be.name() + " backend is not one");
}

// ---- embedding

struct Embedding {
  const float *w, *b, *pos;  // (P, C), (C), (T, C)
};
template <class P>
Embedding embedding_view(const model::UnitDesc& u, P* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("x_embedder.proj.weight"), at("x_embedder.proj.bias"), at("pos_embed")};
}

void embedding_forward(const UnitArgs& a) {
  const Dims d = dims(a);
  const Embedding p = embedding_view(*a.unit, a.params);
  float* patches = reinterpret_cast<float*>(a.forward_ws);
  noised_patches(a, d, patches);
  a.backend->linear_forward(a.out, patches, p.w, p.b, d.BT, d.P, d.C);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t i = 0; i < d.T * d.C; ++i) a.out[b * d.T * d.C + i] += p.pos[i];
}

void embedding_backward(const UnitArgs& a) {
  const Dims d = dims(a);
  const Embedding g = embedding_view(*a.unit, a.grads);
  float* patches = reinterpret_cast<float*>(a.backward_ws);
  noised_patches(a, d, patches);
  a.backend->linear_backward(nullptr, mut(g.w), mut(g.b), a.dx, patches, nullptr, d.BT, d.P, d.C);
  for (int64_t i = 0; i < d.T * d.C; ++i) {
    double s = 0;
    for (int64_t b = 0; b < d.B; ++b) s += a.dx[b * d.T * d.C + i];
    mut(g.pos)[i] += static_cast<float>(s);
  }
}

Carved embedding_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                        const model::Shape& shape) {
  refuse_device(be);
  const Dims d = dims(desc, shape.B, shape.T);
  Carver cv(nullptr);
  cv.take<float>(d.BT * d.P);
  return {0, 0, cv.used(), cv.used()};
}

// ---- block

struct Block {
  const float *ada_w, *ada_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
};
template <class P>
Block block_view(const model::UnitDesc& u, P* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("adaLN_modulation.1.weight"), at("adaLN_modulation.1.bias"), at("attn.qkv.weight"), at("attn.qkv.bias"),
          at("attn.proj.weight"),          at("attn.proj.bias"),          at("mlp.fc1.weight"),  at("mlp.fc1.bias"),
          at("mlp.fc2.weight"),            at("mlp.fc2.bias")};
}

// The modulation row of a sample: shift, scale, gate of the attention, then of the MLP.
enum Mod { shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp };

struct Saved {
  float* mod;                         // (B, 6C)
  float *mean1, *rstd1, *n1, *m1;     // norm 1 and its modulated output
  float *qkv, *att, *lse, *o, *x1;    // attention, its projection, the first residual
  float *mean2, *rstd2, *n2, *m2;     // norm 2 and its modulated output
  float *h, *g, *y;                   // fc1 out, GELU out, fc2 out
};
Saved carve_saved(Carver& cv, const Dims& d) {
  Saved s;
  s.mod = cv.take<float>(d.B * 6 * d.C);
  s.mean1 = cv.take<float>(d.BT), s.rstd1 = cv.take<float>(d.BT);
  s.n1 = cv.take<float>(d.BT * d.C), s.m1 = cv.take<float>(d.BT * d.C);
  s.mean2 = cv.take<float>(d.BT), s.rstd2 = cv.take<float>(d.BT);
  s.n2 = cv.take<float>(d.BT * d.C), s.m2 = cv.take<float>(d.BT * d.C);
  s.qkv = cv.take<float>(d.BT * 3 * d.C);
  s.att = cv.take<float>(d.BT * d.C);
  s.lse = cv.take<float>(d.B * d.NH * d.T);
  s.o = cv.take<float>(d.BT * d.C);
  s.x1 = cv.take<float>(d.BT * d.C);
  s.h = cv.take<float>(d.BT * d.F), s.g = cv.take<float>(d.BT * d.F);
  s.y = cv.take<float>(d.BT * d.C);
  return s;
}

struct BlockGrads {
  float* dmod;                  // (B, 6C)
  float *dy, *dm, *dn, *dproj;  // (B, T, C): d fc2 out, d modulated input, d norm out, d projection out
  float *dg, *dh;               // (B, T, F): d GELU out, d fc1 out
  float *datt, *dqkv, *attention;
};
BlockGrads carve_block_grads(const kernels::Backend& be, Carver& cv, const Dims& d, int threads) {
  BlockGrads w;
  w.dmod = cv.take<float>(d.B * 6 * d.C);
  w.dy = cv.take<float>(d.BT * d.C), w.dm = cv.take<float>(d.BT * d.C), w.dn = cv.take<float>(d.BT * d.C);
  w.dproj = cv.take<float>(d.BT * d.C);
  w.dg = cv.take<float>(d.BT * d.F), w.dh = cv.take<float>(d.BT * d.F);
  w.datt = cv.take<float>(d.BT * d.C);
  w.dqkv = cv.take<float>(d.BT * 3 * d.C);
  w.attention = cv.take<float>(be.attention_backward_scratch(d.B, d.T, d.NH, d.NH, d.HS, threads));
  return w;
}

// The block's forward into `s`, and into a.out when `out` (a full recompute rebuilds `s` only).
void block_pass(const UnitArgs& a, const Saved& s, bool out) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  const double eps = a.desc->config.norm_eps;
  Carver cw(a.forward_ws);
  const Cond k = carve_cond(cw, d.B, d.C);
  cond_forward(a, k, d.B, d.C);
  const int64_t ld = 6 * d.C;
  const auto mod = [&](Mod m) { return s.mod + m * d.C; };
  be.linear_forward(s.mod, k.sc, p.ada_w, p.ada_b, d.B, d.C, ld);
  norm_forward(s.n1, s.mean1, s.rstd1, a.in, d.BT, d.C, eps);
  modulate(s.m1, s.n1, mod(shift_msa), mod(scale_msa), ld, d);
  be.linear_forward(s.qkv, s.m1, p.qkv_w, p.qkv_b, d.BT, d.C, 3 * d.C);
  be.attention_forward(s.att, s.lse, s.qkv, d.B, d.T, d.NH, d.NH, d.HS, false);
  be.linear_forward(s.o, s.att, p.proj_w, p.proj_b, d.BT, d.C, d.C);
  gated_residual(s.x1, a.in, mod(gate_msa), s.o, ld, d);
  norm_forward(s.n2, s.mean2, s.rstd2, s.x1, d.BT, d.C, eps);
  modulate(s.m2, s.n2, mod(shift_mlp), mod(scale_mlp), ld, d);
  be.linear_forward(s.h, s.m2, p.fc1_w, p.fc1_b, d.BT, d.C, d.F);
  be.gelu_forward(s.g, s.h, d.BT * d.F);
  be.linear_forward(s.y, s.g, p.fc2_w, p.fc2_b, d.BT, d.F, d.C);
  if (out) gated_residual(a.out, s.x1, mod(gate_mlp), s.y, ld, d);
}

void block_forward(const UnitArgs& a) {
  Carver cs(a.saved);
  block_pass(a, carve_saved(cs, dims(a)), true);
}

// Everything the backward reads is saved: selective rebuilds nothing, full reruns the pass.
void block_recompute(const UnitArgs& a, model::Recompute mode) {
  if (mode != model::Recompute::full) return;
  Carver cs(a.saved);
  block_pass(a, carve_saved(cs, dims(a)), false);
}

void block_backward(const UnitArgs& a) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  const Block g = block_view(*a.unit, a.grads);
  Carver cs(a.saved), cw(a.backward_ws);
  const Saved s = carve_saved(cs, d);
  const Cond k = carve_cond(cw, d.B, d.C);
  const CondGrads kg = carve_cond_grads(cw, d.B, d.C);
  const BlockGrads w = carve_block_grads(be, cw, d, a.threads);
  cond_forward(a, k, d.B, d.C);
  const int64_t ld = 6 * d.C, BT = d.BT, C = d.C, F = d.F;
  const auto mod = [&](Mod m) { return s.mod + m * C; };
  const auto dmod = [&](Mod m) { return w.dmod + m * C; };
  float* dx = a.dx;  // d out on entry; the residuals pass it through to d x1, then to d in
  // The MLP half.
  gated_residual_backward(w.dy, dmod(gate_mlp), dx, mod(gate_mlp), s.y, ld, d);
  be.zero(w.dg, sizeof(float) * BT * F);
  be.linear_backward(w.dg, mut(g.fc2_w), mut(g.fc2_b), w.dy, s.g, p.fc2_w, BT, F, C);
  be.zero(w.dh, sizeof(float) * BT * F);  // GELU's backward adds into it
  be.gelu_backward(w.dh, w.dg, s.h, BT * F);
  be.zero(w.dm, sizeof(float) * BT * C);
  be.linear_backward(w.dm, mut(g.fc1_w), mut(g.fc1_b), w.dh, s.m2, p.fc1_w, BT, C, F);
  modulate_backward(w.dn, dmod(shift_mlp), dmod(scale_mlp), w.dm, s.n2, mod(scale_mlp), ld, d);
  norm_backward(dx, w.dn, s.n2, s.rstd2, BT, C);
  // The attention half.
  gated_residual_backward(w.dproj, dmod(gate_msa), dx, mod(gate_msa), s.o, ld, d);
  be.zero(w.datt, sizeof(float) * BT * C);
  be.linear_backward(w.datt, mut(g.proj_w), mut(g.proj_b), w.dproj, s.att, p.proj_w, BT, C, C);
  be.zero(w.dqkv, sizeof(float) * BT * 3 * C);
  be.attention_backward(w.dqkv, w.datt, s.qkv, s.att, s.lse, d.B, d.T, d.NH, d.NH, d.HS, w.attention, false);
  be.zero(w.dm, sizeof(float) * BT * C);
  be.linear_backward(w.dm, mut(g.qkv_w), mut(g.qkv_b), w.dqkv, s.m1, p.qkv_w, BT, C, 3 * C);
  modulate_backward(w.dn, dmod(shift_msa), dmod(scale_msa), w.dm, s.n1, mod(scale_msa), ld, d);
  norm_backward(dx, w.dn, s.n1, s.rstd1, BT, C);
  // The modulation and the conditioning it came from.
  be.zero(kg.dsc, sizeof(float) * d.B * C);
  be.linear_backward(kg.dsc, mut(g.ada_w), mut(g.ada_b), w.dmod, k.sc, p.ada_w, d.B, C, ld);
  cond_backward(a, k, kg, d.B, C);
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  refuse_device(be);
  const Dims d = dims(desc, shape.B, shape.T);
  Carver cs(nullptr), cf(nullptr), cw(nullptr);
  carve_saved(cs, d);
  carve_cond(cf, d.B, d.C);
  carve_cond(cw, d.B, d.C);
  carve_cond_grads(cw, d.B, d.C);
  carve_block_grads(be, cw, d, shape.threads);
  return {cs.used(), 0, cf.used(), cw.used()};
}

// ---- final layer and the rectified-flow loss

struct HeadWs {
  Cond cond;
  float* mod;                // (B, 2C): shift, scale
  float *mean, *rstd, *n, *m;
  float* pred;               // (B·T, P) by patch
  float* latents;            // (B, latent values): the prediction as latents
};
HeadWs carve_head_ws(Carver& cv, const Dims& d, int64_t latent_values) {
  HeadWs w;
  w.cond = carve_cond(cv, d.B, d.C);
  w.mod = cv.take<float>(d.B * 2 * d.C);
  w.mean = cv.take<float>(d.BT), w.rstd = cv.take<float>(d.BT);
  w.n = cv.take<float>(d.BT * d.C), w.m = cv.take<float>(d.BT * d.C);
  w.pred = cv.take<float>(d.BT * d.P);
  w.latents = cv.take<float>(d.B * latent_values);
  return w;
}
struct HeadGrads {
  float *dpred, *dm, *dn, *dmod;
  CondGrads cond;
};
HeadGrads carve_head_grads(Carver& cv, const Dims& d) {
  HeadGrads g;
  g.dpred = cv.take<float>(d.BT * d.P);
  g.dm = cv.take<float>(d.BT * d.C), g.dn = cv.take<float>(d.BT * d.C);
  g.dmod = cv.take<float>(d.B * 2 * d.C);
  g.cond = carve_cond_grads(cv, d.B, d.C);
  return g;
}

// Σ over every value of (prediction − (noise − x0))², over P (a sum over tokens of each token's
// mean: the trainer's 1 / tokens makes it the mean over values); in training d prediction by
// patch into `dpred`, scaled by grad_scale.
double flow_loss(const UnitArgs& a, const Dims& d, const HeadWs& w, float* dpred) {
  const Samples s = samples(a);
  const model::ModelConfig& c = a.desc->config;
  const int64_t L = c.latent_values();
  const double per_value = 1.0 / static_cast<double>(d.P);
  double loss = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    const float *x0 = s.x0(b), *noise = s.noise(b), *pred = w.latents + b * L;
    for (int64_t i = 0; i < L; ++i) {
      const double e = static_cast<double>(pred[i]) - (static_cast<double>(noise[i]) - x0[i]);
      loss += e * e;
    }
    if (!dpred) continue;
    const float k = static_cast<float>(2.0 * per_value * a.grad_scale);
    float* row = dpred + b * d.T * d.P;
    each_patch_value(c, [&](int64_t token, int64_t, int64_t out, int64_t latent) {
      row[token * d.P + out] = k * (pred[latent] - (noise[latent] - x0[latent]));
    });
  }
  return loss * per_value;
}

double head(const UnitArgs& a, HeadMode mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const model::ModelConfig& c = a.desc->config;
  const float* ada_w = a.params + a.unit->param("adaLN_modulation.1.weight").offset;
  const float* ada_b = a.params + a.unit->param("adaLN_modulation.1.bias").offset;
  const float* lin_w = a.params + a.unit->param("linear.weight").offset;
  const float* lin_b = a.params + a.unit->param("linear.bias").offset;
  Carver cv(a.forward_ws);
  const HeadWs w = carve_head_ws(cv, d, c.latent_values());
  cond_forward(a, w.cond, d.B, d.C);
  be.linear_forward(w.mod, w.cond.sc, ada_w, ada_b, d.B, d.C, 2 * d.C);
  norm_forward(w.n, w.mean, w.rstd, a.in, d.BT, d.C, c.norm_eps);
  modulate(w.m, w.n, w.mod, w.mod + d.C, 2 * d.C, d);
  be.linear_forward(w.pred, w.m, lin_w, lin_b, d.BT, d.C, d.P);
  const int64_t L = c.latent_values();
  for (int64_t b = 0; b < d.B; ++b) {
    const float* row = w.pred + b * d.T * d.P;
    float* lat = w.latents + b * L;
    each_patch_value(c, [&](int64_t token, int64_t, int64_t out, int64_t latent) { lat[latent] = row[token * d.P + out]; });
  }
  if (mode == HeadMode::logits) {  // the predicted velocity, as latents (B, C, F, H, W)
    if (a.logits) std::memcpy(a.logits, w.latents, sizeof(float) * d.B * L);
    return 0;
  }
  if (mode == HeadMode::loss) return flow_loss(a, d, w, nullptr);
  Carver cb(a.backward_ws);
  const HeadGrads g = carve_head_grads(cb, d);
  const double loss = flow_loss(a, d, w, g.dpred);
  float* dada_w = a.grads + a.unit->param("adaLN_modulation.1.weight").offset;
  float* dada_b = a.grads + a.unit->param("adaLN_modulation.1.bias").offset;
  float* dlin_w = a.grads + a.unit->param("linear.weight").offset;
  float* dlin_b = a.grads + a.unit->param("linear.bias").offset;
  be.zero(g.dm, sizeof(float) * d.BT * d.C);
  be.linear_backward(g.dm, dlin_w, dlin_b, g.dpred, w.m, lin_w, d.BT, d.C, d.P);
  modulate_backward(g.dn, g.dmod, g.dmod + d.C, g.dm, w.n, w.mod + d.C, 2 * d.C, d);
  be.zero(a.dx, sizeof(float) * d.BT * d.C);
  norm_backward(a.dx, g.dn, w.n, w.rstd, d.BT, d.C);
  be.zero(g.cond.dsc, sizeof(float) * d.B * d.C);
  be.linear_backward(g.cond.dsc, dada_w, dada_b, g.dmod, w.cond.sc, ada_w, d.B, d.C, 2 * d.C);
  cond_backward(a, w.cond, g.cond, d.B, d.C);
  return loss;
}

Carved head_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                   const model::Shape& shape) {
  refuse_device(be);
  const Dims d = dims(desc, shape.B, shape.T);
  Carver cv(nullptr), cb(nullptr);
  carve_head_ws(cv, d, desc.config.latent_values());
  carve_head_grads(cb, d);
  return {0, 0, cv.used(), cb.used()};
}

}  // namespace

LayerKind dit_embedding_kind() {
  LayerKind k;
  k.forward = embedding_forward;
  k.backward = embedding_backward;
  k.carved = embedding_carved;
  return k;
}

LayerKind dit_block_kind() {
  LayerKind k;
  k.forward = block_forward;
  k.recompute = block_recompute;
  k.backward = block_backward;
  k.carved = block_carved;
  return k;
}

LayerKind dit_head_kind() {
  LayerKind k;
  k.head = head;
  k.carved = head_carved;
  return k;
}

}  // namespace shardlm::layers
