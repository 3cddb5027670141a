// DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers"): patch embedding of the noised
// latents with learned positions; a conditioning vector c from the time (sinusoidal features and
// an MLP) plus a class embedding with a null class; adaLN-Zero blocks (LayerNorm without affine,
// shift / scale / gate from SiLU(c) through a zero-initialised linear, bidirectional attention,
// GELU-tanh MLP); a final adaLN layer and linear to each patch's values (zero-initialised). The
// objective is rectified flow: the head predicts the velocity noise − x0 at x_t = (1 − t)·x0 +
// t·noise, scored by its mean squared error.
//
// The conditioning parameters live in the embedding unit, which every block and the head borrow:
// each recomputes c for its samples (B rows, a sliver of its work) and adds its part of c's
// gradient to the embedding's, so no per-sample value other than the residual stream passes
// between units. Linear weights are stored (in, out), as GPT-2's Conv1D (the transpose of a
// PyTorch nn.Linear weight), the patch embedding's Conv3d weight (C, channels, pf, ph, pw) as
// (channels·pf·ph·pw, C).
#include <stdexcept>

#include "model/model.h"

namespace shardlm::model {

using detail::add_param;
using detail::slice;

namespace {

void add_linear(UnitDesc& u, const std::string& name, int64_t in, int64_t out, ParamInit w) {
  add_param(u, name + ".weight", {in, out}, true, w);
  add_param(u, name + ".bias", {out}, false, {0.0f, 0.0f});
}

}  // namespace

ModelDesc describe_dit(const ModelConfig& config) {
  const int64_t C = config.n_embd, F = config.ffn_dim, L = config.n_layer, T = config.patch_tokens();
  const int64_t P = config.patch_values();
  const ParamInit normal{0.02f, 0.0f}, zero{0.0f, 0.0f};

  ModelDesc d;
  d.config = config;
  d.values.push_back({"batch", true, dit_sample(config).bytes});
  UnitDesc emb;
  emb.kind = UnitKind::dit_embedding;
  emb.name = "embedding";
  add_linear(emb, "x_embedder.proj", P, C, normal);
  add_param(emb, "pos_embed", {T, C}, false, normal);
  add_linear(emb, "t_embedder.mlp.0", kDitTimeFeatures, C, normal);
  add_linear(emb, "t_embedder.mlp.2", C, C, normal);
  add_param(emb, "y_embedder.embedding_table.weight", {config.num_classes + 1, C}, true, normal);
  emb.reads = {0};
  emb.writes = 1;
  emb.backward_reads_params = false;  // its backward reads the patches and d x.0 only
  d.values.push_back({"x.0", false});
  d.units.push_back(std::move(emb));

  for (int l = 0; l < L; ++l) {
    UnitDesc b;
    b.kind = UnitKind::dit_block;
    b.layer = l;
    b.name = "blocks." + std::to_string(l);
    const std::string p = b.name + ".";
    // adaLN-Zero: the modulation starts at zero, so every block starts as the identity.
    add_linear(b, p + "adaLN_modulation.1", C, 6 * C, zero);
    add_linear(b, p + "attn.qkv", C, 3 * C, normal);
    add_linear(b, p + "attn.proj", C, C, normal);
    add_linear(b, p + "mlp.fc1", C, F, normal);
    add_linear(b, p + "mlp.fc2", F, C, normal);
    b.reads = {l + 1, 0};
    b.writes = l + 2;
    b.borrows = 0;
    d.values.push_back({"x." + std::to_string(l + 1), false});
    d.units.push_back(std::move(b));
  }

  UnitDesc head;
  head.kind = UnitKind::dit_head;
  head.name = "final_layer";
  add_linear(head, "final_layer.adaLN_modulation.1", C, 2 * C, zero);
  add_linear(head, "final_layer.linear", C, P, zero);
  head.reads = {static_cast<int>(L) + 1, 0};
  head.borrows = 0;
  d.units.push_back(std::move(head));
  return d;
}

namespace {

// The conditioning path every borrower reruns for its B samples: time features, the MLP's two
// linears and SiLU, c, SiLU(c). Its scratch and its gradients' scratch.
int64_t cond_bytes(int64_t B, int64_t C) { return slice(B * kDitTimeFeatures, 4) + 4 * slice(B * C, 4); }
int64_t cond_grad_bytes(int64_t B, int64_t C) { return 4 * slice(B * C, 4); }
double cond_flops(int64_t B, int64_t C) { return 2.0 * B * (kDitTimeFeatures * C + C * C); }

}  // namespace

UnitCosts dit_costs(const ModelDesc& desc, const UnitDesc& unit, const Shape& s) {
  const auto& c = desc.config;
  if (s.cp > 1)
    throw std::invalid_argument("cp (--cp): the dit family runs each sample on one rank for now (cp must be 1)");
  if (s.act_quant.on()) throw std::invalid_argument("act_quant (--act-quant): not supported by the dit family yet");
  const int64_t B = s.B, T = s.T, BT = B * T, C = c.n_embd, F = c.ffn_dim, NH = c.n_head, P = c.patch_values();
  const double bt = static_cast<double>(BT);
  UnitCosts k;
  switch (unit.kind) {
    case UnitKind::dit_embedding:
      k.forward_flops = 2 * bt * P * C;
      k.backward_flops = 2 * bt * P * C;  // the weight's gradient only: x_t needs none
      k.gemms = {{BT, P, C}};
      k.pointwise_bytes = (3 * B * c.latent_values() + 2 * BT * C) * 4;  // x_t from x0 and noise, positions
      k.output_bytes = slice(BT * C, s.elem);
      k.forward_workspace = slice(BT * P, 4);  // x_t's patches
      k.backward_workspace = slice(BT * P, 4);
      break;
    case UnitKind::dit_block: {
      const double gemm = 2 * bt * (C * 3 * C + C * C + C * F + F * C);
      const double attention = 4 * bt * T * C;  // QK^T and AV over every key
      const double ada = 2.0 * B * C * 6 * C + cond_flops(B, C);
      k.forward_flops = gemm + attention + ada;
      k.attention_flops = attention;
      k.backward_flops = 2 * (gemm + attention + ada);
      k.gemms = {{BT, C, 3 * C}, {BT, C, C}, {BT, C, F}, {BT, F, C}, {B, C, 6 * C}};
      k.pointwise_bytes = (12 * BT * C + 2 * BT * F) * 4;  // two norms, modulations, gated residuals, GELU
      k.output_bytes = slice(BT * C, s.elem);
      // Kept: the modulation, both norms (mean, rstd, output) and modulated inputs, q|k|v, the
      // attention output and its log-sum-exp, the projection, the first residual, fc1's output,
      // GELU's and fc2's.
      k.saved_bytes = slice(B * 6 * C, 4) + 2 * (2 * slice(BT, 4) + 2 * slice(BT * C, 4)) + slice(BT * 3 * C, 4) +
                      slice(BT * C, 4) + slice(B * NH * T, 4) + slice(BT * C, 4) + slice(BT * C, 4) +
                      2 * slice(BT * F, 4) + slice(BT * C, 4);
      k.selective_recompute_flops = 0;  // selective keeps everything (none of it is rebuilt apart)
      k.forward_workspace = cond_bytes(B, C);
      // The conditioning again and its gradients, d modulation; d fc2 out, d GELU out, d fc1 out,
      // d modulated input, d norm, d projection out, d attention out, d q|k|v, attention tiles.
      k.backward_workspace = cond_bytes(B, C) + cond_grad_bytes(B, C) + slice(B * 6 * C, 4) + slice(BT * C, 4) +
                             2 * slice(BT * F, 4) + 4 * slice(BT * C, 4) + slice(BT * 3 * C, 4) +
                             slice(detail::attention_backward_scratch_floats(C / NH, s.threads), 4);
      break;
    }
    case UnitKind::dit_head: {
      k.forward_flops = 2 * bt * C * P + 2.0 * B * C * 2 * C + cond_flops(B, C);
      k.backward_flops = 2 * k.forward_flops;
      k.gemms = {{BT, C, P}, {B, C, 2 * C}};
      k.pointwise_bytes = (4 * BT * C + 4 * B * c.latent_values()) * 4;
      // The conditioning, the modulation, the norm (mean, rstd, output), the modulated input, the
      // prediction by patch and as latents.
      k.forward_workspace = cond_bytes(B, C) + slice(B * 2 * C, 4) + 2 * slice(BT, 4) + 2 * slice(BT * C, 4) +
                            slice(BT * P, 4) + slice(B * c.latent_values(), 4);
      // d prediction, d modulated input, d norm, d modulation, the conditioning's gradients.
      k.backward_workspace = slice(BT * P, 4) + 2 * slice(BT * C, 4) + slice(B * 2 * C, 4) + cond_grad_bytes(B, C);
      break;
    }
    default: break;
  }
  return k;
}

}  // namespace shardlm::model
