// `shardlm ckpt export | import | info | snapshots`: checkpoints as files, on one process.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>
#include <vector>

#include "ckpt/hf_export.h"
#include "ckpt/sharded.h"
#include "ckpt/snapshot.h"
#include "cli/subcommands.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"

namespace shardlm::cli {

void add_ckpt_commands(CLI::App& app, CkptCommands& c, std::string& data_dir) {
  c.ckpt = app.add_subcommand("ckpt", "export a checkpoint, import a Hugging Face or llm.c model, or say what a checkpoint holds");
  c.ckpt->require_subcommand(1);
  c.export_cmd = c.ckpt->add_subcommand("export", "write a checkpoint as a Hugging Face directory or an llm.c model file");
  c.export_cmd->add_option("--ckpt", c.dir, "checkpoint: a step directory, or a run directory (its latest)")->group("Checkpoints")->required();
  c.export_cmd->add_option("--format", c.format, "hf | llmc (llm.c's GPT-2 model file)")->group("Checkpoints")
      ->check(CLI::IsMember({"hf", "llmc"}))
      ->capture_default_str();
  c.export_cmd->add_option("--out", c.out, "output directory (hf: model.safetensors, config.json) or file (llmc)")->group("Output")->required();
  c.export_cmd->add_option("--dtype", c.dtype, "fp32 | bf16")->group("Output")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c.export_cmd->add_option("--max-shard-size", c.max_shard_size, "larger: model-0000i-of-0000n.safetensors + index (5GB, 500MB, bytes)")->group("Output")
      ->capture_default_str();
  c.export_cmd->add_option("--data-dir", data_dir, "where gpt2/encoder.json and gpt2/vocab.bpe are")->group("Data")->capture_default_str();
  c.export_cmd->add_flag("--overwrite", c.overwrite, "replace an existing non-empty --out (once the new one is complete)")->group("Output");
  c.import_cmd = c.ckpt->add_subcommand("import", "turn a Hugging Face model or an llm.c model file into a checkpoint");
  c.import_cmd->add_option("--format", c.format, "hf | llmc (llm.c's GPT-2 model file: gpt2_124M.bin, model_NNNNNNNN.bin)")->group("Checkpoints")
      ->check(CLI::IsMember({"hf", "llmc"}))
      ->capture_default_str();
  c.import_cmd->add_option("--in", c.dir, "Hugging Face directory (config.json, model.safetensors or its index), or llm.c file")->group("Checkpoints")
      ->required();
  c.import_cmd->add_option("--out", c.out, "checkpoint directory to write (index.json, a rank file, config.json)")->group("Output")->required();
  c.import_cmd->add_flag("--overwrite", c.overwrite, "replace an existing non-empty --out (once the new one is complete)")->group("Output");
  c.info_cmd = c.ckpt->add_subcommand("info", "print what a checkpoint holds");
  c.info_cmd->add_option("--ckpt", c.dir, "checkpoint: a step directory, or a run directory (its latest)")->group("Checkpoints")->required();
  c.info_cmd->add_flag("--no-verify", c.no_verify, "print what index.json says without checking each file's size and checksum")->group("Output");
  c.snapshots_cmd = c.ckpt->add_subcommand("snapshots", "list (or --clear) the in-memory snapshots in this machine's shared memory");
  c.snapshots_cmd->add_option("--out", c.run, "the run directory whose snapshots (default: every run's)")->group("Output");
  c.snapshots_cmd->add_flag("--clear", c.clear, "remove them")->group("Output");
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

namespace fs = std::filesystem;

// A path as the file system finds it: absolute, `..` and symlinks resolved (as far as it exists).
fs::path real_path(const std::string& p) {
  std::error_code ec;
  fs::path abs = fs::absolute(p, ec);
  fs::path real = ec ? abs.lexically_normal() : fs::weakly_canonical(abs, ec);
  if (ec) real = abs.lexically_normal();
  // "DIR/" names DIR: without its empty last element, so that it compares equal to DIR.
  return real.has_filename() || !real.has_parent_path() ? real : real.parent_path();
}

// Whether `inner` is `outer` or lies inside it.
bool within(const fs::path& inner, const fs::path& outer) {
  const auto [outer_end, inner_at] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
  return outer_end == outer.end();
}

// A symbolic link as --out: the result would be renamed onto the link (failing once all the work
// is done, or with --overwrite replacing the link), never written where it points.
void refuse_link(const std::string& out, const char* what) {
  std::string name = out;
  while (name.size() > 1 && name.back() == '/') name.pop_back();  // "LINK/" names the link too
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(name, ec))) return;
  const fs::path target = fs::read_symlink(name, ec);
  throw std::invalid_argument(fmt::format("--out {}: is a symbolic link (to {}); name the {} itself", out,
                                          target.string(), what));
}

