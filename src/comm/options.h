// Settings of the communicators: the default collective timeout, how a waiting thread polls,
// and which algorithm the MPI backend runs for each collective.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "tensor/dtype.h"

namespace shardlm::comm {

// A collective that has not finished after this long is an error (no rank hangs).
inline constexpr std::chrono::milliseconds kDefaultTimeout{300'000};

// How Work::wait polls. It tests the collective back to back (yielding the core between tests,
// so an oversubscribed compute thread still runs) for `spin`, then sleeps between tests, the
// sleep doubling from 1 µs up to `max_sleep`. Progress of an MPI collective happens only inside
// these tests, so a long sleep delays it; a short one costs the waiting thread's core.
struct WaitPolicy {
  std::chrono::microseconds spin{2000};
  std::chrono::microseconds max_sleep{50};
};

// How the MPI backend carries out a collective.
//   native          the MPI library's nonblocking collective (MPI_Iallgather, MPI_Iallreduce,
//                   MPI_Ireduce_scatter_block, MPI_Ialltoall, MPI_Ialltoallv).
//   direct          every rank exchanges with every other rank at once through MPI_Isend /
//                   MPI_Irecv (reductions: chunked, each chunk summed as soon as it arrives).
//   ring            n−1 steps around the ring of ranks, each chunk pipelined on its own.
//   via_all_reduce  reduce_scatter only: MPI_Iallreduce of the whole buffer, keep own block.
//   automatic       what bench/comm_bench.cc measured fastest (see mpi_backend.h).
// all_reduce accepts native, direct (direct reduce-scatter + direct all-gather) and ring (ring
// reduce-scatter + ring all-gather); all_to_all and broadcast accept native and direct (the
// root sends the whole buffer to every other rank).
enum class Algorithm { automatic, native, direct, ring, via_all_reduce };

const char* to_string(Algorithm a);
// Throws std::invalid_argument on an unknown name.
Algorithm parse_algorithm(const std::string& name);

struct MpiOptions {
  Algorithm all_gather = Algorithm::automatic;
  Algorithm reduce_scatter = Algorithm::automatic;
  Algorithm all_reduce = Algorithm::automatic;
  Algorithm all_to_all = Algorithm::automatic;  // all_to_all_v too
  Algorithm broadcast = Algorithm::automatic;
  // Granularity of the point-to-point algorithms' reductions: a chunk is received, summed and
  // forwarded while the next ones are in flight. `window` chunks are in flight per peer; the
  // staging memory (MemCategory::comm) of one collective is at most
  //   direct: window · (size−1) · chunk_bytes,   ring: 2 · window · chunk_bytes.
  int64_t chunk_bytes = 1 << 20;
  int window = 4;
  WaitPolicy wait;
};

// The two reductions, for queries about them (Communicator::scratch_bytes).
enum class Reduction { reduce_scatter, all_reduce };

// The algorithm `automatic` stands for in a group of `size` ranks (mpi_backend.h says why);
// others are returned unchanged. `collective` is "all_gather", "reduce_scatter", "all_reduce",
// "all_to_all" or "broadcast".
Algorithm resolve_algorithm(const std::string& collective, Algorithm requested, int size);

// Communicator::scratch_bytes of the MPI backend with these options: the staging of the chunked
// schedules (direct: window·(size−1) chunks, ring: 2·window chunks, each chunk at most
// chunk_bytes), or the whole buffer for via_all_reduce; native needs none (an in-place native
// reduce_scatter takes its temporary from the communicator's pool).
int64_t mpi_scratch_bytes(const MpiOptions& o, Reduction op, int64_t count, DType dtype, int size);

// Where settings come from: a setting's value by name, or null when unset. comm reads none itself
// (the command line passes the environment in; tests pass a table).
using SettingLookup = std::function<const char*(const char* name)>;

// Applies the settings SHARDLM_COMM_ALGOS (e.g. "reduce_scatter=ring,all_reduce=native"; keys
// all_gather, reduce_scatter, all_reduce, all_to_all, broadcast), SHARDLM_COMM_CHUNK_KB and
// SHARDLM_COMM_WINDOW to `base`. Throws std::invalid_argument naming a malformed one.
MpiOptions mpi_options_from(const SettingLookup& settings, MpiOptions base = {});

}  // namespace shardlm::comm
