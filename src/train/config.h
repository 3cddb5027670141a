// Everything a training run is configured by. Defaults follow nanoGPT where it has one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/options.h"
#include "kernels/cuda_options.h"
#include "model/model.h"
#include "plan/options.h"
#include "train/machines.h"
#include "train/schedule.h"

namespace shardlm::train {

// Upper bounds of the numeric settings, so that every one keeps time, memory and the integer
// arithmetic over it finite (validate() and the command line refuse more, naming the flag).
inline constexpr int kMaxThreads = 1024;               // compute threads per rank
inline constexpr int kMaxRanks = 1 << 20;              // ranks explain, simulate and plan take
inline constexpr int64_t kMaxSteps = 1'000'000'000'000;  // steps and step counts: beyond any run
inline constexpr int64_t kMaxStepTokens = int64_t{1} << 40;  // batch x seq x grad-accum per rank
inline constexpr int64_t kMaxSampleTokens = 1'000'000;  // tokens generate and --sample-tokens draw

inline constexpr int kOffloadPrefetchAuto = plan::kOffloadPrefetchAuto;  // --offload-prefetch auto

// The plan's settings (batch shape, strategy, memory) are plan::PlanOptions', declared once in
// plan/options.h with their flags.
struct TrainConfig : plan::PlanOptions {
  // Model: a preset or a Hugging Face config.json, with any explicit dimension (> 0) overriding it.
  std::string model = "small";
  int64_t n_layer = 0, n_head = 0, n_kv_head = 0, n_embd = 0, ffn_dim = 0, max_seq = 0;
  int64_t vocab = 0;  // 0: the config.json's or real preset's, else the data's tokenizer
  double rope_theta = 0, norm_eps = 0;  // 0: the preset's
  bool tie_embeddings = false;          // llama: tie the head to the embedding
  // Mixture of experts (moe models; model.h's ModelConfig says what each means). 0 (or -1 for
  // the real-valued ones): the preset's. Any of them on another family is refused.
  int64_t experts = 0, top_k = 0, moe_ffn_dim = 0, moe_every = 0;
  double capacity_factor = -1;  // > 0 when given; the preset's is dropless
  bool no_norm_topk = false;    // keep the softmax weights of the k experts (Switch / OpenMoE)
  double aux_loss_coef = -1, z_loss_coef = -1;
  double cond_drop = -1;  // dit: the probability a sample's label is dropped to the null class (-1: the preset's)
  // dit: the latents' shape, classes and patch (0 or empty: the preset's); patch "PF,PH,PW".
  int64_t frames = 0, height = 0, width = 0, channels = 0, classes = 0;
  std::string patch;
  bool dit_flags_given() const { return cond_drop != -1 || frames || height || width || channels || classes || !patch.empty(); }
  bool moe_flags_given() const {
    return experts || top_k || moe_ffn_dim || moe_every || capacity_factor != -1 || no_norm_topk ||
           aux_loss_coef != -1 || z_loss_coef != -1;
  }

  // A DiT's sequence is its patches: for a dit model, seq becomes their count (train, explain,
  // simulate and plan call it before building a plan; another model, or one not resolvable here,
  // is left as it is).
  void sequence_from_patches();
  void apply_dit_flags(model::ModelConfig& c) const;

  std::string data;  // PREFIX of PREFIX_train.bin / PREFIX_val.bin (dit: DIR of DIR/train.bin / DIR/val.bin, latent sets)
  std::string out = "runs/default";
  std::string resume;  // checkpoint directory, or "auto": --out's newest snapshot, else its latest checkpoint
  // A new run's starting parameters (AdamW moments zero, step 0): a shardlm checkpoint or a
  // Hugging Face model directory (checkpoint.h's resolve_initial). Not used with --resume.
  std::string init_from;
  bool overwrite = false;  // a new run may replace the run that --out holds (run_dir.h)
  // Settings that define the run which a resumed run may change on purpose (resume_check.h).
  std::vector<std::string> resume_override;

