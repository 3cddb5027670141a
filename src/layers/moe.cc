// The mixture-of-experts block: LLaMA's attention half, then a sparse MoE MLP, as a pass of three
// stages with the routed rows exchanged between them over the ep axis (model::Exchange):
//  0. token side: attention; RMSNorm, router (linear, no bias), fp32 softmax, top-k, capacity; the
//     routed rows in expert order, each expert rank's share (its experts' counts, then rows) sent;
//  1. expert side: the rows every rank sent, expert-major; each local expert's SwiGLU MLP as GEMMs
//     on its contiguous rows; the outputs back to the ranks they came from;
//  2. token side: the outputs, in dispatch order, weighted by the routing weights into the residual.
// The backward runs the stages in reverse (2, 1, 0) and adds the load-balancing and z-loss
// gradients, each weighted by its coefficient and UnitArgs::group_weight. With one rank the
// exchanges are left out: each stage reads what the one before it sent. The experts' weights are
// the borrowed unit (moe_experts: w1|w3 (2 FE, C) then w2 (C, FE) per expert): a rank gets
// the slice of its L = E / P experts (rank `peer` of P holds experts peer·L .. peer·L + L − 1).
#include <algorithm>
#include <vector>

#include "kernels/backend.h"
#include "layers/layers.h"
#include "tensor/memory.h"

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
  // Expert parallelism: P ranks, each running L = E / P experts on at most RL rows (the rows all
  // P ranks could route to them).
  int64_t P, L, RL;
};
Dims dims_of(const model::ModelDesc& desc, int64_t B, int64_t T, int64_t P) {
  const auto& c = desc.config;
  const int64_t HS = c.head_size(), BT = B * T;
  const int64_t L = c.n_experts / P;
  return {B,           T,       BT, c.n_embd, c.n_head, c.n_kv_head, HS, (c.n_head + 2 * c.n_kv_head) * HS,
          c.n_experts, c.top_k, c.moe_ffn_dim, c.routed_rows_bound(BT), c.expert_capacity(BT),
          static_cast<float>(c.norm_eps), static_cast<float>(c.rope_theta), c.norm_topk,
          P, L, c.expert_rows_bound(BT, P)};
}
Dims dims(const UnitArgs& a) { return dims_of(*a.desc, a.B, a.T, a.peers); }

// Expert j's w1|w3 (2 FE, C) and w2 (C, FE) inside the experts unit's flat buffer.
const float* expert_gate_up(const Dims& d, const float* experts, int64_t j) { return experts + j * 3 * d.FE * d.C; }
const float* expert_down(const Dims& d, const float* experts, int64_t j) { return experts + (j * 3 + 2) * d.FE * d.C; }

// Token side: this rank's micro-batch. Expert side: the rows its L experts received.
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
  float* ys;           // (R, C) expert outputs, in dispatch order
  int32_t* from;       // (P, L) expert side: rows from rank q for local expert j
  float* xs;           // (RL, C) expert side: received rows, expert-major
  float* gate_up;      // (RL, 2 FE)
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
  s.ys = cv.take<float>(d.R * d.C);
  s.from = cv.take<int32_t>(d.P * d.L);
  s.xs = cv.take<float>(d.RL * d.C);
  s.gate_up = cv.take<float>(d.RL * 2 * d.FE);
  return s;
}
struct Recomputable {
  float *ln1, *rstd1, *ln2, *rstd2;
  float* act;  // (RL, FE) expert side
};
Recomputable carve_recomputable(Carver& cv, const Dims& d) {
  Recomputable r;
  r.ln1 = cv.take<float>(d.BT * d.C);
  r.rstd1 = cv.take<float>(d.BT);
  r.ln2 = cv.take<float>(d.BT * d.C);
  r.rstd2 = cv.take<float>(d.BT);
  r.act = cv.take<float>(d.RL * d.FE);
  return r;
}
struct ForwardWs {
  float *rope, *probs, *router_lse, *ys;  // ys: (RL, C) expert side, expert-major
};
ForwardWs carve_forward_ws(const kernels::Backend& be, Carver& cv, const Dims& d) {
  ForwardWs w;
  w.rope = cv.take<float>(be.rope_table_floats(d.T, d.HS));
  w.probs = cv.take<float>(d.BT * d.E);
  w.router_lse = cv.take<float>(d.BT);
  w.ys = cv.take<float>(d.RL * d.C);
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
  w.dys = cv.take<float>(d.RL * d.C);
  w.dact = cv.take<float>(d.RL * d.FE);
  w.dgate_up = cv.take<float>(d.RL * 2 * d.FE);
  w.dxs = cv.take<float>(d.RL * d.C);
  w.dweight = cv.take<float>(d.BT * d.k);
  w.probs = cv.take<float>(d.BT * d.E);
  w.router_lse = cv.take<float>(d.BT);
  w.dlogits = cv.take<float>(d.BT * d.E);
  w.attention = cv.take<float>(be.attention_backward_scratch(d.B, d.T, d.NH, d.NKV, d.HS, threads));
  w.rope = cv.take<float>(be.rope_table_floats(d.T, d.HS));
  return w;
}

