// What the command line takes from the process's environment. This is the one place src/ reads
// it: the parts below cli/ get these values through their option structs and arguments.
#pragma once

#include <string>

#include "comm/options.h"
#include "train/config.h"
#include "train/trainer.h"

namespace shardlm::cli {

// getenv, as a comm::SettingLookup.
const char* environment(const char* name);
// SHARDLM_COMM_ALGOS, SHARDLM_COMM_CHUNK_KB, SHARDLM_COMM_WINDOW applied to the defaults.
comm::MpiOptions comm_options();
// OMP_NUM_THREADS (its first number, as OpenMP reads a list), 0 where unset: every --threads'
// default where set, as llm.c and HPC job scripts give threads (`export
// OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK`). A value that is not a whole number in [1, kMaxThreads]
// throws std::invalid_argument naming the variable.
int omp_num_threads();
// Whether an MPI launcher (mpirun, srun) started this process.
bool launched_by_mpi();
// Where the hardware presets are: $SHARDLM_HARDWARE_DIR, else beside the executable.
std::string hardware_dir();
// The test seam SHARDLM_TEST_RANKS_ON_MACHINE=K: consecutive blocks of K ranks are taken for
// machines of their own (TrainConfig::test_ranks_per_machine); 0 where unset.
int test_ranks_per_machine();
// SHARDLM_CUDA_ATTENTION, SHARDLM_CUDA_GEMM_OPERANDS, SHARDLM_CUDA_DEBUG and SHARDLM_CUDA_HEAD_ROWS,
// for the CUDA backend (the local rank, which picks the GPU, is found at start: train/machines.h).
kernels::CudaOptions cuda_options();
// `c` with the fields that come from the environment filled in.
train::TrainConfig with_environment(train::TrainConfig c);
// The test seams of a training run, from the environment (unset: no fault):
// SHARDLM_FAULT_SKIP_COLLECTIVE, SHARDLM_FAULT_KILL, SHARDLM_FAULT_NAN_LOSS (the executor's),
// SHARDLM_FAULT_KILL_MID_WRITE, SHARDLM_FAULT_FAIL_WRITE, SHARDLM_FAULT_KILL_IN_SAVE (a
// checkpoint's save), each RANK:STEP; SHARDLM_TEST_SAVE_AFTER_RESUME=1. A malformed value throws
// std::invalid_argument naming the variable.
train::TrainHooks test_faults();

}  // namespace shardlm::cli
