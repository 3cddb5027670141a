// Bad input is refused with one line naming the flag, key, file or field and the bad value, before
// anything runs or is allocated. Each case is a command that misbehaved before: looped,
// died of std::bad_alloc or a bus error, ran for minutes, or silently did something else.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "data/shard.h"
#include "run/test_util.h"

namespace {

namespace fs = std::filesystem;

using shardlm::testing::expect_one_line_error;
using shardlm::testing::Result;

// `shardlm ARGS` (testing::shardlm, which cannot be named here beside namespace shardlm).
Result run(const std::string& args) { return shardlm::testing::shardlm(args); }

class BadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.seed = 5;
    runs_.warmup = 1;
    runs_.threads = 2;
    const Result r = runs_.create("bad_input", shardlm::testing::kGenesisLine, 1);
    ASSERT_EQ(r.code, 0) << r.out;
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }

  static std::string data() { return runs_.data(); }
  static std::string path(const std::string& name) { return (dir_ / name).string(); }
  // A tiny run of `steps` steps; flags given after these win.
  static std::string train_args(const std::string& out, int steps) { return runs_.args(out, steps); }
  static void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }

  static inline shardlm::testing::TinyRuns runs_;
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
  // The same on the command line: `--out=` is an empty value, not a request for the next word.
  expect_one_line_error(run(train_args("x", 1) + " --out= --seq=64"), {"out", "empty"});
  EXPECT_FALSE(fs::exists("--seq=64"));
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
  write("switch_number.toml", "overwrite = 9223372036854775807\n");
  expect_one_line_error(run("train --config " + path("switch_number.toml")),
                        {path("switch_number.toml"), "overwrite", "true or false"});
  write("switch_word.toml", "overwrite = \"yes\"\n");
  expect_one_line_error(run("train --config " + path("switch_word.toml")), {"overwrite", "true or false"});
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
           {"--bucket-mb nan", "--bucket-mb"}, {"--batch 100000000 --seq 64", "--batch 100000000"},
           {"--seed -1", "--seed"}, {"--timeout 1e+300", "--timeout"}, {"--gather-bucket-mb -1", "--gather-bucket-mb"},
           {"--gather-bucket-mb nan", "--gather-bucket-mb"}, {"--gather-bucket-mb inf", "--gather-bucket-mb"},
           {"--keep-gathered h.0:2", "--keep-gathered"}}) {
    const std::string bad = flags.substr(flags.find(' ') + 1);
    SCOPED_TRACE(flags);
    expect_one_line_error(run(base + " " + flags), {needle, bad.substr(bad.rfind(' ') + 1)});
  }
  expect_one_line_error(run("explain --model tiny --n-head 0"), {"--n-head", "0"});
  expect_one_line_error(run("explain --model tiny --ranks 0"), {"--ranks", "0"});
  expect_one_line_error(run("explain --model tiny --batch -1"), {"--batch", "-1"});
  expect_one_line_error(run("explain --model tiny --ranks 2 --gather-bucket-mb -2"), {"--gather-bucket-mb", "-2"});
  expect_one_line_error(run("simulate --model tiny --ranks 2 --hardware cpu-local --gather-bucket-mb nan"),
                        {"--gather-bucket-mb", "nan"});
  expect_one_line_error(run("explain --model llama-tiny --n-kv-head 3"), {"n_kv_head", "3"});
  expect_one_line_error(run("explain --model tiny --ranks 2 --keep-gathered h.1:x"), {"--keep-gathered", "h.1:x"});
}

