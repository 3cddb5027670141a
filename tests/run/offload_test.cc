// The disk tier (--offload) with real runs: parameters, gradients and AdamW moments all in files
// give bitwise the resident run's losses and checkpoints (one process, and every strategy at 2-4
// ranks, with gradient accumulation too), hold none of that state in memory between steps and
// exactly the plan's during one, and leave no files behind. A file truncated or deleted under the
// run, a write the filesystem refuses, or a read that fails stops the run with one line naming the
// file, the last checkpoint intact; a run killed with -9 resumes from its checkpoint.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/options.h"
#include "comm/single_rank.h"
#include "kernels/cpu.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::shardlm;
using testing::step_losses;

const std::string kAll = " --offload params,grads,optimizer";

class OffloadSlow : public ::testing::Test {
 public:  // the helpers below run their suite's runs
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --eps 1e-6 --save-every 5";
    runs_.create("offload");
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static std::string args(const std::string& out, int steps = 5) { return runs_.args(out, steps, 2); }
  // Without --quiet: the run's header says where the files are and how they are written.
  static std::string loud(std::string a) { return a.erase(a.find(" --quiet"), 8); }
  static std::string slurp(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

// The plan of the runs below (tiny, B2 T32; fsdp at more than one rank), with MPI's scratch.
plan::PlanConfig runs_plan_config(int ranks) {
  plan::PlanConfig pc;
  pc.strategy = ranks > 1 ? plan::Strategy::fsdp : plan::Strategy::ddp;
  pc.world = ranks;
  pc.batch = 2;
  pc.seq = 32;
  pc.reduction_scratch = [o = comm::MpiOptions{}](plan::Op op, int64_t count, int elem, int group) {
    return comm::mpi_scratch_bytes(o, op == plan::Op::reduce_scatter ? comm::Reduction::reduce_scatter : comm::Reduction::all_reduce,
                                   count, elem == 2 ? DType::bf16 : DType::fp32, group);
  };
  return pc;
}

// The step-5 checkpoint files of runs `a` and `b` (of the suite's directory) are equal byte for byte.
void expect_same_checkpoints(const std::string& a, const std::string& b, int ranks, const std::string& what) {
  for (int r = 0; r < ranks; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", r, ranks);
    const fs::path x = OffloadSlow::runs_.dir / a / "ckpt" / "step_5" / name, y = OffloadSlow::runs_.dir / b / "ckpt" / "step_5" / name;
    ASSERT_TRUE(fs::exists(y)) << y;
    EXPECT_TRUE(OffloadSlow::slurp(x) == OffloadSlow::slurp(y)) << what << ": " << name << " differs";
  }
}

// Resident and offloaded runs, 5 steps of tiny: equal losses (exactly), equal checkpoint files
// (byte for byte), the offloaded kinds absent from memory between steps and exactly the plan's
// peak during a step, and the offload directory empty afterwards.
void bitwise_against_resident(int ranks) {
  const std::string strat = ranks > 1 ? " --strategy fsdp" : "";
  const std::string res = "resident_" + std::to_string(ranks), off = "offloaded_" + std::to_string(ranks);
  const Result a = ranks == 1 ? shardlm(OffloadSlow::runs_.args(res, 5, 2) + strat)
                              : mpirun(ranks, OffloadSlow::runs_.args(res, 5, 2) + strat);
  ASSERT_EQ(a.code, 0) << a.out;
  const Result b = ranks == 1 ? shardlm(OffloadSlow::runs_.args(off, 5, 2) + strat + kAll)
                              : mpirun(ranks, OffloadSlow::runs_.args(off, 5, 2) + strat + kAll);
  ASSERT_EQ(b.code, 0) << b.out;
  const fs::path dir = OffloadSlow::runs_.dir;
  const auto want = step_losses(dir / res / "metrics.jsonl"), got = step_losses(dir / off / "metrics.jsonl");
  ASSERT_EQ(want.size(), 5u);
  EXPECT_EQ(got, want);  // exact
  expect_same_checkpoints(res, off, ranks, "--offload params,grads,optimizer");

  // Memory: the plan's figures, with the offloaded kinds' static bytes gone.
  plan::PlanConfig pc = runs_plan_config(ranks);
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 256));
  const plan::Plan resident = plan::build_plan(desc, pc);
  pc.offload.kinds = {true, true, true};
  const plan::Plan p = plan::build_plan(desc, pc);
  EXPECT_EQ(p.static_memory.params + p.static_memory.grads + p.static_memory.optimizer, 0);
  const MemSnapshot want_mem = p.max_memory();
  // Windows come and go only with the compute stream, so the allocator's peak of each offloaded
  // kind is the plan's exactly, every step.
  int64_t window = 0;
  for (const plan::BufferDesc& buf : p.buffers)
    if (buf.role == plan::Role::window) window = std::max(window, buf.bytes);
  int steps = 0;
  for (const auto& row : testing::read_metrics(dir / off / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    ++steps;
    for (const char* k : {"params", "grads", "optimizer"}) {
      EXPECT_EQ(row["mem_between_steps"][k].get<int64_t>(), 0) << k;
      const int64_t got_max = row["mem_max"][k].get<int64_t>();
      const int64_t planned = want_mem[k == std::string("params") ? MemCategory::params
                                       : k == std::string("grads") ? MemCategory::grads : MemCategory::optimizer];
      EXPECT_EQ(got_max, planned) << k << " step " << row["step"];
      EXPECT_GE(got_max, window / 64) << k << " step " << row["step"];  // the windows are really used
    }
  }
  EXPECT_EQ(steps, 5);
  // (tiny's embedding is most of its state, so its windows are too: the drop in the resident
  // figures is the plan test's, on `small`.)
  (void)resident;
  const fs::path files = dir / off / "offload";
  EXPECT_TRUE(!fs::exists(files) || fs::is_empty(files)) << "offload files left in " << files;
}

TEST_F(OffloadSlow, AllStateOnDiskIsBitwiseTheResidentRunOnOneProcess) { bitwise_against_resident(1); }
TEST_F(OffloadSlow, AllStateOnDiskIsBitwiseTheResidentRunUnderFsdpAtTwoRanks) { bitwise_against_resident(2); }

// --offload activations, alone and with every kind of state, read ahead 0 (tiny has two blocks;
// the backward's first consumer keeps its activations, the others' go to disk): bitwise the
// resident run's losses and checkpoints, the allocator's activation peak (and each offloaded
// kind's) the plan's exactly every step, and no files left.
void activations_against_resident(int ranks) {
  const std::string strat = ranks > 1 ? " --strategy fsdp" : "";
  auto run = [&](const std::string& name, const std::string& flags) {
    const std::string a = OffloadSlow::runs_.args(name, 5, 2) + strat + flags;
    return ranks == 1 ? shardlm(a) : mpirun(ranks, a);
  };
  const fs::path dir = OffloadSlow::runs_.dir;
  const std::string res = "act_resident_" + std::to_string(ranks);
  const Result a = run(res, "");
  ASSERT_EQ(a.code, 0) << a.out;
  const auto want = step_losses(dir / res / "metrics.jsonl");
  ASSERT_EQ(want.size(), 5u);
  for (const bool state : {false, true}) {
    const std::string kinds = state ? "params,grads,optimizer,activations" : "activations";
    const std::string off = std::string(state ? "act_all_" : "act_only_") + std::to_string(ranks);
    const Result b = run(off, " --offload " + kinds + " --offload-prefetch 0");
    ASSERT_EQ(b.code, 0) << b.out;
    EXPECT_EQ(step_losses(dir / off / "metrics.jsonl"), want) << kinds;  // exact
    expect_same_checkpoints(res, off, ranks, kinds);
    plan::PlanConfig pc = runs_plan_config(ranks);
    const model::ModelDesc desc = model::describe(model::model_preset("tiny", 256));
    const MemSnapshot resident = plan::build_plan(desc, pc).max_memory();
    pc.offload.activations = true;
    pc.offload.kinds = {state, state, state};
    pc.offload.prefetch = 0;
    const plan::Plan p = plan::build_plan(desc, pc);
    ASSERT_GT(p.activation_file_bytes, 0) << "nothing offloaded";
    const MemSnapshot planned = p.max_memory();
    int steps = 0;
    for (const auto& row : testing::read_metrics(dir / off / "metrics.jsonl")) {
      if (!row.contains("loss")) continue;
      ++steps;
      EXPECT_EQ(row["mem_max"]["activations"].get<int64_t>(), planned[MemCategory::activations]) << kinds << " step " << row["step"];
      for (MemCategory k : {MemCategory::params, MemCategory::grads, MemCategory::optimizer})
        EXPECT_EQ(row["mem_max"][to_string(k)].get<int64_t>(), planned[k]) << kinds << " " << to_string(k) << " step " << row["step"];
    }
    EXPECT_EQ(steps, 5);
    std::printf("tiny B2 T32, %d rank(s), --offload %s: activations peak %lld bytes (resident %lld), %lld bytes to disk a step\n",
                ranks, kinds.c_str(), static_cast<long long>(planned[MemCategory::activations]),
                static_cast<long long>(resident[MemCategory::activations]), static_cast<long long>(p.activation_file_bytes));
    const fs::path files = dir / off / "offload";
    EXPECT_TRUE(!fs::exists(files) || fs::is_empty(files)) << "offload files left in " << files;
  }
}

// What an executor of one process runs on, for the tests below.
struct OneProcess {
  explicit OneProcess(const plan::Plan& plan) : world(memory), comms(world, plan), backend(kernels::make_cpu_backend(memory)) {}
  MemoryPool memory;
  comm::SingleRankCommunicator world;
  run::CommGroups comms;
  std::unique_ptr<kernels::Backend> backend;
};

// The executor tests' step: a synthetic batch over the model's vocabulary, AdamW at lr 1e-2.
run::StepInputs synthetic_inputs(const model::ModelDesc& desc, const plan::PlanConfig& pc) {
  run::StepInputs in;
  in.batch = [n = pc.batch * pc.seq, V = desc.config.vocab_size](int64_t micro, int32_t* inputs, int32_t* targets) {
    for (int64_t i = 0; i < n; ++i) {
      inputs[i] = static_cast<int32_t>((micro * 31 + i * 7) % V);
      targets[i] = static_cast<int32_t>((micro * 17 + i * 5 + 3) % V);
    }
  };
  in.grad_scale = 1.0f / static_cast<float>(pc.batch * pc.seq);
  in.opt.lr = 1e-2f;
  return in;
}

// One step on the executor, tiny B2 T32, with --offload activations read ahead 0 (or resident),
// recording each read of the activations file; `scribble`: each such read finds its slot
// overwritten first (through a plain descriptor; the direct read sees it).
struct ActivationStep {
  double loss = 0;
  std::vector<float> params;
  std::vector<std::pair<int64_t, int64_t>> reads;  // offset, bytes
  int64_t file_bytes = 0;
  std::vector<std::pair<int64_t, int64_t>> slots;  // the plan's
};

ActivationStep activation_step(bool offload, bool scribble, const fs::path& dir) {
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 64));
  plan::PlanConfig pc;
  pc.strategy = plan::Strategy::ddp;
  pc.batch = 2, pc.seq = 32;
  pc.offload.activations = offload;
  pc.offload.prefetch = 0;
  const plan::Plan plan = plan::build_plan(desc, pc);
  ActivationStep out;
  out.file_bytes = plan.activation_file_bytes;
  for (const plan::BufferDesc& b : plan.buffers)
    if (b.disk_offset >= 0) out.slots.push_back({b.disk_offset, b.bytes});
  OneProcess one(plan);
  run::OffloadOptions o;
  o.dir = dir.string();
  std::mutex mu;  // reads come on the copy stream's thread
  o.io.read_fault = [&](const std::string& path, int64_t offset, int64_t bytes) {
    if (path.find("activations") == std::string::npos) return false;
    std::lock_guard<std::mutex> lock(mu);
    out.reads.push_back({offset, bytes});
    if (scribble) {
      std::vector<float> junk(bytes / 4, 0.25f);
      const int fd = ::open(path.c_str(), O_WRONLY);
      EXPECT_GE(fd, 0) << path;
      EXPECT_EQ(::pwrite(fd, junk.data(), bytes, offset), bytes);
      ::close(fd);
    }
    return false;
  };
  run::Executor ex(desc, plan, one.comms, 1, std::chrono::seconds(60), *one.backend, {}, o);
  ex.init_params(7);
  run::StepInputs in = synthetic_inputs(desc, pc);
  out.loss = ex.step(0, in).loss_sum;
  const float* p = ex.whole(plan::State::params);
  out.params.assign(p, p + plan.layout.total);
  return out;
}

