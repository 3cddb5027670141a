// `--data PREFIX` over llm.c's numbered shards (PREFIX_train_000000.bin, ...): a run trains on
// their tokens as on the same tokens in one file, loss for loss, on one process and under fsdp at 2
// ranks.
#include <gtest/gtest.h>

#include <filesystem>

#include "data/shard.h"
#include "run/test_util.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

// PREFIX_SPLIT.bin cut into `pieces` numbered files at PIECES_PREFIX (the last takes the rest).
void cut(const std::string& prefix, const std::string& pieces_prefix, const std::string& split, int pieces) {
  const data::TokenShard whole(prefix + "_" + split + ".bin");
  const int64_t each = whole.size() / pieces;
  for (int k = 0; k < pieces; ++k) {
    const int64_t first = k * each, n = k + 1 < pieces ? each : whole.size() - first;
    data::write_token_shard(pieces_prefix + "_" + split + "_00000" + std::to_string(k) + ".bin",
                            whole.read(first, n));
  }
}

TEST(NumberedShards, TrainLikeTheSameTokensInOneFile) {
  testing::TinyRuns runs;
  runs.eval_windows = 4;
  ASSERT_EQ(runs.create("numbered").code, 0);
  const std::string pieces = (runs.dir / "pieces").string();
  cut(runs.data(), pieces, "train", 3);
  cut(runs.data(), pieces, "val", 2);
  fs::copy_file(runs.data() + "_meta.json", pieces + "_meta.json");
  const std::string on_pieces = " --data " + pieces;  // the later --data wins
  for (const int ranks : {1, 2}) {
    const std::string whole = "whole" + std::to_string(ranks), cut_run = "cut" + std::to_string(ranks);
    const testing::Result a = testing::mpirun(ranks, runs.args(whole, 4) + " --eval-every 2");
    const testing::Result b = testing::mpirun(ranks, runs.args(cut_run, 4) + " --eval-every 2" + on_pieces);
    ASSERT_EQ(a.code, 0) << a.out;
    ASSERT_EQ(b.code, 0) << b.out;
    const auto losses = testing::step_losses(runs.out(whole) / "metrics.jsonl");
    ASSERT_EQ(losses.size(), 4u);
    EXPECT_EQ(testing::step_losses(runs.out(cut_run) / "metrics.jsonl"), losses) << ranks << " rank(s)";
    const auto val_losses = [&](const std::string& run) {
      std::vector<double> val;
      for (const auto& row : testing::read_metrics(runs.out(run) / "metrics.jsonl"))
        if (row.contains("val_loss")) val.push_back(row["val_loss"].get<double>());
      return val;
    };
    EXPECT_FALSE(val_losses(whole).empty());
    EXPECT_EQ(val_losses(cut_run), val_losses(whole));
  }
  runs.remove();
}

}  // namespace
}  // namespace shardlm::train
