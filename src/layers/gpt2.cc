// GPT-2's unit kinds: token + position embedding, pre-LN block, final layer norm + tied head.
#include <algorithm>
#include <cstring>

#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "layers/context.h"
#include "layers/layers.h"

namespace shardlm::layers {

namespace {

struct Embedding {
  const float *wte, *wpe;  // (Vp, C), (maxT, C)
};
Embedding embedding_view(const model::UnitDesc& u, const float* flat) {
  return {flat + u.param("wte.weight").offset, flat + u.param("wpe.weight").offset};
}

struct Block {
  const float *ln1_w, *ln1_b;        // (C)
  const float *qkv_w, *qkv_b;        // (C, 3C), (3C)
  const float *proj_w, *proj_b;      // (C, C), (C)
  const float *ln2_w, *ln2_b;        // (C)
  const float *fc_w, *fc_b;          // (C, F), (F)
  const float *fcproj_w, *fcproj_b;  // (F, C), (C)
};
// The same view over parameters or gradients (identical layout).
template <class P>
Block block_view(const model::UnitDesc& u, P* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("ln_1.weight"),        at("ln_1.bias"),        at("attn.c_attn.weight"), at("attn.c_attn.bias"),
          at("attn.c_proj.weight"), at("attn.c_proj.bias"), at("ln_2.weight"),        at("ln_2.bias"),
          at("mlp.c_fc.weight"),    at("mlp.c_fc.bias"),    at("mlp.c_proj.weight"),  at("mlp.c_proj.bias")};
}
float* mut(const float* p) { return const_cast<float*>(p); }

struct Dims {
  int64_t B, T, BT, C, NH, HS, F;
  int64_t P = 1;  // ranks each sequence is split over (T of its T·P positions here)
  bool ring = false;  // split as a ring (else heads split by an all-to-all)
  // --act-quant: the group of the saved / recomputable buffers' GEMM inputs (0: fp32).
  int64_t gs = 0, gr = 0;
  bool heads_split() const { return P > 1 && !ring; }
  int64_t wide() const { return BT * std::max(3 * C, F); }  // q|k|v or GELU out
};
Dims dims(const UnitArgs& a) {
  const auto& c = a.desc->config;
  return {a.B, a.T, a.B * a.T, c.n_embd, c.n_head, c.head_size(), c.ffn_dim, a.cp,
          a.cp > 1 && a.cp_impl == model::ContextImpl::ring,
          a.act_quant.saved_int8(a.recompute) ? a.act_quant.group : 0,
          a.act_quant.recomputable_int8(a.recompute) ? a.act_quant.group : 0};
}
Dims dims(const model::ModelDesc& d, const model::Shape& s) {
  const auto& c = d.config;
  return {s.B, s.T, s.B * s.T, c.n_embd, c.n_head, c.head_size(), c.ffn_dim, s.cp,
          s.cp > 1 && s.cp_impl == model::ContextImpl::ring,
          s.act_quant.saved_int8(s.recompute) ? s.act_quant.group : 0,
          s.act_quant.recomputable_int8(s.recompute) ? s.act_quant.group : 0};
}

// Kept for the backward: GEMM outputs and attention statistics.
struct Saved {
  Kept qkv;     // (B, T, 3C)
  Kept atty;    // (B, T, C) attention output before the projection
  float* lse;   // (B, NH, T)
  float* res1;  // (B, T, C) residual after attention
  float* fch;   // (B, T, F) before GELU
  float* out_split = nullptr;  // heads split over cp: this rank's heads' attention output (B, T·P, C / P)
  float* kv_last = nullptr;    // a ring: the last key/value block the forward attended to (B, T, 2C)
};
Saved carve_saved(Carver& cv, const Dims& d) {
  Saved s;
  s.qkv = take_kept(cv, d.BT * 3 * d.C, d.gs);
  s.atty = take_kept(cv, d.BT * d.C, d.gs);
  s.lse = cv.take<float>(d.B * d.NH * d.T);
  s.res1 = cv.take<float>(d.BT * d.C);
  s.fch = cv.take<float>(d.BT * d.F);
  if (d.heads_split()) s.out_split = cv.take<float>(d.BT * d.C);
  if (d.ring) s.kv_last = cv.take<float>(d.BT * 2 * d.C);
  return s;
}
// Norms and pointwise activations: recomputed under selective recompute.
struct Recomputable {
  Kept ln1;                    // (B, T, C)
  float *ln1_mean, *ln1_rstd;  // (B, T), (B, T)
  Kept ln2;
  float *ln2_mean, *ln2_rstd;
  Kept fch_gelu;  // (B, T, F)
};
Recomputable carve_recomputable(Carver& cv, const Dims& d) {
  Recomputable r;
  r.ln1 = take_kept(cv, d.BT * d.C, d.gr);
  r.ln1_mean = cv.take<float>(d.BT);
  r.ln1_rstd = cv.take<float>(d.BT);
  r.ln2 = take_kept(cv, d.BT * d.C, d.gr);
  r.ln2_mean = cv.take<float>(d.BT);
  r.ln2_rstd = cv.take<float>(d.BT);
  r.fch_gelu = take_kept(cv, d.BT * d.F, d.gr);
  return r;
}
// --act-quant: the forward's fp32 forms of the compressed values, in two scratch slices. A norm's
// output, the attention output and the second norm's output take turns in the first (each is
// stored before the next is written), q|k|v and the GELU output in the second.
void carve_quant_forward(Carver& cv, const Dims& d, Saved& s, Recomputable& r) {
  if (d.gs == 0) return;
  float* narrow = cv.take<float>(d.BT * d.C);
  float* wide = cv.take<float>(d.wide());
  s.qkv.f = wide, s.atty.f = narrow;
  if (d.gr > 0) r.ln1.f = narrow, r.ln2.f = narrow, r.fch_gelu.f = wide;
}
struct BackwardWs {
  float *dln, *datty, *dqkv, *dfch, *dfch_gelu, *attention;
  float *dout_split = nullptr, *dqkv_split = nullptr;  // split over cp: the head split's gradients
  // --act-quant: dequantized GEMM inputs, one at a time in `wide`, the attention output in
  // `narrow` (attention's backward reads it with q|k|v).
  float *wide = nullptr, *narrow = nullptr;
};
BackwardWs carve_backward_ws(const kernels::Backend& be, Carver& cv, const Dims& d, int threads) {
  BackwardWs w;
  w.dln = cv.take<float>(d.BT * d.C);
  w.datty = cv.take<float>(d.BT * d.C);
  w.dqkv = cv.take<float>(d.BT * 3 * d.C);
  w.dfch = cv.take<float>(d.BT * d.F);
  w.dfch_gelu = cv.take<float>(d.BT * d.F);
  w.attention = cv.take<float>(be.attention_backward_scratch(d.B, d.T, d.NH, d.NH, d.HS, threads));
  if (d.heads_split()) {
    w.dout_split = cv.take<float>(d.BT * d.C);
    w.dqkv_split = cv.take<float>(d.BT * 3 * d.C);
  }
  if (d.gs > 0) {
    w.wide = cv.take<float>(d.wide());
    w.narrow = cv.take<float>(d.BT * d.C);
  }
  return w;
}
// Split over cp: this rank's rows' q|k|v before they go to the head split.
float* carve_forward_ws(Carver& cv, const Dims& d) { return d.heads_split() ? cv.take<float>(d.BT * 3 * d.C) : nullptr; }

// ---- embedding

// Each chunk of this rank's rows takes the position embeddings of its positions in the sequence.
void embedding_forward(const UnitArgs& a) {
  const auto p = embedding_view(*a.unit, a.params);
  const int64_t C = a.desc->config.n_embd;
  const context::Positions pos = context::positions(a);
  if (pos.starts.size() == 1)
    return a.backend->embedding_forward(a.out, a.tokens, p.wte, p.wpe + pos.starts[0] * C, a.B, a.T, C);
  for (int64_t b = 0; b < a.B; ++b)
    for (size_t c = 0; c < pos.starts.size(); ++c) {
      const int64_t row = b * a.T + static_cast<int64_t>(c) * pos.rows;
      a.backend->embedding_forward(a.out + row * C, a.tokens + row, p.wte, p.wpe + pos.starts[c] * C, 1, pos.rows, C);
    }
}

void embedding_backward(const UnitArgs& a) {
  const auto g = embedding_view(*a.unit, a.grads);
  const int64_t C = a.desc->config.n_embd;
  const context::Positions pos = context::positions(a);
  if (pos.starts.size() == 1)
    return a.backend->embedding_backward(mut(g.wte), mut(g.wpe) + pos.starts[0] * C, a.dx, a.tokens, a.B, a.T, C);
  for (int64_t b = 0; b < a.B; ++b)
    for (size_t c = 0; c < pos.starts.size(); ++c) {
      const int64_t row = b * a.T + static_cast<int64_t>(c) * pos.rows;
      a.backend->embedding_backward(mut(g.wte), mut(g.wpe) + pos.starts[c] * C, a.dx + row * C, a.tokens + row, 1,
                                    pos.rows, C);
    }
}

Carved embedding_carved(const kernels::Backend&, const model::ModelDesc&, const model::UnitDesc&, const model::Shape&) {
  return {};
}

// ---- block

// From the attention output to the MLP's output projection's input: projection, residual, norm,
// fc, GELU.
// Under --act-quant each compressed value is stored right after its last fp32 reader has run (the
// forward computes in fp32, so its output and the loss are those of an uncompressed run).
void mlp_input_forward(const UnitArgs& a, const Block& p, const float* in, const Saved& s, const Recomputable& r,
                       const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.linear_forward(s.res1, s.atty.f, p.proj_w, p.proj_b, d.BT, d.C, d.C);
  be.residual_forward(s.res1, s.res1, in, d.BT * d.C);
  be.layernorm_forward(r.ln2.f, r.ln2_mean, r.ln2_rstd, s.res1, p.ln2_w, p.ln2_b, d.BT, d.C);
  store(a, r.ln2, "ln_2");
  be.linear_forward(s.fch, r.ln2.f, p.fc_w, p.fc_b, d.BT, d.C, d.F);
  be.gelu_forward(r.fch_gelu.f, s.fch, d.BT * d.F);
  store(a, r.fch_gelu, "gelu");
}

void mlp_out_forward(const kernels::Backend& be, const Block& p, const UnitArgs& a, const Saved& s,
                     const Recomputable& r, const Dims& d) {
  be.linear_forward(a.out, r.fch_gelu.f, p.fcproj_w, p.fcproj_b, d.BT, d.F, d.C);
  be.residual_forward(a.out, a.out, s.res1, d.BT * d.C);
}

// The block's forward up to (and without) the MLP's output projection: what a full recompute
// reruns, with the same kernels on the same inputs, so the backward sees bitwise the same values.
void block_forward_until_mlp_out(const UnitArgs& a, const Block& p, const float* in, const Saved& s,
                                 const Recomputable& r, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.layernorm_forward(r.ln1.f, r.ln1_mean, r.ln1_rstd, in, p.ln1_w, p.ln1_b, d.BT, d.C);
  store(a, r.ln1, "ln_1");
  be.linear_forward(s.qkv.f, r.ln1.f, p.qkv_w, p.qkv_b, d.BT, d.C, 3 * d.C);
  be.attention_forward(s.atty.f, s.lse, s.qkv.f, d.B, d.T, d.NH, d.NH, d.HS, a.desc->config.causal);
  store(a, s.qkv, "qkv");
  store(a, s.atty, "attn");
  mlp_input_forward(a, p, in, s, r, d);
}

// One stage of a pass split over cp (context.h); `out`: through the MLP's output projection (a
// forward, not a full recompute).
void split_forward_stage(const UnitArgs& a, bool out) {
  if (a.stage < 0) throw std::logic_error("gpt2 block: a pass over " + std::to_string(a.cp) + " cp ranks runs as stages");
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  Saved s = carve_saved(cs, d);
  Recomputable r = carve_recomputable(cr, d);
  float* qkv = carve_forward_ws(cw, d);
  // --act-quant: the forward scratch lives from the first stage to the last (plan/'s add_stages),
  // so q|k|v and the attention output stay fp32 there until their last reader has run.
  carve_quant_forward(cw, d, s, r);
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, qkv};
  const auto qkv_forward = [&](float* dst) {
    be.layernorm_forward(r.ln1.f, r.ln1_mean, r.ln1_rstd, a.in, p.ln1_w, p.ln1_b, d.BT, d.C);
    be.linear_forward(dst, r.ln1.f, p.qkv_w, p.qkv_b, d.BT, d.C, 3 * d.C);
    store(a, r.ln1, "ln_1");
  };
  context::split_forward(a, at, qkv_forward, [&] {
    store(a, s.atty, "attn");
    mlp_input_forward(a, p, a.in, s, r, d);
    if (out) mlp_out_forward(be, p, a, s, r, d);
  });
}

