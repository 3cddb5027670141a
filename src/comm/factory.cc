#include "comm/factory.h"

#include <cstdlib>

#include "comm/mpi_backend.h"
#include "comm/single_rank.h"

namespace shardlm::comm {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"}) {
    if (const char* s = std::getenv(v); s && *s) return true;
  }
  return false;
}

std::unique_ptr<Communicator> make_communicator(const MpiOptions& options) {
  if (mpi_active() || launched_by_mpi()) {
    init_mpi(nullptr, nullptr);
    return std::make_unique<MpiCommunicator>(options);
  }
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace shardlm::comm
