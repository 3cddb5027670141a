// The command line: the flags (the option groups below and each subcommand's own in run(); ckpt's
// beside its commands in commands_ckpt.cc) and the dispatch to the subcommands (subcommands.h).
#include "cli/commands.h"
#include "cli/toml_config.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <iostream>
#include <limits>
#include <memory>
#include <type_traits>
#include <variant>

#include "cli/environment.h"
#include "cli/subcommands.h"
#include "comm/factory.h"
#include "comm/process.h"
#include "data/latents.h"
#include "data/tokenize.h"
#include "data/tokenizer.h"
#include "plan/options.h"
#include "run/calibrate.h"
#include "train/config.h"
#include "train/machines.h"
#include "train/trainer.h"

namespace shardlm::cli {

namespace {

// Where the tokenizer files live: $SHARDLM_DATA_DIR, else data/ beside the build directory
// that holds this executable, else the source tree's data/ (a build directory elsewhere), else
// ./data.
std::string default_data_dir() {
  if (const char* env = std::getenv("SHARDLM_DATA_DIR")) return env;
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = exe.parent_path().parent_path() / "data";
    if (std::filesystem::exists(candidate / "gpt2")) return candidate.string();
  }
#ifdef SHARDLM_DATA_DIR_DEFAULT
  if (std::filesystem::exists(std::filesystem::path(SHARDLM_DATA_DIR_DEFAULT) / "gpt2")) return SHARDLM_DATA_DIR_DEFAULT;
#endif
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

// A CLI11 check: "--FLAG: must be >= LO, got V" (or "> LO" when `strict`; "in [LO, HI]" with an
// upper bound), for finite numbers only. Text that is not a number is left to the option's own
// conversion error.
CLI::Validator bounded(double lo, bool strict, double hi) {
  const bool upper = hi < std::numeric_limits<double>::infinity();
  const std::string rule = upper ? fmt::format("in {}{}, {}]", strict ? "(" : "[", lo, hi)
                                 : fmt::format("{} {}", strict ? ">" : ">=", lo);
  return CLI::Validator(
      [lo, strict, hi, rule](std::string& text) -> std::string {
        double v = 0;
        try {
          v = std::stod(text);
        } catch (const std::exception&) {
          return "";
        }
        if (!std::isfinite(v)) return fmt::format("must be finite, got {}", text);
        return (strict ? v > lo : v >= lo) && v <= hi ? "" : fmt::format("must be {}, got {}", rule, text);
      },
      rule);
}
CLI::Validator at_least(double lo) { return bounded(lo, false, std::numeric_limits<double>::infinity()); }
CLI::Validator positive() { return bounded(0, true, std::numeric_limits<double>::infinity()); }
CLI::Validator in_range(double lo, double hi) { return bounded(lo, false, hi); }

// A CLI check: an empty value is refused ("must not be empty (WHY)"), where the option's empty
// default means "not given" and an empty value would silently read as that.
CLI::Validator not_empty(const std::string& why) {
  return CLI::Validator([why](std::string& text) { return text.empty() ? "must not be empty (" + why + ")" : std::string(); },
                        "not empty");
}

// --offload-prefetch: auto (kOffloadPrefetchAuto), or a depth in [0, plan::kMaxOffloadPrefetchDepth].
// One transform, since CLI11 runs transforms before checks: a check after it would see auto's -1.
CLI::Validator offload_prefetch_depth() {
  const CLI::Validator depth = in_range(0, plan::kMaxOffloadPrefetchDepth);
  return CLI::Validator(
      [depth](std::string& text) {
        if (text != "auto") return depth(text);
        text = std::to_string(plan::kOffloadPrefetchAuto);
        return std::string();
      },
      "0.." + std::to_string(plan::kMaxOffloadPrefetchDepth) + " or auto");
}

constexpr const char* kMoeImbalanceHelp =
    "mixture of experts: max/mean expert load, a number >= 1 or a run (its directory or metrics.jsonl: the median of its "
    "steps' expert_load_imbalance, the busiest expert's rows over the mean per routing group and block, measured at that "
    "run's group size); the busiest expert-parallel rank (the hottest expert, its E/ep - 1 neighbours at the mean) "
    "prices its expert compute and all-to-all bytes; default 1: balanced routing";

// A fraction strictly between 0 and 1.
CLI::Validator open_unit_interval() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        try {
          v = std::stod(text);
        } catch (const std::exception&) {
          return "";
        }
        return v > 0 && v < 1 ? "" : fmt::format("must be > 0 and < 1, got {}", text);
      },
      "in (0, 1)");
}

// `--sizes-kib`: whole KiB, as bytes (range and count are calibrate's to check).
std::vector<int64_t> sizes_in_bytes(const std::vector<std::string>& kib) {
  std::vector<int64_t> bytes;
  for (const std::string& k : kib) {
    const bool whole = !k.empty() && k.size() <= 9 && std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
    const int64_t v = whole ? std::stoll(k) : -1;
    if (v < 1 || v * 1024 > run::kMaxSize)
      throw std::invalid_argument(fmt::format("--sizes-kib: '{}' is not a whole number of KiB in [1, {}] (each rank holds two "
                                              "buffers of the size)", k, run::kMaxSize / 1024));
    bytes.push_back(v * 1024);
  }
  return bytes;
}

