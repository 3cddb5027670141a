// The executor: runs one rank's plan with real kernels and collectives. It is a stream runner:
// each stream is an in-order queue on its own thread (compute on the caller's thread, whose
// kernels use the OpenMP pool; comm on a second thread that issues a collective and waits for
// it); dependencies are completion flags; each op has one handler. Every task's start and end
// are recorded for the trace, and every buffer a task allocates is the plan's, charged to the
// plan's category.
//
// State in the plan's placement: parameters, gradients and AdamW moments are each one flat fp32
// buffer holding, unit after unit, this rank's part of each unit (element range
// [s·len_u, (s+1)·len_u) of unit u, len_u = padded_u / parts_u; the whole unit when parts_u is 1),
// as the plan places each unit's state (Plan::placement).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/staged.h"
#include "kernels/backend.h"
#include "layers/layers.h"
#include "model/model.h"
#include "plan/plan.h"
#include "tensor/disk_store.h"
#include "tensor/memory.h"
#include "trace/trace.h"

namespace shardlm::run {

// The communicators a plan's collectives run on, one per set of mesh axes: the ranks that agree
// with this one on every other axis. Split from the world once, at construction (a collective
// call on every rank), for every set of the mesh's axes with more than one rank on them; a set
// spanning all of them is the world.
//
// Collectives issued from two threads on one communicator could be ordered differently on two
// ranks, so each stream that issues collectives has communicators of its own: the comm stream's
// (`get`), and, when the mesh has an expert axis, the exchange stream's (`exchange`: one per set of
// axes that includes it).
//
// Buffers live in the backend's memory. Made with a backend whose memory is not the host's (a
// GPU's), `get` answers with a communicator over device memory for each group, and `host` with the
// group itself, for what the executor keeps in host memory (loss and norm sums, gather_full's
// output). Which one `get` gives is `device`'s choice:
//   staged  comm/staged.h: device -> host -> MPI -> device, copies through the backend (any number
//           of ranks per GPU);
//   nccl    comm/nccl.h: NCCL over the world (bootstrapped through it), ordered after the backend's
//           stream, and its groups split from it (ncclCommSplit) in the order of `host`'s; one GPU
//           per rank (NCCL's construction refuses ranks sharing one, with one line).
// Without a device backend, or with a host-memory one, both are the group itself (`device` unused).
enum class DeviceCollectives { staged, nccl };

class CommGroups {
 public:
  CommGroups(comm::Communicator& world, const plan::Mesh& mesh, const kernels::Backend* backend = nullptr,
             DeviceCollectives device = DeviceCollectives::staged);
  CommGroups(comm::Communicator& world, const plan::Plan& plan, const kernels::Backend* backend = nullptr,
             DeviceCollectives device = DeviceCollectives::staged)
      : CommGroups(world, plan.mesh, backend, device) {}
  ~CommGroups();
  // The world over host memory.
  comm::Communicator& world() const { return world_; }
  const plan::Mesh& mesh() const { return mesh_; }
  // This rank's group over `axes` (indices into the mesh), for buffers in the backend's memory.
  comm::Communicator& get(const std::vector<int>& axes) const;
  // The same group, for buffers in host memory.
  comm::Communicator& host(const std::vector<int>& axes) const;
  // The exchange stream's group over `axes`, for buffers in the backend's memory (staged through
  // host memory on a device backend; exchanges over NCCL are refused), and the same group for
  // host buffers (an exchange's sizes).
  comm::Communicator& exchange(const std::vector<int>& axes) const;
  comm::Communicator& exchange_host(const std::vector<int>& axes) const;
  // Whether get() stages through host memory (made with a device-memory backend).
  bool staged() const { return copier_ != nullptr; }
  // Whether get() is NCCL's (made with a device-memory backend and DeviceCollectives::nccl).
  bool nccl() const { return nccl_world_ != nullptr; }
  // What get() moves device memory with, for the run's header: "nccl", "mpi staged through host
  // memory", or the world's backend.
  std::string describe() const;

 private:
  // Bit a: axis a, for the axes of more than one rank (the others change no group).
  unsigned key(const std::vector<int>& axes) const;
  comm::Communicator& world_;
  plan::Mesh mesh_;
  unsigned all_ = 0;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> groups_, exchange_groups_;
  // Declared after what they wrap, so they go first.
  std::unique_ptr<comm::DeviceCopier> copier_;
  std::unique_ptr<comm::Communicator> staged_world_;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> staged_groups_, staged_exchange_groups_;
  std::unique_ptr<comm::Communicator> nccl_world_;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> nccl_groups_;
};

struct AdamW {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
};

// Fills this rank's batch of micro-step `micro`: inputs and targets, (B, T) each.
using BatchFn = std::function<void(int64_t micro, int32_t* inputs, int32_t* targets)>;

struct StepInputs {
  BatchFn batch;
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

// The disk tier (--offload): where this rank's files go and how they are written. Needed when the
// plan places state on disk and the backend computes in host memory (a device's tier is host
// memory: run/host_store.h).
struct OffloadOptions {
  std::string dir;
  DiskStoreOptions io;
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
  void init_params(uint64_t seed);

