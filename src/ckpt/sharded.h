// Sharded checkpoints: one safetensors file per rank holding only that rank's shard, plus
// index.json saying where every element of every tensor lives, so a checkpoint saved on N ranks
// loads on M under any strategy.
//
//   step_N/rank-0000r-of-0000N.safetensors  1-D F32 slices param/NAME, exp_avg/NAME,
//                                           exp_avg_sq/NAME; "__metadata__": {"format": "pt"}
//   step_N/index.json   run state (step, data position, RNG, schedule, run identity,
//                       optimizer.adamw_step), "config" (Hugging Face keys), "strategy",
//                       "world_size", "files": [{"name", "bytes", "xxh64"}] and
//                       "tensors": {NAME: {"shape", "dtype", "param"|"exp_avg"|"exp_avg_sq":
//                       [{"file": i, "begin": b, "end": e}, ...]}} (ranges of the flattened
//                       exported tensor, ascending, covering it exactly)
//   step_N/config.json  Hugging Face config
//   latest              the name of the newest complete step directory
//
// ckpt/ knows element ranges, not strategies: the caller says, per kind of state, in how many
// equal parts each unit's padded flat buffer is split, which part each rank holds and which rank
// writes it (replicated state is written once).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "model/model.h"

namespace shardlm::ckpt {

// index.json's "format": the layout this file describes (an index of another is refused).
inline constexpr const char* kIndexFormat = "shardlm-sharded-1";
// The most ranks an index may name (rank_file_name's five digits).
inline constexpr int64_t kMaxWorld = 99999;

enum class Kind { param, exp_avg, exp_avg_sq };
constexpr int kNumKinds = 3;
const char* kind_name(Kind k);

// One kind of one unit's state over the ranks: the unit's padded buffer in `parts` equal parts;
// rank r holds part part_of[r], at element `at` of its buffer of that kind, and writes it to its
// file when writes[r]. Units may be split differently (experts over other ranks than dense
// weights): the index records where every element went, so any layout loads into any other.
struct UnitLayout {
  int parts = 1;
  int64_t at = 0;
  std::vector<int> part_of;
  std::vector<bool> writes;
};

struct ShardedLayout {
  model::FlatLayout flat;
  int world = 1;
  std::array<std::vector<UnitLayout>, kNumKinds> kinds;  // [kind][unit]
};

// Everything whole on one process (eval, generate, export).
ShardedLayout whole_layout(const model::FlatLayout& flat);

// A rank's buffers per kind, as the executor holds them: each unit's part back to back in unit
// order (unit u's at UnitLayout::at). A null buffer is neither written nor read.
using RankBuffers = std::array<float*, kNumKinds>;

struct FileSummary {
  uint64_t bytes = 0, xxh64 = 0;
};

std::string rank_file_name(int rank, int world);
// A file's size and XXH64 (seed 0) as index.json records them.
FileSummary summarize_file(const std::string& path);
std::string hex64(uint64_t x);

// Writes rank `rank`'s file into `dir` (temporary name, fsync, rename); returns its size and
// checksum, taken of the bytes as they are written. `progress` as SafetensorsWriter::write takes
// it (fault injection).
FileSummary write_rank_file(const std::string& dir, const model::ModelDesc& desc, const ShardedLayout& layout,
                            int rank, const RankBuffers& bufs, const SafetensorsWriter::Progress& progress = {},
                            SafetensorsWriter::BlockBuffer direct = {});
// Elements of a rank's buffer of kind `k` as RankBuffers lay it out (the same on every rank).
int64_t held_elements(const ShardedLayout& layout, int k);
// Elements of kind `k` a rank holds as RankBuffers lay it out (0 when it writes none of it).
int64_t written_elements(const ShardedLayout& layout, int k, int rank);
// Checks the per-unit parts against the ranks and the padding, and that `at` lays the parts
// back to back (throws std::logic_error).
void check_layout(const ShardedLayout& layout);

// `meta` (the run state and "config") completed with "world_size", "files" and "tensors".
nlohmann::json make_index(const model::ModelDesc& desc, const ShardedLayout& layout,
                          const std::vector<FileSummary>& files, nlohmann::json meta);

// Writes index.json and config.json into `tmp_dir` (every rank's file already durable there),
// moves it to `step_dir`, then names it in `step_dir`/../latest (write-temp, fsync, rename).
void commit_step(const std::string& tmp_dir, const std::string& step_dir, const nlohmann::json& index,
                 const nlohmann::json& hf_config);
// Removes all but the newest `keep` step_N directories under `ckpt_root` (keep <= 0: none).
void keep_last(const std::string& ckpt_root, int64_t keep);

bool is_sharded(const std::string& dir);
// A run directory (DIR/ckpt/latest), a ckpt directory (its latest) or a step directory.
std::string resolve_checkpoint(const std::string& path);
// Parses index.json (a duplicated key is refused) and checks its structure: its format, world
// size, each rank's file by its name, the tensors and their ranges; errors name the file and
// field. The run state it also holds is train/'s to check (read_checkpoint_state).
nlohmann::json read_index(const std::string& step_dir);
// The tensors' (count, elements) as the index lists them.
std::pair<int64_t, int64_t> index_tensor_count(const nlohmann::json& index);
// File `file` against the index: present, its size, its checksum, its header's slices.
void verify_file(const std::string& step_dir, const nlohmann::json& index, int file);
// Every tensor of `desc` in the index with its shape and every kind covered exactly.
void check_index_against_model(const std::string& step_dir, const nlohmann::json& index,
                               const model::ModelDesc& desc, bool optimizer);
// What every reader checks before it loads: files first, first + stride, … of the index
// (verify_file; each rank of a resume checks every N-th), then the index against the model
// (check_index_against_model). Errors name the file.
void verify_checkpoint(const std::string& step_dir, const nlohmann::json& index, const model::ModelDesc& desc,
                       bool optimizer, int first = 0, int stride = 1);
// Where the slices an index names are: file i's slice `name` ("param/NAME", as its file names
// it), a safetensors file on disk or a rank's state in memory (an in-memory snapshot); null
// where file i is not at hand.
struct SliceSource {
  virtual ~SliceSource() = default;
  virtual const float* data(int64_t file, const std::string& name) const = 0;
  virtual std::string where(int64_t file) const = 0;  // for errors: the file's path, or what holds it
};
// Fills `rank`'s buffers under `layout` from the slices `index` lists and `source` has at hand
// (padding zeroed first with `zero_first`): the one resharding path, for checkpoints on disk and
// snapshots in memory alike. Refuses non-finite values naming `where` and the tensor.
void fill_rank(const nlohmann::json& index, const model::ModelDesc& desc, const ShardedLayout& layout, int rank,
               const RankBuffers& bufs, const SliceSource& source, bool zero_first);
// The files of `index` whose slices `rank` needs under `layout`, ascending.
std::vector<int64_t> files_needed(const nlohmann::json& index, const model::ModelDesc& desc, const ShardedLayout& layout,
                                  int rank);
// Rank `rank`'s slices under `layout` in its buffers `bufs`, by name, where its file would hold
// them (the slices it writes): an in-memory state as a SliceSource gives it.
std::map<std::string, const float*> rank_slices(const model::ModelDesc& desc, const ShardedLayout& layout, int rank,
                                               const RankBuffers& bufs);
// Fills `rank`'s buffers (padding zero) reading only the byte ranges it holds. Refuses
// non-finite values naming file and tensor.
void load_rank(const std::string& step_dir, const nlohmann::json& index, const model::ModelDesc& desc,
               const ShardedLayout& layout, int rank, const RankBuffers& bufs);

}  // namespace shardlm::ckpt
