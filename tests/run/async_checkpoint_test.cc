// --async-save and crashes in the middle of writing a checkpoint, end to end under mpirun: an
// asynchronous save writes bitwise the files a synchronous one does and holds its staging copy as
// the plan says; resuming from it gives the uninterrupted losses bit for bit; a rank killed with
// half its file on disk (synchronous or not) leaves `latest` on the previous checkpoint, which
// resumes, and the next run removes the leftover; a failed background write ends every rank with
// one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <regex>

#include "ckpt/sharded.h"
#include "model/model.h"
#include "plan/plan.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::step_losses;

class AsyncCheckpointSlow : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --save-every 2 --timeout 60 --strategy fsdp";
    runs_.create("async_ckpt");
    dir_ = runs_.dir;
    // The uninterrupted synchronous run every test compares with.
    const Result r = mpirun(2, args("straight", 6));
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static std::string args(const std::string& out, int steps) { return runs_.args(out, steps); }
  static fs::path step(const std::string& run, int n) { return dir_ / run / "ckpt" / ("step_" + std::to_string(n)); }
  static std::string latest(const std::string& run) {
    std::ifstream f(dir_ / run / "ckpt" / "latest");
    std::string s;
    std::getline(f, s);
    return s;
  }
  static std::string bytes_of(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
  // A rank killed by SIGKILL in the middle of writing its file of step 4: only a partial (or
  // empty) temporary file of it is on disk, step_4 never appears, latest names step_2; resuming (with
  // `resume_flags`) removes the leftover and gives the uninterrupted losses bit for bit.
  static void expect_mid_write_kill_recovers(const std::string& run, const std::string& flags) {
    const Result r = mpirun(2, args(run, 6) + flags, "-x SHARDLM_FAULT_KILL_MID_WRITE=1:4");
    ASSERT_NE(r.code, 0) << r.out;
    EXPECT_FALSE(fs::exists(step(run, 4)));
    EXPECT_EQ(latest(run), "step_2");
    int partial = 0;
    for (const auto& e : fs::recursive_directory_iterator(dir_ / run / "ckpt"))
      if (e.path().filename().string().rfind("rank-00001-of-00002.safetensors.tmp-", 0) == 0) {  // its own temporary
        ++partial;  // possibly empty: --async-save writes through an 8 MiB block, larger than tiny's file
        EXPECT_LT(fs::file_size(e.path()), fs::file_size(step("straight", 4) / "rank-00001-of-00002.safetensors"));
      }
    EXPECT_EQ(partial, 1) << "no partial rank file: the fault did not strike in the middle of the write";
    const Result again = mpirun(2, args(run, 6) + flags + " --resume " + (dir_ / run).string());
    ASSERT_EQ(again.code, 0) << again.out;
    EXPECT_EQ(latest(run), "step_6");
    for (const auto& e : fs::recursive_directory_iterator(dir_ / run / "ckpt"))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    EXPECT_EQ(step_losses(dir_ / run / "metrics.jsonl"), step_losses(dir_ / "straight" / "metrics.jsonl"));
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

// Every file of every checkpoint equal byte for byte; the staging copy is held between steps
// exactly as the plan says (and not at all without --async-save); the losses are the same.
TEST_F(AsyncCheckpointSlow, FilesAreBitwiseTheSynchronousSavesAndStagingIsThePlans) {
  const Result r = mpirun(2, args("async", 6) + " --async-save");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(latest("async"), "step_6");
  int files = 0;
  for (int s : {2, 4, 6})
    for (const auto& e : fs::directory_iterator(step("straight", s))) {
      const fs::path mine = step("async", s) / e.path().filename();
      ASSERT_TRUE(fs::exists(mine)) << mine;
      EXPECT_EQ(bytes_of(mine), bytes_of(e.path())) << mine;
      ++files;
    }
  EXPECT_EQ(files, 3 * 4);  // two rank files, index.json, config.json
  plan::PlanConfig pc;
  pc.world = 2;
  pc.batch = 2;
  pc.seq = 32;
  pc.stage_checkpoint = true;
  const plan::Plan p = plan::build_plan(model::describe(model::model_preset("tiny", 256)), pc);
  ASSERT_GT(p.static_memory.staging, 0);
  // explain takes the flag and prints the same figure.
  const Result e = testing::shardlm("explain --model tiny --vocab 256 --ranks 2 --batch 2 --seq 32 --threads 1 --async-save");
  ASSERT_EQ(e.code, 0) << e.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(e.out, m, std::regex("  staging: static ([0-9]+),"))) << e.out;
  EXPECT_EQ(std::stoll(m[1]), p.static_memory.staging);
  for (const auto& row : testing::read_metrics(dir_ / "async" / "metrics.jsonl"))
    if (row.contains("loss")) {
      EXPECT_EQ(row["mem_between_steps"]["staging"].get<int64_t>(), p.static_memory.staging);
    }
  for (const auto& row : testing::read_metrics(dir_ / "straight" / "metrics.jsonl"))
    if (row.contains("loss")) {
      EXPECT_EQ(row["mem"]["staging"].get<int64_t>(), 0);
    }
  EXPECT_EQ(step_losses(dir_ / "async" / "metrics.jsonl"), step_losses(dir_ / "straight" / "metrics.jsonl"));
}

// Killed at the start of step 5 (0-based) while the save of step 4 may still be in flight:
// latest names a complete checkpoint (step 4 if its commit came first, else step 2), and the
// resumed run (asynchronous too) gives the uninterrupted losses bit for bit.
TEST_F(AsyncCheckpointSlow, ResumeFromAnAsyncCheckpointGivesTheUninterruptedLossesBitwise) {
  const Result part = mpirun(2, args("part", 6) + " --async-save", "-x SHARDLM_FAULT_KILL=0:5");
  ASSERT_NE(part.code, 0) << part.out;
  const std::string at = latest("part");
  EXPECT_TRUE(at == "step_4" || at == "step_2") << at;
  const Result r = mpirun(2, args("part", 6) + " --async-save --resume " + (dir_ / "part").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = step_losses(dir_ / "straight" / "metrics.jsonl"), b = step_losses(dir_ / "part" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);  // exact
}

TEST_F(AsyncCheckpointSlow, ARankKilledMidWriteLeavesLatestOnThePreviousCheckpoint) {
  expect_mid_write_kill_recovers("mid_sync", "");
}

TEST_F(AsyncCheckpointSlow, ARankKilledMidBackgroundWriteLeavesLatestOnThePreviousCheckpoint) {
  expect_mid_write_kill_recovers("mid_async", " --async-save");
}

// One line, from the rank whose write failed; every rank ends (no hang: the test returns);
// nothing of step 4 is committed.
TEST_F(AsyncCheckpointSlow, AFailedBackgroundWriteEndsEveryRankWithOneLine) {
  const Result r = mpirun(2, args("failed", 6) + " --async-save", "-x SHARDLM_FAULT_FAIL_WRITE=1:4");
  ASSERT_NE(r.code, 0) << r.out;
  size_t lines = 0;
  for (size_t at = 0; (at = r.out.find("shardlm: error:", at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 1u) << r.out;
  EXPECT_NE(r.out.find("checkpoint: write failed: injected"), std::string::npos) << r.out;
  EXPECT_EQ(latest("failed"), "step_2");
  EXPECT_FALSE(fs::exists(step("failed", 4)));
}

TEST_F(AsyncCheckpointSlow, AsyncSaveWithoutSaveEveryIsRefused) {
  const Result r = testing::shardlm("train --model tiny --data " + (dir_ / "tok").string() + " --out " +
                                    (dir_ / "refused").string() + " --steps 2 --async-save --quiet");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--async-save: needs --save-every"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "refused" / "metrics.jsonl"));
}

}  // namespace
}  // namespace shardlm