  // Runs the plan the executor was built with (step: for labels, the trace and fault injection).
  StepResult step(int64_t step, const StepInputs& in) { return run(plan_, step, in); }
  // Runs another plan over the same state, e.g. a forward-only plan for evaluation or sampling.
  // Its parameter layout must be this executor's; it may need less state (no gradients).
  StepResult run(const plan::Plan& plan, int64_t step, const StepInputs& in);

  enum class State { params, grads, exp_avg, exp_avg_sq };
  // Every rank receives the whole padded flat buffer (layout of plan.layout) of `which`. Collective.
  void gather_full(State which, float* full);
  // Takes this rank's part of a whole padded flat buffer.
  void load_full(State which, const float* full);
  // The state buffer itself when this rank holds it whole (a single process, DDP); else null. It is
  // in the backend's memory (device memory on a GPU backend); gather_full and load_full take host
  // memory (on a GPU backend they copy through it, and gather_full's collectives run on the host).
  // Gradients after a step are clipped (when clipping applied).
  float* whole(State which);
  // This rank's buffer of `which` as the plan places it (each unit's part, back to back in unit
  // order; the whole padded flat buffer when every unit is whole); null when the plan holds none. For ckpt/,
  // which reads and writes each rank's element ranges in place.
  // State the plan keeps on disk is read into a staging copy (memory category staging) first; after
  // writing into it, commit_local_state() writes it back to disk; release_local_state() drops it.
  float* local_state(State which);
  void commit_local_state();
  void release_local_state();
  // The offload tier (disk, or host memory under a device backend) and how it moves bytes; null
  // when nothing is offloaded.
  const OffloadStore* offload_store() const { return store_.get(); }

  const plan::Plan& plan() const { return plan_; }
  trace::RankTrace& trace() { return trace_; }
  // Records the memory categories now (also done at every allocation and free inside a step).
  void sample_memory();

 private:
  struct Run;  // one plan's execution: its live buffers, inputs and result
  using Handler = void (Executor::*)(const plan::Task&, Run&);
  static const Handler kHandlers[plan::kNumOps];

  // This rank's part of one kind of unit u's state: elements [begin, begin + len) of the unit's
  // padded flat buffer, the part `begin / len` of `parts`, at element `at` of this rank's buffer
  // of that kind.
  struct Shard {
    int64_t unit_offset;  // element offset of the unit in the whole flat layout
    int64_t len;
    int64_t begin;
    int parts;
    int64_t at;
  };
  void check_carved_fits() const;
  void check_device_run(const plan::Plan& plan) const;
  void gather_full_from_device(plan::StateKind k, const Buffer& buf, float* full);
  void check_placement() const;
  bool holds_state_of(const plan::Plan& plan) const;
  Shard shard_of(plan::StateKind k, int u) const;
  // Element e of unit u (inside this rank's part of kind k) in this rank's buffer `buf` of that kind.
  float* element(const Buffer& buf, plan::StateKind k, int u, int64_t e) const;
  const Buffer& state(State which) const;
  // This rank's part of unit u's state `s` (plan::StateIndex): in the resident buffer, or in its
  // window when the plan keeps it on disk (the window must be loaded: the plan's reload, or for
  // gradients the zero-filled window of their first use, comes before every use).
  float* held(plan::StateIndex s, int u, const Run* r) const;
  // Whether any unit's state s is on disk (it has a file); whether unit u's is.
  bool on_disk(plan::StateIndex s) const;
  bool on_disk(plan::StateIndex s, int u) const;
  // Unit u's part of state s between its file and `dst` / `src` (window-sized, 4 KiB aligned).
  void disk_read(plan::StateIndex s, int u, void* dst);
  void disk_write(plan::StateIndex s, int u, const void* src);
  // Every unit's part, packed as the resident buffer would be (`packed` in the backend's memory),
  // through a bounce window.
  Buffer bounce_window(plan::StateIndex s, Buffer::Fill fill) const;
  void disk_read_all(plan::StateIndex s, float* packed);
  void disk_write_all(plan::StateIndex s, const float* packed);
  void init_range(int u, uint64_t seed, float* dst, int64_t begin, int64_t end) const;
  void unit_optimizer(int u, Run& r);
  void adamw(int u, Run& r);
  // --pipeline-optimizer: unit u's parameters (its optimizer range) and moments to or from `copy`.
  void keep_state(int u, float* copy, Run& r);
  void restore_state(int u, const float* copy, Run& r);
  void decide_update(Run& r);
  float* unit_params(int buffer, int u, Run& r) const;
  float* unit_grads(int buffer, int u, Run& r) const;
  std::string label(const plan::Task& t, int64_t step) const;
  double sum_over(comm::Communicator& c, double local, const std::string& label);
  static void note_nonfinite(Run& r, int rank, double sum_squares, double loss_sum);
  double now_us() const;
  // Allocates `ids` for a run of task `t` that belongs to micro-step `micro` of the step.
  void allocate(const plan::Task& t, int64_t micro, const std::vector<int>& ids, Run& r);
  void release(const plan::Task& t, Run& r);
  void unit_task(const plan::Task& t, Run& r);

