// Choosing a backend for this process.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/options.h"
#include "tensor/memory.h"

namespace shardlm::comm {

// True when an MPI launcher started this process: its environment (`env`) has
// OMPI_COMM_WORLD_SIZE (Open MPI's mpirun), PMI_SIZE / PMIX_RANK (MPICH, Slurm's PMI) or
// SLURM_NTASKS (srun).
bool launched_by_mpi(const SettingLookup& env);

// The communicator of all ranks of this job: an MpiCommunicator when MPI is already active or
// `launched` (launched_by_mpi; then it calls init_mpi(nullptr, nullptr) if needed; the program
// must call finalize_mpi() after destroying its communicators), otherwise a
// SingleRankCommunicator. `options` are used by the MPI backend; its buffers come from `memory`.
std::unique_ptr<Communicator> make_communicator(MemoryPool& memory, const MpiOptions& options, bool launched);

}  // namespace shardlm::comm
