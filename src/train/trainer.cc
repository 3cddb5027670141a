#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>

#include "ckpt/sharded.h"
#include "data/corpus.h"
#include "data/sampler.h"
#include "data/shard.h"
#include "files/replace_file.h"
#include "kernels/cpu.h"
#ifdef SHARDLM_CUDA
#include "kernels/cuda_backend.h"
#endif
#include "run/executor.h"
#include "tensor/disk_store.h"
#include "train/agreement.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/flow_samples.h"
#include "train/guard.h"
#include "train/resume_check.h"
#include "train/run_dir.h"
#include "train/run_report.h"
#include "train/memory_check.h"
#include "train/run_state_io.h"
#include "train/schedule.h"
#include "train/session.h"
#include "train/snapshots.h"
#include "trace/trace.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

json mem_json(const MemSnapshot& s) {
  json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

std::string progress_bar(int64_t done, int64_t total, int width = 20) {
  const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  std::string bar(width + 2, '.');
  bar.front() = '[';
  bar.back() = ']';
  bar.replace(1, filled, filled, '#');
  return bar;
}

}  // namespace

std::string checkpoint_dir(const std::string& out, int64_t step) { return out + "/ckpt/step_" + std::to_string(step); }

DataMeta read_data_meta(const std::string& prefix) {
  DataMeta m;
  const std::string path = prefix + "_meta.json";
  std::ifstream f(path);
  if (!f) {
    try {  // a file that cannot be read is refused, naming it, where the run opens it
      if (data::TokenShard(data::split_files(prefix, "train").front()).token_bytes() == 4) m = {"llama3", 128256};
    } catch (const std::exception&) {
    }
    return m;
  }
  try {
    const json j = json::parse(f);
    m.tokenizer = j.at("tokenizer").get<std::string>();
    m.vocab_size = j.at("vocab_size").get<int64_t>();
    m.eot = j.value("eot", -1);
  } catch (const std::exception&) {
    throw std::runtime_error(path + ": expected {\"tokenizer\": name, \"vocab_size\": n, \"eot\": id (optional)}");
  }
  return m;
}

int32_t document_start_token(const DataMeta& meta) {
  if (meta.eot >= 0) return meta.eot;
  if (meta.tokenizer == "gpt2") return 50256;
  if (meta.tokenizer == "llama3") return 128000;
  return '\n';
}

void write_data_meta(const std::string& prefix, const DataMeta& meta) {
  json j = {{"tokenizer", meta.tokenizer}, {"vocab_size", meta.vocab_size}};
  if (meta.eot >= 0) j["eot"] = meta.eot;
  files::replace_file(prefix + "_meta.json", j.dump() + "\n");
}

double measure_gemm_gflops(MemoryPool& memory) {
  // The best of repeated large square GEMMs over ~0.6 s, plain and with the second operand
  // transposed (a weight's layout), which can run faster: short runs (a few ms) catch the thread
  // pool and the clock still ramping up and under-read the peak by 30% or more, and one layout
  // alone read ~10% under the model's own GEMMs (the quick start showed an MFU over 100%).
  const int64_t n = 2048;
  Buffer a(memory, MemCategory::workspace, 4 * n * n), b(memory, MemCategory::workspace, 4 * n * n),
      c(memory, MemCategory::workspace, 4 * n * n);
  std::fill(a.f32(), a.f32() + n * n, 0.5f);
  std::fill(b.f32(), b.f32() + n * n, 0.25f);
  std::fill(c.f32(), c.f32() + n * n, 0.0f);
  double best = 1e30, spent = 0;
  for (int rep = 0; rep < 4 || (spent < 600 && rep < 60); ++rep) {
    auto t0 = Clock::now();
    kernels::matmul(false, rep % 2 == 1, n, n, n, 1.0f, a.f32(), n, b.f32(), n, 0.0f, c.f32(), n);
    const double ms = ms_since(t0);
    spent += ms;
    if (rep > 0) best = std::min(best, ms);
  }
  return 2.0 * n * n * n / (best * 1e-3) / 1e9;
}

namespace {
// The plan's question about a reduction task, put to the communicator's scratch_bytes.
std::function<int64_t(plan::Op, int64_t, int, int)> reduction_scratch(
    std::function<int64_t(comm::Reduction, int64_t, DType, int)> scratch_bytes) {
  return [scratch_bytes](plan::Op op, int64_t count, int elem, int group) {
    return scratch_bytes(op == plan::Op::reduce_scatter ? comm::Reduction::reduce_scatter : comm::Reduction::all_reduce,
                         count, float_dtype(elem), group);
  };
}
}  // namespace

kernels::CudaOptions cuda_options(const TrainConfig& c) {
  kernels::CudaOptions o = c.cuda;
  o.bf16_gemm = c.compute_dtype != "fp32";
  return o;
}

