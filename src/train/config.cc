#include "train/config.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <stdexcept>
#include <tuple>

#include "ckpt/hf_config.h"
#include "plan/options.h"

namespace shardlm::train {

namespace {

// "PF,PH,PW": three positive integers.
void parse_patch(const std::string& text, model::ModelConfig& c) {
  int64_t p[3];
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const size_t end = i < 2 ? text.find(',', at) : text.size();
    const std::string part = end == std::string::npos ? "" : text.substr(at, end - at);
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 6)
      throw std::invalid_argument("--patch: expected PF,PH,PW (three positive integers, e.g. 1,2,2), got '" + text + "'");
    p[i] = std::stoll(part);
    at = end + 1;
  }
  c.patch_f = p[0], c.patch_h = p[1], c.patch_w = p[2];
}

}  // namespace

void TrainConfig::apply_dit_flags(model::ModelConfig& c) const {
  if (cond_drop != -1) c.cond_drop = cond_drop;
  if (frames > 0) c.frames = frames;
  if (height > 0) c.height = height;
  if (width > 0) c.width = width;
  if (channels > 0) c.channels = channels;
  if (classes > 0) c.num_classes = classes;
  if (!patch.empty()) parse_patch(patch, c);
  if (c.patch_tokens() > 0 && max_seq == 0) c.max_seq = c.patch_tokens();  // its positions are its patches
}

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
  if (moe_flags_given() && c.family != model::Family::moe)
    throw std::invalid_argument(std::string("--experts, --top-k, --moe-ffn-dim, --moe-every, --capacity-factor, --no-norm-topk, "
                                            "--aux-loss-coef and --z-loss-coef are mixture-of-experts settings; a ") +
                                model::to_string(c.family) + " model has no experts (use a moe model, e.g. --model moe-tiny)");
  if (experts > 0) c.n_experts = experts;
  if (top_k > 0) c.top_k = top_k;
  if (moe_ffn_dim > 0) c.moe_ffn_dim = moe_ffn_dim;
  if (moe_every > 0) c.moe_every = moe_every;
  if (capacity_factor != -1) c.capacity_factor = capacity_factor;
  if (no_norm_topk) c.norm_topk = false;
  if (aux_loss_coef != -1) c.aux_loss_coef = aux_loss_coef;
  if (z_loss_coef != -1) c.z_loss_coef = z_loss_coef;
  if (dit_flags_given() && c.family != model::Family::dit)
    throw std::invalid_argument(std::string("--cond-drop, --frames, --height, --width, --channels, --classes and --patch are "
                                            "diffusion-transformer settings; a ") + model::to_string(c.family) +
                                " model has no latents (use a dit model, e.g. --model dit-tiny)");
  if (c.family == model::Family::dit) apply_dit_flags(c);
  c.validate();
  // A DiT's sequence is its patches (the trainer sets --seq from them).
  if (c.family != model::Family::dit && seq > c.max_seq)
    throw std::invalid_argument("seq (" + std::to_string(seq) + ") exceeds the model's max_seq (" +
                                std::to_string(c.max_seq) + ")");
  return c;
}

void TrainConfig::sequence_from_patches() {
  try {
    const model::ModelConfig c = model_config(1);
    if (c.family == model::Family::dit) seq = c.patch_tokens();
  } catch (const std::exception&) {
    // refused, with its line, where the command resolves the model
  }
}

