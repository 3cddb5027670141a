#include "cli/commands.h"
#include "cli/toml_config.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <malloc.h>
#include <iostream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "ckpt/sharded.h"
#include "ckpt/snapshot.h"
#include "comm/factory.h"
#include "comm/mpi_backend.h"
#include "comm/single_rank.h"
#include "data/shard.h"
#include "data/tokenize.h"
#include "data/tokenizer.h"
#include "kernels/cpu.h"
#include "run/calibrate.h"
#include "run/executor.h"
#include "sim/hardware.h"
#include "sim/planner.h"
#include "sim/simulator.h"
#include "trace/trace.h"
#include "train/agreement.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/memory_check.h"
#include "train/snapshots.h"
#include "train/trainer.h"

namespace shardlm::cli {

namespace {

// Where the tokenizer files live: $SHARDLM_DATA_DIR, else data/ beside the build directory
// that holds this executable, else ./data.
std::string default_data_dir() {
  if (const char* env = std::getenv("SHARDLM_DATA_DIR")) return env;
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = exe.parent_path().parent_path() / "data";
    if (std::filesystem::exists(candidate / "gpt2")) return candidate.string();
  }
  return "data";
}

// CLI11 reads `--out=` as `--out` wanting a value and takes the next word (`--out= --seq=64`
// wrote into a directory named `--seq=64`): an empty value after '=' is passed as a value.
std::vector<std::string> split_empty_values(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (const auto& a : args) {
    const bool empty_value = a.size() > 3 && a.rfind("--", 0) == 0 && a.back() == '=' && a.find('=') == a.size() - 1;
    out.push_back(empty_value ? a.substr(0, a.size() - 1) : a);
    if (empty_value) out.emplace_back();
  }
  return out;
}

// A CLI11 check: "--FLAG: must be >= LO, got V" (or "> LO" when `strict`), for finite numbers
// only. Text that is not a number is left to the option's own conversion error.
CLI::Validator bounded_below(double lo, bool strict = false) {
  const std::string rule = fmt::format("{} {}", strict ? ">" : ">=", lo);
  return CLI::Validator(
      [lo, strict, rule](std::string& text) -> std::string {
        double v = 0;
        try {
          v = std::stod(text);
        } catch (const std::exception&) {
          return "";
        }
        if (!std::isfinite(v)) return fmt::format("must be finite, got {}", text);
        return (strict ? v > lo : v >= lo) ? "" : fmt::format("must be {}, got {}", rule, text);
      },
      rule);
}
CLI::Validator at_least(double lo) { return bounded_below(lo); }
CLI::Validator positive() { return bounded_below(0, true); }

// The model: a preset or config.json, and explicit dimensions over it (train and explain).
void add_model_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--model", c.model,
                  "preset (tiny, small, gpt2-124m, llama-tiny, llama-small, llama2-7b, llama2-13b, llama2-70b, "
                  "llama3-8b, llama3-70b, gpt3-175b) or a Hugging Face config.json")
      ->capture_default_str();
  cmd->add_option("--n-layer", c.n_layer, "layers (overrides the preset)")->check(at_least(1));
  cmd->add_option("--n-head", c.n_head, "attention heads (overrides the preset)")->check(at_least(1));
  cmd->add_option("--n-kv-head", c.n_kv_head, "key/value heads, dividing n-head (llama)")->check(at_least(1));
  cmd->add_option("--n-embd", c.n_embd, "channels (overrides the preset)")->check(at_least(1));
  cmd->add_option("--ffn-dim", c.ffn_dim, "MLP width (gpt2: 4 n-embd)")->check(at_least(1));
  cmd->add_option("--max-seq", c.max_seq, "positions (overrides the preset)")->check(at_least(1));
  cmd->add_option("--vocab", c.vocab, "vocabulary size (default: the config's, else the data's tokenizer)")->check(at_least(1));
  cmd->add_option("--rope-theta", c.rope_theta, "rotary embedding base (llama)")->check(positive());
  cmd->add_option("--norm-eps", c.norm_eps, "RMSNorm epsilon (llama)")->check(positive());
  cmd->add_flag("--tie-embeddings", c.tie_embeddings, "llama: the head reuses the token embedding");
}

