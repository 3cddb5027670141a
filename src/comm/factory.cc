#include "comm/factory.h"

#include "comm/mpi_backend.h"
#include "comm/single_rank.h"

namespace shardlm::comm {

bool launched_by_mpi(const SettingLookup& env) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"}) {
    if (const char* s = env(v); s && *s) return true;
  }
  return false;
}

std::unique_ptr<Communicator> make_communicator(MemoryPool& memory, const MpiOptions& options, bool launched) {
  if (mpi_active() || launched) {
    init_mpi(nullptr, nullptr);
    return std::make_unique<MpiCommunicator>(memory, options);
  }
  return std::make_unique<SingleRankCommunicator>(memory);
}

}  // namespace shardlm::comm
