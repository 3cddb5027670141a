#include "run/state_store.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "layers/layers.h"
#include "run/host_store.h"

namespace shardlm::run {

using plan::State;

namespace {
MemCategory category_of(State s) {
  switch (s) {
    case State::params: return MemCategory::params;
    case State::grads: return MemCategory::grads;
    default: return MemCategory::optimizer;  // either moment
  }
}
}  // namespace

StateStore::StateStore(const model::ModelDesc& desc, const plan::Plan& plan, int rank, const kernels::Backend& backend,
                       const OffloadOptions& offload)
    : desc_(desc), plan_(plan), rank_(rank), backend_(backend) {
  check_placement();
  const int U = static_cast<int>(desc_.units.size());
  for (int si = 0; si < plan::kNumStateBuffers; ++si) {
    ram_at_[si].assign(1, 0);
    for (int u = 0; u < U; ++u) ram_at_[si].push_back(ram_at_[si].back() + plan_.ram_elems(plan::kind_of(State(si)), u));
  }
  if (plan_.any_on_disk(State::params) || plan_.any_on_disk(State::grads) || plan_.any_on_disk(State::optimizer) ||
      plan_.config.offload.activations)
    create_files(offload);
  for (int si = 0; si < plan::kNumStateBuffers; ++si) {
    const int64_t n = ram_at_[si].back();
    if (n > 0) buffers_[si] = backend_.alloc(category_of(State(si)), sizeof(float) * n, Buffer::Fill::zero);
  }
}

// One file per state kept on disk, "rank-0000R.<state>" (a unit kept in memory takes no room in it).
void StateStore::create_files(const OffloadOptions& offload) {
  char rank[16];
  std::snprintf(rank, sizeof rank, "rank-%05d.", rank_);
  if (!backend_.host_memory()) {
    tier_ = std::make_unique<HostStore>(backend_);
  } else {
    if (offload.dir.empty()) throw std::invalid_argument("--offload: the plan keeps state on disk but no --offload-dir was given");
    tier_ = std::make_unique<DiskStore>(offload.dir, offload.io, std::string(rank, 10));  // "rank-0000R"
  }
  const int U = static_cast<int>(desc_.units.size());
  for (int si = 0; si < plan::kNumStateBuffers; ++si) {
    const State k = plan::kind_of(State(si));
    if (!plan_.any_on_disk(k)) continue;
    std::vector<int64_t>& at = file_at_[si];
    at.assign(1, 0);
    for (int u = 0; u < U; ++u) at.push_back(at.back() + plan_.disk_slot_bytes(k, u));
    file_[si] = tier_->create(rank + std::string(plan::to_string(State(si))), at.back());
  }
  // --offload activations: one slot per offloaded buffer of the step (scratch within a step).
  if (plan_.activation_file_bytes > 0) activation_file_ = tier_->create(rank + std::string("activations"), plan_.activation_file_bytes);
}

// The optimizer updates its range of each unit in place on the parameters and gradients, so
// those must hold it.
void StateStore::check_placement() const {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard o = shard(State::optimizer, u);
    if (o.parts == 0) continue;
    for (State k : {State::params, State::grads}) {
      const Shard h = shard(k, u);
      if (h.parts == 0 || o.begin < h.begin || o.begin + o.len > h.begin + h.len)
        throw std::logic_error("executor: unit " + desc_.units[u].name + "'s " + plan::kind_name(k) +
                               " do not hold its optimizer range");
    }
  }
}

StateStore::Shard StateStore::shard(State k, int u) const {
  const int64_t len = plan_.held_elems(k, u);
  const int parts = plan_.placed(k, u).parts;
  return {plan_.layout.units[u].offset, len, parts > 1 ? plan_.part_index(k, u, rank_) * len : 0, parts,
          plan_.held_offset(k, u)};
}

// A window holds the unit's whole part: its resident head (plan::Placement::resident) from memory,
// then the rest from the file.
void StateStore::disk_read(State s, int u, void* dst) {
  const int64_t head = 4 * plan_.placed(plan::kind_of(s), u).resident;
  const auto& at = file_at_[index(s)];
  if (head > 0) backend_.copy(dst, buffer(s).f32() + ram_at_[index(s)][u], head);
  tier_->read(file_[index(s)], at[u], static_cast<char*>(dst) + head, at[u + 1] - at[u]);
}

