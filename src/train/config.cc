#include "train/config.h"

#include <stdexcept>

#include "ckpt/hf_config.h"

namespace shardlm::train {

model::ModelConfig TrainConfig::model_config(int64_t data_vocab) const {
  const bool from_file = model.size() > 5 && model.compare(model.size() - 5, 5, ".json") == 0;
  model::ModelConfig c = from_file ? ckpt::read_hf_config(model) : model::model_preset(model, data_vocab);
  if (vocab > 0) c.vocab_size = vocab;
  if (n_layer > 0) c.n_layer = n_layer;
  if (n_head > 0) c.n_head = n_head;
  if (n_kv_head > 0) c.n_kv_head = n_kv_head;
  else if (n_head > 0 && c.family == model::Family::gpt2) c.n_kv_head = n_head;
  if (n_embd > 0) c.n_embd = n_embd;
  if (ffn_dim > 0) c.ffn_dim = ffn_dim;
  else if (n_embd > 0 && c.family == model::Family::gpt2) c.ffn_dim = 4 * n_embd;
  if (max_seq > 0) c.max_seq = max_seq;
  if (rope_theta > 0) c.rope_theta = rope_theta;
  if (norm_eps > 0) c.norm_eps = norm_eps;
  if (tie_embeddings) c.tie_embeddings = true;
  c.validate();
  if (seq > c.max_seq)
    throw std::invalid_argument("seq (" + std::to_string(seq) + ") exceeds the model's max_seq (" +
                                std::to_string(c.max_seq) + ")");
  return c;
}

void TrainConfig::validate() const {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(steps >= 0, "steps must be >= 0");
  need(batch > 0, "batch must be positive");
  need(seq > 0, "seq must be positive");
  need(grad_accum > 0, "grad-accum must be positive");
  need(threads > 0, "threads must be positive");
  need(lr >= 0 && min_lr >= 0, "lr and min-lr must be >= 0");
  need(warmup >= 0, "warmup must be >= 0");
  need(beta1 >= 0 && beta1 < 1, "beta1 must be in [0, 1)");
  need(beta2 >= 0 && beta2 < 1, "beta2 must be in [0, 1)");
  need(eps > 0, "eps must be positive");
  need(grad_clip >= 0, "grad-clip must be >= 0");
  need(eval_every >= 0 && save_every >= 0, "eval-every and save-every must be >= 0");
  need(eval_windows > 0, "eval-windows must be positive");
  need(!data.empty(), "data: no token file prefix given (--data PREFIX)");
  need(timeout_s > 0, "timeout must be positive");
  for (const auto* dt : {&param_dtype, &reduce_dtype})
    need(*dt == "fp32" || *dt == "bf16", "dtype '" + *dt + "' must be fp32 or bf16");
  need(compute_dtype == "auto" || compute_dtype == "fp32" || compute_dtype == "bf16",
       "compute-dtype '" + compute_dtype + "' must be auto, fp32 or bf16");
  need(device == "cpu" || device == "cuda", "device '" + device + "' must be cpu or cuda");
  need(device == "cpu" || strategy == "ddp", "device cuda runs one process with strategy ddp (no NCCL yet)");
  model::parse_recompute(recompute);
  need(n_layer >= 0 && n_head >= 0 && n_kv_head >= 0 && n_embd >= 0 && ffn_dim >= 0 && max_seq >= 0 && vocab >= 0,
       "model dimensions (--n-layer, --n-head, --n-kv-head, --n-embd, --ffn-dim, --max-seq, --vocab) must be positive");
  need(rope_theta >= 0 && norm_eps >= 0, "rope-theta and norm-eps must be positive");
  need(device == "cuda" || compute_dtype != "bf16", "compute-dtype bf16 is not supported on CPU (bf16 GEMM is about half fp32's speed here)");
}

}  // namespace shardlm::train
