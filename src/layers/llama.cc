// LLaMA's unit kinds: token embedding, pre-norm block (RMSNorm, rotary q/k, grouped-query
// attention, SwiGLU; Linear weights (out, in), no biases), final RMSNorm + head (own or tied).
#include <algorithm>
#include <cstring>

#include <stdexcept>

#include "kernels/backend.h"
#include "layers/context.h"
#include "layers/layers.h"

namespace shardlm::layers {

namespace {

float* mut(const float* p) { return const_cast<float*>(p); }

struct Block {
  const float* in_norm;   // (C)
  const float* qkv;       // ((NH + 2 NKV) HS, C): q_proj, k_proj, v_proj, adjacent
  const float* o;         // (C, NH HS)
  const float* post_norm; // (C)
  const float* gate_up;   // (2F, C): gate_proj, up_proj, adjacent
  const float* down;      // (C, F)
};
Block block_view(const model::UnitDesc& u, const float* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("input_layernorm.weight"), at("self_attn.q_proj.weight"), at("self_attn.o_proj.weight"),
          at("post_attention_layernorm.weight"), at("mlp.gate_proj.weight"), at("mlp.down_proj.weight")};
}

struct Dims {
  int64_t B, T, BT, C, NH, NKV, HS, QKV, F;
  float eps;
  kernels::Rope rope;
  int64_t P = 1;  // ranks each sequence is split over (T of its T·P positions here)
  bool ring = false;  // split as a ring (else heads split by an all-to-all)
  // --act-quant: the group of the saved / recomputable buffers' GEMM inputs (0: fp32).
  int64_t gs = 0, gr = 0;
  bool op = false;  // selective_op: q and v, and the gate, kept apart; the rest rebuilt
  bool heads_split() const { return P > 1 && !ring; }
  int64_t QV() const { return (NH + NKV) * HS; }  // a row of q and v
  int64_t wide() const { return BT * std::max(QKV, F); }  // q|k|v or the SwiGLU output
};
Dims dims_of(const model::ModelDesc& desc, int64_t B, int64_t T, int64_t P, model::ContextImpl impl,
             const model::ActQuant& q = {}, model::Recompute mode = model::Recompute::none) {
  const auto& c = desc.config;
  const int64_t HS = c.head_size();
  return {B, T, B * T, c.n_embd, c.n_head, c.n_kv_head, HS, (c.n_head + 2 * c.n_kv_head) * HS, c.ffn_dim,
          static_cast<float>(c.norm_eps), context::rope_of(c), P,
          P > 1 && impl == model::ContextImpl::ring, q.saved_int8(mode) ? q.group : 0,
          q.recomputable_int8(mode) ? q.group : 0, mode == model::Recompute::selective_op};
}
Dims dims(const UnitArgs& a) { return dims_of(*a.desc, a.B, a.T, a.cp, a.cp_impl, a.act_quant, a.recompute); }

struct Saved {
  Kept qkv;        // (B, T, QKV) after rotation; split over cp: this rank's heads, every position
  Kept atty;       // (B, T, C) attention output before o_proj
  float* lse;      // (B, NH, T); split over cp: (B, NH / P, T·P)
  float* res1;     // (B, T, C) residual after attention
  float* gate_up;  // (B, T, 2F)
  float* out_split = nullptr;  // heads split over cp: this rank's heads' attention output (B, T·P, C / P)
  float* kv_last = nullptr;    // a ring: the last key/value block the forward attended to (B, T, 2·NKV·HS)
  float* qv = nullptr;    // selective_op: (B, T, (NH + NKV) HS) rotated q, then v; kept
  float* gate = nullptr;  // selective_op: (B, T, F) gate_proj's output; kept
};
Saved carve_saved(Carver& cv, const Dims& d) {
  Saved s;
  s.qkv = take_kept(cv, d.BT * d.QKV, d.gs);
  s.atty = take_kept(cv, d.BT * d.C, d.gs);
  s.lse = cv.take<float>(d.B * d.NH * d.T);
  s.res1 = cv.take<float>(d.BT * d.C);
  s.gate_up = cv.take<float>(d.BT * 2 * d.F);
  if (d.heads_split()) s.out_split = cv.take<float>(d.BT * d.C);
  if (d.ring) s.kv_last = cv.take<float>(d.BT * 2 * d.NKV * d.HS);
  return s;
}
struct Recomputable {
  Kept ln1;      // (B, T, C)
  float* rstd1;  // (B, T)
  Kept ln2;
  float* rstd2;
  Kept act;  // (B, T, F) silu(gate) * up
};
Recomputable carve_recomputable(Carver& cv, const Dims& d) {
  Recomputable r;
  r.ln1 = take_kept(cv, d.BT * d.C, d.gr);
  r.rstd1 = cv.take<float>(d.BT);
  r.ln2 = take_kept(cv, d.BT * d.C, d.gr);
  r.rstd2 = cv.take<float>(d.BT);
  r.act = take_kept(cv, d.BT * d.F, d.gr);
  return r;
}
// The forward's values in the buffer kept for the backward (`saved`) and the one a recompute may
// rebuild (`recomputable`). Under selective_op q|k|v, residual 1 and gate|up live in the rebuilt
// one, as the forward and backward read them, and the kept one holds what rebuilds them.
struct Activations {
  Saved s;
  Recomputable r;
};
Activations carve_activations(Carver& saved, Carver& recomputable, const Dims& d) {
  if (!d.op) return {carve_saved(saved, d), carve_recomputable(recomputable, d)};
  Activations a;
  a.s.qv = saved.take<float>(d.BT * d.QV());
  a.s.atty = take_kept(saved, d.BT * d.C, 0);
  a.s.lse = saved.take<float>(d.B * d.NH * d.T);
  a.s.gate = saved.take<float>(d.BT * d.F);
  a.r = carve_recomputable(recomputable, d);
  a.s.qkv = take_kept(recomputable, d.BT * d.QKV, 0);
  a.s.res1 = recomputable.take<float>(d.BT * d.C);
  a.s.gate_up = recomputable.take<float>(d.BT * 2 * d.F);
  return a;
}
// selective_op's kept columns: q|v out of (or back into) q|k|v, the gate out of (or into) gate|up.
void keep_q_v(const kernels::Backend& be, float* qv, const float* qkv, const Dims& d) {
  const size_t f = sizeof(float), q = d.NH * d.HS, kv = d.NKV * d.HS;
  be.copy_rows(qv, d.QV() * f, qkv, d.QKV * f, q * f, d.BT);
  be.copy_rows(qv + q, d.QV() * f, qkv + q + kv, d.QKV * f, kv * f, d.BT);
}
void restore_q_v(const kernels::Backend& be, float* qkv, const float* qv, const Dims& d) {
  const size_t f = sizeof(float), q = d.NH * d.HS, kv = d.NKV * d.HS;
  be.copy_rows(qkv, d.QKV * f, qv, d.QV() * f, q * f, d.BT);
  be.copy_rows(qkv + q + kv, d.QKV * f, qv + q, d.QV() * f, kv * f, d.BT);
}
// --act-quant: the forward's fp32 forms of the compressed values, in two scratch slices after the
// forward's own (as GPT-2's block: norm out, attention out, norm out take turns in the first,
// q|k|v and the SwiGLU output in the second, each stored before the next is written).
void carve_quant_forward(Carver& cv, const Dims& d, Saved& s, Recomputable& r) {
  if (d.gs == 0) return;
  float* narrow = cv.take<float>(d.BT * d.C);
  float* wide = cv.take<float>(d.wide());
  s.qkv.f = wide, s.atty.f = narrow;
  if (d.gr > 0) r.ln1.f = narrow, r.ln2.f = narrow, r.act.f = wide;
}
float* carve_rope(const kernels::Backend& be, Carver& cv, const Dims& d) {
  return cv.take<float>(be.rope_table_floats(d.T * d.P, d.HS));
}
struct ForwardWs {
  float* rope;
  float* qkv = nullptr;  // split over cp: this rank's rows' q|k|v before they go to the head split
};
ForwardWs carve_forward_ws(const kernels::Backend& be, Carver& cv, const Dims& d) {
  ForwardWs w;
  w.rope = carve_rope(be, cv, d);
  if (d.heads_split()) w.qkv = cv.take<float>(d.BT * d.QKV);
  return w;
}
struct BackwardWs {
  float *dln, *datty, *dqkv, *dact, *dgate_up, *attention, *rope;
  float *dout_split = nullptr, *dqkv_split = nullptr;  // split over cp: the head split's gradients
  float *wide = nullptr, *narrow = nullptr;  // --act-quant: dequantized inputs (as GPT-2's block)
};
BackwardWs carve_backward_ws(const kernels::Backend& be, Carver& cv, const Dims& d, int threads) {
  BackwardWs w;
  w.dln = cv.take<float>(d.BT * d.C);
  w.datty = cv.take<float>(d.BT * d.C);
  w.dqkv = cv.take<float>(d.BT * d.QKV);
  w.dact = cv.take<float>(d.BT * d.F);
  w.dgate_up = cv.take<float>(d.BT * 2 * d.F);
  w.attention = cv.take<float>(be.attention_backward_scratch(d.B, d.T, d.NH, d.NKV, d.HS, threads));
  w.rope = carve_rope(be, cv, d);
  if (d.heads_split()) {
    w.dout_split = cv.take<float>(d.BT * d.C);
    w.dqkv_split = cv.take<float>(d.BT * d.QKV);
  }
  if (d.gs > 0) {
    w.wide = cv.take<float>(d.wide());
    w.narrow = cv.take<float>(d.BT * d.C);
  }
  return w;
}

void rotate(const kernels::Backend& be, float* qkv, const UnitArgs& a, const Dims& d, const float* table, bool back) {
  context::rotate(be, qkv, a, d.QKV, d.NH + d.NKV, d.HS, table, back);
}

// ---- embedding

const float* embed_tokens(const model::UnitDesc& u, const float* flat) {
  return flat + u.param("model.embed_tokens.weight").offset;
}

void embedding_forward(const UnitArgs& a) {
  a.backend->embedding_forward(a.out, a.tokens, embed_tokens(*a.unit, a.params), nullptr, a.B, a.T,
                               a.desc->config.n_embd);
}

void embedding_backward(const UnitArgs& a) {
  a.backend->embedding_backward(mut(embed_tokens(*a.unit, a.grads)), nullptr, a.dx, a.tokens, a.B, a.T,
                                a.desc->config.n_embd);
}

Carved embedding_carved(const kernels::Backend&, const model::ModelDesc&, const model::UnitDesc&, const model::Shape&) {
  return {};
}

// ---- block

// Output columns [first, first + width) of a fused GEMM (weight rows of the same range) through
// `tmp` (B, T, width). selective_op's forward runs every GEMM its rebuild reruns so, as the rebuild
// does: a GEMM's kernel (so the order it sums in) may depend on the output width, and the rebuilt
// values must be the forward's bits.
void dense_part(const kernels::Backend& be, float* out, int64_t out_width, float* tmp, const float* in,
                const float* weight, int64_t first, int64_t width, const Dims& d) {
  const size_t f = sizeof(float);
  be.dense_forward(tmp, in, weight + first * d.C, d.BT, d.C, width);
  be.copy_rows(out + first, out_width * f, tmp, width * f, width * f, d.BT);
}

// Norm, q|k|v and their rotation: a pass's start (stage 0 of one split over cp).
void qkv_forward(const kernels::Backend& be, const Block& p, const float* in, float* qkv, const Recomputable& r,
                 float* rope, const UnitArgs& a, const Dims& d) {
  be.rmsnorm_forward(r.ln1.f, r.rstd1, in, p.in_norm, d.BT, d.C, d.eps);
  store(a, r.ln1, "input_layernorm");
  if (d.op) {  // q, k and v apart (r.ln2 is free until the second norm)
    const int64_t q = d.NH * d.HS, kv = d.NKV * d.HS;
    dense_part(be, qkv, d.QKV, r.ln2.f, r.ln1.f, p.qkv, 0, q, d);
    dense_part(be, qkv, d.QKV, r.ln2.f, r.ln1.f, p.qkv, q, kv, d);
    dense_part(be, qkv, d.QKV, r.ln2.f, r.ln1.f, p.qkv, q + kv, kv, d);
  } else {
    be.dense_forward(qkv, r.ln1.f, p.qkv, d.BT, d.C, d.QKV);
  }
  be.rope_table(rope, d.T * d.P, d.HS, d.rope);
  rotate(be, qkv, a, d, rope, false);  // q and k, in place
}

// From the attention output to the MLP's input: projection, residual, norm, gate|up, SwiGLU.
void mlp_input_forward(const UnitArgs& a, const Block& p, const float* in, const Saved& s, const Recomputable& r,
                       const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.dense_forward(s.res1, s.atty.f, p.o, d.BT, d.C, d.C);
  be.residual_forward(s.res1, s.res1, in, d.BT * d.C);
  be.rmsnorm_forward(r.ln2.f, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  store(a, r.ln2, "post_attention_layernorm");
  if (d.op) {  // the gate into its kept buffer, up apart (r.act is free until the SwiGLU)
    dense_part(be, s.gate_up, 2 * d.F, s.gate, r.ln2.f, p.gate_up, 0, d.F, d);
    dense_part(be, s.gate_up, 2 * d.F, r.act.f, r.ln2.f, p.gate_up, d.F, d.F, d);
  } else {
    be.dense_forward(s.gate_up, r.ln2.f, p.gate_up, d.BT, d.C, 2 * d.F);
  }
  be.swiglu_forward(r.act.f, s.gate_up, d.BT, d.F);
  store(a, r.act, "swiglu");
}

void down_forward(const kernels::Backend& be, const Block& p, const UnitArgs& a, const Saved& s,
                  const Recomputable& r, const Dims& d) {
  be.dense_forward(a.out, r.act.f, p.down, d.BT, d.F, d.C);
  be.residual_forward(a.out, a.out, s.res1, d.BT * d.C);
}

// One stage of a pass split over cp (context.h); `down`: through the down projection (a forward,
// not a full recompute).
void split_forward_stage(const UnitArgs& a, bool down) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  Activations kept = carve_activations(cs, cr, d);
  Saved& s = kept.s;
  Recomputable& r = kept.r;
  const ForwardWs w = carve_forward_ws(be, cw, d);
  // --act-quant: the forward scratch lives from the first stage to the last (plan/'s add_stages),
  // so q|k|v and the attention output stay fp32 there until their last reader has run.
  carve_quant_forward(cw, d, s, r);
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, w.qkv};
  context::split_forward(
      a, at, [&](float* dst) { qkv_forward(be, p, a.in, dst, r, w.rope, a, d); },
      [&] {
        store(a, s.atty, "attn");
        mlp_input_forward(a, p, a.in, s, r, d);
        if (down) down_forward(be, p, a, s, r, d);
      });
}