// Each expert's first row in the dispatch order, on the host (E + 1 entries).
std::vector<int32_t> expert_offsets(const kernels::Backend& be, const Saved& s, const Dims& d) {
  std::vector<int32_t> off(d.E + 1);
  be.download(off.data(), s.offsets, sizeof(int32_t) * off.size());
  return off;
}

// ---- the routed rows between the stages (model::Exchange: a header of bytes per rank, then the
// payloads rank after rank). Token side to expert side, each payload is the L counts (int64) of
// the destination's experts, then their rows in dispatch order; every other payload is rows.

struct Routed {
  const kernels::Backend& be;
  int64_t P;
  int64_t header() const { return model::exchange_header_bytes(P); }
  void write_sizes(char* buf, const std::vector<int64_t>& bytes) const { be.upload(buf, bytes.data(), 8 * P); }
  std::vector<int64_t> sizes(const char* buf) const {
    std::vector<int64_t> bytes(P);
    be.download(bytes.data(), buf, 8 * P);
    return bytes;
  }
  // Where rank q's payload starts.
  std::vector<int64_t> starts(const std::vector<int64_t>& bytes) const {
    std::vector<int64_t> at(P);
    for (int64_t q = 0, pos = header(); q < P; pos += bytes[q++]) at[q] = pos;
    return at;
  }
};

// The expert side's rows: rank q's rows for local expert j sit at expert-major row
// first[j] + before[q][j] (their ranks' rows for expert j in rank order).
struct ExpertRows {
  std::vector<int64_t> first;              // (L + 1) each local expert's first row
  std::vector<std::vector<int64_t>> at;    // (P, L) where rank q's rows for expert j start
  std::vector<std::vector<int64_t>> count; // (P, L)
};
ExpertRows expert_rows(const std::vector<int32_t>& from, const Dims& d) {
  ExpertRows x{std::vector<int64_t>(d.L + 1, 0), std::vector<std::vector<int64_t>>(d.P, std::vector<int64_t>(d.L)),
               std::vector<std::vector<int64_t>>(d.P, std::vector<int64_t>(d.L))};
  int64_t row = 0;
  for (int64_t j = 0; j < d.L; ++j) {
    x.first[j] = row;
    for (int64_t q = 0; q < d.P; ++q) {
      x.count[q][j] = from[q * d.L + j];
      x.at[q][j] = row;
      row += x.count[q][j];
    }
  }
  x.first[d.L] = row;
  return x;
}
std::vector<int32_t> download_from(const kernels::Backend& be, const Saved& s, const Dims& d) {
  std::vector<int32_t> from(d.P * d.L);
  be.download(from.data(), s.from, sizeof(int32_t) * from.size());
  return from;
}

// Expert side: rows (expert-major, `width` floats each) to the ranks they came from, each rank's
// rows in the order it sent them.
void send_back(const kernels::Backend& be, char* send, const float* rows, int64_t width, const ExpertRows& x,
               const Dims& d) {
  const Routed io{be, d.P};
  std::vector<int64_t> bytes(d.P, 0);
  for (int64_t q = 0; q < d.P; ++q)
    for (int64_t j = 0; j < d.L; ++j) bytes[q] += 4 * x.count[q][j] * width;
  io.write_sizes(send, bytes);
  const std::vector<int64_t> start = io.starts(bytes);
  for (int64_t q = 0; q < d.P; ++q) {
    char* out = send + start[q];
    for (int64_t j = 0; j < d.L; ++j) {
      const int64_t n = 4 * x.count[q][j] * width;
      be.copy(out, rows + x.at[q][j] * width, n);
      out += n;
    }
  }
}

