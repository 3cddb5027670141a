// The training loop: the sequence of a step (batch, executor step, metrics, checkpoint,
// evaluation) over every rank; evaluation and sampling live in evaluate.h, checkpoint I/O in
// checkpoint.h, saving, snapshots and resuming a run's state in run_state_io.h. Metrics go to DIR/metrics.jsonl and, at a glance, to the console.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "tensor/memory.h"
#include "train/config.h"

namespace shardlm::train {

struct TrainSummary {
  int64_t steps_done = 0;
  double final_loss = 0;           // training loss of the last step
  double final_val_loss = 0;       // nats per token
  double val_unigram_entropy = 0;  // nats per token, of the validation tokens
  std::vector<int32_t> sample;     // tokens generated at the end (none when sample_tokens == 0)
  // A run that ended early on every rank (non-finite step, stop signal): the process's exit
  // status and the one line that says why. 0 for a run that went to its end.
  int exit_code = 0;
  std::string stop_reason;
};

// Seams for tests, passed in (never read from the environment): what a test does inside a run.
struct TrainHooks {
  // Called on every rank after step `step` (numbered from 0) has been recorded in metrics.jsonl,
  // before that step boundary's checkpoint, snapshot and evaluation: what it takes is time between
  // steps, as theirs is.
  std::function<void(int64_t step)> at_step_boundary;
  // Faults injected into the steps (run::ExecutorFaults) and into saving checkpoint STEP on that
  // rank: kill_mid_write dies by SIGKILL once half the rank file's bytes are written (a partial
  // temporary file stays on disk); fail_write makes that write fail, as a full disk would;
  // kill_in_save dies after writing its file, before the barrier that commits the checkpoint.
  run::ExecutorFaults executor_faults;
  run::FaultPoint kill_mid_write, fail_write, kill_in_save;
  // With --resume: save the state just loaded, under this run's strategy and rank count, so a
  // test can compare it with the checkpoint it came from.
  bool save_after_resume = false;
  // The CPU backend as if its memory were a device's (kernels::make_cpu_backend's as_device): the
  // device paths, staged collectives included, run without a GPU.
  bool cpu_as_device = false;
};

// Trains on every rank of `world` (a world of one is a single process); rank 0 writes metrics,
// checkpoints and the trace. Collective: every rank calls it with the same configuration. Every
// buffer of the run is charged to `memory` (the pool `world` allocates from too), whose tracker
// the metrics' memory figures are read from.
TrainSummary run_training(const TrainConfig& cfg, comm::Communicator& world, MemoryPool& memory,
                          const TrainHooks& hooks = {});
plan::PlanConfig plan_config(const TrainConfig& cfg, int world_size);
// What the CUDA backend of a run is made with: the environment's options (cfg.cuda) and the
// GEMMs' dtype (--compute-dtype).
kernels::CudaOptions cuda_options(const TrainConfig& c);

// The tokenizer a token file was made with, from PREFIX_meta.json beside it (written by
// `shardlm tokenize`). Files without one are llm.c's: GPT-2 BPE where their ids are uint16, and
// LLaMA 3's ("llama3", 128256 ids; shardlm has no such tokenizer) where they are uint32.
struct DataMeta {
  std::string tokenizer = "gpt2";
  int64_t vocab_size = 50257;
  int32_t eot = -1;  // the id tokenize put between documents; -1 where none or not recorded (older files)
};
// The token a sample starts from where it has no prompt: what begins a document in such data
// (the recorded eot: gpt2's <|endoftext|> separator, llama3's <|begin_of_text|>, mistral's <s>;
// else by name; bytes: a newline).
int32_t document_start_token(const DataMeta& meta);
DataMeta read_data_meta(const std::string& prefix);
void write_data_meta(const std::string& prefix, const DataMeta& meta);

// GFLOP/s of an fp32 GEMM on this machine's current thread count: the MFU denominator.
double measure_gemm_gflops(MemoryPool& memory);

// The kernels a run uses, over the run's memory: the CPU's (answering that its memory is not the
// host's with `cpu_as_device`, a test seam), or with --device cuda the CUDA backend's, its GEMMs in
// c.compute_dtype (auto: bf16) and c.cuda's options. Throws one line where this build or this
// machine has no CUDA device.
std::unique_ptr<kernels::Backend> make_backend(const TrainConfig& c, MemoryPool& memory, bool cpu_as_device);

// Directory names under a run: DIR/ckpt/step_N.
std::string checkpoint_dir(const std::string& out, int64_t step);

}  // namespace shardlm::train
