// The communicators a plan's collectives run on (CommGroups): one per set of mesh axes, split from
// the world once, in the same order on every rank.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/staged.h"
#include "kernels/backend.h"
#include "plan/mesh.h"
#include "plan/plan.h"

namespace shardlm::run {

// The communicators a plan's collectives run on, one per set of mesh axes: the ranks that agree
// with this one on every other axis. Split from the world once, at construction (a collective
// call on every rank), for every set of the mesh's axes with more than one rank on them; a set
// spanning all of them is the world.
//
// Collectives issued from two threads on one communicator could be ordered differently on two
// ranks, so each stream that issues collectives has communicators of its own: the comm stream's
// (`get`), and, when the mesh has an expert axis, the exchange stream's (`exchange`: one per set of
// axes that includes it).
//
// Buffers live in the backend's memory. Made with a backend whose memory is not the host's (a
// GPU's), `get` answers with a communicator over device memory for each group, and `host` with the
// group itself, for what the executor keeps in host memory (loss and norm sums, gather_full's
// output). Which one `get` gives is `device`'s choice:
//   staged  comm/staged.h: device -> host -> MPI -> device, copies through the backend (any number
//           of ranks per GPU);
//   nccl    comm/nccl.h: NCCL over the world (bootstrapped through it), ordered after the backend's
//           stream, and its groups split from it (ncclCommSplit) in the order of `host`'s; one GPU
//           per rank (NCCL's construction refuses ranks sharing one, with one line).
// Without a device backend, or with a host-memory one, both are the group itself (`device` unused).
enum class DeviceCollectives { staged, nccl };

class CommGroups {
 public:
  CommGroups(comm::Communicator& world, const plan::Mesh& mesh, const kernels::Backend* backend = nullptr,
             DeviceCollectives device = DeviceCollectives::staged);
  CommGroups(comm::Communicator& world, const plan::Plan& plan, const kernels::Backend* backend = nullptr,
             DeviceCollectives device = DeviceCollectives::staged)
      : CommGroups(world, plan.mesh, backend, device) {}
  ~CommGroups();
  // The world over host memory.
  comm::Communicator& world() const { return world_; }
  const plan::Mesh& mesh() const { return mesh_; }
  // This rank's group over `axes` (indices into the mesh), for buffers in the backend's memory.
  comm::Communicator& get(const std::vector<int>& axes) const;
  // The same group, for buffers in host memory.
  comm::Communicator& host(const std::vector<int>& axes) const;
  // The exchange stream's group over `axes`, for buffers in the backend's memory (staged through
  // host memory on a device backend; exchanges over NCCL are refused), and the same group for
  // host buffers (an exchange's sizes).
  comm::Communicator& exchange(const std::vector<int>& axes) const;
  comm::Communicator& exchange_host(const std::vector<int>& axes) const;
  // The pipe's group (the ranks holding the other stages of this rank's model copy), for the
  // send and recv streams alone, over the backend's memory. Throws std::logic_error without a pipe.
  comm::Communicator& pipe() const;
  // Whether get() stages through host memory (made with a device-memory backend).
  bool staged() const { return copier_ != nullptr; }
  // Whether get() is NCCL's (made with a device-memory backend and DeviceCollectives::nccl).
  bool nccl() const { return nccl_world_ != nullptr; }
  // What get() moves device memory with, for the run's header: "nccl", "mpi staged through host
  // memory", or the world's backend.
  std::string describe() const;

 private:
  // Bit a: axis a, for the axes of more than one rank (the others change no group).
  unsigned key(const std::vector<int>& axes) const;
  comm::Communicator& world_;
  plan::Mesh mesh_;
  unsigned all_ = 0;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> groups_, exchange_groups_;
  std::unique_ptr<comm::Communicator> pipe_, staged_pipe_;
  // Declared after what they wrap, so they go first.
  std::unique_ptr<comm::DeviceCopier> copier_;
  std::unique_ptr<comm::Communicator> staged_world_;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> staged_groups_, staged_exchange_groups_;
  std::unique_ptr<comm::Communicator> nccl_world_;
  std::map<unsigned, std::unique_ptr<comm::Communicator>> nccl_groups_;
};

}  // namespace shardlm::run
