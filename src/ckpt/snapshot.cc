#include "ckpt/snapshot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <stdexcept>
#include <xxhash.h>

namespace shardlm::ckpt {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The last character is the format's version. 2: the header names the run and the state's owner
// (version 1 slots lack them and are refused, not misread).
constexpr char kMagic[8] = {'S', 'L', 'M', 'S', 'N', 'A', 'P', '2'};
constexpr size_t kMagicNameBytes = 7;  // "SLMSNAP": a shardlm snapshot of some version
constexpr int64_t kChunk = 8 << 20;  // bytes per message and per checksum update
constexpr int64_t kMetaOffset = 1024, kChecksumOffset = kSnapshotHeaderBytes - 16,
                  kValidOffset = kSnapshotHeaderBytes - 8;
constexpr int kTagSave = 0x5a1, kTagRestore = 0x5a2;
const char* const kShmDir = "/dev/shm";

enum Role : int32_t { own = 0, copy = 1, parity = 2 };

// The fixed fields at the start of a slot; the run state's JSON follows at kMetaOffset, the
// header's XXH64 (of bytes [0, kChecksumOffset): these fields and the JSON) at kChecksumOffset
// and the valid flag (1: the slot is complete) at kValidOffset.
struct Header {
  char magic[8];
  int64_t step;
  int32_t world, holder, role, source, members, meta_bytes;
  int64_t payload_bytes;
  uint64_t payload_xxh64;
  char run_id[kMaxRunIdChars + 1];  // the run that wrote it, NUL-terminated
  int32_t mesh_axes;                // own, copy: the owner's (rank `source`'s) place on the mesh
  char axis_name[kMaxMeshAxes][kMaxAxisNameChars + 1];
  int32_t coordinate[kMaxMeshAxes];
  uint64_t member_xxh64[kMaxParityGroup];  // parity: the group's states' checksums, for a rebuild
};
static_assert(sizeof(Header) <= kMetaOffset);

std::atomic<uint32_t>* valid_flag(char* base) { return reinterpret_cast<std::atomic<uint32_t>*>(base + kValidOffset); }

uint64_t header_checksum(const char* base) { return XXH64(base, kChecksumOffset, 0); }

std::string errno_text() { return std::strerror(errno); }

// The status of a slot written in another version of the format: not this run's to use, though
// nothing says its memory is damaged.
const std::string kOtherFormat = "written in another snapshot format";

// "ok", "incomplete" (valid flag 0: its writer died mid-write) or what is wrong, for a slot of
// `size` bytes at `base`; `h` receives the header.
std::string check_slot(const char* base, int64_t size, bool verify_payload, Header* h) {
  if (size < kSnapshotHeaderBytes) return "shorter than its header";
  std::memcpy(h, base, sizeof(Header));
  uint32_t valid;
  std::memcpy(&valid, base + kValidOffset, 4);
  if (valid == 0) return "incomplete";
  if (valid != 1) return "valid flag is " + std::to_string(valid);
  if (std::memcmp(h->magic, kMagic, kMagicNameBytes) == 0 && h->magic[7] != kMagic[7])
    return kOtherFormat + " (" + std::string(h->magic, 8) + "; this shardlm reads " + std::string(kMagic, 8) + ")";
  if (std::memcmp(h->magic, kMagic, 8) != 0) return "not a shardlm snapshot";
  uint64_t sum;
  std::memcpy(&sum, base + kChecksumOffset, 8);
  if (sum != header_checksum(base)) return "header checksum mismatch";
  if (h->payload_bytes != size - kSnapshotHeaderBytes) return "size disagrees with its header";
  if (verify_payload && XXH64(base + kSnapshotHeaderBytes, h->payload_bytes, 0) != h->payload_xxh64)
    return "payload checksum mismatch";
  return "ok";
}

const char* role_name(int32_t role) { return role == Role::own ? "own" : role == Role::copy ? "copy" : "parity"; }

std::string run_of(const Header& h) { return std::string(h.run_id, strnlen(h.run_id, sizeof h.run_id)); }

// Why a slot whose header verified is not what its name says (held by `holder`, in role `role`,
// of rank or group `source`), or "": a segment renamed to another rank's name, say, holds that
// other rank's state, and must not be taken for this one's.
std::string not_as_named(const Header& h, int holder, const std::string& role, int source) {
  if (h.holder == holder && role == role_name(h.role) && h.source == source) return "";
  const std::string whose = h.role == Role::parity ? "group " + std::to_string(h.source) + "'s parity"
                                                    : "rank " + std::to_string(h.source) + "'s state";
  return "holds " + whose + " as rank " + std::to_string(h.holder) + " wrote it (" + role_name(h.role) +
         "), not what its name says";
}

// Why a slot whose header verified and is what its name says is not state of run `run_id` at the
// place `mesh` gives its owner, or "".
std::string not_of_run(const Header& h, const std::string& run_id, const SnapshotMesh& mesh) {
  if (run_of(h) != run_id)
    return "of another run (" + (run_of(h).empty() ? std::string("none named") : run_of(h)) + "; this run is " +
           (run_id.empty() ? std::string("new") : run_id) + ")";
  if (h.role == Role::parity) return "";
  if (h.source < 0 || h.source >= static_cast<int>(mesh.of_rank.size()))
    return "of rank " + std::to_string(h.source) + ", outside this world";
  const std::vector<int>& want = mesh.of_rank[h.source];
  bool same = h.mesh_axes == static_cast<int32_t>(mesh.axes.size());
  for (int a = 0; same && a < h.mesh_axes; ++a)
    same = mesh.axes[a] == h.axis_name[a] && want[a] == h.coordinate[a];
  if (same) return "";
  std::string was, is;
  for (int a = 0; a < std::min(h.mesh_axes, kMaxMeshAxes); ++a)
    was += std::string(a ? ", " : "") + h.axis_name[a] + "=" + std::to_string(h.coordinate[a]);
  for (size_t a = 0; a < mesh.axes.size(); ++a) is += (a ? ", " : "") + mesh.axes[a] + "=" + std::to_string(want[a]);
  return "taken with rank " + std::to_string(h.source) + " at another place on the mesh (" + was + "; this run has it at " +
         is + ")";
}

// Completes a slot whose payload is written: fields, meta, header checksum, then the valid flag.
void commit_slot(char* base, Header h, const json& meta) {
  const std::string m = meta.dump();
  if (static_cast<int64_t>(m.size()) > kChecksumOffset - kMetaOffset)
    throw std::runtime_error("snapshot: run state of " + std::to_string(m.size()) + " bytes does not fit the header");
  std::memcpy(h.magic, kMagic, 8);
  h.meta_bytes = static_cast<int32_t>(m.size());
  std::memcpy(base, &h, sizeof h);
  std::memcpy(base + kMetaOffset, m.data(), m.size());
  const uint64_t sum = header_checksum(base);
  std::memcpy(base + kChecksumOffset, &sum, 8);
  valid_flag(base)->store(1, std::memory_order_release);
}

// Hands a mapping back to the kernel. Holds nothing: one instance serves every mapping.
class Unmapper final : public Buffer::Owner {
 public:
  void give_back(void* data, size_t bytes) override { ::munmap(data, bytes); }
};
Unmapper unmapper;

// A mapping of a whole segment, charged to MemCategory::snapshot of `memory`.
Buffer map_segment(MemoryPool& memory, const std::string& name, int64_t bytes, bool create) {
  const std::string path = "/" + name;
  const int fd = ::shm_open(path.c_str(), O_RDWR | (create ? O_CREAT : 0), 0600);
  if (fd < 0) throw std::runtime_error("snapshot " + name + ": cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw std::runtime_error("snapshot " + name + ": cannot stat: " + errno_text());
  }
  if (!create) bytes = st.st_size;
  else if (st.st_size != bytes && ::ftruncate(fd, bytes) != 0) {
    ::close(fd);
    throw std::runtime_error("snapshot " + name + ": cannot size to " + std::to_string(bytes) + " bytes: " + errno_text());
  }
  // ftruncate leaves the segment sparse: a write into the mapping past what the tmpfs can hold
  // (a container's /dev/shm is 64 MiB unless given more) is a SIGBUS, not an error. Reserve it.
  if (create && bytes > 0) {
    if (const int err = ::posix_fallocate(fd, 0, bytes); err != 0) {
      ::close(fd);
      if (st.st_size == 0) ::shm_unlink(path.c_str());  // made here: no older slot in it to keep
      struct statvfs fs {};
      const std::string room = ::statvfs(kShmDir, &fs) == 0
                                   ? " (" + std::to_string(fs.f_bavail * fs.f_frsize) + " bytes free of its " +
                                         std::to_string(fs.f_blocks * fs.f_frsize) + ")"
                                   : "";
      throw std::runtime_error("snapshot " + name + ": " + kShmDir + " has no room for " + std::to_string(bytes) +
                               " bytes" + room + ": " + std::strerror(err) +
                               "; give it more (a container: --shm-size) or take no --snapshot-every");
    }
  }
  void* p = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : nullptr;
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("snapshot " + name + ": cannot map: " + errno_text());
  return Buffer::adopt(memory, MemCategory::snapshot, p, bytes, unmapper);
}

// Segment names in /dev/shm starting with `prefix`.
std::vector<std::string> segments_named(const std::string& prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(kShmDir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// prefix-rank<h>-<role>[<source>]-slot<s> → its parts (false for another name).
bool parse_name(const std::string& name, SlotInfo& s) {
  const size_t at = name.find("-rank");
  if (at == std::string::npos) return false;
  char role[16] = {};
  int holder, slot, n = 0;
  if (std::sscanf(name.c_str() + at, "-rank%d-%15[a-z]%n", &holder, role, &n) != 2) return false;
  const char* rest = name.c_str() + at + n;
  int source = holder;
  if (std::strcmp(role, "own") != 0 && std::sscanf(rest, "%d", &source) != 1) return false;
  const char* sl = std::strstr(rest, "-slot");
  if (!sl || std::sscanf(sl, "-slot%d", &slot) != 1) return false;
  s.name = name, s.holder = holder, s.role = role, s.source = source, s.slot = slot;
  return true;
}

// Whether the slot named `name` holds what its name says.
bool is_named_state(const std::string& name, const Header& h) {
  SlotInfo s;
  return parse_name(name, s) && not_as_named(h, s.holder, s.role, s.source).empty();
}

void wait_all(std::vector<std::shared_ptr<comm::Work>>& works, std::chrono::milliseconds timeout) {
  for (auto& w : works) w->wait(timeout);
  works.clear();
}

// Point to point in chunks (a message's count is an int in MPI); both sides chunk alike.
void send_bytes(comm::Communicator& c, const char* p, int64_t n, int peer, int tag,
                std::vector<std::shared_ptr<comm::Work>>& works) {
  for (int64_t o = 0; o < n; o += kChunk)
    works.push_back(c.send(p + o, std::min(kChunk, n - o), DType::int8, peer, tag, "snapshot send"));
}
void recv_bytes(comm::Communicator& c, char* p, int64_t n, int peer, int tag,
                std::vector<std::shared_ptr<comm::Work>>& works) {
  for (int64_t o = 0; o < n; o += kChunk)
    works.push_back(c.recv(p + o, std::min(kChunk, n - o), DType::int8, peer, tag, "snapshot recv"));
}

template <class T>
std::vector<T> gather(comm::Communicator& c, const T& mine, std::chrono::milliseconds timeout, const char* label) {
  std::vector<T> all(c.size());
  c.all_gather(&mine, all.data(), sizeof(T), DType::int8, label)->wait(timeout);
  return all;
}

void xor_into(char* dst, const char* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t a, b;
    std::memcpy(&a, dst + i, 8);
    std::memcpy(&b, src + i, 8);
    a ^= b;
    std::memcpy(dst + i, &a, 8);
  }
  for (; i < n; ++i) dst[i] ^= src[i];
}

constexpr int kMaxEntries = 16;
struct EntryList {
  int32_t count;
  int32_t pad;
  SnapshotStore::Entry e[kMaxEntries];
};

}  // namespace

struct SnapshotStore::Mapped {
  Buffer buf;
  char* base() const { return buf.as<char>(); }
};

std::string snapshot_prefix(const std::string& run_dir) {
  std::error_code ec;
  const std::string p = fs::weakly_canonical(fs::absolute(run_dir, ec), ec).string();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH64(p.data(), p.size(), 0)));
  return std::string("shardlm-") + hex;
}

