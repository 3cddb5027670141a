#include "cli/environment.h"

#include <cstdlib>

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

train::TrainConfig with_environment(train::TrainConfig c) {
  c.comm = comm_options();
  c.ranks_on_machine = ranks_on_this_machine();
  return c;
}

}  // namespace shardlm::cli