  int64_t steps = 1000;
  uint64_t seed = 1337;

  float lr = 6e-4f;
  float min_lr = 6e-5f;
  int64_t warmup = 100;
  std::string lr_decay = "cosine";  // the decay's shape: cosine | linear | sqrt | none (lr to the end)
  double decay_fraction = 1;        // of the steps after warmup, the last this share decay (< 1: stable before)
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float grad_clip = 1.0f;  // 0: off
  // A step whose loss or gradient norm is NaN or infinite on any rank: `stop` ends the run
  // before the update; `skip` drops the update and ends the run after max_skipped_steps in a row.
  std::string on_nonfinite = "stop";
  int64_t max_skipped_steps = 5;

  int64_t eval_every = 100;    // 0: only at the end
  int64_t eval_windows = 64;   // validation windows per evaluation (spread over the file)
  int64_t save_every = 0;      // 0: never
  int64_t keep_last = 0;       // checkpoints kept (the newest); 0: all
  int64_t snapshot_every = 0;  // steps between in-memory snapshots (ckpt/snapshot.h); 0: never
  int snapshot_parity = 0;     // 0: a partner rank holds a copy; G: XOR parity per group of G ranks
  int64_t sample_tokens = 64;  // tokens generated at the end of a run (0: none)
  // dit: samples of each class drawn at the end of a run into DIR/samples.png and .bin (0: none),
  // the sampler's Euler steps and its classifier-free guidance scale.
  int64_t samples_per_class = 4, sample_steps = 50;
  double sample_cfg = 4.0;
  double peak_gflops = 0;      // 0: measure the GEMM peak at start-up
  bool quiet = false;          // no console progress

  // Distribution (ranks come from mpirun / srun; one process is a world of 1) is PlanOptions'.
  // GEMM precision: "auto" is fp32 on the CPU and bf16 (fp32 accumulation) on CUDA.
  std::string compute_dtype = "auto";
  std::string device = "cpu";  // cpu | cuda (a build with -DSHARDLM_CUDA=ON; ranks stage collectives through host MPI; no ep/cp)
  // Collectives over device memory: auto (MPI staged through host memory, any ranks per GPU) | nccl
  // (--device cuda, one GPU per rank) | mpi (the CPU's; on cuda the same as auto).
  std::string comm_backend = "auto";
  double timeout_s = 300;  // a collective that does not finish in time ends the job
  std::string trace;       // Chrome trace JSON of every rank's tasks and memory
  bool no_report = false;  // --no-report: no DIR/report.html at each evaluation and at the end
  std::string command_line;  // as typed, for the report (run_info.json); cli/ fills it

  // Resolves the model: preset or config.json, then explicit overrides, then validation.
  // data_vocab sizes the vocabulary of presets that take it from the data.
  model::ModelConfig model_config(int64_t data_vocab) const;
  // Throws std::invalid_argument naming the field for values out of range.
  void validate() const;
  // The recompute mode as the run header and report show it ("full on 16 blocks").
  std::string recompute_text() const;
  // The learning rate of each step (validate() first: lr_decay must parse).
  LrSchedule lr_schedule() const;

  // From the process's environment; the command line fills these (nothing below cli/ reads it).
  comm::MpiOptions comm;     // the MPI backend's algorithms and chunking (SHARDLM_COMM_*)
  // > 0: consecutive blocks of this many ranks are taken for machines, all on this one (the test
  // seam SHARDLM_TEST_RANKS_ON_MACHINE); 0: the machines are found at start (train/machines.h).
  int test_ranks_per_machine = 0;
  Machines machines;  // where the ranks run: found at start (run_training), not a setting
  kernels::CudaOptions cuda;  // --device cuda: SHARDLM_CUDA_* and the local rank (bf16_gemm is compute_dtype's)
};

}  // namespace shardlm::train
