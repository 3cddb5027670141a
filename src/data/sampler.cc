#include "data/sampler.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace shardlm::data {
namespace {

// splitmix64's output function applied to x + golden ratio: a bijective 64-bit mixer.
inline uint64_t mix(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void check_shard(const TokenCorpus& shard, int64_t T) {
  if (T < 1) throw std::invalid_argument("sequence length T must be >= 1, got " + std::to_string(T));
  if (shard.size() < T + 1)
    throw std::runtime_error("token shard " + shard.path() + ": has " + std::to_string(shard.size()) +
                             " tokens, fewer than T + 1 = " + std::to_string(T + 1) + " needed for one sequence");
}

// Splits T + 1 consecutive tokens into inputs and the targets one position later.
inline void split_window(const int32_t* tok, int64_t T, int32_t* in, int32_t* tg) {
  for (int64_t t = 0; t < T; ++t) {
    in[t] = tok[t];
    tg[t] = tok[t + 1];
  }
}

}  // namespace

uint64_t sample_offset(uint64_t seed, int64_t step, int64_t j, int64_t ntokens, int64_t T) {
  if (T < 1 || ntokens < T + 1)
    throw std::invalid_argument("sample_offset: need T >= 1 and ntokens >= T + 1 (T = " + std::to_string(T) +
                                ", ntokens = " + std::to_string(ntokens) + ")");
  uint64_t h = mix(seed ^ 0x5348415244444154ull);  // "SHARDDAT"
  h = mix(h ^ static_cast<uint64_t>(step));
  h = mix(h ^ static_cast<uint64_t>(j));
  return h % static_cast<uint64_t>(ntokens - T);
}

void sample_batch(const TokenCorpus& shard, uint64_t seed, int64_t step, int64_t first_seq, int64_t num_seq, int64_t T,
                  int32_t* inputs, int32_t* targets) {
  check_shard(shard, T);
  if (num_seq < 0 || first_seq < 0)
    throw std::invalid_argument("sample_batch: first_seq and num_seq must be >= 0 (got " +
                                std::to_string(first_seq) + ", " + std::to_string(num_seq) + ")");
  std::vector<int32_t> window(static_cast<size_t>(T + 1));
  for (int64_t i = 0; i < num_seq; ++i) {
    const auto off = static_cast<int64_t>(sample_offset(seed, step, first_seq + i, shard.size(), T));
    shard.read(off, T + 1, window.data());
    split_window(window.data(), T, inputs + i * T, targets + i * T);
  }
}

int64_t num_eval_windows(int64_t ntokens, int64_t T) {
  if (T < 1) throw std::invalid_argument("sequence length T must be >= 1, got " + std::to_string(T));
  return ntokens < 1 ? 0 : (ntokens - 1) / T;
}

void eval_batch(const TokenCorpus& shard, int64_t first, int64_t count, int64_t T, int32_t* inputs,
                int32_t* targets) {
  check_shard(shard, T);
  const int64_t n = num_eval_windows(shard.size(), T);
  if (first < 0 || count < 0 || first + count > n)
    throw std::out_of_range("token shard " + shard.path() + ": eval windows [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") are not within its " + std::to_string(n) +
                            " windows of T = " + std::to_string(T));
  // Consecutive windows share their boundary tokens: one read of count * T + 1 tokens.
  if (count == 0) return;
  const std::vector<int32_t> tok = shard.read(first * T, count * T + 1);
  for (int64_t i = 0; i < count; ++i) split_window(tok.data() + i * T, T, inputs + i * T, targets + i * T);
}

void eval_window(const TokenCorpus& shard, int64_t i, int64_t T, int32_t* inputs, int32_t* targets) {
  eval_batch(shard, i, 1, T, inputs, targets);
}

}  // namespace shardlm::data