plan::PlanConfig plan_config(const TrainConfig& cfg, int world) {
  plan::PlanConfig pc;
  pc.world = world;
  plan::apply_plan_options(cfg, pc);
  if (cfg.device == "cuda") {
    const kernels::CudaOptions o = cuda_options(cfg);
    pc.kernel_scratch = {true, o.bf16_gemm, o.bf16_operands, o.attention == kernels::CudaOptions::Attention::mma,
                         o.attention != kernels::CudaOptions::Attention::flash, o.head_rows};
  }
  pc.reduction_scratch = reduction_scratch([o = cfg.comm](comm::Reduction op, int64_t count,
                                                                               DType dtype, int group) {
    return comm::mpi_scratch_bytes(o, op, count, dtype, group);
  });
  return pc;
}

namespace {

// The plan for the communicator at hand: its reductions' scratch as `world` takes it.
plan::PlanConfig plan_config(const TrainConfig& cfg, const comm::Communicator& world) {
  plan::PlanConfig pc = plan_config(cfg, world.size());
  pc.pipe_rank = plan::pipe_rank_of(pc, world.rank());
  // On a device, collectives are staged through host memory (comm/staged.h), where the MPI
  // communicator underneath takes its scratch itself, or run by NCCL (comm/nccl.h), which keeps
  // its own buffers: no device scratch to plan.
  // (SHARDLM_TEST_CPU_AS_DEVICE's runs keep the CPU's plan: its scratch goes unused.)
  if (cfg.device != "cpu") {
    pc.reduction_scratch = nullptr;
    return pc;
  }
  pc.reduction_scratch = reduction_scratch([&world](comm::Reduction op, int64_t count, DType dtype, int group) {
    return world.scratch_bytes(op, count, dtype, group);
  });
  return pc;
}

}  // namespace

std::unique_ptr<kernels::Backend> make_backend(const TrainConfig& c, MemoryPool& memory, bool cpu_as_device) {
  if (c.device == "cpu") return kernels::make_cpu_backend(memory, cpu_as_device);
#ifdef SHARDLM_CUDA
  if (!kernels::cuda_device_present()) throw std::runtime_error("--device cuda: no CUDA device present");
  return kernels::make_cuda_backend(memory, cuda_options(c));
#else
  throw std::runtime_error("--device cuda: this build has no CUDA backend (configure with -DSHARDLM_CUDA=ON)");
#endif
}

namespace {

bool is_flow(const model::ModelConfig& mc) { return mc.family == model::Family::dit; }

std::optional<data::TokenCorpus> token_split(const TrainConfig& c, const model::ModelConfig& mc, const char* split) {
  if (is_flow(mc)) return std::nullopt;
  return data::TokenCorpus(data::split_files(c.data, split));
}

// A diffusion model's split: DIR/train.bin or DIR/val.bin (data/latents.h).
std::optional<data::LatentSet> latent_split(const TrainConfig& c, const model::ModelConfig& mc, const char* split) {
  if (!is_flow(mc)) return std::nullopt;
  return data::LatentSet(c.data + "/" + split + ".bin");
}

}  // namespace

Session::Session(const TrainConfig& c, comm::Communicator& w, MemoryPool& memory, const model::ModelConfig& mc,
                 const DataMeta& m, const TrainHooks& h, const run::OffloadOptions& offload)
    : cfg(c),
      hooks(h),
      world(w),
      memory(memory),
      rank(w.rank()),
      N(w.size()),
      lead(rank == 0),
      talk(lead && !c.quiet),
      timeout(static_cast<int64_t>(c.timeout_s * 1000)),
      meta(m),
      train_data(token_split(c, mc, "train")),
      val_data(token_split(c, mc, "val")),
      train_latents(latent_split(c, mc, "train")),
      val_latents(latent_split(c, mc, "val")),
      desc(model::describe(refuse_unless_state_fits(mc, 16, w.size(), c.machines))),
      // Sharded saves and resumes work in place on each rank's ranges; only resuming an older
      // whole checkpoint (or --init-from a Hugging Face directory) stages whole state on every rank.
      plan(refuse_unless_plan_fits(with_snapshot_memory(plan::build_plan(desc, plan_config(c, w)), c),
                                   (!c.resume.empty() && !ckpt::is_sharded(c.resume)) ||
                                       (!c.init_from.empty() && !ckpt::is_sharded(c.init_from)),
                                   c.machines)),
      backend(make_backend(c, memory, h.cpu_as_device)),
      comms(w, plan, backend.get(), c.comm_backend == "nccl" ? run::DeviceCollectives::nccl : run::DeviceCollectives::staged),
      ex(desc, plan, comms, c.threads, timeout, *backend, h.executor_faults, offload),
      writer(c.async_save ? std::make_unique<ckpt::AsyncRankWriter>(memory, desc, sharded_layout(plan, N), rank)
                          : nullptr) {}