void block_forward(const UnitArgs& a) {
  if (a.cp > 1) return split_forward_stage(a, true);
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  Saved s = carve_saved(cs, d);
  Recomputable r = carve_recomputable(cr, d);
  carve_quant_forward(cw, d, s, r);
  block_forward_until_mlp_out(a, p, a.in, s, r, d);
  mlp_out_forward(be, p, a, s, r, d);
}

void block_recompute(const UnitArgs& a, model::Recompute mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable);
  const Saved s = carve_saved(cs, d);
  const Recomputable r = carve_recomputable(cr, d);
  // What is rebuilt is fp32 (model::ActQuant: only kept values are compressed), so a full
  // rebuild writes its buffers as an uncompressed forward does.
  if (mode == model::Recompute::full) {
    if (a.cp > 1) return split_forward_stage(a, false);
    return block_forward_until_mlp_out(a, p, a.in, s, r, d);
  }
  be.layernorm_forward(r.ln1.f, r.ln1_mean, r.ln1_rstd, a.in, p.ln1_w, p.ln1_b, d.BT, d.C);
  be.layernorm_forward(r.ln2.f, r.ln2_mean, r.ln2_rstd, s.res1, p.ln2_w, p.ln2_b, d.BT, d.C);
  be.gelu_forward(r.fch_gelu.f, s.fch, d.BT * d.F);
}

