// The mixture-of-experts block: LLaMA's attention half, then a sparse MoE MLP, as a pass of three
// stages with the routed rows exchanged between them over the ep axis (model::Exchange):
//  0. token side: attention; RMSNorm, router (linear, no bias), fp32 softmax, top-k, capacity; the
//     routed rows in expert order, each expert rank's share (its experts' counts, then rows) sent;
//  1. expert side: the rows every rank sent, expert-major; each local expert's SwiGLU MLP as GEMMs
//     on its contiguous rows; the outputs back to the ranks they came from;
//  2. token side: the outputs, in dispatch order, weighted by the routing weights into the residual.
// The backward runs the stages in reverse (2, 1, 0) and adds the load-balancing and z-loss
// gradients, each weighted by its coefficient and UnitArgs::group_weight. With one rank the
// exchanges are left out: each stage reads what the one before it sent.
// Under context parallelism (cp ranks each holding T of a sequence's T·cp positions) the attention
// half runs as a LLaMA block's split attention (layers/context.h: A = cp + 1 stages for a ring, 3
// for the all-to-all form), its last stage going on through the router and sending this rank's
// routing counts to the cp group; then stage A dispatches with the group's counts (the routing
// group stays the data-parallel micro-batch: the load-balancing loss, the z-loss and the capacity
// are the whole sequences'), and stages A + 1, A + 2 are stages 1 and 2 above. The experts' weights are
// the borrowed unit (moe_experts: w1|w3 (2 FE, C) then w2 (C, FE) per expert): a rank gets
// the slice of its L = E / P experts (rank `peer` of P holds experts peer·L .. peer·L + L − 1).
#include <algorithm>
#include <vector>

#include "kernels/backend.h"
#include "layers/context.h"
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
  float eps;
  kernels::Rope rope;
  bool norm_topk;
  // Expert parallelism: P ranks, each running L = E / P experts on at most RL rows (the rows all
  // P ranks could route to them).
  int64_t P, L, RL;
  // Context parallelism: K ranks hold each sequence (this rank T of its T·K positions), as a ring
  // or heads split by an all-to-all; the routing group has G = BT·K tokens, and this rank holds
  // `chunks` chunks of `chunk_rows` positions of each sequence.
  int64_t K = 1, G = 0;
  bool ring = false;
  int64_t chunks = 1, chunk_rows = 0;
  // --act-quant: the group of the saved / recomputable buffers' GEMM inputs (0: fp32).
  int64_t gs = 0, gr = 0;
  bool heads_split() const { return K > 1 && !ring; }
  // The fp32 scratch a compressed q|k|v or expert-side row block passes through.
  int64_t wide() const { return std::max(BT * QKV, RL * std::max(C, FE)); }
  // Stages of the attention half under cp, in the forward and in the backward.
  int A(bool backward = false) const {
    if (!ring) return 3;
    return backward ? model::ring_backward_stage_count(static_cast<int>(K)) : static_cast<int>(K) + 1;
  }
};
Dims dims_of(const model::ModelDesc& desc, int64_t B, int64_t T, int64_t P, int64_t K, model::ContextImpl impl,
             const model::ActQuant& q, model::Recompute mode) {
  const auto& c = desc.config;
  const int64_t HS = c.head_size(), BT = B * T, G = BT * K;
  const int64_t L = c.n_experts / P;
  const bool ring = K > 1 && impl == model::ContextImpl::ring;
  return {B,           T,       BT, c.n_embd, c.n_head, c.n_kv_head, HS, (c.n_head + 2 * c.n_kv_head) * HS,
          c.n_experts, c.top_k, c.moe_ffn_dim, c.routed_rows_bound(BT, G), c.expert_capacity(G),
          static_cast<float>(c.norm_eps), context::rope_of(c), c.norm_topk,
          P, L, c.expert_rows_bound(BT, P, G), K, G, ring, ring ? 2 : 1, ring ? T / 2 : T,
          q.saved_int8(mode) ? q.group : 0, q.recomputable_int8(mode) ? q.group : 0};
}
Dims dims(const UnitArgs& a) { return dims_of(*a.desc, a.B, a.T, a.peers, a.cp, a.cp_impl, a.act_quant, a.recompute); }