namespace {

// One line naming the flag (also the TOML key) and the value refused; `!(v >= lo)` also
// refuses NaN.
template <class T>
void at_least(T v, T lo, const char* flag) {
  if (!(v >= lo)) throw std::invalid_argument(fmt::format("--{}: must be >= {}, got {}", flag, lo, v));
}

void positive(double v, const char* flag) {
  if (!(v > 0)) throw std::invalid_argument(fmt::format("--{}: must be > 0, got {}", flag, v));
}

// Infinity passes every lower bound above; no setting here means anything at infinity.
void finite(double v, const char* flag) {
  if (!std::isfinite(v)) throw std::invalid_argument(fmt::format("--{}: must be finite, got {}", flag, v));
}

template <class T>
void at_most(T v, T hi, const char* flag) {
  if (v > hi) throw std::invalid_argument(fmt::format("--{}: must be <= {}, got {}", flag, hi, v));
}

void in_unit_interval(double v, const char* flag) {
  if (!(v >= 0 && v < 1)) throw std::invalid_argument(fmt::format("--{}: must be in [0, 1), got {}", flag, v));
}

// The explicit model dimensions: 0 leaves the preset's (the command line refuses an explicit
// 0 before this, see cli/), so only negative values are wrong here.
void check_model_overrides(const TrainConfig& c) {
  at_least<int64_t>(c.n_layer, 0, "n-layer");
  at_least<int64_t>(c.n_head, 0, "n-head");
  at_least<int64_t>(c.n_kv_head, 0, "n-kv-head");
  at_least<int64_t>(c.n_embd, 0, "n-embd");
  at_least<int64_t>(c.ffn_dim, 0, "ffn-dim");
  at_least<int64_t>(c.max_seq, 0, "max-seq");
  at_least<int64_t>(c.vocab, 0, "vocab");
  at_least(c.rope_theta, 0.0, "rope-theta");
  finite(c.rope_theta, "rope-theta");
  at_least(c.norm_eps, 0.0, "norm-eps");
  finite(c.norm_eps, "norm-eps");
  at_least<int64_t>(c.experts, 0, "experts");
  at_least<int64_t>(c.top_k, 0, "top-k");
  at_least<int64_t>(c.moe_ffn_dim, 0, "moe-ffn-dim");
  at_least<int64_t>(c.moe_every, 0, "moe-every");
  if (c.capacity_factor != -1) {
    if (!(c.capacity_factor > 0))
      throw std::invalid_argument(fmt::format("--capacity-factor: must be > 0 (omit it for dropless routing), got {}", c.capacity_factor));
    finite(c.capacity_factor, "capacity-factor");
  }
  for (auto [v, flag] : {std::pair{c.aux_loss_coef, "aux-loss-coef"}, std::pair{c.z_loss_coef, "z-loss-coef"}})
    if (v != -1) at_least(v, 0.0, flag), finite(v, flag);
}

// Steps, batch shape and the optimizer's settings.
void check_run(const TrainConfig& c) {
  at_least<int64_t>(c.steps, 0, "steps");
  at_most(c.steps, kMaxSteps, "steps");
  at_least<int64_t>(c.batch, 1, "batch");
  at_least<int64_t>(c.seq, 1, "seq");
  at_least<int64_t>(c.grad_accum, 1, "grad-accum");
  // Token buffers of one micro-step are indexed with 32 bits.
  if (c.batch > std::numeric_limits<int32_t>::max() / c.seq)
    throw std::invalid_argument(fmt::format("--batch {} x --seq {}: tokens per micro-step exceed 2^31", c.batch, c.seq));
  // A step's tokens over kMaxRanks ranks stay within int64; micro-steps are counted in an int.
  const int64_t max_accum = std::min<int64_t>(std::numeric_limits<int32_t>::max(), kMaxStepTokens / (c.batch * c.seq));
  if (c.grad_accum > max_accum)
    throw std::invalid_argument(fmt::format("--grad-accum: must be <= {} (--batch x --seq x --grad-accum: at most 2^40 tokens "
                                            "per rank per step), got {}", max_accum, c.grad_accum));
  at_least(c.threads, 1, "threads");
  at_most(c.threads, kMaxThreads, "threads");
  at_least(c.lr, 0.0f, "lr");
  finite(c.lr, "lr");
  at_least(c.min_lr, 0.0f, "min-lr");
  finite(c.min_lr, "min-lr");
  at_least<int64_t>(c.warmup, 0, "warmup");
  at_most(c.warmup, kMaxSteps, "warmup");
  parse_lr_decay(c.lr_decay);
  if (!(c.decay_fraction > 0 && c.decay_fraction <= 1))
    throw std::invalid_argument(fmt::format("--decay-fraction: must be in (0, 1], got {}", c.decay_fraction));
  at_least(c.weight_decay, 0.0f, "weight-decay");
  finite(c.weight_decay, "weight-decay");
  in_unit_interval(c.beta1, "beta1");
  in_unit_interval(c.beta2, "beta2");
  positive(c.eps, "eps");
  finite(c.eps, "eps");
  at_least(c.grad_clip, 0.0f, "grad-clip");
  finite(c.grad_clip, "grad-clip");
  if (c.on_nonfinite != "stop" && c.on_nonfinite != "skip")
    throw std::invalid_argument(fmt::format("--on-nonfinite: must be stop or skip, got '{}'", c.on_nonfinite));
  at_least<int64_t>(c.max_skipped_steps, 1, "max-skipped-steps");
  at_most(c.max_skipped_steps, kMaxSteps, "max-skipped-steps");
}

// Evaluation, checkpoints, sampling, output.
void check_reporting(const TrainConfig& c) {
  // Each count is at most kMaxSteps; evaluation reads at most the validation file's windows.
  for (const auto& [v, lo, flag] : {std::tuple{c.eval_every, 0, "eval-every"}, std::tuple{c.eval_windows, 1, "eval-windows"},
                                    std::tuple{c.save_every, 0, "save-every"}, std::tuple{c.keep_last, 0, "keep-last"},
                                    std::tuple{c.snapshot_every, 0, "snapshot-every"}}) {
    at_least<int64_t>(v, lo, flag);
    at_most(v, kMaxSteps, flag);
  }
  at_least(c.snapshot_parity, 0, "snapshot-parity");
  if (c.snapshot_parity == 1) throw std::invalid_argument("--snapshot-parity: a group of 1 rank has no parity; 0 (partner copies) or >= 2");
  at_least<int64_t>(c.sample_tokens, 0, "sample-tokens");
  at_most(c.sample_tokens, kMaxSampleTokens, "sample-tokens");
  at_least<int64_t>(c.samples_per_class, 0, "samples-per-class");
  at_most<int64_t>(c.samples_per_class, 64, "samples-per-class");
  at_least<int64_t>(c.sample_steps, 1, "sample-steps");
  at_most<int64_t>(c.sample_steps, 10000, "sample-steps");
  at_least(c.sample_cfg, 0.0, "sample-cfg");
  at_least(c.peak_gflops, 0.0, "peak-gflops");
  finite(c.peak_gflops, "peak-gflops");
  if (c.data.empty()) throw std::invalid_argument("--data: no token file prefix given (--data PREFIX)");
  if (c.out.empty()) throw std::invalid_argument("--out: the run directory is an empty string");
}

// How the step is laid out over ranks.
void check_distribution(const TrainConfig& c) {
  plan::check_plan_options(c);
  positive(c.timeout_s, "timeout");
  // Held as int64 milliseconds; a billion seconds (32 years) is "never".
  if (!(c.timeout_s <= 1e9)) throw std::invalid_argument(fmt::format("--timeout: must be <= 1e9 seconds, got {}", c.timeout_s));
  if (c.compute_dtype != "auto" && c.compute_dtype != "fp32" && c.compute_dtype != "bf16")
    throw std::invalid_argument(fmt::format("--compute-dtype: must be auto, fp32 or bf16, got '{}'", c.compute_dtype));
  if (c.device != "cpu" && c.device != "cuda")
    throw std::invalid_argument(fmt::format("--device: must be cpu or cuda, got '{}'", c.device));
  if (c.comm_backend != "auto" && c.comm_backend != "mpi" && c.comm_backend != "nccl")
    throw std::invalid_argument(fmt::format("--comm: must be auto, mpi or nccl, got '{}'", c.comm_backend));
  if (c.comm_backend == "nccl" && c.device != "cuda")
    throw std::invalid_argument("--comm nccl: needs --device cuda (NCCL moves GPU memory; the CPU's collectives are MPI's)");
  // Ranks on CUDA stage their collectives through host memory (MPI) or run them on NCCL; the CUDA
  // backend has no MoE kernels, and context parallelism's exchanges are staged only.
  if (c.device == "cuda" && c.ep > 1)
    throw std::invalid_argument("--device cuda: --ep is not supported yet (no CUDA kernels for experts)");
  if (c.device == "cuda" && c.cp > 1 && c.comm_backend == "nccl")
    throw std::invalid_argument("--cp with --comm nccl: not supported yet (context parallelism's exchanges run staged "
                                "through host memory: --comm auto)");
  if (c.offload != "none" && c.offload != "activations" && c.snapshot_every > 0)
    throw std::invalid_argument("--offload with --snapshot-every: in-memory snapshots of offloaded state are not supported yet");
  if (c.device == "cpu" && c.compute_dtype == "bf16")
    throw std::invalid_argument("--compute-dtype bf16 is not supported on CPU (bf16 GEMM is about half fp32's speed here)");
  if (c.device == "cuda" && c.pipeline_optimizer)
    throw std::invalid_argument("--device cuda: --pipeline-optimizer is not supported yet (the optimizer stream runs host kernels)");
}

}  // namespace