void SnapshotScheme::check() const {
  if (parity_group == 0) return;
  if (parity_group < 2 || parity_group > kMaxParityGroup || world % parity_group != 0 || world / parity_group < 2)
    throw std::invalid_argument("--snapshot-parity " + std::to_string(parity_group) + ": groups must split the " +
                                std::to_string(world) + " ranks evenly (2 to " + std::to_string(kMaxParityGroup) +
                                " each) and leave a rank outside each group to hold its parity");
}

int64_t snapshot_bytes_held(const SnapshotScheme& s, int rank, int64_t payload_bytes) {
  const int64_t both_slots = 2 * (kSnapshotHeaderBytes + payload_bytes);
  if (!s.redundant()) return both_slots;
  if (s.parity_group == 0) return 2 * both_slots;
  // Group g's parity is held by rank (g+1)·G mod N: each multiple of G holds one, and folds it
  // from G receive buffers of one chunk.
  return both_slots + (rank % s.parity_group == 0 ? both_slots + s.parity_group * kChunk : 0);
}

int64_t snapshot_bytes_most(const SnapshotScheme& s, int64_t payload_bytes) {
  int64_t most = 0;
  for (int r = 0; r < s.world; ++r) most = std::max(most, snapshot_bytes_held(s, r, payload_bytes));
  return most;
}

