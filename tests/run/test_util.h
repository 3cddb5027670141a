// Helpers for tests that run the shardlm executable, alone or under mpirun.
#pragma once

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
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

// `mpirun --oversubscribe -np N [MPI_OPTIONS] shardlm ARGS` (as root too).
inline Result mpirun(int n, const std::string& args, const std::string& mpi_options = "") {
  return run_command("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np " +
                     std::to_string(n) + " " + mpi_options + " " + shardlm_binary() + " " + args);
}

inline Result shardlm(const std::string& args) { return run_command(shardlm_binary() + " " + args); }

// A step directory's weights in the whole Hugging Face form: `shardlm ckpt export` into
// STEP_DIR.hf; returns the path of its model.safetensors.
inline std::filesystem::path exported_weights(const std::filesystem::path& step_dir) {
  const std::filesystem::path out = step_dir.string() + ".hf";
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

// A small byte-level corpus tokenized into DIR/tok_{train,val}.bin.
inline void make_corpus(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::ofstream text(dir / "corpus.txt");
  for (int i = 0; i < 400; ++i) text << "And God said, Let there be light: and there was light. " << i * 7 << "\n";
  text.close();
  run_command(shardlm_binary() + " tokenize --tokenizer bytes --in " + (dir / "corpus.txt").string() + " --out " +
              (dir / "tok").string());
}

}  // namespace shardlm::testing