// Expert side: the rows each rank sent (payloads of `skip` bytes of counts, then rows in their
// expert order), expert-major.
void take_rows(const kernels::Backend& be, float* rows, const char* recv, int64_t skip, int64_t width,
               const ExpertRows& x, const Dims& d) {
  const Routed io{be, d.P};
  const std::vector<int64_t> start = io.starts(io.sizes(recv));
  for (int64_t q = 0; q < d.P; ++q) {
    const char* in = recv + start[q] + skip;
    for (int64_t j = 0; j < d.L; ++j) {
      const int64_t n = 4 * x.count[q][j] * width;
      be.copy(rows + x.at[q][j] * width, in, n);
      in += n;
    }
  }
}

// Token side: the header of rows in dispatch order going to (or coming back from) each expert
// rank, `extra` bytes before each rank's rows.
std::vector<int64_t> rows_per_rank(const std::vector<int32_t>& off, int64_t width, int64_t extra, const Dims& d) {
  std::vector<int64_t> bytes(d.P);
  for (int64_t p = 0; p < d.P; ++p) bytes[p] = extra + 4 * width * (off[(p + 1) * d.L] - off[p * d.L]);
  return bytes;
}

// ---- the forward, stage by stage

// Stage 0 (token side): the attention half, the router, and the routed rows of ln2 to the
// ranks of their experts.
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

std::vector<int32_t> dispatch(const kernels::Backend& be, const Block& p, const Saved& s, const Recomputable& r,
                              const ForwardWs& w, char* send, const Dims& d) {
  be.dense_forward(s.logits, r.ln2, p.gate, d.BT, d.C, d.E);
  be.moe_router_forward(w.probs, w.router_lse, s.expert, s.weight, s.logits, d.BT, d.E, d.k, d.norm_topk);
  be.moe_dispatch(s.offsets, s.assigned, s.slot_row, s.row_token, s.expert, d.BT, d.E, d.k, d.capacity);
  const std::vector<int32_t> off = expert_offsets(be, s, d);
  const Routed io{be, d.P};
  const std::vector<int64_t> bytes = rows_per_rank(off, d.C, 8 * d.L, d);
  io.write_sizes(send, bytes);
  const std::vector<int64_t> start = io.starts(bytes);
  for (int64_t p = 0; p < d.P; ++p) {
    std::vector<int64_t> counts(d.L);
    for (int64_t j = 0; j < d.L; ++j) counts[j] = off[p * d.L + j + 1] - off[p * d.L + j];
    be.upload(send + start[p], counts.data(), 8 * d.L);
    const int64_t first = off[p * d.L], n = off[(p + 1) * d.L] - first;
    be.moe_gather_rows(reinterpret_cast<float*>(send + start[p] + 8 * d.L), r.ln2, s.row_token + first, n, d.C);
  }
  return off;
}

// Stage 1 (expert side): the received rows, expert-major, through this rank's experts (the GEMMs
// of all its experts at once, per projection), and their outputs back to the ranks they came from.
ExpertRows receive_rows(const kernels::Backend& be, const char* recv, const Saved& s, const Dims& d) {
  const Routed io{be, d.P};
  const std::vector<int64_t> start = io.starts(io.sizes(recv));
  std::vector<int32_t> from(d.P * d.L);
  for (int64_t q = 0; q < d.P; ++q) {
    std::vector<int64_t> counts(d.L);
    be.download(counts.data(), recv + start[q], 8 * d.L);
    for (int64_t j = 0; j < d.L; ++j) from[q * d.L + j] = static_cast<int32_t>(counts[j]);
  }
  be.upload(s.from, from.data(), sizeof(int32_t) * from.size());
  const ExpertRows x = expert_rows(from, d);
  take_rows(be, s.xs, recv, 8 * d.L, d.C, x, d);
  return x;
}

