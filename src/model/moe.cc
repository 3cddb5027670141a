// Sparse mixture of experts (Mixtral style): LLaMA's embedding, head and dense blocks, and in every
// moe_every-th block a router over E SwiGLU experts in place of the MLP. The experts of a block
// are a unit of their own (kind moe_experts, state only, right after the block), borrowed by the
// block, so their state can be placed over other mesh axes than the dense weights. They are laid
// out expert after expert (w1, w3, w2 each), so a contiguous range of the unit is a contiguous
// group of experts.
#include "model/model.h"

#include <algorithm>
#include <cmath>

namespace shardlm::model {

using detail::add_param;
using detail::slice;

// An expert takes each of a group's tokens at most once, so a capacity of `tokens` is dropless:
// compared in double before the conversion, a factor of any size saturates there (converting
// 1e18 tokens' worth or more overflowed, to a negative capacity that dropped every token).
int64_t ModelConfig::expert_capacity(int64_t tokens) const {
  if (capacity_factor <= 0 || tokens <= 0) return tokens;
  const double cap = std::ceil(capacity_factor * static_cast<double>(tokens) * static_cast<double>(top_k) /
                               static_cast<double>(n_experts));
  if (!(cap < static_cast<double>(tokens))) return tokens;
  return std::max<int64_t>(1, static_cast<int64_t>(cap));  // a product underflowing to 0 still leaves one
}

int64_t ModelConfig::routed_rows_bound(int64_t tokens, int64_t group) const {
  return std::min(tokens * top_k, n_experts * expert_capacity(group > 0 ? group : tokens));
}

int64_t ModelConfig::expert_rows_bound(int64_t tokens, int64_t ranks, int64_t group) const {
  return ranks * std::min(routed_rows_bound(tokens, group), n_experts / ranks * expert_capacity(group > 0 ? group : tokens));
}

int64_t moe_exchange_bound(const ModelDesc& desc, int64_t tokens, int64_t ranks, int64_t group) {
  const ModelConfig& c = desc.config;
  return exchange_header_bytes(ranks) + 8 * c.n_experts + 4 * c.n_embd * c.expert_rows_bound(tokens, ranks, group);
}

int64_t moe_count_bytes(const ModelDesc& desc, const Shape& s) {
  const int64_t chunks = s.cp_impl == ContextImpl::ring ? 2 : 1;
  return 4 * s.B * chunks * desc.config.n_experts;
}

namespace {

void add_moe_block(ModelDesc& d, int l) {
  const auto& config = d.config;
  const int64_t C = config.n_embd, E = config.n_experts, FE = config.moe_ffn_dim;
  const ParamInit normal{0.02f, 0.0f};
  UnitDesc b;
  b.kind = UnitKind::moe_block;
  b.layer = l;
  b.name = "layers." + std::to_string(l);
  const std::string p = "model." + b.name + ".";
  add_llama_attention(b, config, p);
  add_param(b, p + "block_sparse_moe.gate.weight", {E, C}, true, normal);
  b.reads = {l + 1};
  b.writes = l + 2;
  b.borrows = static_cast<int>(d.units.size()) + 1;
  d.values.push_back({"x." + std::to_string(l + 1), false});
  d.units.push_back(std::move(b));

  UnitDesc x;
  x.kind = UnitKind::moe_experts;
  x.layer = l;
  x.name = "layers." + std::to_string(l) + ".experts";
  x.sliced_over = Split::experts;
  // w1 (gate) and w3 (up) adjacent: one (2 FE, C) matrix per expert, one GEMM.
  for (int64_t j = 0; j < E; ++j) {
    const std::string e = p + "block_sparse_moe.experts." + std::to_string(j) + ".";
    add_param(x, e + "w1.weight", {FE, C}, true, normal);
    add_param(x, e + "w3.weight", {FE, C}, true, normal);
    add_param(x, e + "w2.weight", {C, FE}, true, normal);
  }
  d.units.push_back(std::move(x));
}

// A MoE block whose sequences are split over s.cp > 1 ranks: the attention half's stages as a
// LLaMA block's (ring or all-to-all; its last stage goes on through the projection, the norm and
// the router), then the routing group's counts over cp (moe_count_bytes, every rank's to every
// rank: an all-to-all of one payload repeated), then the dispatch, the experts and the combine
// with the routed rows over ep between them as without cp. The backward needs no counts exchange:
// the forward leaves the group's counts in the saved routing.
void moe_over_context(UnitCosts& u, const ModelDesc& desc, const Shape& s, const Exchange& routed, double load,
                      double experts, double combine) {
  const auto& c = desc.config;
  const double bt = static_cast<double>(s.B * s.T);
  const int64_t C = c.n_embd, HS = c.head_size(), QKV = (c.n_head + 2 * c.n_kv_head) * HS, E = c.n_experts;
  const double qkv_flops = 2 * bt * C * QKV, rest = 2 * bt * C * C + 2 * bt * C * E;  // projection, router
  const double total = u.forward_flops + combine;
  const double attention = u.attention_flops;
  const bool ring = s.cp_impl == ContextImpl::ring;
  if (ring) detail::ring_attention_over_context(u, s, 2 * c.n_kv_head * HS, qkv_flops);
  else detail::split_attention_over_context(u, s, QKV, C, qkv_flops);
  const int A = u.stages();  // the attention half's
  u.stage_share.assign(A + 3, 0.0);
  u.stage_share[0] = qkv_flops / total;
  for (int i = 1; i < A; ++i) u.stage_share[i] = ring ? attention / s.cp / total : (i == 1 ? attention / total : 0.0);
  u.stage_share[A - 1] += rest / total;
  u.stage_share[A + 1] = experts / total;  // stage A (the dispatch) moves rows: no FLOPs
  u.stage_share[A + 2] = combine / total;
  u.stage_load.assign(A + 3, 1.0);
  u.stage_load[A + 1] = load;
  if (ring) {  // the ring's backward has stages of its own (ring_backward_stage); the MoE half's follow
    using Role = RingBackwardStage::Role;
    const int Ab = u.stages(true);
    u.backward_stage_share.assign(Ab + 3, 0.0);
    for (int b = 0; b < Ab; ++b) {
      const RingBackwardStage st = ring_backward_stage(b, static_cast<int>(s.cp));
      if (st.role == Role::compute) u.backward_stage_share[b] = attention / s.cp / total;
      if (st.role == Role::home) u.backward_stage_share[b] = qkv_flops / total;
    }
    u.backward_stage_share[Ab] = rest / total;  // the token side: the router and the projection
    u.backward_stage_share[Ab + 1] = experts / total;
    u.backward_stage_share[Ab + 2] = combine / total;
    u.backward_stage_load.assign(Ab + 3, 1.0);
    u.backward_stage_load[Ab + 1] = load;
  }
  const int64_t counts = moe_count_bytes(desc, s);
  u.forward_workspace += slice(counts / 4, 4);  // the group's slots before each of this rank's chunks, per expert
  if (u.backward_exchanges.empty()) u.backward_exchanges = u.exchanges;
  Exchange group{Split::sequence, exchange_header_bytes(s.cp) + s.cp * counts, (s.cp - 1) * counts};
  group.carries = "routing counts of the cp group";
  u.exchanges.push_back(group);
  u.backward_exchanges.push_back(Exchange{Split::sequence, 0, 0, Exchange::Route::none});
  for (int i = 0; i < 2; ++i) u.exchanges.push_back(routed), u.backward_exchanges.push_back(routed);
}

}  // namespace

ModelDesc describe_moe(const ModelConfig& config) {
  ModelDesc d;
  d.config = config;
  add_llama_embedding(d);
  for (int l = 0; l < config.n_layer; ++l) {
    if (config.is_moe_layer(l)) add_moe_block(d, l);
    else add_llama_block(d, l);
  }
  add_llama_head(d);
  return d;
}

UnitCosts moe_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s) {
  if (unit.kind == UnitKind::moe_experts) return {};  // its work is its block's
  if (unit.kind != UnitKind::moe_block) return llama_costs(desc, unit, s);
  const auto& c = desc.config;
  const int64_t B = s.B, T = s.T, BT = B * T, C = c.n_embd, NH = c.n_head, e = s.elem;
  const int64_t HS = c.head_size(), QKV = (c.n_head + 2 * c.n_kv_head) * HS;
  // A routing group is the data-parallel micro-batch: its B sequences whole, G tokens, however
  // many cp ranks hold them (each T of a sequence's T·cp positions).
  const int64_t G = BT * s.cp;
  const int64_t E = c.n_experts, k = c.top_k, FE = c.moe_ffn_dim, R = c.routed_rows_bound(BT, G);
  const int64_t P = s.ep, L = E / P, RL = c.expert_rows_bound(BT, P, G);
  const double bt = static_cast<double>(BT), routed = bt * static_cast<double>(k);
  UnitCosts u;
  const double gemm = 2 * bt * (C * QKV + C * C + C * E) + 2 * routed * (C * 2 * FE + FE * C);
  // Causal half (bidirectional: all); split over cp ranks, each does 1/cp of it.
  const double attention = (c.causal ? 2 : 4) * bt * (T * s.cp) * C;
  u.forward_flops = gemm + attention;
  u.attention_flops = attention;
  u.backward_flops = 2 * u.forward_flops;
  u.gemms = {{BT, C, QKV}, {BT, C, C}, {BT, C, E}, {BT * k, C, 2 * FE}, {BT * k, FE, C}};
  // Three stages (token side, expert side, token side) with the routed rows exchanged over ep
  // between them; balanced routing sends every routed row once, and the busiest rank of the group
  // takes `load` times its share (all-to-all: the group finishes with the rank that receives
  // most, dispatching, or sends most, combining): the hottest expert's rows at expert_load times
  // the mean and its L − 1 neighbours' at the mean, at most all P ranks' rows.
  const double hottest = std::max(1.0, s.expert_load);
  const double load = P > 1 ? std::min((hottest + static_cast<double>(L - 1)) / static_cast<double>(L), static_cast<double>(P)) : 1.0;
  const int64_t bound = moe_exchange_bound(desc, BT, P, G);
  const int64_t moved = 8 * E + static_cast<int64_t>(std::llround(load * static_cast<double>(4 * C * R)));
  const model::Exchange x{Split::experts, bound, std::min(bound, moved)};
  u.exchanges = {x, x};
  u.stage_load = {1.0, load, 1.0};
  const double experts = 2 * routed * (C * 2 * FE + FE * C), combine = 2 * routed * C;
  const double total = u.forward_flops + combine;
  u.stage_share = {(u.forward_flops - experts) / total, experts / total, combine / total};
  u.selective_recompute_flops = 2 * 4 * bt * C + 6 * routed * FE;  // two RMSNorms, the experts' SwiGLU
  // Norms, rotary q/k, SwiGLU as llama; router softmax over E; dispatch gather, weighted combine.
  u.pointwise_bytes = (2 * 2 * BT * C + 2 * 2 * BT * C + 2 * (BT * (NH + c.n_kv_head) * HS) + 3 * R * FE +
                       2 * R * C + R * C + 2 * BT * C) * e +
                      3 * BT * E * 4;
  u.output_bytes = slice(BT * C, e);
  // Under --act-quant the GEMM inputs among them are int8 + scales where they are kept.
  const int64_t gs = s.act_quant.saved_int8(s.recompute) ? s.act_quant.group : 0;
  const int64_t gr = s.act_quant.recomputable_int8(s.recompute) ? s.act_quant.group : 0;
  // Kept: q|k|v after rotation, attention output, its log-sum-exp, residual 1; router logits, the
  // routing (expert, weight and dispatch row of each token's k slots; each row's token; offsets
  // and assigned counts per expert); each routed row's expert output; on the expert side, the rows
  // from each rank for each local expert, the rows received and their gate|up.
  u.saved_bytes = detail::kept_input(BT * QKV, e, gs) + detail::kept_input(BT * C, e, gs) + slice(B * NH * T, 4) +
                  slice(BT * C, e) + slice(BT * E, 4) + 3 * slice(BT * k, 4) + slice(R, 4) + slice(E + 1, 4) +
                  slice(E, 4) + slice(R * C, e) + slice(P * L, 4) + detail::kept_input(RL * C, e, gs) +
                  slice(RL * 2 * FE, e);
  // Recomputable: both norms' outputs and rstd, the experts' SwiGLU output. Forward scratch: the
  // rope table, the router's probabilities and log-sum-exp, the expert side's outputs.
  u.recomputable_bytes = 2 * (detail::kept_input(BT * C, e, gr) + slice(BT, 4)) + detail::kept_input(RL * FE, e, gr);
  const int64_t rope_table = slice(T * s.cp * HS, 4);  // every position of the sequence
  const int64_t router = slice(BT * E, 4) + slice(BT, 4);  // probabilities and log-sum-exp
  u.forward_workspace = rope_table + router + slice(RL * C, e);
  // Backward scratch: d norm out, d attention out, d qkv; on the expert side d expert out,
  // d SwiGLU out, d gate|up, d received rows; d routing weights, router probabilities, log-sum-exp, d logits;
  // attention tiles, rope table.
  u.backward_workspace = slice(BT * C, e) + slice(BT * C, e) + slice(BT * QKV, e) + slice(RL * C, e) +
                         slice(RL * FE, e) + slice(RL * 2 * FE, e) + slice(RL * C, e) + slice(BT * k, 4) + router +
                         slice(BT * E, 4) + slice(detail::attention_backward_scratch_floats(HS, s.threads), 4) +
                         rope_table;
  if (gs > 0) {  // as LLaMA's block: fp32 scratch for the compressed values in both passes
    const int64_t wide = std::max(BT * QKV, RL * std::max(C, FE));
    u.forward_workspace += slice(BT * C, e) + slice(wide, e);
    u.backward_workspace += slice(wide, e) + slice(BT * C, e);
    u.pointwise_bytes += (BT * (QKV + C) + R * C + (gr > 0 ? 2 * BT * C + R * FE : 0)) * (e + 1);
  }
  if (s.cp > 1) moe_over_context(u, desc, s, x, load, experts, combine);
  return u;
}

}  // namespace shardlm::model