namespace {

// The run's model; with --resume (or --init-from) the checkpoint's must be the same.
model::ModelConfig resolve_model(const TrainConfig& cfg, const DataMeta& meta) {
  model::ModelConfig mc = cfg.model_config(meta.vocab_size);
  if (cfg.resume.empty() && cfg.init_from.empty()) return mc;
  const std::string& dir = cfg.resume.empty() ? cfg.init_from : cfg.resume;
  const model::ModelConfig saved = cfg.resume.empty() ? read_initial_config(dir) : read_checkpoint_config(dir);
  auto check = [&](const char* field, auto run, auto ck) {
    if (run != ck)
      throw std::runtime_error(fmt::format("checkpoint: {}/config.json: {} is {} but this run's model has {}", dir,
                                           field, ck, run));
  };
  check("model_type", std::string(model::to_string(mc.family)), std::string(model::to_string(saved.family)));
  check("n_layer", mc.n_layer, saved.n_layer);
  check("n_head", mc.n_head, saved.n_head);
  check("n_kv_head", mc.n_kv_head, saved.n_kv_head);
  check("n_embd", mc.n_embd, saved.n_embd);
  // A model whose every block is MoE has no dense MLP: its ffn_dim shapes nothing (a Mixtral
  // config.json does not carry it).
  if (mc.family != model::Family::moe || mc.moe_every != 1) check("ffn_dim", mc.ffn_dim, saved.ffn_dim);
  if (mc.family == model::Family::moe) {
    check("n_experts", mc.n_experts, saved.n_experts);
    check("moe_ffn_dim", mc.moe_ffn_dim, saved.moe_ffn_dim);
    check("moe_every", mc.moe_every, saved.moe_every);
  }
  check("vocab_size", mc.vocab_size, saved.vocab_size);
  check("max_seq", mc.max_seq, saved.max_seq);
  check("tie_word_embeddings", mc.tie_embeddings, saved.tie_embeddings);
  return mc;
}

// What start-up settles: rank 0's run directory (null on the other ranks), this run's id (every
// rank), and the snapshot store with --resume auto's choice from it.
struct StartUp {
  std::unique_ptr<RunDirectory> dir;
  std::string run_id;
  std::unique_ptr<ckpt::SnapshotStore> snapshots;  // with --snapshot-every or --resume auto
  ckpt::SnapshotChoice snapshot;                   // --resume auto's, when it took one (else step -1)
  int64_t steps_lost = -1;                         // rank 0: steps its run had done past that snapshot
};

// The steps a run had completed by its metrics (its last training row's index + 1); -1 when none.
int64_t steps_done_by_metrics(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  int64_t done = -1;
  while (std::getline(in, line)) {
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
    if (row.is_object() && row.contains("loss") && !row.contains("val_loss") && row.contains("step") &&
        row["step"].is_number_integer())
      done = std::max(done, row["step"].get<int64_t>() + 1);
  }
  return done;
}

// Before any collective of the step: the ranks agree on their settings and find which of them
// share a machine (train/machines.h: memory checks, snapshot partners, the GPU); rank 0 takes the run
// directory (whose run it holds says which snapshots are this run's), then checks that a resume
// continues the saved run and admits the run into the directory. A failure there ends every
// rank. --resume names a run or step directory; afterwards cfg.resume is the step directory on
// every rank. --resume auto picks a snapshot (cfg.resume becomes empty) or a checkpoint.
StartUp start_up(TrainConfig& cfg, comm::Communicator& world, MemoryPool& memory) {
  const std::chrono::milliseconds timeout(static_cast<int64_t>(cfg.timeout_s * 1000));
  check_ranks_agree(cfg, world, timeout);
  cfg.machines = find_machines(world, timeout, cfg.test_ranks_per_machine);
  cfg.cuda.local_rank = cfg.machines.local_rank;
  if (cfg.strategy == "hybrid" && cfg.shard_group == 0) {
    cfg.shard_group = machine_shard_group(cfg.machines, world.size());
    if (cfg.shard_group == 0)
      throw AgreedFailure(fmt::format("--strategy hybrid: the ranks are not placed a machine's worth at a time ({}), so no "
                                      "machine's ranks can be the shard group; give --shard-group G (G consecutive "
                                      "ranks shard, the groups replicate)",
                                      describe(cfg.machines)),
                          world.rank() == 0);
  }
  warn_of_threads_beyond_cpus(world, timeout, cfg.threads);
  const std::string asked_resume = cfg.resume;  // before --resume auto replaces it
  StartUp up;
  on_lead_or_all_fail(world, timeout, [&] { up.dir = RunDirectory::open(cfg.out); });
  check_out_shared(world, timeout, cfg.out);
  const std::string held_run = lead_text(world, timeout, up.dir ? up.dir->held_run_id() : "");
  if (cfg.snapshot_every > 0 || cfg.resume == "auto") up.snapshots = make_snapshot_store(cfg, world, memory, timeout);
  if (cfg.resume == "auto") up.snapshot = resume_auto(cfg, world, *up.snapshots, held_run);
  on_lead_or_all_fail(world, timeout, [&] {
    RunDirectory::Start start;
    TrainConfig asked = cfg;
    asked.resume = asked_resume;
    check_resume_override_use(asked);
    // A MoE checkpoint's routing changes --resume-override allows, said once admitted. (A snapshot
    // holds its model in its layout, which resume_auto takes only when it is this run's.)
    std::vector<std::string> routing_changes;
    if (up.snapshot.step >= 0) {
      const RunState saved = snapshot_state(up.snapshot.meta);
      const std::string source = "snapshot " + up.snapshots->prefix() + " of step " + std::to_string(saved.step);
      check_resume_matches(asked, world.size(), saved.run, source);
      check_resume_has_steps_left(cfg, saved.step, source);
      start.resumed_step = saved.step;
      start.from_snapshot = true;
      if (const int64_t done = steps_done_by_metrics(up.dir->metrics_path()); done >= saved.step)
        up.steps_lost = done - saved.step;
    } else if (!cfg.resume.empty()) {
      cfg.resume = ckpt::resolve_checkpoint(cfg.resume);
      const model::ModelConfig mc = resolve_model(cfg, read_data_meta(cfg.data));  // refused before DIR changes
      routing_changes = check_routing_matches(cfg, mc, read_checkpoint_config(cfg.resume), cfg.resume + "/config.json");
      const RunState saved = read_checkpoint_state(cfg.resume);
      const std::string state_path = cfg.resume + (ckpt::is_sharded(cfg.resume) ? "/index.json" : "/state.json");
      check_resume_matches(cfg, world.size(), saved.run, state_path);
      check_resume_has_steps_left(cfg, saved.step, state_path);
      start.resumed_step = saved.step;
    } else if (!cfg.init_from.empty()) {
      cfg.init_from = resolve_initial(cfg.init_from);
      const model::ModelConfig mc = resolve_model(cfg, read_data_meta(cfg.data));
      routing_changes = check_routing_matches(cfg, mc, read_initial_config(cfg.init_from), cfg.init_from + "/config.json");
    }
    start.auto_found_nothing = asked_resume == "auto" && start.resumed_step < 0;
    up.dir->admit(cfg, world.size(), start);
    if (up.dir->restarts())
      fmt::print("--resume auto: {} holds this run (run {}, its run.json), killed before it saved anything: it restarts "
                 "from step 0\n",
                 cfg.out, up.dir->run_id());
    for (const std::string& change : routing_changes) fmt::print("{}\n", change);
    std::fflush(stdout);
  });
  up.run_id = lead_text(world, timeout, up.dir ? up.dir->run_id() : "");
  if (world.rank() != 0 && !cfg.resume.empty()) cfg.resume = ckpt::resolve_checkpoint(cfg.resume);
  if (!cfg.resume.empty()) cfg.init_from.clear();  // the checkpoint holds the weights
  if (world.rank() != 0 && !cfg.init_from.empty()) cfg.init_from = resolve_initial(cfg.init_from);
  return up;
}

// A diffusion model's splits hold records of its latents' shape and classes.
void check_latents_fit(const Session& s) {
  const model::ModelConfig& mc = s.desc.config;
  const data::LatentShape want{mc.frames, mc.height, mc.width, mc.channels, mc.num_classes};
  for (const data::LatentSet* split : {&*s.train_latents, &*s.val_latents}) {
    const data::LatentShape& got = split->shape();
    if (!(got == want))
      throw AgreedFailure(fmt::format("{}: records of {}x{}x{}x{} latents in {} classes, but model {} takes {}x{}x{}x{} in {}",
                                      split->path(), got.frames, got.height, got.width, got.channels, got.classes,
                                      s.cfg.model, want.frames, want.height, want.width, want.channels, want.classes),
                          s.lead);
    if (split->size() < 1) throw AgreedFailure(split->path() + ": no records", s.lead);
  }
}

// Every run samples its training split and evaluates its validation split at least once (at the
// end), each in windows of --seq + 1 tokens: a split shorter than one is refused before the first
// step, not found after the last. Every rank reads the same files, so rank 0 alone reports it.
void check_splits_hold_a_window(const Session& s) {
  if (s.train_latents) return check_latents_fit(s);
  const int64_t window = s.cfg.seq + 1;
  for (const data::TokenCorpus* split : {&*s.train_data, &*s.val_data})
    if (split->size() < window)
      throw AgreedFailure(fmt::format("{}: {} tokens, fewer than the {} one window of --seq {} needs", split->path(),
                                      split->size(), window, s.cfg.seq),
                          s.lead);
}

// Where the disk tier's files go: --offload-dir, else DIR/offload, which is the run's. The run
// removes the directory at its end (when empty) unless it was there before the run: a directory
// the user made is theirs. Asked before the ranks' first collective, so that no rank has made it
// yet, and each rank asks of its own (--offload-dir may be node-local).
run::OffloadOptions offload_options(const TrainConfig& cfg) {
  run::OffloadOptions o{cfg.offload_dir.empty() ? cfg.out + "/offload" : cfg.offload_dir, {}};
  std::error_code ec;
  o.io.remove_dir = cfg.offload_dir.empty() || !std::filesystem::exists(cfg.offload_dir, ec);
  return o;
}

// The per-category maximum over ranks of a memory snapshot (collective).
MemSnapshot max_over_ranks(Session& s, const MemSnapshot& mine) {
  std::vector<int64_t> all(kNumMemCategories * s.N);
  s.world.all_gather(mine.bytes.data(), all.data(), 2 * kNumMemCategories, DType::fp32, "memory")->wait(s.timeout);
  MemSnapshot out;
  for (int r = 0; r < s.N; ++r)
    for (int c = 0; c < kNumMemCategories; ++c) out.bytes[c] = std::max(out.bytes[c], all[r * kNumMemCategories + c]);
  for (int c = 0; c < kNumMemCategories; ++c) out.total += out.bytes[c];
  return out;
}

double max_over_ranks(Session& s, double mine) {
  std::vector<double> all(s.N);
  s.world.all_gather(&mine, all.data(), 2, DType::fp32, "metrics")->wait(s.timeout);
  return *std::max_element(all.begin(), all.end());
}

double run_eval(Session& s) {
  const double val = s.val_latents ? evaluate_flow(s.ex, s.desc, s.plan.config, *s.val_latents, s.cfg.batch, s.cfg.seed,
                                                   s.cfg.eval_windows, s.rank)
                                   : evaluate(s.ex, s.desc, s.plan.config, *s.val_data, s.cfg.batch, s.cfg.seq,
                                              s.cfg.eval_windows, s.rank);
  if (s.lead) s.metrics << json{{"step", s.state.step}, {"val_loss", val}}.dump() << "\n" << std::flush;
  if (s.talk) fmt::print("step {:>6} | val_loss {:.4f}\n", s.state.step, val);
  return val;
}

// The stop signal any rank has received, agreed by all (collective: every rank stops at the
// same step, and a job missing a rank never gets past it to a checkpoint).
int agreed_stop_signal(Session& s) { return static_cast<int>(max_over_ranks(s, StopSignals::pending())); }

// "SIGTERM": glibc's abbreviation of the signal, so every stop signal guard.cc routes is named.
std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal";
}