// The backward reads its offloaded activations from the file, each slot once, as the plan lays
// them out, and uses what the disk holds: the step is the resident one bit for bit, and a step
// whose slot is overwritten just before its read stops naming the file and the slot (the read
// came from the disk, and its checksum is not the write's), so the equality is not the memory
// pool handing back the freed bytes untouched.
TEST(OffloadActivations, TheBackwardReadsWhatTheDiskHolds) {
  kernels::init_compute(1);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_act_step_" + std::to_string(::getpid()));
  const ActivationStep resident = activation_step(false, false, dir);
  const ActivationStep off = activation_step(true, false, dir);
  std::string scribbled;
  try {
    activation_step(true, true, dir);
  } catch (const std::runtime_error& e) {
    scribbled = e.what();
  }
  fs::remove_all(dir);
  ASSERT_GT(off.file_bytes, 0);
  std::vector<std::pair<int64_t, int64_t>> reads = off.reads, slots = off.slots;
  std::sort(reads.begin(), reads.end());
  std::sort(slots.begin(), slots.end());
  EXPECT_EQ(reads, slots);  // every slot read once, whole
  EXPECT_EQ(off.loss, resident.loss);
  ASSERT_EQ(off.params.size(), resident.params.size());
  EXPECT_EQ(std::memcmp(off.params.data(), resident.params.data(), 4 * off.params.size()), 0);
  EXPECT_NE(scribbled.find("rank-00000.activations: bytes ["), std::string::npos) << scribbled;
  EXPECT_NE(scribbled.find(") read back are not what was written there (checksum)"), std::string::npos) << scribbled;
}

