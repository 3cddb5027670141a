// Sharded checkpoints end to end, under mpirun: resume gives the uninterrupted run's losses bit
// for bit; a damaged checkpoint is refused with one line naming the file and what is wrong (and
// training does not start); a rank killed in the middle of a save leaves `latest` on the
// previous checkpoint, which loads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "ckpt/sharded.h"
#include "model/model.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::shardlm;
using testing::step_losses;

class CheckpointSlow : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --save-every 2 --timeout 60";
    runs_.create("ckpt");
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static std::string args(const std::string& out, int steps, int batch = 2) { return runs_.args(out, steps, batch); }
  static std::string step(const std::string& run, int n) { return (dir_ / run / "ckpt" / ("step_" + std::to_string(n))).string(); }
  static std::string latest(const std::string& run) {
    std::ifstream f(dir_ / run / "ckpt" / "latest");
    std::string s;
    std::getline(f, s);
    return s;
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

// One line naming `file` and saying `what`; for eval (one process) and a resumed training run on
// two ranks, which must not start (no metrics.jsonl).
void expect_refused(const std::string& ck, const std::string& file, const std::string& what, const std::string& data,
                    const std::string& train_args, const fs::path& train_out) {
  const Result e = shardlm("eval --ckpt " + ck + " --data " + data + " --seq 32 --threads 1");
  EXPECT_NE(e.code, 0) << e.out;
  EXPECT_EQ(testing::count_lines(e.out), 1) << e.out;
  EXPECT_NE(e.out.find(file), std::string::npos) << e.out;
  EXPECT_NE(e.out.find(what), std::string::npos) << e.out;
  fs::remove_all(train_out);
  const Result t = mpirun(2, train_args + " --resume " + ck);
  EXPECT_NE(t.code, 0) << t.out;
  EXPECT_NE(t.out.find(file), std::string::npos) << t.out;
  EXPECT_NE(t.out.find(what), std::string::npos) << t.out;
  EXPECT_FALSE(fs::exists(train_out / "metrics.jsonl")) << "training started from a damaged checkpoint";
}

// 6 steps straight vs 4 + resume (from the run directory: its latest) + 2, fsdp on 2 ranks.
TEST_F(CheckpointSlow, ResumeOnTwoRanksGivesTheUninterruptedLossesBitwise) {
  ASSERT_EQ(mpirun(2, args("straight", 6) + " --strategy fsdp").code, 0);
  const Result part = mpirun(2, args("part", 6) + " --strategy fsdp", "-x SHARDLM_FAULT_KILL=0:4");
  ASSERT_NE(part.code, 0);
  EXPECT_EQ(latest("part"), "step_4");
  const Result r = mpirun(2, args("part", 6) + " --strategy fsdp --resume " + (dir_ / "part").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = step_losses(dir_ / "straight" / "metrics.jsonl"), b = step_losses(dir_ / "part" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);  // exact
  // Each rank wrote its own half; --keep-last was not given, so every checkpoint stays.
  for (int s : {2, 4, 6}) EXPECT_TRUE(fs::exists(step("part", s) + "/rank-00001-of-00002.safetensors")) << s;
}

// Every tensor of every kind of a checkpoint, whole, read in one process.
std::vector<std::vector<float>> whole_state(const std::string& step, const model::ModelDesc& desc) {
  const model::FlatLayout flat = model::flat_layout(desc);
  std::vector<std::vector<float>> s(ckpt::kNumKinds, std::vector<float>(flat.total));
  const nlohmann::json index = ckpt::read_index(step);
  ckpt::load_rank(step, index, desc, ckpt::whole_layout(flat), 0, {s[0].data(), s[1].data(), s[2].data()});
  return s;
}

// Saved by zero2 on 2 ranks; loaded by real runs under other strategies and rank counts, which
// save what they loaded at once (SHARDLM_TEST_SAVE_AFTER_RESUME): parameters and both AdamW
// moments are bitwise those saved.
TEST_F(CheckpointSlow, StateAfterLoadingUnderAnotherStrategyAndRankCountIsBitwiseTheSaved) {
  ASSERT_EQ(mpirun(2, args("src", 2) + " --strategy zero2").code, 0);
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 256));
  const auto want = whole_state(step("src", 2), desc);
  for (const auto& [ranks, strategy] : {std::pair{3, std::string("fsdp")}, {4, "hybrid --shard-group 2"}, {1, "ddp"}}) {
    const std::string out = "reload_" + std::to_string(ranks);
    const std::string a = args(out, 2, 1) + " --strategy " + strategy + " --resume-override global-batch --resume " +
                          step("src", 2);
    const Result r = ranks == 1 ? testing::run_command("SHARDLM_TEST_SAVE_AFTER_RESUME=1 " + testing::shardlm_binary() + " " + a)
                                : mpirun(ranks, a, "-x SHARDLM_TEST_SAVE_AFTER_RESUME=1");
    ASSERT_EQ(r.code, 0) << r.out;
    ASSERT_TRUE(fs::exists(step(out, 2) + "/" + ckpt::rank_file_name(ranks - 1, ranks))) << strategy;
    const auto got = whole_state(step(out, 2), desc);
    for (int k = 0; k < ckpt::kNumKinds; ++k)
      EXPECT_EQ(0, std::memcmp(got[k].data(), want[k].data(), 4 * want[k].size())) << strategy << " x" << ranks << " kind " << k;
  }
}