// The model: a preset or config.json, and explicit dimensions over it (train and explain).
void add_model_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--model", c.model,
                  "preset (tiny, small, gpt2-124m, llama-tiny, llama-small, llama2-7b, llama2-13b, llama2-70b, "
                  "llama3-8b, llama3-70b, llama3.1-8b, llama3.2-1b, gpt3-175b, moe-tiny, moe-small, mixtral-8x7b, "
                  "mixtral-8x22b) or a Hugging Face config.json")->group("Model")
      ->capture_default_str();
  cmd->add_option("--n-layer", c.n_layer, "layers (overrides the preset)")->group("Model")->check(at_least(1));
  cmd->add_option("--n-head", c.n_head, "attention heads (overrides the preset)")->group("Model")->check(at_least(1));
  cmd->add_option("--n-kv-head", c.n_kv_head, "key/value heads, dividing n-head (llama)")->group("Model")->check(at_least(1));
  cmd->add_option("--n-embd", c.n_embd, "channels (overrides the preset)")->group("Model")->check(at_least(1));
  cmd->add_option("--ffn-dim", c.ffn_dim, "MLP width (gpt2: 4 n-embd)")->group("Model")->check(at_least(1));
  cmd->add_option("--max-seq", c.max_seq, "positions (overrides the preset)")->group("Model")->check(at_least(1));
  cmd->add_option("--vocab", c.vocab, "vocabulary size (default: the config's, else the data's tokenizer)")->group("Model")->check(at_least(1));
  cmd->add_option("--rope-theta", c.rope_theta, "rotary embedding base (llama)")->group("Model")->check(positive());
  cmd->add_option("--norm-eps", c.norm_eps, "RMSNorm epsilon (llama)")->group("Model")->check(positive());
  cmd->add_flag("--tie-embeddings", c.tie_embeddings, "llama: the head reuses the token embedding")->group("Model");
  cmd->add_option("--experts", c.experts, "moe: experts per MoE block")->group("Model")->check(at_least(1));
  cmd->add_option("--top-k", c.top_k, "moe: experts per token (1: Switch)")->group("Model")->check(at_least(1));
  cmd->add_option("--moe-ffn-dim", c.moe_ffn_dim, "moe: an expert's SwiGLU width")->group("Model")->check(at_least(1));
  cmd->add_option("--moe-every", c.moe_every, "moe: a MoE block every M blocks (blocks M-1, 2M-1, ...; dense SwiGLU in the others)")->group("Model")
      ->check(at_least(1));
  cmd->add_option("--capacity-factor", c.capacity_factor,
                  "moe: an expert takes at most ceil(C tokens k / E) tokens of a micro-batch (default: dropless)")->group("Model")
      ->check(positive());
  cmd->add_flag("--no-norm-topk", c.no_norm_topk, "moe: keep the k experts' softmax weights (not renormalised to 1)")->group("Model");
  cmd->add_option("--aux-loss-coef", c.aux_loss_coef, "moe: load-balancing loss coefficient (default 0.01)")->group("Model")->check(at_least(0.0));
  cmd->add_option("--z-loss-coef", c.z_loss_coef, "moe: router z-loss coefficient (default 0.001)")->group("Model")->check(at_least(0.0));
  cmd->add_option("--cond-drop", c.cond_drop, "dit: probability a training sample's class becomes the null class (default 0.1)")
      ->group("Model")->check(CLI::Range(0.0, 0.999));
  cmd->add_option("--frames", c.frames, "dit: latent frames (a still image: 1)")->group("Model")->check(at_least(1));
  cmd->add_option("--height", c.height, "dit: latent rows")->group("Model")->check(at_least(1));
  cmd->add_option("--width", c.width, "dit: latent columns")->group("Model")->check(at_least(1));
  cmd->add_option("--channels", c.channels, "dit: latent channels")->group("Model")->check(at_least(1));
  cmd->add_option("--classes", c.classes, "dit: classes (the class table has one more row, the null class)")->group("Model")
      ->check(at_least(1));
  cmd->add_option("--patch", c.patch, "dit: patch PF,PH,PW (frames, rows, columns), each dividing the latents' size")->group("Model");
}

// How a step is laid out over ranks and memory (train and explain): every entry of the plan's
// option table (plan/options.h), in its order.
void add_plan_options(CLI::App* cmd, train::TrainConfig& c) {
  plan::PlanOptions& v = c;
  for (const plan::PlanOption& o : plan::plan_options()) {
    const std::string flag = std::string("--") + o.flag;
    CLI::Option* opt = std::visit(
        [&](auto field) -> CLI::Option* {
          auto& value = v.*field;
          if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) return cmd->add_flag(flag, value, o.help);
          else return cmd->add_option(flag, value, o.help);
        },
        o.field);
    opt->group(o.group);
    if (o.flag_check == plan::FlagCheck::not_empty) opt->check(not_empty(o.why));
    if (o.flag_check == plan::FlagCheck::depth_or_auto) opt->transform(offload_prefetch_depth());
    if (o.show_default) opt->capture_default_str();
  }
}