// Numbers too large for any run: refused with one line, where they ran without end (a plan
// search over 10^16 micro-batches), overflowed (a memory budget of 1e300 bytes read as a negative
// int64) or would have. The train flags are checked before the data is read (none here).
TEST_F(BadInput, NumericFlagsHaveUpperBounds) {
  std::string base = train_args("upper", 1);
  base.replace(base.find(data()), data().size(), path("no_data"));
  for (const auto& [flags, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--steps 10000000000000", "--steps"}, {"--warmup 10000000000000", "--warmup"},
           {"--eval-every 10000000000000", "--eval-every"}, {"--eval-windows 10000000000000", "--eval-windows"},
           {"--save-every 10000000000000", "--save-every"}, {"--keep-last 10000000000000", "--keep-last"},
           {"--snapshot-every 10000000000000", "--snapshot-every"},
           {"--max-skipped-steps 10000000000000", "--max-skipped-steps"}, {"--threads 5000", "--threads"},
           {"--sample-tokens 2000000", "--sample-tokens"}, {"--grad-accum 3000000000", "--grad-accum"},
           {"--batch 1024 --seq 1024 --grad-accum 2000000", "--grad-accum"}}) {
    SCOPED_TRACE(flags);
    expect_one_line_error(run(base + " " + flags), {needle, flags.substr(flags.rfind(' ') + 1)});
  }
  for (const char* cmd : {"explain --model tiny", "simulate --model tiny", "plan --model tiny --global-batch 128 --seq 32"})
    expect_one_line_error(run(std::string(cmd) + " --ranks 2000000"), {"--ranks", "2000000"});
  expect_one_line_error(run("explain --model tiny --threads 2000"), {"--threads", "2000"});
  const std::string plan = shardlm::testing::shardlm_binary() + " plan --model tiny --ranks 2 --seq 64 ";
  expect_one_line_error(shardlm::testing::run_command("timeout 60 " + plan + "--global-batch 1000000000000000000"),
                        {"--global-batch", "1000000000000000000", "1048576"});
  expect_one_line_error(shardlm::testing::run_command("timeout 60 " + plan + "--global-batch 4096 --memory-per-rank 1e300"),
                        {"--memory-per-rank", "1e300"});
}

TEST_F(BadInput, EvalAndGenerateFlagsAreRangeChecked) {
  // The flags are refused before the checkpoint is even read.
  const std::string ck = path("no_ckpt");
  const std::string eval = "eval --ckpt " + ck + " --data " + data() + "_val.bin";
  expect_one_line_error(run(eval + " --batch 0"), {"--batch", "0"});
  expect_one_line_error(run(eval + " --batch -1"), {"--batch", "-1"});
  expect_one_line_error(run(eval + " --seq 0"), {"--seq", "0"});
  expect_one_line_error(run(eval + " --threads 0"), {"--threads", "0"});
  expect_one_line_error(run(eval + " --threads 5000"), {"--threads", "5000"});
  // 2^56 x 256 tokens wrapped to 0 and crashed the plan.
  expect_one_line_error(run(eval + " --batch 72057594037927936 --seq 256"), {"--batch", "72057594037927936", "2^31"});
  const std::string gen = "generate --ckpt " + ck;
  expect_one_line_error(run(gen + " --tokens -1"), {"--tokens", "-1"});
  expect_one_line_error(run(gen + " --tokens 1000001"), {"--tokens", "1000001"});
  expect_one_line_error(run(gen + " --threads 5000"), {"--threads", "5000"});
  expect_one_line_error(run(gen + " --top-k -1"), {"--top-k", "-1"});
  expect_one_line_error(run(gen + " --top-p 1.5"), {"--top-p", "1.5"});
  expect_one_line_error(run(gen + " --top-p -0.1"), {"--top-p", "-0.1"});
  expect_one_line_error(run(gen + " --temperature -1"), {"--temperature", "-1"});
  expect_one_line_error(run(gen + " --temperature nan"), {"--temperature", "nan"});
  expect_one_line_error(run(gen + " --threads -3"), {"--threads", "-3"});
  expect_one_line_error(run(gen + " --seed -2"), {"--seed", "-2"});
}

// `tokenize --val-fraction 0` wrote an empty PREFIX_val.bin that `train` then refused (it
// evaluates every run on it): refused here, before anything is read or written.
TEST_F(BadInput, TokenizeNeedsAValidationFraction) {
  write("text.txt", "In the beginning God created the heaven and the earth.\n");
  const std::string tok = "tokenize --tokenizer bytes --in " + path("text.txt") + " --out " + path("vf");
  for (const char* v : {"0", "1", "-0.1", "nan"}) expect_one_line_error(run(tok + " --val-fraction " + v), {"--val-fraction", v});
  EXPECT_FALSE(fs::exists(path("vf_train.bin")));
  EXPECT_FALSE(fs::exists(path("vf_val.bin")));
  ASSERT_EQ(run(tok + " --val-fraction 0.2").code, 0);
  EXPECT_TRUE(fs::exists(path("vf_val.bin")));
}

