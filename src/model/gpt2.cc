// GPT-2: token + position embedding; pre-LN blocks (fused q|k|v projection, tanh-GELU MLP, Conv1D
// weights (in, out) with biases); final layer norm; head tied to the token embedding.
#include <algorithm>
#include <cmath>

#include "model/model.h"

namespace shardlm::model {

using detail::add_param;
using detail::slice;

ModelDesc describe_gpt2(const ModelConfig& config) {
  const int64_t C = config.n_embd, F = config.ffn_dim, L = config.n_layer;
  // GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L), norms at 1.
  const ParamInit normal{0.02f, 0.0f}, zero{0.0f, 0.0f}, one{0.0f, 1.0f};
  const ParamInit residual{0.02f / std::sqrt(2.0f * static_cast<float>(L)), 0.0f};

  ModelDesc d;
  d.config = config;
  d.values.push_back({"batch", true});
  UnitDesc emb;
  emb.kind = UnitKind::gpt2_embedding;
  emb.name = "embedding";
  add_param(emb, "wte.weight", {config.padded_vocab(), C}, true, normal, config.vocab_size);
  add_param(emb, "wpe.weight", {config.max_seq, C}, true, {0.01f, 0.0f});
  emb.reads = {0};
  emb.writes = 1;
  emb.backward_reads_params = false;
  d.values.push_back({"x.0", false});
  d.units.push_back(std::move(emb));

  for (int l = 0; l < L; ++l) {
    UnitDesc b;
    b.kind = UnitKind::gpt2_block;
    b.layer = l;
    b.name = "h." + std::to_string(l);
    const std::string p = b.name + ".";
    add_param(b, p + "ln_1.weight", {C}, false, one);
    add_param(b, p + "ln_1.bias", {C}, false, zero);
    add_param(b, p + "attn.c_attn.weight", {C, 3 * C}, true, normal);
    add_param(b, p + "attn.c_attn.bias", {3 * C}, false, zero);
    add_param(b, p + "attn.c_proj.weight", {C, C}, true, residual);
    add_param(b, p + "attn.c_proj.bias", {C}, false, zero);
    add_param(b, p + "ln_2.weight", {C}, false, one);
    add_param(b, p + "ln_2.bias", {C}, false, zero);
    add_param(b, p + "mlp.c_fc.weight", {C, F}, true, normal);
    add_param(b, p + "mlp.c_fc.bias", {F}, false, zero);
    add_param(b, p + "mlp.c_proj.weight", {F, C}, true, residual);
    add_param(b, p + "mlp.c_proj.bias", {C}, false, zero);
    b.reads = {l + 1};
    b.writes = l + 2;
    d.values.push_back({"x." + std::to_string(l + 1), false});
    d.units.push_back(std::move(b));
  }

  UnitDesc head;
  head.kind = UnitKind::gpt2_head;
  head.name = "final_norm";
  add_param(head, "ln_f.weight", {C}, false, one);
  add_param(head, "ln_f.bias", {C}, false, zero);
  head.reads = {static_cast<int>(L) + 1, 0};
  head.borrows = 0;
  d.units.push_back(std::move(head));
  return d;
}

UnitCosts gpt2_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s) {
  const auto& c = desc.config;
  const int64_t B = s.B, T = s.T, BT = B * T, C = c.n_embd, F = c.ffn_dim, NH = c.n_head, e = s.elem;
  const double bt = static_cast<double>(BT);
  UnitCosts k;
  switch (unit.kind) {
    case UnitKind::gpt2_embedding:
      k.output_bytes = slice(BT * C, e);
      k.pointwise_bytes = 3 * BT * C * e;  // two rows read, one written per token
      break;
    case UnitKind::gpt2_block: {
      const double gemm = 2 * bt * (C * 3 * C + C * C + C * F + F * C);
      // QK^T and AV, 2 FLOPs a multiply-add, causal half (bidirectional: all); split over cp ranks,
      // each does 1/cp of it.
      const double attention = (c.causal ? 2 : 4) * bt * (T * s.cp) * C;
      k.forward_flops = gemm + attention;
      k.attention_flops = attention;
      k.backward_flops = 2 * k.forward_flops;
      k.gemms = {{BT, C, 3 * C}, {BT, C, C}, {BT, C, F}, {BT, F, C}};
      k.selective_recompute_flops = 2 * 8 * bt * C + 20 * bt * F;  // two layer norms, GELU
      k.pointwise_bytes = (2 * 2 * BT * C + 2 * 2 * BT * C + 2 * BT * F) * e;  // norms, residuals, GELU
      k.output_bytes = slice(BT * C, e);
      // Under --act-quant the GEMM inputs among them are int8 + scales where they are kept.
      const int64_t gs = s.act_quant.saved_int8(s.recompute) ? s.act_quant.group : 0;
      const int64_t gr = s.act_quant.recomputable_int8(s.recompute) ? s.act_quant.group : 0;
      // Kept: qkv, attention output, its log-sum-exp, residual 1, fc output before GELU.
      k.saved_bytes = detail::kept_input(BT * 3 * C, e, gs) + detail::kept_input(BT * C, e, gs) +
                      slice(B * NH * T, 4) + slice(BT * C, e) + slice(BT * F, e);
      // Recomputable: ln_1 out + mean + rstd, ln_2 out + mean + rstd, GELU output.
      k.recomputable_bytes =
          2 * (detail::kept_input(BT * C, e, gr) + 2 * slice(BT, 4)) + detail::kept_input(BT * F, e, gr);
      // Backward scratch: d ln, d attention out, d qkv, d fc, d GELU, attention tiles.
      k.backward_workspace = slice(BT * C, e) + slice(BT * C, e) + slice(BT * 3 * C, e) + 2 * slice(BT * F, e) +
                             slice(detail::attention_backward_scratch_floats(C / NH, s.threads), 4);
      if (gs > 0) {
        // The forward writes the compressed values in fp32 scratch first (norm out / attention
        // out, then q|k|v / GELU out), the backward dequantizes into two scratch slices (the
        // attention backward reads q|k|v and its output at once); quantizing reads e and writes
        // one byte per value, dequantizing the reverse.
        const int64_t wide = BT * std::max(3 * C, F);
        k.forward_workspace += slice(BT * C, e) + slice(wide, e);
        k.backward_workspace += slice(wide, e) + slice(BT * C, e);
        k.pointwise_bytes += (BT * 4 * C + (gr > 0 ? BT * (2 * C + F) : 0)) * (e + 1);
      }
      if (s.cp > 1 && s.cp_impl == ContextImpl::ring) detail::ring_attention_over_context(k, s, 2 * C, 2 * bt * C * 3 * C);
      if (s.cp > 1 && s.cp_impl == ContextImpl::all_to_all) detail::split_attention_over_context(k, s, 3 * C, C, 2 * bt * C * 3 * C);
      break;
    }
    case UnitKind::gpt2_head: {
      const int64_t V = c.vocab_size, Vp = c.padded_vocab(), rows = detail::head_chunk_rows(BT);
      k.forward_flops = 2 * bt * C * V;
      k.backward_flops = 4 * bt * C * V;
      k.gemms = {{BT, C, V}};
      k.pointwise_bytes = (2 * BT * C + BT * V) * e;
      // Final norm out + mean + rstd, and the logits of one chunk of rows (+ 2 per row).
      k.forward_workspace = slice(BT * C, e) + 2 * slice(BT, 4) + slice(rows * Vp + 2 * rows, 4);
      k.backward_workspace = slice(BT * C, e);  // d final norm out
      break;
    }
    default: break;
  }
  return k;
}

}  // namespace shardlm::model
