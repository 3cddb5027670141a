// A split of a corpus as one sequence over llm.c's numbered shards (PREFIX_train_000001.bin, ...):
// which files make it, reads across their boundaries, and batches equal to those of the same
// tokens in one file.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "data/corpus.h"
#include "data/sampler.h"
#include "data_test_util.h"

namespace shardlm::data {
namespace {

using testing::TempDir;

std::vector<int32_t> iota_tokens(int64_t n, int32_t from) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), from);
  return t;
}

TEST(TokenCorpus, TheWholeFileElseTheNumberedShardsInNameOrder) {
  const TempDir dir;
  const std::string prefix = dir.file("fw");
  EXPECT_EQ(split_files(prefix, "train"), std::vector<std::string>{prefix + "_train.bin"});  // nothing: the name to open
  for (const char* name : {"fw_train_000002.bin", "fw_train_000001.bin", "fw_train_x1.bin", "fw_train_.bin",
                           "fw_val_000000.bin", "fw_trainer_000001.bin", "fw_train_000003.bin.tmp"})
    write_token_shard(dir.file(name), std::vector<int32_t>{1});
  EXPECT_EQ(split_files(prefix, "train"),
            (std::vector<std::string>{dir.file("fw_train_000001.bin"), dir.file("fw_train_000002.bin")}));
  EXPECT_EQ(split_files(prefix, "val"), std::vector<std::string>{dir.file("fw_val_000000.bin")});
  write_token_shard(prefix + "_train.bin", std::vector<int32_t>{1});  // a whole file wins
  EXPECT_EQ(split_files(prefix, "train"), std::vector<std::string>{prefix + "_train.bin"});
}

// Files of 5, 0 and 7 tokens read as the 12 in a row, a range spanning all three included.
TEST(TokenCorpus, ReadsAcrossFileBoundaries) {
  const TempDir dir;
  write_token_shard(dir.file("c_train_000001.bin"), iota_tokens(5, 0));
  write_token_shard(dir.file("c_train_000002.bin"), std::vector<int32_t>{});
  write_token_shard(dir.file("c_train_000003.bin"), iota_tokens(7, 5));
  const TokenCorpus c(split_files(dir.file("c"), "train"));
  EXPECT_EQ(c.size(), 12);
  EXPECT_EQ(c.files(), 3u);
  EXPECT_EQ(c.path(), dir.file("c_train_*.bin (3 files)"));
  for (int64_t first = 0; first <= 12; ++first)
    for (int64_t count = 0; first + count <= 12; ++count) {
      const std::vector<int32_t> got = c.read(first, count);
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], first + i) << first << " +" << count;
    }
  EXPECT_THROW(c.read(10, 3), std::out_of_range);
  EXPECT_THROW(c.read(-1, 1), std::out_of_range);
  try {
    c.validate_tokens(9);
    FAIL() << "token 9 passed a vocabulary of 9";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("c_train_000003.bin")), std::string::npos) << e.what();
  }
}

// A range's scan finds the bad ids inside it, across file boundaries, and none outside it:
// ranks each scan one share of a corpus (train's check_token_ids).
TEST(TokenCorpus, ValidatesARangeOfTokens) {
  const TempDir dir;
  write_token_shard(dir.file("c_train_000001.bin"), std::vector<int32_t>{0, 1, 9, 2});
  write_token_shard(dir.file("c_train_000002.bin"), std::vector<int32_t>{3, 4, 9});
  const TokenCorpus c(split_files(dir.file("c"), "train"));
  EXPECT_NO_THROW(c.validate_tokens(9, 0, 2));
  EXPECT_NO_THROW(c.validate_tokens(9, 3, 3));  // across the boundary, between the two 9s
  EXPECT_NO_THROW(c.validate_tokens(9, 7, 0));
  const auto error_of = [&](int64_t first, int64_t count) {
    try {
      c.validate_tokens(9, first, count);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of(1, 2).find(dir.file("c_train_000001.bin") + ": token id 9 at position 2 "), std::string::npos)
      << error_of(1, 2);
  EXPECT_NE(error_of(3, 4).find(dir.file("c_train_000002.bin") + ": token id 9 at position 2 "), std::string::npos)
      << error_of(3, 4);
}

// Shares tile the whole in rank order, sizes differing by at most one, whatever the counts
// (fewer tokens than ranks, one rank, counts whose product with a rank overflows int64).
TEST(TokenCorpus, SharesTileTheTokensEvenly) {
  for (const int64_t total : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000003}, int64_t{1} << 60})
    for (const int ranks : {1, 2, 3, 4, 7, 1024}) {
      int64_t next = 0, least = total, most = 0;
      for (int r = 0; r < ranks; ++r) {
        const TokenRange s = share_of(total, r, ranks);
        ASSERT_EQ(s.first, next) << total << " over " << ranks << ", rank " << r;
        ASSERT_LE(s.first, s.end);
        least = std::min(least, s.end - s.first);
        most = std::max(most, s.end - s.first);
        next = s.end;
      }
      EXPECT_EQ(next, total) << total << " over " << ranks;
      EXPECT_LE(most - least, 1) << total << " over " << ranks;
    }
}

// Training batches and evaluation windows over shards are those over the same tokens in one
// file, so a corpus split as llm.c splits it trains as it would whole.
TEST(TokenCorpus, BatchesEqualThoseOfOneFile) {
  const TempDir dir;
  std::vector<int32_t> all(10000);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i * 7919 % 50257);
  write_token_shard(dir.file("one_train.bin"), all);
  for (int k = 0; k < 4; ++k)
    write_token_shard(dir.file("four_train_00000" + std::to_string(k) + ".bin"),
                      std::vector<int32_t>(all.begin() + 2500 * k, all.begin() + 2500 * (k + 1)));
  const TokenCorpus one(split_files(dir.file("one"), "train")), four(split_files(dir.file("four"), "train"));
  ASSERT_EQ(four.files(), 4u);
  const int64_t B = 16, T = 64;
  std::vector<int32_t> in1(B * T), tg1(B * T), in4(B * T), tg4(B * T);
  for (int64_t step = 0; step < 20; ++step) {
    sample_batch(one, 42, step, 0, B, T, in1.data(), tg1.data());
    sample_batch(four, 42, step, 0, B, T, in4.data(), tg4.data());
    ASSERT_EQ(in1, in4) << step;
    ASSERT_EQ(tg1, tg4) << step;
  }
  eval_batch(one, 30, B, T, in1.data(), tg1.data());
  eval_batch(four, 30, B, T, in4.data(), tg4.data());  // windows 30..45 cross the boundary at 2500
  EXPECT_EQ(in1, in4);
  EXPECT_EQ(tg1, tg4);
}

}  // namespace
}  // namespace shardlm::data