// Goodput under failures (simulate, plan).
void add_goodput_options(CLI::App* cmd, GoodputFlags& g) {
  cmd->add_option("--mtbf-hours", g.mtbf_hours,
                      "goodput under failures: mean time between failures of one node, hours (a run of N nodes fails N times "
                      "as often); prints the expected share of time on counted steps and the best checkpoint and snapshot intervals")->group("Fault tolerance")
      ->check(at_least(0));
  cmd->add_option("--restart-s", g.restart_s,
                      "with --mtbf-hours: seconds to relaunch the job after a failure, before reading its state back")->group("Fault tolerance")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--snapshot-survives", g.snapshot_survives,
                      "with --mtbf-hours: fraction of failures an in-memory snapshot recovers from (0: no snapshots); "
                      "default 0.92 where every rank's snapshot copy lives on another node (the same rank count on each "
                      "node, no parity group within a node): all but Llama 3's switch and cable failures, 35 of its 419, "
                      "which may take several nodes; else 0.15: its software bugs, NCCL timeouts and dependency failures, "
                      "63 of 419, after which the node and its memory remain")->group("Fault tolerance")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--snapshot-parity", g.snapshot_parity,
                  "with --mtbf-hours: the run's --snapshot-parity G (0: partner copies), which decides the default above")->group("Fault tolerance")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--storage-gbs", g.storage_gbs,
                      "with --mtbf-hours: GB/s one node writes checkpoints at (default: the profile's storage_bw)")->group("Fault tolerance")
      ->check(at_least(0));
}

// What the kernels run on (train; explain and simulate: a CUDA backend's kernels take scratch the plan holds).
void add_device_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--compute-dtype", c.compute_dtype, "GEMMs: auto (cpu fp32, cuda bf16) | fp32 | bf16 (cuda only)")->group("Device")
      ->capture_default_str();
  cmd->add_option("--device", c.device, "cpu | cuda (a -DSHARDLM_CUDA=ON build; several ranks stage collectives through host memory; no --ep/--cp)")->group("Device")
      ->capture_default_str();
}

// In-memory snapshots (train, and explain for their memory).
void add_snapshot_options(CLI::App* cmd, train::TrainConfig& c) {
  cmd->add_option("--snapshot-every", c.snapshot_every, "steps between in-memory snapshots in shared memory (0: never)")->group("Checkpoints")
      ->capture_default_str();
  cmd->add_option("--snapshot-parity", c.snapshot_parity,
                  "snapshot redundancy: 0 a partner rank holds a copy; G one XOR parity per group of G ranks")->group("Checkpoints")
      ->capture_default_str();
}