// Three steps on the executor, tiny B2 T32: every kind of state resident, or on disk with each
// unit's part split as `head` says (per unit and kind: the fraction of the part, in whole 4 KiB
// pages, kept in memory). Losses, and the parameters and first moments after the last step.
struct StateSteps {
  std::vector<double> losses;
  std::vector<float> params, exp_avg;
  int64_t heads = 0, static_state = 0;  // resident head elements, the plan's static state bytes
};

StateSteps state_steps(bool offload, double head, const fs::path& dir) {
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 64));
  plan::PlanConfig pc;
  pc.strategy = plan::Strategy::ddp;
  pc.batch = 2, pc.seq = 32;
  StateSteps out;
  if (offload) {
    pc.offload.kinds = {true, true, true};
    const plan::Plan whole = plan::build_plan(desc, pc);
    pc.offload.resident.assign(desc.units.size(), {});
    for (size_t u = 0; u < desc.units.size(); ++u)
      for (int k = 0; k < plan::kNumStateKinds; ++k) {
        const int64_t n = whole.held_elems(plan::State(k), static_cast<int>(u));
        const int64_t most = (n - 1) / plan::kResidentGrain * plan::kResidentGrain;  // fewer than all
        const int64_t kept = static_cast<int64_t>(head * static_cast<double>(n)) / plan::kResidentGrain * plan::kResidentGrain;
        pc.offload.resident[u][k] = std::min(kept, most);
        out.heads += pc.offload.resident[u][k];
      }
  }
  const plan::Plan plan = plan::build_plan(desc, pc);
  out.static_state = plan.static_memory.params + plan.static_memory.grads + plan.static_memory.optimizer;
  OneProcess one(plan);
  run::OffloadOptions o;
  o.dir = dir.string();
  run::Executor ex(desc, plan, one.comms, 1, std::chrono::seconds(60), *one.backend, {}, o);
  ex.init_params(7);
  run::StepInputs in = synthetic_inputs(desc, pc);
  in.grad_clip = 0.5f;  // clipping reads the gradients back (the norm) before the update
  for (int64_t step = 0; step < 3; ++step) {
    in.adam_t = step + 1;
    out.losses.push_back(ex.step(step, in).loss_sum);
  }
  out.params.resize(plan.layout.total);
  out.exp_avg.resize(plan.layout.total);
  ex.gather_full(plan::State::params, out.params.data());
  ex.gather_full(plan::State::exp_avg, out.exp_avg.data());
  return out;
}