// `experts`: this rank's slice of the experts unit, its L experts.
void experts_forward(const kernels::Backend& be, const float* experts, const Saved& s, const Recomputable& r,
                     float* ys, const ExpertRows& x, const Dims& d) {
  std::vector<const float*> gate_up(d.L), down(d.L);
  for (int64_t j = 0; j < d.L; ++j) gate_up[j] = expert_gate_up(d, experts, j), down[j] = expert_down(d, experts, j);
  be.grouped_dense_forward(s.gate_up, s.xs, gate_up.data(), x.first.data(), d.L, d.C, 2 * d.FE);
  be.swiglu_forward(r.act, s.gate_up, x.first[d.L], d.FE);
  be.grouped_dense_forward(ys, r.act, down.data(), x.first.data(), d.L, d.FE, d.C);
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

struct Views {
  Dims d;
  Block p;
  Saved s;
  Recomputable r;
};
Views views(const UnitArgs& a) {
  const Dims d = dims(a);
  Carver cs(a.saved), cr(a.recomputable);
  const Saved s = carve_saved(cs, d);
  const Recomputable r = carve_recomputable(cr, d);
  return {d, block_view(*a.unit, a.params), s, r};
}

// One stage of the forward (stats: the routing's figures are recorded, as a forward does and a
// rebuild does not).
void forward_stage(const UnitArgs& a, int stage, bool stats) {
  const kernels::Backend& be = *a.backend;
  const auto [d, p, s, r] = views(a);
  Carver cw(a.forward_ws);
  const ForwardWs w = carve_forward_ws(be, cw, d);
  if (stage == 0) {
    attention_forward(be, p, a.in, s, r, w.rope, d);
    const std::vector<int32_t> off = dispatch(be, p, s, r, w, a.send, d);
    if (stats) record(a, s, w, off, d);
  } else if (stage == 1) {
    const ExpertRows x = receive_rows(be, a.recv, s, d);
    experts_forward(be, a.borrowed_params, s, r, w.ys, x, d);
    send_back(be, a.send, w.ys, d.C, x, d);
  } else {  // stage 2 (token side): the experts' outputs, in dispatch order, weighted into the residual
    const std::vector<int32_t> off = expert_offsets(be, s, d);
    be.copy(s.ys, a.recv + Routed{be, d.P}.header(), sizeof(float) * off[d.E] * d.C);
    be.moe_combine(a.out, s.res1, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);
  }
}

// The whole pass in one call (a unit task of one process, as the layers tests run it): the
// stages back to back through a routed-rows buffer of its own.
template <class Stage>
void whole_pass(const UnitArgs& a, bool reverse, Stage stage) {
  if (a.peers != 1) throw std::logic_error("moe block: a pass over " + std::to_string(a.peers) + " ranks runs as stages");
  const Dims d = dims(a);
  const kernels::Backend& be = *a.backend;
  Buffer x0 = be.alloc(MemCategory::comm, model::moe_exchange_bound(*a.desc, d.BT, 1), Buffer::Fill::none);
  Buffer x1 = be.alloc(MemCategory::comm, model::moe_exchange_bound(*a.desc, d.BT, 1), Buffer::Fill::none);
  UnitArgs b = a;
  for (int i = 0; i < 3; ++i) {
    const int st = reverse ? 2 - i : i;
    b.recv = i == 0 ? nullptr : (i == 1 ? x0.as<char>() : x1.as<char>());
    b.send = i == 2 ? nullptr : (i == 0 ? x0.as<char>() : x1.as<char>());
    stage(b, st);
  }
}

void block_forward(const UnitArgs& a) {
  if (a.stage < 0) return whole_pass(a, false, [](const UnitArgs& b, int st) { forward_stage(b, st, true); });
  forward_stage(a, a.stage, true);
}

// Selective (one task, every stage's part on this rank): the norms and the experts' SwiGLU. Full:
// the forward again, stage by stage.
void block_recompute(const UnitArgs& a, model::Recompute mode) {
  if (mode == model::Recompute::full) {
    if (a.stage < 0) return whole_pass(a, false, [](const UnitArgs& b, int st) { forward_stage(b, st, false); });
    return forward_stage(a, a.stage, false);
  }
  const kernels::Backend& be = *a.backend;
  const auto [d, p, s, r] = views(a);
  const ExpertRows x = expert_rows(download_from(be, s, d), d);
  be.rmsnorm_forward(r.ln1, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  be.rmsnorm_forward(r.ln2, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  be.swiglu_forward(r.act, s.gate_up, x.first[d.L], d.FE);
}

// ---- the backward, stage by stage (2, 1, 0)

// Stage 1 backward (expert side): d expert outputs -> d received rows, into the experts' grads.
void experts_backward(const kernels::Backend& be, const float* experts, float* g_experts, const Saved& s,
                      const Recomputable& r, const BackwardWs& w, const ExpertRows& x, const Dims& d) {
  const int64_t rows = x.first[d.L];
  be.zero(w.dact, sizeof(float) * rows * d.FE);
  be.zero(w.dgate_up, sizeof(float) * rows * 2 * d.FE);
  be.zero(w.dxs, sizeof(float) * rows * d.C);
  // An idle expert (no rows) keeps its gradient as it was.
  std::vector<const float*> gate_up(d.L), down(d.L);
  std::vector<float*> g_gate_up(d.L), g_down(d.L);
  for (int64_t j = 0; j < d.L; ++j) {
    gate_up[j] = expert_gate_up(d, experts, j), down[j] = expert_down(d, experts, j);
    g_gate_up[j] = mut(expert_gate_up(d, g_experts, j)), g_down[j] = mut(expert_down(d, g_experts, j));
  }
  be.grouped_dense_backward(w.dact, g_down.data(), w.dys, r.act, down.data(), x.first.data(), d.L, d.FE, d.C);
  be.swiglu_backward(w.dgate_up, w.dact, s.gate_up, rows, d.FE);
  be.grouped_dense_backward(w.dxs, g_gate_up.data(), w.dgate_up, s.xs, gate_up.data(), x.first.data(), d.L, d.C,
                            2 * d.FE);
}

void backward_stage(const UnitArgs& a, int stage) {
  const kernels::Backend& be = *a.backend;
  const auto [d, p, s, r] = views(a);
  Carver cw(a.backward_ws);
  const BackwardWs w = carve_backward_ws(be, cw, d, a.threads);
  const Routed io{be, d.P};
  if (stage == 2) {  // token side: d out -> d routing weights, and d expert outputs to their experts
    const std::vector<int32_t> off = expert_offsets(be, s, d);
    const std::vector<int64_t> bytes = rows_per_rank(off, d.C, 0, d);
    io.write_sizes(a.send, bytes);
    float* dys = reinterpret_cast<float*>(a.send + io.header());  // dispatch order: ranks in expert order
    be.zero(dys, sizeof(float) * off[d.E] * d.C);
    be.zero(w.dweight, sizeof(float) * d.BT * d.k);
    be.moe_combine_backward(dys, w.dweight, a.dx, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);
    return;
  }
  if (stage == 1) {
    const ExpertRows x = expert_rows(download_from(be, s, d), d);
    take_rows(be, w.dys, a.recv, 0, d.C, x, d);
    experts_backward(be, a.borrowed_params, a.borrowed_grads, s, r, w, x, d);
    send_back(be, a.send, w.dxs, d.C, x, d);
    return;
  }
  // Stage 0 (token side): d dispatched rows back to tokens, the router (top-k weights, aux and
  // z-loss), the norm, then the attention half as llama's.
  const float* dxs = reinterpret_cast<const float*>(a.recv + io.header());
  const auto& c = a.desc->config;
  const int64_t BT = d.BT, C = d.C;
  float* dres = a.dx;  // d out on entry; the residual passes it through unchanged
  be.zero(w.dln, sizeof(float) * BT * C);
  be.zero(w.dlogits, sizeof(float) * BT * d.E);
  be.moe_gather_rows_backward(w.dln, dxs, s.slot_row, BT, d.k, C);
  be.moe_router_probs(w.probs, w.router_lse, s.logits, BT, d.E);
  be.moe_router_backward(w.dlogits, w.dweight, w.probs, w.router_lse, s.expert, s.weight, s.assigned, BT, d.E, d.k,
                         d.norm_topk, static_cast<float>(c.aux_loss_coef * a.group_weight),
                         static_cast<float>(c.z_loss_coef * a.group_weight));
  const Block g = block_view(*a.unit, a.grads);
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

void block_backward(const UnitArgs& a) {
  if (a.stage < 0) return whole_pass(a, true, [](const UnitArgs& b, int st) { backward_stage(b, st); });
  backward_stage(a, a.stage);
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  const Dims d = dims_of(desc, shape.B, shape.T, shape.ep);
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
