// The dit family through `shardlm train` on `make-data shapes`: every data-parallel strategy at two
// ranks gives one process's losses (the blocks and the head borrow the embedding's conditioning,
// gathered under fsdp and reduced with its gradients); bad input is one line; trained for half a
// minute, the validation loss falls by more than half and the samples are their class.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>

#include "data/latents.h"
#include "run/test_util.h"

namespace shardlm::testing {
namespace {

namespace fs = std::filesystem;

class DitRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("shardlm_dit_run_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    const Result r = shardlm("make-data shapes --train 512 --val 32 --out " + (dir_ / "shapes").string());
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string args(const std::string& out, int steps) {
    return "train --model dit-tiny --data " + (dir_ / "shapes").string() + " --out " + (dir_ / out).string() +
           " --steps " + std::to_string(steps) + " --lr 1e-3 --warmup 2 --threads 1 --eval-windows 32 --quiet --no-report" +
           " --samples-per-class 0";
  }
  static std::vector<double> column(const std::string& out, const char* field) {
    std::vector<double> v;
    for (const auto& row : read_metrics(dir_ / out / "metrics.jsonl"))
      if (row.contains(field)) v.push_back(row[field].get<double>());
    return v;
  }
  static inline fs::path dir_;
};

// Latents of a latent set, record after record.
std::vector<float> latents(const fs::path& path) {
  const data::LatentSet set(path.string());
  std::vector<float> all(set.size() * set.shape().values());
  for (int64_t i = 0; i < set.size(); ++i) set.read_channels_first(i, all.data() + i * set.shape().values());
  return all;
}

TEST_F(DitRun, TwoRanksOfEveryStrategyGiveOneProcesssLossesAndSamples) {
  const std::string sample = " --samples-per-class 1 --sample-steps 4";
  const Result one = shardlm(args("one", 4) + " --batch 8" + sample);
  ASSERT_EQ(one.code, 0) << one.out;
  const std::vector<double> want = column("one", "loss"), want_norm = column("one", "grad_norm");
  ASSERT_EQ(want.size(), 4u);
  for (const std::string strategy : {"ddp", "zero2", "fsdp"}) {
    const Result r = mpirun(2, args(strategy, 4) + " --batch 4 --strategy " + strategy + sample);
    ASSERT_EQ(r.code, 0) << strategy << ": " << r.out;
    const std::vector<double> got = column(strategy, "loss"), norm = column(strategy, "grad_norm");
    ASSERT_EQ(got.size(), want.size()) << strategy;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << strategy << " step " << i;
      EXPECT_NEAR(norm[i], want_norm[i], 1e-5 * want_norm[i]) << strategy << " step " << i;
    }
    EXPECT_EQ(column(strategy, "val_loss").size(), 1u) << strategy;
    const std::vector<float> want_x = latents(dir_ / "one" / "samples.bin"), x = latents(dir_ / strategy / "samples.bin");
    ASSERT_EQ(x.size(), want_x.size()) << strategy;
    float most = 0;
    for (size_t i = 0; i < x.size(); ++i) most = std::max(most, std::fabs(x[i] - want_x[i]));
    EXPECT_LE(most, 1e-4f) << strategy << ": the samples differ from one process's by up to " << most;
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

// A run of half a minute: the end-to-end suite.
class DitTrainSlow : public DitRun {};

// The mean colour of a sample's lit pixels (any channel above −0.5: not background), as the
// shapes set colours each class (data::class_colour), names the nearest class.
int32_t class_by_colour(const data::LatentSet& set, int64_t i) {
  const data::LatentShape& s = set.shape();
  const int64_t plane = s.frames * s.height * s.width;
  std::vector<float> x(s.values());
  set.read_channels_first(i, x.data());
  std::vector<double> mean(s.channels, 0.0);
  int64_t lit = 0;
  for (int64_t p = 0; p < plane; ++p) {
    float top = -1;
    for (int64_t c = 0; c < s.channels; ++c) top = std::max(top, x[c * plane + p]);
    if (top <= -0.5f) continue;
    ++lit;
    for (int64_t c = 0; c < s.channels; ++c) mean[c] += x[c * plane + p];
  }
  int32_t best = -1;
  double best_d = 1e30;
  for (int32_t k = 0; k < s.classes && lit > 0; ++k) {
    double d = 0;
    for (int64_t c = 0; c < s.channels; ++c) d += std::pow(mean[c] / lit - data::class_colour(k, c), 2);
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

// Trained on the shapes, the validation loss falls by more than half, and the samples drawn at
// the end (classifier-free guided) are their class by colour.
TEST_F(DitTrainSlow, ValidationLossHalvesAndSamplesAreTheirClass) {
  const Result r = shardlm(args("long", 600) + " --batch 32 --lr 2e-3 --warmup 50 --eval-every 100 --samples-per-class 2 "
                           "--sample-steps 25");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<double> val = column("long", "val_loss");
  ASSERT_EQ(val.size(), 6u);
  EXPECT_LT(val.back(), 0.5 * val.front()) << "first " << val.front() << ", last " << val.back();
  std::ifstream png(dir_ / "long" / "samples.png", std::ios::binary);
  std::string magic(8, '\0');
  png.read(magic.data(), 8);
  EXPECT_EQ(magic, "\x89PNG\r\n\x1a\n");
  const data::LatentSet samples((dir_ / "long" / "samples.bin").string());
  ASSERT_EQ(samples.size(), 20);
  int right = 0;
  for (int64_t i = 0; i < samples.size(); ++i) right += class_by_colour(samples, i) == samples.label(i);
  EXPECT_GE(right, 16) << "of 20 samples, " << right << " have their class's colour";
}

}  // namespace
}  // namespace shardlm::testing