// A part of each unit's state kept in memory (a resident head) and the rest on disk gives the
// resident run's steps bit for bit, at a quarter, half and all but the last page of every part: the
// heads are really in memory (the plan's static state is their bytes) and really used (a window
// missing its head would compute with whatever the window held).
TEST(OffloadHeads, APartKeptInMemoryAndTheRestOnDiskIsBitwiseTheResidentRun) {
  kernels::init_compute(1);
  const fs::path dir = fs::temp_directory_path() / ("shardlm_heads_" + std::to_string(::getpid()));
  const StateSteps resident = state_steps(false, 0, dir);
  for (double head : {0.25, 0.5, 1.0}) {
    const StateSteps off = state_steps(true, head, dir);
    ASSERT_GT(off.heads, 0) << head;
    EXPECT_GT(off.static_state, 0) << head;
    EXPECT_EQ(off.losses, resident.losses) << head;
    ASSERT_EQ(off.params.size(), resident.params.size());
    EXPECT_EQ(std::memcmp(off.params.data(), resident.params.data(), 4 * off.params.size()), 0) << head;
    EXPECT_EQ(std::memcmp(off.exp_avg.data(), resident.exp_avg.data(), 4 * off.exp_avg.size()), 0) << head;
  }
  fs::remove_all(dir);
}

TEST_F(OffloadSlow, ActivationsOnDiskAreBitwiseTheResidentRunOnOneProcess) { activations_against_resident(1); }
TEST_F(OffloadSlow, ActivationsOnDiskAreBitwiseTheResidentRunUnderFsdpAtTwoRanks) { activations_against_resident(2); }

// What `explain` says of the memory of a plan of the suite's batch and vocabulary.
testing::Explained explained_memory(int ranks, const std::string& model, const std::string& flags) {
  return testing::explained_memory("explain --ranks " + std::to_string(ranks) + " --model " + model +
                                   " --vocab 256 --batch 2 --seq 32 --threads 1" + flags);
}

