// Runs that never lie, run as real processes: a non-finite loss or gradient norm stops
// the run before the optimizer applies it (or skips the update, up to K in a row) on one process
// and on 2 ranks; a checkpoint holding NaN is refused by eval and generate naming the tensor;
// SIGTERM / SIGINT / SIGUSR1 finish the step in progress, checkpoint it and exit non-zero, alone and under
// mpirun. Each case reproduces a failure of the engine before these checks (run the binary of an
// older build through SHARDLM_BINARY to see it).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "ckpt/sharded.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::read_metrics;
using testing::Result;
using testing::run_command;
using testing::shardlm;


class StopTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.seed = 3;
    runs_.create("stop");
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static std::string args(const std::string& out, int steps) { return runs_.args(out, steps); }
  // The step rows of a run's metrics.jsonl (every line must parse).
  static std::vector<nlohmann::json> steps_of(const std::string& out) {
    std::vector<nlohmann::json> rows;
    for (const auto& r : read_metrics(dir_ / out / "metrics.jsonl"))
      if (r.contains("loss")) rows.push_back(r);
    return rows;
  }
  // N of every DIR/ckpt/step_N, and whether any temporary checkpoint directory is left.
  static std::vector<int64_t> checkpoints(const std::string& out, bool* leftovers = nullptr) {
    std::vector<int64_t> steps;
    if (leftovers) *leftovers = false;
    if (!fs::exists(dir_ / out / "ckpt")) return steps;
    for (const auto& e : fs::directory_iterator(dir_ / out / "ckpt")) {
      const std::string name = e.path().filename().string();
      if (name.find(".tmp") != std::string::npos) {
        if (leftovers) *leftovers = true;
      } else if (name.rfind("step_", 0) == 0) {
        steps.push_back(std::stoll(name.substr(5)));
      }
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// The stop line: one line naming the step and what was non-finite; the metrics end at that step;
// no checkpoint is written from it on.
void expect_stopped_at_nonfinite(const Result& r, const std::vector<nlohmann::json>& rows,
                                 const std::vector<int64_t>& ckpts) {
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "non-finite")) << r.out;
  EXPECT_TRUE(contains(r.out, "stopped before the optimizer applied it")) << r.out;
  ASSERT_FALSE(rows.empty());
  const int64_t bad = rows.back()["step"].get<int64_t>();
  EXPECT_TRUE(contains(r.out, "step " + std::to_string(bad) + ": non-finite")) << r.out;
  EXPECT_TRUE(rows.back()["loss"].is_null() || rows.back()["grad_norm"].is_null()) << rows.back().dump();
  for (size_t i = 0; i + 1 < rows.size(); ++i) EXPECT_TRUE(rows[i]["loss"].is_number()) << rows[i].dump();
  // step_N holds the state after N steps: step `bad` was never applied, so nothing beyond it.
  for (int64_t c : ckpts) EXPECT_LE(c, bad) << "checkpoint step_" << c << " saved after the non-finite step " << bad;
}

TEST_F(StopTest, InfiniteLearningRateIsRefused) {
  const Result r = shardlm(args("lr_inf", 3) + " --lr inf");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "lr")) << r.out;
  EXPECT_TRUE(contains(r.out, "finite")) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "lr_inf" / "metrics.jsonl"));
}

TEST_F(StopTest, HugeLearningRateStopsBeforeTheUpdateAndSavesNothingPoisoned) {
  const Result r = shardlm(args("lr_huge", 8) + " --lr 1e9 --save-every 1");
  const auto rows = steps_of("lr_huge");
  expect_stopped_at_nonfinite(r, rows, checkpoints("lr_huge"));
  EXPECT_TRUE(contains(r.out, "rank 0")) << r.out;
  EXPECT_LT(rows.size(), 8u) << "the run went on after the non-finite step";
  // What was saved before the stop holds finite values, but the last one may be weights that
  // overflow in the forward (the stop was found by running them): eval gives a number or refuses,
  // never prints NaN with exit 0.
  for (int64_t c : checkpoints("lr_huge")) {
    const Result e = shardlm("eval --ckpt " + (dir_ / "lr_huge" / "ckpt" / ("step_" + std::to_string(c))).string() +
                             " --data " + (dir_ / "tok_val.bin").string() + " --seq 32 --batch 2 --threads 1");
    if (e.code == 0) {
      EXPECT_FALSE(contains(e.out, "nan")) << e.out;
    }
    else EXPECT_TRUE(contains(e.out, "not finite")) << e.out;
  }
}