// A signal asked the run to stop after the step just finished: a checkpoint of that step when
// the run saves any (unless it has just saved it). Returns the reason.
std::string stop_on_signal(Session& s, int sig) {
  if (s.cfg.save_every > 0 && s.state.step % s.cfg.save_every != 0) save(s);
  return fmt::format("stopped by signal {} ({}) after step {}{}", sig,
                     signal_name(sig), s.state.step - 1,
                     s.cfg.save_every > 0 ? "; checkpoint " + checkpoint_dir(s.cfg.out, s.state.step)
                                          : "; no checkpoint (--save-every 0)");
}

void write_trace(Session& s) {
  s.ex.sample_memory();
  const std::string mine = s.ex.trace().events_json();
  const int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(s.N);
  s.world.all_gather(&len, lens.data(), 2, DType::fp32, "trace sizes")->wait(s.timeout);
  const int64_t most = *std::max_element(lens.begin(), lens.end());
  std::string padded = mine;
  padded.resize(most, ' ');
  std::string all(most * s.N, ' ');
  s.world.all_gather(padded.data(), all.data(), most, DType::int8, "trace")->wait(s.timeout);
  if (!s.lead) return;
  std::vector<std::string> parts;
  for (int r = 0; r < s.N; ++r) parts.push_back(all.substr(r * most, lens[r]));
  trace::write_trace(s.cfg.trace, parts);
}

