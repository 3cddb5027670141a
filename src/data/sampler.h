// Deterministic, stateless batch selection from a token shard.
//
// Sequence j (0-based, global across ranks) of micro-step `micro_step` of step `step` starts
// at offset hash(seed, step, micro_step, j) mod (ntokens - T), where hash chains splitmix64;
// its inputs are tok[off, off+T) and its targets tok[off+1, off+T+1). Nothing depends on
// earlier calls, so a run resumes from (seed, step) alone, and rank r of N with per-rank
// batch B, calling with first_seq = r*B and num_seq = B, gets exactly rows r*B..r*B+B-1 of
// the batch one process with batch N*B gets.
#pragma once

#include <cstdint>

#include "data/shard.h"

namespace shardlm::data {

// The start offset of global sequence j, in [0, ntokens - T). Throws std::invalid_argument
// unless ntokens >= T + 1 and T >= 1.
uint64_t sample_offset(uint64_t seed, int64_t step, int64_t micro_step, int64_t j, int64_t ntokens, int64_t T);

// Fills inputs and targets, each num_seq * T int32 (row-major, row i = sequence first_seq+i).
// Throws std::runtime_error naming the shard if it has fewer than T + 1 tokens, and
// std::invalid_argument for T < 1, num_seq < 0 or first_seq < 0.
void sample_batch(const TokenShard& shard, uint64_t seed, int64_t step, int64_t micro_step, int64_t first_seq,
                  int64_t num_seq, int64_t T, int32_t* inputs, int32_t* targets);

// Evaluation walks the shard in consecutive, non-overlapping windows: window i has inputs
// tok[iT, iT+T) and targets tok[iT+1, iT+T+1). There are floor((ntokens - 1) / T) of them
// (0 if ntokens < 1).
int64_t num_eval_windows(int64_t ntokens, int64_t T);

// Fills one window (T int32 each). Throws std::out_of_range if i is not a window of the
// shard, std::runtime_error naming the shard if it has fewer than T + 1 tokens.
void eval_window(const TokenShard& shard, int64_t i, int64_t T, int32_t* inputs, int32_t* targets);

// Fills windows first..first+count-1 as rows of a (count, T) batch.
void eval_batch(const TokenShard& shard, int64_t first, int64_t count, int64_t T, int32_t* inputs,
                int32_t* targets);

}  // namespace shardlm::data
