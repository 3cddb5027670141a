// The executor: runs one rank's plan for a training step with real kernels and collectives.
// Each stream is an in-order queue on its own thread (compute on the caller's thread, whose
// kernels use the OpenMP pool; comm on a second thread that issues a collective and waits for
// it); dependencies are completion flags. Every task's start and end are recorded for the trace.
//
// State in the plan's layout: parameters, gradients and AdamW moments are each one flat fp32
// buffer holding either the whole padded model or this rank's shard (element range
// [s·len_u, (s+1)·len_u) of every unit u, len_u = padded_u / shard_size), as the strategy says.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"
#include "layers/gpt2.h"
#include "model/gpt2.h"
#include "plan/plan.h"
#include "trace/trace.h"

namespace shardlm::run {

// The communicators a plan's collectives run on: all ranks, this rank's shard group and its
// replicate group (hybrid; otherwise shard is world and replicate is unused).
class CommGroups {
 public:
  CommGroups(comm::Communicator& world, const plan::Plan& plan);
  comm::Communicator& world() const { return world_; }
  comm::Communicator& shard() const { return shard_ ? *shard_ : world_; }
  comm::Communicator& replicate() const { return replicate_ ? *replicate_ : world_; }
  comm::Communicator& get(plan::Group g) const;

 private:
  comm::Communicator& world_;
  std::unique_ptr<comm::Communicator> shard_, replicate_;
};

struct AdamW {
  float lr, beta1, beta2, eps, weight_decay;
};

struct StepResult {
  double loss_sum = 0;      // summed cross-entropy over the global batch (all ranks, micro-steps)
  double grad_norm = 0;     // global, before clipping
  double comm_exposed_ms = 0;  // time the compute stream waited for collectives
};

// Fills this rank's batch of micro-step `micro`: inputs and targets, (B, T) each.
using BatchFn = std::function<void(int micro, int32_t* inputs, int32_t* targets)>;

class Executor {
 public:
  Executor(const model::ModelDesc& desc, const plan::Plan& plan, const CommGroups& comms, int threads,
           std::chrono::milliseconds timeout);
  ~Executor();

  // Initialises this rank's parameters: element e of every parameter depends on (seed, name, e)
  // alone, so any strategy and rank count start from the same model.
  void init_params(uint64_t seed);

  // One optimizer step: forward and backward of every micro-step, gradient reduction, clipping
  // to `grad_clip` (0: off), AdamW with bias correction for step `t` (1-based).
  // grad_scale multiplies the summed loss for the gradients: 1 / (global tokens of the step).
  StepResult step(int64_t step, const BatchFn& batch, float grad_scale, float grad_clip, const AdamW& opt, int64_t t);

  enum class State { params, exp_avg, exp_avg_sq };
  // Every rank receives the whole padded flat buffer (layout of plan.layout) of `which`. Collective.
  void gather_full(State which, float* full);
  // Takes this rank's part of a whole padded flat buffer.
  void load_full(State which, const float* full);

  const plan::Plan& plan() const { return plan_; }
  trace::RankTrace& trace() { return trace_; }
  // Records the memory categories now (also done at every allocation and free inside a step).
  void sample_memory();

 private:
  struct Shard {
    int64_t unit_offset;  // element offset of the unit in the whole flat layout
    int64_t len;          // elements per shard of this unit
    int64_t begin;        // first element of this rank's shard within the unit
  };
  Shard shard_of(int u) const;
  float* local(const Buffer& buf, bool sharded, int u) const;  // this rank's shard of unit u
  float* full_params(int u);
  float* full_grads(int u);
  void run_compute(const plan::Task& t, int64_t step, const BatchFn& batch, float grad_scale, float grad_clip,
                   const AdamW& opt, int64_t adam_t, StepResult& result);
  void run_comm(const plan::Task& t, int64_t step);
  void allocate(const plan::Task& t);
  void release(const plan::Task& t);
  std::string label(const plan::Task& t, int64_t step) const;
  double sum_over(comm::Communicator& c, double local, const std::string& label);
  double now_us() const;

  const model::ModelDesc& desc_;
  plan::Plan plan_;
  const CommGroups& comms_;
  std::chrono::milliseconds timeout_;
  bool sharded_params_, sharded_grads_, sharded_optimizer_;
  int shard_index_;
  Buffer params_, grads_, exp_avg_, exp_avg_sq_;
  layers::Activations acts_;
  layers::BackwardWorkspace ws_;
  std::mutex buffers_mu_;
  std::map<std::string, Buffer> dynamic_;  // plan-named buffers alive now
  std::chrono::steady_clock::time_point t0_;
  // Test-only fault injection, from the environment: SHARDLM_FAULT_SKIP_COLLECTIVE=RANK:STEP makes
  // that rank skip its first collective of that step and stall (the others must time out and
  // name it); SHARDLM_FAULT_KILL=RANK:STEP makes it die by SIGKILL at the start of that step.
  int64_t fault_skip_step_ = -1, fault_kill_step_ = -1;
  trace::RankTrace trace_;
  std::mutex trace_mu_;
};

}  // namespace shardlm::run