// Before export or import writes anything: `--out` may not overlap what the command reads (each
// {flag, path} of `reads`; replacing the one would destroy the other, --overwrite or not), and an
// existing --out must be an empty directory unless --overwrite says to replace it, and not a link.
void check_out_dir(const std::string& out, bool overwrite, const std::vector<std::pair<std::string, std::string>>& reads) {
  const fs::path real_out = real_path(out);
  for (const auto& [flag, path] : reads) {
    const fs::path real_in = real_path(path);
    if (!within(real_in, real_out) && !within(real_out, real_in)) continue;
    const std::string how = real_in == real_out      ? "is the same directory as"
                            : within(real_out, real_in) ? "lies inside"
                                                        : "holds";
    throw std::invalid_argument(fmt::format("--out {} {} {} {} ({}): the command would write over what it reads", out,
                                            how, flag, path, real_in.string()));
  }
  refuse_link(out, "directory");
  std::error_code ec;
  const auto st = fs::symlink_status(out, ec);
  if (!fs::exists(st) || overwrite) return;
  if (!fs::is_directory(out, ec)) throw std::invalid_argument("--out " + out + ": exists and is not a directory");
  if (!fs::is_empty(out, ec))
    throw std::invalid_argument("--out " + out + ": exists and is not empty; --overwrite replaces it (once the new one is complete)");
}

// The same for a file --out: an existing one is replaced only with --overwrite, never a directory.
void check_out_file(const std::string& out, bool overwrite, const std::vector<std::pair<std::string, std::string>>& reads) {
  for (const auto& [flag, path] : reads)
    if (within(real_path(out), real_path(path)))
      throw std::invalid_argument(fmt::format("--out {} lies inside {} {}: the command would write over what it reads", out,
                                              flag, path));
  refuse_link(out, "file");
  std::error_code ec;
  if (fs::is_directory(out, ec)) throw std::invalid_argument("--out " + out + ": is a directory; llmc writes a file");
  if (fs::exists(fs::symlink_status(out, ec)) && !overwrite)
    throw std::invalid_argument("--out " + out + ": exists; --overwrite replaces it (once the new one is complete)");
}

// `ckpt info`: what the checkpoint holds, each shard file checked (present, its size, its
// XXH64) as a resume checks it, unless --no-verify. Everything is checked before anything is
// printed: a broken checkpoint gives its one error line and nothing that looks like a listing.
void print_ckpt_info(const std::string& arg, bool verify) {
  const std::string dir = ckpt::resolve_checkpoint(arg);
  const model::ModelConfig mc = train::read_checkpoint_config(dir);
  const train::RunState st = train::read_checkpoint_state(dir);
  const bool sharded = ckpt::is_sharded(dir);
  const nlohmann::json index = sharded ? ckpt::read_index(dir) : nlohmann::json();
  if (sharded && verify) ckpt::verify_checkpoint(dir, index, model::describe(mc), true);
  fmt::print("checkpoint {}\n  model {} L={} C={} NH={} NKV={} F={} V={} max_seq={}\n  step {} (adamw_step {}), seed {}, tokenizer {}\n",
             dir, model::to_string(mc.family), mc.n_layer, mc.n_embd, mc.n_head, mc.n_kv_head, mc.ffn_dim,
             mc.vocab_size, mc.max_seq, st.step, st.adam_step, st.seed, st.tokenizer);
  if (!sharded) return fmt::print("  whole (model.safetensors, optimizer.safetensors, state.json)\n");
  const auto [tensors, elements] = ckpt::index_tensor_count(index);
  fmt::print("  sharded: saved by {} on {} rank(s); {} tensors, {} elements each of param, exp_avg, exp_avg_sq\n",
             index["strategy"].get<std::string>(), index["world_size"].get<int>(), tensors, elements);
  for (const auto& f : index["files"])
    fmt::print("  {}  {} bytes  xxh64 {}{}\n", f["name"].get<std::string>(), f["bytes"].get<uint64_t>(),
               f["xxh64"].get<std::string>(), verify ? "  verified" : "  (not verified: --no-verify)");
}

}  // namespace

