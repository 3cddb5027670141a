// Deterministic, stateless batch selection from a token shard.
//
// The sequences of a step are numbered 0, 1, .. across all its micro-steps and data-parallel
// ranks; sequence j of step `step` starts at offset hash(seed, step, j) mod (ntokens - T), where
// hash chains splitmix64; its inputs are tok[off, off+T) and its targets tok[off+1, off+T+1).
// Nothing depends on earlier calls, so a run resumes from (seed, step) alone. Micro-step m of
// data-parallel rank r of N, with B sequences per micro-batch, reads sequences
// first_sequence(m, r, N, B) = (m N + r) B onwards: so one process with batch N B reads, per
// micro-step, what the N ranks read together, and one process with batch B and N times the
// micro-steps reads, at micro-step m N + r, exactly rank r's micro-batch m (the same routing
// groups, for a mixture of experts).
#pragma once

#include <cstdint>

#include "data/corpus.h"

namespace shardlm::data {

// The start offset of the step's sequence j, in [0, ntokens - T). Throws std::invalid_argument
// unless ntokens >= T + 1 and T >= 1.
uint64_t sample_offset(uint64_t seed, int64_t step, int64_t j, int64_t ntokens, int64_t T);

// The step's first sequence of micro-step `micro` of data-parallel rank `dp` of `dp_size`, with
// `batch` sequences per micro-batch.
inline int64_t first_sequence(int64_t micro, int64_t dp, int64_t dp_size, int64_t batch) {
  return (micro * dp_size + dp) * batch;
}

// Fills inputs and targets, each num_seq * T int32 (row-major, row i = sequence first_seq+i).
// Throws std::runtime_error naming the shard if it has fewer than T + 1 tokens, and
// std::invalid_argument for T < 1, num_seq < 0 or first_seq < 0.
void sample_batch(const TokenCorpus& shard, uint64_t seed, int64_t step, int64_t first_seq, int64_t num_seq, int64_t T,
                  int32_t* inputs, int32_t* targets);

// Evaluation walks the shard in consecutive, non-overlapping windows: window i has inputs
// tok[iT, iT+T) and targets tok[iT+1, iT+T+1). There are floor((ntokens - 1) / T) of them
// (0 if ntokens < 1).
int64_t num_eval_windows(int64_t ntokens, int64_t T);

// Fills one window (T int32 each). Throws std::out_of_range if i is not a window of the
// shard, std::runtime_error naming the shard if it has fewer than T + 1 tokens.
void eval_window(const TokenCorpus& shard, int64_t i, int64_t T, int32_t* inputs, int32_t* targets);

// Fills windows first..first+count-1 as rows of a (count, T) batch.
void eval_batch(const TokenCorpus& shard, int64_t first, int64_t count, int64_t T, int32_t* inputs,
                int32_t* targets);

}  // namespace shardlm::data
