// The sampler: deterministic, stateless, rank-splittable batches; eval windows.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "data/sampler.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::TempDir;

// A shard whose token i is i % 50000 (so a window shows where it starts).
TokenCorpus make_shard(const TempDir& dir, int64_t n, const std::string& name = "s.bin") {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>(i % 50000);
  write_token_shard(dir.file(name), t);
  return TokenCorpus(dir.file(name));
}

struct Batch {
  std::vector<int32_t> in, tg;
  bool operator==(const Batch&) const = default;
};

Batch sample(const TokenCorpus& s, uint64_t seed, int64_t step, int64_t first, int64_t num, int64_t T) {
  Batch b{std::vector<int32_t>(static_cast<size_t>(num * T)), std::vector<int32_t>(static_cast<size_t>(num * T))};
  sample_batch(s, seed, step, first, num, T, b.in.data(), b.tg.data());
  return b;
}

TEST(Sampler, DeterministicAndWindowed) {
  TempDir dir;
  const TokenCorpus s = make_shard(dir, 10000);
  const int64_t B = 8, T = 64;
  const Batch a = sample(s, 1234, 5, 0, B, T);
  EXPECT_EQ(a, sample(s, 1234, 5, 0, B, T));
  EXPECT_NE(a, sample(s, 1235, 5, 0, B, T));
  EXPECT_NE(a, sample(s, 1234, 6, 0, B, T));
  EXPECT_NE(a, sample(s, 1234, 5, B, B, T));
  for (int64_t i = 0; i < B; ++i) {
    const auto off = static_cast<int64_t>(sample_offset(1234, 5, i, s.size(), T));
    ASSERT_LT(off, s.size() - T);
    const std::vector<int32_t> window = s.read(off, T + 1);
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(a.in[i * T + t], window[t]);
      ASSERT_EQ(a.tg[i * T + t], window[t + 1]);
    }
  }
}

// N ranks with micro-batches of B read, per micro-step, what one process with batch N B reads;
// and rank r's micro-batch m is micro-batch m N + r of one process with batch B and N times the
// micro-steps (its routing groups are the ranks').
TEST(Sampler, RanksSplitTheGlobalBatch) {
  TempDir dir;
  const TokenCorpus s = make_shard(dir, 5000);
  const int64_t N = 4, B = 3, T = 16, A = 2;
  for (int64_t step = 0; step < 3; ++step) {
    for (int64_t micro = 0; micro < A; ++micro) {
      const Batch full = sample(s, 42, step, first_sequence(micro, 0, 1, N * B), N * B, T);
      for (int64_t r = 0; r < N; ++r) {
        const Batch part = sample(s, 42, step, first_sequence(micro, r, N, B), B, T);
        const auto lo = static_cast<size_t>(r * B * T), hi = static_cast<size_t>((r + 1) * B * T);
        EXPECT_EQ(part.in, std::vector<int32_t>(full.in.begin() + lo, full.in.begin() + hi));
        EXPECT_EQ(part.tg, std::vector<int32_t>(full.tg.begin() + lo, full.tg.begin() + hi));
        EXPECT_EQ(part, sample(s, 42, step, first_sequence(micro * N + r, 0, 1, B), B, T));
      }
    }
    EXPECT_NE(sample(s, 42, step, first_sequence(0, 0, 1, B), B, T), sample(s, 42, step, first_sequence(1, 0, 1, B), B, T));
  }
}

TEST(Sampler, OffsetsCoverTheRangeEvenly) {
  TempDir dir;
  // With T + 1 tokens the only window is at 0; with T + 2 there are two.
  const TokenCorpus tight = make_shard(dir, 17, "tight.bin");
  for (int j = 0; j < 20; ++j) EXPECT_EQ(sample_offset(9, 0, j, tight.size(), 16), 0u);
  std::set<uint64_t> seen;
  for (int j = 0; j < 50; ++j) seen.insert(sample_offset(9, 0, j, 18, 16));
  EXPECT_EQ(seen, (std::set<uint64_t>{0, 1}));
  // 10 buckets, 20000 draws: each bucket near 2000.
  std::vector<int> hist(10);
  for (int j = 0; j < 20000; ++j) ++hist[sample_offset(7, j / 100, j, 1010, 10) / 100];
  for (int h : hist) {
    EXPECT_GT(h, 1700);
    EXPECT_LT(h, 2300);
  }
}

TEST(Sampler, ErrorsOnAShardTooShort) {
  TempDir dir;
  const TokenCorpus s = make_shard(dir, 16);
  std::vector<int32_t> in(16), tg(16);
  try {
    sample_batch(s, 0, 0, 0, 1, 16, in.data(), tg.data());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("s.bin")), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fewer than T + 1 = 17"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(sample_batch(s, 0, 0, 0, 1, 15, in.data(), tg.data()));
  EXPECT_THROW(sample_batch(s, 0, 0, 0, 1, 0, in.data(), tg.data()), std::invalid_argument);
  EXPECT_THROW(eval_window(s, 0, 16, in.data(), tg.data()), std::runtime_error);
}

TEST(Sampler, EvalWindows) {
  EXPECT_EQ(num_eval_windows(1001, 100), 10);
  EXPECT_EQ(num_eval_windows(1000, 100), 9);
  EXPECT_EQ(num_eval_windows(101, 100), 1);
  EXPECT_EQ(num_eval_windows(100, 100), 0);
  EXPECT_EQ(num_eval_windows(0, 100), 0);
  TempDir dir;
  const TokenCorpus s = make_shard(dir, 1001);
  const int64_t T = 100;
  std::vector<int32_t> in(T), tg(T);
  for (int64_t i = 0; i < num_eval_windows(s.size(), T); ++i) {
    eval_window(s, i, T, in.data(), tg.data());
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(in[t], i * T + t);
      ASSERT_EQ(tg[t], i * T + t + 1);
    }
  }
  EXPECT_THROW(eval_window(s, 10, T, in.data(), tg.data()), std::out_of_range);
  EXPECT_THROW(eval_window(s, -1, T, in.data(), tg.data()), std::out_of_range);
  std::vector<int32_t> bin(3 * T), btg(3 * T);
  eval_batch(s, 7, 3, T, bin.data(), btg.data());
  EXPECT_EQ(bin[0], 700);
  EXPECT_EQ(btg[3 * T - 1], 1000);
  EXPECT_THROW(eval_batch(s, 8, 3, T, bin.data(), btg.data()), std::out_of_range);
}

}  // namespace
}  // namespace shardlm::data