std::string TrainConfig::recompute_text() const {
  if (recompute_blocks < 0 || recompute == "none") return recompute;
  return recompute + " on " + std::to_string(recompute_blocks) + (recompute_blocks == 1 ? " block" : " blocks");
}

LrSchedule TrainConfig::lr_schedule() const {
  return {lr, min_lr, warmup, steps, parse_lr_decay(lr_decay), decay_fraction};
}

namespace {

// What pipeline stages do not carry yet: each rank holds its stages' units only, and the
// checkpoint and snapshot layouts, the disk tier and the optimizer's stream still assume every
// rank's plan holds every unit.
void check_pipeline(const TrainConfig& c) {
  if (c.pp <= 1) return;
  auto refuse = [](const std::string& what) {
    throw std::invalid_argument("--pp: " + what + " is not supported with pipeline stages yet");
  };
  if (c.save_every > 0 || !c.resume.empty() || !c.init_from.empty() || c.snapshot_every > 0 || c.async_save)
    refuse("--save-every, --snapshot-every, --async-save, --resume or --init-from (checkpoints)");
  if (c.offload != "none" || !c.memory_budget.empty()) refuse("--offload or --memory-budget");
  if (c.pipeline_optimizer) refuse("--pipeline-optimizer");
  if (c.device != "cpu") refuse("--device " + c.device);
}

}  // namespace

void TrainConfig::validate() const {
  check_model_overrides(*this);
  check_run(*this);
  check_reporting(*this);
  check_distribution(*this);
  check_pipeline(*this);
}

}  // namespace shardlm::train