// Everything on disk (state, and saved activations read ahead 0) under `flags` (a strategy,
// gradient accumulation): bitwise the resident run (losses and checkpoints), the allocator's peak,
// in all and of every category, the plan's exactly, every step, and the offload files gone.
void everything_on_disk_against_resident(int ranks, const std::string& flags, const std::string& tag) {
  auto run = [&](const std::string& name, const std::string& more) {
    const std::string a = OffloadSlow::runs_.args(name, 5, 2) + flags + more;
    return ranks == 1 ? shardlm(a) : mpirun(ranks, a);
  };
  const std::string all = " --offload params,grads,optimizer,activations --offload-prefetch 0";
  const std::string res = "all_resident_" + tag, off = "all_offloaded_" + tag;
  const Result a = run(res, "");
  ASSERT_EQ(a.code, 0) << a.out;
  const Result b = run(off, all);
  ASSERT_EQ(b.code, 0) << b.out;
  const fs::path dir = OffloadSlow::runs_.dir;
  const auto want = step_losses(dir / res / "metrics.jsonl");
  ASSERT_EQ(want.size(), 5u);
  EXPECT_EQ(step_losses(dir / off / "metrics.jsonl"), want) << flags;  // exact
  expect_same_checkpoints(res, off, ranks, flags);
  const testing::Explained planned = explained_memory(ranks, "tiny", flags + all);
  int steps = 0;
  for (const auto& row : testing::read_metrics(dir / off / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    ++steps;
    for (const char* k : {"params", "grads", "optimizer", "activations", "comm"})
      EXPECT_EQ(row["mem_max"][k].get<int64_t>(), planned.own_peak.at(k)) << flags << " " << k << " step " << row["step"];
    EXPECT_EQ(row["mem"]["total"].get<int64_t>(), planned.total) << flags << " step " << row["step"];
  }
  EXPECT_EQ(steps, 5);
  const fs::path files = dir / off / "offload";
  EXPECT_TRUE(!fs::exists(files) || fs::is_empty(files)) << "offload files left in " << files;
}

// Gradients accumulated over micro-steps: over 5 on one process (past kUnrolledMicroSteps: the
// offload pass lists them all); over 3 under fsdp at 2 ranks, gradients accumulated whole and
// reduced once a step, and reduced every micro-step into the held shard on disk with the pipelined
// optimizer.
TEST_F(OffloadSlow, AccumulatedMicroStepsWithEverythingOnDiskAreBitwiseTheResidentRun) {
  everything_on_disk_against_resident(1, " --grad-accum 5", "accum_1");
  everything_on_disk_against_resident(2, " --strategy fsdp --grad-accum 3", "accum_fsdp");
  everything_on_disk_against_resident(2, " --strategy fsdp --grad-accum 3 --reduce-each-micro-step --pipeline-optimizer",
                                      "accum_fsdp_each");
}

// The other strategies: ddp and zero1 (a unit whose gradients are on disk is a bucket of its own),
// zero2 over 2 micro-steps reduced each, at 3 ranks; hybrid at 4 ranks in shard groups of 2.
TEST_F(OffloadSlow, EveryStrategyWithEverythingOnDiskIsBitwiseTheResidentRun) {
  everything_on_disk_against_resident(3, " --strategy ddp --bucket-mb 0.05", "ddp");
  everything_on_disk_against_resident(3, " --strategy zero1", "zero1");
  everything_on_disk_against_resident(3, " --strategy zero2 --grad-accum 2 --reduce-each-micro-step", "zero2");
  everything_on_disk_against_resident(4, " --strategy hybrid --shard-group 2", "hybrid");
}

// A reduce-scatter that adds into a gradient window waits for that window's reload, so it runs when
// the disk lets it; its scratch (the communicator's working memory) still counts where the plan
// says, and the allocator's peak is the plan's: `small` (whose reduce-scatters take MPI scratch;
// tiny's are too small to) at 2 ranks over 3 micro-steps, gradients on disk.
TEST_F(OffloadSlow, AReduceScatterWaitingForItsGradientWindowKeepsThePlansPeak) {
  const std::string flags = " --strategy fsdp --grad-accum 3 --reduce-each-micro-step --offload grads";
  const Result r = mpirun(2, runs_.args("late_scatter", 2, 2, "small") + flags);
  ASSERT_EQ(r.code, 0) << r.out;
  const int64_t planned = explained_memory(2, "small", flags).total;
  int steps = 0;
  for (const auto& row : testing::read_metrics(dir_ / "late_scatter" / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    ++steps;
    EXPECT_EQ(row["mem"]["total"].get<int64_t>(), planned) << "step " << row["step"];
  }
  EXPECT_EQ(steps, 2);
}

// Any subset of the kinds, other families (untied LLaMA, a MoE block borrowing its experts) and
// recompute modes: the same losses as resident, exactly (one process; 4 steps).
TEST_F(OffloadSlow, EverySubsetFamilyAndRecomputeModeKeepsTheLossesExact) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"tiny", "params"}, {"tiny", "grads"}, {"tiny", "optimizer"}, {"tiny", "params,grads"},
      {"llama-tiny --recompute full", "params,grads,optimizer"},
      {"llama-tiny --recompute selective", "grads,optimizer"},
      {"moe-tiny", "params,grads,optimizer"}};
  int i = 0;
  for (const auto& [model, kinds] : cases) {
    const std::string name = "subset_" + std::to_string(i++);
    const Result a = shardlm(runs_.args(name + "_res", 4, 2, model));
    ASSERT_EQ(a.code, 0) << a.out;
    const Result b = shardlm(runs_.args(name + "_off", 4, 2, model) + " --offload " + kinds);
    ASSERT_EQ(b.code, 0) << b.out;
    const auto want = step_losses(dir_ / (name + "_res") / "metrics.jsonl");
    ASSERT_EQ(want.size(), 4u) << model;
    EXPECT_EQ(step_losses(dir_ / (name + "_off") / "metrics.jsonl"), want) << model << " --offload " << kinds;
  }
}

