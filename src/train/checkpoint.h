// Checkpoints as train/ and cli/ read them, whole or sharded (ckpt/sharded.h; training writes
// only the sharded form now, the trainer's save()), and the whole form below, which export_hf
// and tests write: a Hugging Face-style directory written atomically.
//   model.safetensors      Hugging Face names and layouts of the model's family (GPT-2: Conv1D
//                          (in, out); LLaMA: Linear (out, in)), fp32, vocabulary matrices with V rows
//   optimizer.safetensors  AdamW moments: exp_avg.<name>, exp_avg_sq.<name>
//   config.json            Hugging Face GPT2Config / LlamaConfig keys
//   state.json             step, data position, RNG, schedule, tokenizer
// The tensors travel as whole padded flat buffers in a FlatLayout (run/'s gather_full output).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/hf_export.h"
#include "ckpt/sharded.h"
#include "model/model.h"
#include "plan/plan.h"
#include "train/config.h"

namespace shardlm::train {

struct RunState {
  int64_t step = 0;  // steps completed; the next step to run
  uint64_t seed = 0;
  std::string tokenizer = "gpt2";
  // The settings that define the run (resume_check.h's run_identity), checked on resume. Read
  // from state.json's "run"; older files give what their "schedule" and "rng" hold.
  nlohmann::json run;
  int64_t adam_step = 0;  // updates AdamW applied: fewer than `step` when non-finite steps were skipped
};

// exp_avg / exp_avg_sq may be null (no optimizer.safetensors).
void save_checkpoint(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     const float* params, const float* exp_avg, const float* exp_avg_sq, const RunState& state,
                     const TrainConfig& cfg);

// Reads config.json (throws std::runtime_error naming the file and field when absent or bad).
model::ModelConfig read_checkpoint_config(const std::string& dir);
RunState read_checkpoint_state(const std::string& dir);
// What eval and generate need of a checkpoint's state (its tokenizer): read_checkpoint_state, or
// for an exported Hugging Face directory (no run state) config.json's shardlm_tokenizer.
RunState read_model_state(const std::string& dir);
// Loads parameters and, when exp_avg is not null, AdamW moments into flat buffers laid out by
// `layout` (padding untouched). Every tensor must exist with its exact shape and hold only finite
// values; errors name the file and tensor.
void load_checkpoint(const std::string& dir, const model::ModelDesc& desc, const model::FlatLayout& layout,
                     float* params, float* exp_avg, float* exp_avg_sq);

// Which rank holds and writes which part of each kind of each unit's state under `plan` on
// `world` ranks: the plan's placement; replicas (ddp, zero1's parameters, hybrid's replicate
// groups) write once, from the lowest rank holding a part. The plan holds every kind.
ckpt::ShardedLayout sharded_layout(const plan::Plan& plan, int world);

// `shardlm ckpt export --format hf`: a checkpoint (sharded or whole) as a Hugging Face directory
// (ckpt/hf_export.h), written atomically. An empty opt.tokenizer is the checkpoint's own.
ckpt::HfExportSummary export_hf(const std::string& ckpt_dir, const std::string& out_dir, ckpt::HfExportOptions opt);

// `shardlm ckpt import --format hf`: a Hugging Face directory (ckpt/hf_import.h) as a sharded
// step directory `out_dir` (index.json, one rank file, config.json; written atomically) at step
// 0 with zero AdamW moments and no run recorded: what `train --init-from` starts from (as it
// starts from the Hugging Face directory itself). An existing non-empty out_dir is replaced
// (once the new one is complete) only with `overwrite`; otherwise the import fails and leaves it.
// The directory's tokenizer.json, and vocab.json with merges.txt, are copied along, each first read
// as the tokenizer loader reads it; a broken one, or one resolving outside in_dir (a link out of
// it), is refused with one line naming the file before anything is written.
// Returns the model's config.
model::ModelConfig import_hf(const std::string& in_dir, const std::string& out_dir, bool overwrite = false);
// `shardlm ckpt import --format llmc`: an llm.c GPT-2 model file (ckpt/llmc_model.h) likewise.
model::ModelConfig import_llmc(const std::string& in_file, const std::string& out_dir, bool overwrite = false);
// `shardlm ckpt export --format llmc`: a GPT-2 checkpoint's parameters as an llm.c model file
// (fp32, or bf16), written atomically.
void export_llmc(const std::string& ckpt_dir, const std::string& out_file, bool bf16);

// `train --init-from PATH`: a sharded checkpoint (a run, ckpt or step directory; the step
// directory is returned), a directory import_hf reads (a Hugging Face model, an export, an
// older whole checkpoint) or an llm.c model file (both returned as they are).
std::string resolve_initial(const std::string& path);
// Its model (config.json, checked against its tensors where sharded).
model::ModelConfig read_initial_config(const std::string& dir);
// The tokenizer it was trained with: a checkpoint's run state says; a Hugging Face directory's is
// ckpt/hf_import.h's guess (shardlm_tokenizer, GPT-2's files, the vocabulary); an llm.c file's
// its vocabulary's (gpt2 for llm.c's own models).
std::string read_initial_tokenizer(const std::string& source);
// Its parameters whole into `params` (laid out by `layout`, padding zero): what eval and generate
// run, and what --init-from reads on every rank where the source is not sharded.
void read_initial_weights(const std::string& source, const model::ModelDesc& desc, const model::FlatLayout& layout,
                          float* params);

}  // namespace shardlm::train
