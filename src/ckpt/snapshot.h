// In-memory snapshots (after REFT, Gemini and NVRx): each rank copies its shard of the training
// state into POSIX shared memory that outlives the process, so that a crashed job restarts from
// the last step instead of the last disk checkpoint.
//
// Segments (/dev/shm/NAME), named after the rank that HOLDS them, so a lost node is every segment
// of its ranks:
//   shardlm-<xxh64 of the run directory>-rank<h>-own-slot<s>         rank h's own state
//   shardlm-<…>-rank<h>-copy<r>-slot<s>       rank r's state, held by h = (r−1) mod N (partner copy;
//                                             r − ranks per machine over several: SnapshotScheme)
//   shardlm-<…>-rank<h>-parity<g>-slot<s>     XOR of group g's states (ranks gG … gG+G−1), held by
//                                             h = (g+1)·G mod N, outside the group (--snapshot-parity G)
// Two slots per segment: a snapshot overwrites the older one, so the one being written is never
// the only one. A slot is kHeaderBytes of header (magic and format version, step, world, who
// holds it, whose state it is — the run's id, the owner's rank and its coordinates on the mesh —
// the payload's xxh64, the run state as JSON, the header's own xxh64 over all of these, then the
// valid flag, set last) followed by the payload: the rank's state buffers back to back as it
// holds them. The valid flag is cleared before a slot is rewritten and set only after payload
// and header are complete, so a process killed mid-write leaves an invalid slot, never a wrong one.
//
// Trust: a slot is used only if its header and payload checksums verify and its header says it
// is what its name says (a segment renamed to another rank's name holds that other rank's state)
// and belongs to this run, at this world size and mesh place. A slot that fails its checksums
// taints its step (the memory that held it is not trusted); a slot that is someone else's, like a
// missing segment (a lost node), is rebuilt from its partner copy or from parity + the group's
// other states, verified against the checksum the redundancy recorded.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/sharded.h"
#include "comm/communicator.h"
#include "tensor/memory.h"

namespace shardlm::ckpt {

inline constexpr int64_t kSnapshotHeaderBytes = 16384;
inline constexpr int kMaxParityGroup = 64;
inline constexpr int kMaxRunIdChars = 39;
inline constexpr int kMaxMeshAxes = 4;
inline constexpr int kMaxAxisNameChars = 15;

// "shardlm-<16 hex digits>" for the run directory `run_dir` (its absolute, normalised path).
std::string snapshot_prefix(const std::string& run_dir);

// Who holds what. parity_group 0: partner copies; G >= 2: XOR parity per group of G ranks.
// ranks_per_node: ranks of the job on each machine, consecutive ranks together (Open MPI's and
// Slurm's default block placement). Where several machines hold the same count, rank r's partner
// copy goes to the same place on the previous machine, (r − ranks_per_node) mod N, so that losing
// a machine loses no state that only it held; on one machine (or uneven counts) to r − 1. Parity
// groups are consecutive ranks whatever the machines.
struct SnapshotScheme {
  int world = 1;
  int parity_group = 0;
  int ranks_per_node = 1;
  int stride() const {
    return ranks_per_node > 1 && ranks_per_node < world && world % ranks_per_node == 0 ? ranks_per_node : 1;
  }
  // Rank r's partner copy is held by partner_of(r), which holds copy_source's; its group's parity by
  // parity_holder(group).
  int partner_of(int r) const { return (r + world - stride()) % world; }
  int copy_source(int r) const { return (r + stride()) % world; }
  int group_of(int r) const { return r / parity_group; }
  int parity_holder(int g) const { return ((g + 1) * parity_group) % world; }
  bool redundant() const { return world > 1; }
  // Throws naming --snapshot-parity when G does not divide the world or leaves no rank outside a group.
  void check() const;
};

// Bytes of shared memory rank `rank` maps (both slots of every segment it holds, plus the
// receive buffers it folds parity with) for a state of `payload_bytes` per rank: the plan's
// `snapshot` figure.
int64_t snapshot_bytes_held(const SnapshotScheme& scheme, int rank, int64_t payload_bytes);
// The most any rank maps.
int64_t snapshot_bytes_most(const SnapshotScheme& scheme, int64_t payload_bytes);

// The ranks' places on the mesh: the axes' names (outermost first) and each rank's coordinate on
// every axis, as the plan lays them out. A slot records its state's owner's place.
struct SnapshotMesh {
  std::vector<std::string> axes;
  std::vector<std::vector<int>> of_rank;  // [rank][axis]
};

// One slot as found in /dev/shm.
struct SlotInfo {
  std::string name;
  int holder = -1;
  std::string role;    // "own", "copy", "parity"
  int source = -1;     // whose state (own, copy) or which group (parity)
  int slot = -1;
  int64_t step = -1, world = 0, bytes = 0;
  std::string run_id;  // the run that wrote it (from a header that verifies)
  // "ok", "incomplete" (being written when its writer died), or what fails: its checksums, or a
  // header that says it is not the state its name says (a segment renamed to another's name).
  std::string status;
};
// Every slot of every segment whose name starts with `prefix` ("shardlm-" for all runs).
// verify: checks the payload's checksum too (reads every byte).
std::vector<SlotInfo> list_snapshot_slots(const std::string& prefix, bool verify);
// Removes every segment whose name starts with `prefix`; returns how many.
int remove_snapshot_segments(const std::string& prefix);

// A rank's state buffers (host memory), copied back to back into the payload.
struct StatePart {
  float* data = nullptr;
  int64_t bytes = 0;
};

// What --resume auto found: the newest step every rank's state can be had at, or none (step -1),
// and why, in words.
struct SnapshotChoice {
  int64_t step = -1;
  std::string why;
  std::string run_id;   // the run whose snapshot it is
  nlohmann::json meta;  // the run state recorded with the snapshot
  // The world that took it: this run's, or (find_resharded) another, whose states are resharded
  // into this run's layout as they are restored.
  int world = 0;
};

// One rank's snapshots of one run. Collective methods are called by every rank in the same order.
class SnapshotStore {
 public:
  // One held slot as every rank sees it (all-gathered by find_newest).
  struct Entry {
    int32_t holder, role, source, status;  // role: 0 own, 1 copy, 2 parity; status: 0 ok, 1 unusable here, 2 corrupt
    int32_t members, pad;                  // parity: the group's size
    int64_t step;                          // -1: unknown (its header failed)
  };