// How a step is laid out over ranks and memory (train and explain).
void add_plan_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--batch", c.batch, "sequences per micro-step")->capture_default_str();
  cmd->add_option("--seq", c.seq, "sequence length T")->capture_default_str();
  cmd->add_option("--grad-accum", c.grad_accum, "micro-steps per optimizer step")->capture_default_str();
  cmd->add_option("--threads", c.threads, "compute threads")->capture_default_str();
  cmd->add_option("--strategy", c.strategy, "ddp | zero1 | zero2 | fsdp | hybrid")->capture_default_str();
  cmd->add_option("--shard-group", c.shard_group, "hybrid: consecutive ranks that shard (0: all)")->capture_default_str();
  cmd->add_option("--prefetch-forward", c.prefetch_forward, "all-gathers issued ahead in the forward")->capture_default_str();
  cmd->add_option("--prefetch-backward", c.prefetch_backward, "all-gathers issued ahead in the backward")->capture_default_str();
  cmd->add_option("--max-gathers-in-flight", c.max_gathers_in_flight, "gathered units alive at once")->capture_default_str();
  cmd->add_option("--bucket-mb", c.bucket_mb, "DDP / ZeRO-1 gradient bucket size")->capture_default_str();
  cmd->add_option("--keep-gathered", c.keep_gathered,
                  "fsdp / hybrid: units kept gathered through the step: all | none | names (h.10,final_norm)")
      ->capture_default_str();
  cmd->add_option("--gather-bucket-mb", c.gather_bucket_mb,
                  "fsdp / hybrid: consecutive units gathered by one all-gather up to this many MiB (0: off)")
      ->capture_default_str();
  cmd->add_option("--param-dtype", c.param_dtype, "gathered parameters: fp32 | bf16")->capture_default_str();
  cmd->add_option("--reduce-dtype", c.reduce_dtype, "gradient reduction: fp32 | bf16")->capture_default_str();
  cmd->add_option("--recompute", c.recompute, "activation recompute: none | selective | full")->capture_default_str();
  cmd->add_flag("--async-save", c.async_save,
                "checkpoints: copy each rank's shard into a staging buffer (memory category staging) and write it "
                "in a background thread while training goes on");
}

// In-memory snapshots (train, and explain for their memory).
void add_snapshot_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--snapshot-every", c.snapshot_every, "steps between in-memory snapshots in shared memory (0: never)")
      ->capture_default_str();
  cmd->add_option("--snapshot-parity", c.snapshot_parity,
                  "snapshot redundancy: 0 a partner rank holds a copy; G one XOR parity per group of G ranks")
      ->capture_default_str();
}