// Every rank ends the run at the same step (the decision came from collectives): the trace still
// gathers, and the caller gets the exit status and the reason.
TrainSummary end_early(Session& s, TrainSummary summary, int code, const std::string& reason) {
  settle_save(s, true);
  summary.exit_code = code;
  summary.stop_reason = reason;
  if (!s.cfg.trace.empty()) write_trace(s);
  if (s.lead) refresh_report(s.cfg);  // the page shows the steps up to the stop
  return summary;
}

// The state the run starts from: --resume auto's snapshot, a checkpoint, --init-from's weights or
// fresh parameters; then what this run's checkpoints record of itself.
void load_start_state(Session& s, const ckpt::SnapshotChoice& snapshot) {
  const TrainConfig& cfg = s.cfg;
  if (snapshot.step >= 0) resume_from_snapshot(s, snapshot);
  else if (!cfg.resume.empty()) resume(s);
  else if (!cfg.init_from.empty()) init_from(s);
  else s.ex.init_params(cfg.seed);
  s.state.seed = cfg.seed;  // after resume(): what this run's checkpoints record is this run
  s.state.run = run_identity(cfg, s.N);
  if (s.snapshots) {
    // Snapshots of another timeline (a new run, or one resumed from disk) must never be taken
    // for this run's; then both slots of every held segment are mapped, as the plan counts them.
    if (snapshot.step < 0) s.snapshots->remove_held();
    if (cfg.snapshot_every > 0) s.snapshots->prepare(s.plan.static_memory.params + s.plan.static_memory.optimizer);
  }
}

// A step's time. wall_ms: from the end of the previous step (for a run's or a resume's first
// step, from its own start) to its end, so that whatever happens between steps — a checkpoint, a
// snapshot, an evaluation, a stalled process — is in some step's time, and the steps' times add
// up to the run's (torchtitan's end-to-end step time and its tokens/s are this wall time too).
// compute_ms: the step itself, which the gap between them is not.
struct StepTime {
  double wall_ms, compute_ms;
};

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// What a step's throughput is measured against.
struct StepScale {
  double peak_gflops;  // per rank
  double flops;        // of one step over every rank
  int64_t tokens;      // of one step over every rank
};

