// Runs that never lie, as real processes: the run directory belongs to one run at a time and
// holds only that run's record; ranks started with different settings end with one line naming
// the setting and the ranks; a resumed run is the saved run unless told otherwise. Each case is
// a failure the engine once let through (exit 0, or a crash), reproduced and now refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "data/shard.h"
#include "run/test_util.h"
#include "train/agreement.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::Result;
using testing::run_command;
using testing::shardlm;

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Every line of metrics.jsonl parses; the training rows' step numbers in file order.
std::vector<int64_t> train_steps(const fs::path& metrics) {
  std::vector<int64_t> steps;
  std::ifstream f(metrics);
  for (std::string line; std::getline(f, line);) {
    const auto row = nlohmann::json::parse(line);  // throws on a half-written line
    if (row.contains("loss")) steps.push_back(row["step"].get<int64_t>());
  }
  return steps;
}

// Fails with one "shardlm: error" line (mpirun may add its own banner) holding every needle.
void expect_one_error(const Result& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "shardlm: error"), 1) << r.out;
  for (const auto& n : needles) EXPECT_NE(r.out.find(n), std::string::npos) << "expected '" << n << "' in:\n" << r.out;
  for (const char* crash : {"corrupted", "signal", "Segmentation", "bad_alloc"})
    EXPECT_EQ(r.out.find(crash), std::string::npos) << r.out;
}