int run_ckpt(const CkptCommands& c, const std::string& data_dir) {
  if (*c.export_cmd && c.format == "llmc") {
    const std::string step_dir = ckpt::resolve_checkpoint(c.dir);
    check_out_file(c.out, c.overwrite, {{"--ckpt", c.dir}, {"--ckpt", step_dir}});
    train::export_llmc(step_dir, c.out, c.dtype == "bf16");
    fmt::print("exported {} -> {}: llm.c model file, {} parameters\n", c.dir, c.out, c.dtype);
  } else if (*c.export_cmd) {
    const data::Gpt2Files tok = data::gpt2_files(data_dir);
    const std::string step_dir = ckpt::resolve_checkpoint(c.dir);
    const std::string tokenizer = train::read_initial_tokenizer(step_dir);
    // A checkpoint imported from a Hugging Face directory keeps that directory's tokenizer.json.
    const std::string own = step_dir + "/tokenizer.json";
    const std::string tokenizer_json = std::filesystem::exists(own) ? own : data::hf_tokenizer_file(tokenizer, data_dir);
    check_out_dir(c.out, c.overwrite,
                  {{"--ckpt", c.dir}, {"--ckpt", step_dir}, {"--data-dir", tok.encoder_json}, {"--data-dir", tok.vocab_bpe},
                   {"--data-dir", tokenizer_json}});
    ckpt::HfExportOptions opt;
    opt.dtype = c.dtype;
    opt.max_shard_bytes = ckpt::parse_size(c.max_shard_size);
    opt.tokenizer = tokenizer;
    opt.encoder_json = tok.encoder_json;
    opt.vocab_bpe = tok.vocab_bpe;
    opt.tokenizer_json = tokenizer_json;
    opt.overwrite = c.overwrite;
    // Its first and end tokens as the tokenizer here reads them (a missing file: the export's error names it).
    if (ckpt::exports_tokenizer_json(tokenizer) && std::filesystem::exists(tokenizer_json)) {
      const auto t = data::load_hf_tokenizer(tokenizer_json, tokenizer);
      const std::vector<int32_t> ends = t->end_tokens();
      if (t->bos() >= 0) opt.bos = {t->decode_token(t->bos()), t->bos()};
      if (!ends.empty()) opt.eos = {t->decode_token(ends[0]), ends[0]};
    }
    const auto s = train::export_hf(step_dir, c.out, opt);
    fmt::print("exported {} -> {}: {} safetensors file(s), {} bytes of {} tensors, config.json{}\n", c.dir, c.out, s.files,
               s.total_size, c.dtype, !s.tokenizer_files.empty() ? ", " + s.tokenizer_files : "; " + s.tokenizer_note);
  } else if (*c.import_cmd) {
    check_out_dir(c.out, c.overwrite, {{"--in", c.dir}});
    const model::ModelConfig mc = c.format == "llmc" ? train::import_llmc(c.dir, c.out, c.overwrite)
                                                     : train::import_hf(c.dir, c.out, c.overwrite);
    fmt::print("imported {} -> {}: {} model, {} parameters, step 0 (train --init-from {})\n", c.dir, c.out,
               model::to_string(mc.family), model::describe(mc).num_params_exported(), c.out);
  } else if (*c.snapshots_cmd) {
    return run_ckpt_snapshots(c);
  } else {
    print_ckpt_info(c.dir, !c.no_verify);
  }
  return 0;
}

}  // namespace shardlm::cli
