// LLaMA: token embedding; pre-norm blocks (RMSNorm, rotary q/k in the rotate_half convention,
// grouped-query attention, SwiGLU MLP, Linear weights (out, in), no biases); final RMSNorm; an
// untied head (or tied: borrowing the embedding).
#include <algorithm>

#include "model/model.h"

namespace shardlm::model {

using detail::add_param;
using detail::slice;

void add_llama_embedding(ModelDesc& d) {
  const auto& config = d.config;
  const int64_t C = config.n_embd, Vp = config.padded_vocab(), V = config.vocab_size;
  d.values.push_back({"batch", true});
  UnitDesc emb;
  emb.kind = UnitKind::llama_embedding;
  emb.name = "embedding";
  add_param(emb, "model.embed_tokens.weight", {Vp, C}, true, {0.02f, 0.0f}, V);
  emb.reads = {0};
  emb.writes = 1;
  emb.backward_reads_params = false;
  d.values.push_back({"x.0", false});
  d.units.push_back(std::move(emb));
}

void add_llama_attention(UnitDesc& b, const ModelConfig& config, const std::string& p) {
  const int64_t C = config.n_embd, HS = config.head_size();
  const ParamInit normal{0.02f, 0.0f}, one{0.0f, 1.0f};
  add_param(b, p + "input_layernorm.weight", {C}, false, one);
  add_param(b, p + "self_attn.q_proj.weight", {config.n_head * HS, C}, true, normal);
  add_param(b, p + "self_attn.k_proj.weight", {config.n_kv_head * HS, C}, true, normal);
  add_param(b, p + "self_attn.v_proj.weight", {config.n_kv_head * HS, C}, true, normal);
  add_param(b, p + "self_attn.o_proj.weight", {C, config.n_head * HS}, true, normal);
  add_param(b, p + "post_attention_layernorm.weight", {C}, false, one);
}

// Block l reads x.l+1 and writes x.l+2 (values[0] is the batch, values[1] the embedding's).
void add_llama_block(ModelDesc& d, int l) {
  const auto& config = d.config;
  const int64_t C = config.n_embd, F = config.ffn_dim;
  const ParamInit normal{0.02f, 0.0f};
  UnitDesc b;
  b.kind = UnitKind::llama_block;
  b.layer = l;
  b.name = "layers." + std::to_string(l);
  const std::string p = "model." + b.name + ".";
  add_llama_attention(b, config, p);
  // gate and up adjacent: one (2F, C) matrix, one GEMM.
  add_param(b, p + "mlp.gate_proj.weight", {F, C}, true, normal);
  add_param(b, p + "mlp.up_proj.weight", {F, C}, true, normal);
  add_param(b, p + "mlp.down_proj.weight", {C, F}, true, normal);
  b.reads = {l + 1};
  b.writes = l + 2;
  d.values.push_back({"x." + std::to_string(l + 1), false});
  d.units.push_back(std::move(b));
}

void add_llama_head(ModelDesc& d) {
  const auto& config = d.config;
  const int64_t C = config.n_embd, Vp = config.padded_vocab(), V = config.vocab_size, L = config.n_layer;
  UnitDesc head;
  head.kind = UnitKind::llama_head;
  head.name = "head";
  add_param(head, "model.norm.weight", {C}, false, {0.0f, 1.0f});
  if (!config.tie_embeddings) add_param(head, "lm_head.weight", {Vp, C}, true, {0.02f, 0.0f}, V);
  head.reads = {static_cast<int>(L) + 1, 0};
  head.borrows = config.tie_embeddings ? 0 : -1;
  d.units.push_back(std::move(head));
}

ModelDesc describe_llama(const ModelConfig& config) {
  ModelDesc d;
  d.config = config;
  add_llama_embedding(d);
  for (int l = 0; l < config.n_layer; ++l) add_llama_block(d, l);
  add_llama_head(d);
  return d;
}

UnitCosts llama_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s) {
  const auto& c = desc.config;
  const int64_t B = s.B, T = s.T, BT = B * T, C = c.n_embd, F = c.ffn_dim, NH = c.n_head, e = s.elem;
  const int64_t HS = c.head_size(), QKV = (c.n_head + 2 * c.n_kv_head) * HS;
  const double bt = static_cast<double>(BT);
  UnitCosts k;
  switch (unit.kind) {
    case UnitKind::llama_embedding:
      k.output_bytes = slice(BT * C, e);
      k.pointwise_bytes = 2 * BT * C * e;
      break;
    case UnitKind::llama_block: {
      const double gemm = 2 * bt * (C * QKV + C * C + C * 2 * F + F * C);
      // QK^T and AV over the NH query heads, causal half (bidirectional: all); split over cp ranks,
      // each does 1/cp of it.
      const double attention = (c.causal ? 2 : 4) * bt * (T * s.cp) * C;
      k.forward_flops = gemm + attention;
      k.attention_flops = attention;
      k.backward_flops = 2 * k.forward_flops;
      k.gemms = {{BT, C, QKV}, {BT, C, C}, {BT, C, 2 * F}, {BT, F, C}};
      k.selective_recompute_flops = 2 * 4 * bt * C + 6 * bt * F;  // two RMSNorms, SwiGLU
      k.pointwise_bytes = (2 * 2 * BT * C + 2 * 2 * BT * C + 2 * (BT * (NH + c.n_kv_head) * HS) + 3 * BT * F) * e;
      k.output_bytes = slice(BT * C, e);
      // Under --act-quant the GEMM inputs among them are int8 + scales where they are kept.
      const int64_t gs = s.act_quant.saved_int8(s.recompute) ? s.act_quant.group : 0;
      const int64_t gr = s.act_quant.recomputable_int8(s.recompute) ? s.act_quant.group : 0;
      // Kept: q|k|v after rotation, attention output, its log-sum-exp, residual 1, gate|up.
      k.saved_bytes = detail::kept_input(BT * QKV, e, gs) + detail::kept_input(BT * C, e, gs) +
                      slice(B * NH * T, 4) + slice(BT * C, e) + slice(BT * 2 * F, e);
      // Recomputable: both norms' outputs and rstd, the SwiGLU output.
      k.recomputable_bytes =
          2 * (detail::kept_input(BT * C, e, gr) + slice(BT, 4)) + detail::kept_input(BT * F, e, gr);
      const int64_t KV = c.n_kv_head * HS;
      k.op_rebuilt_gemms = {{BT, C, KV}, {BT, C, C}, {BT, C, F}};  // wk, wo, w3 (up)
      k.op_recompute_flops = k.selective_recompute_flops + 2 * bt * C * (KV + C + F);
      if (s.recompute == Recompute::selective_op) {
        // Kept: q (rotated) and v, attention output and log-sum-exp, gate; the rest is rebuilt,
        // q|k|v, residual 1 and gate|up whole as the backward reads them.
        k.saved_bytes = slice(BT * (NH + c.n_kv_head) * HS, e) + slice(BT * C, e) + slice(B * NH * T, 4) + slice(BT * F, e);
        k.recomputable_bytes += slice(BT * QKV, e) + slice(BT * C, e) + slice(BT * 2 * F, e);
      }
      const int64_t rope_table = slice(T * s.cp * HS, 4);  // cos and sin, (T, HS/2) each, every position
      k.forward_workspace = rope_table;
      // Backward scratch: d norm out, d attention out, d qkv, d SwiGLU out, d gate|up, attention tiles.
      k.backward_workspace = slice(BT * C, e) + slice(BT * C, e) + slice(BT * QKV, e) + slice(BT * F, e) +
                             slice(BT * 2 * F, e) +
                             slice(detail::attention_backward_scratch_floats(HS, s.threads), 4) + rope_table;
      if (gs > 0) {  // as GPT-2's block: fp32 scratch for the compressed values in both passes
        const int64_t wide = BT * std::max(QKV, F);
        k.forward_workspace += slice(BT * C, e) + slice(wide, e);
        k.backward_workspace += slice(wide, e) + slice(BT * C, e);
        k.pointwise_bytes += (BT * (QKV + C) + (gr > 0 ? BT * (2 * C + F) : 0)) * (e + 1);
      }
      if (s.cp > 1 && s.cp_impl == ContextImpl::ring)
        detail::ring_attention_over_context(k, s, 2 * c.n_kv_head * HS, 2 * bt * C * QKV);
      if (s.cp > 1 && s.cp_impl == ContextImpl::all_to_all) detail::split_attention_over_context(k, s, QKV, C, 2 * bt * C * QKV);
      break;
    }
    case UnitKind::llama_head: {
      const int64_t V = c.vocab_size, Vp = c.padded_vocab(), rows = detail::head_chunk_rows(BT);
      k.forward_flops = 2 * bt * C * V;
      k.backward_flops = 4 * bt * C * V;
      k.gemms = {{BT, C, V}};
      k.pointwise_bytes = (2 * BT * C + BT * V) * e;
      k.forward_workspace = slice(BT * C, e) + slice(BT, 4) + slice(rows * Vp + 2 * rows, 4);
      k.backward_workspace = slice(BT * C, e);
      break;
    }
    default: break;
  }
  return k;
}

}  // namespace shardlm::model
