#include "cli/environment.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "comm/factory.h"
#include "sim/hardware.h"

namespace shardlm::cli {

const char* environment(const char* name) { return std::getenv(name); }

comm::MpiOptions comm_options() { return comm::mpi_options_from(environment); }

bool launched_by_mpi() { return comm::launched_by_mpi(environment); }

std::string hardware_dir() { return sim::hardware_dir(environment("SHARDLM_HARDWARE_DIR")); }

int ranks_on_this_machine() {
  const char* local = environment("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int n = local ? std::atoi(local) : 1;
  return n > 0 ? n : 1;
}

kernels::CudaOptions cuda_options() {
  kernels::CudaOptions o;
  const auto is = [](const char* name, const char* value) {
    const char* v = environment(name);
    return v && std::string(v) == value;
  };
  o.flash_attention = is("SHARDLM_CUDA_ATTENTION", "flash");
  o.sync_each_launch = is("SHARDLM_CUDA_DEBUG", "1");
  if (const char* rows = environment("SHARDLM_CUDA_HEAD_ROWS"); rows && std::atoll(rows) > 0)
    o.head_rows = std::atoll(rows);
  if (const char* local = environment("OMPI_COMM_WORLD_LOCAL_RANK")) o.local_rank = std::max(0, std::atoi(local));
  return o;
}

train::TrainConfig with_environment(train::TrainConfig c) {
  c.comm = comm_options();
  c.ranks_on_machine = ranks_on_this_machine();
  c.cuda = cuda_options();
  return c;
}

}  // namespace shardlm::cli
