// One process's copy of a GPT-2: flat buffers for parameters, gradients and AdamW moments in
// the model-wide layout (model::flat_layout), and the unit-by-unit forward and backward over a
// batch. The distributed executor later runs the same unit functions from a plan.
#pragma once

#include <functional>
#include <memory>

#include "layers/gpt2.h"
#include "model/gpt2.h"
#include "tensor/memory.h"

namespace shardlm::train {

struct AdamWConfig {
  float lr, beta1, beta2, eps, weight_decay;
};

class ModelState {
 public:
  // with_optimizer: allocate gradients and AdamW moments (training) or parameters only.
  ModelState(const model::ModelConfig& config, uint64_t seed, bool with_optimizer);

  const model::ModelDesc& desc() const { return desc_; }
  const model::ModelConfig& config() const { return desc_.config; }
  const model::FlatLayout& layout() const { return layout_; }
  float* params(int unit) const { return params_.f32() + layout_.units[unit].offset; }
  float* grads(int unit) const { return grads_.f32() + layout_.units[unit].offset; }
  float* params_flat() const { return params_.f32(); }
  float* grads_flat() const { return grads_.f32(); }
  float* exp_avg_flat() const { return exp_avg_.f32(); }
  float* exp_avg_sq_flat() const { return exp_avg_sq_.f32(); }
  int num_units() const { return static_cast<int>(desc_.units.size()); }

  // Runs forward and, with `backward`, backward over acts.inputs/targets, accumulating
  // d(loss_sum * grad_scale) into the gradients. Returns the summed cross-entropy.
  double run_batch(layers::Activations& acts, layers::BackwardWorkspace& ws, bool backward, float grad_scale);
  // Forward only; writes logits (V) of position `row` of the first sequence.
  void logits_at(layers::Activations& acts, layers::BackwardWorkspace& ws, int64_t T, int64_t row, float* logits);

  // Copies the units of a whole flat buffer laid out by `layout` (e.g. a distributed plan's,
  // padded for its shard size) into this model's parameters or AdamW moments, and back.
  enum class Kind { params, exp_avg, exp_avg_sq };
  void copy_from(Kind kind, const model::FlatLayout& layout, const float* src);
  void copy_to(Kind kind, const model::FlatLayout& layout, float* dst) const;

  void zero_grads();
  double grad_norm() const;
  void scale_grads(float s);
  void adamw_step(const AdamWConfig& opt, int64_t t);  // t: 1-based step count

  // Visits every parameter with its exported shape (wte: V rows) and its element range in a
  // flat buffer, in checkpoint order.
  struct TensorRef {
    const model::ParamSpec* spec;
    std::vector<int64_t> shape;  // exported shape
    int64_t flat_offset;         // into params/grads/moments
    int64_t numel;               // exported element count
  };
  std::vector<TensorRef> tensors() const;

 private:
  model::ModelDesc desc_;
  model::FlatLayout layout_;
  Buffer params_, grads_, exp_avg_, exp_avg_sq_;
};

}  // namespace shardlm::train
