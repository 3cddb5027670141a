// The diffusion data set: the shapes set is the same bytes from the same arguments and reads back
// as written (channels first for the model), a damaged file is refused naming it, and the flow
// objective's draws are pure functions of (seed, step, sample).
#include "data/latents.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

namespace shardlm::data {
namespace {

namespace fs = std::filesystem;

std::string bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("shardlm_latents_" + std::to_string(::getpid()));
  TempDir() { fs::remove_all(dir); }
  ~TempDir() { fs::remove_all(dir); }
};

TEST(Latents, ShapesAreDeterministicAndReadBackChannelsFirst) {
  TempDir t;
  ShapesOptions o;
  o.train = 20, o.val = 10;
  make_shapes((t.dir / "a").string(), o);
  make_shapes((t.dir / "b").string(), o);
  EXPECT_EQ(bytes_of(t.dir / "a" / "train.bin"), bytes_of(t.dir / "b" / "train.bin"));
  o.seed += 1;
  make_shapes((t.dir / "c").string(), o);
  EXPECT_NE(bytes_of(t.dir / "a" / "train.bin"), bytes_of(t.dir / "c" / "train.bin"));

  const LatentSet train((t.dir / "a" / "train.bin").string()), val((t.dir / "a" / "val.bin").string());
  EXPECT_EQ(train.size(), 20);
  EXPECT_EQ(val.size(), 10);
  EXPECT_EQ(train.shape(), o.shape);
  const LatentShape& s = o.shape;
  std::vector<float> last(s.values()), first(s.values());
  o.seed -= 1;  // a's
  render_shape(o, "train", 13, train.label(13), last.data());
  train.read_channels_first(13, first.data());
  const int64_t plane = s.frames * s.height * s.width;
  for (int64_t p = 0; p < plane; ++p)
    for (int64_t c = 0; c < s.channels; ++c) ASSERT_EQ(first[c * plane + p], last[p * s.channels + c]);
  // Every class occurs, and a record is not all background.
  std::set<int32_t> labels;
  for (int64_t i = 0; i < train.size(); ++i) labels.insert(train.label(i));
  EXPECT_EQ(static_cast<int64_t>(labels.size()), s.classes);
  int64_t lit = 0;
  for (float v : first) lit += v != -1.0f;
  EXPECT_GT(lit, s.channels * 4);
}

TEST(Latents, DamagedFilesAreRefusedNamingThem) {
  TempDir t;
  ShapesOptions o;
  o.train = 3, o.val = 1;
  make_shapes(t.dir.string(), o);
  const fs::path p = t.dir / "train.bin";
  fs::resize_file(p, fs::file_size(p) - 8);
  try {
    LatentSet set(p.string());
    FAIL() << "a truncated set was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("record 2"), std::string::npos) << e.what();
  }
  // A file make-data did not write stays, and the call says why.
  const fs::path foreign = t.dir / "other";
  fs::create_directories(foreign);
  std::ofstream(foreign / "val.bin") << "someone's file";
  EXPECT_THROW(make_shapes(foreign.string(), o), std::runtime_error);
  EXPECT_EQ(bytes_of(foreign / "val.bin"), "someone's file");
}

TEST(Latents, FlowDrawsArePureFunctionsOfSeedStepAndSample) {
  std::vector<float> a(64), b(64), c(64);
  const FlowDraw da = flow_draw(7, 3, 5, 0.1, a.data(), 64);
  const FlowDraw db = flow_draw(7, 3, 5, 0.1, b.data(), 64);
  const FlowDraw dc = flow_draw(7, 3, 6, 0.1, c.data(), 64);
  EXPECT_EQ(a, b);
  EXPECT_EQ(da.time, db.time);
  EXPECT_NE(a, c);
  EXPECT_NE(da.time, dc.time);
  // Logit-normal times inside (0, 1) with their median near 1/2; drops near cond_drop's share.
  std::vector<float> times;
  int drops = 0;
  for (int j = 0; j < 4000; ++j) {
    const FlowDraw d = flow_draw(1, 0, j, 0.1, c.data(), 1);
    ASSERT_GT(d.time, 0.0f);
    ASSERT_LT(d.time, 1.0f);
    times.push_back(d.time);
    drops += d.drop_label;
  }
  std::nth_element(times.begin(), times.begin() + 2000, times.end());
  EXPECT_NEAR(times[2000], 0.5, 0.03);
  EXPECT_NEAR(drops / 4000.0, 0.1, 0.02);
  EXPECT_EQ(latent_record(1, 2, 3, 100), latent_record(1, 2, 3, 100));
  EXPECT_LT(latent_record(1, 2, 3, 100), 100);
}

}  // namespace
}  // namespace shardlm::data