class RunSafety : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.seed = 5;
    runs_.warmup = 1;
    runs_.create("safety");
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }

  static std::string args(const std::string& out, int steps, int batch = 2) { return runs_.args(out, steps, batch); }
  static std::string ckpt(const std::string& out, int step) {
    return (dir_ / out / "ckpt" / ("step_" + std::to_string(step))).string();
  }
  // `mpirun -np 1 shardlm A : -np 1 shardlm B`: two ranks started with different command lines.
  static Result mpmd(const std::string& a, const std::string& b) {
    const std::string bin = testing::shardlm_binary();
    const testing::MpiSession session;
    return run_command(session.env() + "mpirun --oversubscribe -np 1 " + bin + " " + a + " : -np 1 " + bin + " " + b);
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

// ---- run directory ----

// Two runs on one --out used to both exit 0 with interleaved metrics. The second now fails at
// once naming the first's pid; once the first is killed (SIGKILL: no clean-up of its own) the
// kernel has released the lock and a new run may take the directory.
TEST_F(RunSafety, SecondRunOnTheSameOutFailsNamingTheHoldersPid) {
  const std::string cmd = "exec " + testing::shardlm_binary() + " " + args("busy", 1000000) + " >/dev/null 2>&1";
  const pid_t first = ::fork();
  ASSERT_GE(first, 0);
  if (first == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const std::string holder = "pid " + std::to_string(first) + " ";
  bool locked = false;
  for (int i = 0; i < 1200 && !locked; ++i) {  // up to a minute for the first run to start
    locked = read_file(dir_ / "busy" / ".lock").rfind(holder, 0) == 0;
    if (!locked) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const Result second = locked ? shardlm(args("busy", 2) + " --overwrite") : Result{-1, "first run never locked"};
  ::kill(first, SIGKILL);
  int status = 0;
  ::waitpid(first, &status, 0);
  ASSERT_TRUE(locked) << read_file(dir_ / "busy" / ".lock");
  expect_one_error(second, {"in use by another run", holder, (dir_ / "busy").string()});
  const Result third = shardlm(args("busy", 2) + " --overwrite");
  ASSERT_EQ(third.code, 0) << third.out;
  EXPECT_EQ(train_steps(dir_ / "busy" / "metrics.jsonl"), (std::vector<int64_t>{0, 1}));
}

// A new run into a directory holding a run used to truncate its metrics and mix checkpoints.
TEST_F(RunSafety, DirectoryHoldingARunIsRefusedUnlessOverwriteOrResume) {
  ASSERT_EQ(shardlm(args("held", 4) + " --save-every 2").code, 0);
  const std::string before = read_file(dir_ / "held" / "metrics.jsonl");
  expect_one_error(shardlm(args("held", 2)), {"holds a run", "--overwrite", "--resume"});
  EXPECT_EQ(read_file(dir_ / "held" / "metrics.jsonl"), before) << "a refused run changed the old run's record";
  EXPECT_TRUE(fs::exists(ckpt("held", 4)));

  const Result resumed = shardlm(args("held", 4) + " --resume " + ckpt("held", 2));
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_EQ(train_steps(dir_ / "held" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3}));

  ASSERT_EQ(shardlm(args("held", 3) + " --overwrite").code, 0);  // no --save-every: no ckpt/ of its own
  EXPECT_EQ(train_steps(dir_ / "held" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_FALSE(fs::exists(dir_ / "held" / "ckpt")) << "the old run's checkpoints outlived --overwrite";

  // Resuming another directory's checkpoint into it would mix two runs: refused, or replaced.
  ASSERT_EQ(shardlm(args("other", 4) + " --save-every 2").code, 0);
  expect_one_error(shardlm(args("held", 4) + " --resume " + ckpt("other", 2)), {"holds a run", "not the run --resume"});
  ASSERT_EQ(shardlm(args("held", 4) + " --resume " + ckpt("other", 2) + " --overwrite").code, 0);
  EXPECT_EQ(train_steps(dir_ / "held" / "metrics.jsonl"), (std::vector<int64_t>{2, 3}));
}

// A run killed before its first checkpoint or snapshot, relaunched with --resume auto, used to be
// told "a new run" and then refused ("holds a run"): a restart loop could never restart it.
// DIR/run.json says the run DIR holds is this one, so the relaunch starts it over from step 0 and
// finishes with the losses of a run never killed. A directory holding another run (other
// settings, or no run.json saying whose it is) is still refused, and left as it was.
TEST_F(RunSafety, ResumeAutoRestartsARunKilledBeforeItsFirstSave) {
  const std::string a = args("early", 6) + " --save-every 100 --snapshot-every 100";
  const Result killed = run_command("SHARDLM_FAULT_KILL=0:3 " + testing::shardlm_binary() + " " + a);
  ASSERT_NE(killed.code, 0) << killed.out;
  ASSERT_EQ(train_steps(dir_ / "early" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2}));
  const Result restarted = shardlm(a + " --resume auto");
  ASSERT_EQ(restarted.code, 0) << restarted.out;
  EXPECT_NE(restarted.out.find("restarts from step 0"), std::string::npos) << restarted.out;
  EXPECT_EQ(train_steps(dir_ / "early" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  ASSERT_EQ(shardlm(args("never_killed", 6)).code, 0);
  EXPECT_EQ(testing::step_losses(dir_ / "early" / "metrics.jsonl"),
            testing::step_losses(dir_ / "never_killed" / "metrics.jsonl"));

  const std::string before = read_file(dir_ / "early" / "metrics.jsonl");
  expect_one_error(shardlm(args("early", 6) + " --seed 99 --resume auto"), {"holds another run", "seed is 99", "--overwrite"});
  fs::remove(dir_ / "early" / "run.json");  // as an older shardlm's run directory, or another program's
  expect_one_error(shardlm(a + " --resume auto"), {"holds a run", "run.json", "--overwrite"});
  EXPECT_EQ(read_file(dir_ / "early" / "metrics.jsonl"), before);
}

// The run directory is taken (and whose run it holds read) before the resume's checkpoint is
// checked: a start refused there leaves no --out directory it made behind, as before.
TEST_F(RunSafety, AStartRefusedAtItsResumeCheckLeavesNoNewDirectory) {
  expect_one_error(shardlm(args("never_made", 2) + " --resume " + (dir_ / "no_such_run").string()),
                   {"no_such_run"});
  EXPECT_FALSE(fs::exists(dir_ / "never_made"));
}

// A run.json that does not say whose the directory is (damaged, or another program's) is refused
// with one line naming it, and left as it was; --overwrite replaces the run, and the record.
TEST_F(RunSafety, AnUnreadableRunRecordIsRefusedUnlessOverwrite) {
  ASSERT_EQ(shardlm(args("bad_record", 2)).code, 0);
  const fs::path record = dir_ / "bad_record" / "run.json";
  { std::ofstream(record) << "{\"run_id\": 7}"; }
  expect_one_error(shardlm(args("bad_record", 2) + " --resume auto"), {record.string(), "not a run record", "--overwrite"});
  EXPECT_EQ(read_file(record), "{\"run_id\": 7}");
  ASSERT_EQ(shardlm(args("bad_record", 2) + " --overwrite").code, 0);
  EXPECT_EQ(nlohmann::json::parse(read_file(record))["run_id"].get<std::string>().size(), 32u);
}

// A resume used to append after the old run's later steps: step numbers appeared twice. Now the
// log is cut back to the resumed step (an evaluation at that step stays: it belongs to the saved
// run), a half line a killed run left is dropped, and the resumed steps are bitwise the old ones.
TEST_F(RunSafety, ResumeCutsMetricsAfterTheResumedStep) {
  ASSERT_EQ(shardlm(args("cut", 6) + " --save-every 2 --eval-every 2").code, 0);
  const auto original = testing::step_losses(dir_ / "cut" / "metrics.jsonl");
  ASSERT_EQ(original.size(), 6u);
  std::ofstream(dir_ / "cut" / "metrics.jsonl", std::ios::app) << "{\"step\": 6, \"loss\": 1.2";  // killed mid-line
  const Result r = shardlm(args("cut", 6) + " --save-every 2 --eval-every 2 --resume " + ckpt("cut", 4));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(train_steps(dir_ / "cut" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(testing::step_losses(dir_ / "cut" / "metrics.jsonl"), original);
  std::vector<int64_t> evals;
  for (const auto& row : testing::read_metrics(dir_ / "cut" / "metrics.jsonl"))
    if (row.contains("val_loss")) evals.push_back(row["step"].get<int64_t>());
  EXPECT_EQ(evals, (std::vector<int64_t>{2, 4, 6}));
  for (const auto& e : fs::directory_iterator(dir_ / "cut"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

// A run killed while writing a checkpoint leaves ckpt/step_N.tmp-PID behind; no run removed it.
TEST_F(RunSafety, LeftoverTemporaryCheckpointsAreRemoved) {
  ASSERT_EQ(shardlm(args("left", 4) + " --save-every 2").code, 0);
  for (const char* dead : {"step_4.tmp-999999", "step_2.old-999998"}) {
    fs::create_directories(dir_ / "left" / "ckpt" / dead);
    std::ofstream(dir_ / "left" / "ckpt" / dead / "model.safetensors") << "half";
  }
  std::ofstream(dir_ / "left" / "ckpt" / "latest.tmp-999997") << "step_";
  fs::create_directories(dir_ / "left" / "ckpt" / "keep.tmp-1");  // not a checkpoint's: left alone
  const Result r = shardlm(args("left", 4) + " --save-every 2 --resume " + ckpt("left", 2));
  ASSERT_EQ(r.code, 0) << r.out;
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_ / "left" / "ckpt")) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"step_2", "step_4", "latest", "keep.tmp-1"}));
}

// A disk-full metrics.jsonl used to be ignored: exit 0 with the log cut mid-line.
TEST_F(RunSafety, FailedMetricsWriteStopsTheRunWithTheReason) {
  fs::create_directories(dir_ / "full");
  fs::create_symlink("/dev/full", dir_ / "full" / "metrics.jsonl");  // every write: ENOSPC
  expect_one_error(shardlm(args("full", 3)), {"metrics.jsonl", "No space left on device"});
}

// A trace that cannot be written ends the run naming it and the reason, and leaves no .tmp.
TEST_F(RunSafety, FailedTraceWriteStopsTheRunWithTheReason) {
  // A 4 KiB file size limit (SIGXFSZ ignored, so the write fails with EFBIG): metrics.jsonl of
  // two steps fits, the trace does not.
  const fs::path trace = dir_ / "tr" / "trace.json";
  const Result r = run_command("bash -c \"trap '' XFSZ; ulimit -f 4; exec " + testing::shardlm_binary() + " " +
                               args("tr", 2) + " --trace " + trace.string() + "\"");
  expect_one_error(r, {trace.string(), "File too large"});
  EXPECT_FALSE(fs::exists(trace.string() + ".tmp"));
}

// ---- ckpt export and import never destroy what they did not write ----

// `ckpt export --out DIR` and `ckpt import --out DIR` replaced whatever DIR held without a word (a
// run directory, a checkpoint, a data directory), and `import --in X --out X` deleted its own
// source. An existing non-empty --out is now refused unless --overwrite, and an --out that
// overlaps what the command reads is refused even then.
TEST_F(RunSafety, ExportAndImportNeverReplaceWhatTheyWereNotToldTo) {
  ASSERT_EQ(shardlm(args("victim", 2) + " --save-every 2").code, 0);
  const std::string metrics = read_file(dir_ / "victim" / "metrics.jsonl");
  const std::string victim = (dir_ / "victim").string();
  auto intact = [&] {
    EXPECT_EQ(read_file(dir_ / "victim" / "metrics.jsonl"), metrics);
    EXPECT_TRUE(fs::exists(ckpt("victim", 2) + "/index.json"));
  };
  const std::string exp = "ckpt export --ckpt " + victim + " --out ";
  expect_one_error(shardlm(exp + victim), {"--out " + victim, "is the same directory as --ckpt"});
  expect_one_error(shardlm(exp + victim + " --overwrite"), {"--out " + victim, "--ckpt"});
  expect_one_error(shardlm(exp + dir_.string() + " --overwrite"), {"--out " + dir_.string(), "holds --ckpt"});
  expect_one_error(shardlm(exp + ckpt("victim", 2) + "/hf"), {"lies inside --ckpt"});
  intact();

  // An unrelated directory: refused while it holds anything, replaced with --overwrite.
  const fs::path mine = dir_ / "mine";
  fs::create_directories(mine);
  std::ofstream(mine / "notes.txt") << "keep me";
  expect_one_error(shardlm(exp + mine.string()), {"--out " + mine.string(), "not empty", "--overwrite"});
  EXPECT_EQ(read_file(mine / "notes.txt"), "keep me");
  fs::create_directories(dir_ / "empty_out");
  ASSERT_EQ(shardlm(exp + (dir_ / "empty_out").string()).code, 0);  // an empty directory is taken
  EXPECT_TRUE(fs::exists(dir_ / "empty_out" / "model.safetensors"));
  const Result replaced = shardlm(exp + mine.string() + " --overwrite");
  ASSERT_EQ(replaced.code, 0) << replaced.out;
  EXPECT_FALSE(fs::exists(mine / "notes.txt"));
  EXPECT_TRUE(fs::exists(mine / "model.safetensors"));

  // import: --in and --out the same directory however spelled (`..`, a symlink), or nested.
  const std::string hf = (dir_ / "empty_out").string();
  fs::create_symlink(dir_ / "empty_out", dir_ / "alias");
  for (const std::string& out : {hf, hf + "/../empty_out", (dir_ / "alias").string(), hf + "/sub"}) {
    SCOPED_TRACE(out);
    expect_one_error(shardlm("ckpt import --in " + hf + " --out " + out + " --overwrite"), {"--out " + out, "--in " + hf});
  }
  expect_one_error(shardlm("ckpt import --in " + (dir_ / "alias").string() + " --out " + hf), {"--out " + hf});
  EXPECT_TRUE(fs::exists(dir_ / "empty_out" / "model.safetensors"));
  expect_one_error(shardlm("ckpt import --in " + hf + " --out " + victim), {"--out " + victim, "not empty"});
  intact();

  // With --overwrite the old directory goes only once the new one is complete: an import that
  // fails (its weights are missing a tensor) leaves it as it was.
  const fs::path broken = dir_ / "broken_hf";
  fs::create_directories(broken);
  fs::copy_file(dir_ / "empty_out" / "config.json", broken / "config.json");
  std::ofstream(broken / "model.safetensors") << std::string(8, '\0');
  const Result failed = shardlm("ckpt import --in " + broken.string() + " --out " + ckpt("victim", 2) + " --overwrite");
  EXPECT_NE(failed.code, 0) << failed.out;
  intact();
  EXPECT_EQ(shardlm("ckpt import --in " + hf + " --out " + (dir_ / "imported").string()).code, 0);
}

// `ckpt export --out LINK`, LINK a symbolic link to an empty directory, passed the checks, did
// all the work and then failed to rename the result onto the link; with --overwrite it replaced
// the link with a directory. Either is refused now before anything is read or written, as import's.
TEST_F(RunSafety, ExportAndImportRefuseAnOutThatIsALink) {
  ASSERT_EQ(shardlm(args("linked", 2) + " --save-every 2").code, 0);
  fs::create_directories(dir_ / "link_target");
  const fs::path link = dir_ / "out_link";
  fs::create_directory_symlink(dir_ / "link_target", link);
  const std::string exp = "ckpt export --ckpt " + (dir_ / "linked").string() + " --out " + link.string();
  for (const char* flags : {"", " --overwrite", " --format llmc --overwrite"}) {
    SCOPED_TRACE(flags);
    expect_one_error(shardlm(exp + flags), {"--out " + link.string(), "symbolic link"});
  }
  const fs::path hf = dir_ / "linked_hf";
  ASSERT_EQ(shardlm("ckpt export --ckpt " + (dir_ / "linked").string() + " --out " + hf.string()).code, 0);
  expect_one_error(shardlm("ckpt import --in " + hf.string() + " --out " + link.string()), {"--out " + link.string(), "symbolic link"});
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::is_empty(dir_ / "link_target"));
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find("out_link."), std::string::npos) << e.path() << " was left behind";
}

// `ckpt import` copied a Hugging Face directory's tokenizer files unread: a broken vocab.json
// surfaced only at the first generate, and a tokenizer.json linked to a file elsewhere (any file
// the user can read) was copied into the checkpoint. Each is one line at import now, naming the
// file, and nothing is written; a link that stays inside --in is followed.
TEST_F(RunSafety, ImportChecksTheTokenizerFilesItCopies) {
  ASSERT_EQ(shardlm(args("tok_src", 2) + " --save-every 2").code, 0);
  const fs::path hf = dir_ / "tok_hf";
  ASSERT_EQ(shardlm("ckpt export --ckpt " + (dir_ / "tok_src").string() + " --out " + hf.string()).code, 0);
  // GPT-2's files by Hugging Face's names, as a GPT-2 directory holds them (the tiny model's own
  // tokenizer is bytes, which has none).
  const char* data_env = std::getenv("SHARDLM_DATA_DIR");
  const fs::path gpt2 = fs::path(data_env && *data_env ? data_env : std::string(std::getenv("SHARDLM_SOURCE_DIR")) + "/data") / "gpt2";
  ASSERT_TRUE(fs::exists(gpt2 / "encoder.json")) << gpt2 << ": scripts/fetch_data.sh fetches it";
  fs::copy_file(gpt2 / "encoder.json", hf / "vocab.json");
  fs::copy_file(gpt2 / "vocab.bpe", hf / "merges.txt");
  const auto variant = [&](const std::string& name, const std::function<void(const fs::path&)>& change) {
    const fs::path d = dir_ / name;
    fs::copy(hf, d, fs::copy_options::recursive);
    change(d);
    return d;
  };
  const auto import_of = [&](const fs::path& in) {
    return shardlm("ckpt import --in " + in.string() + " --out " + (dir_ / (in.filename().string() + "_ckpt")).string());
  };
  const auto refused = [&](const fs::path& in, const std::string& file, const std::string& why) {
    SCOPED_TRACE(in.string());
    expect_one_error(import_of(in), {(in / file).string(), why});
    EXPECT_FALSE(fs::exists(dir_ / (in.filename().string() + "_ckpt")));
  };
  refused(variant("broken_vocab", [](const fs::path& d) { std::ofstream(d / "vocab.json", std::ios::trunc) << "{\"a\": "; }),
          "vocab.json", "vocab.json");
  refused(variant("broken_merges", [](const fs::path& d) { std::ofstream(d / "merges.txt", std::ios::trunc) << "#version: 0.2\nnot-a-pair\n"; }),
          "merges.txt", "merges.txt");
  refused(variant("broken_tokenizer_json", [](const fs::path& d) { std::ofstream(d / "tokenizer.json") << "{}"; }),
          "tokenizer.json", "tokenizer.json");
  // A good tokenizer file, but another directory's: through a relative link with `..`, and an absolute one.
  fs::copy_file(hf / "merges.txt", dir_ / "elsewhere_merges.txt");
  refused(variant("linked_out", [](const fs::path& d) {
            fs::remove(d / "merges.txt");
            fs::create_symlink("../elsewhere_merges.txt", d / "merges.txt");
          }),
          "merges.txt", "outside --in");
  refused(variant("linked_abs", [&](const fs::path& d) {
            fs::remove(d / "vocab.json");
            fs::create_symlink(dir_ / "tok_hf" / "vocab.json", d / "vocab.json");
          }),
          "vocab.json", "outside --in");
  const fs::path inside = variant("linked_in", [](const fs::path& d) {
    fs::rename(d / "vocab.json", d / "the_vocab.json");
    fs::create_symlink("the_vocab.json", d / "vocab.json");
  });
  const Result ok = import_of(inside);
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_EQ(read_file(dir_ / "linked_in_ckpt" / "vocab.json"), read_file(hf / "vocab.json"));
}

// Resuming a checkpoint past --steps (--resume-override steps lowered it) trained nothing and
// exited 0 as if the run had been continued. It is now one line naming the checkpoint's step and
// --steps; at --steps (a complete run restarted) it still exits 0.
TEST_F(RunSafety, ResumeBeyondStepsIsRefused) {
  ASSERT_EQ(shardlm(args("done", 2) + " --save-every 2").code, 0);
  const std::string before = read_file(dir_ / "done" / "metrics.jsonl");
  expect_one_error(shardlm(args("done", 1) + " --resume-override steps --resume " + ckpt("done", 2)),
                   {ckpt("done", 2) + "/index.json", "field 'step' is 2, beyond --steps 1", "--resume-override steps"});
  EXPECT_EQ(read_file(dir_ / "done" / "metrics.jsonl"), before);
  const Result more = shardlm(args("done", 3) + " --resume-override steps --resume " + ckpt("done", 2));
  ASSERT_EQ(more.code, 0) << more.out;
  EXPECT_EQ(train_steps(dir_ / "done" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2}));
}

// ---- ranks agree ----

// Ranks started with different settings used to die of heap corruption (--n-layer under fsdp) or
// train to exit 0 with inconsistent replicas (--seed, --lr, --batch). Now: one line naming the
// setting and each rank's value, every rank ends, nothing crashes.
TEST_F(RunSafety, RanksWithDifferentSettingsEndWithOneLineNamingFieldAndRanks) {
  const std::string a = args("agree", 2) + " --strategy fsdp";
  struct Case {
    std::string flag, expected;
  };
  for (const Case& c : {Case{" --n-layer 3", "n-layer (0 on rank 0, 3 on rank 1)"},
                        Case{" --seed 9", "seed (5 on rank 0, 9 on rank 1)"},
                        Case{" --lr 0.01", "lr (0.0006 on rank 0, 0.01 on rank 1)"},
                        Case{" --batch 3", "batch (2 on rank 0, 3 on rank 1)"}}) {
    SCOPED_TRACE(c.flag);
    expect_one_error(mpmd(a, a + c.flag), {"ranks disagree on settings", c.expected});
  }
}

// What is a process's own (threads, console, the path it reaches the run directory by) may
// differ: rank 1's --out is a link to rank 0's (as a shared filesystem mounted elsewhere).
TEST_F(RunSafety, RanksMayDifferInThreadsQuietAndOutputPath) {
  const std::string a = args("own", 2);
  fs::create_directory_symlink(dir_ / "own", dir_ / "own-link");
  const Result r = mpmd(a, a + " --threads 2 --out " + (dir_ / "own-link").string() + " --timeout 200");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A rank whose --out is another directory (each machine's own disk) used to train and save
// with exit 0: rank 0 committed every checkpoint naming rank 1's file, which was never there, so
// no checkpoint could be resumed. Now the run ends at start, naming the rank; no directory is left.
TEST_F(RunSafety, ARankThatDoesNotSeeTheRunDirectoryEndsTheRun) {
  const std::string a = args("shared", 2) + " --save-every 2";
  expect_one_error(mpmd(a, a + " --out " + (dir_ / "not-shared").string()),
                   {"--out: rank 1 does not see the run directory rank 0 holds", (dir_ / "shared" / ".lock").string()});
  EXPECT_FALSE(fs::exists(dir_ / "shared"));
  EXPECT_FALSE(fs::exists(dir_ / "not-shared" / "ckpt"));
}

// Rank 0 owns the run directory: when it cannot lock it, every rank ends, with one line.
TEST_F(RunSafety, LockedRunDirectoryEndsEveryRank) {
  fs::create_directories(dir_ / "locked");
  const int fd = ::open((dir_ / "locked" / ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string me = "pid " + std::to_string(::getpid()) + " on the test\n";
  ASSERT_EQ(::write(fd, me.data(), me.size()), static_cast<ssize_t>(me.size()));
  const Result r = testing::mpirun(2, args("locked", 2));
  ::close(fd);
  expect_one_error(r, {"in use by another run", "pid " + std::to_string(::getpid())});
}

// Each rank checks its share of the corpus (train, then val) for ids past the vocabulary, so a
// job reads it once, not once a rank. A bad id only rank 1 reads (the val file's last token) ends
// every rank with one line naming the file and the position, from rank 0.
TEST_F(RunSafety, ABadTokenIdInOneRanksShareEndsEveryRankWithOneLine) {
  const std::string bad = (dir_ / "badid").string();
  fs::copy_file(runs_.data() + "_train.bin", bad + "_train.bin");
  fs::copy_file(runs_.data() + "_meta.json", bad + "_meta.json");
  const data::TokenShard val(runs_.data() + "_val.bin");
  std::vector<int32_t> tokens = val.read(0, val.size());
  tokens.back() = 65000;
  data::write_token_shard(bad + "_val.bin", tokens);
  expect_one_error(testing::mpirun(2, args("badid", 2) + " --data " + bad),
                   {bad + "_val.bin: token id 65000 at position " + std::to_string(tokens.size() - 1) + " is >="});
  EXPECT_FALSE(fs::exists(dir_ / "badid" / "ckpt"));
}

// ---- resume is the saved run ----

// --resume used to accept a changed --lr (or --steps, --batch, --seq, --data) silently.
TEST_F(RunSafety, ResumeWithAChangedSettingIsRefusedUnlessOverridden) {
  ASSERT_EQ(shardlm(args("lr", 4) + " --save-every 2").code, 0);
  const std::string before = read_file(dir_ / "lr" / "metrics.jsonl");
  const std::string resume = " --save-every 2 --resume " + ckpt("lr", 2);
  expect_one_error(shardlm(args("lr", 4) + resume + " --lr 0.01"), {"index.json", "lr is 0.01 (saved 0.0006)",
                                                                   "--resume-override lr"});
  expect_one_error(shardlm(args("lr", 6) + resume), {"steps is 6 (saved 4)"});
  expect_one_error(shardlm(args("lr", 4, 4) + resume), {"global-batch is 4 (saved 2)"});
  expect_one_error(shardlm(args("lr", 4) + resume + " --resume-override lr,no-such"), {"'no-such'"});
  EXPECT_EQ(read_file(dir_ / "lr" / "metrics.jsonl"), before) << "a refused resume changed the run's record";

  const Result r = shardlm(args("lr", 6) + resume + " --lr 0.01 --resume-override lr --resume-override steps");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(train_steps(dir_ / "lr" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  // The checkpoints of the resumed run record the run as it now is.
  const auto state = nlohmann::json::parse(read_file(fs::path(ckpt("lr", 6)) / "index.json"));
  EXPECT_EQ(state["run"]["steps"], 6);
  EXPECT_FLOAT_EQ(state["run"]["lr"].get<float>(), 0.01f);
}

// A mixture-of-experts run's routing (--top-k, --no-norm-topk, --capacity-factor) and its
// losses' coefficients changed on --resume were taken without a word (and the next checkpoint's
// config.json rewritten). Each is refused naming it, or changed through --resume-override,
// which says so. --init-from compares what the weights compute with (the losses are the new
// run's own).
TEST_F(RunSafety, ResumeWithChangedRoutingIsRefusedUnlessOverridden) {
  const auto moe = [](const std::string& out, int steps) { return runs_.args(out, steps, 2, "moe-tiny"); };
  ASSERT_EQ(shardlm(moe("moe", 2) + " --save-every 1").code, 0);
  const std::string before = read_file(dir_ / "moe" / "metrics.jsonl");
  const std::string resume = " --save-every 1 --resume " + ckpt("moe", 1);
  const std::string config = ckpt("moe", 1) + "/config.json";
  expect_one_error(shardlm(moe("moe", 2) + resume + " --top-k 1"),
                   {config, "top-k is 1 (saved 2)", "--resume-override top-k if that is meant"});
  expect_one_error(shardlm(moe("moe", 2) + resume + " --no-norm-topk"), {config, "no-norm-topk is true (saved false)"});
  expect_one_error(shardlm(moe("moe", 2) + resume + " --capacity-factor 1.25 --aux-loss-coef 0.5 --z-loss-coef 0"),
                   {"capacity-factor is 1.25 (saved dropless)", "aux-loss-coef is 0.5 (saved 0.01)",
                    "z-loss-coef is 0 (saved 0.001)", "--resume-override capacity-factor,aux-loss-coef,z-loss-coef"});
  expect_one_error(shardlm(moe("moe", 2) + resume + " --top-k 1 --capacity-factor 2 --resume-override top-k"),
                   {"capacity-factor is 2 (saved dropless)"});
  EXPECT_EQ(read_file(dir_ / "moe" / "metrics.jsonl"), before) << "a refused resume changed the run's record";

  const Result r = shardlm(moe("moe", 2) + resume + " --top-k 1 --aux-loss-coef 0.5 --resume-override top-k,aux-loss-coef");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "--resume-override top-k: top-k changed from 2 to 1\n"), 1) << r.out;
  EXPECT_EQ(count(r.out, "--resume-override aux-loss-coef: aux-loss-coef changed from 0.01 to 0.5\n"), 1) << r.out;
  const auto saved = nlohmann::json::parse(read_file(fs::path(ckpt("moe", 2)) / "config.json"));
  EXPECT_EQ(saved["num_experts_per_tok"], 1);

  // A new run from the checkpoint (now top-k 1): another top-k or a capacity is refused; other
  // loss coefficients are this run's own.
  const std::string from = " --init-from " + ckpt("moe", 2);
  expect_one_error(shardlm(moe("moe_init", 1) + from + " --top-k 1 --capacity-factor 1.25"),
                   {ckpt("moe", 2) + "/config.json", "capacity-factor is 1.25 (saved dropless)",
                    "--resume-override capacity-factor"});
  expect_one_error(shardlm(moe("moe_init", 1) + from), {"top-k is 2 (saved 1)"});
  expect_one_error(shardlm(moe("moe_init", 1) + from + " --top-k 1 --resume-override lr"), {"--resume-override", "'lr'", "--init-from"});
  EXPECT_FALSE(fs::exists(dir_ / "moe_init" / "metrics.jsonl"));
  const Result fresh = shardlm(moe("moe_init", 1) + from + " --top-k 1 --z-loss-coef 0.5");
  EXPECT_EQ(fresh.code, 0) << fresh.out;
  const Result topped = shardlm(moe("moe_init2", 1) + from + " --resume-override top-k");
  ASSERT_EQ(topped.code, 0) << topped.out;
  EXPECT_NE(topped.out.find("--resume-override top-k: top-k changed from 1 to 2\n"), std::string::npos) << topped.out;
}

// The per-rank batch and the strategy follow the rank count: fsdp on 2 ranks with --batch 2 is
// the same run as ddp on 4 with --batch 1 (global batch 4), and it continues the saved losses.
TEST_F(RunSafety, FsdpOnTwoRanksResumesAsDdpOnFour) {
  const Result saved = testing::mpirun(2, args("ranks", 4) + " --strategy fsdp --save-every 2");
  ASSERT_EQ(saved.code, 0) << saved.out;
  const auto original = testing::step_losses(dir_ / "ranks" / "metrics.jsonl");
  ASSERT_EQ(original.size(), 4u);
  expect_one_error(testing::mpirun(4, args("ranks", 4, 2) + " --strategy ddp --resume " + ckpt("ranks", 2)),
                   {"global-batch is 8 (saved 4)"});
  const Result r = testing::mpirun(4, args("ranks", 4, 1) + " --strategy ddp --resume " + ckpt("ranks", 2));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(train_steps(dir_ / "ranks" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3}));
  const auto resumed = testing::step_losses(dir_ / "ranks" / "metrics.jsonl");
  for (int i = 2; i < 4; ++i) EXPECT_NEAR(resumed[i], original[i], 1e-5 * original[i]) << "step " << i;
}

// The ranks of a cp group read the same sequences: cp 2 on 2 ranks with --batch 2 is the run one
// rank makes with --batch 2 (global batch 2, where it was once counted 4), so that is the resume
// that continues its losses; 2 ranks with --cp 1 read 4 sequences a step and are refused.
TEST_F(RunSafety, ContextParallelRunResumesOnTheRanksThatReadItsBatch) {
  const Result saved = testing::mpirun(2, args("cp", 4) + " --strategy fsdp --cp 2 --save-every 2");
  ASSERT_EQ(saved.code, 0) << saved.out;
  const auto state = nlohmann::json::parse(read_file(fs::path(ckpt("cp", 2)) / "index.json"));
  EXPECT_EQ(state["run"]["global-batch"], 2);
  // tokens/s and MFU count the same step: 2 sequences of 32 tokens.
  const auto info = nlohmann::json::parse(read_file(dir_ / "cp" / "run_info.json"));
  EXPECT_EQ(info["config"]["tokens_per_step"], 2 * 32);
  const auto original = testing::step_losses(dir_ / "cp" / "metrics.jsonl");
  ASSERT_EQ(original.size(), 4u);
  expect_one_error(testing::mpirun(2, args("cp", 4) + " --strategy fsdp --resume " + ckpt("cp", 2)),
                   {"global-batch is 4 (saved 2)", "data-parallel ranks x batch x grad-accum = 2 x 2 x 1"});
  const Result r = shardlm(args("cp", 4) + " --resume " + ckpt("cp", 2));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(train_steps(dir_ / "cp" / "metrics.jsonl"), (std::vector<int64_t>{0, 1, 2, 3}));
  const auto resumed = testing::step_losses(dir_ / "cp" / "metrics.jsonl");
  for (int i = 2; i < 4; ++i) EXPECT_NEAR(resumed[i], original[i], 1e-5 * original[i]) << "step " << i;
}

// An --offload-dir the user made (empty) was removed at the end of the run, as if the run had
// made it: it stays; only the run's own files in it go. One the run made goes.
TEST_F(RunSafety, AnOffloadDirTheRunDidNotMakeIsLeftInPlace) {
  const fs::path mine = dir_ / "my_offload";
  fs::create_directories(mine);
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(ranks);
    const std::string a = args("offload_dir_" + std::to_string(ranks), 1) + " --offload params --offload-dir ";
    const Result kept = testing::mpirun(ranks, a + mine.string());
    ASSERT_EQ(kept.code, 0) << kept.out;
    ASSERT_TRUE(fs::is_directory(mine)) << "the run removed the --offload-dir it was given";
    EXPECT_TRUE(fs::is_empty(mine)) << "the run left files in " << mine;
    const fs::path made = dir_ / ("made_offload_" + std::to_string(ranks));
    const Result gone = testing::mpirun(ranks, a + made.string() + " --overwrite");
    ASSERT_EQ(gone.code, 0) << gone.out;
    EXPECT_FALSE(fs::exists(made)) << "the run left the --offload-dir it made";
  }
}

// Every train flag is either compared across ranks or one of the process's own settings: a new
// run-defining flag left out of rank_settings() would let ranks start with different values.
TEST(RankSettings, CoverEveryTrainFlag) {
  const Result r = shardlm("train --help");
  ASSERT_EQ(r.code, 0) << r.out;
  std::set<std::string> flags;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find_first_not_of(' ');
    if (at == std::string::npos || line.compare(at, 2, "--") != 0) continue;
    flags.insert(line.substr(at + 2, line.find_first_of(" =", at) - at - 2));
  }
  ASSERT_GT(flags.size(), 40u) << r.out;
  std::set<std::string> compared;
  for (const auto& [name, value] : train::rank_settings(train::TrainConfig{})) compared.insert(name.substr(0, name.find(' ')));
  // no-report: only rank 0, which owns the run directory, writes the report. offload-dir: a node's
  // own disk may be mounted elsewhere. hardware: a path; what it decides (--offload-prefetch auto's
  // depth) is compared.
  const std::set<std::string> own = {"config",   "data-dir",    "hardware", "help-all",        "no-report", "offload-dir",
                                     "out",      "overwrite",   "peak-gflops", "quiet", "resume-override", "threads", "timeout"};
  for (const std::string& f : flags)
    EXPECT_TRUE(compared.count(f) || own.count(f))
        << "--" << f << " is neither compared across ranks (rank_settings, src/train/agreement.cc) nor the process's own";
}

}  // namespace
}  // namespace shardlm