void print_run_header(const Session& s, double peak) {
  const TrainConfig& cfg = s.cfg;
  const auto& mc = s.desc.config;
  fmt::print("model {} ({}): {:.2f}M parameters (L={} C={} NH={} NKV={} F={} V={}), {} rank(s) on {} x {} thread(s), "
             "strategy {}, B={} per rank T={} accum={}, recompute {}, GEMM peak {:.0f} GFLOP/s per rank, "
             "kernels {}, collectives {}\n",
             cfg.model, model::to_string(mc.family), s.desc.num_params_exported() / 1e6, mc.n_layer, mc.n_embd,
             mc.n_head, mc.n_kv_head, mc.ffn_dim, mc.vocab_size, s.N, describe(cfg.machines), cfg.threads,
             plan::strategy_text(s.plan.config), cfg.batch, cfg.seq, cfg.grad_accum, cfg.recompute_text(), peak,
             s.backend->name(), s.comms.describe());
  if (const OffloadStore* d = s.ex.offload_store())
    fmt::print("offload: {} {}, read ahead {} using task(s)\n",
               cfg.offload != "none" ? cfg.offload : "the --memory-budget placement's units (explain lists them)", d->where(),
               cfg.offload_prefetch);
  std::fflush(stdout);
}

// A step's row of metrics.jsonl and its console line (collective: memory and exposed
// communication are the maxima over ranks). Returns the step's loss.
double record_step(Session& s, int64_t step, const run::StepInputs& in, const run::StepResult& r, const StepTime& time,
                   const StepScale& scale, const NonFiniteGuard& nonfinite) {
  // --async-save's writer is paced on compute: a stalled step must not slow the next write down.
  s.last_step_ms = time.compute_ms;
  const double step_ms = time.wall_ms;
  const MemoryTracker& tracker = s.memory.tracker();
  const MemSnapshot mem = max_over_ranks(s, tracker.peak());
  const MemSnapshot mem_max = max_over_ranks(s, tracker.peak_each());
  // What stays allocated between steps: the (sharded) state.
  const MemSnapshot held = max_over_ranks(s, tracker.live());
  const double exposed = max_over_ranks(s, r.comm_exposed_ms);
  const double loss = r.loss_sum * in.grad_scale;
  const double tokens_per_s = static_cast<double>(scale.tokens) / (step_ms * 1e-3);
  const double mfu = scale.flops / (step_ms * 1e-3) / (scale.peak_gflops * 1e9 * s.N);
  if (s.lead) {
    json row{{"step", step},
             {"loss", loss},
             {"lr", in.opt.lr},
             {"grad_norm", r.grad_norm},
             {"step_ms", step_ms},
             {"compute_ms", time.compute_ms},
             {"tokens_per_s", tokens_per_s},
             {"mfu", mfu},
             {"comm_exposed_ms", exposed},
             {"mem", mem_json(mem)},
             {"mem_max", mem_json(mem_max)},
             {"mem_between_steps", mem_json(held)},
             {"skipped", r.update_skipped},
             {"skipped_steps", nonfinite.skipped_total()}};
    if (r.moe.routed > 0) {  // the language loss stays "loss"; the routers' figures beside it
      row["aux_loss"] = r.moe.aux_loss;
      row["z_loss"] = r.moe.z_loss;
      row["expert_load_min"] = r.moe.min_load;
      row["expert_load_max"] = r.moe.max_load;
      if (r.moe.routings > 0) row["expert_load_imbalance"] = r.moe.imbalance_sum / static_cast<double>(r.moe.routings);
      row["dropped_frac"] = static_cast<double>(r.moe.dropped) / static_cast<double>(r.moe.routed);
    }
#ifdef SHARDLM_CUDA
    if (s.cfg.device == "cuda") row["mem_reserved"] = kernels::cuda_reserved_bytes(*s.backend);  // the caching allocator's
#endif
    s.metrics << row.dump() << "\n" << std::flush;
  }
  if (s.talk) {
    const int64_t steps = s.cfg.steps;
    fmt::print("step {:>6}/{} {} loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.0f} ms | {:.0f} tok/s | mfu {:.1f}% | "
               "mem {:.1f} MiB{}\n",
               step + 1, steps, progress_bar(step + 1, steps), loss, in.opt.lr, r.grad_norm, step_ms, tokens_per_s,
               100 * mfu, mem.total / 1048576.0,
               (s.N > 1 ? fmt::format(" | comm exposed {:.0f} ms", exposed) : "") +
                   (r.moe.routed > 0 ? fmt::format(" | aux {:.4f} z {:.4f}", r.moe.aux_loss, r.moe.z_loss) : ""));
    std::fflush(stdout);
  }
  return loss;
}

// This rank's positions (model::context_chunk_starts) of each of a batch's sequences (B, T).
void keep_positions(const plan::Plan& plan, int rank, const int32_t* all, int32_t* mine) {
  const auto& c = plan.config;
  const int64_t rows = model::context_chunk_rows(c.seq, c.cp, c.cp_impl);
  const std::vector<int64_t> starts = model::context_chunk_starts(c.seq, c.cp, plan.cp_index(rank), c.cp_impl);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t start : starts) mine = std::copy_n(all + b * c.seq + start, rows, mine);
}

