// The executor's state store: this rank's run-long state as the plan places it. Parameters,
// gradients and AdamW moments (plan::State) are each one flat fp32 buffer holding, unit after
// unit, this rank's part of each unit (element range [s·len_u, (s+1)·len_u) of unit u,
// len_u = padded_u / parts_u; the whole unit when parts_u is 1), as Plan::placement says. A unit
// whose state the plan keeps on disk (--offload) lives in a file of the offload tier, but for its
// resident head; the step brings it into a window (a plan buffer) and takes it back, and between
// steps the store reads and writes every unit's part through a bounce window.
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/comm_groups.h"
#include "tensor/disk_store.h"
#include "tensor/memory.h"
#include "tensor/offload_store.h"

namespace shardlm::run {

// The disk tier (--offload): where this rank's files go and how they are written. Needed when the
// plan places state on disk and the backend computes in host memory (a device's tier is host
// memory: run/host_store.h).
struct OffloadOptions {
  std::string dir;
  DiskStoreOptions io;
};

class StateStore {
 public:
  // This rank's part of one kind of unit u's state: elements [begin, begin + len) of the unit's
  // padded flat buffer, the part `begin / len` of `parts`, at element `at` of this rank's buffer
  // of that kind.
  struct Shard {
    int64_t unit_offset;  // element offset of the unit in the whole flat layout
    int64_t len;
    int64_t begin;
    int parts;
    int64_t at;
  };

  // Allocates the buffers and, when the plan keeps state or activations on disk, creates the
  // files. `plan` and `backend` must outlive the store.
  StateStore(const model::ModelDesc& desc, const plan::Plan& plan, int rank, const kernels::Backend& backend,
             const OffloadOptions& offload);

  Shard shard(plan::State k, int u) const;
  // Whether any unit's state s is on disk (it has a file); whether unit u's is.
  bool on_disk(plan::State s) const { return file_[index(s)] >= 0; }
  bool on_disk(plan::State s, int u) const { return on_disk(s) && plan_.on_disk(plan::kind_of(s), u); }
  // The resident buffer of `s`, which packs only the units kept in memory (the plan's held
  // offsets when none is on disk), and unit u's part (or resident head) in it.
  const Buffer& buffer(plan::State s) const { return buffers_[index(s)]; }
  float* resident(plan::State s, int u) const { return buffer(s).f32() + ram_at_[index(s)][u]; }
  // Unit u's part of state s between its file and `dst` / `src` (window-sized, 4 KiB aligned).
  void disk_read(plan::State s, int u, void* dst);
  void disk_write(plan::State s, int u, const void* src);

  void init_params(uint64_t seed);
  // Every rank receives the whole padded flat buffer (layout of plan.layout) of `which`. Collective.
  void gather_full(plan::State which, float* full, const CommGroups& comms, std::chrono::milliseconds timeout);
  // Takes this rank's part of a whole padded flat buffer.
  void load_full(plan::State which, const float* full);
  // The state buffer itself when this rank holds it whole (a single process, DDP); else null. It is
  // in the backend's memory (device memory on a GPU backend); gather_full and load_full take host
  // memory (on a GPU backend they copy through it, and gather_full's collectives run on the host).
  // Gradients after a step are clipped (when clipping applied).
  float* whole(plan::State which);
  // This rank's buffer of `which` as the plan places it (each unit's part, back to back in unit
  // order; the whole padded flat buffer when every unit is whole); null when the plan holds none. For ckpt/,
  // which reads and writes each rank's element ranges in place.
  // State the plan keeps on disk, and on a device backend all state, is read into a staging copy
  // (memory category staging; on a device in host memory, downloaded, and charged to a pool of the
  // store's own, so the run's tracker keeps counting what the device holds) first; after writing
  // into it, commit_local_state() writes it back (to disk, or uploads it); release_local_state()
  // drops it.
  float* local_state(plan::State which);
  void commit_local_state();
  void release_local_state();

  // The offload tier (disk, or host memory under a device backend); null when nothing is offloaded.
  OffloadStore* tier() const { return tier_.get(); }
  int activation_file() const { return activation_file_; }  // --offload activations' slots (-1: none)

 private:
  static int index(plan::State s) { return static_cast<int>(s); }
  // The optimizer updates its range of each unit in place on the parameters and gradients, so
  // those must hold it.
  void check_placement() const;
  void create_files(const OffloadOptions& offload);
  // Every unit's part, packed as the resident buffer would be (`packed` in the backend's memory),
  // through a bounce window.
  Buffer bounce_window(plan::State s, Buffer::Fill fill) const;
  void disk_read_all(plan::State s, float* packed);
  void disk_write_all(plan::State s, const float* packed);
  // A device's packed state of `s` (offloaded units from the tier) to and from host memory.
  void download_packed(plan::State s, void* host);
  void upload_packed(plan::State s, const void* host);
  void gather_full_from_device(plan::State k, const Buffer& buf, float* full, const CommGroups& comms,
                               std::chrono::milliseconds timeout);
  void init_range(int u, uint64_t seed, float* dst, int64_t begin, int64_t end) const;

  const model::ModelDesc& desc_;
  const plan::Plan& plan_;
  int rank_;  // in the world
  const kernels::Backend& backend_;
  // By State, per unit (U + 1 prefix sums): where its part starts in the resident buffer.
  std::array<std::vector<int64_t>, plan::kNumStateBuffers> ram_at_;
  // The offload tier: files by State (-1: in memory), each unit's byte offset in them, and the
  // staged copies local_state() hands out.
  std::unique_ptr<OffloadStore> tier_;
  std::array<int, plan::kNumStateBuffers> file_{-1, -1, -1, -1};
  std::array<std::vector<int64_t>, plan::kNumStateBuffers> file_at_;
  MemoryPool host_pool_;  // a device's host staging copies; declared before them, so it outlives them
  std::array<Buffer, plan::kNumStateBuffers> staged_;
  int activation_file_ = -1;
  std::array<Buffer, plan::kNumStateBuffers> buffers_;  // by State
};

}  // namespace shardlm::run
