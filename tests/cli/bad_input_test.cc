// Bad input is refused with one line naming the flag, key, file or field and the bad value, before
// anything runs or is allocated (issue 9). Each case is a command that misbehaved before: looped,
// died of std::bad_alloc or a bus error, ran for minutes, or silently did something else.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;

struct Result {
  int code;
  std::string out;  // stdout and stderr together
};

Result run(const std::string& args) {
  const char* bin = std::getenv("SHARDLM_BINARY");
  if (!bin) return {-1, "SHARDLM_BINARY not set"};
  FILE* p = popen((std::string(bin) + " " + args + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// Non-zero exit, exactly one line, holding every needle.
void expect_one_line_error(const Result& r, std::initializer_list<std::string> needles) {
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
  for (const auto& needle : needles)
    EXPECT_NE(r.out.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.out;
}

class BadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("shardlm_bad_input_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream text(dir_ / "corpus.txt");
    for (int i = 0; i < 400; ++i) text << "In the beginning God created the heaven and the earth. " << i << "\n";
    text.close();
    const Result r = run("tokenize --tokenizer bytes --in " + (dir_ / "corpus.txt").string() + " --out " + data());
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string data() { return (dir_ / "tok").string(); }
  static std::string path(const std::string& name) { return (dir_ / name).string(); }
  // A tiny run of `steps` steps; flags given after these win.
  static std::string train_args(const std::string& out, int steps) {
    return "train --model tiny --data " + data() + " --out " + path(out) + " --steps " + std::to_string(steps) +
           " --batch 2 --seq 32 --threads 2 --seed 5 --eval-every 0 --eval-windows 2 --sample-tokens 0" +
           " --peak-gflops 100 --warmup 1 --quiet";
  }
  static void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }

  static inline fs::path dir_;
};

// `out = ""` swallowed the next key: the run wrote into a directory named `--seq=64` and trained
// at T=256. Every TOML value is a value: the empty string is refused as the run directory, and the
// key after it is read as a key.
TEST_F(BadInput, TomlEmptyStringIsAValue) {
  write("empty_out.toml", "model = \"tiny\"\nout = \"\"\nseq = 64\nsteps = 1\n");
  expect_one_line_error(run("train --config " + path("empty_out.toml") + " --data " + data()), {"out", "empty"});
  EXPECT_FALSE(fs::exists("--seq=64"));
  write("seq_after_out.toml", "model = \"tiny\"\nout = \"" + path("o") + "\"\nseq = 100000\nsteps = 1\n");
  expect_one_line_error(run("train --config " + path("seq_after_out.toml") + " --data " + data()), {"seq", "100000"});
  // A string starting with '-' is a value too, not a flag.
  write("dash.toml", "out = \"" + path("-dash") + "\"\nlr = -1\n");
  expect_one_line_error(run(train_args("x", 1) + " --config " + path("dash.toml") + " --out " + path("y")), {"lr", "-1"});
}

TEST_F(BadInput, TomlKeysApplyAndTheCommandLineWins) {
  write("run.toml", "model = \"tiny\"\nout = \"" + path("from_toml") + "\"\nsteps = 3\nsave_every = 1\n");
  const Result r = run(train_args("x", 1) + " --config " + path("run.toml") + " --steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  // --out from the command line (train_args) wins over the file's; save-every from the file applies.
  EXPECT_FALSE(fs::exists(path("from_toml")));
  EXPECT_TRUE(fs::exists(path("x") + "/ckpt/step_2"));
  EXPECT_FALSE(fs::exists(path("x") + "/ckpt/step_3"));
}

// `--config` naming a directory ran the defaults silently.
TEST_F(BadInput, ConfigFileThatIsNotAFile) {
  fs::create_directories(dir_ / "adir");
  expect_one_line_error(run("train --config " + path("adir")), {path("adir"), "directory"});
  expect_one_line_error(run("train --config " + path("absent.toml")), {path("absent.toml")});
  write("syntax.toml", "steps = 3\nlr = \n");
  expect_one_line_error(run("train --config " + path("syntax.toml")), {path("syntax.toml"), "line 2"});
  write("array.toml", "steps = [1, 2]\n");
  expect_one_line_error(run("train --config " + path("array.toml")), {path("array.toml"), "steps"});
  write("word.toml", "steps = \"many\"\n");
  expect_one_line_error(run("train --config " + path("word.toml")), {path("word.toml"), "steps", "many"});
}

// `eval --batch 0` looped forever, `--batch -1` died of std::bad_alloc, `--n-head 0` and
// `--n-layer -2` were ignored: every numeric flag of every command is range-checked.
TEST_F(BadInput, NumericFlagsAreRangeChecked) {
  const std::string base = train_args("range", 1);
  for (const auto& [flags, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--n-head 0", "--n-head"}, {"--n-layer -2", "--n-layer"}, {"--n-embd 0", "--n-embd"},
           {"--n-kv-head 0", "--n-kv-head"}, {"--ffn-dim -1", "--ffn-dim"}, {"--vocab 0", "--vocab"},
           {"--max-seq 0", "--max-seq"}, {"--norm-eps 0", "--norm-eps"}, {"--rope-theta -1", "--rope-theta"},
           {"--batch 0", "--batch"}, {"--batch -1", "--batch"}, {"--seq 0", "--seq"}, {"--steps -1", "--steps"},
           {"--grad-accum 0", "--grad-accum"}, {"--threads 0", "--threads"}, {"--eval-windows 0", "--eval-windows"},
           {"--sample-tokens -1", "--sample-tokens"}, {"--lr inf", "--lr"}, {"--lr -1", "--lr"},
           {"--beta2 1", "--beta2"}, {"--eps 0", "--eps"}, {"--timeout 0", "--timeout"},
           {"--bucket-mb nan", "--bucket-mb"}, {"--batch 100000000 --seq 64", "--batch 100000000"}}) {
    const std::string bad = flags.substr(flags.find(' ') + 1);
    SCOPED_TRACE(flags);
    expect_one_line_error(run(base + " " + flags), {needle, bad.substr(bad.rfind(' ') + 1)});
  }
  expect_one_line_error(run("explain --model tiny --n-head 0"), {"--n-head", "0"});
  expect_one_line_error(run("explain --model tiny --ranks 0"), {"--ranks", "0"});
  expect_one_line_error(run("explain --model tiny --batch -1"), {"--batch", "-1"});
  expect_one_line_error(run("explain --model llama-tiny --n-kv-head 3"), {"n_kv_head", "3"});
}

TEST_F(BadInput, EvalAndGenerateFlagsAreRangeChecked) {
  // The flags are refused before the checkpoint is even read.
  const std::string ck = path("no_ckpt");
  const std::string eval = "eval --ckpt " + ck + " --data " + data() + "_val.bin";
  expect_one_line_error(run(eval + " --batch 0"), {"--batch", "0"});
  expect_one_line_error(run(eval + " --batch -1"), {"--batch", "-1"});
  expect_one_line_error(run(eval + " --seq 0"), {"--seq", "0"});
  expect_one_line_error(run(eval + " --threads 0"), {"--threads", "0"});
  const std::string gen = "generate --ckpt " + ck;
  expect_one_line_error(run(gen + " --tokens -1"), {"--tokens", "-1"});
  expect_one_line_error(run(gen + " --top-k -1"), {"--top-k", "-1"});
  expect_one_line_error(run(gen + " --temperature -1"), {"--temperature", "-1"});
  expect_one_line_error(run(gen + " --temperature nan"), {"--temperature", "nan"});
  expect_one_line_error(run(gen + " --threads -3"), {"--threads", "-3"});
}

// Truncating the token file during a run crashed with a bus error and no message.
TEST_F(BadInput, TokenFileTruncatedDuringARun) {
  const std::string prefix = path("shrinking");
  for (const char* part : {"_train.bin", "_val.bin"}) fs::copy_file(data() + part, prefix + part);
  const fs::path metrics = dir_ / "shrink" / "metrics.jsonl";
  std::string args = train_args("shrink", 100000);
  args.replace(args.find(data()), data().size(), prefix);
  Result r;
  std::thread runner([&] { r = run(args); });
  // Truncate once the run has trained a step (it has read batches from the file).
  for (int i = 0; i < 1200 && !(fs::exists(metrics) && fs::file_size(metrics) > 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  fs::resize_file(prefix + "_train.bin", 1024 + 2 * 40);
  runner.join();
  expect_one_line_error(r, {prefix + "_train.bin", "truncated", "1104 bytes"});
}

}  // namespace