// Step `step`'s inputs: its batches (a pure function of seed and step), learning rate and
// AdamW's update count.
run::StepInputs step_inputs(const Session& s, int64_t step, float grad_scale) {
  const TrainConfig& cfg = s.cfg;
  run::StepInputs in;
  if (s.train_latents) {
    in.samples = [&s, step](int64_t micro, char* batch, int64_t bytes) {
      const int64_t first = data::first_sequence(micro, s.plan.dp_index(s.rank), s.plan.dp_size(), s.cfg.batch);
      fill_flow_samples(s.desc.config, *s.train_latents, s.cfg.seed, step, first, s.cfg.batch, batch, bytes);
    };
  }
  in.batch = [&s, step](int64_t micro, int32_t* inputs, int32_t* targets) {
    const TrainConfig& c = s.cfg;
    // Ranks that share a data-parallel coordinate read the same sequences; a rank of a cp group
    // keeps its positions of each.
    const int64_t first = data::first_sequence(micro, s.plan.dp_index(s.rank), s.plan.dp_size(), c.batch);
    if (s.plan.sequence_split() == 1)
      return data::sample_batch(*s.train_data, c.seed, step, first, c.batch, c.seq, inputs, targets);
    std::vector<int32_t> all_inputs(c.batch * c.seq), all_targets(c.batch * c.seq);
    data::sample_batch(*s.train_data, c.seed, step, first, c.batch, c.seq, all_inputs.data(), all_targets.data());
    keep_positions(s.plan, s.rank, all_inputs.data(), inputs);
    keep_positions(s.plan, s.rank, all_targets.data(), targets);
  };
  in.grad_scale = grad_scale;
  in.grad_clip = cfg.grad_clip;
  in.opt = {cfg.lr_schedule().at(step), cfg.beta1, cfg.beta2, cfg.eps,
            cfg.weight_decay};
  in.adam_t = s.state.adam_step + 1;  // a skipped update does not count
  in.quant_seed = cfg.seed;
  return in;
}

// The end of a run that went to its last step: its last checkpoint committed, the final
// evaluation and sample, the trace; its snapshots are no longer needed.
TrainSummary finish(Session& s, TrainSummary summary) {
  const TrainConfig& cfg = s.cfg;
  settle_save(s, true);
  summary.final_val_loss = run_eval(s);
  if (s.train_latents) {  // a diffusion model: no unigram baseline; pictures, not text
    if (s.talk) fmt::print("final val_loss {:.4f} (mean squared error of the predicted velocity)\n", summary.final_val_loss);
    if (cfg.samples_per_class > 0) {
      const FlowSampling fs{cfg.sample_steps, static_cast<float>(cfg.sample_cfg), cfg.seed};
      const std::string png = write_flow_samples(s.ex, s.desc, s.plan.config, cfg.out, cfg.samples_per_class, fs, s.lead);
      if (s.talk)
        fmt::print("samples: {} ({} a class, {} Euler steps, guidance {}; latents in {}/samples.bin)\n", png,
                   cfg.samples_per_class, cfg.sample_steps, cfg.sample_cfg, cfg.out);
    }
  } else if (s.lead) {
    summary.val_unigram_entropy = unigram_entropy(*s.val_data);
    if (s.talk)
      fmt::print("final val_loss {:.4f} nats/token vs unigram entropy of the validation tokens {:.4f} nats/token\n",
                 summary.final_val_loss, summary.val_unigram_entropy);
  }
  if (cfg.sample_tokens > 0 && !s.train_latents && s.plan.schedule.stages > 1) {
    // The head's logits live on the last stage; generation does not pass them back along the pipe yet.
    if (s.talk) fmt::print("sample: not drawn under --pp (generation runs on one stage's ranks only so far)\n");
  } else if (cfg.sample_tokens > 0 && !s.train_latents) {
    SampleConfig sc;
    sc.tokens = cfg.sample_tokens;
    sc.seed = cfg.seed;
    sc.vocab_limit = s.meta.vocab_size;
    const auto ids = generate(s.ex, s.desc, s.plan.config, {}, document_start_token(s.meta), sc);
    if (s.lead) summary.sample = ids;
  }
  if (!cfg.trace.empty()) write_trace(s);
  if (s.talk) fmt::print("accounted peak memory over the run: {} bytes\n", s.memory.tracker().run_peak());
  if (const int64_t over = s.backend->scratch_overflows(); over > 0 && s.talk)
    fmt::print("warning: {} kernel calls took scratch beyond the plan's region for them (allocated apart, so the "
               "accounted peak may pass the plan's)\n", over);
  if (s.lead) refresh_report(cfg);  // after the trace, which the page breaks down
  if (s.talk && !cfg.no_report) fmt::print("report: {}/report.html\n", cfg.out);
  if (s.snapshots) s.snapshots->remove_held();
  return summary;
}

// Whether the run's model is a DiT (a model the configuration does not describe is refused later,
// where the run resolves it against its data).
bool dit_model(const TrainConfig& cfg) {
  try {
    return is_flow(cfg.model_config(1));
  } catch (const std::exception&) {
    return false;
  }
}

