// Choosing a backend for this process.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/options.h"

namespace shardlm::comm {

// True when an MPI launcher started this process: the environment has OMPI_COMM_WORLD_SIZE
// (Open MPI's mpirun), PMI_SIZE / PMIX_RANK (MPICH, Slurm's PMI) or SLURM_NTASKS (srun).
bool launched_by_mpi();

// The communicator of all ranks of this job: an MpiCommunicator when MPI is already active or
// launched_by_mpi() (then it calls init_mpi(nullptr, nullptr) if needed; the program must call
// finalize_mpi() after destroying its communicators), otherwise a SingleRankCommunicator.
// `options` are used by the MPI backend; by default they come from the environment
// (mpi_options_from_env).
std::unique_ptr<Communicator> make_communicator(const MpiOptions& options = mpi_options_from_env());

}  // namespace shardlm::comm