  // `mesh`: every rank's place (of_rank has one row per rank of `world`). Mappings and parity
  // buffers are charged to `memory` (MemCategory::snapshot), which must outlive the store.
  SnapshotStore(const std::string& run_dir, comm::Communicator& world, MemoryPool& memory, SnapshotScheme scheme,
                SnapshotMesh mesh, std::chrono::milliseconds timeout);
  ~SnapshotStore();
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  const std::string& prefix() const { return prefix_; }

  // Collective. Writes `parts` and `meta` (the run state, JSON) as step `step` of run `run_id`
  // into this rank's older own slot, then its redundancy: the partner copy / the group's parity.
  // Each slot's header names the run, whose state it holds and that owner's mesh place.
  void save(const std::string& run_id, int64_t step, const nlohmann::json& meta, const std::vector<StatePart>& parts);

  // Collective. The newest step of run `run_id` at which every rank's state (payload of
  // `payload_bytes` each) is held verified or can be rebuilt, at this world size and mesh; no
  // step is used where any slot failed its checksum, and no slot whose header says it is another
  // run's, or another rank's state than its name says, is used (each is printed, with why).
  SnapshotChoice find_newest(int64_t payload_bytes, const std::string& run_id);

  // Collective. Fills every rank's `parts` from `choice` (own slot, or rebuilt from the partner
  // copy or from parity), each slot checked again to be this rank's state of the chosen run and
  // step; returns how this rank's state was had ("own", "partner copy", "parity").
  std::string restore(const SnapshotChoice& choice, const std::vector<StatePart>& parts);

  // Collective. Where this world's size differs from the one that took the snapshots (a lost
  // machine's survivors): the newest step of run `run_id` at which every state of the world that
  // took it is held verified, own or as a partner copy, in any segment a rank of this world can
  // map (its machine's /dev/shm, whichever rank's name the segment has). Parity is not rebuilt
  // across world sizes. choice.world is that world; the meta is the snapshot's.
  SnapshotChoice find_resharded(const std::string& run_id);

  // Collective, after find_resharded: fills this rank's buffers `bufs` under `layout` from the
  // chosen step's states, laid out by `taken` (the world that took them), through the same
  // resharding code a checkpoint loads by (ckpt/sharded.h's fill_rank). Each state travels,
  // verified, from the rank that holds it to each rank that needs part of it; nothing is read
  // from disk.
  void restore_resharded(const SnapshotChoice& choice, const model::ModelDesc& desc, const ShardedLayout& taken,
                         const ShardedLayout& layout, const RankBuffers& bufs);

  // Maps both slots of every segment this rank holds under the scheme (creating them), and a
  // parity holder's receive buffers: from here on the rank holds snapshot_bytes_held().
  void prepare(int64_t payload_bytes);

  // Unmaps and removes every segment this rank holds (the run ended normally, or it starts a
  // timeline of its own).
  void remove_held();

 private:
  struct Mapped;
  // This rank's segment `role` slot `slot`: created (or resized) to hold `payload_bytes` when
  // `create`, else mapped as it is, or null when absent.
  Mapped* map_slot(const std::string& role, int slot, int64_t payload_bytes, bool create);
  std::string segment(const std::string& role, int slot) const;
  std::vector<std::string> held_roles() const;  // "own", "copy<r>", "parity<g>"
  // How rank r's state at step s can be had from table_: "own", "partner copy", "group's parity"
  // or "" (it cannot).
  std::string how_held(int r, int64_t s) const;
  const Entry* parity_entry(int r, int64_t s) const;

  comm::Communicator& world_;
  MemoryPool& memory_;
  SnapshotScheme scheme_;
  SnapshotMesh mesh_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
  int rank_;
  std::map<std::string, Mapped*> mapped_;  // by segment name
  std::vector<Entry> table_;               // every rank's held slots, from find_newest
  // find_resharded's: per state of the world that took the chosen step, the rank of this world
  // that serves it and the segment it maps.
  struct Served {
    int server = -1;
    std::string segment;
  };
  std::vector<Served> served_;
  std::vector<Buffer> scratch_;            // a parity holder's receive buffers, one per member
};

}  // namespace shardlm::ckpt
