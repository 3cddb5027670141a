#include "train/model_state.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu.h"

namespace shardlm::train {

using layers::Dims;
using model::UnitKind;

ModelState::ModelState(const model::ModelConfig& config, uint64_t seed, bool with_optimizer)
    : desc_(model::describe(config)), layout_(model::flat_layout(desc_)) {
  const size_t bytes = sizeof(float) * layout_.total;
  params_ = Buffer(MemCategory::params, bytes);
  if (with_optimizer) {
    grads_ = Buffer(MemCategory::grads, bytes);
    exp_avg_ = Buffer(MemCategory::optimizer, bytes);
    exp_avg_sq_ = Buffer(MemCategory::optimizer, bytes);
  }
  for (int u = 0; u < num_units(); ++u)
    layers::init_unit(desc_.units[u], config, seed, params(u), 0, desc_.units[u].numel);
}

double ModelState::run_batch(layers::Activations& acts, layers::BackwardWorkspace& ws, bool backward,
                             float grad_scale) {
  const Dims d = layers::dims_of(config(), acts.B, acts.T);
  const int L = static_cast<int>(config().n_layer);
  const int emb = 0, fin = num_units() - 1;
  const auto& units = desc_.units;
  auto emb_p = layers::embedding_view(units[emb], params(emb));
  auto fin_p = layers::final_norm_view(units[fin], params(fin));

  layers::embedding_forward(emb_p, acts.inputs, acts.embedded, d);
  const float* x = acts.embedded;
  for (int l = 0; l < L; ++l) {
    layers::block_forward(layers::block_view(units[1 + l], params(1 + l)), x, acts.block(l), d);
    x = acts.block(l).out;
  }
  layers::final_norm_forward(fin_p, x, acts, d);
  if (!backward) return layers::head_loss(fin_p, emb_p, x, acts, d, ws, nullptr, nullptr, 0.0f);

  auto emb_g = layers::embedding_view(units[emb], grads(emb));
  auto fin_g = layers::final_norm_view(units[fin], grads(fin));
  const double loss = layers::head_loss(fin_p, emb_p, x, acts, d, ws, &fin_g, &emb_g, grad_scale);
  for (int l = L - 1; l >= 0; --l) {
    const float* in = l == 0 ? acts.embedded : acts.block(l - 1).out;
    layers::block_backward(layers::block_view(units[1 + l], params(1 + l)),
                           layers::block_view(units[1 + l], grads(1 + l)), in, acts.block(l), ws, d);
  }
  layers::embedding_backward(emb_g, acts.inputs, ws.dresidual, d);
  return loss;
}

void ModelState::logits_at(layers::Activations& acts, layers::BackwardWorkspace& ws, int64_t T, int64_t row,
                           float* logits) {
  const Dims d = layers::dims_of(config(), 1, T);
  const int L = static_cast<int>(config().n_layer);
  const int emb = 0, fin = num_units() - 1;
  const auto& units = desc_.units;
  auto emb_p = layers::embedding_view(units[emb], params(emb));
  layers::embedding_forward(emb_p, acts.inputs, acts.embedded, d);
  const float* x = acts.embedded;
  for (int l = 0; l < L; ++l) {
    layers::block_forward(layers::block_view(units[1 + l], params(1 + l)), x, acts.block(l), d);
    x = acts.block(l).out;
  }
  layers::final_norm_forward(layers::final_norm_view(units[fin], params(fin)), x, acts, d);
  const int32_t ignore = -1;
  kernels::lm_head_cross_entropy(nullptr, nullptr, acts.lnf + row * d.C, emb_p.wte, &ignore, 1, d.C, d.V, d.Vp, 0.0f,
                                 1, ws.head_scratch, logits);
}

namespace {
float* buffer_of(const Buffer& params, const Buffer& m, const Buffer& v, ModelState::Kind kind) {
  return kind == ModelState::Kind::params ? params.f32() : kind == ModelState::Kind::exp_avg ? m.f32() : v.f32();
}
}  // namespace

void ModelState::copy_from(Kind kind, const model::FlatLayout& layout, const float* src) {
  float* dst = buffer_of(params_, exp_avg_, exp_avg_sq_, kind);
  for (int u = 0; u < num_units(); ++u)
    std::memcpy(dst + layout_.units[u].offset, src + layout.units[u].offset, sizeof(float) * layout_.units[u].numel);
}

void ModelState::copy_to(Kind kind, const model::FlatLayout& layout, float* dst) const {
  const float* src = buffer_of(params_, exp_avg_, exp_avg_sq_, kind);
  for (int u = 0; u < num_units(); ++u)
    std::memcpy(dst + layout.units[u].offset, src + layout_.units[u].offset, sizeof(float) * layout_.units[u].numel);
}

void ModelState::zero_grads() { std::memset(grads_.data(), 0, grads_.bytes()); }

double ModelState::grad_norm() const { return std::sqrt(kernels::sum_squares(grads_.f32(), layout_.total)); }

void ModelState::scale_grads(float s) { kernels::scale(grads_.f32(), layout_.total, s); }

void ModelState::adamw_step(const AdamWConfig& opt, int64_t t) {
  for (int u = 0; u < num_units(); ++u) {
    const int64_t base = layout_.units[u].offset;
    for (const auto& p : desc_.units[u].params) {
      const int64_t o = base + p.offset;
      kernels::adamw_update(params_.f32() + o, grads_.f32() + o, exp_avg_.f32() + o, exp_avg_sq_.f32() + o, p.numel,
                            opt.lr, opt.beta1, opt.beta2, opt.eps, p.decay ? opt.weight_decay : 0.0f, t);
    }
  }
}

std::vector<ModelState::TensorRef> ModelState::tensors() const {
  std::vector<TensorRef> out;
  for (int u = 0; u < num_units(); ++u) {
    for (const auto& p : desc_.units[u].params) {
      TensorRef r{&p, p.shape, layout_.units[u].offset + p.offset, p.numel};
      if (p.name == "wte.weight") {
        r.shape[0] = config().vocab_size;
        r.numel = config().vocab_size * config().n_embd;
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace shardlm::train