std::vector<SlotInfo> list_snapshot_slots(const std::string& prefix, bool verify) {
  MemoryPool listing;  // each segment is mapped only while its header is read; nothing reports it
  std::vector<SlotInfo> out;
  for (const std::string& name : segments_named(prefix)) {
    SlotInfo s;
    if (!parse_name(name, s)) continue;
    try {
      const Buffer m = map_segment(listing, name, 0, false);
      s.bytes = static_cast<int64_t>(m.bytes());
      Header h{};
      s.status = check_slot(m.as<char>(), s.bytes, verify, &h);
      if (s.status == "ok" || s.status == "incomplete") s.step = h.step, s.world = h.world;
      if (s.status == "ok") s.run_id = run_of(h);
      if (const std::string why = s.status == "ok" ? not_as_named(h, s.holder, s.role, s.source) : ""; !why.empty())
        s.status = why;
    } catch (const std::exception& e) {
      s.status = e.what();
    }
    out.push_back(s);
  }
  return out;
}

int remove_snapshot_segments(const std::string& prefix) {
  int n = 0;
  for (const std::string& name : segments_named(prefix)) n += ::shm_unlink(("/" + name).c_str()) == 0;
  return n;
}

SnapshotStore::SnapshotStore(const std::string& run_dir, comm::Communicator& world, MemoryPool& memory,
                             SnapshotScheme scheme, SnapshotMesh mesh, std::chrono::milliseconds timeout)
    : world_(world),
      memory_(memory),
      scheme_(scheme),
      mesh_(std::move(mesh)),
      timeout_(timeout),
      prefix_(snapshot_prefix(run_dir)),
      rank_(world.rank()) {
  scheme_.check();
  bool fits = static_cast<int>(mesh_.of_rank.size()) == scheme_.world && mesh_.axes.size() <= kMaxMeshAxes;
  for (const auto& name : mesh_.axes) fits = fits && name.size() <= kMaxAxisNameChars;
  for (const auto& place : mesh_.of_rank) fits = fits && place.size() == mesh_.axes.size();
  if (!fits) throw std::invalid_argument("snapshot: the mesh does not give every rank's place on at most 4 named axes");
}

SnapshotStore::~SnapshotStore() {
  for (auto& [name, m] : mapped_) delete m;
}

std::vector<std::string> SnapshotStore::held_roles() const {
  std::vector<std::string> roles{"own"};
  if (!scheme_.redundant()) return roles;
  if (scheme_.parity_group == 0) {
    roles.push_back("copy" + std::to_string(scheme_.copy_source(rank_)));
    return roles;
  }
  for (int g = 0; g < scheme_.world / scheme_.parity_group; ++g)
    if (scheme_.parity_holder(g) == rank_) roles.push_back("parity" + std::to_string(g));
  return roles;
}

void SnapshotStore::prepare(int64_t payload_bytes) {
  for (const std::string& role : held_roles())
    for (int slot = 0; slot < 2; ++slot) {
      // Every page written once now (its own value back: a slot may hold the snapshot this run
      // resumed from), so that the first snapshots do not pay the page faults of fresh memory.
      Mapped* m = map_slot(role, slot, payload_bytes, true);
      volatile char* p = m->base();
      for (size_t at = 0; at < m->buf.bytes(); at += 4096) p[at] = p[at];
    }
  if (held_roles().size() > 1 && scheme_.parity_group > 0 && scratch_.empty())
    for (int m = 0; m < scheme_.parity_group; ++m)
      scratch_.emplace_back(memory_, MemCategory::snapshot, kChunk, Buffer::Fill::none);
}

std::string SnapshotStore::segment(const std::string& role, int slot) const {
  return prefix_ + "-rank" + std::to_string(rank_) + "-" + role + "-slot" + std::to_string(slot);
}

