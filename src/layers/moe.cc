// The mixture-of-experts block: LLaMA's attention half, then a sparse MoE MLP in three phases
// (kept apart because expert parallelism puts an all-to-all between them):
//  1. dispatch: RMSNorm, router (linear, no bias), fp32 softmax, top-k, capacity, and the routed
//     rows permuted into expert-sorted order (a dispatch buffer + each expert's row range);
//  2. experts: each expert's SwiGLU MLP as GEMMs on its contiguous rows;
//  3. combine: rows back to their tokens, weighted by the routing weights, added to the residual.
// The experts' weights are the borrowed unit (moe_experts: w1|w3 (2 FE, C) then w2 (C, FE) per
// expert). The backward mirrors the phases and adds the load-balancing and z-loss gradients, each
// weighted by its coefficient and UnitArgs::group_weight.
#include <algorithm>
#include <vector>

#include "kernels/backend.h"
#include "layers/layers.h"

namespace shardlm::layers {

namespace {

float* mut(const float* p) { return const_cast<float*>(p); }

struct Block {
  const float* in_norm;    // (C)
  const float* qkv;        // ((NH + 2 NKV) HS, C)
  const float* o;          // (C, NH HS)
  const float* post_norm;  // (C)
  const float* gate;       // (E, C) the router
};
Block block_view(const model::UnitDesc& u, const float* flat) {
  auto at = [&](const char* s) { return flat + u.param(s).offset; };
  return {at("input_layernorm.weight"), at("self_attn.q_proj.weight"), at("self_attn.o_proj.weight"),
          at("post_attention_layernorm.weight"), at("block_sparse_moe.gate.weight")};
}

struct Dims {
  int64_t B, T, BT, C, NH, NKV, HS, QKV;
  int64_t E, k, FE, R, capacity;
  float eps, theta;
  bool norm_topk;
};
Dims dims_of(const model::ModelDesc& desc, int64_t B, int64_t T) {
  const auto& c = desc.config;
  const int64_t HS = c.head_size(), BT = B * T;
  return {B,           T,       BT, c.n_embd, c.n_head, c.n_kv_head, HS, (c.n_head + 2 * c.n_kv_head) * HS,
          c.n_experts, c.top_k, c.moe_ffn_dim, c.routed_rows_bound(BT), c.expert_capacity(BT),
          static_cast<float>(c.norm_eps), static_cast<float>(c.rope_theta), c.norm_topk};
}
Dims dims(const UnitArgs& a) { return dims_of(*a.desc, a.B, a.T); }

// Expert j's w1|w3 (2 FE, C) and w2 (C, FE) inside the experts unit's flat buffer.
const float* expert_gate_up(const Dims& d, const float* experts, int64_t j) { return experts + j * 3 * d.FE * d.C; }
const float* expert_down(const Dims& d, const float* experts, int64_t j) { return experts + (j * 3 + 2) * d.FE * d.C; }

struct Saved {
  float* qkv;   // (B, T, QKV) after rotation
  float* atty;  // (B, T, C)
  float* lse;   // (B, NH, T)
  float* res1;  // (B, T, C) residual after attention
  float* logits;  // (BT, E) router logits
  int32_t* expert;    // (BT, k)
  float* weight;      // (BT, k)
  int32_t* slot_row;  // (BT, k)
  int32_t* row_token;  // (R)
  int32_t* offsets;    // (E + 1)
  int32_t* assigned;   // (E)
  float* gate_up;  // (R, 2 FE)
  float* ys;       // (R, C) expert outputs
};
Saved carve_saved(Carver& cv, const Dims& d) {
  Saved s;
  s.qkv = cv.take<float>(d.BT * d.QKV);
  s.atty = cv.take<float>(d.BT * d.C);
  s.lse = cv.take<float>(d.B * d.NH * d.T);
  s.res1 = cv.take<float>(d.BT * d.C);
  s.logits = cv.take<float>(d.BT * d.E);
  s.expert = cv.take<int32_t>(d.BT * d.k);
  s.weight = cv.take<float>(d.BT * d.k);
  s.slot_row = cv.take<int32_t>(d.BT * d.k);
  s.row_token = cv.take<int32_t>(d.R);
  s.offsets = cv.take<int32_t>(d.E + 1);
  s.assigned = cv.take<int32_t>(d.E);
  s.gate_up = cv.take<float>(d.R * 2 * d.FE);
  s.ys = cv.take<float>(d.R * d.C);
  return s;
}
struct Recomputable {
  float *ln1, *rstd1, *ln2, *rstd2;
  float* xs;   // (R, C) dispatched rows of ln2
  float* act;  // (R, FE)
};
Recomputable carve_recomputable(Carver& cv, const Dims& d) {
  Recomputable r;
  r.ln1 = cv.take<float>(d.BT * d.C);
  r.rstd1 = cv.take<float>(d.BT);
  r.ln2 = cv.take<float>(d.BT * d.C);
  r.rstd2 = cv.take<float>(d.BT);
  r.xs = cv.take<float>(d.R * d.C);
  r.act = cv.take<float>(d.R * d.FE);
  return r;
}
struct ForwardWs {
  float *rope, *probs, *router_lse;
};
ForwardWs carve_forward_ws(const kernels::Backend& be, Carver& cv, const Dims& d) {
  ForwardWs w;
  w.rope = cv.take<float>(be.rope_table_floats(d.T, d.HS));
  w.probs = cv.take<float>(d.BT * d.E);
  w.router_lse = cv.take<float>(d.BT);
  return w;
}
struct BackwardWs {
  float *dln, *datty, *dqkv, *dys, *dact, *dgate_up, *dxs, *dweight, *probs, *router_lse, *dlogits, *attention, *rope;
};
BackwardWs carve_backward_ws(const kernels::Backend& be, Carver& cv, const Dims& d, int threads) {
  BackwardWs w;
  w.dln = cv.take<float>(d.BT * d.C);
  w.datty = cv.take<float>(d.BT * d.C);
  w.dqkv = cv.take<float>(d.BT * d.QKV);
  w.dys = cv.take<float>(d.R * d.C);
  w.dact = cv.take<float>(d.R * d.FE);
  w.dgate_up = cv.take<float>(d.R * 2 * d.FE);
  w.dxs = cv.take<float>(d.R * d.C);
  w.dweight = cv.take<float>(d.BT * d.k);
  w.probs = cv.take<float>(d.BT * d.E);
  w.router_lse = cv.take<float>(d.BT);
  w.dlogits = cv.take<float>(d.BT * d.E);
  w.attention = cv.take<float>(be.attention_backward_scratch(d.B, d.T, d.NH, d.NKV, d.HS, threads));
  w.rope = cv.take<float>(be.rope_table_floats(d.T, d.HS));
  return w;
}

// Each expert's first row in the dispatch buffer, on the host (E + 1 entries): where its GEMMs start.
std::vector<int32_t> expert_offsets(const kernels::Backend& be, const Saved& s, const Dims& d) {
  std::vector<int32_t> off(d.E + 1);
  be.download(off.data(), s.offsets, sizeof(int32_t) * off.size());
  return off;
}

// Attention half and the MLP's norm: in -> res1, ln2.
void attention_forward(const kernels::Backend& be, const Block& p, const float* in, const Saved& s,
                       const Recomputable& r, float* rope, const Dims& d) {
  be.rmsnorm_forward(r.ln1, r.rstd1, in, p.in_norm, d.BT, d.C, d.eps);
  be.dense_forward(s.qkv, r.ln1, p.qkv, d.BT, d.C, d.QKV);
  be.rope_table(rope, d.T, d.HS, d.theta);
  be.rope_forward(s.qkv, d.B, d.T, d.NH + d.NKV, d.HS, d.QKV, rope);
  be.attention_forward(s.atty, s.lse, s.qkv, d.B, d.T, d.NH, d.NKV, d.HS);
  be.dense_forward(s.res1, s.atty, p.o, d.BT, d.C, d.C);
  be.residual_forward(s.res1, s.res1, in, d.BT * d.C);
  be.rmsnorm_forward(r.ln2, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
}

// Phase 1: route ln2 and permute its rows into expert order. Returns the experts' row offsets.
std::vector<int32_t> dispatch(const kernels::Backend& be, const Block& p, const Saved& s, const Recomputable& r,
                              const ForwardWs& w, const Dims& d) {
  be.dense_forward(s.logits, r.ln2, p.gate, d.BT, d.C, d.E);
  be.moe_router_forward(w.probs, w.router_lse, s.expert, s.weight, s.logits, d.BT, d.E, d.k, d.norm_topk);
  const int64_t rows = be.moe_dispatch(s.offsets, s.assigned, s.slot_row, s.row_token, s.expert, d.BT, d.E, d.k,
                                       d.capacity);
  be.moe_gather_rows(r.xs, r.ln2, s.row_token, rows, d.C);
  return expert_offsets(be, s, d);
}

// Phase 2: every expert's SwiGLU MLP on its rows (one GEMM per expert and projection).
void experts_forward(const kernels::Backend& be, const float* experts, const Saved& s, const Recomputable& r,
                     const std::vector<int32_t>& off, const Dims& d) {
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t at = off[j], n = off[j + 1] - off[j];
    if (n > 0) be.dense_forward(s.gate_up + at * 2 * d.FE, r.xs + at * d.C, expert_gate_up(d, experts, j), n, d.C, 2 * d.FE);
  }
  be.swiglu_forward(r.act, s.gate_up, off[d.E], d.FE);
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t at = off[j], n = off[j + 1] - off[j];
    if (n > 0) be.dense_forward(s.ys + at * d.C, r.act + at * d.FE, expert_down(d, experts, j), n, d.FE, d.C);
  }
}

void record(const UnitArgs& a, const Saved& s, const ForwardWs& w, const std::vector<int32_t>& off, const Dims& d) {
  if (!a.moe) return;
  const kernels::Backend& be = *a.backend;
  MoeStats m;
  double aux = 0, z = 0;
  be.moe_router_losses(&aux, &z, w.probs, w.router_lse, s.assigned, d.BT, d.E, d.k);
  m.aux_loss = a.group_weight * aux;
  m.z_loss = a.group_weight * z;
  m.routed = d.BT * d.k;
  m.dropped = m.routed - off[d.E];
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t n = off[j + 1] - off[j];
    m.min_load = m.min_load < 0 ? n : std::min(m.min_load, n);
    m.max_load = std::max(m.max_load, n);
  }
  a.moe->add(m);
}

