// `shardlm ckpt export | import | info | snapshots`: checkpoints as files, on one process.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt/sharded.h"
#include "ckpt/snapshot.h"
#include "cli/subcommands.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"

namespace shardlm::cli {

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

namespace {

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

}  // namespace

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

}  // namespace shardlm::cli
