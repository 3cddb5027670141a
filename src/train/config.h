// Everything a training run is configured by. Defaults follow nanoGPT where it has one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/options.h"
#include "kernels/cuda_options.h"
#include "model/model.h"
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

inline constexpr int kOffloadPrefetchAuto = -1;  // --offload-prefetch auto

struct TrainConfig {
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
  bool moe_flags_given() const {
    return experts || top_k || moe_ffn_dim || moe_every || capacity_factor != -1 || no_norm_topk ||
           aux_loss_coef != -1 || z_loss_coef != -1;
  }
  std::string recompute = "none";       // none | selective | full
  int recompute_blocks = -1;            // how many blocks `recompute` applies to, spread evenly; -1: all
  // Activation compression (model::ActQuant): none | int8, values per scale, nearest | stochastic.
  std::string act_quant = "none";
  int64_t act_quant_group = 64;
  std::string act_quant_rounding = "nearest";

  std::string data;  // PREFIX of PREFIX_train.bin / PREFIX_val.bin
  std::string out = "runs/default";
  std::string resume;  // checkpoint directory, or "auto": --out's newest snapshot, else its latest checkpoint
  // A new run's starting parameters (AdamW moments zero, step 0): a shardlm checkpoint or a
  // Hugging Face model directory (checkpoint.h's resolve_initial). Not used with --resume.
  std::string init_from;
  bool overwrite = false;  // a new run may replace the run that --out holds (run_dir.h)
  // Settings that define the run which a resumed run may change on purpose (resume_check.h).
  std::vector<std::string> resume_override;

  int64_t steps = 1000;
  int64_t batch = 4;  // B sequences per micro-step
  int64_t seq = 256;  // T
  int64_t grad_accum = 1;
  int threads = 2;
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
  bool async_save = false;     // stage each rank's shard and write it in a background thread
  int64_t sample_tokens = 64;  // tokens generated at the end of a run (0: none)
  double peak_gflops = 0;      // 0: measure the GEMM peak at start-up
  bool quiet = false;          // no console progress

  // Distribution (ranks come from mpirun / srun; one process is a world of 1).
  std::string strategy = "fsdp";  // ddp | zero1 | zero2 | fsdp | hybrid
  int shard_group = 0;            // hybrid: ranks per shard group (0: a machine's, once start-up has found the machines)
  int ep = 1;                     // expert parallel: ranks an expert group spans (E / ep experts each)
  int cp = 1;                     // context parallel: ranks each sequence is split over
  std::string cp_impl = "ring";   // ring | all-to-all
  int prefetch_forward = 1, prefetch_backward = 1;
  int max_gathers_in_flight = 2;
  double bucket_mb = 25;
  std::string keep_gathered = "none";  // all | none | unit names, comma-separated (h.10,final_norm,h.9:0.5)
  double gather_bucket_mb = 0;         // fsdp / hybrid all-gather buckets (0: off)
  // The disk tier: kinds of state kept in files (none | any of params,grads,optimizer), where
  // (empty: OUT/offload), and how many using tasks ahead the copy stream reads
  // (kOffloadPrefetchAuto: the depth a simulation on a hardware profile predicts fastest, which the
  // cli resolves before the plan is built).
  std::string offload = "none";
  std::string offload_dir;
  int offload_prefetch = 2;
  // AdamW per unit as soon as its gradients are final, speculatively (plan/optimizer_overlap.cc).
  bool pipeline_optimizer = false;
  bool reduce_each_micro_step = false;  // plan::PlanConfig::reduce_each_micro_step
  // --memory-budget: per-rank bytes ("8GB", "512MiB", "4096") the plan's accounted peak must stay
  // within; the placement pass puts units' params, grads and optimizer state on disk until it
  // does (activations stay in memory). Empty: no budget.
  std::string memory_budget;
  std::string param_dtype = "fp32", reduce_dtype = "fp32";
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