TEST_F(StopTest, SkipModeCountsSkippedUpdatesAndStopsAfterKInARow) {
  const Result r = shardlm(args("skip", 20) + " --lr 1e9 --on-nonfinite skip --max-skipped-steps 3 --save-every 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "3 updates skipped in a row")) << r.out;
  const auto rows = steps_of("skip");
  ASSERT_GE(rows.size(), 3u);
  ASSERT_LT(rows.size(), 20u) << "the run went on past 3 skipped steps";
  int64_t skipped = 0;
  for (const auto& row : rows) {
    skipped += row["skipped"].get<bool>();
    EXPECT_EQ(row["skipped_steps"].get<int64_t>(), skipped) << row.dump();
  }
  EXPECT_EQ(skipped, 3);
  for (size_t i = rows.size() - 3; i < rows.size(); ++i) EXPECT_TRUE(rows[i]["skipped"].get<bool>());
  // The schedule advanced over the skipped steps (the cosine decays with the step).
  EXPECT_LT(rows.back()["lr"].get<double>(), rows[rows.size() - 3]["lr"].get<double>());
  // The checkpoint after the first skipped step: the step advanced, AdamW's count did not.
  const int64_t first_skip = rows[rows.size() - 3]["step"].get<int64_t>();
  std::ifstream f(dir_ / "skip" / "ckpt" / ("step_" + std::to_string(first_skip + 1)) / "index.json");
  ASSERT_TRUE(f) << "no checkpoint after the first skipped step";
  const auto state = nlohmann::json::parse(f);
  EXPECT_EQ(state["step"].get<int64_t>(), first_skip + 1);
  EXPECT_EQ(state["optimizer"]["adamw_step"].get<int64_t>(), first_skip);
}

// One NaN step (rank 0's loss at step 2) in skip mode: its update is dropped, the run goes on to
// its end and exits 0, and AdamW counted one update fewer than the steps.
TEST_F(StopTest, SkipModeCarriesOnAfterASingleNonFiniteStep) {
  const Result r = run_command("SHARDLM_FAULT_NAN_LOSS=0:2 " + testing::shardlm_binary() + " " + args("skip_once", 5) +
                           " --on-nonfinite skip --save-every 5");
  EXPECT_EQ(r.code, 0) << r.out;
  const auto rows = steps_of("skip_once");
  ASSERT_EQ(rows.size(), 5u);
  for (const auto& row : rows) EXPECT_EQ(row["skipped"].get<bool>(), row["step"].get<int64_t>() == 2) << row.dump();
  EXPECT_EQ(rows.back()["skipped_steps"].get<int64_t>(), 1);
  EXPECT_TRUE(rows.back()["loss"].is_number());
  std::ifstream f(dir_ / "skip_once" / "ckpt" / "step_5" / "index.json");
  ASSERT_TRUE(f);
  EXPECT_EQ(nlohmann::json::parse(f)["optimizer"]["adamw_step"].get<int64_t>(), 4);
}

// Writes NaN over the first element of `tensor` in a safetensors file.
void poison(const fs::path& file, const std::string& tensor) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, ' ');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  const auto j = nlohmann::json::parse(header);
  const int64_t at = 8 + static_cast<int64_t>(header_len) + j.at(tensor).at("data_offsets")[0].get<int64_t>();
  const float nan = std::nanf("");
  f.seekp(at);
  f.write(reinterpret_cast<const char*>(&nan), 4);
}