// Expert j's w1|w3 (2 FE, C) and w2 (C, FE) inside the experts unit's flat buffer.
const float* expert_gate_up(const Dims& d, const float* experts, int64_t j) { return experts + j * 3 * d.FE * d.C; }
const float* expert_down(const Dims& d, const float* experts, int64_t j) { return experts + (j * 3 + 2) * d.FE * d.C; }

// Token side: this rank's micro-batch. Expert side: the rows its L experts received.
struct Saved {
  Kept qkv;     // (B, T, QKV) after rotation
  Kept atty;    // (B, T, C)
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
  Kept xs;             // (RL, C) expert side: received rows, expert-major
  float* gate_up;      // (RL, 2 FE)
  float* out_split = nullptr;  // heads split over cp: this rank's heads' attention output (B, T·K, C / K)
  float* kv_last = nullptr;    // a ring: the last key/value block the forward attended to (B, T, 2·NKV·HS)
};
Saved carve_saved(Carver& cv, const Dims& d) {
  Saved s;
  s.qkv = take_kept(cv, d.BT * d.QKV, d.gs);
  s.atty = take_kept(cv, d.BT * d.C, d.gs);
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
  s.xs = take_kept(cv, d.RL * d.C, d.gs);
  s.gate_up = cv.take<float>(d.RL * 2 * d.FE);
  if (d.heads_split()) s.out_split = cv.take<float>(d.BT * d.C);
  if (d.ring) s.kv_last = cv.take<float>(d.BT * 2 * d.NKV * d.HS);
  return s;
}
struct Recomputable {
  Kept ln1;      // (B, T, C)
  float* rstd1;  // (B, T)
  Kept ln2;      // the router's input and the rows dispatched
  float* rstd2;
  Kept act;  // (RL, FE) expert side
};
Recomputable carve_recomputable(Carver& cv, const Dims& d) {
  Recomputable r;
  r.ln1 = take_kept(cv, d.BT * d.C, d.gr);
  r.rstd1 = cv.take<float>(d.BT);
  r.ln2 = take_kept(cv, d.BT * d.C, d.gr);
  r.rstd2 = cv.take<float>(d.BT);
  r.act = take_kept(cv, d.RL * d.FE, d.gr);
  return r;
}
struct ForwardWs {
  float *rope, *probs, *router_lse, *ys;  // ys: (RL, C) expert side, expert-major
  float* qkv = nullptr;      // heads split over cp: this rank's rows' q|k|v before they go to the head split
  int32_t* taken = nullptr;  // under cp: per sequence and chunk here, the group's slots before it per expert
};
ForwardWs carve_forward_ws(const kernels::Backend& be, Carver& cv, const Dims& d) {
  ForwardWs w;
  w.rope = cv.take<float>(be.rope_table_floats(d.T * d.K, d.HS));
  w.probs = cv.take<float>(d.BT * d.E);
  w.router_lse = cv.take<float>(d.BT);
  w.ys = cv.take<float>(d.RL * d.C);
  if (d.heads_split()) w.qkv = cv.take<float>(d.BT * d.QKV);
  if (d.K > 1) w.taken = cv.take<int32_t>(d.B * d.chunks * d.E);
  return w;
}
// --act-quant: the forward's fp32 forms of the compressed values, in two scratch slices after the
// forward's own. On the token side norm 1's output, the attention output and norm 2's take turns
// in the narrow one, q|k|v has the wide one; on the expert side the received rows, then the
// SwiGLU output, take turns in the wide one. Each is stored before the next is written.
void carve_quant_forward(Carver& cv, const Dims& d, Saved& s, Recomputable& r) {
  if (d.gs == 0) return;
  float* narrow = cv.take<float>(d.BT * d.C);
  float* wide = cv.take<float>(d.wide());
  s.qkv.f = wide, s.atty.f = narrow, s.xs.f = wide;
  if (d.gr > 0) r.ln1.f = narrow, r.ln2.f = narrow, r.act.f = wide;
}
struct BackwardWs {
  float *dln, *datty, *dqkv, *dys, *dact, *dgate_up, *dxs, *dweight, *probs, *router_lse, *dlogits, *attention, *rope;
  float *dout_split = nullptr, *dqkv_split = nullptr;  // heads split over cp: the head split's gradients
  float *wide = nullptr, *narrow = nullptr;  // --act-quant: dequantized inputs (the attention output in narrow)
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
  w.rope = cv.take<float>(be.rope_table_floats(d.T * d.K, d.HS));
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

// From the attention output to the router's input: projection, residual, norm.
void post_attention_forward(const UnitArgs& a, const Block& p, const Saved& s, const Recomputable& r, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.dense_forward(s.res1, s.atty.f, p.o, d.BT, d.C, d.C);
  store(a, s.atty, "attn");
  be.residual_forward(s.res1, s.res1, a.in, d.BT * d.C);
  be.rmsnorm_forward(r.ln2.f, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
}

// Stage 0 (token side): the attention half, the router, and the routed rows of ln2 to the
// ranks of their experts.
void attention_forward(const UnitArgs& a, const Block& p, const Saved& s, const Recomputable& r, float* rope,
                       const Dims& d) {
  const kernels::Backend& be = *a.backend;
  be.rmsnorm_forward(r.ln1.f, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  be.dense_forward(s.qkv.f, r.ln1.f, p.qkv, d.BT, d.C, d.QKV);
  store(a, r.ln1, "input_layernorm");
  be.rope_table(rope, d.T, d.HS, d.rope);
  be.rope_forward(s.qkv.f, d.B, d.T, d.NH + d.NKV, d.HS, d.QKV, rope);
  be.attention_forward(s.atty.f, s.lse, s.qkv.f, d.B, d.T, d.NH, d.NKV, d.HS, a.desc->config.causal);
  store(a, s.qkv, "qkv");
  post_attention_forward(a, p, s, r, d);
}

void route(const kernels::Backend& be, const Block& p, const Saved& s, const Recomputable& r, const ForwardWs& w,
           const Dims& d) {
  be.dense_forward(s.logits, r.ln2.f, p.gate, d.BT, d.C, d.E);
  be.moe_router_forward(w.probs, w.router_lse, s.expert, s.weight, s.logits, d.BT, d.E, d.k, d.norm_topk);
}

// The routed rows in expert order (capacity counted after `taken`, moe_dispatch's), each expert
// rank's share sent.
std::vector<int32_t> dispatch(const kernels::Backend& be, const Saved& s, const Recomputable& r, const int32_t* taken,
                              char* send, const Dims& d) {
  be.moe_dispatch(s.offsets, s.assigned, s.slot_row, s.row_token, s.expert, d.BT, d.E, d.k, d.capacity, taken,
                  d.chunk_rows);
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
    be.moe_gather_rows(reinterpret_cast<float*>(send + start[p] + 8 * d.L), r.ln2.f, s.row_token + first, n, d.C);
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
  take_rows(be, s.xs.f, recv, 8 * d.L, d.C, x, d);
  return x;
}

// a.borrowed_params: this rank's slice of the experts unit, its L experts.
void experts_forward(const UnitArgs& a, const Saved& s, const Recomputable& r, float* ys, const ExpertRows& x,
                     const Dims& d) {
  const kernels::Backend& be = *a.backend;
  std::vector<const float*> gate_up(d.L), down(d.L);
  for (int64_t j = 0; j < d.L; ++j)
    gate_up[j] = expert_gate_up(d, a.borrowed_params, j), down[j] = expert_down(d, a.borrowed_params, j);
  const int64_t rows = x.first[d.L];  // received; the buffers are sized for the bound RL
  be.grouped_dense_forward(s.gate_up, s.xs.f, gate_up.data(), x.first.data(), d.L, d.C, 2 * d.FE);
  store(a, first_values(s.xs, rows * d.C), "expert_rows");
  be.swiglu_forward(r.act.f, s.gate_up, rows, d.FE);
  be.grouped_dense_forward(ys, r.act.f, down.data(), x.first.data(), d.L, d.FE, d.C);
  store(a, first_values(r.act, rows * d.FE), "expert_swiglu");
}

// ---- the routing group over cp (model::moe_count_bytes): this rank's slots per (sequence, chunk,
// expert) to every rank of the group, the same payload to each.

int64_t count_entries(const Dims& d) { return d.B * d.chunks * d.E; }

void send_counts(const kernels::Backend& be, char* send, const Saved& s, const Dims& d) {
  std::vector<int32_t> expert(d.BT * d.k);
  be.download(expert.data(), s.expert, sizeof(int32_t) * expert.size());
  std::vector<int32_t> counts(count_entries(d), 0);
  for (int64_t t = 0; t < d.BT; ++t) {
    const int64_t segment = t / d.chunk_rows;  // sequence-major, then the chunks in the order held
    for (int64_t j = 0; j < d.k; ++j) ++counts[segment * d.E + expert[t * d.k + j]];
  }
  const int64_t bytes = 4 * count_entries(d), header = model::exchange_header_bytes(d.K);
  be.upload(send, std::vector<int64_t>(d.K, bytes).data(), 8 * d.K);
  for (int64_t q = 0; q < d.K; ++q) be.upload(send + header + q * bytes, counts.data(), bytes);
}

// From every rank's counts: the group's slots per expert, and into `taken` (device) the group's
// slots before each of this rank's (sequence, chunk) segments in the group's token order
// (sequence-major, then position).
std::vector<int32_t> group_counts(const kernels::Backend& be, const UnitArgs& a, const char* recv, int32_t* taken,
                                  const Dims& d) {
  const int64_t n = count_entries(d), header = model::exchange_header_bytes(d.K);
  std::vector<int32_t> all(d.K * n);
  be.download(all.data(), recv + header, sizeof(int32_t) * all.size());
  const int64_t seq = d.T * d.K;
  std::vector<std::vector<int64_t>> starts(d.K);
  for (int q = 0; q < d.K; ++q) starts[q] = model::context_chunk_starts(seq, static_cast<int>(d.K), q, a.cp_impl);
  std::vector<int32_t> group(d.E, 0), before(n, 0);
  for (int64_t q = 0; q < d.K; ++q)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t c = 0; c < d.chunks; ++c) {
        const int32_t* cnt = all.data() + q * n + (b * d.chunks + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) group[e] += cnt[e];
        // Ahead of this rank's segment (b2, c2): every earlier sequence, and this sequence's
        // chunks at earlier positions.
        for (int64_t b2 = b; b2 < d.B; ++b2)
          for (int64_t c2 = 0; c2 < d.chunks; ++c2)
            if (b2 > b || starts[q][c] < starts[a.cp_index][c2])
              for (int64_t e = 0; e < d.E; ++e) before[(b2 * d.chunks + c2) * d.E + e] += cnt[e];
      }
  be.upload(taken, before.data(), sizeof(int32_t) * n);
  return group;
}

// `stage` under cp: the attention half's stages (A − 1 of them exchanging over cp); its last goes
// on through the router and sends this rank's counts.
void split_attention_forward(const UnitArgs& a, const Block& p, const Saved& s, const Recomputable& r,
                             const ForwardWs& w, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  const auto qkv_forward = [&](float* qkv) {
    be.rmsnorm_forward(r.ln1.f, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
    be.dense_forward(qkv, r.ln1.f, p.qkv, d.BT, d.C, d.QKV);
    store(a, r.ln1, "input_layernorm");
    be.rope_table(w.rope, d.T * d.K, d.HS, d.rope);
    context::rotate(be, qkv, a, d.QKV, d.NH + d.NKV, d.HS, w.rope, false);
  };
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, w.qkv};
  context::split_forward(a, at, qkv_forward, [&] {
    post_attention_forward(a, p, s, r, d);
    route(be, p, s, r, w, d);
    send_counts(be, a.send, s, d);
  });
}

// The routing's figures: this rank's part of the group's losses, and the group's expert loads.
void record(const UnitArgs& a, const Saved& s, const ForwardWs& w, const std::vector<int32_t>& off,
            const std::vector<int32_t>& group, const Dims& d) {
  if (!a.moe) return;
  const kernels::Backend& be = *a.backend;
  MoeStats m;
  double aux = 0, z = 0;
  be.moe_router_losses(&aux, &z, w.probs, w.router_lse, s.assigned, d.BT, d.E, d.k, d.G);
  m.aux_loss = a.group_weight * aux;
  m.z_loss = a.group_weight * z;
  m.routed = d.BT * d.k;
  m.dropped = m.routed - off[d.E];
  int64_t taken = 0;
  for (int64_t j = 0; j < d.E; ++j) {
    const int64_t n = d.K > 1 ? std::min<int64_t>(group[j], d.capacity) : off[j + 1] - off[j];
    m.min_load = m.min_load < 0 ? n : std::min(m.min_load, n);
    m.max_load = std::max(m.max_load, n);
    taken += n;
  }
  if (taken > 0) {  // the cp ranks of a group each count it: the mean over routings is unchanged
    m.imbalance_sum = static_cast<double>(m.max_load) * static_cast<double>(d.E) / static_cast<double>(taken);
    m.routings = 1;
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
  auto [d, p, s, r] = views(a);
  Carver cw(a.forward_ws);
  const ForwardWs w = carve_forward_ws(be, cw, d);
  carve_quant_forward(cw, d, s, r);
  const int m = d.K == 1 ? stage : stage - d.A();  // the MoE half's stage: 0 dispatch, 1 experts, 2 combine
  if (m < 0) {
    split_attention_forward(a, p, s, r, w, d);
  } else if (m == 0 && d.K == 1) {
    attention_forward(a, p, s, r, w.rope, d);
    route(be, p, s, r, w, d);
    const std::vector<int32_t> off = dispatch(be, s, r, nullptr, a.send, d);
    store(a, r.ln2, "post_attention_layernorm");
    if (stats) record(a, s, w, off, {}, d);
  } else if (m == 0) {
    // The group's counts: capacity after the group's earlier slots; the losses' f_e from the
    // group's slots (kept in `assigned` for the backward, in place of this rank's).
    const std::vector<int32_t> group = group_counts(be, a, a.recv, w.taken, d);
    const std::vector<int32_t> off = dispatch(be, s, r, w.taken, a.send, d);
    store(a, r.ln2, "post_attention_layernorm");  // kept in the forward scratch since the stage before
    be.upload(s.assigned, group.data(), sizeof(int32_t) * d.E);
    if (stats) record(a, s, w, off, group, d);
  } else if (m == 1) {
    const ExpertRows x = receive_rows(be, a.recv, s, d);
    experts_forward(a, s, r, w.ys, x, d);
    send_back(be, a.send, w.ys, d.C, x, d);
  } else {  // stage 2 (token side): the experts' outputs, in dispatch order, weighted into the residual
    const std::vector<int32_t> off = expert_offsets(be, s, d);
    be.copy(s.ys, a.recv + Routed{be, d.P}.header(), sizeof(float) * off[d.E] * d.C);
    if (a.out) be.moe_combine(a.out, s.res1, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);  // a rebuild writes no output
  }
}

// The whole pass in one call (a unit task of one process, as the layers tests run it): the
// stages back to back through a routed-rows buffer of its own.
template <class Stage>
void whole_pass(const UnitArgs& a, bool reverse, Stage stage) {
  if (a.peers != 1 || a.cp != 1)
    throw std::logic_error("moe block: a pass over " + std::to_string(a.peers * a.cp) + " ranks runs as stages");
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
  be.rmsnorm_forward(r.ln1.f, r.rstd1, a.in, p.in_norm, d.BT, d.C, d.eps);
  be.rmsnorm_forward(r.ln2.f, r.rstd2, s.res1, p.post_norm, d.BT, d.C, d.eps);
  be.swiglu_forward(r.act.f, s.gate_up, x.first[d.L], d.FE);
}

// ---- the backward, stage by stage (2, 1, 0)

// Stage 1 backward (expert side): d expert outputs -> d received rows, into the experts' grads
// (a.borrowed_params, a.borrowed_grads: this rank's slices).
void experts_backward(const UnitArgs& a, const Saved& s, const Recomputable& r, const BackwardWs& w,
                      const ExpertRows& x, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  const float* experts = a.borrowed_params;
  float* g_experts = a.borrowed_grads;
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
  be.grouped_dense_backward(w.dact, g_down.data(), w.dys, load(a, first_values(r.act, rows * d.FE), w.wide),
                            down.data(), x.first.data(), d.L, d.FE, d.C);
  be.swiglu_backward(w.dgate_up, w.dact, s.gate_up, rows, d.FE);
  be.grouped_dense_backward(w.dxs, g_gate_up.data(), w.dgate_up, load(a, first_values(s.xs, rows * d.C), w.wide),
                            gate_up.data(), x.first.data(), d.L, d.C, 2 * d.FE);
}

// Under cp, the attention half's backward stages (its own count, A(true), below the MoE half's) as
// a LLaMA block's: d attention output (w.datty, from the token side's stage) through the ring or
// the head split, then q|k|v's backward.
void split_attention_backward(const UnitArgs& a, const Block& p, const Block& g, const Saved& s,
                              const Recomputable& r, const BackwardWs& w, const Dims& d) {
  const kernels::Backend& be = *a.backend;
  auto qkv_backward = [&] {
    be.rope_table(w.rope, d.T * d.K, d.HS, d.rope);
    context::rotate(be, w.dqkv, a, d.QKV, d.NH + d.NKV, d.HS, w.rope, true);
    be.zero(w.dln, sizeof(float) * d.BT * d.C);
    be.dense_backward(w.dln, mut(g.qkv), w.dqkv, load(a, r.ln1, w.wide), p.qkv, d.BT, d.C, d.QKV);
    be.rmsnorm_backward(a.dx, mut(g.in_norm), w.dln, a.in, p.in_norm, r.rstd1, d.BT, d.C);  // a.dx: d in
  };
  // The token side's stage ran the projection's backward (nothing before the first block), which
  // under --act-quant leaves the attention output in w.narrow.
  const context::SplitAttention at{s.qkv, s.atty, s.lse, s.out_split, s.kv_last, nullptr};
  const context::SplitAttentionGrads ag{w.dqkv, w.datty, w.dout_split, w.dqkv_split, w.wide, w.narrow, w.attention};
  context::split_backward(a, at, ag, [] {}, qkv_backward);
}

void backward_stage(const UnitArgs& a, int stage) {
  const kernels::Backend& be = *a.backend;
  const auto [d, p, s, r] = views(a);
  Carver cw(a.backward_ws);
  const BackwardWs w = carve_backward_ws(be, cw, d, a.threads);
  const Routed io{be, d.P};
  const Block g = block_view(*a.unit, a.grads);
  const int m = d.K == 1 ? stage : stage - d.A(true);  // the MoE half's stage: 0 dispatch, 1 experts, 2 combine
  if (m < 0) return split_attention_backward(a, p, g, s, r, w, d);
  if (m == 2) {  // token side: d out -> d routing weights, and d expert outputs to their experts
    const std::vector<int32_t> off = expert_offsets(be, s, d);
    const std::vector<int64_t> bytes = rows_per_rank(off, d.C, 0, d);
    io.write_sizes(a.send, bytes);
    float* dys = reinterpret_cast<float*>(a.send + io.header());  // dispatch order: ranks in expert order
    be.zero(dys, sizeof(float) * off[d.E] * d.C);
    be.zero(w.dweight, sizeof(float) * d.BT * d.k);
    be.moe_combine_backward(dys, w.dweight, a.dx, s.ys, s.weight, s.slot_row, d.BT, d.k, d.C);
    return;
  }
  if (m == 1) {
    const ExpertRows x = expert_rows(download_from(be, s, d), d);
    take_rows(be, w.dys, a.recv, 0, d.C, x, d);
    experts_backward(a, s, r, w, x, d);
    send_back(be, a.send, w.dxs, d.C, x, d);
    return;
  }
  // Stage 0 (token side): d dispatched rows back to tokens, the router (top-k weights, aux and
  // z-loss of the routing group: its G tokens, `assigned` its counts), the norm, the projection,
  // then the attention half as llama's (under cp, in the stages before this one).
  const float* dxs = reinterpret_cast<const float*>(a.recv + io.header());
  const auto& c = a.desc->config;
  const int64_t BT = d.BT, C = d.C;
  float* dres = a.dx;  // d out on entry; the residual passes it through unchanged
  be.zero(w.dln, sizeof(float) * BT * C);
  be.zero(w.dlogits, sizeof(float) * BT * d.E);
  be.moe_gather_rows_backward(w.dln, dxs, s.slot_row, BT, d.k, C);
  be.moe_router_probs(w.probs, w.router_lse, s.logits, BT, d.E);
  be.moe_router_backward(w.dlogits, w.dweight, w.probs, w.router_lse, s.expert, s.weight, s.assigned, BT, d.E, d.k,
                         d.G, d.norm_topk, static_cast<float>(c.aux_loss_coef * a.group_weight),
                         static_cast<float>(c.z_loss_coef * a.group_weight));
  be.dense_backward(w.dln, mut(g.gate), w.dlogits, load(a, r.ln2, w.wide), p.gate, BT, C, d.E);
  be.rmsnorm_backward(dres, mut(g.post_norm), w.dln, s.res1, p.post_norm, r.rstd2, BT, C);
  // dres now holds d res1: the attention half, as llama's.
  be.zero(w.datty, sizeof(float) * BT * C);
  be.zero(w.dqkv, sizeof(float) * BT * d.QKV);
  be.zero(w.dln, sizeof(float) * BT * C);
  const float* atty = load(a, s.atty, w.narrow);  // kept for the attention's backward
  be.dense_backward(w.datty, mut(g.o), dres, atty, p.o, BT, C, C);
  if (d.K > 1) return;
  be.attention_backward(w.dqkv, w.datty, load(a, s.qkv, w.wide), atty, s.lse, d.B, d.T, d.NH, d.NKV, d.HS,
                        w.attention, a.desc->config.causal);
  be.rope_table(w.rope, d.T, d.HS, d.rope);
  be.rope_backward(w.dqkv, d.B, d.T, d.NH + d.NKV, d.HS, d.QKV, w.rope);
  be.dense_backward(w.dln, mut(g.qkv), w.dqkv, load(a, r.ln1, w.wide), p.qkv, BT, C, d.QKV);
  be.rmsnorm_backward(dres, mut(g.in_norm), w.dln, a.in, p.in_norm, r.rstd1, BT, C);
}

void block_backward(const UnitArgs& a) {
  if (a.stage < 0) return whole_pass(a, true, [](const UnitArgs& b, int st) { backward_stage(b, st); });
  backward_stage(a, a.stage);
}

Carved block_carved(const kernels::Backend& be, const model::ModelDesc& desc, const model::UnitDesc&,
                    const model::Shape& shape) {
  const Dims d = dims_of(desc, shape.B, shape.T, shape.ep, shape.cp, shape.cp_impl, shape.act_quant, shape.recompute);
  Carver cs(nullptr), cr(nullptr), cf(nullptr), cw(nullptr);
  Saved s = carve_saved(cs, d);
  Recomputable r = carve_recomputable(cr, d);
  carve_forward_ws(be, cf, d);
  carve_quant_forward(cf, d, s, r);
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