  // One handler per op (ops.h), named as the op.
  void zero_grads(const plan::Task& t, Run& r);
  void forward(const plan::Task& t, Run& r);
  void recompute(const plan::Task& t, Run& r);
  void head(const plan::Task& t, Run& r);
  void loss(const plan::Task& t, Run& r);
  void logits(const plan::Task& t, Run& r);
  void backward(const plan::Task& t, Run& r);
  void grad_norm(const plan::Task& t, Run& r);
  void optimizer(const plan::Task& t, Run& r);
  void optimizer_commit(const plan::Task& t, Run& r);
  void all_gather(const plan::Task& t, Run& r);
  void gather_bucket(const plan::Task& t, Run& r);
  void gather_rest(const plan::Task& t, Run& r);
  void keep_part(const plan::Task& t, Run& r);
  void to_wire(void* dst, const float* src, int64_t n, int elem) const;
  void from_wire(float* dst, const void* src, int64_t n, int elem) const;
  void reduce_scatter(const plan::Task& t, Run& r);
  comm::Scratch comm_scratch(const plan::Task& t, Run& r);
  void all_reduce(const plan::Task& t, Run& r);
  void param_gather(const plan::Task& t, Run& r);
  void norm_reduce(const plan::Task& t, Run& r);
  void loss_reduce(const plan::Task& t, Run& r);
  void exchange(const plan::Task& t, Run& r);
  void reload(const plan::Task& t, Run& r);
  void write_back(const plan::Task& t, Run& r);
  int activation_file(const Run& r) const;  // the file of the saved activations' slots
  void window_sync(const plan::Task& t, Run& r);
  void ring_step(const plan::Task& t, Run& r, comm::Communicator& c, const std::string& label);

  const model::ModelDesc& desc_;
  plan::Plan plan_;
  const CommGroups& comms_;
  int threads_;
  std::chrono::milliseconds timeout_;
  const kernels::Backend& backend_;
  int rank_;  // in the world
  Buffer params_, grads_, exp_avg_, exp_avg_sq_;
  // The offload tier: files by StateIndex (-1: in memory), each unit's byte offset in them, and the
  // staged copies local_state() hands out.
  std::unique_ptr<OffloadStore> store_;
  std::array<int, plan::kNumStateBuffers> file_{-1, -1, -1, -1};
  std::array<std::vector<int64_t>, plan::kNumStateBuffers> file_at_;
  std::array<Buffer, plan::kNumStateBuffers> staged_;
  // By StateIndex, per unit (U + 1 prefix sums): where its part starts in the resident buffer,
  // which packs only the units kept in memory (the plan's held offsets when none is on disk).
  std::array<std::vector<int64_t>, plan::kNumStateBuffers> ram_at_;
  int activation_file_ = -1;  // --offload activations: the plan's slots (-1: none)
  // A host backend's step buffers live at the offsets the plan lays out (plan::lay_out_arena) in
  // this block, kept between steps and grown to the largest plan run.
  Arena arena_;
  std::vector<plan::GradClass> grad_classes_;  // plan_.grad_classes()
  std::chrono::steady_clock::time_point t0_;
  // This rank's steps of the ExecutorFaults it was built with (-1: none).
  int64_t fault_skip_step_ = -1, fault_kill_step_ = -1, fault_nan_loss_step_ = -1, fault_disk_read_step_ = -1;
  // The step running now (read by the disk store's read_fault on the copy stream), and whether the
  // disk_read fault has struck (once).
  std::atomic<int64_t> running_step_{-1};
  std::atomic<bool> disk_read_failed_{false};
  trace::RankTrace trace_;
  std::mutex trace_mu_;
};

}  // namespace shardlm::run