// `calibrate --sizes-kib 1000000000000` died of std::bad_alloc; `--sizes-kib 4` and an empty
// entry (read as 0 KiB) fitted bus_bw 1e30 and wrote it as measured. Refused before anything
// is measured or written.
TEST_F(BadInput, CalibrateSizesAreBoundedAndEnoughForABandwidth) {
  const std::string cal = "calibrate --out " + path("cal.json") + " --gemm-models none --iters 1 ";
  expect_one_line_error(run(cal + "--sizes-kib 1000000000000"), {"--sizes-kib", "1000000000000", "1048576"});
  expect_one_line_error(run(cal + "--sizes-kib 1e12"), {"--sizes-kib", "1e12"});
  expect_one_line_error(run(cal + "--sizes-kib ''"), {"--sizes-kib", "''"});
  expect_one_line_error(run(cal + "--sizes-kib 4,"), {"--sizes-kib 4:"});
  expect_one_line_error(run(cal + "--sizes-kib 4"), {"--sizes-kib 4:", "two different sizes", "1024 KiB"});
  expect_one_line_error(run(cal + "--sizes-kib 4,256"), {"--sizes-kib 4,256:", "1024 KiB"});
  expect_one_line_error(run(cal + "--iters 100000"), {"--iters", "100000"});
  expect_one_line_error(run(cal + "--threads 100000"), {"--threads", "100000"});
  EXPECT_FALSE(fs::exists(path("cal.json")));
}

// calibrate's device and GEMM flags: one line each, nothing written. --device cuda is refused by a
// build without CUDA (or a machine without a GPU) naming the flag.
TEST_F(BadInput, CalibrateDeviceAndGemmModelsAreChecked) {
  const std::string cal = "calibrate --out " + path("cal.json") + " --iters 1 ";
  expect_one_line_error(run(cal + "--device gpu --gemm-models none"), {"--device", "gpu"});
  expect_one_line_error(run(cal + "--compute-dtype bf16 --gemm-models none"), {"--compute-dtype bf16", "--device cuda"});
  expect_one_line_error(run(cal + "--compute-dtype fp16 --gemm-models none"), {"--compute-dtype", "fp16"});
  expect_one_line_error(run(cal + "--gemm-models small:0x256"), {"--gemm-models", "small:0x256"});
  expect_one_line_error(run(cal + "--gemm-models nosuchmodel"), {"--gemm-models", "nosuchmodel"});
#ifndef SHARDLM_CUDA
  expect_one_line_error(run(cal + "--device cuda --gemm-models none"), {"--device cuda", "no CUDA backend"});
#endif
  EXPECT_FALSE(fs::exists(path("cal.json")));
}

// A Hugging Face config.json given as --model: every key range-checked, integers as integers.
TEST_F(BadInput, HuggingFaceConfigKeysAreRangeChecked) {
  const std::string gpt2 = R"("model_type": "gpt2", "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 256)";
  for (const auto& [json, needles] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"{" + gpt2 + R"(, "n_layer": -2})", {"n_layer", "-2"}},
           {"{" + gpt2 + R"(, "n_layer": 0})", {"n_layer", "0"}},
           {"{" + gpt2 + R"(, "n_layer": 2.5})", {"n_layer", "2.5"}},
           {"{" + gpt2 + R"(, "n_layer": 1e8})", {"n_layer", "100000000"}},
           {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
                "hidden_size": 64, "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 256})",
            {"n_kv_head", "3"}}}) {
    SCOPED_TRACE(json);
    write("hf.json", json);
    std::vector<std::string> all = needles;
    all.push_back(path("hf.json"));
    const Result r = run(train_args("hf", 1) + " --model " + path("hf.json"));
    for (const auto& needle : all) EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " in: " << r.out;
    expect_one_line_error(r, {});
  }
}

