// `shardlm train | eval | generate | explain`.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <iostream>
#include <limits>
#include <memory>

#include "ckpt/sharded.h"
#include "cli/environment.h"
#include "cli/subcommands.h"
#include "comm/single_rank.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "kernels/backend.h"
#include "kernels/cpu.h"
#include "run/executor.h"
#include "train/agreement.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/memory_check.h"
#include "train/snapshots.h"
#include "train/trainer.h"

namespace shardlm::cli {

namespace {

// A checkpoint's model on one process under a forward-only plan of (B, T): what eval and
// generate run on.
struct LoadedModel {
  model::ModelDesc desc;
  plan::Plan plan;
  MemoryPool memory;  // declared first of what allocates: it goes last
  std::unique_ptr<comm::Communicator> world;
  std::unique_ptr<run::CommGroups> comms;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<run::Executor> ex;
  std::string source;     // the checkpoint's step directory, the Hugging Face directory or the llm.c file
  std::string tokenizer;  // what the model was trained with
};

// `arg` is what `train --init-from` takes: a checkpoint (run or step directory), a Hugging Face
// directory or an llm.c model file.
std::unique_ptr<LoadedModel> load_model(const std::string& arg, int threads, plan::PlanConfig::Mode mode, int64_t B,
                                        int64_t T) {
  auto m = std::make_unique<LoadedModel>();
  m->source = train::resolve_initial(arg);
  m->desc = model::describe(train::refuse_unless_state_fits(train::read_initial_config(m->source), 4, 1, train::Machines{}));
  m->tokenizer = train::read_initial_tokenizer(m->source);
  if (T > m->desc.config.max_seq)
    throw std::runtime_error(fmt::format("--seq {} exceeds the checkpoint's max_seq {}", T, m->desc.config.max_seq));
  plan::PlanConfig pc;
  pc.mode = mode;
  pc.batch = B;
  pc.seq = T;
  pc.threads = threads;
  m->plan = train::refuse_unless_plan_fits(plan::build_plan(m->desc, pc), false, train::Machines{});
  m->world = std::make_unique<comm::SingleRankCommunicator>(m->memory);
  m->comms = std::make_unique<run::CommGroups>(*m->world, m->plan);
  m->backend = kernels::make_cpu_backend(m->memory);
  m->ex = std::make_unique<run::Executor>(m->desc, m->plan, *m->comms, threads, std::chrono::seconds(300), *m->backend);
  train::read_initial_weights(m->source, m->desc, m->plan.layout, m->ex->whole(plan::State::params));
  return m;
}

// --offload-prefetch auto, resolved on `hardware` for this world (every rank chooses alike); rank 0
// says what it chose.
train::TrainConfig with_read_ahead(const train::TrainConfig& cfg, const comm::Communicator& world, const std::string& hardware) {
  if (cfg.offload_prefetch != train::kOffloadPrefetchAuto) {
    if (!hardware.empty())  // a profile given and silently unused would look like it shaped the run
      throw std::invalid_argument("--hardware: train uses a profile only to choose --offload-prefetch auto; drop it, "
                                  "or give --offload-prefetch auto");
    return cfg;
  }
  if (hardware.empty())
    throw std::invalid_argument("--offload-prefetch auto: needs --hardware PROFILE to simulate the depths on (`shardlm "
                                "calibrate --offload-dir DIR --out FILE` measures this machine)");
  const sim::HardwareProfile hw = sim::load_hardware(hardware, hardware_dir());
  std::string line;
  const train::TrainConfig out =
      with_offload_prefetch(cfg, world.size(), train::read_data_meta(cfg.data).vocab_size, hw, 1, &line);
  if (world.rank() == 0 && !cfg.quiet && !line.empty()) fmt::print("{}\n", line);
  return out;
}

// The final sample as text, or as ids where the data's tokenizer cannot be loaded (llm.c's LLaMA 3
// files where no LLaMA 3 tokenizer.json is at hand): the run itself succeeded.
void print_sample(const std::vector<int32_t>& ids, const std::string& tokenizer, const std::string& data_dir) {
  std::unique_ptr<data::Tokenizer> tok;
  std::string why;
  try {
    tok = data::make_tokenizer(tokenizer, data_dir);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (tok)
    fmt::print("--- sample ---\n{}\n--------------\n", tok->decode(ids));
  else
    fmt::print("--- sample, token ids ({}) ---\n{}\n--------------\n", why, fmt::join(ids, " "));
}

}  // namespace

// Training may span ranks: errors name the rank, and a failing rank ends the whole job
// (on_world). A failure every rank knows of (AgreedFailure) is one line from rank 0, and every
// rank finalizes instead of aborting.
int run_train(const train::TrainConfig& given, const std::string& data_dir, const std::string& hardware) {
  const train::TrainHooks hooks = test_faults();
  return on_world([&](comm::Communicator& world, MemoryPool& memory) {
    try {
      const train::TrainConfig tc = with_read_ahead(given, world, hardware);
      auto summary = train::run_training(tc, world, memory, hooks);
      if (summary.exit_code != 0) {  // every rank stopped at the same step for the same reason
        if (world.rank() == 0) std::cerr << "shardlm: error: " << summary.stop_reason << "\n";
        return summary.exit_code;
      }
      if (!summary.sample.empty()) print_sample(summary.sample, train::read_data_meta(tc.data).tokenizer, data_dir);
      return 0;
    } catch (const train::AgreedFailure& e) {
      if (e.report()) std::cerr << "shardlm: error: " << e.what() << "\n";
      return 1;
    }
  });
}

void run_eval(const std::string& ckpt, const std::string& tokens, int64_t batch, int64_t seq, int threads) {
  // A forward's token buffers are indexed with 32 bits (train's --batch x --seq has the same
  // bound); a larger product wrapped around and crashed the plan.
  if (batch > std::numeric_limits<int32_t>::max() / seq)
    throw std::invalid_argument(fmt::format("eval: --batch {} x --seq {}: tokens per forward exceed 2^31", batch, seq));
  kernels::init_compute(threads);
  auto m = load_model(ckpt, threads, plan::PlanConfig::Mode::loss, batch, seq);
  const data::TokenCorpus shard(data::file_or_split(tokens, "val"));
  shard.validate_tokens(static_cast<int32_t>(std::min<int64_t>(m->desc.config.vocab_size, 1 << 30)));
  const double loss = train::evaluate(*m->ex, m->desc, m->plan.config, shard, batch, seq, 0, 0);
  // Finite weights can still overflow (a run that diverged): a NaN is no measurement.
  if (!std::isfinite(loss))
    throw std::runtime_error(fmt::format("eval: {}: the mean loss over {} is not finite ({})", ckpt, shard.path(), loss));
  fmt::print("{:.6f}\n", loss);
}

void run_generate(const std::string& ckpt, const std::string& prompt, train::SampleConfig sc, bool ignore_eos,
                  int threads, const std::string& data_dir) {
  kernels::init_compute(threads);
  auto m = load_model(ckpt, threads, plan::PlanConfig::Mode::logits, 1, 1);
  auto tok = data::make_model_tokenizer(m->tokenizer, m->source, data_dir);
  sc.vocab_limit = tok->vocab_size();
  if (!ignore_eos) sc.stop_tokens = tok->end_tokens();
  // Each token is written as it is drawn: a long generation shows its text as it goes. A
  // token's bytes may be part of a UTF-8 character; the bytes as a whole are the decoded text.
  // Nobody reading (a closed pipe whose SIGPIPE is ignored) ends the generation.
  const auto show = [](const std::string& text) {
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0)
      throw std::runtime_error(fmt::format("generate: cannot write to standard output: {}", std::strerror(errno)));
  };
  show(prompt);
  train::generate(*m->ex, m->desc, m->plan.config, data::encode_prompt(*tok, prompt), tok->eot() >= 0 ? tok->eot() : '\n', sc,
                  [&](int32_t id) { show(tok->decode_token(id)); });
  show("\n");
}

// The plan of rank `rank`; with pipeline stages, the schedule's grid first.
void run_explain(train::TrainConfig cfg, int ranks, int rank) {
  cfg.data = "-";  // explain reads no data
  cfg.validate();
  if (rank >= ranks)
    throw std::invalid_argument("rank (--rank): " + std::to_string(rank) + " is not one of the " + std::to_string(ranks) +
                                " ranks (--ranks)");
  const model::ModelConfig mc = cfg.model_config(50257);
  const model::ModelDesc desc = model::describe(mc);
  plan::PlanConfig pc = train::plan_config(cfg, ranks);
  pc.pipe_rank = plan::pipe_rank_of(pc, rank);
  const plan::Plan plan = train::with_snapshot_memory(plan::build_plan(desc, pc), cfg);
  if (plan.schedule.stages > 1)
    std::cout << "schedule " << plan.schedule.name << " (a row per rank of the pipe, a column per slot):\n"
              << plan::schedule_grid(plan.schedule) << "\nplan of rank " << rank << " (pipe rank " << pc.pipe_rank
              << "):\n";
  std::cout << plan.to_text(desc);
}

}  // namespace shardlm::cli
