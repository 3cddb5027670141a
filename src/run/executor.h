// The executor: runs one rank's plan with real kernels and collectives, in three parts.
//   stream runner (run/stream_runner.h)  each stream an in-order queue on a thread of its own,
//                                        dependencies as completion counts;
//   state store (run/state_store.h)      this rank's parameters, gradients and AdamW moments as
//                                        the plan places them, and the offload tier's files;
//   op handlers (run/*_ops.cc)           one per op of plan/ops.h, registered from its list.
// Every task's start and end are recorded for the trace, and every buffer a task allocates is the
// plan's, charged to the plan's category.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"
#include "layers/layers.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/comm_groups.h"
#include "run/state_store.h"
#include "tensor/disk_store.h"
#include "tensor/memory.h"
#include "trace/trace.h"

namespace shardlm::run {

struct AdamW {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
};

// Fills this rank's batch of micro-step `micro`: inputs and targets, (B, T) each.
using BatchFn = std::function<void(int64_t micro, int32_t* inputs, int32_t* targets)>;
// Or, for a model whose batch is samples it lays out (model::ValueDesc::sample_bytes: a DiT's
// latents, noise, times and labels), fills the `bytes` of micro-step `micro`'s batch.
using SampleFn = std::function<void(int64_t micro, char* batch, int64_t bytes)>;

struct StepInputs {
  BatchFn batch;
  SampleFn samples;  // instead of `batch` where the model's batch is samples
  float grad_scale = 1;   // multiplies the summed loss for the gradients: 1 / global tokens
  // Weight of one routing group's (one rank's micro-batch's) MoE auxiliary losses in the objective:
  // 1 / the step's routing groups. 0: 1 / (ranks × micro-steps) of the plan.
  float group_weight = 0;
  float grad_clip = 0;    // global-norm clipping (0: off)
  AdamW opt;
  int64_t adam_t = 1;     // AdamW's 1-based step count
  float* logits = nullptr;  // Op::logits writes the vocabulary's logits here: (V) of the last
  bool all_logits = false;  // position of sequence 0, or with all_logits every row's (B, T, V)
  uint64_t quant_seed = 0;  // --act-quant-rounding stochastic: the run's seed (draws keyed by it, the step, ...)
};

struct StepResult {
  double loss_sum = 0;         // summed cross-entropy over the global batch (all ranks, micro-steps)
  double grad_norm = 0;        // global, before clipping
  double comm_exposed_ms = 0;  // time the compute stream waited for other streams
  // Mixture-of-experts routing over the global batch: auxiliary losses (before their
  // coefficients, the mean over routing groups), assignments, drops, per-expert load extremes.
  layers::MoeStats moe;
  // World ranks (ascending) whose summed loss / squared-gradient sum was not finite this step.
  // Every rank sees the same lists before its optimizer task runs; when either is non-empty the
  // optimizer leaves parameters and AdamW moments untouched (update_skipped).
  std::vector<int> nonfinite_loss, nonfinite_grads;
  bool update_skipped = false;
  bool nonfinite() const { return !nonfinite_loss.empty() || !nonfinite_grads.empty(); }
};

// A test's fault injection point: something goes wrong on world rank `rank` at step `step`
// (-1: nowhere). Passed in by whoever builds the run (cli/ reads it from the environment).
struct FaultPoint {
  int rank = -1;
  int64_t step = -1;
  // The step this fault strikes on rank `r`, -1 if it never does.
  int64_t step_of(int r) const { return r == rank ? step : -1; }
};

// Test-only faults in a run's steps. skip_collective: that rank skips its first collective of
// that step and stalls (the others must time out and name it); kill: it dies by SIGKILL at the
// start of that step; nan_loss: its loss of that step is NaN (gradients stay finite);
// disk_read: its first read from its offload files in that step fails as an I/O error would.
struct ExecutorFaults {
  FaultPoint skip_collective, kill, nan_loss, disk_read;
};

class Executor {
 public:
  // Every kernel the executor and its layers run goes through `backend` (which must outlive it);
  // its buffers are charged to, and the trace's memory counters read from, backend.memory().
  Executor(const model::ModelDesc& desc, const plan::Plan& plan, const CommGroups& comms, int threads,
           std::chrono::milliseconds timeout, const kernels::Backend& backend, const ExecutorFaults& faults = {},
           const OffloadOptions& offload = {});
  ~Executor();

  // Initialises this rank's parameters: element e of every parameter depends on (seed, name, e)
  // alone, so any strategy and rank count start from the same model.
  void init_params(uint64_t seed) { store_->init_params(seed); }

  // Runs the plan the executor was built with (step: for labels, the trace and fault injection).
  StepResult step(int64_t step, const StepInputs& in) { return run(plan_, step, in); }
  // Runs another plan over the same state, e.g. a forward-only plan for evaluation or sampling.
  // Its parameter layout must be this executor's; it may need less state (no gradients).
  StepResult run(const plan::Plan& plan, int64_t step, const StepInputs& in);

  // The run-long state between steps: StateStore's, of the same names.
  void gather_full(plan::State which, float* full) { store_->gather_full(which, full, comms_, timeout_); }
  void load_full(plan::State which, const float* full) { store_->load_full(which, full); }
  float* whole(plan::State which) { return store_->whole(which); }
  float* local_state(plan::State which) { return store_->local_state(which); }
  void commit_local_state() { store_->commit_local_state(); }
  void release_local_state() { store_->release_local_state(); }
  // The offload tier (disk, or host memory under a device backend) and how it moves bytes; null
  // when nothing is offloaded.
  const OffloadStore* offload_store() const { return store_->tier(); }