void StateStore::disk_write(State s, int u, const void* src) {
  const int64_t head = 4 * plan_.placed(plan::kind_of(s), u).resident;
  const auto& at = file_at_[index(s)];
  if (head > 0) backend_.copy(buffer(s).f32() + ram_at_[index(s)][u], src, head);
  tier_->write(file_[index(s)], at[u], static_cast<const char*>(src) + head, at[u + 1] - at[u]);
}

// Through one window-sized bounce buffer: the file pads each unit to 4 KiB, the packed buffer does not.
// A window-sized buffer for the largest unit's part of state s (transfers are whole, aligned units).
Buffer StateStore::bounce_window(State s, Buffer::Fill fill) const {
  int64_t most = 0;
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) most = std::max(most, plan_.window_bytes(plan::kind_of(s), u));
  return backend_.alloc(MemCategory::staging, most, fill);
}

void StateStore::disk_read_all(State s, float* packed) {
  const State k = plan::kind_of(s);
  const auto& at = file_at_[index(s)];
  Buffer bounce = bounce_window(s, Buffer::Fill::none);
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    if (!on_disk(s, u)) {  // kept in memory (a budget's placement may mix)
      backend_.copy(packed + plan_.held_offset(k, u), buffer(s).f32() + ram_at_[index(s)][u],
                    4 * plan_.held_elems(k, u));
      continue;
    }
    if (at[u + 1] == at[u]) continue;
    disk_read(s, u, bounce.data());
    backend_.wait(kernels::Backend::Lane::compute, backend_.mark(kernels::Backend::Lane::copy));  // the read, then the copy
    backend_.copy(packed + plan_.held_offset(k, u), bounce.data(), 4 * plan_.held_elems(k, u));
  }
}

void StateStore::disk_write_all(State s, const float* packed) {
  const State k = plan::kind_of(s);
  const auto& at = file_at_[index(s)];
  Buffer bounce = bounce_window(s, Buffer::Fill::zero);  // the padding past the unit's part is written too
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    if (!on_disk(s, u)) {
      backend_.copy(const_cast<Buffer&>(buffer(s)).f32() + ram_at_[index(s)][u],
                    packed + plan_.held_offset(k, u), 4 * plan_.held_elems(k, u));
      continue;
    }
    if (at[u + 1] == at[u]) continue;
    backend_.copy(bounce.data(), packed + plan_.held_offset(k, u), 4 * plan_.held_elems(k, u));
    disk_write(s, u, bounce.data());
  }
}

float* StateStore::local_state(State which) {
  const int si = static_cast<int>(which);
  const bool device = !backend_.host_memory();
  if (!device && !on_disk(State(si))) return buffer(which).bytes() ? buffer(which).f32() : nullptr;
  const int64_t bytes = 4 * plan_.held_total(plan::kind_of(which));
  if (bytes == 0) return nullptr;
  if (!staged_[si].data()) {
    if (device) {
      staged_[si] = Buffer(host_pool_, MemCategory::staging, bytes, Buffer::Fill::none);
      download_packed(State(si), staged_[si].data());
    } else {
      staged_[si] = backend_.alloc(MemCategory::staging, bytes, Buffer::Fill::none);
      disk_read_all(State(si), staged_[si].f32());
    }
  }
  return staged_[si].f32();
}

// A device's state comes to the host through the backend's download; offloaded units are first
// packed in device memory from the tier.
void StateStore::download_packed(State s, void* host) {
  const int64_t bytes = 4 * plan_.held_total(plan::kind_of(s));
  if (!on_disk(s)) return backend_.download(host, buffer(s).data(), bytes);
  Buffer packed = backend_.alloc(MemCategory::staging, bytes, Buffer::Fill::none);
  disk_read_all(s, packed.f32());
  backend_.download(host, packed.data(), bytes);
}

void StateStore::upload_packed(State s, const void* host) {
  const int64_t bytes = 4 * plan_.held_total(plan::kind_of(s));
  if (!on_disk(s)) return backend_.upload(const_cast<Buffer&>(buffer(s)).data(), host, bytes);
  Buffer packed = backend_.alloc(MemCategory::staging, bytes, Buffer::Fill::none);
  backend_.upload(packed.data(), host, bytes);
  disk_write_all(s, packed.f32());
}

void StateStore::commit_local_state() {
  for (int si = 0; si < plan::kNumStateBuffers; ++si) {
    if (!staged_[si].data()) continue;
    if (!backend_.host_memory()) upload_packed(State(si), staged_[si].data());
    else disk_write_all(State(si), staged_[si].f32());
  }
  release_local_state();
}

void StateStore::release_local_state() {
  for (Buffer& b : staged_) b = Buffer();
}