void add_train_options(CLI::App* cmd, train::TrainConfig& c) {
  add_model_options(cmd, c);
  add_plan_options(cmd, c);
  cmd->add_option("--data", c.data, "token file prefix: PREFIX_train.bin and PREFIX_val.bin, or numbered shards PREFIX_train_000001.bin ...")->group("Data");
  cmd->add_option("--out", c.out, "run directory (metrics.jsonl, ckpt/)")->group("Output")->capture_default_str();
  cmd->add_option("--resume", c.resume,
                  "checkpoint to continue from: a run directory (its ckpt/latest), a step directory, or auto (--out's newest "
                  "in-memory snapshot every rank holds, else its latest checkpoint; ./auto names a directory)")->group("Checkpoints");
  cmd->add_option("--init-from", c.init_from,
                  "start from these parameters (step 0, fresh optimizer): a checkpoint or a Hugging Face model directory")->group("Checkpoints");
  cmd->add_flag("--overwrite", c.overwrite, "replace the run --out holds (its metrics.jsonl and ckpt/)")->group("Output");
  cmd->add_option("--resume-override", c.resume_override,
                  "settings of the saved run a resume may change on purpose (repeat, or a comma list: lr,steps); "
                  "with --init-from, the checkpoint's routing (top-k, no-norm-topk, capacity-factor)")
      ->group("Checkpoints")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--steps", c.steps, "optimizer steps")->group("Schedule")->capture_default_str();
  cmd->add_option("--seed", c.seed, "seed of initialisation and batch sampling")->group("Schedule")->check(at_least(0))->capture_default_str();
  cmd->add_option("--lr", c.lr, "peak learning rate")->group("Schedule")->capture_default_str();
  cmd->add_option("--min-lr", c.min_lr, "learning rate at the end of the decay")->group("Schedule")->capture_default_str();
  cmd->add_option("--warmup", c.warmup, "linear warmup steps")->group("Schedule")->capture_default_str();
  cmd->add_option("--lr-decay", c.lr_decay, "the decay from --lr to --min-lr: cosine | linear | sqrt | none (--lr to the end)")->group("Schedule")
      ->capture_default_str();
  cmd->add_option("--decay-fraction", c.decay_fraction,
                  "the last share of the steps after warmup that decay; before them the rate holds at --lr "
                  "(warmup-stable-decay: 0.2; 1: decay from the end of warmup)")->group("Schedule")
      ->capture_default_str();
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW decay (matrices and embeddings)")->group("Schedule")->capture_default_str();
  cmd->add_option("--beta1", c.beta1, "AdamW beta1")->group("Schedule")->capture_default_str();
  cmd->add_option("--beta2", c.beta2, "AdamW beta2")->group("Schedule")->capture_default_str();
  cmd->add_option("--eps", c.eps, "AdamW epsilon")->group("Schedule")->capture_default_str();
  cmd->add_option("--grad-clip", c.grad_clip, "global gradient norm limit (0: off)")->group("Schedule")->capture_default_str();
  cmd->add_option("--on-nonfinite", c.on_nonfinite, "NaN/inf loss or gradient norm: stop | skip (the update)")->group("Fault tolerance")
      ->capture_default_str();
  cmd->add_option("--max-skipped-steps", c.max_skipped_steps, "skip: end the run after this many skipped in a row")->group("Fault tolerance")
      ->capture_default_str();
  cmd->add_option("--eval-every", c.eval_every, "steps between evaluations (0: at the end only)")->group("Schedule")->capture_default_str();
  cmd->add_option("--eval-windows", c.eval_windows, "validation windows per evaluation")->group("Schedule")->capture_default_str();
  cmd->add_option("--save-every", c.save_every, "steps between checkpoints (0: never)")->group("Checkpoints")->capture_default_str();
  cmd->add_option("--keep-last", c.keep_last, "checkpoints to keep, the newest (0: all)")->group("Checkpoints")->capture_default_str();
  add_snapshot_options(cmd, c);
  cmd->add_option("--sample-tokens", c.sample_tokens, "tokens to generate at the end")->group("Output")->capture_default_str();
  cmd->add_option("--samples-per-class", c.samples_per_class,
                  "dit: samples of each class drawn at the end into DIR/samples.png and DIR/samples.bin (0: none)")
      ->group("Output")->capture_default_str();
  cmd->add_option("--sample-steps", c.sample_steps, "dit: the sampler's Euler steps")->group("Output")->capture_default_str();
  cmd->add_option("--sample-cfg", c.sample_cfg, "dit: classifier-free guidance scale (1: the class alone)")->group("Output")
      ->capture_default_str();
  cmd->add_option("--peak-gflops", c.peak_gflops, "GEMM peak for MFU (0: measure)")->group("Output")->capture_default_str();
  cmd->add_flag("--quiet", c.quiet, "no console progress")->group("Output");
  add_device_options(cmd, c);
  cmd->add_option("--comm", c.comm_backend,
                  "collectives over GPU memory: auto (MPI staged through host memory; ranks may share a GPU) | "
                  "nccl (--device cuda, one GPU per rank) | mpi")->group("Parallelism")
      ->capture_default_str();
  cmd->add_option("--timeout", c.timeout_s, "seconds a collective may take before the job fails")->group("Fault tolerance")->capture_default_str();
  cmd->add_option("--trace", c.trace, "write a Chrome trace (Perfetto) of every rank to this file")->group("Output");
  cmd->add_flag("--no-report", c.no_report, "do not write DIR/report.html at each evaluation and at the end")->group("Output");
}

}  // namespace

int on_world(const std::function<int(comm::Communicator& world, MemoryPool& memory)>& body) {
  MemoryPool memory;  // before the world: it outlives every buffer
  std::unique_ptr<comm::Communicator> world;
  int code = 0;
  try {
    world = comm::make_communicator(memory, comm_options(), launched_by_mpi());
    code = body(*world, memory);
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

// The command as typed, each argument quoted where a shell would need it, for the report.
static std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    const bool plain = !a.empty() && a.find_first_of(" \t'\"\\$`") == std::string::npos;
    out += (i ? " " : "") + (plain ? a : "'" + a + "'");
  }
  return out;
}

namespace {

// Every subcommand's flags as CLI11 fills them, and the App of each, which is true once parsed.
struct Commands {
  std::string data_dir = default_data_dir();
  int omp_threads = 0;  // OMP_NUM_THREADS: every --threads' default where set (0: unset)
  int threads = 2;      // --threads' default: OMP_NUM_THREADS, else 2
  int or_omp(int fallback) const { return omp_threads > 0 ? omp_threads : fallback; }