void block_forward(const UnitArgs& a) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  const Saved s = carve_saved(cs, d);
  const Recomputable r = carve_recomputable(cr, d);
  const ForwardWs w = carve_forward_ws(be, cw, d);
  attention_forward(be, p, a.in, s, r, w.rope, d);
  const std::vector<int32_t> off = dispatch(be, p, s, r, w, d);
  record(a, s, w, off, d);
  experts_forward(be, a.borrowed_params, s, r, off, d);
  be.moe_combine(a.out, s.res1, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);  // phase 3
}

void block_recompute(const UnitArgs& a, model::Recompute mode) {
  const kernels::Backend& be = *a.backend;
  const Dims d = dims(a);
  const Block p = block_view(*a.unit, a.params);
  Carver cs(a.saved), cr(a.recomputable), cw(a.forward_ws);
  const Saved s = carve_saved(cs, d);
  const Recomputable r = carve_recomputable(cr, d);
  const ForwardWs w = carve_forward_ws(be, cw, d);
  if (mode == model::Recompute::full) {
    attention_forward(be, p, a.in, s, r, w.rope, d);
    experts_forward(be, a.borrowed_params, s, r, dispatch(be, p, s, r, w, d), d);
    return;
  }
  const std::vector<int32_t> off = expert_offsets(be, s, d);
  be.rmsnorm_forward(r.ln1, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  be.rmsnorm_forward(r.ln2, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  be.moe_gather_rows(r.xs, r.ln2, s.row_token, off[d.E], d.C);
  be.swiglu_forward(r.act, s.gate_up, off[d.E], d.FE);
}

// Phases 3 and 2 backward: d out -> d expert rows -> d dispatched rows, into the experts' grads.
void experts_backward(const kernels::Backend& be, const float* experts, float* g_experts, const float* dout,
                      const Saved& s, const Recomputable& r, const BackwardWs& w, const std::vector<int32_t>& off,
                      const Dims& d) {
  const int64_t rows = off[d.E];
  be.zero(w.dys, sizeof(float) * rows * d.C);
  be.zero(w.dweight, sizeof(float) * d.BT * d.k);
  be.zero(w.dact, sizeof(float) * rows * d.FE);
  be.zero(w.dgate_up, sizeof(float) * rows * 2 * d.FE);
  be.zero(w.dxs, sizeof(float) * rows * d.C);
  be.moe_combine_backward(w.dys, w.dweight, dout, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t at = off[j], n = off[j + 1] - off[j];
    if (n == 0) continue;  // an idle expert: no rows, its gradient stays as it was
    be.dense_backward(w.dact + at * d.FE, mut(expert_down(d, g_experts, j)), w.dys + at * d.C, r.act + at * d.FE,
                      expert_down(d, experts, j), n, d.FE, d.C);
  }
  be.swiglu_backward(w.dgate_up, w.dact, s.gate_up, rows, d.FE);
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t at = off[j], n = off[j + 1] - off[j];
    if (n == 0) continue;
    be.dense_backward(w.dxs + at * d.C, mut(expert_gate_up(d, g_experts, j)), w.dgate_up + at * 2 * d.FE,
                      r.xs + at * d.C, expert_gate_up(d, experts, j), n, d.C, 2 * d.FE);
  }
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
  const std::vector<int32_t> off = expert_offsets(be, s, d);
  const int64_t BT = d.BT, C = d.C;
  float* dres = a.dx;  // d out on entry; the residual passes it through unchanged
  experts_backward(be, a.borrowed_params, a.borrowed_grads, dres, s, r, w, off, d);
  // Phase 1 backward: rows back to tokens, the router (top-k weights, aux and z-loss), the norm.
  const auto& c = a.desc->config;
  be.zero(w.dln, sizeof(float) * BT * C);
  be.zero(w.dlogits, sizeof(float) * BT * d.E);
  be.moe_gather_rows_backward(w.dln, w.dxs, s.slot_row, BT, d.k, C);
  be.moe_router_probs(w.probs, w.router_lse, s.logits, BT, d.E);
  be.moe_router_backward(w.dlogits, w.dweight, w.probs, w.router_lse, s.expert, s.weight, s.assigned, BT, d.E, d.k,
                         d.norm_topk, static_cast<float>(c.aux_loss_coef * a.group_weight),
                         static_cast<float>(c.z_loss_coef * a.group_weight));
  be.dense_backward(w.dln, mut(g.gate), w.dlogits, r.ln2, p.gate, BT, C, d.E);
  be.rmsnorm_backward(dres, mut(g.post_norm), w.dln, s.res1, p.post_norm, r.rstd2, BT, C);
  // dres now holds d res1: the attention half, as llama's.
  be.zero(w.datty, sizeof(float) * BT * C);
  be.zero(w.dqkv, sizeof(float) * BT * d.QKV);
  be.zero(w.dln, sizeof(float) * BT * C);
  be.dense_backward(w.datty, mut(g.o), dres, s.atty, p.o, BT, C, C);
  be.attention_backward(w.dqkv, w.datty, s.qkv, s.atty, s.lse, d.B, d.T, d.NH, d.NKV, d.HS, w.attention);
  be.rope_table(w.rope, d.T, d.HS, d.theta);
  be.rope_backward(w.dqkv, d.B, d.T, d.NH + d.NKV, d.HS, d.QKV, w.rope);
  be.dense_backward(w.dln, mut(g.qkv), w.dqkv, r.ln1, p.qkv, BT, C, d.QKV);
  be.rmsnorm_backward(dres, mut(g.in_norm), w.dln, a.in, p.in_norm, r.rstd1, BT, C);
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  const Dims d = dims_of(desc, shape.B, shape.T);
  Carver cs(nullptr), cr(nullptr), cf(nullptr), cw(nullptr);
  carve_saved(cs, d);
  carve_recomputable(cr, d);
  carve_forward_ws(be, cf, d);
  carve_backward_ws(be, cw, d, shape.threads);
  return {cs.used(), cr.used(), cf.used(), cw.used()};
}

Carved experts_carved(const kernels::Backend&, const model::ModelDesc&, const model::UnitDesc&, const model::Shape&) {
  return {};
}

}  // namespace

LayerKind moe_block_kind() {
  LayerKind k;
  k.forward = block_forward;
  k.recompute = block_recompute;
  k.backward = block_backward;
  k.carved = block_carved;
  return k;
}

// State only: its block runs it.
LayerKind moe_experts_kind() {
  LayerKind k;
  k.carved = experts_carved;
  return k;
}

}  // namespace shardlm::layers
