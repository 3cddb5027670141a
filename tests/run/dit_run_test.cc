// The dit family through `shardlm train` on `make-data shapes`: every data-parallel strategy at two
// ranks gives one process's losses (the blocks and the head borrow the embedding's conditioning,
// gathered under fsdp and reduced with its gradients); bad input is one line; trained for the
// quick start's length, the validation loss falls by more than half.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>

#include "run/test_util.h"

namespace shardlm::testing {
namespace {

namespace fs = std::filesystem;

class DitRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("shardlm_dit_run_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    const Result r = shardlm("make-data shapes --train 256 --val 32 --out " + (dir_ / "shapes").string());
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string args(const std::string& out, int steps) {
    return "train --model dit-tiny --data " + (dir_ / "shapes").string() + " --out " + (dir_ / out).string() +
           " --steps " + std::to_string(steps) + " --lr 1e-3 --warmup 2 --threads 1 --eval-windows 32 --quiet --no-report";
  }
  static std::vector<double> column(const std::string& out, const char* field) {
    std::vector<double> v;
    for (const auto& row : read_metrics(dir_ / out / "metrics.jsonl"))
      if (row.contains(field)) v.push_back(row[field].get<double>());
    return v;
  }
  static inline fs::path dir_;
};

TEST_F(DitRun, TwoRanksOfEveryStrategyGiveOneProcesssLosses) {
  const Result one = shardlm(args("one", 4) + " --batch 8");
  ASSERT_EQ(one.code, 0) << one.out;
  const std::vector<double> want = column("one", "loss"), want_norm = column("one", "grad_norm");
  ASSERT_EQ(want.size(), 4u);
  for (const std::string strategy : {"ddp", "zero2", "fsdp"}) {
    const Result r = mpirun(2, args(strategy, 4) + " --batch 4 --strategy " + strategy);
    ASSERT_EQ(r.code, 0) << strategy << ": " << r.out;
    const std::vector<double> got = column(strategy, "loss"), norm = column(strategy, "grad_norm");
    ASSERT_EQ(got.size(), want.size()) << strategy;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << strategy << " step " << i;
      EXPECT_NEAR(norm[i], want_norm[i], 1e-5 * want_norm[i]) << strategy << " step " << i;
    }
    EXPECT_EQ(column(strategy, "val_loss").size(), 1u) << strategy;
  }
}

TEST_F(DitRun, BadInputIsOneLine) {
  // Latents of another shape than the model's.
  const Result made = shardlm("make-data shapes --height 8 --width 8 --train 4 --val 2 --out " + (dir_ / "small").string());
  ASSERT_EQ(made.code, 0) << made.out;
  expect_one_line_error(shardlm("train --model dit-tiny --steps 1 --quiet --data " + (dir_ / "small").string() + " --out " +
                                (dir_ / "bad_shape").string()),
                        {"small/train.bin", "8x8", "16x16"});
  expect_one_line_error(shardlm(args("bad_save", 1) + " --save-every 1"), {"--save-every", "dit"});
  // A patch that does not divide the latents, and one that is not three sizes.
  expect_one_line_error(shardlm(args("bad_patch", 1) + " --patch 1,3,2"), {"--patch 1,3,2", "3 does not divide height (16)"});
  expect_one_line_error(shardlm(args("bad_patch", 1) + " --patch 2,2"), {"--patch", "PF,PH,PW", "2,2"});
  expect_one_line_error(shardlm("train --model tiny --cond-drop 0.2 --data x --out " + (dir_ / "bad_drop").string()),
                        {"--cond-drop", "gpt2"});
  // A directory holding a file make-data did not write.
  fs::create_directories(dir_ / "foreign");
  std::ofstream(dir_ / "foreign" / "train.bin") << "not ours";
  expect_one_line_error(shardlm("make-data shapes --out " + (dir_ / "foreign").string()), {"foreign/train.bin", "not a latent set"});
}

// The quick start's run (docs/dit.md), which takes seconds: the end-to-end suite.
class DitTrainSlow : public DitRun {};

TEST_F(DitTrainSlow, ValidationLossFallsByMoreThanHalf) {
  const Result r = shardlm(args("long", 300) + " --batch 16 --warmup 20 --eval-every 25");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<double> val = column("long", "val_loss");
  ASSERT_EQ(val.size(), 12u);
  EXPECT_LT(val.back(), 0.5 * val.front()) << "first " << val.front() << ", last " << val.back();
}

}  // namespace
}  // namespace shardlm::testing