// --offload activations (read ahead 0, so tiny's first block moves) with other families (untied
// LLaMA, a MoE block whose stages share its saved activations), selective recompute (the saved
// part moves, the rebuilt part does not), compressed activations (--act-quant int8: the int8
// bytes move as they are) and with the pipelined optimizer: the resident run's losses, exactly
// (one process; 4 steps).
TEST_F(OffloadSlow, ActivationsWithOtherFamiliesRecomputeAndActQuantKeepTheLossesExact) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"llama-tiny", "activations"},
      {"llama-tiny --recompute selective", "activations,grads"},
      {"moe-tiny", "activations"},
      {"tiny --act-quant int8", "activations"},
      {"moe-tiny --act-quant int8 --act-quant-group 32", "activations"},
      {"tiny --pipeline-optimizer", "activations"},
      {"tiny --pipeline-optimizer", "params,grads,optimizer,activations"}};
  int i = 0;
  for (const auto& [model, kinds] : cases) {
    const std::string name = "act_case_" + std::to_string(i++);
    const Result a = shardlm(runs_.args(name + "_res", 4, 2, model));
    ASSERT_EQ(a.code, 0) << a.out;
    const Result b = shardlm(runs_.args(name + "_off", 4, 2, model) + " --offload " + kinds + " --offload-prefetch 0");
    ASSERT_EQ(b.code, 0) << b.out;
    const auto want = step_losses(dir_ / (name + "_res") / "metrics.jsonl");
    ASSERT_EQ(want.size(), 4u) << model;
    EXPECT_EQ(step_losses(dir_ / (name + "_off") / "metrics.jsonl"), want) << model << " --offload " << kinds;
  }
}