// --init-from on two fsdp ranks: from the sharded step directory (each rank reading its ranges)
// and from its Hugging Face export (read whole) the runs start from the same parameters — equal
// losses bit for bit — and agree with one process starting from them within 1e-5.
TEST_F(CheckpointSlow, InitFromOnTwoRanksShardedOrHuggingFace) {
  ASSERT_EQ(mpirun(2, args("init_src", 2) + " --strategy zero2").code, 0);
  const std::string hf = (dir_ / "init_hf").string();
  const Result x = shardlm("ckpt export --format hf --ckpt " + step("init_src", 2) + " --out " + hf);
  ASSERT_EQ(x.code, 0) << x.out;
  std::vector<std::vector<double>> runs;
  for (const std::string& from : {step("init_src", 2), hf}) {
    const std::string out = "init_" + std::to_string(runs.size());
    const Result r = mpirun(2, args(out, 2, 1) + " --strategy fsdp --init-from " + from);
    ASSERT_EQ(r.code, 0) << r.out;
    runs.push_back(step_losses(dir_ / out / "metrics.jsonl"));
  }
  const Result one = shardlm(args("init_one", 2) + " --init-from " + hf);
  ASSERT_EQ(one.code, 0) << one.out;
  const auto single = step_losses(dir_ / "init_one" / "metrics.jsonl");
  ASSERT_EQ(runs[0].size(), 2u);
  EXPECT_EQ(runs[0], runs[1]);
  ASSERT_EQ(single.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(runs[0][i], single[i], 1e-5 * single[i]) << "step " << i;
  ASSERT_EQ(shardlm(args("init_fresh", 2)).code, 0);
  EXPECT_NE(single[0], step_losses(dir_ / "init_fresh" / "metrics.jsonl")[0]);  // not a fresh start
}

TEST_F(CheckpointSlow, KeepLastKeepsTheNewest) {
  ASSERT_EQ(mpirun(2, args("keep", 6) + " --strategy zero2 --keep-last 2").code, 0);
  EXPECT_FALSE(fs::exists(step("keep", 2)));
  EXPECT_TRUE(fs::exists(step("keep", 4)));
  EXPECT_EQ(latest("keep"), "step_6");
}

// SHARDLM_FAULT_KILL_IN_SAVE kills rank 1 after writing its file of step 4, before the ranks
// agree that every file is durable: step_4 never appears, latest still names step_2, and the
// run resumes from it (the leftover temporary directory is removed).
TEST_F(CheckpointSlow, ARankKilledMidSaveLeavesLatestOnThePreviousCheckpoint) {
  const Result r = mpirun(2, args("crash", 6) + " --strategy fsdp", "-x SHARDLM_FAULT_KILL_IN_SAVE=1:4");
  ASSERT_NE(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(step("crash", 4)));
  EXPECT_EQ(latest("crash"), "step_2");
  const Result again = mpirun(2, args("crash", 6) + " --strategy fsdp --resume " + (dir_ / "crash").string());
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_EQ(latest("crash"), "step_6");
  for (const auto& e : fs::directory_iterator(dir_ / "crash" / "ckpt"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

TEST_F(CheckpointSlow, ADamagedCheckpointIsRefusedNamingTheFile) {
  ASSERT_EQ(mpirun(2, args("good", 2) + " --strategy fsdp").code, 0);
  const std::string data = (dir_ / "tok_val.bin").string();
  const std::string resume_args = args("resumed", 4) + " --strategy fsdp --resume-override steps";
  const fs::path resumed = dir_ / "resumed";
  int n = 0;
  auto copy = [&] {
    const fs::path ck = dir_ / ("damaged_" + std::to_string(n++));
    fs::copy(step("good", 2), ck);
    return ck;
  };
  const std::string rank1 = "rank-00001-of-00002.safetensors";
  {  // truncated
    const fs::path ck = copy();
    fs::resize_file(ck / rank1, fs::file_size(ck / rank1) - 100);
    expect_refused(ck.string(), rank1, "truncated", data, resume_args, resumed);
  }
  {  // one byte flipped in the tensor data
    const fs::path ck = copy();
    std::fstream f(ck / rank1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1000, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(-1000, std::ios::end);
    f.write(&c, 1);
    f.close();
    expect_refused(ck.string(), rank1, "checksum", data, resume_args, resumed);
  }
  {  // a rank's file missing
    const fs::path ck = copy();
    fs::remove(ck / rank1);
    expect_refused(ck.string(), rank1, "missing", data, resume_args, resumed);
  }
  {  // the index places a range the file does not hold: the first param slice of rank 1 shrunk
    const fs::path ck = copy();
    nlohmann::json index = nlohmann::json::parse(std::ifstream(ck / "index.json"));
    bool edited = false;
    for (auto& [name, t] : index["tensors"].items()) {
      auto& pieces = t["param"];
      if (!edited && pieces.size() == 2 && pieces[1]["file"] == 1) {
        pieces[1]["end"] = pieces[1]["end"].get<int64_t>() - 1;
        edited = true;
      }
    }
    ASSERT_TRUE(edited) << "no tensor spans both ranks' shards";
    std::ofstream(ck / "index.json") << index.dump();
    expect_refused(ck.string(), rank1, "index.json's range", data, resume_args, resumed);
  }
  // Another model's checkpoint: refused against this run's model, naming the checkpoint's config.
  const Result other = mpirun(2, args("other", 4) + " --strategy fsdp --n-embd 32 --resume " + step("good", 2));
  EXPECT_NE(other.code, 0) << other.out;
  EXPECT_NE(other.out.find("config.json: n_embd is 64 but this run's model has 32"), std::string::npos) << other.out;
  EXPECT_FALSE(fs::exists(dir_ / "other" / "metrics.jsonl"));
}

}  // namespace
}  // namespace shardlm