SnapshotStore::Mapped* SnapshotStore::map_slot(const std::string& role, int slot, int64_t payload_bytes, bool create) {
  const std::string name = segment(role, slot);
  const int64_t want = kSnapshotHeaderBytes + payload_bytes;
  auto it = mapped_.find(name);
  if (it != mapped_.end() && (!create || static_cast<int64_t>(it->second->buf.bytes()) == want)) return it->second;
  if (it != mapped_.end()) {
    delete it->second;
    mapped_.erase(it);
  }
  if (!create && ::access((std::string(kShmDir) + "/" + name).c_str(), F_OK) != 0) return nullptr;
  auto* m = new Mapped{map_segment(memory_, name, want, create)};
  mapped_[name] = m;
  return m;
}

namespace {
// A header for step `step` of run `run_id`: `holder` holds `source`'s state (own, copy; with that
// rank's mesh place) or group `source`'s parity, of `payload_bytes`.
Header slot_header(const SnapshotMesh& mesh, int holder, Role role, int source, int64_t step, int64_t payload_bytes,
                   const std::string& run_id) {
  if (run_id.size() > static_cast<size_t>(kMaxRunIdChars))
    throw std::invalid_argument("snapshot: run id '" + run_id + "' is longer than " + std::to_string(kMaxRunIdChars));
  Header h{};
  h.step = step, h.world = static_cast<int32_t>(mesh.of_rank.size()), h.holder = holder, h.role = role;
  h.source = source, h.payload_bytes = payload_bytes;
  std::memcpy(h.run_id, run_id.data(), run_id.size());
  if (role != Role::parity) {
    h.mesh_axes = static_cast<int32_t>(mesh.axes.size());
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      std::memcpy(h.axis_name[a], mesh.axes[a].data(), mesh.axes[a].size());
      h.coordinate[a] = mesh.of_rank.at(source)[a];
    }
  }
  return h;
}

// The slot to overwrite: an invalid one, else the one holding the older step.
int older_slot(char* a, char* b) {
  Header ha{}, hb{};
  const bool va = valid_flag(a)->load() == 1, vb = valid_flag(b)->load() == 1;
  std::memcpy(&ha, a, sizeof ha);
  std::memcpy(&hb, b, sizeof hb);
  if (!va) return 0;
  if (!vb) return 1;
  return ha.step <= hb.step ? 0 : 1;
}
}  // namespace