TEST_F(StopTest, EvalGenerateAndResumeRefuseANonFiniteCheckpointNamingTheTensor) {
  ASSERT_EQ(shardlm(args("poisoned", 2) + " --save-every 2").code, 0);
  const fs::path ckpt = dir_ / "poisoned" / "ckpt" / "step_2";
  // As an older build without the guard would have saved it: the file's checksum in index.json
  // matches, so the load itself must find the NaN.
  const fs::path file = ckpt / "rank-00000-of-00001.safetensors";
  poison(file, "param/h.0.attn.c_attn.weight");
  nlohmann::json index = nlohmann::json::parse(std::ifstream(ckpt / "index.json"));
  index["files"][0]["xxh64"] = ckpt::hex64(ckpt::summarize_file(file.string()).xxh64);
  std::ofstream(ckpt / "index.json") << index.dump();
  const std::string tensor = "'h.0.attn.c_attn.weight'";
  const Result e = shardlm("eval --ckpt " + ckpt.string() + " --data " + (dir_ / "tok_val.bin").string() +
                           " --seq 32 --batch 2 --threads 1");
  EXPECT_NE(e.code, 0) << e.out;
  EXPECT_TRUE(contains(e.out, tensor) && contains(e.out, "non-finite")) << e.out;
  const Result g = shardlm("generate --ckpt " + ckpt.string() + " --tokens 4 --threads 1");
  EXPECT_NE(g.code, 0) << g.out;
  EXPECT_TRUE(contains(g.out, tensor)) << g.out;
  const Result r = shardlm(args("poisoned_resumed", 2) + " --resume " + ckpt.string());
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, tensor)) << r.out;
}

class StopSlow : public StopTest {};

// Under fsdp and ddp on 2 ranks every rank stops at the same step, before the update.
TEST_F(StopSlow, HugeLearningRateStopsEveryRankUnderFsdpAndDdp) {
  for (const std::string strategy : {"fsdp", "ddp"}) {
    const std::string out = "lr_huge_" + strategy;
    const Result r = mpirun(2, args(out, 8) + " --lr 1e9 --save-every 1 --timeout 60 --strategy " + strategy);
    expect_stopped_at_nonfinite(r, steps_of(out), checkpoints(out));
    EXPECT_TRUE(contains(r.out, "ranks 0, 1")) << r.out;
  }
}

// A NaN loss on rank 1 alone (gradients finite): both ranks learn it before their optimizer runs,
// stop together (no rank left waiting in a collective) and name rank 1.
TEST_F(StopSlow, ANonFiniteLossOnOneRankStopsEveryRankNamingIt) {
  const Result r = mpirun(2, args("nan_rank1", 6) + " --save-every 1 --timeout 60", "-x SHARDLM_FAULT_NAN_LOSS=1:2");
  expect_stopped_at_nonfinite(r, steps_of("nan_rank1"), checkpoints("nan_rank1"));
  EXPECT_TRUE(contains(r.out, "step 2: non-finite loss on rank 1")) << r.out;
  EXPECT_FALSE(contains(r.out, "gradient norm")) << r.out;
  EXPECT_EQ(checkpoints("nan_rank1").back(), 2);
}

// Starts `command` in the background, waits until the run's metrics hold `rows` step rows, runs
// `kill` (on $pid, e.g. "kill -TERM $pid") and returns the command's exit status and output.
Result signal_after(const std::string& command, const fs::path& metrics, int rows, const std::string& kill) {
  const std::string script = command + " > " + metrics.parent_path().string() + ".log 2>&1 & pid=$!\n" +
                             "while kill -0 $pid 2>/dev/null && [ \"$(cat " + metrics.string() +
                             " 2>/dev/null | grep -c '\"loss\"')\" -lt " + std::to_string(rows) + " ]; do sleep 0.1; done\n" +
                             kill + "\nwait $pid\ncode=$?\ncat " + metrics.parent_path().string() +
                             ".log\nexit $code\n";
  const fs::path file = metrics.parent_path().string() + ".sh";
  std::ofstream(file) << script;
  return run_command("sh " + file.string());
}

// After a stop signal: the last step row is the last step run, its checkpoint exists (saved
// although not a multiple of --save-every), no temporary directory is left, the exit is non-zero.
void expect_stopped_by_signal(const Result& r, const std::vector<nlohmann::json>& rows,
                              const std::vector<int64_t>& ckpts, bool leftovers, int code, const fs::path& out) {
  EXPECT_EQ(r.code, code) << r.out;
  EXPECT_TRUE(contains(r.out, "stopped by signal")) << r.out;
  ASSERT_FALSE(rows.empty()) << r.out;
  const int64_t done = rows.back()["step"].get<int64_t>() + 1;
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i]["step"].get<int64_t>(), static_cast<int64_t>(i));
  ASSERT_FALSE(ckpts.empty()) << r.out;
  EXPECT_EQ(ckpts.back(), done) << r.out;
  EXPECT_FALSE(leftovers);
  std::ifstream f(out / "ckpt" / ("step_" + std::to_string(done)) / "index.json");
  ASSERT_TRUE(f);
  EXPECT_EQ(nlohmann::json::parse(f)["step"].get<int64_t>(), done);
}