// d out (in a.dx) back through the MLP, the second norm and the projection: a.dx then holds
// d res1 and w.datty d attention output.
// Under --act-quant the GEMM inputs are dequantized into w.wide one after another, the attention
// output into w.narrow (left there for the attention's backward).
void mlp_backward(const UnitArgs& a, const Block& p, const Block& g, const Saved& s, const Recomputable& r,
                  const BackwardWs& w, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  const int64_t BT = d.BT, C = d.C, F = d.F;
  float* dres = a.dx;  // d out on entry; the residual passes it through unchanged
  be.zero(w.dfch_gelu, sizeof(float) * BT * F);
  be.zero(w.dfch, sizeof(float) * BT * F);
  be.zero(w.dln, sizeof(float) * BT * C);
  be.linear_backward(w.dfch_gelu, mut(g.fcproj_w), mut(g.fcproj_b), dres, load(a, r.fch_gelu, w.wide), p.fcproj_w,
                     BT, F, C);
  be.gelu_backward(w.dfch, w.dfch_gelu, s.fch, BT * F);
  be.linear_backward(w.dln, mut(g.fc_w), mut(g.fc_b), w.dfch, load(a, r.ln2, w.wide), p.fc_w, BT, C, F);
  be.layernorm_backward(dres, mut(g.ln2_w), mut(g.ln2_b), w.dln, s.res1, p.ln2_w, r.ln2_mean, r.ln2_rstd, BT, C);
  be.zero(w.datty, sizeof(float) * BT * C);
  be.linear_backward(w.datty, mut(g.proj_w), mut(g.proj_b), dres, load(a, s.atty, w.narrow), p.proj_w, BT, C, C);
}