  struct {
    CLI::App* cmd = nullptr;
    std::vector<std::string> in;
    std::string out, tokenizer = "gpt2";
    double val_fraction = 0.1;
    int64_t shard_tokens = 0;
    int threads = 1;
    std::string text_field = "text";
  } tokenize;
  struct {  // make-data shapes
    CLI::App *cmd = nullptr, *shapes = nullptr;
    std::string out;
    data::ShapesOptions options;
  } make_data;
  struct {
    CLI::App* cmd = nullptr;
    train::TrainConfig cfg;
    std::string config_path, hardware;
  } train;
  struct {  // eval and generate
    CLI::App *eval = nullptr, *generate = nullptr;
    std::string ckpt, data, prompt;
    int64_t seq = 256, batch = 4;
    train::SampleConfig sample;
    bool ignore_eos = false;
  } from_ckpt;
  struct {
    CLI::App* cmd = nullptr;
    train::TrainConfig cfg;
    int ranks = 1;
    int rank = 0;
  } explain;
  CLI::App* simulate_cmd = nullptr;
  SimulateArgs simulate;
  struct {
    CLI::App* cmd = nullptr;
    run::CalibrateOptions options;
    std::vector<std::string> sizes_kib;
    std::string out, compute_dtype = "auto";
  } calibrate;
  CLI::App* plan_cmd = nullptr;
  PlanArgs plan;
  CkptCommands ckpt;
  ReportArgs report;
};

CLI::Option* add_threads_option(CLI::App* cmd, int& threads) {
  return cmd->add_option("--threads", threads, "compute threads (default: OMP_NUM_THREADS where set, else 2)")->group("Parallelism")
      ->check(in_range(1, train::kMaxThreads))
      ->capture_default_str();
}

void add_tokenize_command(CLI::App& app, Commands& c) {
  auto& t = c.tokenize;
  t.cmd = app.add_subcommand("tokenize", "turn text files into llm.c token shards");
  t.threads = c.or_omp(std::max(1, train::allowed_cpus()));
  t.cmd->add_option("--in", t.in, "input files: text, each a document; *.jsonl, each line's --text-field a document")->group("Data")
      ->required()
      ->check(CLI::ExistingFile);
  t.cmd->add_option("--text-field", t.text_field, "the field of a JSON Lines record holding its text")->group("Data")->capture_default_str();
  t.cmd->add_option("--out", t.out, "output prefix")->group("Output")->required();
  t.cmd->add_option("--tokenizer", t.tokenizer,
                    "gpt2 | bytes | NAME: DATA_DIR/NAME/tokenizer.json, a Hugging Face tokenizer file (llama3 and "
                    "mistral: scripts/fetch_data.sh --llama; another model's: copy its tokenizer.json there)")->group("Data")
      ->capture_default_str();
  // Not 0: train evaluates every run on PREFIX_val.bin, so data without it could not be trained on.
  t.cmd->add_option("--val-fraction", t.val_fraction, "last fraction of tokens for validation (train evaluates on them)")->group("Output")
      ->check(open_unit_interval())
      ->capture_default_str();
  t.cmd->add_option("--threads", t.threads,
                    "pieces of text (a MiB each) encoded at once (default: OMP_NUM_THREADS where set, else the CPUs it "
                    "may run on)")->group("Parallelism")
      ->check(in_range(1, train::kMaxThreads))
      ->capture_default_str();
  t.cmd->add_option("--shard-tokens", t.shard_tokens,
                    "tokens per output file: numbered files PREFIX_train_000000.bin ... as llm.c writes them (its "
                    "FineWeb shards hold 100000000); 0: one file a split, at most 2^31 - 1 tokens in all")->group("Output")
      ->check(in_range(0, data::kShardMaxTokens))
      ->capture_default_str();
  t.cmd->add_option("--data-dir", c.data_dir, "where gpt2/encoder.json, gpt2/vocab.bpe and NAME/tokenizer.json are")->group("Data")
      ->capture_default_str();
}

void add_make_data_command(CLI::App& app, Commands& c) {
  auto& m = c.make_data;
  m.cmd = app.add_subcommand("make-data", "write a synthetic data set");
  m.cmd->require_subcommand(1);
  m.shapes = m.cmd->add_subcommand("shapes", "coloured shapes, one class per shape and colour, as latents for a dit model "
                                             "(DIR/train.bin, DIR/val.bin; docs/dit.md has the layout)");
  data::ShapesOptions& o = m.options;
  m.shapes->add_option("--out", m.out, "directory to write train.bin and val.bin into")->group("Output")->required();
  m.shapes->add_option("--frames", o.shape.frames, "frames per sample (a still image: 1)")->group("Data")->check(in_range(1, 64))->capture_default_str();
  m.shapes->add_option("--height", o.shape.height, "rows")->group("Data")->check(in_range(4, 1024))->capture_default_str();
  m.shapes->add_option("--width", o.shape.width, "columns")->group("Data")->check(in_range(4, 1024))->capture_default_str();
  m.shapes->add_option("--channels", o.shape.channels, "channels")->group("Data")->check(in_range(1, 64))->capture_default_str();
  m.shapes->add_option("--classes", o.shape.classes, "classes (shape x colour)")->group("Data")->check(in_range(1, 10))->capture_default_str();
  m.shapes->add_option("--train", o.train, "training records")->group("Data")->check(in_range(1, 1 << 24))->capture_default_str();
  m.shapes->add_option("--val", o.val, "validation records")->group("Data")->check(in_range(1, 1 << 24))->capture_default_str();
  m.shapes->add_option("--seed", o.seed, "positions and sizes are drawn from it")->group("Data")->capture_default_str();
}

void add_train_command(CLI::App& app, Commands& c) {
  auto& t = c.train;
  t.cmd = app.add_subcommand("train", "train a model");
  t.cfg.threads = c.threads;
  t.cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  t.cmd->add_option("--config", t.config_path, "TOML file of train options (keys are flag names; command-line flags win)");
  add_train_options(t.cmd, t.cfg);
  t.cmd->add_option("--data-dir", c.data_dir, "tokenizer files (for the final sample)")->group("Data")->capture_default_str();
  t.cmd->add_option("--hardware", t.hardware,
                    "hardware profile --offload-prefetch auto simulates the plan on: a JSON file (calibrate --offload-dir "
                    "DIR measures this machine's disk and compute) or a preset")->group("Memory");
}

void add_eval_and_generate_commands(CLI::App& app, Commands& c) {
  auto& f = c.from_ckpt;
  f.eval = app.add_subcommand("eval", "mean cross-entropy of a checkpoint over a token file or a prefix's validation split");
  f.eval->add_option("--ckpt", f.ckpt, "the model: a checkpoint, a Hugging Face directory or an llm.c model file")->group("Model")
      ->required();
  f.eval->add_option("--data", f.data, "token file (.bin), or a prefix: its validation files (PREFIX_val.bin, or numbered)")->group("Data")
      ->required();
  f.eval->add_option("--seq", f.seq, "window length T")->group("Schedule")->check(at_least(1))->capture_default_str();
  f.eval->add_option("--batch", f.batch, "windows per forward")->group("Schedule")->check(at_least(1))->capture_default_str();
  add_threads_option(f.eval, c.threads);

  f.generate = app.add_subcommand("generate", "continue a prompt from a checkpoint");
  f.generate->add_option("--ckpt", f.ckpt, "the model: a checkpoint, a Hugging Face directory or an llm.c model file")->group("Model")
      ->required();
  f.generate->add_option("--prompt", f.prompt, "text to continue (empty: start of a document)")->group("Output");
  f.generate->add_option("--tokens", f.sample.tokens, "tokens to generate (printed as they are drawn)")->group("Output")
      ->check(in_range(0, train::kMaxSampleTokens))
      ->capture_default_str();
  f.generate->add_option("--temperature", f.sample.temperature, "0: greedy")->group("Output")->check(at_least(0))->capture_default_str();
  f.generate->add_option("--top-k", f.sample.top_k, "sample among the k likeliest (0: all)")->group("Output")->check(at_least(0))->capture_default_str();
  f.generate->add_option("--top-p", f.sample.top_p,
                         "then among the likeliest whose probabilities sum to at least p (nucleus sampling; 1: all, "
                         "0: the likeliest)")->group("Output")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  f.generate->add_option("--seed", f.sample.seed, "sampling seed")->group("Output")->check(at_least(0))->capture_default_str();
  f.generate->add_flag("--ignore-eos", f.ignore_eos,
                       "draw all --tokens: by default the continuation ends at the model's end token (<|endoftext|>, "
                       "<|end_of_text|>, <|eot_id|>, </s>), as Hugging Face's generate does")->group("Output");
  add_threads_option(f.generate, c.threads);
  f.generate->add_option("--data-dir", c.data_dir, "tokenizer files")->group("Data")->capture_default_str();
}

void add_explain_command(CLI::App& app, Commands& c) {
  auto& e = c.explain;
  e.cmd = app.add_subcommand("explain", "print the plan of one training step (no run, no MPI)");
  e.cfg.threads = c.threads;
  e.cmd->add_option("--ranks", e.ranks, "number of ranks")->group("Parallelism")->check(in_range(1, train::kMaxRanks))->capture_default_str();
  e.cmd->add_option("--rank", e.rank, "the rank whose plan to print (ranks of one pipeline stage run the same plan)")
      ->group("Parallelism")
      ->check(in_range(0, train::kMaxRanks - 1))
      ->capture_default_str();
  add_model_options(e.cmd, e.cfg);
  add_plan_options(e.cmd, e.cfg);
  add_snapshot_options(e.cmd, e.cfg);
  add_device_options(e.cmd, e.cfg);
}

void add_simulate_command(CLI::App& app, Commands& c) {
  SimulateArgs& sa = c.simulate;
  auto* cmd = c.simulate_cmd =
      app.add_subcommand("simulate", "predict a training step's time, memory and timeline on a hardware profile (no run, no MPI)");
  sa.cfg.threads = c.threads;
  cmd->add_option("--ranks", sa.ranks, "number of ranks")->group("Parallelism")->check(in_range(1, train::kMaxRanks))->capture_default_str();
  cmd->add_option("--hardware", sa.hardware,
                  "hardware profile: a preset (h100-80gb, a100-80gb: kernel rates measured on a GPU; "
                  "h100-80gb-datasheet, a100-80gb-datasheet: datasheet figures, optimistic; cpu-local) or a JSON file")
      ->group("Simulation")
      ->capture_default_str();
  cmd->add_option("--trace", sa.trace, "write the simulated rank's Chrome trace (the format a real run writes)")->group("Output");
  cmd->add_flag("--json", sa.json, "print one JSON object (step_ms, tokens_per_s, mfu, comm_exposed_ms, mem, ...)")->group("Output");
  cmd->add_option("--moe-imbalance", sa.moe_imbalance, kMoeImbalanceHelp)->group("Simulation");
  cmd->add_option("--collective", sa.collective,
                  "instead of a step: time, algbw and busbw of one collective per message size, as nccl-tests prints "
                  "them (all-reduce, all-gather, reduce-scatter, all-to-all) over --ranks on --hardware")->group("One collective (simulate --collective)");
  cmd->add_option("--bytes", sa.bytes,
                  "with --collective: a size (8, 64K, 1G: K/M/G are 1024-based) or a range MIN:MAX doubling "
                  "(default 8:8G)")->group("One collective (simulate --collective)");
  add_goodput_options(cmd, sa.goodput);
  cmd->add_option("--algo", sa.algo, "with --collective: best (the fastest, as the simulator prices it), ring, tree or nvls")->group("One collective (simulate --collective)")
      ->capture_default_str();
  add_model_options(cmd, sa.cfg);
  add_plan_options(cmd, sa.cfg);
  add_device_options(cmd, sa.cfg);
}

void add_calibrate_command(CLI::App& app, Commands& c) {
  auto& k = c.calibrate;
  k.cmd = app.add_subcommand("calibrate", "measure this machine into a hardware profile for simulate (under mpirun -np N for collectives)");
  run::CalibrateOptions& co = k.options;
  co.threads = c.or_omp(co.threads);
  k.cmd->add_option("--out", k.out, "profile JSON file to write")->group("Output")->required();
  k.cmd->add_option("--threads", co.threads, "compute threads per rank (default: OMP_NUM_THREADS where set, else 1)")->group("Parallelism")
      ->check(in_range(1, train::kMaxThreads))
      ->capture_default_str();
  k.cmd->add_option("--iters", co.iters, "timed repetitions per collective size")->group("Simulation")
      ->check(in_range(1, run::kMaxIters))
      ->capture_default_str();
  k.cmd->add_option("--sizes-kib", k.sizes_kib,
                    "collective sizes in KiB (comma list; default 4 .. 262144 by x4): at least two, the largest >= 1024 "
                    "and >= 4 x the smallest, none above 1048576")->group("Simulation")
      ->delimiter(',');
  k.cmd->add_option("--device", co.device,
                    "cpu | cuda (a -DSHARDLM_CUDA=ON build; one rank, the GPU's kernels timed on its own memory)")->group("Device")
      ->capture_default_str();
  k.cmd->add_option("--compute-dtype", k.compute_dtype, "GEMMs: auto (cpu fp32, cuda bf16) | fp32 | bf16 (cuda only)")->group("Device")
      ->capture_default_str();
  k.cmd->add_option("--name", co.name, "the profile's name (default cpu-local; on a device, the device's name)")->group("Output");
  k.cmd->add_option("--offload-dir", co.offload_dir,
                    "also time the disk under this directory for the disk tier (--offload): read and write bandwidth, latency")->group("Memory");
  k.cmd->add_option("--gemm-models", co.gemm_models,
                    "models whose GEMM shapes and attention are timed, each NAME or NAME:BxT (batch x sequence; default "
                    "4x256), comma list; none: skip. The first one's block also shapes gemm_efficiency and pointwise_bw")->group("Simulation")
      ->delimiter(',')
      ->capture_default_str();
}

void add_plan_command(CLI::App& app, Commands& c) {
  PlanArgs& pa = c.plan;
  auto* cmd = c.plan_cmd =
      app.add_subcommand("plan", "search plan configurations by simulation and rank those that fit the memory budget");
  pa.cfg.threads = c.threads;
  add_model_options(cmd, pa.cfg);
  cmd->add_option("--ranks", pa.ranks, "number of ranks")->group("Parallelism")->check(in_range(1, train::kMaxRanks))->capture_default_str();
  cmd->add_option("--global-batch", pa.global_batch, "tokens per optimizer step over all ranks")->group("Schedule")->required()->check(positive());
  cmd->add_option("--seq", pa.cfg.seq, "sequence length T")->group("Schedule")->capture_default_str();
  cmd->add_option("--threads", pa.cfg.threads, "compute threads per rank (default: OMP_NUM_THREADS where set, else 2)")->group("Parallelism")
      ->capture_default_str();
  cmd->add_option("--hardware", pa.hardware, "hardware profile: a preset or a JSON file")->group("Simulation")->capture_default_str();
  cmd->add_option("--memory-per-rank", pa.memory,
                  "budget per rank (40000000000, 40GB, 64GiB; default: the profile's device memory)")->group("Memory");
  cmd->add_option("--disk-per-rank", pa.disk,
                  "the disk tier: where nothing fits in memory, search placements of state and saved activations on "
                  "disk (--memory-budget) whose files fit this many bytes per rank (200GB, 64GiB)")->group("Memory");
  cmd->add_flag("--largest-model", pa.largest,
                "report the most layers of --model's shape (width, heads, vocabulary kept) that fit the budget, "
                "with its fastest configuration")->group("Search");
  cmd->add_flag("--search-cp", pa.search_cp,
                "search context parallelism (every cp, ring and all-to-all) beside cp 1, not only where nothing "
                "fits without it")->group("Search");
  cmd->add_flag("--search-act-quant", pa.search_act_quant,
                "search int8 activation compression (--act-quant int8) beside fp32 activations: it changes the "
                "gradients a little, so only where asked")->group("Search");
  cmd->add_option("--act-quant-group", pa.cfg.act_quant_group, "--search-act-quant: values per scale")->group("Search")->capture_default_str();
  cmd->add_option("--act-quant-rounding", pa.cfg.act_quant_rounding, "--search-act-quant: nearest | stochastic")->group("Search")
      ->capture_default_str();
  cmd->add_option("--top", pa.top, "rows to print")->group("Search")->check(at_least(1))->capture_default_str();
  cmd->add_option("--moe-imbalance", pa.moe_imbalance, kMoeImbalanceHelp)->group("Simulation");
  add_goodput_options(cmd, pa.goodput);
  cmd->add_flag("--run", pa.run, "train the best configuration here (under mpirun -np RANKS) and print predicted vs measured")->group("Run the best (plan --run)");
  cmd->add_option("--data", pa.data, "--run: token file prefix")->group("Run the best (plan --run)");
  cmd->add_option("--out", pa.out, "--run: run directory")->group("Run the best (plan --run)")->capture_default_str();
  cmd->add_flag("--overwrite", pa.overwrite, "--run: replace the run --out holds")->group("Run the best (plan --run)");
  cmd->add_option("--run-steps", pa.run_steps, "--run: steps to train (the first 2 untimed)")->group("Run the best (plan --run)")->check(at_least(3))->capture_default_str();
}

// `tokenize`: the files, their tokens, and the data's meta beside them.
void run_tokenize(const Commands& c) {
  const auto& t = c.tokenize;
  auto tok = data::make_tokenizer(t.tokenizer, c.data_dir);
  const auto stats = data::tokenize_files(t.in, t.out, *tok,
                                          {.val_fraction = t.val_fraction,
                                           .shard_tokens = t.shard_tokens,
                                           .threads = t.threads,
                                           .text_field = t.text_field});
  train::write_data_meta(t.out, {tok->name(), tok->vocab_size(), tok->eot()});
  const auto files = [](const std::vector<std::string>& paths) {
    return paths.size() == 1 ? paths[0] : fmt::format("{} ... {} ({} files)", paths.front(), paths.back(), paths.size());
  };
  fmt::print("{}: {} train tokens -> {}, {} val tokens -> {}\n", tok->name(), stats.train_tokens, files(stats.train_files),
             stats.val_tokens, files(stats.val_files));
}

// The parsed subcommand, run; its exit code. Throws what it throws.
int dispatch(Commands& c, const std::string& typed) {
  for (train::TrainConfig* cfg : {&c.train.cfg, &c.explain.cfg, &c.simulate.cfg, &c.plan.cfg}) {
    *cfg = with_environment(*cfg);
    cfg->sequence_from_patches();
  }
  const auto& f = c.from_ckpt;
  if (*c.tokenize.cmd) {
    run_tokenize(c);
  } else if (*c.make_data.cmd) {
    data::make_shapes(c.make_data.out, c.make_data.options);
    fmt::print("shapes: {} train and {} val records of {}x{}x{}x{} in {} classes -> {}/train.bin, {}/val.bin\n",
               c.make_data.options.train, c.make_data.options.val, c.make_data.options.shape.frames,
               c.make_data.options.shape.height, c.make_data.options.shape.width, c.make_data.options.shape.channels,
               c.make_data.options.shape.classes, c.make_data.out, c.make_data.out);
  } else if (*c.train.cmd) {
    c.train.cfg.command_line = typed;
    return run_train(c.train.cfg, c.data_dir, c.train.hardware);
  } else if (*c.explain.cmd) {
    run_explain(c.explain.cfg, c.explain.ranks, c.explain.rank);
  } else if (*c.calibrate.cmd) {
    c.calibrate.options.sizes = sizes_in_bytes(c.calibrate.sizes_kib);
    return run_calibrate(c.calibrate.options, c.calibrate.compute_dtype, c.calibrate.out);
  } else if (*c.plan_cmd) {
    return run_plan(c.plan);
  } else if (*c.simulate_cmd) {
    run_simulate(c.simulate);
  } else if (*c.report.cmd) {
    return run_report(c.report);
  } else if (*c.ckpt.ckpt) {
    return run_ckpt(c.ckpt, c.data_dir);
  } else if (*f.eval) {
    run_eval(f.ckpt, f.data, f.batch, f.seq, c.threads);
  } else if (*f.generate) {
    run_generate(f.ckpt, f.prompt, f.sample, f.ignore_eos, c.threads, c.data_dir);
  }
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"shardlm: train GPT-2, LLaMA and mixture-of-experts language models, and predict their training"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all");
  Commands c;
  try {
    c.omp_threads = omp_num_threads();
  } catch (const std::exception& e) {
    std::cerr << "shardlm: error: " << e.what() << "\n";
    return 2;
  }
  c.threads = c.or_omp(2);
  add_tokenize_command(app, c);
  add_make_data_command(app, c);
  add_train_command(app, c);
  add_eval_and_generate_commands(app, c);
  add_explain_command(app, c);
  add_simulate_command(app, c);
  add_calibrate_command(app, c);
  add_plan_command(app, c);
  add_ckpt_commands(app, c.ckpt, c.data_dir);
  add_report_command(app, c.report);

  try {
    std::vector<std::string> args = split_empty_values(std::vector<std::string>(argv + 1, argv + argc));
    std::reverse(args.begin(), args.end());  // CLI11 takes them last-first
    app.parse(args);
    if (!c.train.config_path.empty()) apply_toml_config(c.train.config_path, c.train.cmd);
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
    return dispatch(c, command_line(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "shardlm: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace shardlm::cli