float* StateStore::whole(State which) {
  return plan_.held_whole(plan::kind_of(which)) && !on_disk(which) ? buffer(which).f32() : nullptr;
}

// Unit u's initial values of its elements [begin, end) into dst, in the backend's memory (a
// device's are made on the host and uploaded; the padding past the unit stays as it was).
void StateStore::init_range(int u, uint64_t seed, float* dst, int64_t begin, int64_t end) const {
  end = std::min(end, desc_.units[u].numel);
  if (backend_.host_memory()) return layers::init_unit(desc_.units[u], seed, dst, begin, end);
  std::vector<float> host(std::max<int64_t>(0, end - begin));
  layers::init_unit(desc_.units[u], seed, host.data(), begin, end);
  backend_.upload(dst, host.data(), sizeof(float) * host.size());
}

void StateStore::init_params(uint64_t seed) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard(State::params, u);
    if (!on_disk(State::params, u)) {
      const int64_t at = on_disk(State::params) ? ram_at_[index(State::params)][u] : s.at;
      init_range(u, seed, buffers_[index(State::params)].f32() + at, s.begin, s.begin + s.len);
      continue;
    }
    // Offloaded: through a window-sized buffer into the file (and the resident head).
    Buffer window = backend_.alloc(MemCategory::staging, plan_.window_bytes(State::params, u), Buffer::Fill::zero);
    init_range(u, seed, window.f32(), s.begin, s.begin + s.len);
    disk_write(State::params, u, window.data());
  }
}

void StateStore::gather_full(State which, float* full, const CommGroups& comms, std::chrono::milliseconds timeout) {
  const State k = plan::kind_of(which);
  Buffer from_disk;  // offloaded state is read back first, through the disk tier
  if (on_disk(which)) {
    from_disk = backend_.alloc(MemCategory::staging, 4 * plan_.held_total(k), Buffer::Fill::none);
    disk_read_all(which, from_disk.f32());
  }
  const Buffer& buf = from_disk.data() ? from_disk : buffer(which);
  if (plan_.held_total(k) == 0) throw std::logic_error("executor: this plan holds no " + std::string(which == State::grads ? "gradients" : "optimizer state"));
  if (plan_.held_whole(k)) {
    backend_.download(full, buf.data(), buf.bytes());
    return;
  }
  if (!backend_.host_memory()) return gather_full_from_device(k, buf, full, comms, timeout);
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard(k, u);
    if (s.parts == 1) {
      std::copy_n(buf.f32() + s.at, s.len, full + s.unit_offset);
      continue;
    }
    comms.get(plan_.placed(k, u).axes)
        .all_gather(buf.f32() + s.at, full + s.unit_offset, s.len, DType::fp32, "gather state unit " + desc_.units[u].name)
        ->wait(timeout);
  }
}

// Device memory: each rank's part comes to its own place in `full` on the host, then the
// group's parts are gathered there in place (the group's members are the parts in order).
void StateStore::gather_full_from_device(State k, const Buffer& buf, float* full, const CommGroups& comms,
                                         std::chrono::milliseconds timeout) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard(k, u);
    float* mine = full + s.unit_offset + s.begin;
    backend_.download(mine, buf.f32() + s.at, sizeof(float) * s.len);
    if (s.parts == 1) continue;
    comm::Communicator& c = comms.host(plan_.placed(k, u).axes);
    if (s.begin != c.rank() * s.len) throw std::logic_error("executor: unit " + desc_.units[u].name + "'s parts are not in group order");
    c.all_gather(mine, full + s.unit_offset, s.len, DType::fp32, "gather state unit " + desc_.units[u].name)->wait(timeout);
  }
}

void StateStore::load_full(State which, const float* full) {
  Buffer& buf = const_cast<Buffer&>(buffer(which));
  const State k = plan::kind_of(which);
  if (plan_.held_total(k) == 0) return;
  if (on_disk(which)) {  // this rank's ranges, packed, then to the file
    Buffer packed = backend_.alloc(MemCategory::staging, 4 * plan_.held_total(k), Buffer::Fill::none);
    for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
      const Shard s = shard(k, u);
      backend_.upload(packed.f32() + s.at, full + s.unit_offset + s.begin, sizeof(float) * s.len);
    }
    return disk_write_all(which, packed.f32());
  }
  if (plan_.held_whole(k)) {
    if (buf.f32() != full) backend_.upload(buf.data(), full, buf.bytes());
    return;
  }
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard(k, u);
    backend_.upload(buf.f32() + s.at, full + s.unit_offset + s.begin, sizeof(float) * s.len);
  }
}

}  // namespace shardlm::run