// d q|k|v (in w.dqkv) back through the GEMM and the first norm into a.dx.
void qkv_backward(const UnitArgs& a, const Block& p, const Block& g, const Recomputable& r, const BackwardWs& w,
                  const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.zero(w.dln, sizeof(float) * d.BT * d.C);
  be.linear_backward(w.dln, mut(g.qkv_w), mut(g.qkv_b), w.dqkv, load(a, r.ln1, w.wide), p.qkv_w, d.BT, d.C, 3 * d.C);
  be.layernorm_backward(a.dx, mut(g.ln1_w), mut(g.ln1_b), w.dln, a.in, p.ln1_w, r.ln1_mean, r.ln1_rstd, d.BT, d.C);
}

void block_backward(const UnitArgs& a) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  const Block g = block_view(*a.unit, a.grads);
  Carver cs(a.saved), cr(a.recomputable), cw(a.backward_ws);
  const Saved s = carve_saved(cs, d);
  const Recomputable r = carve_recomputable(cr, d);
  const BackwardWs w = carve_backward_ws(be, cw, d, a.threads);
  if (a.cp == 1) {
    mlp_backward(a, p, g, s, r, w, d);
    be.zero(w.dqkv, sizeof(float) * d.BT * 3 * d.C);
    // The attention output is still in w.narrow from mlp_backward's load (or fp32 in place).
    const float* atty = s.atty.quantized() ? w.narrow : s.atty.f;
    be.attention_backward(w.dqkv, w.datty, load(a, s.qkv, w.wide), atty, s.lse, d.B, d.T, d.NH, d.NH, d.HS,
                          w.attention, a.desc->config.causal);
    return qkv_backward(a, p, g, r, w, d);
  }
  if (a.stage < 0) throw std::logic_error("gpt2 block: a pass over " + std::to_string(a.cp) + " cp ranks runs as stages");
  // Under --act-quant the MLP's backward leaves the attention output in w.narrow.
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, nullptr};
  const context::SplitAttentionGrads ag{w.dqkv, w.datty, w.dout_split, w.dqkv_split, w.wide, w.narrow, w.attention};
  context::split_backward(
      a, at, ag, [&] { mlp_backward(a, p, g, s, r, w, d); }, [&] { qkv_backward(a, p, g, r, w, d); });
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  const Dims d = dims(desc, shape);
  Carver cs(nullptr), cr(nullptr), cf(nullptr), cw(nullptr);
  Saved s = carve_saved(cs, d);
  Recomputable r = carve_recomputable(cr, d);
  carve_forward_ws(cf, d);
  carve_quant_forward(cf, d, s, r);
  carve_backward_ws(be, cw, d, shape.threads);
  return {cs.used(), cr.used(), cf.used(), cw.used()};
}

