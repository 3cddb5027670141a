// Which ranks of a job share a machine: those that share memory as MPI reports it
// (Communicator::machine, MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the node the launcher
// started each rank on), one all-gather at start. Not a launcher's environment: mpirun, srun and
// mpiexec each name the local ranks in variables of their own, and srun's direct launch sets none
// of Open MPI's, so a job that read OMPI_COMM_WORLD_LOCAL_* alone took every rank for a machine of
// its own there: each rank's memory check counted the whole machine as its, every rank took the
// first GPU, and an in-memory snapshot's partner copy could sit on its own machine. Nor the kernel
// a rank runs on (its boot id): hosts that are network namespaces of one kernel (scripts/cluster.sh)
// or containers the launcher treats as nodes each hold their own /dev/shm, so they are machines.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace shardlm::comm {
class Communicator;
}

namespace shardlm::train {

struct Machines {
  int count = 1;       // machines the job spans
  int ranks_here = 1;  // ranks on this rank's machine, it included: what share its memory
  int local_rank = 0;  // this rank's place among them, in rank order (the GPU it takes)
  // k where every machine holds k consecutive ranks (Open MPI's and Slurm's default block
  // placement): what a snapshot's partner scheme spreads copies by (ckpt::SnapshotScheme). 1
  // otherwise; a placement of any other shape keeps rank r − 1 as partner.
  int block = 1;
  // Ranks whose memory counts against the limit of this rank's memory cgroup, it included
  // (train/cgroups.h: Slurm's job, a container): the ranks under the same limiting cgroup
  // on the same machine. ranks_here where no cgroup limits this rank.
  int ranks_under_memory_limit = 1;
};

// The layout of ranks whose machines are `hosts` (one id per rank), as rank `rank` sees it;
// `memory_limits` (one per rank, "" for none, or empty for no rank limited) name each rank's
// limiting memory cgroup.
Machines machines_of(const std::vector<std::string>& hosts, int rank, const std::vector<std::string>& memory_limits = {});

// Collective: every rank's machine (world.machine()) and limiting memory cgroup, all-gathered,
// then machines_of. A test may instead take
// consecutive blocks of `test_block` ranks for machines (all on this one): test_block > 0.
Machines find_machines(comm::Communicator& world, std::chrono::milliseconds timeout, int test_block = 0);

// Hybrid shard's group where --shard-group is not given: the ranks of one machine, as PyTorch's
// HYBRID_SHARD shards inside a node and replicates across nodes (every rank on one machine: all of
// them). 0 where no run of consecutive ranks is a machine (round-robin or uneven placement).
int machine_shard_group(const Machines& m, int world);

// "1 machine", "2 machines of 4 ranks", "3 machines" (no block placement): for the run header.
std::string describe(const Machines& m);

// The kernel's boot id (a random id each boot), the host name where there is none: what a CPU
// quota and the cores belong to. A cgroup's quota is the kernel's, shared by every process under
// it, whichever machine the launcher took them for (hosts that are namespaces of one kernel share
// it, and their cores).
std::string kernel_id();

// The CPUs this process may run on (its affinity mask); 0 where that is not known.
int allowed_cpus();

// What a rank may run its compute threads on.
struct RankCpus {
  int allowed = 0;          // CPUs of its affinity mask; 0 where not known
  std::string quota_group;  // its machine and CPU quota cgroup (train/cgroups.h), "" for none
  std::string quota_dir;    // that cgroup's directory
  double quota_cpus = 0;    // and its CPUs' worth of time, shared by every rank of the group
};

// The warnings, a line each, for ranks whose `threads` compute threads a rank do not fit what they
// may run on: more threads than a rank's CPU affinity (mpirun binds each rank to one core when it
// starts two or fewer, so `mpirun -np 2 shardlm train --threads 8` ran each rank's eight threads
// on one core, without a word: its MFU is against a peak measured on that core), or more threads
// in a CPU quota's ranks together than its CPUs (docker --cpus, a pod's CPU limit: the threads
// past it are throttled every period, and hold up the others at every barrier).
std::vector<std::string> threads_beyond_cpus(const std::vector<RankCpus>& ranks, int threads);

// Collective: every rank's RankCpus, and rank 0 prints threads_beyond_cpus' lines as warnings on
// stderr (train and calibrate, whose rates would be those of the squeeze).
void warn_of_threads_beyond_cpus(comm::Communicator& world, std::chrono::milliseconds timeout, int threads);

}  // namespace shardlm::train
