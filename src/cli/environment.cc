#include "cli/environment.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <fmt/format.h>
#include <stdexcept>
#include <string>
#include <string_view>

#include "comm/factory.h"
#include "sim/hardware.h"

namespace shardlm::cli {

const char* environment(const char* name) { return std::getenv(name); }

comm::MpiOptions comm_options() { return comm::mpi_options_from(environment); }

bool launched_by_mpi() { return comm::launched_by_mpi(environment); }

std::string hardware_dir() { return sim::hardware_dir(environment("SHARDLM_HARDWARE_DIR")); }

int omp_num_threads() {
  const char* given = environment("OMP_NUM_THREADS");
  if (!given || !*given) return 0;
  const std::string first = std::string(given).substr(0, std::string(given).find(','));
  const bool digits = !first.empty() && first.size() <= 9 && first.find_first_not_of("0123456789") == std::string::npos;
  const int n = digits ? std::stoi(first) : 0;
  if (n < 1 || n > train::kMaxThreads)
    throw std::invalid_argument(fmt::format("OMP_NUM_THREADS={}: the compute threads where no --threads is given must "
                                            "be a whole number from 1 to {}",
                                            given, train::kMaxThreads));
  return n;
}

int test_ranks_per_machine() {
  const char* test = environment("SHARDLM_TEST_RANKS_ON_MACHINE");
  const int n = test ? std::atoi(test) : 0;
  return n > 0 ? n : 0;
}

kernels::CudaOptions cuda_options() {
  kernels::CudaOptions o;
  const auto is = [](const char* name, const char* value) {
    const char* v = environment(name);
    return v && std::string(v) == value;
  };
  if (is("SHARDLM_CUDA_ATTENTION", "flash")) o.attention = kernels::CudaOptions::Attention::flash;
  if (is("SHARDLM_CUDA_ATTENTION", "cublas")) o.attention = kernels::CudaOptions::Attention::cublas;
  if (is("SHARDLM_CUDA_GEMM_OPERANDS", "fp32")) o.bf16_operands = false;
  o.sync_each_launch = is("SHARDLM_CUDA_DEBUG", "1");
  if (const char* rows = environment("SHARDLM_CUDA_HEAD_ROWS"); rows && std::atoll(rows) > 0)
    o.head_rows = std::atoll(rows);
  return o;
}

train::TrainConfig with_environment(train::TrainConfig c) {
  c.comm = comm_options();
  c.test_ranks_per_machine = test_ranks_per_machine();
  c.cuda = cuda_options();
  return c;
}

namespace {

// The whole of `text` as one integer (no sign, spaces or trailing characters).
template <typename Int>
bool parse_whole(std::string_view text, Int& out) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return !text.empty() && ec == std::errc() && ptr == end && out >= 0;
}

// `var` as RANK:STEP, both non-negative integers; unset is no fault.
run::FaultPoint fault_point(const char* var) {
  const char* value = environment(var);
  if (!value) return {};
  const std::string_view text(value);
  const size_t colon = text.find(':');
  run::FaultPoint f;
  if (colon == std::string_view::npos || !parse_whole(text.substr(0, colon), f.rank) ||
      !parse_whole(text.substr(colon + 1), f.step))
    throw std::invalid_argument(std::string(var) + ": expected RANK:STEP (two non-negative integers), got '" +
                                std::string(text) + "'");
  return f;
}

bool flag(const char* var) {
  const char* value = environment(var);
  if (!value) return false;
  const std::string_view text(value);
  if (text != "0" && text != "1")
    throw std::invalid_argument(std::string(var) + ": expected 0 or 1, got '" + std::string(text) + "'");
  return text == "1";
}

}  // namespace

train::TrainHooks test_faults() {
  train::TrainHooks h;
  h.executor_faults.skip_collective = fault_point("SHARDLM_FAULT_SKIP_COLLECTIVE");
  h.executor_faults.kill = fault_point("SHARDLM_FAULT_KILL");
  h.executor_faults.nan_loss = fault_point("SHARDLM_FAULT_NAN_LOSS");
  h.executor_faults.disk_read = fault_point("SHARDLM_FAULT_DISK_READ");
  h.kill_mid_write = fault_point("SHARDLM_FAULT_KILL_MID_WRITE");
  h.fail_write = fault_point("SHARDLM_FAULT_FAIL_WRITE");
  h.kill_in_save = fault_point("SHARDLM_FAULT_KILL_IN_SAVE");
  h.save_after_resume = flag("SHARDLM_TEST_SAVE_AFTER_RESUME");
  h.cpu_as_device = flag("SHARDLM_TEST_CPU_AS_DEVICE");
  return h;
}

}  // namespace shardlm::cli