void SnapshotStore::save(const std::string& run_id, int64_t step, const json& meta, const std::vector<StatePart>& parts) {
  int64_t S = 0;
  for (const auto& p : parts) S += p.bytes;
  const int N = scheme_.world;
  // Own slot: invalid while the payload is copied (its checksum computed chunk by chunk as it lands).
  struct Mine {
    int64_t step, bytes;
    uint64_t xxh64;
    int32_t ok, pad;
  } mine{step, S, 0, 0, 0};
  std::string error;
  char* own = nullptr;
  try {
    char* slots[2] = {map_slot("own", 0, S, true)->base(), map_slot("own", 1, S, true)->base()};
    own = slots[older_slot(slots[0], slots[1])];
    valid_flag(own)->store(0, std::memory_order_release);
    XXH64_state_t* st = XXH64_createState();
    XXH64_reset(st, 0);
    char* dst = own + kSnapshotHeaderBytes;
    for (const auto& p : parts)
      for (int64_t o = 0; o < p.bytes; o += kChunk) {
        const int64_t n = std::min(kChunk, p.bytes - o);
        std::memcpy(dst, reinterpret_cast<const char*>(p.data) + o, n);
        XXH64_update(st, dst, n);
        dst += n;
      }
    mine.xxh64 = XXH64_digest(st);
    XXH64_freeState(st);
    Header h = slot_header(mesh_, rank_, Role::own, rank_, step, S, run_id);
    h.payload_xxh64 = mine.xxh64;
    commit_slot(own, h, meta);
    mine.ok = 1;
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<Mine> all = gather(world_, mine, timeout_, "snapshot checksums");
  for (int r = 0; r < N; ++r)
    if (!all[r].ok) throw std::runtime_error(error.empty() ? "snapshot: rank " + std::to_string(r) + " failed to write its own" : error);
  if (!scheme_.redundant()) return;

  std::vector<std::shared_ptr<comm::Work>> works;
  if (scheme_.parity_group == 0) {  // partner copy: send mine to partner_of(r), take copy_source(r)'s
    const int from = scheme_.copy_source(rank_);
    if (all[from].bytes != S) throw std::runtime_error("snapshot: rank " + std::to_string(from) + "'s state has another size");
    const std::string role = "copy" + std::to_string(from);
    char* slots[2] = {map_slot(role, 0, S, true)->base(), map_slot(role, 1, S, true)->base()};
    char* cp = slots[older_slot(slots[0], slots[1])];
    valid_flag(cp)->store(0, std::memory_order_release);
    recv_bytes(world_, cp + kSnapshotHeaderBytes, S, from, kTagSave, works);
    send_bytes(world_, own + kSnapshotHeaderBytes, S, scheme_.partner_of(rank_), kTagSave, works);
    wait_all(works, timeout_);
    if (XXH64(cp + kSnapshotHeaderBytes, S, 0) != all[from].xxh64)
      throw std::runtime_error("snapshot: rank " + std::to_string(from) + "'s state arrived with another checksum");
    Header h = slot_header(mesh_, rank_, Role::copy, from, step, S, run_id);
    h.payload_xxh64 = all[from].xxh64;
    commit_slot(cp, h, meta);
    return;
  }
  // Parity: every member sends its state to its group's holder, which folds them by XOR.
  const int G = scheme_.parity_group;
  send_bytes(world_, own + kSnapshotHeaderBytes, S, scheme_.parity_holder(scheme_.group_of(rank_)), kTagSave, works);
  for (int g = 0; g < N / G; ++g) {
    if (scheme_.parity_holder(g) != rank_) continue;
    for (int m = 0; m < G; ++m)
      if (all[g * G + m].bytes != S) throw std::runtime_error("snapshot: group " + std::to_string(g) + "'s states differ in size");
    const std::string role = "parity" + std::to_string(g);
    char* slots[2] = {map_slot(role, 0, S, true)->base(), map_slot(role, 1, S, true)->base()};
    char* par = slots[older_slot(slots[0], slots[1])];
    valid_flag(par)->store(0, std::memory_order_release);
    if (scratch_.empty()) prepare(S);
    std::vector<Buffer>& scratch = scratch_;
    XXH64_state_t* st = XXH64_createState();
    XXH64_reset(st, 0);
    for (int64_t o = 0; o < S; o += kChunk) {  // receive a chunk from every member, fold it
      const int64_t n = std::min(kChunk, S - o);
      std::vector<std::shared_ptr<comm::Work>> got;
      for (int m = 0; m < G; ++m)
        got.push_back(world_.recv(scratch[m].data(), n, DType::int8, g * G + m, kTagSave, "snapshot parity"));
      wait_all(got, timeout_);
      char* dst = par + kSnapshotHeaderBytes + o;
      std::memcpy(dst, scratch[0].data(), n);
      for (int m = 1; m < G; ++m) xor_into(dst, scratch[m].as<char>(), n);
      XXH64_update(st, dst, n);
    }
    Header h = slot_header(mesh_, rank_, Role::parity, g, step, S, run_id);
    h.members = G;
    h.payload_xxh64 = XXH64_digest(st);
    XXH64_freeState(st);
    for (int m = 0; m < G; ++m) h.member_xxh64[m] = all[g * G + m].xxh64;
    commit_slot(par, h, meta);
  }
  wait_all(works, timeout_);
}

SnapshotChoice SnapshotStore::find_newest(int64_t payload_bytes, const std::string& run_id) {
  const int N = scheme_.world;
  EntryList mine{};
  std::vector<std::string> why_not;  // this rank's unusable or corrupt slots, printed by it
  for (const std::string& name : segments_named(prefix_ + "-rank" + std::to_string(rank_) + "-")) {
    SlotInfo s;
    if (!parse_name(name, s) || s.holder != rank_ || s.slot < 0 || s.slot > 1) continue;
    const std::string role = s.role == "own" ? "own" : s.role + std::to_string(s.source);
    Entry e{rank_, s.role == "own" ? Role::own : s.role == "copy" ? Role::copy : Role::parity, s.source, 2, 0, 0, -1};
    Header h{};
    std::string status;
    try {
      const Mapped* m = map_slot(role, s.slot, 0, false);
      status = m ? check_slot(m->base(), m->buf.bytes(), true, &h) : "vanished";
    } catch (const std::exception& ex) {
      status = ex.what();
    }
    if (status == "ok") {
      e.step = h.step;
      e.members = h.members;
      e.status = 1;  // unless it is this run's state as its name says, at this world size, mesh and layout
      if (std::string why = not_as_named(h, s.holder, s.role, s.source); !why.empty()) status = why;
      else if (h.world != N) status = "taken at world size " + std::to_string(h.world);
      else if (std::string other = not_of_run(h, run_id, mesh_); !other.empty()) status = other;
      else if (h.payload_bytes != payload_bytes) status = "holds another layout of the state";
      else e.status = 0;
    } else if (status == "incomplete" || status.rfind(kOtherFormat, 0) == 0) {
      e.status = 1;
    } else {
      // A header that verifies names its step; one that does not taints every step.
      if (std::memcmp(h.magic, kMagic, 8) == 0 && status == "payload checksum mismatch") e.step = h.step;
    }
    if (e.status != 0) why_not.push_back(name + ": " + status + "; not used");
    if (mine.count < kMaxEntries) mine.e[mine.count++] = e;
  }
  for (const auto& w : why_not) std::fprintf(stderr, "snapshot %s\n", w.c_str());
  const std::vector<EntryList> all = gather(world_, mine, timeout_, "snapshot inventory");
  table_.clear();
  for (const auto& l : all) table_.insert(table_.end(), l.e, l.e + l.count);

  std::set<int64_t, std::greater<>> steps;
  std::set<int64_t> tainted;
  bool all_tainted = false;
  for (const Entry& e : table_) {
    if (e.status == 0) steps.insert(e.step);
    if (e.status == 2 && e.step >= 0) tainted.insert(e.step), steps.insert(e.step);
    if (e.status == 2 && e.step < 0) all_tainted = true;
  }
  SnapshotChoice c;
  c.run_id = run_id;
  c.world = N;
  if (steps.empty()) {
    c.why = all_tainted ? "the only snapshots failed their checksums" : "no snapshot of this run at this world size";
    return c;
  }
  std::string skipped;
  for (int64_t s : steps) {
    if (all_tainted || tainted.count(s)) {
      skipped += (skipped.empty() ? "" : "; ") + std::string("step ") + std::to_string(s) + ": a slot failed its checksum";
      continue;
    }
    std::string missing;
    for (int r = 0; r < N && missing.empty(); ++r)
      if (how_held(r, s).empty()) missing = "rank " + std::to_string(r) + "'s state is neither held nor rebuildable";
    if (!missing.empty()) {
      skipped += (skipped.empty() ? "" : "; ") + std::string("step ") + std::to_string(s) + ": " + missing;
      continue;
    }
    c.step = s;
    std::string rebuilt;
    for (int r = 0; r < N; ++r)
      if (const std::string h = how_held(r, s); h != "own") rebuilt += "; rank " + std::to_string(r) + "'s rebuilt from its " + h;
    c.why = "every rank's state at step " + std::to_string(s) + " verified" + rebuilt +
            (skipped.empty() ? "" : "; newer not used: " + skipped);
    break;
  }
  if (c.step < 0) {
    c.why = "no usable snapshot: " + skipped;
    return c;
  }
  // The run state: from the lowest rank holding a verified slot of the step.
  int64_t have = 0;
  std::string meta;
  for (const auto& [name, m] : mapped_) {
    Header h{};
    if (check_slot(m->base(), m->buf.bytes(), false, &h) == "ok" && h.step == c.step && h.world == N &&
        h.payload_bytes == payload_bytes && is_named_state(name, h) && not_of_run(h, run_id, mesh_).empty()) {
      meta = std::string(m->base() + kMetaOffset, h.meta_bytes);
      have = 1;
      break;
    }
  }
  const std::vector<int64_t> holders = gather(world_, have, timeout_, "snapshot meta holders");
  const int root = static_cast<int>(std::find(holders.begin(), holders.end(), 1) - holders.begin());
  int64_t len = static_cast<int64_t>(meta.size());
  world_.broadcast(&len, 8, DType::int8, root, "snapshot meta size")->wait(timeout_);
  meta.resize(len);
  world_.broadcast(meta.data(), len, DType::int8, root, "snapshot meta")->wait(timeout_);
  c.meta = json::parse(meta);
  return c;
}

// The verified parity slot of r's group at step s, when every other member's own state is held
// verified too (r's state = parity XOR theirs); else null.
const SnapshotStore::Entry* SnapshotStore::parity_entry(int r, int64_t s) const {
  for (const Entry& e : table_) {
    if (e.status != 0 || e.step != s || e.role != Role::parity || e.members < 2 || r / e.members != e.source) continue;
    bool others = true;
    for (int m = e.source * e.members; m < (e.source + 1) * e.members && others; ++m) {
      if (m == r) continue;
      others = false;
      for (const Entry& o : table_) others |= o.status == 0 && o.step == s && o.role == Role::own && o.source == m && o.holder == m;
    }
    if (others) return &e;
  }
  return nullptr;
}

std::string SnapshotStore::how_held(int r, int64_t s) const {
  auto ok = [&](int role, int source) {
    for (const Entry& e : table_)
      if (e.status == 0 && e.step == s && e.role == role && e.source == source) return e.holder;
    return -1;
  };
  if (ok(Role::own, r) == r) return "own";
  if (ok(Role::copy, r) >= 0) return "partner copy";
  if (parity_entry(r, s)) return "group's parity";
  return "";
}

std::string SnapshotStore::restore(const SnapshotChoice& c, const std::vector<StatePart>& parts) {
  int64_t S = 0;
  for (const auto& p : parts) S += p.bytes;
  const int N = scheme_.world;
  const int64_t slot_bytes = kSnapshotHeaderBytes + S;
  // Whether a verified slot `name` (header `h`) is what its name says, of the chosen run and step.
  auto chosen = [&](const std::string& name, const Header& h) {
    return h.step == c.step && is_named_state(name, h) && not_of_run(h, c.run_id, mesh_).empty();
  };
  // This rank's slot in `role` of the chosen step, verified.
  auto held = [&](const std::string& role) -> char* {
    for (int sl = 0; sl < 2; ++sl) {
      Mapped* m = map_slot(role, sl, 0, false);
      Header h{};
      if (m && check_slot(m->base(), m->buf.bytes(), false, &h) == "ok" && chosen(segment(role, sl), h)) return m->base();
    }
    return nullptr;
  };
  // Every rank walks the same plan: who sends what to whom.
  std::vector<std::shared_ptr<comm::Work>> works;
  std::vector<Buffer> got;  // what this rank receives, in plan order
  std::vector<int> got_from;
  std::string how;
  for (int r = 0; r < N; ++r) {
    const std::string h = how_held(r, c.step);
    if (r == rank_) how = h;
    if (h == "own") continue;
    std::vector<std::pair<int, std::string>> senders;  // (rank, its role naming the slot)
    if (h == "partner copy") {
      for (const Entry& e : table_)
        if (e.status == 0 && e.step == c.step && e.role == Role::copy && e.source == r) {
          senders.push_back({e.holder, "copy" + std::to_string(r)});
          break;
        }
    } else {
      const Entry* e = parity_entry(r, c.step);
      const int G = e->members, g = e->source;
      senders.push_back({e->holder, "parity" + std::to_string(g)});
      for (int m = g * G; m < (g + 1) * G; ++m)
        if (m != r) senders.push_back({m, "own"});
    }
    for (const auto& [from, role] : senders) {
      if (from == rank_) {
        char* p = held(role);
        if (!p) throw std::runtime_error("snapshot: rank " + std::to_string(rank_) + " lost its " + role + " slot of step " + std::to_string(c.step));
        send_bytes(world_, p, slot_bytes, r, kTagRestore, works);
      }
      if (r == rank_) {
        got.emplace_back(memory_, MemCategory::snapshot, slot_bytes, Buffer::Fill::none);
        got_from.push_back(from);
        recv_bytes(world_, got.back().as<char>(), slot_bytes, from, kTagRestore, works);
      }
    }
  }
  wait_all(works, timeout_);

  std::string error;
  try {
    const char* payload = nullptr;
    Header h{};
    if (how == "own") {
      const char* p = held("own");
      if (!p) throw std::runtime_error("snapshot: own slot of step " + std::to_string(c.step) + " vanished");
      payload = p + kSnapshotHeaderBytes;
    } else {
      for (size_t i = 0; i < got.size(); ++i) {
        // The partner's copy of this rank's state; or the group's parity, then the other members' own states.
        const bool copy = how == "partner copy";
        const std::string role = copy ? "copy" : i == 0 ? "parity" : "own";
        const int source = copy ? rank_ : i == 0 ? scheme_.group_of(rank_) : got_from[i];
        std::string st = check_slot(got[i].as<char>(), slot_bytes, true, &h);
        if (st == "ok") st = not_as_named(h, got_from[i], role, source);
        if (st.empty()) st = not_of_run(h, c.run_id, mesh_);
        if (st.empty() && h.step != c.step) st = "of step " + std::to_string(h.step) + ", not " + std::to_string(c.step);
        if (!st.empty())
          throw std::runtime_error("snapshot: the slot rank " + std::to_string(got_from[i]) + " sent for rank " +
                                   std::to_string(rank_) + ": " + st);
      }
      char* first = got[0].as<char>();
      std::memcpy(&h, first, sizeof h);
      if (how != "partner copy") {  // parity first, then the group's other states
        for (size_t i = 1; i < got.size(); ++i) xor_into(first + kSnapshotHeaderBytes, got[i].as<char>() + kSnapshotHeaderBytes, S);
        const uint64_t want = h.member_xxh64[rank_ - h.source * h.members];
        if (XXH64(first + kSnapshotHeaderBytes, S, 0) != want)
          throw std::runtime_error("snapshot: rank " + std::to_string(rank_) + "'s state rebuilt from parity fails its checksum");
      }
      payload = first + kSnapshotHeaderBytes;
    }
    for (const auto& p : parts) {
      std::memcpy(p.data, payload, p.bytes);
      payload += p.bytes;
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<int64_t> ok = gather(world_, static_cast<int64_t>(error.empty()), timeout_, "snapshot restored");
  for (int r = 0; r < N; ++r)
    if (!ok[r]) throw std::runtime_error(error.empty() ? "snapshot: rank " + std::to_string(r) + " could not restore its state" : error);
  // The run goes on from the chosen step: a slot of any other step (a newer one that failed, or an
  // older one) or not the chosen run's state as named is of no use, and a slot that failed must
  // not be picked as the newer one to keep.
  for (auto& [name, m] : mapped_) {
    Header h{};
    if (m->buf.bytes() >= static_cast<size_t>(kSnapshotHeaderBytes) &&
        (check_slot(m->base(), m->buf.bytes(), false, &h) != "ok" || !chosen(name, h)))
      valid_flag(m->base())->store(0, std::memory_order_release);
    delete m;
  }
  mapped_.clear();
  return how;
}

namespace {
// A verified own or copy slot of another world's run, as find_resharded lists it.
struct Found {
  int32_t source, world, slot, holder, role, pad;  // holder, role: as its name says
  int64_t step;
};
constexpr int kMaxFound = 64;
struct FoundList {
  int32_t count, pad;
  Found f[kMaxFound];
};

std::string fmt_step(int64_t step, int world) {
  return "step " + std::to_string(step) + " of " + std::to_string(world) + " ranks";
}

std::string found_segment(const std::string& prefix, const Found& f) {
  return prefix + "-rank" + std::to_string(f.holder) + "-" +
         (f.role == Role::own ? std::string("own") : "copy" + std::to_string(f.source)) + "-slot" + std::to_string(f.slot);
}
}  // namespace

SnapshotChoice SnapshotStore::find_resharded(const std::string& run_id) {
  const int N = scheme_.world;
  FoundList mine{};
  MemoryPool listing;  // each segment is mapped only while its header is read
  for (const std::string& name : segments_named(prefix_ + "-rank")) {
    SlotInfo s;
    if (!parse_name(name, s) || (s.role != "own" && s.role != "copy") || s.slot < 0 || s.slot > 1) continue;
    try {
      const Buffer m = map_segment(listing, name, 0, false);
      Header h{};
      if (check_slot(m.as<char>(), static_cast<int64_t>(m.bytes()), false, &h) != "ok") continue;
      if (!not_as_named(h, s.holder, s.role, s.source).empty() || run_of(h) != run_id || h.world == N) continue;
      if (mine.count == kMaxFound) {
        std::fprintf(stderr, "snapshot: more than %d slots of this run at other world sizes in /dev/shm; %s and later "
                             "ones not considered\n", kMaxFound, name.c_str());
        break;
      }
      mine.f[mine.count++] = {h.source, h.world, s.slot, s.holder, h.role, 0, h.step};
    } catch (const std::exception&) {
      continue;  // vanished or unreadable: not a state to restore from
    }
  }
  const std::vector<FoundList> all = gather(world_, mine, timeout_, "snapshot inventory (resharded)");
  std::set<std::pair<int64_t, int32_t>, std::greater<>> candidates;  // (step, world), newest first
  for (const auto& l : all)
    for (int i = 0; i < l.count; ++i) candidates.insert({l.f[i].step, l.f[i].world});
  SnapshotChoice c;
  c.run_id = run_id;
  std::string skipped;
  for (const auto& [step, W] : candidates) {
    // Each state's server: a rank that can map it, the one whose number its holder had first.
    std::vector<Served> served(W);
    std::vector<Found> found(W);
    for (int q = 0; q < N; ++q)
      for (int i = 0; i < all[q].count; ++i) {
        const Found& f = all[q].f[i];
        if (f.step != step || f.world != W || f.source < 0 || f.source >= W) continue;
        Served& sv = served[f.source];
        if (sv.server < 0 || (f.holder == q && found[f.source].holder != sv.server))
          sv = {q, found_segment(prefix_, f)}, found[f.source] = f;
      }
    std::string missing;
    for (int r = 0; r < W && missing.empty(); ++r)
      if (served[r].server < 0) missing = "rank " + std::to_string(r) + "'s state is held by no rank of this run";
    if (!missing.empty()) {
      skipped += (skipped.empty() ? "" : "; ") + fmt_step(step, W) + ": " + missing;
      continue;
    }
    // The servers read every byte of what they serve against its checksum.
    int64_t ok = 1;
    std::string meta;
    for (int r = 0; r < W; ++r) {
      if (served[r].server != rank_) continue;
      try {
        const Buffer m = map_segment(listing, served[r].segment, 0, false);
        Header h{};
        if (check_slot(m.as<char>(), static_cast<int64_t>(m.bytes()), true, &h) != "ok" || h.step != step) ok = 0;
        if (r == 0) meta = std::string(m.as<char>() + kMetaOffset, h.meta_bytes);
      } catch (const std::exception&) {
        ok = 0;
      }
    }
    const std::vector<int64_t> oks = gather(world_, ok, timeout_, "snapshot verified (resharded)");
    if (std::find(oks.begin(), oks.end(), 0) != oks.end()) {
      skipped += (skipped.empty() ? "" : "; ") + fmt_step(step, W) + ": a slot failed its checksum";
      continue;
    }
    int64_t len = static_cast<int64_t>(meta.size());
    world_.broadcast(&len, 8, DType::int8, served[0].server, "snapshot meta size")->wait(timeout_);
    meta.resize(len);
    world_.broadcast(meta.data(), len, DType::int8, served[0].server, "snapshot meta")->wait(timeout_);
    c.step = step;
    c.world = W;
    c.meta = json::parse(meta);
    c.why = "every state of the " + std::to_string(W) + " ranks at step " + std::to_string(step) +
            " verified in this run's shared memory" + (skipped.empty() ? "" : "; newer not used: " + skipped);
    served_ = std::move(served);
    return c;
  }
  c.why = candidates.empty() ? "no snapshot of this run at another world size" : "no usable snapshot: " + skipped;
  return c;
}

void SnapshotStore::restore_resharded(const SnapshotChoice& c, const model::ModelDesc& desc, const ShardedLayout& taken,
                                      const ShardedLayout& layout, const RankBuffers& bufs) {
  const int W = c.world, N = scheme_.world;
  if (static_cast<int>(served_.size()) != W || taken.world != W || layout.world != N)
    throw std::logic_error("snapshot: restore_resharded without find_resharded's choice of that world");
  int64_t S = 0;
  std::array<int64_t, kNumKinds> at{};  // each kind's element offset in a state's payload
  for (int k = 0; k < kNumKinds; ++k) at[k] = S / 4, S += 4 * held_elements(taken, k);
  const int64_t slot_bytes = kSnapshotHeaderBytes + S;
  const json index = make_index(desc, taken, std::vector<FileSummary>(W), json::object());
  // Which ranks need which states (a state's elements some rank holds under the new layout).
  std::vector<uint8_t> mine(W, 0), need(static_cast<size_t>(W) * N);
  for (int64_t r : files_needed(index, desc, layout, rank_)) mine[r] = 1;
  world_.all_gather(mine.data(), need.data(), W, DType::int8, "snapshot reshard needs")->wait(timeout_);

  struct InMemory final : SliceSource {
    int64_t file = -1;
    std::map<std::string, const float*> slices;
    std::string holder;
    const float* data(int64_t f, const std::string& name) const override {
      if (f != file) return nullptr;
      auto it = slices.find(name);
      return it == slices.end() ? nullptr : it->second;
    }
    std::string where(int64_t) const override { return holder; }
  } source;
  std::string error;
  try {
    fill_rank(index, desc, layout, rank_, bufs, source, true);  // no file at hand yet: zeroes the padding
  } catch (const std::exception& e) {
    error = e.what();
  }
  for (int r = 0; r < W; ++r) {
    const Served& sv = served_[r];
    std::vector<std::shared_ptr<comm::Work>> works;
    Buffer mapped, got;
    const char* slot = nullptr;
    if (sv.server == rank_) {
      try {
        mapped = map_segment(memory_, sv.segment, 0, false);
        if (static_cast<int64_t>(mapped.bytes()) != slot_bytes) throw std::runtime_error("holds another layout of the state");
        slot = mapped.as<char>();
      } catch (const std::exception& e) {
        error = "snapshot " + sv.segment + ": " + e.what();
        mapped = Buffer(memory_, MemCategory::snapshot, slot_bytes, Buffer::Fill::zero);  // sends what fails its check
        slot = mapped.as<char>();
      }
      for (int q = 0; q < N; ++q)
        if (q != rank_ && need[static_cast<size_t>(q) * W + r]) send_bytes(world_, slot, slot_bytes, q, kTagRestore, works);
    } else if (mine[r]) {
      got = Buffer(memory_, MemCategory::snapshot, slot_bytes, Buffer::Fill::none);
      recv_bytes(world_, got.as<char>(), slot_bytes, sv.server, kTagRestore, works);
      slot = got.as<char>();
    }
    wait_all(works, timeout_);
    if (!mine[r] || !error.empty()) continue;
    Header h{};
    std::string st = check_slot(slot, slot_bytes, true, &h);
    if (st == "ok" && (h.source != r || h.step != c.step || h.world != W || run_of(h) != c.run_id))
      st = "not rank " + std::to_string(r) + "'s state of step " + std::to_string(c.step);
    if (st != "ok") {
      error = "snapshot " + sv.segment + " (sent by rank " + std::to_string(sv.server) + "): " + st;
      continue;
    }
    const float* payload = reinterpret_cast<const float*>(slot + kSnapshotHeaderBytes);
    source.file = r;
    source.holder = "snapshot " + sv.segment;
    source.slices = rank_slices(desc, taken, r, {const_cast<float*>(payload + at[0]), const_cast<float*>(payload + at[1]),
                                                 const_cast<float*>(payload + at[2])});
    try {
      fill_rank(index, desc, layout, rank_, bufs, source, false);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const std::vector<int64_t> ok = gather(world_, static_cast<int64_t>(error.empty()), timeout_, "snapshot restored");
  for (int q = 0; q < N; ++q)
    if (!ok[q]) throw std::runtime_error(error.empty() ? "snapshot: rank " + std::to_string(q) + " could not restore its state" : error);
  served_.clear();
}

void SnapshotStore::remove_held() {
  for (auto& [name, m] : mapped_) delete m;
  mapped_.clear();
  scratch_.clear();
  remove_snapshot_segments(prefix_ + "-rank" + std::to_string(rank_) + "-");
}

}  // namespace shardlm::ckpt
