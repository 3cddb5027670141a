// NCCL behind the communicator interface: collectives straight on device memory (a CUDA GPU's),
// one GPU per rank. Built only where the CUDA backend is (-DSHARDLM_CUDA=ON) and CMake found
// nccl.h and libnccl; elsewhere make_nccl_communicator refuses with one line.
//
// comm knows nothing of kernels: the compute stream the collectives are ordered after comes in as
// an opaque handle (a cudaStream_t), which run/ takes from its kernels::Backend.
//
// How a collective runs (comm::NcclCommunicator, nccl.cc):
//  - Each communicator has a CUDA stream of its own. A collective records an event on the compute
//    stream, makes its stream wait for that event (so it reads what every kernel issued before it
//    wrote), launches the NCCL call on its stream and records a completion event there. The call
//    returns at once; the Work is complete when cudaEventQuery says that event has happened. Work
//    issued on the compute stream after wait() returned sees the results.
//  - Work::wait polls the event with the same timeout and TimeoutError line as the MPI backend
//    (backend "nccl"); NCCL cannot tell which peer is missing, so the line names none. An
//    asynchronous NCCL error (ncclCommGetAsyncError) ends the collective as comm::Error naming it.
//  - Reductions are NCCL's sums (fp32 and bf16; NCCL's bf16 rounding, not the MPI backend's
//    widen-add-round in rank order); scratch_bytes is 0 (NCCL keeps its own buffers).
//  - all_to_all / all_to_all_v are groups of ncclSend / ncclRecv; send / recv are ncclSend /
//    ncclRecv, each in a group of its own. NCCL has no tags: messages between two ranks match in
//    the order they were issued, whatever their tag (the tag is checked for range only).
//  - barrier is an all_reduce of one float on the device. split is ncclCommSplit (collective over
//    this communicator, blocking; a negative color gives nullptr).
//  - Construction is collective over `bootstrap` (host memory, MPI in a job): every rank tells the
//    others its GPU's UUID; two ranks on one GPU are refused with one line on every rank (NCCL
//    refuses them; the staged path of comm/staged.h serves that case). Then rank 0 makes the
//    unique id (ncclGetUniqueId) and broadcasts it, and every rank calls ncclCommInitRank on the
//    calling thread's current device.
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "comm/options.h"

namespace shardlm::comm {

// Whether this build has the NCCL backend.
bool nccl_built();

// An NcclCommunicator over the ranks of `bootstrap` (which it uses only while constructing),
// ordered after `compute_stream` (a cudaStream_t; null: the legacy default stream). Collective
// over `bootstrap`; `timeout` bounds its host exchanges. Throws Error, one line, where NCCL cannot
// be used: a build without it, no CUDA device, two ranks on one GPU, NCCL's own failure.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, void* compute_stream,
                                                     WaitPolicy wait = {},
                                                     std::chrono::milliseconds timeout = kDefaultTimeout);

}  // namespace shardlm::comm
