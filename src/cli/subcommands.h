// Internal to cli/: the subcommands as commands.cc's dispatcher calls them, one file per group
// (commands_train.cc: train, eval, generate, explain; commands_sim.cc: simulate, calibrate,
// plan; commands_ckpt.cc: ckpt; commands_report.cc: report). Each returns the process exit code or throws; the dispatcher
// turns an exception into one "shardlm: error: ..." line.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "report/report.h"
#include "run/calibrate.h"
#include "sim/hardware.h"
#include "train/config.h"
#include "train/evaluate.h"

namespace shardlm::cli {

// Runs `body` on this process's world communicator (MPI under mpirun, else a world of one) and
// returns its exit code. A failure ends the whole job: one line, naming the rank when there are
// several, then an MPI abort so that no rank waits forever for the failed one. MPI is finalized
// whichever way the body ends. `memory` is the run's: the world's buffers and the body's are
// charged to it, and it outlives them.
int on_world(const std::function<int(comm::Communicator& world, MemoryPool& memory)>& body);

// commands_train.cc
// `train`; `hardware`: the profile --offload-prefetch auto is simulated on (empty: none given).
int run_train(const train::TrainConfig& tc, const std::string& data_dir, const std::string& hardware);
// `eval`: the checkpoint's mean loss over a token file, printed.
void run_eval(const std::string& ckpt, const std::string& tokens, int64_t batch, int64_t seq, int threads);
// `generate`: the prompt and its continuation, printed; the continuation ends at the tokenizer's
// end tokens unless `ignore_eos`.
void run_generate(const std::string& ckpt, const std::string& prompt, train::SampleConfig sc, bool ignore_eos,
                  int threads, const std::string& data_dir);
// `explain`: the plan of one step of `cfg` on `ranks` ranks, printed.
void run_explain(train::TrainConfig cfg, int ranks, int rank);

// commands_sim.cc
// Goodput under failures, for simulate and plan (--mtbf-hours > 0 turns it on).
struct GoodputFlags {
  // snapshot_survives < 0: from the snapshot layout (sim::snapshot_survives_node_loss).
  double mtbf_hours = 0, restart_s = 300, snapshot_survives = -1, storage_gbs = 0;
  int snapshot_parity = 0;
};

struct SimulateArgs {
  train::TrainConfig cfg;
  int ranks = 1;
  std::string hardware = "cpu-local", trace;
  bool json = false;
  std::string moe_imbalance;  // --moe-imbalance: max/mean expert load, or a run to take it from (empty: balanced)
  // --collective: price one collective per message size the way nccl-tests reports it, instead of a step.
  std::string collective, bytes, algo = "best";
  GoodputFlags goodput;
};
void run_simulate(SimulateArgs& a);
// --offload-prefetch auto: cfg with the disk tier's read-ahead depth the simulator predicts fastest
// on `hw` for the plan of `ranks` ranks (a model of `vocab` tokens), and the choice with each
// depth's prediction as one line (empty where nothing was chosen: a number given, or nothing on disk).
train::TrainConfig with_offload_prefetch(train::TrainConfig cfg, int ranks, int64_t vocab, const sim::HardwareProfile& hw,
                                         double expert_load, std::string* line);
// `calibrate`: co.device's kernels (cpu, or cuda with GEMMs in compute_dtype) into a profile at `out`.
int run_calibrate(const run::CalibrateOptions& co, const std::string& compute_dtype, const std::string& out);
struct PlanArgs {
  train::TrainConfig cfg;
  int ranks = 1, top = 10;
  int64_t global_batch = 0;
  std::string memory;  // --memory-per-rank (sizes as --memory-budget's); empty: the profile's device memory
  std::string disk;    // --disk-per-rank: the disk tier's bytes per rank (sizes as --memory-budget's); empty: none
  bool largest = false;  // --largest-model
  bool search_cp = false;  // --search-cp: context parallelism beside cp 1 (PlanQuery::context_always)
  bool search_act_quant = false;  // --search-act-quant: int8 activations beside fp32 (PlanQuery::act_quant)
  std::string hardware = "cpu-local";
  bool run = false, overwrite = false, talk = true;
  std::string data, out = "runs/plan";
  int64_t run_steps = 6;
  std::string moe_imbalance;  // --moe-imbalance: max/mean expert load, or a run to take it from (empty: balanced)
  GoodputFlags goodput;      // --mtbf-hours: rank by tokens/s × goodput
};
int run_plan(PlanArgs& a);

// commands_ckpt.cc
// `shardlm ckpt export | import | info`: checkpoints as files, on one process.
struct CkptCommands {
  CLI::App *ckpt = nullptr, *export_cmd = nullptr, *import_cmd = nullptr, *info_cmd = nullptr, *snapshots_cmd = nullptr;
  std::string dir, out, format = "hf", dtype = "fp32", max_shard_size = "5GB", run;
  bool clear = false, overwrite = false, no_verify = false;
};
void add_ckpt_commands(CLI::App& app, CkptCommands& c, std::string& data_dir);
int run_ckpt(const CkptCommands& c, const std::string& data_dir);

// commands_report.cc
struct ReportArgs {
  CLI::App* cmd = nullptr;
  report::ReportOptions opt;
};
void add_report_command(CLI::App& app, ReportArgs& a);
int run_report(const ReportArgs& a);

}  // namespace shardlm::cli