void check_staged(const UnitArgs& a) {
  if (a.stage < 0) throw std::logic_error("llama block: a pass over " + std::to_string(a.cp) + " cp ranks runs as stages");
}

// Everything up to (and without) the MLP's down projection: what a full recompute reruns.
void block_forward_until_down(const UnitArgs& a, const Block& p, const Saved& s, const Recomputable& r,
                              const ForwardWs& w, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  qkv_forward(be, p, a.in, s.qkv.f, r, w.rope, a, d);
  if (d.op) keep_q_v(be, s.qv, s.qkv.f, d);
  be.attention_forward(s.atty.f, s.lse, s.qkv.f, d.B, d.T, d.NH, d.NKV, d.HS, a.desc->config.causal);
  store(a, s.qkv, "qkv");
  store(a, s.atty, "attn");
  mlp_input_forward(a, p, a.in, s, r, d);
}

// selective_op's rebuild: the first norm, k (k_proj's rows of the q|k|v weight) and its rotation,
// the attention projection and residual, the second norm, up (up_proj's rows of gate|up) and the
// SwiGLU; q, v and the gate go back beside them. Each GEMM is the forward's own call (dense_part),
// so each value is the forward's bits.
void op_rebuild(const UnitArgs& a, const Block& p, const Saved& s, const Recomputable& r, const ForwardWs& w,
                const Dims& d) {
  const kernels::Backend& be = *a.backend;
  const size_t f = sizeof(float);
  const int64_t q = d.NH * d.HS, kv = d.NKV * d.HS;
  be.rmsnorm_forward(r.ln1.f, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  dense_part(be, s.qkv.f, d.QKV, r.ln2.f, r.ln1.f, p.qkv, q, kv, d);
  be.rope_table(w.rope, d.T * d.P, d.HS, d.rope);
  context::rotate(be, s.qkv.f + q, a, d.QKV, d.NKV, d.HS, w.rope, false);
  restore_q_v(be, s.qkv.f, s.qv, d);
  be.dense_forward(s.res1, s.atty.f, p.o, d.BT, d.C, d.C);
  be.residual_forward(s.res1, s.res1, a.in, d.BT * d.C);
  be.rmsnorm_forward(r.ln2.f, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  dense_part(be, s.gate_up, 2 * d.F, r.act.f, r.ln2.f, p.gate_up, d.F, d.F, d);
  be.copy_rows(s.gate_up, 2 * d.F * f, s.gate, d.F * f, d.F * f, d.BT);
  be.swiglu_forward(r.act.f, s.gate_up, d.BT, d.F);
}

void block_forward(const UnitArgs& a) {
  if (a.cp > 1) {
    check_staged(a);
    return split_forward_stage(a, true);
  }
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  Activations kept = carve_activations(cs, cr, d);
  Saved& s = kept.s;
  Recomputable& r = kept.r;
  const ForwardWs w = carve_forward_ws(*a.backend, cw, d);
  carve_quant_forward(cw, d, s, r);
  block_forward_until_down(a, p, s, r, w, d);
  down_forward(*a.backend, p, a, s, r, d);
}

void block_recompute(const UnitArgs& a, model::Recompute mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  const Activations kept = carve_activations(cs, cr, d);
  const Saved& s = kept.s;
  const Recomputable& r = kept.r;
  if (mode == model::Recompute::full) {
    if (a.cp > 1) {
      check_staged(a);
      return split_forward_stage(a, false);
    }
    return block_forward_until_down(a, p, s, r, carve_forward_ws(be, cw, d), d);
  }
  if (mode == model::Recompute::selective_op) return op_rebuild(a, p, s, r, carve_forward_ws(be, cw, d), d);
  // Rebuilt values are fp32 (model::ActQuant: only kept values are compressed).
  be.rmsnorm_forward(r.ln1.f, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  be.rmsnorm_forward(r.ln2.f, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  be.swiglu_forward(r.act.f, s.gate_up, d.BT, d.F);
}

// d out (in a.dx) back through the MLP, the second norm and the projection: a.dx then holds
// d res1 and w.datty d attention output.
void mlp_backward(const UnitArgs& a, const Block& p, const Block& g, const Saved& s, const Recomputable& r,
                  const BackwardWs& w, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  const int64_t BT = d.BT, C = d.C, F = d.F;
  float* dres = a.dx;  // d out on entry; the residual passes it through unchanged
  be.zero(w.dact, sizeof(float) * BT * F);
  be.zero(w.dgate_up, sizeof(float) * BT * 2 * F);
  be.zero(w.dln, sizeof(float) * BT * C);
  be.dense_backward(w.dact, mut(g.down), dres, load(a, r.act, w.wide), p.down, BT, F, C);
  be.swiglu_backward(w.dgate_up, w.dact, s.gate_up, BT, F);
  be.dense_backward(w.dln, mut(g.gate_up), w.dgate_up, load(a, r.ln2, w.wide), p.gate_up, BT, C, 2 * F);
  be.rmsnorm_backward(dres, mut(g.post_norm), w.dln, s.res1, p.post_norm, r.rstd2, BT, C);
  be.zero(w.datty, sizeof(float) * BT * C);
  be.dense_backward(w.datty, mut(g.o), dres, load(a, s.atty, w.narrow), p.o, BT, C, C);
}

// d q|k|v (rotated, in w.dqkv) back through the rotation, the GEMM and the first norm into a.dx.
void qkv_backward(const UnitArgs& a, const Block& p, const Block& g, const Recomputable& r, const BackwardWs& w,
                  const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.rope_table(w.rope, d.T * d.P, d.HS, d.rope);
  rotate(be, w.dqkv, a, d, w.rope, true);
  be.zero(w.dln, sizeof(float) * d.BT * d.C);
  be.dense_backward(w.dln, mut(g.qkv), w.dqkv, load(a, r.ln1, w.wide), p.qkv, d.BT, d.C, d.QKV);
  be.rmsnorm_backward(a.dx, mut(g.in_norm), w.dln, a.in, p.in_norm, r.rstd1, d.BT, d.C);  // a.dx: d in
}

void block_backward(const UnitArgs& a) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  const Block g = block_view(*a.unit, a.grads);
  Carver cs(a.saved), cr(a.recomputable), cw(a.backward_ws);
  const Activations kept = carve_activations(cs, cr, d);
  const Saved& s = kept.s;
  const Recomputable& r = kept.r;
  const BackwardWs w = carve_backward_ws(be, cw, d, a.threads);
  if (a.cp == 1) {
    mlp_backward(a, p, g, s, r, w, d);
    be.zero(w.dqkv, sizeof(float) * d.BT * d.QKV);
    // The attention output is still in w.narrow from mlp_backward's load (or fp32 in place).
    const float* atty = s.atty.quantized() ? w.narrow : s.atty.f;
    be.attention_backward(w.dqkv, w.datty, load(a, s.qkv, w.wide), atty, s.lse, d.B, d.T, d.NH, d.NKV, d.HS,
                          w.attention, a.desc->config.causal);
    return qkv_backward(a, p, g, r, w, d);
  }
  check_staged(a);
  // Under --act-quant the MLP's backward leaves the attention output in w.narrow.
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, nullptr};
  const context::SplitAttentionGrads ag{w.dqkv, w.datty, w.dout_split, w.dqkv_split, w.wide, w.narrow, w.attention};
  context::split_backward(
      a, at, ag, [&] { mlp_backward(a, p, g, s, r, w, d); }, [&] { qkv_backward(a, p, g, r, w, d); });
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  const Dims d = dims_of(desc, shape.B, shape.T, shape.cp, shape.cp_impl, shape.act_quant, shape.recompute);
  Carver cs(nullptr), cr(nullptr), cf(nullptr), cw(nullptr);
  Activations kept = carve_activations(cs, cr, d);
  Saved& s = kept.s;
  Recomputable& r = kept.r;
  carve_forward_ws(be, cf, d);
  carve_quant_forward(cf, d, s, r);
  carve_backward_ws(be, cw, d, shape.threads);
  return {cs.used(), cr.used(), cf.used(), cw.used()};
}

// ---- final norm + head (own weights, or the embedding's when tied)

struct HeadWs {
  float *ln, *rstd, *logits;
};
HeadWs carve_head_ws(const kernels::Backend& be, Carver& cv, const Dims& d, int64_t chunk, int64_t Vp) {
  HeadWs w;
  w.ln = cv.take<float>(d.BT * d.C);
  w.rstd = cv.take<float>(d.BT);
  w.logits = cv.take<float>(be.head_scratch(chunk, Vp));
  return w;
}

double head(const UnitArgs& a, HeadMode mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const model::UnitDesc& u = *a.unit;
  const float* norm_w = a.params + u.param("model.norm.weight").offset;
  const bool tied = u.borrows >= 0;
  const model::UnitDesc& owner = tied ? a.desc->units[u.borrows] : u;
  const char* weight_name = tied ? "model.embed_tokens.weight" : "lm_head.weight";
  const float* w_head = (tied ? a.borrowed_params : a.params) + owner.param(weight_name).offset;
  Carver cv(a.forward_ws);
  const HeadWs w = carve_head_ws(be, cv, d, model::detail::head_chunk_rows(d.BT), a.desc->config.padded_vocab());
  be.rmsnorm_forward(w.ln, w.rstd, a.in, norm_w, d.BT, d.C, d.eps);
  if (mode != HeadMode::train) return vocabulary_pass(a, mode, w.ln, w_head, nullptr, nullptr, w.logits);
  float* dln = reinterpret_cast<float*>(a.backward_ws);
  float* g_head = (tied ? a.borrowed_grads : a.grads) + owner.param(weight_name).offset;
  const double loss = vocabulary_pass(a, mode, w.ln, w_head, g_head, dln, w.logits);
  be.zero(a.dx, sizeof(float) * d.BT * d.C);
  be.rmsnorm_backward(a.dx, a.grads + u.param("model.norm.weight").offset, dln, a.in, norm_w, w.rstd, d.BT, d.C);
  return loss;
}

Carved head_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                   const model::Shape& shape) {
  const Dims d = dims_of(desc, shape.B, shape.T, shape.cp, shape.cp_impl);
  Carver cv(nullptr), cb(nullptr);
  carve_head_ws(be, cv, d, model::detail::head_chunk_rows(d.BT), desc.config.padded_vocab());
  cb.take<float>(d.BT * d.C);
  return {0, 0, cv.used(), cb.used()};
}

}  // namespace

LayerKind llama_embedding_kind() {
  LayerKind k;
  k.forward = embedding_forward;
  k.backward = embedding_backward;
  k.carved = embedding_carved;
  return k;
}

LayerKind llama_block_kind() {
  LayerKind k;
  k.forward = block_forward;
  k.recompute = block_recompute;
  k.backward = block_backward;
  k.carved = block_carved;
  return k;
}

LayerKind llama_head_kind() {
  LayerKind k;
  k.head = head;
  k.carved = head_carved;
  return k;
}

}  // namespace shardlm::layers