  const plan::Plan& plan() const { return plan_; }
  trace::RankTrace& trace() { return trace_; }
  // Records the memory categories now (also done at every allocation and free inside a step).
  void sample_memory();

 private:
  struct Run;  // one plan's execution: its live buffers, inputs and result (run/executor_run.h)
  using Handler = void (Executor::*)(const plan::Task&, Run&);
  static const Handler kHandlers[plan::kNumOps];
  using Shard = StateStore::Shard;

  // ---- executor.cc: construction, the step, buffers
  void check_carved_fits() const;
  void check_device_run(const plan::Plan& plan) const;
  bool holds_state_of(const plan::Plan& plan) const;
  OffloadOptions with_fault(const OffloadOptions& offload);
  // One run of a task on its stream's thread, once what it waits for is done.
  void run_task(const plan::Task& t, int64_t micro, double waited_ms, Run& r);
  Shard shard_of(plan::State k, int u) const { return store_->shard(k, u); }
  bool on_disk(plan::State s) const { return store_->on_disk(s); }
  bool on_disk(plan::State s, int u) const { return store_->on_disk(s, u); }
  // This rank's part of unit u's state `s`: in the resident buffer, or in its window when the plan
  // keeps it on disk (the window must be loaded: the plan's reload, or for gradients the
  // zero-filled window of their first use, comes before every use).
  float* held(plan::State s, int u, const Run* r) const;
  float* unit_params(int buffer, int u, Run& r) const;
  float* unit_grads(int buffer, int u, Run& r) const;
  std::string label(const plan::Task& t, int64_t step) const;
  double now_us() const;
  // Allocates `ids` for a run of task `t` that belongs to micro-step `micro` of the step.
  void allocate(const plan::Task& t, int64_t micro, const std::vector<int>& ids, Run& r);
  void release(const plan::Task& t, Run& r);

  // ---- One handler per op (ops.h), named as the op, and what each family shares.
  // compute_ops.cc
  void zero_grads(const plan::Task& t, Run& r);
  void forward(const plan::Task& t, Run& r);
  void recompute(const plan::Task& t, Run& r);
  void head(const plan::Task& t, Run& r);
  void loss(const plan::Task& t, Run& r);
  void logits(const plan::Task& t, Run& r);
  void backward(const plan::Task& t, Run& r);
  void unit_task(const plan::Task& t, Run& r);
  layers::UnitArgs unit_args(const plan::Task& t, Run& r);
  // optimizer_ops.cc
  void grad_norm(const plan::Task& t, Run& r);
  void optimizer(const plan::Task& t, Run& r);
  void optimizer_commit(const plan::Task& t, Run& r);
  static void note_nonfinite(Run& r, int rank, double sum_squares, double loss_sum);
  void decide_update(Run& r);
  void unit_optimizer(int u, Run& r);
  void adamw(int u, Run& r);
  // --pipeline-optimizer: unit u's parameters (its optimizer range) and moments to or from `copy`.
  void keep_state(int u, float* copy, Run& r);
  void restore_state(int u, const float* copy, Run& r);
  // gather_ops.cc
  void all_gather(const plan::Task& t, Run& r);
  void param_gather(const plan::Task& t, Run& r);
  void gather_bucket(const plan::Task& t, Run& r);
  void gather_rest(const plan::Task& t, Run& r);
  void keep_part(const plan::Task& t, Run& r);
  void to_wire(void* dst, const float* src, int64_t n, int elem) const;
  void from_wire(float* dst, const void* src, int64_t n, int elem) const;
  // reduce_ops.cc
  void reduce_scatter(const plan::Task& t, Run& r);
  void all_reduce(const plan::Task& t, Run& r);
  void norm_reduce(const plan::Task& t, Run& r);
  void loss_reduce(const plan::Task& t, Run& r);
  comm::Scratch comm_scratch(const plan::Task& t, Run& r);
  double sum_over(comm::Communicator& c, double local, const std::string& label);
  void reduce_fields(comm::Communicator& c, const std::string& label, Run& r);
  // exchange_ops.cc
  void exchange(const plan::Task& t, Run& r);
  void send(const plan::Task& t, Run& r);
  void recv(const plan::Task& t, Run& r);
  void ring_step(const plan::Task& t, Run& r, comm::Communicator& c, const std::string& label);
  // offload_ops.cc
  void reload(const plan::Task& t, Run& r);
  void write_back(const plan::Task& t, Run& r);
  void window_sync(const plan::Task& t, Run& r);
  int activation_file(const Run& r) const;  // the file of the saved activations' slots

  const model::ModelDesc& desc_;
  plan::Plan plan_;
  const CommGroups& comms_;
  int threads_;
  std::chrono::milliseconds timeout_;
  const kernels::Backend& backend_;
  int rank_;  // in the world
  // A host backend's step buffers live at the offsets the plan lays out (plan::lay_out_arena) in
  // this block, kept between steps and grown to the largest plan run.
  Arena arena_;
  std::vector<plan::GradClass> grad_classes_;  // plan_.grad_classes()
  std::chrono::steady_clock::time_point t0_;
  // This rank's steps of the ExecutorFaults it was built with (-1: none).
  int64_t fault_skip_step_ = -1, fault_kill_step_ = -1, fault_nan_loss_step_ = -1, fault_disk_read_step_ = -1;
  // The step running now (read by the disk store's read_fault on the copy stream), and whether the
  // disk_read fault has struck (once). Declared before the store, whose files' fault reads them.
  std::atomic<int64_t> running_step_{-1};
  std::atomic<bool> disk_read_failed_{false};
  std::unique_ptr<StateStore> store_;
  trace::RankTrace trace_;
  std::mutex trace_mu_;
};

}  // namespace shardlm::run