// SIGUSR1 too: Slurm's --signal=USR1@SECONDS sends it ahead of a job's time limit; its default
// action ended the run with nothing saved.
TEST_F(StopSlow, SigtermSigintAndSigusr1FinishTheStepCheckpointAndExitNonZero) {
  for (const auto& [sig, code] : {std::pair<const char*, int>{"TERM", 143}, {"INT", 130}, {"USR1", 138}}) {
    const std::string out = std::string("signal_") + sig;
    // Finite, so that a binary ignoring the signal (a background job ignores SIGINT) ends anyway.
    const Result r = signal_after(testing::shardlm_binary() + " " + args(out, 20000) + " --save-every 100000",
                                  dir_ / out / "metrics.jsonl", 3, std::string("kill -") + sig + " $pid");
    bool leftovers = true;
    const auto ckpts = checkpoints(out, &leftovers);
    expect_stopped_by_signal(r, steps_of(out), ckpts, leftovers, code, dir_ / out);
  }
}

// A second signal ends the process at once: no stop line, no checkpoint. Both signals are made
// pending while the process is stopped, so the second arrives before any step can finish.
TEST_F(StopSlow, ASecondSignalEndsAtOnce) {
  const std::string out = "signal_twice";
  const Result r = signal_after(testing::shardlm_binary() + " " + args(out, 20000) + " --save-every 100000",
                                dir_ / out / "metrics.jsonl", 3,
                                "kill -STOP $pid; kill -INT $pid; kill -TERM $pid; kill -CONT $pid");
  EXPECT_TRUE(r.code == 130 || r.code == 143) << r.out;
  EXPECT_FALSE(contains(r.out, "stopped by signal")) << r.out;
  EXPECT_TRUE(checkpoints(out).empty()) << r.out;
}

// mpirun, on SIGTERM, waits odls_base_sigkill_timeout seconds (1 by default), sends SIGTERM to
// the ranks, waits as long again and sends SIGKILL; raised, the ranks agree on a step, checkpoint
// it and exit.
// mpirun forwards SIGUSR1 to the ranks as it is.
TEST_F(StopSlow, SigtermAndSigusr1UnderMpirunCheckpointTheAgreedStep) {
  for (const std::string sig : {"TERM", "USR1"}) {
    const std::string out = "signal_mpirun_" + sig;
    const testing::MpiSession session;
    const std::string cmd = session.env() + "mpirun --oversubscribe -np 2 --mca odls_base_sigkill_timeout 10 " +
                            testing::shardlm_binary() + " " + args(out, 1000000) +
                            " --save-every 100000 --timeout 60 --strategy fsdp";
    const Result r = signal_after(cmd, dir_ / out / "metrics.jsonl", 3, "kill -" + sig + " $pid");
    bool leftovers = true;
    const auto ckpts = checkpoints(out, &leftovers);
    EXPECT_NE(r.code, 0) << r.out;
    expect_stopped_by_signal(r, steps_of(out), ckpts, leftovers, r.code, dir_ / out);
  }
}

// A rank that fails ends the job by MPI_Abort; the survivors, signalled by mpirun, cannot agree
// on a step without it, so no checkpoint is written after the failure. The timeout also bounds
// the start-up's waits on rank 0's run directory (its lock is fdatasync'ed): 8 s once ran out there
// on a loaded machine, before the fault.
TEST_F(StopSlow, AJobEndedByAFailedRankWritesNoCheckpoint) {
  const Result r = mpirun(2, args("aborted", 8) + " --save-every 1 --timeout 20", "-x SHARDLM_FAULT_SKIP_COLLECTIVE=1:2");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "step 2")) << r.out;
  bool leftovers = true;
  const auto ckpts = checkpoints("aborted", &leftovers);
  ASSERT_FALSE(ckpts.empty());
  EXPECT_EQ(ckpts.back(), 2) << r.out;
}

}  // namespace
}  // namespace shardlm