// tmpfs (which before Linux 6.6 refuses O_DIRECT; the files are then opened buffered): the log
// says which I/O was used, and the losses stay exact.
TEST_F(OffloadSlow, OnTmpfsTheLogSaysWhichIoWasUsed) {
  if (!fs::exists("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  const fs::path where = "/dev/shm/shardlm_offload_test_" + std::to_string(::getpid());
  const Result r = shardlm(loud(args("tmpfs", 3)) + kAll + " --offload-dir " + where.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("offload: params,grads,optimizer on disk under " + where.string() + " ("), std::string::npos) << r.out;
  EXPECT_TRUE(r.out.find("io_uring, O_DIRECT)") != std::string::npos ||
              r.out.find("buffered (the filesystem refused O_DIRECT)") != std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(where)) << "the offload directory it made is left";
  const Result base = shardlm(args("tmpfs_resident", 3));
  ASSERT_EQ(base.code, 0) << base.out;
  EXPECT_EQ(step_losses(dir_ / "tmpfs" / "metrics.jsonl"), step_losses(dir_ / "tmpfs_resident" / "metrics.jsonl"));
}

// Saved activations alone on disk: with prefetch 0 every block's but the last's are written out.
const std::string kActivations = " --offload activations --offload-prefetch 0";

// A run of many steps started in the background; `damage` strikes its offload file `file` once it
// has saved a checkpoint and gone on, and again every 100 ms while the file is there and the run
// goes on. The run must stop with one line naming the file (`what`, or, where a truncation landed
// just before a write past it, which made the file whole again with zeros in between, the
// checksum line of the range that lost bytes), and the checkpoint it saved must still load (a
// resume runs from it).
void damaged_mid_run(const std::string& name, const std::function<void(const fs::path&)>& damage, const std::string& what,
                     const std::string& file_name = "params", const std::string& offload = kAll) {
  const fs::path dir = OffloadSlow::runs_.dir, out = dir / name, log = dir / (name + ".log");
  // exec: the pid is the run's own, so that a kill ends it and not only the shell.
  const std::string cmd = "exec " + testing::shardlm_binary() + " " + OffloadSlow::runs_.args(name, 100000, 2) + offload +
                          " --save-every 2 > " + log.string() + " 2>&1";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const fs::path file = out / "offload" / ("rank-00000." + file_name);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(out / "ckpt" / "step_4") && testing::read_metrics(out / "metrics.jsonl").size() >= 5) break;
    if (waitpid(pid, &status, WNOHANG) == pid) FAIL() << "the run ended before its files were damaged:\n" << OffloadSlow::slurp(log);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(fs::exists(file)) << file;
  damage(file);
  bool ended = false;
  for (int i = 1; i <= 6000 && !ended; ++i) {  // 60 s
    ended = waitpid(pid, &status, WNOHANG) == pid;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!ended && i % 10 == 0 && fs::exists(file)) damage(file);
  }
  if (!ended) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    FAIL() << "the run went on after its offload file was damaged";
  }
  const std::string text = OffloadSlow::slurp(log);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << text;
  const std::string named = "offload file " + file.string() + ": ";
  EXPECT_TRUE(text.find(named + what) != std::string::npos ||
              (text.find(named + "bytes [") != std::string::npos && text.find("(checksum)") != std::string::npos))
      << text;
  // The latest checkpoint is intact: a fresh run resumes from it and trains on. On a loaded
  // machine the run may have gone past step 4 before a strike stuck, so it trains 3 steps past
  // whichever checkpoint is the latest (ckpt/latest: "step_N").
  std::ifstream latest(out / "ckpt" / "latest");
  std::string step_dir;
  ASSERT_TRUE(latest >> step_dir) << "no ckpt/latest in " << out;
  ASSERT_EQ(step_dir.rfind("step_", 0), 0u) << step_dir;
  const int steps = std::stoi(step_dir.substr(5)) + 3;
  const Result r = shardlm(OffloadSlow::loud(OffloadSlow::runs_.args(name + "_resumed", steps, 2)) + offload +
                           " --resume " + out.string() + " --resume-override steps");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + out.string()), std::string::npos) << r.out;
}

TEST_F(OffloadSlow, AFileTruncatedMidRunStopsTheRunNamingIt) {
  damaged_mid_run("truncated", [](const fs::path& f) { fs::resize_file(f, 4096); }, "is 4096 bytes");
}

TEST_F(OffloadSlow, AFileDeletedMidRunStopsTheRunNamingIt) {
  damaged_mid_run("deleted", [](const fs::path& f) { fs::remove(f); }, "deleted while the run was using it");
}

// The activations file likewise (a scratch file within each step, written and read every step).
TEST_F(OffloadSlow, AnActivationsFileTruncatedMidRunStopsTheRunNamingIt) {
  damaged_mid_run("act_truncated", [](const fs::path& f) { fs::resize_file(f, 4096); }, "is 4096 bytes", "activations",
                  kActivations);
}

TEST_F(OffloadSlow, AnActivationsFileDeletedMidRunStopsTheRunNamingIt) {
  damaged_mid_run("act_deleted", [](const fs::path& f) { fs::remove(f); }, "deleted while the run was using it",
                  "activations", kActivations);
}