// ---- final norm + tied head

struct HeadWs {
  float *lnf, *mean, *rstd, *logits;
};
HeadWs carve_head_ws(const kernels::Backend& be, Carver& cv, const Dims& d, int64_t chunk, int64_t Vp) {
  HeadWs w;
  w.lnf = cv.take<float>(d.BT * d.C);
  w.mean = cv.take<float>(d.BT);
  w.rstd = cv.take<float>(d.BT);
  w.logits = cv.take<float>(be.head_scratch(chunk, Vp));
  return w;
}

double head(const UnitArgs& a, HeadMode mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const float* lnf_w = a.params + a.unit->param("ln_f.weight").offset;
  const float* lnf_b = a.params + a.unit->param("ln_f.bias").offset;
  const float* wte = embedding_view(a.desc->units[a.unit->borrows], a.borrowed_params).wte;
  Carver cv(a.forward_ws);
  const HeadWs w = carve_head_ws(be, cv, d, model::detail::head_chunk_rows(d.BT), a.desc->config.padded_vocab());
  be.layernorm_forward(w.lnf, w.mean, w.rstd, a.in, lnf_w, lnf_b, d.BT, d.C);
  if (mode != HeadMode::train) return vocabulary_pass(a, mode, w.lnf, wte, nullptr, nullptr, w.logits);
  float* dln = reinterpret_cast<float*>(a.backward_ws);
  float* dwte = mut(embedding_view(a.desc->units[a.unit->borrows], a.borrowed_grads).wte);
  const double loss = vocabulary_pass(a, mode, w.lnf, wte, dwte, dln, w.logits);
  be.zero(a.dx, sizeof(float) * d.BT * d.C);
  be.layernorm_backward(a.dx, a.grads + a.unit->param("ln_f.weight").offset,
                        a.grads + a.unit->param("ln_f.bias").offset, dln, a.in, lnf_w, w.mean, w.rstd, d.BT, d.C);
  return loss;
}

Carved head_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                   const model::Shape& shape) {
  const Dims d = dims(desc, shape);
  Carver cv(nullptr), cb(nullptr);
  carve_head_ws(be, cv, d, model::detail::head_chunk_rows(d.BT), desc.config.padded_vocab());
  cb.take<float>(d.BT * d.C);
  return {0, 0, cv.used(), cb.used()};
}

}  // namespace

LayerKind gpt2_embedding_kind() {
  LayerKind k;
  k.forward = embedding_forward;
  k.backward = embedding_backward;
  k.carved = embedding_carved;
  return k;
}

LayerKind gpt2_block_kind() {
  LayerKind k;
  k.forward = block_forward;
  k.recompute = block_recompute;
  k.backward = block_backward;
  k.carved = block_carved;
  return k;
}

LayerKind gpt2_head_kind() {
  LayerKind k;
  k.head = head;
  k.carved = head_carved;
  return k;
}

}  // namespace shardlm::layers