// A test fault whose value is not RANK:STEP was ignored (sscanf read what it could), so a test
// with a typo passed without its fault. It is refused naming the variable.
TEST_F(BadInput, MalformedTestFaultIsRefusedNamingTheVariable) {
  const std::string binary = shardlm::testing::shardlm_binary();
  for (const char* value : {"1", "1:", ":2", "1:2x", "-1:2", "a:b", "1:2:3"})
    expect_one_line_error(shardlm::testing::run_command("SHARDLM_FAULT_KILL='" + std::string(value) + "' " + binary +
                                                        " " + train_args("fault", 1)),
                          {"SHARDLM_FAULT_KILL", "RANK:STEP", value});
  expect_one_line_error(shardlm::testing::run_command("SHARDLM_TEST_SAVE_AFTER_RESUME=yes " + binary + " " +
                                                      train_args("fault", 1)),
                        {"SHARDLM_TEST_SAVE_AFTER_RESUME", "yes"});
  EXPECT_FALSE(fs::exists(dir_ / "fault"));
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

// `--memory-budget ""` ran with no budget and `--offload ""` with nothing offloaded, silently;
// `--offload-prefetch -1` was taken for auto (and refused as auto without --hardware), and any
// depth up to 2^31 was taken. Each is one line naming the flag, from the command line and TOML.
TEST_F(BadInput, OffloadSettingsAreCheckedNamingTheFlag) {
  const std::string base = train_args("offload_flags", 1);
  expect_one_line_error(run(base + " --memory-budget="), {"--memory-budget", "empty"});
  expect_one_line_error(run(base + " --memory-budget ''"), {"--memory-budget", "empty"});
  expect_one_line_error(run(base + " --offload="), {"--offload", "empty"});
  for (const std::string depth : {"-1", "-7", "65", "2000000000"}) {
    SCOPED_TRACE(depth);
    const Result r = run(base + " --offload params --offload-prefetch " + depth);
    expect_one_line_error(r, {"--offload-prefetch", depth, "[0, 64]"});
    EXPECT_EQ(r.out.find("--offload-prefetch auto"), std::string::npos) << r.out;
  }
  for (const auto& [line, key] : std::vector<std::pair<std::string, std::string>>{
           {"memory_budget = \"\"", "memory_budget"}, {"offload = \"\"", "offload"},
           {"offload_prefetch = -1", "offload_prefetch"}, {"offload_prefetch = 65", "offload_prefetch"}}) {
    SCOPED_TRACE(line);
    write("offload.toml", line + "\n");
    expect_one_line_error(run(base + " --config " + path("offload.toml")), {path("offload.toml"), key});
  }
  expect_one_line_error(run("explain --model tiny --offload params --offload-prefetch 65"), {"--offload-prefetch", "65"});
  const Result deepest = run("explain --model tiny --offload params --offload-prefetch 64");
  EXPECT_EQ(deepest.code, 0) << deepest.out;
}

// A validation split shorter than one window (--seq + 1 tokens) was found at the run's final
// evaluation, after every step had trained; now the run is refused before it starts, naming the
// file and --seq, and leaves no run directory. The training split is held to the same.
TEST_F(BadInput, SplitsShorterThanOneWindowAreRefusedBeforeTraining) {
  const std::string prefix = path("short_val");
  fs::copy_file(data() + "_train.bin", prefix + "_train.bin");
  const std::vector<int32_t> window_less_one(32, 7);  // --seq 32 needs 33
  shardlm::data::write_token_shard(prefix + "_val.bin", window_less_one);
  std::string args = train_args("short_val_run", 2);
  args.replace(args.find(data()), data().size(), prefix);
  expect_one_line_error(run(args), {prefix + "_val.bin", "32 tokens", "--seq 32"});
  EXPECT_FALSE(fs::exists(path("short_val_run")));
  fs::copy_file(prefix + "_val.bin", prefix + "_train.bin", fs::copy_options::overwrite_existing);
  fs::copy_file(data() + "_val.bin", prefix + "_val.bin", fs::copy_options::overwrite_existing);
  expect_one_line_error(run(args), {prefix + "_train.bin", "32 tokens", "--seq 32"});
  EXPECT_FALSE(fs::exists(path("short_val_run")));
}

// A config.json with n_layer 1e8 ran for minutes instead of being refused; a model too big for
// this machine is refused with the figures before anything is allocated.
TEST_F(BadInput, ModelTooBigForTheMachineIsRefusedWithTheFigure) {
  auto hf = [&](int64_t layers) {
    write("big.json", "{\"model_type\": \"gpt2\", \"n_layer\": " + std::to_string(layers) +
                          ", \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 256, \"n_positions\": 256}");
    return " --model " + path("big.json");
  };
  expect_one_line_error(run(train_args("big", 1) + hf(100000000)), {"big.json", "n_layer", "100000000"});
  // Under the layer limit, the parameters alone (16 bytes each) exceed any machine this runs on.
  expect_one_line_error(run(train_args("big", 1) + hf(1000000)),
                        {"does not fit in memory", "n_layer 1000000", "GiB per rank", "MemAvailable"});
  expect_one_line_error(run(train_args("big", 1) + " --n-embd 16384 --n-head 128 --n-layer 100"),
                        {"does not fit in memory", "n_embd 16384", "MemAvailable"});
  // Parameters fit, the plan's activations (2^31 tokens a micro-step) do not: the plan's figure.
  expect_one_line_error(run(train_args("big", 1) + " --batch 8388607 --seq 256"),
                        {"does not fit in memory", "the plan needs", "activations", "MemAvailable"});
  EXPECT_FALSE(fs::exists(path("big") + "/metrics.jsonl"));
  // eval of a real checkpoint with a batch whose activations cannot fit.
  ASSERT_EQ(run(train_args("small", 1) + " --save-every 1").code, 0);
  expect_one_line_error(run("eval --ckpt " + path("small") + "/ckpt/step_1 --data " + data() +
                            "_val.bin --seq 256 --batch 100000"),
                        {"does not fit in memory", "activations", "MemAvailable"});
}

// A copy of a real checkpoint whose config.json or index.json `edit` changes.
class BadCheckpoint : public BadInput {
 protected:
  static void SetUpTestSuite() {
    BadInput::SetUpTestSuite();
    const Result r = run(train_args("ck", 2) + " --save-every 2");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  std::string edited(const std::string& file, const std::function<void(nlohmann::json&)>& edit) {
    return edited_text(file, [&](std::string& text) {
      nlohmann::json j = nlohmann::json::parse(text);
      edit(j);
      text = j.dump();
    });
  }
  std::string edited_text(const std::string& file, const std::function<void(std::string&)>& edit) {
    const fs::path ck = dir_ / ("edited_" + std::to_string(n_++));
    fs::copy(dir_ / "ck" / "ckpt" / "step_2", ck);
    std::stringstream text;
    text << std::ifstream(ck / file).rdbuf();
    std::string s = text.str();
    edit(s);
    std::ofstream(ck / file) << s;
    return ck.string();
  }
  // Every command that reads a checkpoint refuses it with the same line: eval, generate, a
  // resume, --init-from, ckpt export (writing nothing) and ckpt info.
  void expect_refused(const std::string& ck, std::initializer_list<std::string> needles) {
    expect_one_line_error(run("eval --ckpt " + ck + " --data " + data() + "_val.bin --seq 32"), needles);
    expect_one_line_error(run("generate --ckpt " + ck + " --tokens 2"), needles);
    expect_one_line_error(run(train_args("resumed", 3) + " --resume " + ck), needles);
    expect_one_line_error(run(train_args("init", 1) + " --overwrite --init-from " + ck), needles);
    expect_one_line_error(run("ckpt export --ckpt " + ck + " --out " + ck + ".hf"), needles);
    EXPECT_FALSE(fs::exists(ck + ".hf"));
    expect_one_line_error(run("ckpt info --ckpt " + ck), needles);
  }
  static inline int n_ = 0;  // across the suite: every edited copy has a name of its own
};

// The run state (state.json's fields, in a sharded checkpoint's index.json) with step -7 gave
// `basic_string::_M_replace_aux`.
TEST_F(BadCheckpoint, StateFieldsAreRangeChecked) {
  expect_refused(edited("index.json", [](auto& j) { j["step"] = -7; }), {"index.json", "'step'", "-7"});
  expect_refused(edited("index.json", [](auto& j) { j["step"] = 2.5; }), {"index.json", "'step'", "2.5"});
  expect_refused(edited("index.json", [](auto& j) { j["rng"]["seed"] = -1; }), {"index.json", "'seed'", "-1"});
  expect_refused(edited("index.json", [](auto& j) { j.erase("step"); }), {"index.json", "'step'"});
  expect_refused(edited("index.json", [](auto& j) { j["tokenizer"] = ""; }), {"index.json", "'tokenizer'"});
}

// config.json is checked against the tensors index.json lists before anything is allocated.
TEST_F(BadCheckpoint, ConfigIsCheckedAgainstTheTensorFile) {
  expect_refused(edited("config.json", [](auto& j) { j["n_layer"] = 100000000; }), {"config.json", "n_layer", "100000000"});
  expect_refused(edited("config.json", [](auto& j) { j["n_layer"] = 1000; }),
                 {"config.json", "n_layer 1000", "index.json", "tensors"});
  expect_refused(edited("config.json", [](auto& j) { j["n_layer"] = 3; }), {"config.json", "n_layer 3", "index.json"});
  expect_refused(edited("config.json", [](auto& j) { j["n_inner"] = 200; }), {"config.json", "ffn_dim 200", "index.json"});
  // Same element count, other shapes: n_positions 256 -> 128 with vocabulary 256 -> 384 keeps
  // wte + wpe at (256 + 256) x 64 = (384 + 128) x 64; caught tensor by tensor.
  expect_refused(edited("config.json", [](auto& j) { j["n_positions"] = j["n_ctx"] = 128; j["vocab_size"] = 384; }),
                 {"config.json", "wte.weight", "[256, 64]", "[384, 64]"});
  expect_refused(edited("config.json", [](auto& j) { j["n_head"] = 0; }), {"config.json", "n_head", "0"});
}

// Each field of index.json is checked alone and against the others (an unknown format
// version, an unknown strategy, a negative next step, an optimizer step of 2^63 or past the step,
// a world size of 0 all loaded).
TEST_F(BadCheckpoint, IndexFieldsAreCheckedAgainstEachOther) {
  expect_refused(edited("index.json", [](auto& j) { j["format"] = "shardlm-sharded-9"; }),
                 {"index.json", "'format'", "shardlm-sharded-9"});
  expect_refused(edited("index.json", [](auto& j) { j["strategy"] = "zero9"; }), {"index.json", "'strategy'", "zero9"});
  expect_refused(edited("index.json", [](auto& j) { j["world_size"] = 0; }), {"index.json", "'world_size'", "0"});
  expect_refused(edited("index.json", [](auto& j) { j["data"]["next_step"] = -1; }), {"index.json", "'next_step'", "-1"});
  expect_refused(edited("index.json", [](auto& j) { j["data"]["next_step"] = 1; }),
                 {"index.json", "'next_step'", "is 1 but 'step' is 2"});
  expect_refused(edited("index.json", [](auto& j) { j["optimizer"]["adamw_step"] = uint64_t{1} << 63; }),
                 {"index.json", "'adamw_step'", "9223372036854775808"});
  expect_refused(edited("index.json", [](auto& j) { j["optimizer"]["adamw_step"] = -1; }),
                 {"index.json", "'adamw_step'", "-1"});
  expect_refused(edited("index.json", [](auto& j) { j["optimizer"]["adamw_step"] = 3; }),
                 {"index.json", "'adamw_step'", "is 3, more than 'step' 2"});
  expect_refused(edited("index.json", [](auto& j) { j["run"]["steps"] = j["schedule"]["total_steps"] = 1; }),
                 {"index.json", "'step'", "beyond the run's 'steps' 1"});
  expect_refused(edited("index.json", [](auto& j) { j["schedule"]["total_steps"] = 7; }),
                 {"index.json", "'total_steps'", "is 7 but 'steps' (in 'run') is 2"});
  expect_refused(edited("index.json", [](auto& j) { j["rng"]["seed"] = 6; }), {"index.json", "'seed'", "'run'"});
  expect_refused(edited("index.json", [](auto& j) { j["files"][0]["name"] = "../ck.safetensors"; }),
                 {"index.json", "'name'", "../ck.safetensors"});
  expect_refused(edited("index.json", [](auto& j) { j["resharded_by"] = "someone"; }),
                 {"index.json", "'resharded_by'", "not one shardlm writes"});
  // The model stated twice must be one: n_head 2 keeps every tensor's shape, so only index.json's
  // "config" shows config.json was changed.
  expect_refused(edited("config.json", [](auto& j) { j["n_head"] = 2; }),
                 {"config.json", "'n_head' is 2 but index.json's 'config' has 4"});
}

// nlohmann's parser keeps one of two equal keys: a checkpoint naming a field twice was read as
// whichever came last.
TEST_F(BadCheckpoint, DuplicatedKeysAreRefused) {
  expect_refused(edited_text("index.json", [](std::string& t) { t.insert(1, "\"step\": 0, "); }),
                 {"index.json", "key 'step' appears twice"});
  expect_refused(edited_text("index.json", [](std::string& t) { t.insert(t.find("\"seed\"") , "\"seed\": 3, "); }),
                 {"index.json", "key 'seed' appears twice"});
  expect_refused(edited_text("config.json", [](std::string& t) { t.insert(1, "\"n_layer\": 2, "); }),
                 {"config.json", "key 'n_layer' appears twice"});
}

// `ckpt info` printed the sizes and checksums index.json claims for shard files that were
// missing, truncated or corrupt, and exited 0. It now checks them as a resume does (--no-verify
// to skip that), and a broken checkpoint is one line naming the file.
TEST_F(BadCheckpoint, InfoVerifiesEveryFileItLists) {
  const std::string rank0 = "/rank-00000-of-00001.safetensors";
  const Result good = run("ckpt info --ckpt " + path("ck"));
  ASSERT_EQ(good.code, 0) << good.out;
  EXPECT_NE(good.out.find(rank0.substr(1) + "  "), std::string::npos) << good.out;
  EXPECT_NE(good.out.find("verified"), std::string::npos) << good.out;

  const std::string cut = edited("index.json", [](auto&) {});
  fs::resize_file(cut + rank0, fs::file_size(cut + rank0) - 8);
  expect_one_line_error(run("ckpt info --ckpt " + cut), {cut + rank0, "truncated"});
  const Result unverified = run("ckpt info --no-verify --ckpt " + cut);
  EXPECT_EQ(unverified.code, 0) << unverified.out;
  EXPECT_NE(unverified.out.find("not verified"), std::string::npos) << unverified.out;

  const std::string flipped = edited("index.json", [](auto&) {});
  std::fstream f(flipped + rank0, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-3, std::ios::end);
  f.put('\x7f');
  f.close();
  expect_one_line_error(run("ckpt info --ckpt " + flipped), {flipped + rank0, "checksum"});

  const std::string gone = edited("index.json", [](auto&) {});
  fs::remove(gone + rank0);
  expect_one_line_error(run("ckpt info --ckpt " + gone), {gone + rank0, "missing"});
}

}  // namespace

namespace {

TEST(BadMoeInput, EachRefusedSettingIsOneLineNamingIt) {
  expect_one_line_error(run("explain --model moe-tiny --top-k 0"), {"--top-k", "0"});
  expect_one_line_error(run("explain --model moe-tiny --top-k 5"), {"top_k", "--top-k", "5"});
  expect_one_line_error(run("explain --model moe-tiny --capacity-factor 0"), {"--capacity-factor", "0"});
  expect_one_line_error(run("explain --model moe-tiny --capacity-factor -0.5"), {"--capacity-factor", "-0.5"});
  expect_one_line_error(run("explain --model tiny --experts 4"), {"--experts", "gpt2", "no experts"});
  expect_one_line_error(run("explain --model tiny --capacity-factor 1.0"), {"--capacity-factor", "gpt2"});
  expect_one_line_error(run("explain --model llama-tiny --top-k 2"), {"--top-k", "llama"});
  expect_one_line_error(run("explain --model moe-tiny --moe-every 3"), {"moe_every", "--moe-every", "3"});
}

}  // namespace

namespace {
// --act-quant's settings, from the command line and TOML: each bad value is one line naming its
// field; a good TOML setting trains (with selective recompute, which it composes with).
TEST_F(BadInput, ActQuantSettings) {
  write("aq_group.toml", "act_quant = \"int8\"\nact_quant_group = 48\n");
  expect_one_line_error(run(train_args("aq1", 1) + " --config " + path("aq_group.toml")),
                        {"act_quant_group (--act-quant-group)", "48", "n_embd (64)"});
  expect_one_line_error(run(train_args("aq2", 1) + " --act-quant int4"), {"act_quant (--act-quant)", "int4"});
  expect_one_line_error(run(train_args("aq3", 1) + " --act-quant int8 --act-quant-rounding up"),
                        {"act_quant_rounding (--act-quant-rounding)", "up"});
  expect_one_line_error(run(train_args("aq4", 1) + " --act-quant int8 --act-quant-group 0"),
                        {"act_quant_group (--act-quant-group)", "0"});
  expect_one_line_error(run(train_args("aq5", 1) + " --model moe-tiny --act-quant int8 --act-quant-group 128"),
                        {"act_quant_group (--act-quant-group)", "128", "n_embd (64)"});
  write("aq_ok.toml", "act_quant = \"int8\"\nact_quant_group = 32\nact_quant_rounding = \"stochastic\"\n");
  const Result r = run(train_args("aq6", 2) + " --config " + path("aq_ok.toml") + " --recompute selective");
  EXPECT_EQ(r.code, 0) << r.out;
}

// --recompute-blocks, from the command line and TOML: out of [0, n_layer], or with no mode to
// apply, is one line naming the field; a good TOML setting trains on that many blocks.
TEST_F(BadInput, RecomputeBlocks) {
  expect_one_line_error(run(train_args("rb1", 1) + " --recompute full --recompute-blocks -2"),
                        {"recompute_blocks (--recompute-blocks)", "-2"});
  expect_one_line_error(run("explain --model tiny --recompute full --recompute-blocks 3"),
                        {"recompute_blocks (--recompute-blocks)", "n_layer = 2", "3"});
  expect_one_line_error(run("simulate --model tiny --recompute-blocks 1"),
                        {"recompute_blocks (--recompute-blocks)", "--recompute is none"});
  write("rb_bad.toml", "recompute = \"selective\"\nrecompute_blocks = 7\n");
  expect_one_line_error(run(train_args("rb2", 1) + " --config " + path("rb_bad.toml")),
                        {"recompute_blocks (--recompute-blocks)", "7"});
  write("rb_ok.toml", "recompute = \"full\"\nrecompute_blocks = 1\n");
  const Result r = run(train_args("rb3", 1) + " --config " + path("rb_ok.toml"));
  EXPECT_EQ(r.code, 0) << r.out;
  std::ifstream info(dir_ / "rb3" / "run_info.json");
  EXPECT_EQ(nlohmann::json::parse(info)["config"]["recompute"], "full on 1 block");
}

// --recompute selective-op names a LLaMA block's GEMMs: on another family, over cp ranks or with
// --act-quant it is one line naming the field; an unknown mode lists the four.
TEST_F(BadInput, SelectiveOpRecompute) {
  expect_one_line_error(run(train_args("so1", 1) + " --recompute selective-op"),
                        {"recompute (--recompute): selective-op", "gpt2"});
  expect_one_line_error(run("simulate --model moe-tiny --recompute selective-op"),
                        {"recompute (--recompute): selective-op", "moe"});
  expect_one_line_error(run("explain --model llama-tiny --ranks 2 --cp 2 --seq 64 --recompute selective-op"),
                        {"recompute (--recompute): selective-op", "--cp 1"});
  expect_one_line_error(run("explain --model llama-tiny --recompute selective-op --act-quant int8 --act-quant-group 32"),
                        {"recompute (--recompute): selective-op", "--act-quant"});
  expect_one_line_error(run("explain --model llama-tiny --recompute op"), {"recompute", "selective-op"});
}

TEST_F(BadInput, ReduceEachMicroStepWithWholeGradients) {
  for (const char* s : {"ddp", "zero1"})
    expect_one_line_error(run(std::string("explain --model tiny --ranks 2 --grad-accum 2 --reduce-each-micro-step --strategy ") + s),
                          {"reduce_each_micro_step (--reduce-each-micro-step)", s, "zero2, fsdp and hybrid"});
}
}  // namespace