void add_train_options(CLI::App* cmd, train::TrainConfig& c) {
  add_model_options(cmd, c);
  add_plan_options(cmd, c);
  cmd->add_option("--data", c.data, "token file prefix: PREFIX_train.bin, PREFIX_val.bin");
  cmd->add_option("--out", c.out, "run directory (metrics.jsonl, ckpt/)")->capture_default_str();
  cmd->add_option("--resume", c.resume,
                  "checkpoint to continue from: a run directory (its ckpt/latest), a step directory, or auto (--out's newest "
                  "in-memory snapshot every rank holds, else its latest checkpoint; ./auto names a directory)");
  cmd->add_option("--init-from", c.init_from,
                  "start from these parameters (step 0, fresh optimizer): a checkpoint or a Hugging Face model directory");
  cmd->add_flag("--overwrite", c.overwrite, "replace the run --out holds (its metrics.jsonl and ckpt/)");
  cmd->add_option("--resume-override", c.resume_override,
                  "settings of the saved run a resume may change on purpose (repeat, or a comma list: lr,steps)")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--steps", c.steps, "optimizer steps")->capture_default_str();
  cmd->add_option("--seed", c.seed, "seed of initialisation and batch sampling")->check(at_least(0))->capture_default_str();
  cmd->add_option("--lr", c.lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", c.min_lr, "final learning rate of the cosine decay")->capture_default_str();
  cmd->add_option("--warmup", c.warmup, "linear warmup steps")->capture_default_str();
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW decay (matrices and embeddings)")->capture_default_str();
  cmd->add_option("--beta1", c.beta1, "AdamW beta1")->capture_default_str();
  cmd->add_option("--beta2", c.beta2, "AdamW beta2")->capture_default_str();
  cmd->add_option("--eps", c.eps, "AdamW epsilon")->capture_default_str();
  cmd->add_option("--grad-clip", c.grad_clip, "global gradient norm limit (0: off)")->capture_default_str();
  cmd->add_option("--on-nonfinite", c.on_nonfinite, "NaN/inf loss or gradient norm: stop | skip (the update)")
      ->capture_default_str();
  cmd->add_option("--max-skipped-steps", c.max_skipped_steps, "skip: end the run after this many skipped in a row")
      ->capture_default_str();
  cmd->add_option("--eval-every", c.eval_every, "steps between evaluations (0: at the end only)")->capture_default_str();
  cmd->add_option("--eval-windows", c.eval_windows, "validation windows per evaluation")->capture_default_str();
  cmd->add_option("--save-every", c.save_every, "steps between checkpoints (0: never)")->capture_default_str();
  cmd->add_option("--keep-last", c.keep_last, "checkpoints to keep, the newest (0: all)")->capture_default_str();
  add_snapshot_options(cmd, c);
  cmd->add_option("--sample-tokens", c.sample_tokens, "tokens to generate at the end")->capture_default_str();
  cmd->add_option("--peak-gflops", c.peak_gflops, "GEMM peak for MFU (0: measure)")->capture_default_str();
  cmd->add_flag("--quiet", c.quiet, "no console progress");
  cmd->add_option("--compute-dtype", c.compute_dtype, "GEMMs: auto (cpu fp32, cuda bf16) | fp32 | bf16 (cuda only)")
      ->capture_default_str();
  cmd->add_option("--device", c.device, "cpu | cuda (a -DSHARDLM_CUDA=ON build; one process, --strategy ddp)")
      ->capture_default_str();
  cmd->add_option("--timeout", c.timeout_s, "seconds a collective may take before the job fails")->capture_default_str();
  cmd->add_option("--trace", c.trace, "write a Chrome trace (Perfetto) of every rank to this file");
}

// A checkpoint's model on one process under a forward-only plan of (B, T): what eval and
// generate run on.
struct LoadedModel {
  model::ModelDesc desc;
  plan::Plan plan;
  std::unique_ptr<comm::Communicator> world;
  std::unique_ptr<run::CommGroups> comms;
  std::unique_ptr<run::Executor> ex;
  train::RunState state;
};

std::unique_ptr<LoadedModel> load_model(const std::string& ckpt_dir_arg, int threads, plan::PlanConfig::Mode mode,
                                        int64_t B, int64_t T) {
  auto m = std::make_unique<LoadedModel>();
  const std::string ckpt_dir = ckpt::resolve_checkpoint(ckpt_dir_arg);
  m->desc = model::describe(train::refuse_unless_state_fits(train::read_checkpoint_config(ckpt_dir), 4, 1));
  m->state = train::read_model_state(ckpt_dir);
  if (T > m->desc.config.max_seq)
    throw std::runtime_error(fmt::format("--seq {} exceeds the checkpoint's max_seq {}", T, m->desc.config.max_seq));
  plan::PlanConfig pc;
  pc.mode = mode;
  pc.batch = B;
  pc.seq = T;
  pc.threads = threads;
  m->plan = train::refuse_unless_plan_fits(plan::build_plan(m->desc, pc), false);
  m->world = std::make_unique<comm::SingleRankCommunicator>();
  m->comms = std::make_unique<run::CommGroups>(*m->world, m->plan);
  m->ex = std::make_unique<run::Executor>(m->desc, m->plan, *m->comms, threads, std::chrono::seconds(300));
  train::load_checkpoint(ckpt_dir, m->desc, m->plan.layout, m->ex->whole(run::Executor::State::params), nullptr,
                         nullptr);
  return m;
}

// `shardlm ckpt export | import | info`: checkpoints as files, on one process.
struct CkptCommands {
  CLI::App *ckpt = nullptr, *export_cmd = nullptr, *import_cmd = nullptr, *info_cmd = nullptr, *snapshots_cmd = nullptr;
  std::string dir, out, format = "hf", dtype = "fp32", max_shard_size = "5GB", run;
  bool clear = false;
};

void add_ckpt_commands(CLI::App& app, CkptCommands& c, std::string& data_dir) {
  c.ckpt = app.add_subcommand("ckpt", "export a checkpoint, import a Hugging Face model, or say what a checkpoint holds");
  c.ckpt->require_subcommand(1);
  c.export_cmd = c.ckpt->add_subcommand("export", "write a checkpoint as a Hugging Face directory");
  c.export_cmd->add_option("--ckpt", c.dir, "checkpoint: a step directory, or a run directory (its latest)")->required();
  c.export_cmd->add_option("--format", c.format, "hf")->check(CLI::IsMember({"hf"}))->capture_default_str();
  c.export_cmd->add_option("--out", c.out, "output directory (model.safetensors, config.json)")->required();
  c.export_cmd->add_option("--dtype", c.dtype, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c.export_cmd->add_option("--max-shard-size", c.max_shard_size, "larger: model-0000i-of-0000n.safetensors + index (5GB, 500MB, bytes)")
      ->capture_default_str();
  c.export_cmd->add_option("--data-dir", data_dir, "where gpt2/encoder.json and gpt2/vocab.bpe are")->capture_default_str();
  c.import_cmd = c.ckpt->add_subcommand("import", "turn a Hugging Face model directory into a checkpoint train --init-from takes");
  c.import_cmd->add_option("--format", c.format, "hf")->check(CLI::IsMember({"hf"}))->capture_default_str();
  c.import_cmd->add_option("--in", c.dir, "Hugging Face directory: config.json, model.safetensors (or its index)")->required();
  c.import_cmd->add_option("--out", c.out, "checkpoint directory to write (index.json, a rank file, config.json)")->required();
  c.info_cmd = c.ckpt->add_subcommand("info", "print what a checkpoint holds");
  c.info_cmd->add_option("--ckpt", c.dir, "checkpoint: a step directory, or a run directory (its latest)")->required();
  c.snapshots_cmd = c.ckpt->add_subcommand("snapshots", "list (or --clear) the in-memory snapshots in this machine's shared memory");
  c.snapshots_cmd->add_option("--out", c.run, "the run directory whose snapshots (default: every run's)");
  c.snapshots_cmd->add_flag("--clear", c.clear, "remove them");
}

// `ckpt snapshots`: every slot with its step and whether its checksums verify.
int run_ckpt_snapshots(const CkptCommands& c) {
  const std::string prefix = c.run.empty() ? "shardlm-" : ckpt::snapshot_prefix(c.run) + "-";
  if (c.clear) {
    fmt::print("removed {} snapshot segment(s) {}*\n", ckpt::remove_snapshot_segments(prefix), prefix);
    return 0;
  }
  const auto slots = ckpt::list_snapshot_slots(prefix, true);
  if (slots.empty()) fmt::print("no snapshots{}\n", c.run.empty() ? "" : " of " + c.run);
  for (const auto& s : slots)
    fmt::print("/dev/shm/{}  step {}  world {}  {} bytes  {}\n", s.name, s.step, s.world, s.bytes, s.status);
  return 0;
}

void print_ckpt_info(const std::string& arg) {
  const std::string dir = ckpt::resolve_checkpoint(arg);
  const model::ModelConfig mc = train::read_checkpoint_config(dir);
  const train::RunState st = train::read_checkpoint_state(dir);
  fmt::print("checkpoint {}\n  model {} L={} C={} NH={} NKV={} F={} V={} max_seq={}\n  step {} (adamw_step {}), seed {}, tokenizer {}\n",
             dir, model::to_string(mc.family), mc.n_layer, mc.n_embd, mc.n_head, mc.n_kv_head, mc.ffn_dim,
             mc.vocab_size, mc.max_seq, st.step, st.adam_step, st.seed, st.tokenizer);
  if (!ckpt::is_sharded(dir)) return fmt::print("  whole (model.safetensors, optimizer.safetensors, state.json)\n");
  const nlohmann::json index = ckpt::read_index(dir);
  const auto [tensors, elements] = ckpt::index_tensor_count(index);
  fmt::print("  sharded: saved by {} on {} rank(s); {} tensors, {} elements each of param, exp_avg, exp_avg_sq\n",
             index.value("strategy", "?"), index["world_size"].get<int>(), tensors, elements);
  for (const auto& f : index["files"])
    fmt::print("  {}  {} bytes  xxh64 {}\n", f["name"].get<std::string>(), f["bytes"].get<uint64_t>(),
               f["xxh64"].get<std::string>());
}

int run_ckpt(const CkptCommands& c, const std::string& data_dir) {
  if (*c.export_cmd) {
    const data::Gpt2Files tok = data::gpt2_files(data_dir);
    const auto s = train::export_hf(ckpt::resolve_checkpoint(c.dir), c.out,
                                    {c.dtype, ckpt::parse_size(c.max_shard_size), "", tok.encoder_json, tok.vocab_bpe});
    fmt::print("exported {} -> {}: {} safetensors file(s), {} bytes of {} tensors, config.json{}\n", c.dir, c.out, s.files,
               s.total_size, c.dtype, s.tokenizer_files ? ", vocab.json, merges.txt" : "; " + s.tokenizer_note);
  } else if (*c.import_cmd) {
    const model::ModelConfig mc = train::import_hf(c.dir, c.out);
    fmt::print("imported {} -> {}: {} model, {} parameters, step 0 (train --init-from {})\n", c.dir, c.out,
               model::to_string(mc.family), model::describe(mc).num_params_exported(), c.out);
  } else if (*c.snapshots_cmd) {
    return run_ckpt_snapshots(c);
  } else {
    print_ckpt_info(c.dir);
  }
  return 0;
}

// Training may span ranks: errors name the rank, and a failing rank ends the whole job (an MPI
// abort) so that no rank waits forever for it.
int run_train(const train::TrainConfig& tc, const std::string& data_dir) {
  std::unique_ptr<comm::Communicator> world;
  int code = 0;
  try {
    world = comm::make_communicator();
    auto summary = train::run_training(tc, *world);
    if (summary.exit_code != 0) {  // every rank stopped at the same step for the same reason
      if (world->rank() == 0) std::cerr << "shardlm: error: " << summary.stop_reason << "\n";
      code = summary.exit_code;
    } else if (!summary.sample.empty()) {
      auto tok = data::make_tokenizer(train::read_data_meta(tc.data).tokenizer, data_dir);
      fmt::print("--- sample ---\n{}\n--------------\n", tok->decode(summary.sample));
    }
  } catch (const train::AgreedFailure& e) {
    // Every rank knows: one line from rank 0, and every rank finalizes instead of aborting.
    if (e.report()) std::cerr << "shardlm: error: " << e.what() << "\n";
    code = 1;
  } catch (const std::exception& e) {
    const bool distributed = world && world->size() > 1;
    std::cerr << "shardlm: error: " << (distributed ? fmt::format("rank {}: ", world->rank()) : "") << e.what() << "\n";
    std::cerr.flush();
    if (distributed) comm::abort_job(1);
    code = 1;
  }
  world.reset();
  comm::finalize_mpi();
  return code;
}

nlohmann::json mem_json(const MemSnapshot& s) {
  nlohmann::json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

struct SimulateArgs {
  train::TrainConfig cfg;
  int ranks = 1;
  std::string hardware = "cpu-local", trace;
  bool json = false;
};

// `simulate`: the plan `train` would run at --ranks, priced on a hardware profile. Nothing of
// the model is allocated, so shapes far beyond this machine simulate in milliseconds.
void run_simulate(SimulateArgs& a) {
  a.cfg.data = "-";  // simulate reads no data
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  const plan::Plan plan = plan::build_plan(desc, sim::for_hardware(train::plan_config(a.cfg, a.ranks), hw));
  const sim::SimResult r = sim::simulate(desc, plan, hw, a.cfg.threads);
  if (!a.trace.empty()) trace::write_trace(a.trace, {sim::to_trace(desc, plan, r).events_json()});
  const bool fits = hw.device_memory == 0 || r.mem.total <= hw.device_memory;
  if (a.json) {
    nlohmann::json j{{"model", a.cfg.model},       {"strategy", plan::to_string(plan.config.strategy)},
                     {"ranks", a.ranks},           {"hardware", hw.name},
                     {"step_ms", r.step_ms},       {"tokens_per_s", r.tokens_per_s},
                     {"mfu", r.mfu},               {"comm_exposed_ms", r.comm_exposed_ms},
                     {"compute_busy_ms", r.compute_busy_ms}, {"comm_busy_ms", r.comm_busy_ms},
                     {"mem", mem_json(r.mem)},     {"mem_max", mem_json(r.mem_max)},
                     {"device_memory", hw.device_memory}, {"fits", fits}};
    std::cout << j.dump() << "\n";
    return;
  }
  const double peak = hw.peak_flops * (hw.per_thread ? a.cfg.threads : 1);
  fmt::print("simulated: model {}, strategy {}, {} rank(s) on {} ({} peak {:.4g} TFLOP/s per rank, GEMM efficiency {:.3g})\n",
             a.cfg.model, plan::to_string(plan.config.strategy), a.ranks, hw.name, hw.compute_dtype, peak / 1e12,
             hw.gemm_efficiency);
  fmt::print("step {:.3f} ms | {:.0f} tokens/s | MFU {:.1f}% | comm exposed {:.3f} ms (compute busy {:.3f} ms, comm busy {:.3f} ms)\n",
             r.step_ms, r.tokens_per_s, 100 * r.mfu, r.comm_exposed_ms, r.compute_busy_ms, r.comm_busy_ms);
  fmt::print("memory per rank at peak (bytes):\n");
  for (int c = 0; c < kNumMemCategories; ++c)
    if (r.mem.bytes[c] > 0 || r.mem_max.bytes[c] > 0)
      fmt::print("  {}: {} ({:.1f} MiB), own peak {}\n", to_string(static_cast<MemCategory>(c)), r.mem.bytes[c],
                 r.mem.bytes[c] / 1048576.0, r.mem_max.bytes[c]);
  fmt::print("  total: {} ({:.2f} GiB){}\n", r.mem.total, r.mem.total / 1073741824.0,
             hw.device_memory == 0 ? std::string()
                                   : fmt::format(", device memory {:.0f} GiB: {}", hw.device_memory / 1073741824.0,
                                                 fits ? "fits" : "does NOT fit"));
}

// `calibrate`: every rank measures (collectives span the world); rank 0 writes the profile.
int run_calibrate(const run::CalibrateOptions& co, const std::string& out) {
  std::unique_ptr<comm::Communicator> world;
  int code = 0;
  try {
    world = comm::make_communicator();
    const std::string text = run::calibrate(kernels::cpu_backend(), *world, co);
    if (world->rank() == 0) {
      std::ofstream f(out);
      f << text << "\n";
      f.close();
      if (!f) throw std::runtime_error("calibrate: cannot write " + out);
      fmt::print("calibrate: wrote {} ({} rank(s) x {} thread(s))\n", out, world->size(), co.threads);
    }
  } catch (const std::exception& e) {
    const bool distributed = world && world->size() > 1;
    std::cerr << "shardlm: error: " << (distributed ? fmt::format("rank {}: ", world->rank()) : "") << e.what() << "\n";
    std::cerr.flush();
    if (distributed) comm::abort_job(1);
    code = 1;
  }
  world.reset();
  comm::finalize_mpi();
  return code;
}

struct PlanArgs {
  train::TrainConfig cfg;
  int ranks = 1, top = 10;
  int64_t global_batch = 0;
  double memory = -1;  // bytes per rank; unset: the profile's device memory
  std::string hardware = "cpu-local";
  bool run = false, overwrite = false, talk = true;
  std::string data, out = "runs/plan";
  int64_t run_steps = 6;
};

// `plan`: the planner's ranked table of the configurations that fit (printed when `talk`).
sim::PlanSearch search_and_print(PlanArgs& a) {
  a.cfg.data = "-";
  a.cfg.validate();
  const sim::HardwareProfile hw = sim::load_hardware(a.hardware);
  const model::ModelDesc desc = model::describe(a.cfg.model_config(50257));
  sim::PlanQuery q;
  q.ranks = a.ranks, q.global_tokens = a.global_batch, q.seq = a.cfg.seq, q.threads = a.cfg.threads;
  q.memory_budget = a.memory >= 0 ? static_cast<int64_t>(a.memory) : hw.device_memory;
  // The search builds and drops thousands of plans of a few MB: keep their pages in the heap
  // instead of mapping and unmapping them each time (a third of the search's time otherwise).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const sim::PlanSearch s = sim::search_plans(desc, train::plan_config(a.cfg, a.ranks), hw, q);
  if (!a.talk) return s;
  if (s.fitting.empty())
    throw std::runtime_error(fmt::format("plan: no configuration of {} on {} rank(s) fits {} bytes per rank; the smallest of {} "
                                         "needs {} ({})",
                                         a.cfg.model, a.ranks, q.memory_budget, s.considered, s.smallest.peak_bytes,
                                         s.smallest.flags));
  fmt::print("plan: {} on {} rank(s) x {} thread(s), {} tokens per step, {}: {} configurations simulated, {} fit {} "
             "(+{} refined by keeping units gathered)\n",
             a.cfg.model, a.ranks, a.cfg.threads, a.global_batch, hw.name, s.considered, s.fitting.size() - s.refined,
             q.memory_budget ? fmt::format("{:.3f} GiB per rank", q.memory_budget / 1073741824.0) : "(no memory limit)",
             s.refined);
  fmt::print("{:>4}  {:>12}  {:>12}  {:>6}  {:>10}  {}\n", "rank", "step ms", "tokens/s", "MFU", "mem GiB", "flags");
  for (int i = 0; i < std::min<int>(a.top, static_cast<int>(s.fitting.size())); ++i) {
    const sim::Candidate& c = s.fitting[i];
    fmt::print("{:>4}  {:>12.3f}  {:>12.0f}  {:>5.1f}%  {:>10.3f}  {}\n", i + 1, c.step_ms, c.tokens_per_s, 100 * c.mfu,
               c.peak_bytes / 1073741824.0, c.flags);
  }
  return s;
}

// The best configuration as train options over the model options of `a`.
train::TrainConfig train_config_of(const PlanArgs& a, const plan::PlanConfig& c) {
  train::TrainConfig tc = a.cfg;
  tc.strategy = plan::to_string(c.strategy);
  tc.shard_group = c.shard_group;
  tc.batch = c.batch, tc.grad_accum = c.grad_accum, tc.seq = c.seq;
  tc.recompute = model::to_string(c.recompute);
  tc.prefetch_forward = c.prefetch_forward, tc.prefetch_backward = c.prefetch_backward;
  tc.max_gathers_in_flight = c.max_gathers_in_flight;
  tc.bucket_mb = c.bucket_mb;
  tc.gather_bucket_mb = c.gather_bucket_mb;
  tc.param_dtype = c.param_bytes == 2 ? "bf16" : "fp32";
  tc.reduce_dtype = c.reduce_bytes == 2 ? "bf16" : "fp32";
  tc.data = a.data, tc.out = a.out, tc.overwrite = a.overwrite;
  tc.steps = a.run_steps, tc.warmup = 0, tc.eval_every = 0, tc.eval_windows = 1, tc.sample_tokens = 0, tc.quiet = true;
  return tc;
}

// `plan --run`: every rank searches (the search is deterministic), trains the best for a few
// steps, and rank 0 prints predicted against measured (median step after 2 untimed).
int run_plan(PlanArgs& a) {
  if (!a.run) {
    search_and_print(a);
    return 0;
  }
  if (a.data.empty()) throw std::runtime_error("plan --run: --data PREFIX is required (the tokens to train on)");
  std::unique_ptr<comm::Communicator> world;
  int code = 0;
  try {
    world = comm::make_communicator();
    if (world->size() != a.ranks)
      throw std::runtime_error(fmt::format("plan --run: --ranks {} but {} process(es) were started (mpirun -np {})", a.ranks,
                                           world->size(), a.ranks));
    a.talk = world->rank() == 0;
    const sim::PlanSearch s = search_and_print(a);
    if (s.fitting.empty())
      throw std::runtime_error("plan --run: no configuration fits " + std::to_string(s.smallest.peak_bytes));
    const sim::Candidate& best = s.fitting.front();
    const train::TrainConfig tc = train_config_of(a, best.config);
    const train::TrainSummary run = train::run_training(tc, *world);
    if (run.exit_code != 0) throw std::runtime_error("plan --run: training stopped: " + run.stop_reason);
    if (world->rank() == 0) {
      std::ifstream f(std::filesystem::path(tc.out) / "metrics.jsonl");
      std::vector<double> ms;
      int64_t mem = 0;
      for (std::string line; std::getline(f, line);) {
        const auto j = nlohmann::json::parse(line);
        if (!j.contains("step_ms")) continue;
        if (j["step"].get<int64_t>() >= 2) ms.push_back(j["step_ms"].get<double>());
        mem = j["mem"]["total"].get<int64_t>();
      }
      std::sort(ms.begin(), ms.end());
      const double measured = ms.empty() ? 0 : ms[ms.size() / 2];
      fmt::print("best ({}): predicted {:.1f} ms/step, measured {:.1f} ms/step (median of {} after 2 untimed, {:+.1f}%); "
                 "memory per rank predicted {} bytes, measured {}\n",
                 best.flags, best.step_ms, measured, ms.size(), measured > 0 ? 100 * (best.step_ms - measured) / measured : 0.0,
                 best.peak_bytes, mem);
    }
  } catch (const std::exception& e) {
    const bool distributed = world && world->size() > 1;
    std::cerr << "shardlm: error: " << (distributed ? fmt::format("rank {}: ", world->rank()) : "") << e.what() << "\n";
    std::cerr.flush();
    if (distributed) comm::abort_job(1);
    code = 1;
  }
  world.reset();
  comm::finalize_mpi();
  return code;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"shardlm: train GPT-2-shaped language models"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all");
  std::string data_dir = default_data_dir();
  int threads = 2;

  // tokenize
  auto* tok_cmd = app.add_subcommand("tokenize", "turn text files into llm.c token shards");
  std::vector<std::string> tok_in;
  std::string tok_out, tok_name = "gpt2";
  double val_fraction = 0.1;
  tok_cmd->add_option("--in", tok_in, "input text files")->required()->check(CLI::ExistingFile);
  tok_cmd->add_option("--out", tok_out, "output prefix")->required();
  tok_cmd->add_option("--tokenizer", tok_name, "gpt2 | bytes")->check(CLI::IsMember({"gpt2", "bytes"}))->capture_default_str();
  tok_cmd->add_option("--val-fraction", val_fraction, "last fraction of tokens for validation")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  tok_cmd->add_option("--data-dir", data_dir, "where gpt2/encoder.json and gpt2/vocab.bpe are")->capture_default_str();

  // train
  auto* train_cmd = app.add_subcommand("train", "train a model");
  train::TrainConfig tc;
  train_cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string config_path;
  train_cmd->add_option("--config", config_path, "TOML file of train options (keys are flag names; command-line flags win)");
  add_train_options(train_cmd, tc);
  train_cmd->add_option("--data-dir", data_dir, "tokenizer files (for the final sample)")->capture_default_str();

  // eval
  auto* eval_cmd = app.add_subcommand("eval", "mean cross-entropy of a checkpoint over a token file");
  std::string ckpt, eval_data;
  int64_t eval_seq = 256, eval_batch = 4;
  eval_cmd->add_option("--ckpt", ckpt, "checkpoint directory")->required();
  eval_cmd->add_option("--data", eval_data, "token file (.bin)")->required();
  eval_cmd->add_option("--seq", eval_seq, "window length T")->check(at_least(1))->capture_default_str();
  eval_cmd->add_option("--batch", eval_batch, "windows per forward")->check(at_least(1))->capture_default_str();
  eval_cmd->add_option("--threads", threads, "compute threads")->check(at_least(1))->capture_default_str();

  // generate
  auto* gen_cmd = app.add_subcommand("generate", "continue a prompt from a checkpoint");
  std::string prompt;
  train::SampleConfig sc;
  gen_cmd->add_option("--ckpt", ckpt, "checkpoint directory")->required();
  gen_cmd->add_option("--prompt", prompt, "text to continue (empty: start of a document)");
  gen_cmd->add_option("--tokens", sc.tokens, "tokens to generate")->check(at_least(0))->capture_default_str();
  gen_cmd->add_option("--temperature", sc.temperature, "0: greedy")->check(at_least(0))->capture_default_str();
  gen_cmd->add_option("--top-k", sc.top_k, "sample among the k likeliest (0: all)")->check(at_least(0))->capture_default_str();
  gen_cmd->add_option("--seed", sc.seed, "sampling seed")->check(at_least(0))->capture_default_str();
  gen_cmd->add_option("--threads", threads, "compute threads")->check(at_least(1))->capture_default_str();
  gen_cmd->add_option("--data-dir", data_dir, "tokenizer files")->capture_default_str();

  // explain
  auto* explain_cmd = app.add_subcommand("explain", "print the plan of one training step (no run, no MPI)");
  train::TrainConfig ec;
  int explain_ranks = 1;
  explain_cmd->add_option("--ranks", explain_ranks, "number of ranks")->check(at_least(1))->capture_default_str();
  add_model_options(explain_cmd, ec);
  add_plan_options(explain_cmd, ec);
  add_snapshot_options(explain_cmd, ec);

  // simulate
  auto* sim_cmd = app.add_subcommand("simulate", "predict a training step's time, memory and timeline on a hardware profile (no run, no MPI)");
  SimulateArgs sa;
  sim_cmd->add_option("--ranks", sa.ranks, "number of ranks")->check(at_least(1))->capture_default_str();
  sim_cmd->add_option("--hardware", sa.hardware, "hardware profile: a preset (a100-80gb, h100-80gb, cpu-local) or a JSON file")
      ->capture_default_str();
  sim_cmd->add_option("--trace", sa.trace, "write the simulated rank's Chrome trace (the format a real run writes)");
  sim_cmd->add_flag("--json", sa.json, "print one JSON object (step_ms, tokens_per_s, mfu, comm_exposed_ms, mem, ...)");
  add_model_options(sim_cmd, sa.cfg);
  add_plan_options(sim_cmd, sa.cfg);

  // calibrate
  auto* cal_cmd = app.add_subcommand("calibrate", "measure this machine into a hardware profile for simulate (under mpirun -np N for collectives)");
  std::string cal_out;
  run::CalibrateOptions co;
  std::vector<int64_t> cal_sizes_kib;
  cal_cmd->add_option("--out", cal_out, "profile JSON file to write")->required();
  cal_cmd->add_option("--threads", co.threads, "compute threads per rank")->check(at_least(1))->capture_default_str();
  cal_cmd->add_option("--iters", co.iters, "timed repetitions per collective size")->check(at_least(1))->capture_default_str();
  cal_cmd->add_option("--sizes-kib", cal_sizes_kib, "collective sizes in KiB (comma list; default 4 .. 65536 by x4)")
      ->delimiter(',')
      ->check(at_least(1));
  cal_cmd->add_option("--name", co.name, "the profile's name")->capture_default_str();

  // plan
  auto* plan_cmd = app.add_subcommand("plan", "search plan configurations by simulation and rank those that fit the memory budget");
  PlanArgs pa;
  add_model_options(plan_cmd, pa.cfg);
  plan_cmd->add_option("--ranks", pa.ranks, "number of ranks")->check(at_least(1))->capture_default_str();
  plan_cmd->add_option("--global-batch", pa.global_batch, "tokens per optimizer step over all ranks")->required()->check(positive());
  plan_cmd->add_option("--seq", pa.cfg.seq, "sequence length T")->capture_default_str();
  plan_cmd->add_option("--threads", pa.cfg.threads, "compute threads per rank")->capture_default_str();
  plan_cmd->add_option("--hardware", pa.hardware, "hardware profile: a preset or a JSON file")->capture_default_str();
  plan_cmd->add_option("--memory-per-rank", pa.memory, "budget in bytes per rank (default: the profile's device memory)")
      ->check(positive());
  plan_cmd->add_option("--top", pa.top, "rows to print")->check(at_least(1))->capture_default_str();
  plan_cmd->add_flag("--run", pa.run, "train the best configuration here (under mpirun -np RANKS) and print predicted vs measured");
  plan_cmd->add_option("--data", pa.data, "--run: token file prefix");
  plan_cmd->add_option("--out", pa.out, "--run: run directory")->capture_default_str();
  plan_cmd->add_flag("--overwrite", pa.overwrite, "--run: replace the run --out holds");
  plan_cmd->add_option("--run-steps", pa.run_steps, "--run: steps to train (the first 2 untimed)")->check(at_least(3))->capture_default_str();
  CkptCommands ckpt_cmds;
  add_ckpt_commands(app, ckpt_cmds, data_dir);

  try {
    std::vector<std::string> args = split_empty_values(std::vector<std::string>(argv + 1, argv + argc));
    std::reverse(args.begin(), args.end());  // CLI11 takes them last-first
    app.parse(args);
    if (!config_path.empty()) apply_toml_config(config_path, train_cmd);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (char& ch : msg)
      if (ch == '\n') ch = ' ';
    std::cerr << "shardlm: error: " << msg << "\n";
    return 2;
  }

  try {
    if (*tok_cmd) {
      auto tok = data::make_tokenizer(tok_name, data_dir);
      auto stats = data::tokenize_files(tok_in, tok_out, *tok, val_fraction);
      train::write_data_meta(tok_out, {tok->name(), tok->vocab_size()});
      fmt::print("{}: {} train tokens -> {}_train.bin, {} val tokens -> {}_val.bin\n", tok->name(), stats.train_tokens,
                 tok_out, stats.val_tokens, tok_out);
    } else if (*train_cmd) {
      return run_train(tc, data_dir);
    } else if (*explain_cmd) {
      ec.data = "-";  // explain reads no data
      ec.validate();
      const model::ModelConfig mc = ec.model_config(50257);
      const model::ModelDesc desc = model::describe(mc);
      std::cout << train::with_snapshot_memory(plan::build_plan(desc, train::plan_config(ec, explain_ranks)), ec).to_text(desc);
    } else if (*cal_cmd) {
      for (int64_t k : cal_sizes_kib) co.sizes.push_back(k * 1024);
      return run_calibrate(co, cal_out);
    } else if (*plan_cmd) {
      return run_plan(pa);
    } else if (*sim_cmd) {
      run_simulate(sa);
    } else if (*ckpt_cmds.ckpt) {
      return run_ckpt(ckpt_cmds, data_dir);
    } else if (*eval_cmd) {
      kernels::init_compute(threads);
      auto m = load_model(ckpt, threads, plan::PlanConfig::Mode::loss, eval_batch, eval_seq);
      data::TokenShard shard(eval_data);
      shard.validate_tokens(static_cast<int32_t>(std::min<int64_t>(m->desc.config.vocab_size, 1 << 30)));
      const double loss = train::evaluate(*m->ex, m->desc, m->plan.config, shard, eval_batch, eval_seq, 0, 0);
      // Finite weights can still overflow (a run that diverged): a NaN is no measurement.
      if (!std::isfinite(loss))
        throw std::runtime_error(fmt::format("eval: {}: the mean loss over {} is not finite ({})", ckpt, eval_data, loss));
      fmt::print("{:.6f}\n", loss);
    } else if (*gen_cmd) {
      kernels::init_compute(threads);
      auto m = load_model(ckpt, threads, plan::PlanConfig::Mode::logits, 1, 1);
      auto tok = data::make_tokenizer(m->state.tokenizer, data_dir);
      sc.vocab_limit = tok->vocab_size();
      const auto ids = train::generate(*m->ex, m->desc, m->plan.config, tok->encode(prompt),
                                       tok->eot() >= 0 ? tok->eot() : '\n', sc);
      fmt::print("{}{}\n", prompt, tok->decode(ids));
    }
  } catch (const std::exception& e) {
    std::cerr << "shardlm: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace shardlm::cli
