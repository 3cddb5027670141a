// Helpers for tests that run the shardlm executable, alone or under mpirun.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <vector>

namespace shardlm::testing {

struct Result {
  int code;
  std::string out;  // stdout and stderr together
};

inline Result run_command(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

inline std::string shardlm_binary() {
  const char* b = std::getenv("SHARDLM_BINARY");
  return b ? b : "shardlm";
}

// The environment an mpirun of the tests starts in: allowed as root, and with a session directory
// of its own. Open MPI's default, /tmp/ompi.HOST.UID, is shared by every mpirun of the user: one
// starting while another ends races on creating and removing it ("A call to mkdir was unable to
// create the desired directory ... File exists", orte_init failed), which ctest -j2 hit. The
// directory goes with the object.
class MpiSession {
 public:
  MpiSession() {
    static std::atomic<int> count{0};
    dir_ = std::filesystem::temp_directory_path() /
           ("shardlm_ompi_" + std::to_string(::getpid()) + "_" + std::to_string(count++));
    std::filesystem::create_directories(dir_);
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // "VAR=VALUE ... " to put before `mpirun` in a shell command.
  std::string env() const {
    return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_orte_tmpdir_base=" + dir_.string() + " ";
  }

 private:
  std::filesystem::path dir_;
};

// `mpirun --oversubscribe -np N [MPI_OPTIONS] shardlm ARGS` (as root too).
inline Result mpirun(int n, const std::string& args, const std::string& mpi_options = "") {
  const MpiSession session;
  return run_command(session.env() + "mpirun --oversubscribe -np " + std::to_string(n) + " " + mpi_options + " " +
                     shardlm_binary() + " " + args);
}

inline Result shardlm(const std::string& args) { return run_command(shardlm_binary() + " " + args); }

// A step directory's weights in the whole Hugging Face form: `shardlm ckpt export` into
// STEP_DIR.hf (once; a later call reads that export); returns the path of its model.safetensors.
inline std::filesystem::path exported_weights(const std::filesystem::path& step_dir) {
  const std::filesystem::path out = step_dir.string() + ".hf";
  if (std::filesystem::exists(out / "model.safetensors")) return out / "model.safetensors";
  const Result r = shardlm("ckpt export --format hf --ckpt " + step_dir.string() + " --out " + out.string());
  if (r.code != 0) throw std::runtime_error("ckpt export failed: " + r.out);
  return out / "model.safetensors";
}

inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

inline std::vector<double> step_losses(const std::filesystem::path& metrics) {
  std::vector<double> out;
  for (const auto& r : read_metrics(metrics))
    if (r.contains("loss")) out.push_back(r["loss"].get<double>());
  return out;
}

// A small byte-level corpus tokenized into DIR/tok_{train,val}.bin: 400 lines, each `line`
// followed by its number times `stride`. Returns the tokenizer's result.
inline Result make_corpus(const std::filesystem::path& dir,
                          const std::string& line = "And God said, Let there be light: and there was light. ",
                          int stride = 7) {
  std::filesystem::create_directories(dir);
  std::ofstream text(dir / "corpus.txt");
  for (int i = 0; i < 400; ++i) text << line << i * stride << "\n";
  text.close();
  return run_command(shardlm_binary() + " tokenize --tokenizer bytes --in " + (dir / "corpus.txt").string() +
                     " --out " + (dir / "tok").string());
}

// The short `train` runs of one test suite: a directory of this process's holding a small corpus
// (make_corpus), and the command lines of runs on it whose run directories lie in it. The fields
// are what every run of the suite shares; `flags` the rest of it (--lr, --save-every,
// --strategy, --timeout ...). Flags appended to args() come after all of these and win.
struct TinyRuns {
  int seed = 11;
  int warmup = 2;
  int threads = 1;
  int eval_windows = 2;
  int sample_tokens = 0;
  std::string flags;
  std::filesystem::path dir;  // set by create()

  // DIR = <temp>/shardlm_<name>_<pid>, made afresh; the corpus written into it is make_corpus's
  // with `line` and `stride` where given.
  Result create(const std::string& name, const std::string& line = "", int stride = 7) {
    dir = std::filesystem::temp_directory_path() / ("shardlm_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    return line.empty() ? make_corpus(dir) : make_corpus(dir, line, stride);
  }
  void remove() const { std::filesystem::remove_all(dir); }
  std::filesystem::path out(const std::string& run) const { return dir / run; }
  std::string data() const { return (dir / "tok").string(); }
  // `train` of `steps` steps of `model`, `batch` sequences of 32 tokens per rank, into DIR/RUN.
  std::string args(const std::string& run, int steps, int batch = 2, const std::string& model = "tiny") const {
    return "train --model " + model + " --data " + data() + " --out " + out(run).string() + " --steps " +
           std::to_string(steps) + " --batch " + std::to_string(batch) + " --seq 32 --threads " +
           std::to_string(threads) + " --seed " + std::to_string(seed) + " --warmup " + std::to_string(warmup) +
           " --eval-every 0 --eval-windows " + std::to_string(eval_windows) + " --sample-tokens " +
           std::to_string(sample_tokens) + " --peak-gflops 100 --quiet" + (flags.empty() ? "" : " " + flags);
  }
};

// The text of the corpus the cli tests train on (make_corpus's `line`, stride 1).
inline constexpr const char* kGenesisLine = "In the beginning God created the heaven and the earth. ";

inline int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// Refused: a non-zero exit and exactly one line, "shardlm: error: ..." holding every needle.
inline void expect_one_line_error(const Result& r, std::initializer_list<std::string> needles) {
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("shardlm: error"), std::string::npos) << r.out;
  for (const auto& needle : needles)
    EXPECT_NE(r.out.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.out;
}

// What `shardlm EXPLAIN_COMMAND` ("explain --model ...") says of a plan's memory: each category's
// own peak, and the total at the peak.
struct Explained {
  std::map<std::string, int64_t> own_peak;
  int64_t total = -1;
};

inline Explained explained_memory(const std::string& explain_command) {
  const Result r = shardlm(explain_command);
  EXPECT_EQ(r.code, 0) << r.out;
  Explained e;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (const size_t at = line.find("total at peak: "); at != std::string::npos) e.total = std::stoll(line.substr(at + 15));
    const size_t colon = line.find(": static "), own = line.find("own peak ");
    if (colon == std::string::npos || own == std::string::npos) continue;
    const size_t name = line.find_first_not_of(' ');
    e.own_peak[line.substr(name, colon - name)] = std::stoll(line.substr(own + 9));
  }
  EXPECT_GT(e.total, 0) << r.out;
  return e;
}

}  // namespace shardlm::testing