// A read the disk fails (SHARDLM_FAULT_DISK_READ=0:5: rank 0's first read of step 5, an EIO
// through the disk store's read_fault seam): the run stops with one line naming the file, and
// the step-4 checkpoint it saved before resumes. With the state on disk the first read is a
// state window's; with saved activations alone, an activation slot's.
void read_error(const std::string& name, const std::string& offload, const std::string& file_name) {
  testing::TinyRuns& runs = OffloadSlow::runs_;
  const fs::path dir = OffloadSlow::dir_;
  runs.flags = "--lr 3e-3 --eps 1e-6 --save-every 2";
  const std::string a = runs.args(name, 8, 2) + offload;
  runs.flags = "--lr 3e-3 --eps 1e-6 --save-every 5";
  const Result r = testing::run_command("SHARDLM_FAULT_DISK_READ=0:5 " + testing::shardlm_binary() + " " + a);
  EXPECT_NE(r.code, 0) << r.out;
  const fs::path files = dir / name / "offload";
  EXPECT_NE(r.out.find("offload file " + files.string() + "/rank-00000." + file_name), std::string::npos) << r.out;
  const size_t at = r.out.find(": read failed: Input/output error");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("read failed", at + 13), std::string::npos) << "said more than once:\n" << r.out;
  const size_t begin = r.out.rfind('\n', at) + 1;  // npos + 1: the first line
  std::printf("the run's line: %s\n", r.out.substr(begin, r.out.find('\n', at) - begin).c_str());
  EXPECT_TRUE(fs::exists(dir / name / "ckpt" / "step_4")) << r.out;
  EXPECT_FALSE(fs::exists(dir / name / "ckpt" / "step_6")) << r.out;
  const Result resumed = shardlm(OffloadSlow::loud(runs.args(name + "_resumed", 6, 2)) + offload + " --resume " +
                                 (dir / name).string() + " --resume-override steps");
  EXPECT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from " + (dir / name).string()), std::string::npos) << resumed.out;
}

TEST_F(OffloadSlow, AReadErrorStopsTheRunNamingTheFile) { read_error("readerr", kAll, ""); }

TEST_F(OffloadSlow, AnActivationsReadErrorStopsTheRunNamingTheFile) { read_error("act_readerr", kActivations, "activations:"); }

// The files are written out in full before the first step, so a disk too small (or a file size
// limit) fails there, naming the file; nothing is left behind.
TEST_F(OffloadSlow, AWriteTheFilesystemRefusesStopsTheRunNamingTheFile) {
  // RLIMIT_FSIZE with SIGXFSZ ignored: writes past 256 KiB fail with EFBIG.
  const fs::path out = dir_ / "fsize";
  const Result r = testing::run_command("sh -c \"trap '' XFSZ; ulimit -f 256; exec " + testing::shardlm_binary() + " " +
                                        args("fsize", 3) + kAll + "\"");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("offload file " + (out / "offload").string() + "/rank-00000.params: write failed: File too large"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(out / "offload" / "rank-00000.params"));
  // The activations file is made whole before the first step too (0.2 MiB here).
  const Result act = testing::run_command("sh -c \"trap '' XFSZ; ulimit -f 32; exec " + testing::shardlm_binary() + " " +
                                          args("act_fsize", 3) + kActivations + "\"");
  EXPECT_NE(act.code, 0) << act.out;
  EXPECT_NE(act.out.find("offload file " + (dir_ / "act_fsize" / "offload").string() +
                         "/rank-00000.activations: write failed: File too large"),
            std::string::npos)
      << act.out;
  EXPECT_FALSE(fs::exists(dir_ / "act_fsize" / "offload" / "rank-00000.activations"));
  // A full disk: a 256 KiB tmpfs (needs root; skipped without it).
  const fs::path tiny = dir_ / "tinyfs";
  fs::create_directories(tiny);
  if (::mount("tmpfs", tiny.c_str(), "tmpfs", 0, "size=256k") != 0) GTEST_SKIP() << "cannot mount a tmpfs here";
  const Result full = shardlm(args("full", 3) + kAll + " --offload-dir " + tiny.string());
  ::umount(tiny.c_str());
  EXPECT_NE(full.code, 0) << full.out;
  EXPECT_NE(full.out.find("offload file " + tiny.string() + "/rank-00000.params: write failed: No space left on device"),
            std::string::npos)
      << full.out;
}

// Killed with -9 at step 4 (offload files left behind): the run resumes from its step-4
// checkpoint, replaces the stale files, and ends with the uninterrupted run's losses.
TEST_F(OffloadSlow, ARunKilledWithNineResumesFromItsCheckpoint) {
  runs_.flags = "--lr 3e-3 --eps 1e-6 --save-every 2";
  const std::string straight = args("k_straight", 6) + kAll, part = args("k_part", 6) + kAll;
  runs_.flags = "--lr 3e-3 --eps 1e-6 --save-every 5";
  ASSERT_EQ(shardlm(straight).code, 0);
  const Result killed = testing::run_command("SHARDLM_FAULT_KILL=0:4 " + testing::shardlm_binary() + " " + part);
  ASSERT_NE(killed.code, 0);
  EXPECT_TRUE(fs::exists(dir_ / "k_part" / "offload" / "rank-00000.params")) << "expected stale files after -9";
  const Result r = shardlm(part + " --resume " + (dir_ / "k_part").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = step_losses(dir_ / "k_straight" / "metrics.jsonl"), b = step_losses(dir_ / "k_part" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(!fs::exists(dir_ / "k_part" / "offload") || fs::is_empty(dir_ / "k_part" / "offload"));
}

}  // namespace
}  // namespace shardlm