// A diffusion model's checkpoints have no config.json form yet: a run that would write or read one
// is refused before it starts.
void refuse_flow_checkpoints(const TrainConfig& cfg) {
  const std::pair<bool, const char*> asked[] = {{cfg.save_every > 0, "--save-every"}, {!cfg.resume.empty(), "--resume"},
                                                {!cfg.init_from.empty(), "--init-from"},
                                                {cfg.snapshot_every > 0, "--snapshot-every"}};
  for (const auto& [given, flag] : asked)
    if (given)
      throw std::invalid_argument(std::string(flag) + ": the dit family has no checkpoints yet (train it without " + flag + ")");
}

}  // namespace

TrainSummary run_training(const TrainConfig& cfg_in, comm::Communicator& world, MemoryPool& memory,
                          const TrainHooks& hooks) {
  cfg_in.validate();
  if (cfg_in.async_save && cfg_in.save_every == 0)
    throw std::invalid_argument("--async-save: needs --save-every K > 0 (there is nothing to write in the background)");
  TrainConfig cfg = cfg_in;  // --resume becomes the step directory it names
  if (dit_model(cfg)) refuse_flow_checkpoints(cfg);
  cfg.sequence_from_patches();
  const run::OffloadOptions offload = offload_options(cfg);  // before any rank can have made the directory
  StartUp up = start_up(cfg, world, memory);
  kernels::init_compute(cfg.threads);
  const DataMeta meta = read_data_meta(cfg.data);
  Session s(cfg, world, memory, resolve_model(cfg, meta), meta, hooks, offload);
  s.state.tokenizer = meta.tokenizer;
  const auto& mc = s.desc.config;
  check_splits_hold_a_window(s);
  if (s.train_data)
    check_token_ids(world, s.timeout, {&*s.train_data, &*s.val_data},
                    static_cast<int32_t>(std::min<int64_t>(mc.vocab_size, 1 << 30)));
  s.snapshots = std::move(up.snapshots);
  s.run_id = up.run_id;
  s.steps_lost = up.steps_lost;
  load_start_state(s, up.snapshot);

  if (s.lead) {
    up.dir->prepare();
    s.metrics.open(up.dir->metrics_path());
  }
  if (!cfg.resume.empty() && hooks.save_after_resume) save(s);
  // MFU on CUDA is against the H100 SXM's datasheet bf16 dense peak, 989 TFLOP/s.
  const double peak = cfg.peak_gflops > 0      ? cfg.peak_gflops
                      : cfg.device == "cuda" ? 989e3
                                             : measure_gemm_gflops(memory);
  const int64_t T = cfg.seq, global_batch = s.plan.dp_size() * cfg.batch * cfg.grad_accum;
  const StepScale scale{peak, s.desc.train_flops(global_batch, T), global_batch * T};
  if (s.talk) print_run_header(s, peak);
  if (s.lead) write_run_info(cfg, s.plan, {s.N, s.state.step, peak, global_batch * T});

  TrainSummary summary;
  NonFiniteGuard nonfinite(cfg.on_nonfinite, cfg.max_skipped_steps);
  const StopSignals signals;
  const float grad_scale = 1.0f / static_cast<float>(global_batch * T);
  std::optional<Clock::time_point> previous_end;  // of the step before, in this process
  for (int64_t step = s.state.step; step < cfg.steps; ++step) {
    const auto t0 = Clock::now();
    memory.tracker().reset_peak();
    const run::StepInputs in = step_inputs(s, step, grad_scale);
    const run::StepResult r = s.ex.step(step, in);
    const auto end = Clock::now();
    const StepTime time{ms_between(previous_end.value_or(t0), end), ms_between(t0, end)};
    previous_end = end;
    if (!r.update_skipped) ++s.state.adam_step;
    const std::string stop_reason = nonfinite.after_step(step, r);
    const double loss = record_step(s, step, in, r, time, scale, nonfinite);
    // Before any checkpoint of this step: nothing from it on is saved.
    if (!stop_reason.empty()) return end_early(s, summary, kNonFiniteExitCode, stop_reason);
    if (r.update_skipped && s.talk)
      fmt::print("{}: update skipped ({} in a row, {} in all)\n", describe_nonfinite(step, r),
                 nonfinite.skipped_in_a_row(), nonfinite.skipped_total());
    summary.final_loss = loss;
    summary.steps_done = step + 1;
    s.state.step = step + 1;
    if (hooks.at_step_boundary) hooks.at_step_boundary(step);
    settle_save(s, false);
    if (cfg.save_every > 0 && s.state.step % cfg.save_every == 0) save(s);
    if (cfg.snapshot_every > 0 && s.state.step % cfg.snapshot_every == 0) take_snapshot(s);
    if (const int sig = agreed_stop_signal(s)) return end_early(s, summary, 128 + sig, stop_on_signal(s, sig));
    if (cfg.eval_every > 0 && s.state.step % cfg.eval_every == 0 && s.state.step < cfg.steps) {
      run_eval(s);
      if (s.lead) refresh_report(cfg);
    }
  }
  return finish(s, summary);
}

}  // namespace shardlm::train
