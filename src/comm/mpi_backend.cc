#include "comm/mpi_backend.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "comm/reduce.h"
#include "tensor/memory.h"

namespace shardlm::comm {

// ---------------------------------------------------------------------------------------------
// Process-wide MPI state. MPI itself is initialised once per process, so whether this library did
// it is too; it changes only in init_mpi and finalize_mpi.

namespace {

bool g_we_initialized = false;

void bf16_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  sum_into(DType::bf16, inout, in, *len);
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, len);
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw Error(std::string("comm: ") + what + " failed: " + mpi_error_string(rc));
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

}  // namespace

bool mpi_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void init_mpi(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  int provided = 0;
  if (!init) {
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw Error("comm: MPI_Init_thread failed: " + mpi_error_string(rc));
    g_we_initialized = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (g_we_initialized) {
      MPI_Finalize();
      g_we_initialized = false;
    }
    throw Error(std::string("comm: MPI granted ") + thread_level_name(provided) +
                ", but shardlm needs MPI_THREAD_MULTIPLE (a comm thread issues collectives "
                "while others test them); use an MPI built with thread support");
  }
}

// Every Work in flight, of every communicator. Process-wide because MPI's progress is: a Work
// waited on may only complete once another communicator's schedule (another thread's) posts its
// next messages, so a waiting thread advances all of them.
class ProgressRegistry {
 public:
  static ProgressRegistry& get() {
    static ProgressRegistry r;
    return r;
  }
  void add(std::shared_ptr<Work> w) {
    std::lock_guard<std::mutex> lock(mu_);
    works_.push_back(std::move(w));
    count_.store(static_cast<int>(works_.size()), std::memory_order_release);
  }
  // One progress step for every registered Work but `self` that no other thread is testing;
  // forgets the finished ones. Not re-entered from the tests it makes.
  void progress_others(const Work* self) {
    thread_local bool inside = false;
    if (inside || count_.load(std::memory_order_acquire) == 0) return;
    inside = true;
    std::vector<std::shared_ptr<Work>> snapshot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      snapshot = works_;
    }
    bool any_done = false;
    try {
      for (auto& w : snapshot) {
        if (w.get() == self) continue;
        if (w->try_poll()) any_done = true;
      }
    } catch (...) {
      inside = false;
      throw;
    }
    inside = false;
    if (any_done) forget_done();
  }
  // Registered Works not finished yet.
  size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::count_if(works_.begin(), works_.end(), [](const std::shared_ptr<Work>& w) {
      return !w->done_.load(std::memory_order_acquire);
    });
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    works_.clear();
    count_.store(0);
  }

 private:
  void forget_done() {
    std::lock_guard<std::mutex> lock(mu_);
    works_.erase(std::remove_if(works_.begin(), works_.end(),
                                [](const std::shared_ptr<Work>& w) {
                                  return w->done_.load(std::memory_order_acquire);
                                }),
                 works_.end());
    count_.store(static_cast<int>(works_.size()), std::memory_order_release);
  }
  std::mutex mu_;
  std::vector<std::shared_ptr<Work>> works_;
  std::atomic<int> count_{0};
};

void finalize_mpi() {
  if (!mpi_active()) return;
  size_t pending = ProgressRegistry::get().pending();
  if (pending) {
    std::fprintf(stderr, "shardlm comm: finalize with %zu collective(s) still pending\n", pending);
  }
  ProgressRegistry::get().clear();
  if (g_we_initialized) {
    MPI_Finalize();
    g_we_initialized = false;
  }
}

void abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// ---------------------------------------------------------------------------------------------
// Staging memory of the point-to-point algorithms, kept for reuse between collectives so a
// collective does not pay for allocating and zero-filling it.

class StagingPool {
 public:
  explicit StagingPool(MemoryPool& memory) : memory_(memory) {}
  Buffer take(size_t bytes) {
    if (bytes == 0) return Buffer();
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = idle_.size();
      for (size_t i = 0; i < idle_.size(); ++i) {
        if (idle_[i].bytes() >= bytes && (best == idle_.size() || idle_[i].bytes() < idle_[best].bytes()))
          best = i;
      }
      if (best != idle_.size()) {
        Buffer b = std::move(idle_[best]);
        idle_.erase(idle_.begin() + best);
        return b;
      }
    }
    return Buffer(memory_, MemCategory::comm, bytes);
  }
  void give(Buffer b) {
    if (!b.data()) return;
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(b));
    if (idle_.size() > kMaxIdle) {
      // Keep the largest ones.
      auto smallest = std::min_element(idle_.begin(), idle_.end(),
                                       [](const Buffer& a, const Buffer& c) { return a.bytes() < c.bytes(); });
      idle_.erase(smallest);
    }
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.clear();
  }

 private:
  static constexpr size_t kMaxIdle = 4;
  MemoryPool& memory_;
  std::mutex mu_;
  std::vector<Buffer> idle_;
};

// ---------------------------------------------------------------------------------------------
// Works.

namespace {

constexpr int kTagsPerCollective = 32;  // two phases × up to 16 window slots
constexpr int kMaxWindow = 16;
constexpr int64_t kMaxMessageElems = int64_t(1) << 30;  // fits MPI's int count

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::fp32: return MPI_FLOAT;
    case DType::bf16: return MPI_UINT16_T;
    case DType::fp16: return MPI_UINT16_T;
    case DType::int8: return MPI_INT8_T;
  }
  return MPI_BYTE;
}

inline int64_t num_chunks(int64_t max_len, int64_t chunk_elems) {
  return std::max<int64_t>(1, (max_len + chunk_elems - 1) / chunk_elems);
}

struct Ctx {
  MPI_Comm comm;
  int rank, size;
  DType dtype;
  int64_t esize;
  MPI_Datatype type;
  int tag;  // first of kTagsPerCollective tags
  int64_t chunk_elems;
  int window;
  std::shared_ptr<StagingPool> pool;
  Scratch scratch;  // the caller's, for a reduction's staging (else the pool's)
};

// Staging of `bytes` for one reduction: the caller's scratch when it is large enough, else a
// buffer from the pool, kept in `owned` until the schedule gives it back.
char* take_staging(const Ctx& c, int64_t bytes, Buffer& owned) {
  if (c.scratch.data && c.scratch.bytes >= bytes) return static_cast<char*>(c.scratch.data);
  owned = c.pool->take(static_cast<size_t>(bytes));
  return owned.as<char>();
}

// How a chunked schedule splits its largest block: K chunks of at most chunk_max elements,
// W of them in flight.
struct Chunking {
  int64_t K, chunk_max;
  int W;
};
Chunking chunking(int64_t max_len, int64_t chunk_elems, int window) {
  const int64_t K = num_chunks(max_len, chunk_elems);
  return {K, (max_len + K - 1) / K, static_cast<int>(std::min<int64_t>(window, K))};
}
int64_t direct_staging_elems(const Chunking& k, int size) { return int64_t(k.W) * (size - 1) * k.chunk_max; }
int64_t ring_staging_elems(const Chunking& k) { return int64_t(2) * k.W * k.chunk_max; }

// Element ranges of the size blocks of a buffer.
struct Blocks {
  std::vector<int64_t> off, len;
  int64_t max_len = 0;
  static Blocks uniform(int n, int64_t c) {
    Blocks b;
    for (int i = 0; i < n; ++i) {
      b.off.push_back(i * c);
      b.len.push_back(c);
    }
    b.max_len = c;
    return b;
  }
  // count split as evenly as possible: sizes differ by at most one.
  static Blocks even(int n, int64_t count) {
    Blocks b;
    for (int i = 0; i < n; ++i) {
      int64_t lo = count * i / n, hi = count * (i + 1) / n;
      b.off.push_back(lo);
      b.len.push_back(hi - lo);
      b.max_len = std::max(b.max_len, hi - lo);
    }
    return b;
  }
};

// Chunk j of K of a block of `len` elements: [start, start + n).
struct Range {
  int64_t start, n;
};
inline Range chunk_of(int64_t len, int64_t K, int64_t j) {
  int64_t lo = len * j / K, hi = len * (j + 1) / K;
  return {lo, hi - lo};
}

// True when the request is done (or null); then it is MPI_REQUEST_NULL.
bool test_req(MPI_Request& r) {
  if (r == MPI_REQUEST_NULL) return true;
  int flag = 0;
  check(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), "MPI_Test");
  return flag != 0;
}

// The MPI_COMM_WORLD rank of rank `r` of `comm`: what a user knows the rank by.
int world_rank(MPI_Comm comm, int r) {
  MPI_Group group, world;
  int out = r;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS) return r;
  if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    MPI_Group_translate_ranks(group, 1, &r, world, &out);
    MPI_Group_free(&world);
  }
  MPI_Group_free(&group);
  return out == MPI_UNDEFINED ? r : out;
}

// Adds `peer` (a rank of c.comm) as a world rank when `req`, a message from or to it, is still
// pending: a receive the peer has not sent, or a send (too long to go eagerly) it has not
// posted the receive of.
void add_if_pending(const Ctx& c, MPI_Request& req, int peer, std::set<int>& out) {
  if (!test_req(req)) out.insert(world_rank(c.comm, peer));
}

void isend(const Ctx& c, const void* buf, int64_t count, int peer, int tag, MPI_Request* r) {
  check(MPI_Isend(buf, static_cast<int>(count), c.type, peer, tag, c.comm, r), "MPI_Isend");
}
void irecv(const Ctx& c, void* buf, int64_t count, int peer, int tag, MPI_Request* r) {
  check(MPI_Irecv(buf, static_cast<int>(count), c.type, peer, tag, c.comm, r), "MPI_Irecv");
}

class MpiWork : public Work {
 protected:
  MpiWork(const char* collective, const std::string& label, int rank, int size,
          const WaitPolicy& policy)
      : Work(collective, label, rank, size, "mpi", policy) {}
  bool test() final {
    ProgressRegistry::get().progress_others(this);
    return test_own();
  }
  virtual bool test_own() = 0;
  std::vector<int> waiting_for_locked() final { return waiting_for_own(); }
  // Native MPI collectives do not say whom they wait for.
  virtual std::vector<int> waiting_for_own() { return {}; }
};

// A native MPI operation: one or more requests, then an optional action (a copy out of a
// temporary buffer) once all have completed.
class RequestWork final : public MpiWork {
 public:
  RequestWork(const char* collective, const std::string& label, int rank, int size,
              const WaitPolicy& policy)
      : MpiWork(collective, label, rank, size, policy) {}
  std::vector<MPI_Request> reqs;
  std::function<void()> on_done;
  Buffer temp;
  std::vector<std::vector<int>> arrays;  // counts and displacements MPI reads until completion

 protected:
  bool test_own() override {
    int flag = 0;
    check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE),
          "MPI_Testall");
    if (!flag) return false;
    if (on_done) on_done();
    on_done = nullptr;
    temp = Buffer();
    arrays.clear();
    return true;
  }
};

// One phase of a point-to-point schedule.
class Machine {
 public:
  virtual ~Machine() = default;
  // Posts what can be posted, tests what is in flight, reduces what arrived; true when done.
  virtual bool advance() = 0;
  // The world ranks whose messages this rank still waits for (called after a timeout).
  virtual void waiting_for(std::set<int>& ranks) = 0;
};

class ScheduleWork final : public MpiWork {
 public:
  ScheduleWork(const char* collective, const std::string& label, int rank, int size,
               const WaitPolicy& policy)
      : MpiWork(collective, label, rank, size, policy) {}
  std::vector<std::unique_ptr<Machine>> phases;

 protected:
  bool test_own() override {
    while (cur_ < phases.size()) {
      if (!phases[cur_]->advance()) return false;
      phases[cur_].reset();  // frees (returns) its staging
      ++cur_;
    }
    return true;
  }
  std::vector<int> waiting_for_own() override {
    std::set<int> ranks;
    if (cur_ < phases.size()) phases[cur_]->waiting_for(ranks);
    return {ranks.begin(), ranks.end()};
  }

 private:
  size_t cur_ = 0;
};

// Local copies, then sends and receives that need no ordering among themselves: direct
// all-gather, all-to-all, broadcast. Messages longer than `max_elems` are split.
class ExchangeMachine final : public Machine {
 public:
  // Messages are split into pieces of at most `max_elems` (≤ kMaxMessageElems).
  ExchangeMachine(const Ctx& c, int64_t max_elems = kMaxMessageElems)
      : c_(c), max_(std::min(max_elems, kMaxMessageElems)) {}
  void add_send(const void* p, int64_t count, int peer) {
    for (int64_t o = 0; o < count; o += max_)
      sends_.push_back({const_cast<char*>(static_cast<const char*>(p)) + o * c_.esize,
                        std::min(max_, count - o), peer});
  }
  void add_recv(void* p, int64_t count, int peer) {
    for (int64_t o = 0; o < count; o += max_)
      recvs_.push_back({static_cast<char*>(p) + o * c_.esize, std::min(max_, count - o), peer});
  }
  void add_copy(void* dst, const void* src, int64_t count) {
    if (dst != src && count > 0) copies_.push_back({dst, src, count * c_.esize});
  }
  bool advance() override {
    if (!posted_) {
      for (auto& cp : copies_) std::memcpy(cp.dst, cp.src, cp.bytes);
      // Receives first, so the peers' sends find them posted.
      for (auto& m : recvs_) {
        reqs_.emplace_back();
        irecv(c_, m.p, m.n, m.peer, c_.tag, &reqs_.back());
      }
      for (auto& m : sends_) {
        reqs_.emplace_back();
        isend(c_, m.p, m.n, m.peer, c_.tag, &reqs_.back());
      }
      statuses_.resize(recvs_.size());
      early_.assign(recvs_.size(), false);
      posted_ = true;
    }
    now_.resize(reqs_.size());
    int flag = 0;
    check(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, now_.data()), "MPI_Testall");
    if (!flag) return false;
    for (size_t i = 0; i < recvs_.size(); ++i) check_received(i, early_[i] ? statuses_[i] : now_[i]);
    return true;
  }
  void waiting_for(std::set<int>& ranks) override {  // reqs_: the receives, then the sends
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (i < recvs_.size()) {  // keep a receive's status: advance() checks its length
        int flag = 0;
        if (reqs_[i] != MPI_REQUEST_NULL) check(MPI_Test(&reqs_[i], &flag, &statuses_[i]), "MPI_Test");
        if (flag) early_[i] = true;
        if (reqs_[i] != MPI_REQUEST_NULL) ranks.insert(world_rank(c_.comm, recvs_[i].peer));
      } else {
        add_if_pending(c_, reqs_[i], sends_[i - recvs_.size()].peer, ranks);
      }
    }
  }

 private:
  // A peer that sent fewer elements than this rank expects from it (all_to_all_v's counts
  // disagree) would otherwise leave the rest of the receive buffer stale, unnoticed.
  void check_received(size_t i, const MPI_Status& st) {
    int got = 0;
    check(MPI_Get_count(&st, c_.type, &got), "MPI_Get_count");
    const Msg& m = recvs_[i];
    if (got != m.n)
      throw Error("comm: rank " + std::to_string(world_rank(c_.comm, m.peer)) + " sent " + std::to_string(got) +
                  " elements where " + std::to_string(m.n) + " were expected (the ranks' counts disagree)");
  }
  struct Msg {
    char* p;
    int64_t n;
    int peer;
  };
  struct Copy {
    void* dst;
    const void* src;
    int64_t bytes;
  };
  Ctx c_;
  int64_t max_;
  std::vector<Msg> sends_, recvs_;
  std::vector<Copy> copies_;
  std::vector<MPI_Request> reqs_;
  std::vector<MPI_Status> now_;       // of the last MPI_Testall
  std::vector<MPI_Status> statuses_;  // of receives completed by waiting_for
  std::vector<bool> early_;           // per receive: completed by waiting_for
  bool posted_ = false;
};

// Direct reduce-scatter: the own block is split into K chunks; for each chunk every peer sends
// its contribution, which lands in staging; once all have arrived the chunk is summed in rank
// order into `out`. At most `window` chunks are in flight. Chunk j of the block of peer q is
// sent to q at the same time. `out` may be the own block of `send`.
class DirectReduceScatter final : public Machine {
 public:
  DirectReduceScatter(const Ctx& c, const void* send, void* out, Blocks blocks)
      : c_(c), send_(static_cast<const char*>(send)), out_(static_cast<char*>(out)), b_(std::move(blocks)) {
    const Chunking k = chunking(b_.max_len, c_.chunk_elems, c_.window);
    K_ = k.K, W_ = k.W, chunk_max_ = k.chunk_max;
    const int peers = c_.size - 1;
    staging_ = take_staging(c_, direct_staging_elems(k, c_.size) * c_.esize, owned_);
    slots_.resize(W_);
    for (auto& s : slots_) {
      s.recv.assign(peers, MPI_REQUEST_NULL);
      s.send.assign(peers, MPI_REQUEST_NULL);
    }
    ins_.resize(c_.size);
  }
  ~DirectReduceScatter() override { c_.pool->give(std::move(owned_)); }
  void waiting_for(std::set<int>& ranks) override {
    for (int64_t j = lo_; j < hi_; ++j)
      for (int i = 0; i < c_.size - 1; ++i) {
        add_if_pending(c_, slots_[j % W_].recv[i], peer(i), ranks);
        add_if_pending(c_, slots_[j % W_].send[i], peer(i), ranks);
      }
  }

  bool advance() override {
    for (;;) {
      bool moved = false;
      while (hi_ < K_ && hi_ - lo_ < W_) {
        post(hi_++);
        moved = true;
      }
      for (int64_t j = lo_; j < hi_; ++j) {
        Slot& s = slots_[j % W_];
        if (!s.reduced) {
          bool all = true;
          for (auto& r : s.recv) all = test_req(r) && all;
          if (all) {
            reduce(j);
            s.reduced = true;
            moved = true;
          }
        }
        if (!s.sent) {
          bool all = true;
          for (auto& r : s.send) all = test_req(r) && all;
          s.sent = all;
        }
      }
      while (lo_ < hi_ && slots_[lo_ % W_].reduced && slots_[lo_ % W_].sent) {
        ++lo_;
        moved = true;
      }
      if (lo_ == K_) return true;
      if (!moved) return false;
    }
  }

 private:
  struct Slot {
    std::vector<MPI_Request> recv, send;
    bool reduced = false, sent = false;
  };
  int peer(int i) const { return (c_.rank + 1 + i) % c_.size; }  // i-th peer, i in [0, size−1)
  char* stage(int slot, int i) const {
    return staging_ + ((static_cast<int64_t>(slot) * (c_.size - 1) + i) * chunk_max_) * c_.esize;
  }
  void post(int64_t j) {
    const int slot = static_cast<int>(j % W_);
    Slot& s = slots_[slot];
    s.reduced = s.sent = false;
    const Range mine = chunk_of(b_.len[c_.rank], K_, j);
    for (int i = 0; i < c_.size - 1; ++i) irecv(c_, stage(slot, i), mine.n, peer(i), c_.tag, &s.recv[i]);
    for (int i = 0; i < c_.size - 1; ++i) {
      const int q = peer(i);
      const Range r = chunk_of(b_.len[q], K_, j);
      isend(c_, send_ + (b_.off[q] + r.start) * c_.esize, r.n, q, c_.tag, &s.send[i]);
    }
  }
  void reduce(int64_t j) {
    const int slot = static_cast<int>(j % W_);
    const Range mine = chunk_of(b_.len[c_.rank], K_, j);
    for (int i = 0; i < c_.size - 1; ++i) ins_[peer(i)] = stage(slot, i);
    ins_[c_.rank] = send_ + (b_.off[c_.rank] + mine.start) * c_.esize;
    sum_n(c_.dtype, out_ + mine.start * c_.esize, ins_.data(), c_.size, mine.n);
  }

  Ctx c_;
  const char* send_;
  char* out_;
  Blocks b_;
  int64_t K_ = 1, chunk_max_ = 0;
  int W_ = 1;
  char* staging_ = nullptr;
  Buffer owned_;  // staging from the pool when the caller gave no scratch
  std::vector<Slot> slots_;
  std::vector<const void*> ins_;
  int64_t lo_ = 0, hi_ = 0;  // chunks [lo_, hi_) are in flight
};

// A ring's schedule, shared by reduce-scatter and all-gather: the K chunks of every block each go
// through the size−1 steps on their own, at most W in flight (window slots); a slot posts a step's
// receive from the left neighbour and send to the right one, and the next step once both are done.
// Each window slot has its own tag, so a chunk's messages match in step order whatever the
// interleaving of chunks. The collective says what a step sends and receives (post_step) and what
// it does with a received chunk (received).
class PipelinedRing : public Machine {
 public:
  PipelinedRing(const Ctx& c, const void* send, void* out, Blocks blocks)
      : c_(c), send_(static_cast<const char*>(send)), out_(static_cast<char*>(out)), b_(std::move(blocks)) {
    left_ = (c_.rank - 1 + c_.size) % c_.size;
    right_ = (c_.rank + 1) % c_.size;
  }
  void waiting_for(std::set<int>& ranks) override {  // a ring only talks to its two neighbours
    for (int64_t j = lo_; j < hi_; ++j) {
      add_if_pending(c_, slots_[j % W_].recv, left_, ranks);
      add_if_pending(c_, slots_[j % W_].send, right_, ranks);
    }
  }
  bool advance() override {
    for (;;) {
      bool moved = false;
      while (hi_ < K_ && hi_ - lo_ < W_) {
        Slot& s = slots_[hi_ % W_];
        s = Slot{};
        post(hi_, s);
        ++hi_;
        moved = true;
      }
      for (int64_t j = lo_; j < hi_; ++j) {
        Slot& s = slots_[j % W_];
        if (s.finished) continue;
        if (!s.recv_done && test_req(s.recv)) {
          s.recv_done = true;
          received(j, s.step);
          moved = true;
        }
        if (!s.send_done && test_req(s.send)) s.send_done = true;
        if (s.recv_done && s.send_done) {
          if (s.step == c_.size - 2) {
            s.finished = true;
          } else {
            ++s.step;
            post(j, s);
          }
          moved = true;
        }
      }
      while (lo_ < hi_ && slots_[lo_ % W_].finished) {
        ++lo_;
        moved = true;
      }
      if (lo_ == K_) return true;
      if (!moved) return false;
    }
  }

 protected:
  // K chunks per block, W of them in flight.
  void set_chunks(int64_t K, int W) {
    K_ = K, W_ = W;
    slots_.resize(W_);
  }
  int mod(int x) const { return ((x % c_.size) + c_.size) % c_.size; }
  // Posts chunk j's step `step` on `tag`: its receive from the left neighbour and its send to the
  // right one.
  virtual void post_step(int64_t j, int step, MPI_Request* recv, MPI_Request* send, int tag) = 0;
  virtual void received(int64_t /*j*/, int /*step*/) {}

  Ctx c_;
  const char* send_;
  char* out_;
  Blocks b_;
  int64_t K_ = 1;
  int W_ = 1;
  int left_ = 0, right_ = 0;

 private:
  struct Slot {
    int step = 0;
    MPI_Request send = MPI_REQUEST_NULL, recv = MPI_REQUEST_NULL;
    bool send_done = false, recv_done = false, finished = false;
  };
  void post(int64_t j, Slot& s) {
    s.send_done = s.recv_done = false;
    post_step(j, s.step, &s.recv, &s.send, c_.tag + static_cast<int>(j % W_));
  }
  std::vector<Slot> slots_;
  int64_t lo_ = 0, hi_ = 0;  // chunks [lo_, hi_) are in flight
};

// Ring reduce-scatter: at step s a rank sends the partial sum of block (rank−s−1) to its right
// neighbour and receives the partial of block (rank−s−2) from its left one, adds its own
// contribution, and forwards it at step s+1; the last step's sum is its own block's result. The
// partials travel as `dtype` (bf16 partials are rounded at every step).
class RingReduceScatter final : public PipelinedRing {
 public:
  RingReduceScatter(const Ctx& c, const void* send, void* out, Blocks blocks)
      : PipelinedRing(c, send, out, std::move(blocks)) {
    const Chunking k = chunking(b_.max_len, c_.chunk_elems, c_.window);
    set_chunks(k.K, k.W);
    chunk_max_ = k.chunk_max;
    staging_ = take_staging(c_, ring_staging_elems(k) * c_.esize, owned_);
  }
  ~RingReduceScatter() override { c_.pool->give(std::move(owned_)); }

 private:
  char* stage(int parity, int slot) const {
    return staging_ + ((static_cast<int64_t>(parity) * W_ + slot) * chunk_max_) * c_.esize;
  }
  void post_step(int64_t j, int step, MPI_Request* recv, MPI_Request* send, int tag) override {
    const int slot = static_cast<int>(j % W_);
    const int br = mod(c_.rank - step - 2), bs = mod(c_.rank - step - 1);
    irecv(c_, stage(step % 2, slot), chunk_of(b_.len[br], K_, j).n, left_, tag, recv);
    const Range rs = chunk_of(b_.len[bs], K_, j);
    const char* src = step == 0 ? send_ + (b_.off[bs] + rs.start) * c_.esize : stage((step - 1) % 2, slot);
    isend(c_, src, rs.n, right_, tag, send);
  }
  void received(int64_t j, int step) override {
    const int br = mod(c_.rank - step - 2);
    const Range r = chunk_of(b_.len[br], K_, j);
    char* partial = stage(step % 2, static_cast<int>(j % W_));
    const void* ins[2] = {partial, send_ + (b_.off[br] + r.start) * c_.esize};
    char* dst = step == c_.size - 2 ? out_ + r.start * c_.esize : partial;
    sum_n(c_.dtype, dst, ins, 2, r.n);
  }

  int64_t chunk_max_ = 0;
  char* staging_ = nullptr;
  Buffer owned_;  // staging from the pool when the caller gave no scratch
};

// Ring all-gather: at step s a rank forwards block (rank−s) to the right and receives block
// (rank−s−1) from the left, straight into `out`.
class RingAllGather final : public PipelinedRing {
 public:
  RingAllGather(const Ctx& c, const void* send, void* out, Blocks blocks)
      : PipelinedRing(c, send, out, std::move(blocks)) {
    const int64_t K = num_chunks(b_.max_len, c_.chunk_elems);
    set_chunks(K, static_cast<int>(std::min<int64_t>(c_.window, K)));
  }
  bool advance() override {
    if (!copied_) {
      char* own = out_ + b_.off[c_.rank] * c_.esize;
      if (own != send_ && b_.len[c_.rank] > 0) std::memcpy(own, send_, b_.len[c_.rank] * c_.esize);
      copied_ = true;
    }
    return PipelinedRing::advance();
  }

 private:
  void post_step(int64_t j, int step, MPI_Request* recv, MPI_Request* send, int tag) override {
    const int br = mod(c_.rank - step - 1), bs = mod(c_.rank - step);
    const Range rr = chunk_of(b_.len[br], K_, j), rs = chunk_of(b_.len[bs], K_, j);
    irecv(c_, out_ + (b_.off[br] + rr.start) * c_.esize, rr.n, left_, tag, recv);
    isend(c_, out_ + (b_.off[bs] + rs.start) * c_.esize, rs.n, right_, tag, send);
  }

  bool copied_ = false;
};

std::unique_ptr<Machine> direct_all_gather(const Ctx& c, const void* send, void* out, const Blocks& b) {
  auto m = std::make_unique<ExchangeMachine>(c);
  char* o = static_cast<char*>(out);
  char* own = o + b.off[c.rank] * c.esize;
  // The own block is copied into place first and sent from there: the peers then read (with
  // CMA, they copy straight out of this process) data that is still in cache.
  m->add_copy(own, send, b.len[c.rank]);
  for (int i = 1; i < c.size; ++i) {
    const int q = (c.rank + i) % c.size;
    m->add_recv(o + b.off[q] * c.esize, b.len[q], q);
  }
  for (int i = 1; i < c.size; ++i) {
    const int q = (c.rank + c.size - i) % c.size;
    m->add_send(own, b.len[c.rank], q);
  }
  return m;
}

// The result of a collective over one rank: a copy (nothing when in place).
void local_copy(void* dst, const void* src, int64_t bytes) {
  if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
}

void check_count(int64_t count, const char* what) {
  if (count < 0) throw Error(std::string("comm: ") + what + ": negative count");
}

void check_native_count(int64_t count, const char* what) {
  if (count > INT_MAX)
    throw Error(std::string("comm: ") + what + ": native algorithm limited to INT_MAX elements per rank");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MpiCommunicator.

MpiCommunicator::MpiCommunicator(MemoryPool& memory, MpiOptions options, MPI_Comm comm)
    : options_(options), memory_(memory) {
  if (!mpi_active()) throw Error("comm: MpiCommunicator needs init_mpi() first");
  check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  set_up();
}

MpiCommunicator::MpiCommunicator(Adopt, MPI_Comm owned, MpiOptions options, MemoryPool& memory)
    : options_(options), memory_(memory), comm_(owned) {
  set_up();
}

void MpiCommunicator::set_up() {
  if (options_.window < 1 || options_.window > kMaxWindow)
    throw Error("comm: MpiOptions.window must be in [1, 16]");
  if (options_.chunk_bytes < 64) throw Error("comm: MpiOptions.chunk_bytes must be at least 64");
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_dup(comm_, &sched_comm_), "MPI_Comm_dup");
  check(MPI_Comm_set_errhandler(sched_comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  int* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  const int tag_ub = flag && ub ? *ub : 32767;
  tag_blocks_ = static_cast<int>(std::max<int64_t>(1, (int64_t(tag_ub) + 1) / kTagsPerCollective));
  pool_ = std::make_shared<StagingPool>(memory_);
  // MPI calls a user op with no context; bf16_sum_fn needs none (the element type is the op's).
  check(MPI_Op_create(&bf16_sum_fn, 1, &bf16_sum_), "MPI_Op_create");
}

MPI_Op MpiCommunicator::sum_op(DType t) const { return t == DType::fp32 ? MPI_SUM : bf16_sum_; }

MpiCommunicator::~MpiCommunicator() {
  if (!mpi_active()) return;  // finalized: MPI has freed them
  if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
  if (sched_comm_ != MPI_COMM_NULL) MPI_Comm_free(&sched_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::release_staging() { pool_->clear(); }

int MpiCommunicator::next_tag_base() {
  // Called with issue_mu_ held, once per collective on every rank in the same order.
  const int base = static_cast<int>(seq_ % static_cast<uint64_t>(tag_blocks_)) * kTagsPerCollective;
  ++seq_;
  return base;
}

Algorithm resolve_algorithm(const std::string& collective, Algorithm a, int size) {
  if (a != Algorithm::automatic) return a;
  const bool small_group = size <= kDirectMaxRanks;
  if (collective == "all_to_all" || collective == "broadcast")
    return small_group ? Algorithm::direct : Algorithm::native;
  return small_group ? Algorithm::direct : Algorithm::ring;
}

int64_t mpi_scratch_bytes(const MpiOptions& o, Reduction op, int64_t count, DType dtype, int size) {
  if (size <= 1 || count <= 0) return 0;
  const bool rs = op == Reduction::reduce_scatter;
  const Algorithm a = resolve_algorithm(rs ? "reduce_scatter" : "all_reduce", rs ? o.reduce_scatter : o.all_reduce, size);
  const int64_t es = dtype_size(dtype);
  if (a == Algorithm::via_all_reduce) return count * size * es;
  if (a != Algorithm::direct && a != Algorithm::ring) return 0;
  const int64_t max_block = rs ? count : (count + size - 1) / size;  // Blocks::uniform / Blocks::even
  const Chunking k = chunking(max_block, std::max<int64_t>(1, o.chunk_bytes / es), o.window);
  return (a == Algorithm::direct ? direct_staging_elems(k, size) : ring_staging_elems(k)) * es;
}

namespace {
// Posts a schedule's first messages now. A failure already (a peer's message of the wrong
// length that came at once) is the Work's: its wait() reports it, not the issuing call.
void start(Work& w) {
  try {
    w.is_completed();
  } catch (const Error&) {
  }
}

template <class W>
std::shared_ptr<W> make_work(const char* collective, const std::string& label, int rank, int size,
                             const WaitPolicy& p) {
  return std::make_shared<W>(collective, label, rank, size, p);
}
}  // namespace

std::shared_ptr<Work> MpiCommunicator::all_gather(const void* send, void* recv,
                                                  int64_t count_per_rank, DType dtype,
                                                  const std::string& label) {
  static const char* kName = "all_gather";
  check_count(count_per_rank, kName);
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  if (count_per_rank == 0) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  const Algorithm a = resolve(kName, options_.all_gather);
  const int64_t es = dtype_size(dtype);
  if (size_ == 1) {
    local_copy(recv, send, count_per_rank * es);
    return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  }
  const bool in_place = send == static_cast<char*>(recv) + rank_ * count_per_rank * es;
  if (a == Algorithm::native) {
    check_native_count(count_per_rank, kName);
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    w->reqs.emplace_back();
    const int n = static_cast<int>(count_per_rank);
    check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, in_place ? 0 : n,
                         in_place ? MPI_DATATYPE_NULL : mpi_type(dtype), recv, n, mpi_type(dtype),
                         comm_, &w->reqs.back()),
          "MPI_Iallgather");
    return w;
  }
  if (a != Algorithm::direct && a != Algorithm::ring)
    throw Error(std::string("comm: all_gather cannot use algorithm ") + to_string(a));
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, {}};
  const Blocks b = Blocks::uniform(size_, count_per_rank);
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  if (a == Algorithm::direct) {
    w->phases.push_back(direct_all_gather(c, send, recv, b));
  } else {
    w->phases.push_back(std::make_unique<RingAllGather>(c, send, recv, b));
  }
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

std::shared_ptr<Work> MpiCommunicator::reduce_scatter(const void* send, void* recv,
                                                      int64_t count_per_rank, DType dtype,
                                                      const std::string& label, Scratch scratch) {
  static const char* kName = "reduce_scatter";
  check_count(count_per_rank, kName);
  if (!reducible(dtype)) throw Error(std::string("comm: reduce_scatter of ") + to_string(dtype) + " is not supported");
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  if (count_per_rank == 0) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  const Algorithm a = resolve(kName, options_.reduce_scatter);
  const int64_t es = dtype_size(dtype);
  if (size_ == 1) {
    local_copy(recv, send, count_per_rank * es);
    return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  }
  const int64_t block_bytes = count_per_rank * es;
  const bool in_place = recv == static_cast<const char*>(send) + rank_ * block_bytes;
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, scratch};
  if (a == Algorithm::native || a == Algorithm::via_all_reduce) {
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    w->reqs.emplace_back();
    char* temp = nullptr;
    if (a == Algorithm::native) {
      check_native_count(count_per_rank, kName);
      void* out = recv;
      if (in_place) {  // not a reduction's staging: always the pool's
        w->temp = pool_->take(block_bytes);
        out = temp = w->temp.as<char>();
      }
      check(MPI_Ireduce_scatter_block(send, out, static_cast<int>(count_per_rank), mpi_type(dtype),
                                      sum_op(dtype), comm_, &w->reqs.back()),
            "MPI_Ireduce_scatter_block");
    } else {
      const int64_t total = count_per_rank * size_;
      check_native_count(total, kName);
      temp = take_staging(c, total * es, w->temp);
      check(MPI_Iallreduce(send, temp, static_cast<int>(total), mpi_type(dtype), sum_op(dtype), comm_,
                           &w->reqs.back()),
            "MPI_Iallreduce");
    }
    // Copy the result out if it went to the temporary, then hand a pooled temporary back.
    auto pool = pool_;
    RequestWork* raw = w.get();
    const int64_t offset = a == Algorithm::native ? 0 : rank_ * block_bytes;
    if (temp) {
      raw->on_done = [raw, temp, recv, offset, block_bytes, pool] {
        std::memcpy(recv, temp + offset, block_bytes);
        pool->give(std::move(raw->temp));
      };
    }
    return w;
  }
  if (a != Algorithm::direct && a != Algorithm::ring)
    throw Error(std::string("comm: reduce_scatter cannot use algorithm ") + to_string(a));
  (void)in_place;  // the point-to-point algorithms read the own block before writing it
  const Blocks b = Blocks::uniform(size_, count_per_rank);
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  if (a == Algorithm::direct) {
    w->phases.push_back(std::make_unique<DirectReduceScatter>(c, send, recv, b));
  } else {
    w->phases.push_back(std::make_unique<RingReduceScatter>(c, send, recv, b));
  }
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

std::shared_ptr<Work> MpiCommunicator::all_reduce(void* buf, int64_t count, DType dtype,
                                                  const std::string& label, Scratch scratch) {
  static const char* kName = "all_reduce";
  check_count(count, kName);
  if (!reducible(dtype)) throw Error(std::string("comm: all_reduce of ") + to_string(dtype) + " is not supported");
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  if (count == 0) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  const Algorithm a = resolve(kName, options_.all_reduce);
  const int64_t es = dtype_size(dtype);
  if (size_ == 1) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  if (a == Algorithm::native) {
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    for (int64_t o = 0; o < count; o += kMaxMessageElems) {
      w->reqs.emplace_back();
      check(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(buf) + o * es,
                           static_cast<int>(std::min(kMaxMessageElems, count - o)), mpi_type(dtype),
                           sum_op(dtype), comm_, &w->reqs.back()),
            "MPI_Iallreduce");
    }
    return w;
  }
  if (a != Algorithm::direct && a != Algorithm::ring)
    throw Error(std::string("comm: all_reduce cannot use algorithm ") + to_string(a));
  // Reduce-scatter in place into the own block, then all-gather the blocks in place. The two
  // phases use different tags: a fast peer's all-gather messages may arrive early.
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, scratch};
  Ctx c2 = c;
  c2.tag = tag + kMaxWindow;
  c2.scratch = {};
  const Blocks b = Blocks::even(size_, count);
  char* own = static_cast<char*>(buf) + b.off[rank_] * es;
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  if (a == Algorithm::direct) {
    w->phases.push_back(std::make_unique<DirectReduceScatter>(c, buf, own, b));
    w->phases.push_back(direct_all_gather(c2, own, buf, b));
  } else {
    w->phases.push_back(std::make_unique<RingReduceScatter>(c, buf, own, b));
    w->phases.push_back(std::make_unique<RingAllGather>(c2, own, buf, b));
  }
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

std::shared_ptr<Work> MpiCommunicator::broadcast(void* buf, int64_t count, DType dtype, int root,
                                                 const std::string& label) {
  static const char* kName = "broadcast";
  check_count(count, kName);
  if (root < 0 || root >= size_) throw Error("comm: broadcast root out of range");
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  if (count == 0 || size_ == 1) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  const Algorithm a = resolve(kName, options_.broadcast);
  const int64_t es = dtype_size(dtype);
  if (a == Algorithm::native) {
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    for (int64_t o = 0; o < count; o += kMaxMessageElems) {
      w->reqs.emplace_back();
      check(MPI_Ibcast(static_cast<char*>(buf) + o * es,
                       static_cast<int>(std::min(kMaxMessageElems, count - o)), mpi_type(dtype), root,
                       comm_, &w->reqs.back()),
            "MPI_Ibcast");
    }
    return w;
  }
  if (a != Algorithm::direct) throw Error(std::string("comm: broadcast cannot use algorithm ") + to_string(a));
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, {}};
  auto m = std::make_unique<ExchangeMachine>(c);
  if (rank_ == root) {
    for (int i = 1; i < size_; ++i) m->add_send(buf, count, (root + i) % size_);
  } else {
    m->add_recv(buf, count, root);
  }
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  w->phases.push_back(std::move(m));
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

std::shared_ptr<Work> MpiCommunicator::barrier(const std::string& label) {
  std::lock_guard<std::mutex> lock(issue_mu_);
  next_tag_base();
  auto w = make_work<RequestWork>("barrier", label, rank_, size_, options_.wait);
  w->reqs.emplace_back();
  check(MPI_Ibarrier(comm_, &w->reqs.back()), "MPI_Ibarrier");
  return w;
}

std::shared_ptr<Work> MpiCommunicator::all_to_all(const void* send, void* recv,
                                                  int64_t count_per_rank, DType dtype,
                                                  const std::string& label) {
  static const char* kName = "all_to_all";
  check_count(count_per_rank, kName);
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  if (count_per_rank == 0) return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  const Algorithm a = resolve(kName, options_.all_to_all);
  const int64_t es = dtype_size(dtype);
  if (size_ == 1) {
    local_copy(recv, send, count_per_rank * es);
    return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  }
  if (a == Algorithm::native) {
    check_native_count(count_per_rank, kName);
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    w->reqs.emplace_back();
    const int n = static_cast<int>(count_per_rank);
    check(MPI_Ialltoall(send, n, mpi_type(dtype), recv, n, mpi_type(dtype), comm_, &w->reqs.back()),
          "MPI_Ialltoall");
    return w;
  }
  if (a != Algorithm::direct) throw Error(std::string("comm: all_to_all cannot use algorithm ") + to_string(a));
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, {}};
  auto m = std::make_unique<ExchangeMachine>(c);
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  const int64_t bb = count_per_rank * es;
  for (int i = 1; i < size_; ++i) {
    const int q = (rank_ + i) % size_;
    m->add_recv(r + q * bb, count_per_rank, q);
  }
  for (int i = 1; i < size_; ++i) {
    const int q = (rank_ + size_ - i) % size_;
    m->add_send(s + q * bb, count_per_rank, q);
  }
  m->add_copy(r + rank_ * bb, s + rank_ * bb, count_per_rank);
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  w->phases.push_back(std::move(m));
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

namespace {
// Native all_to_all_v hands MPI int counts and displacements: each must fit.
std::vector<int> native_ints(const std::vector<int64_t>& v, const char* field) {
  std::vector<int> out(v.size());
  for (size_t j = 0; j < v.size(); ++j) {
    if (v[j] > INT_MAX)
      throw Error(std::string("comm: all_to_all_v: ") + field + "[" + std::to_string(j) + "] = " + std::to_string(v[j]) +
                  " elements is over INT_MAX, which the native algorithm (MPI_Ialltoallv) cannot take; use direct");
    out[j] = static_cast<int>(v[j]);
  }
  return out;
}

}  // namespace

std::shared_ptr<Work> MpiCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                                    const std::vector<int64_t>& send_displs, void* recv,
                                                    const std::vector<int64_t>& recv_counts,
                                                    const std::vector<int64_t>& recv_displs, DType dtype,
                                                    const std::string& label) {
  static const char* kName = "all_to_all_v";
  check_all_to_all_v(kName, size_, send_counts, send_displs, recv_counts, recv_displs);
  if (send_counts[rank_] != recv_counts[rank_])
    throw Error("comm: all_to_all_v: send_counts[" + std::to_string(rank_) + "] = " + std::to_string(send_counts[rank_]) +
                " but recv_counts[" + std::to_string(rank_) + "] = " + std::to_string(recv_counts[rank_]) +
                " (what this rank sends itself)");
  std::lock_guard<std::mutex> lock(issue_mu_);
  const int tag = next_tag_base();
  const Algorithm a = resolve("all_to_all", options_.all_to_all);
  const int64_t es = dtype_size(dtype);
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  if (size_ == 1) {
    local_copy(r + recv_displs[0] * es, s + send_displs[0] * es, send_counts[0] * es);
    return std::make_shared<CompletedWork>(kName, label, rank_, size_, "mpi");
  }
  if (a == Algorithm::native) {  // every rank takes part, whatever its counts
    auto w = make_work<RequestWork>(kName, label, rank_, size_, options_.wait);
    w->arrays = {native_ints(send_counts, "send_counts"), native_ints(send_displs, "send_displs"),
                 native_ints(recv_counts, "recv_counts"), native_ints(recv_displs, "recv_displs")};
    w->reqs.emplace_back();
    check(MPI_Ialltoallv(send, w->arrays[0].data(), w->arrays[1].data(), mpi_type(dtype), recv, w->arrays[2].data(),
                         w->arrays[3].data(), mpi_type(dtype), comm_, &w->reqs.back()),
          "MPI_Ialltoallv");
    return w;
  }
  if (a != Algorithm::direct) throw Error(std::string("comm: all_to_all_v cannot use algorithm ") + to_string(a));
  // As all_to_all's direct exchange; a zero count is no message (its peer expects none either).
  Ctx c{sched_comm_, rank_, size_, dtype, es, mpi_type(dtype), tag,
        std::max<int64_t>(1, options_.chunk_bytes / es), options_.window, pool_, {}};
  auto m = std::make_unique<ExchangeMachine>(c);
  for (int i = 1; i < size_; ++i) {
    const int q = (rank_ + i) % size_;
    m->add_recv(r + recv_displs[q] * es, recv_counts[q], q);
  }
  for (int i = 1; i < size_; ++i) {
    const int q = (rank_ + size_ - i) % size_;
    m->add_send(s + send_displs[q] * es, send_counts[q], q);
  }
  m->add_copy(r + recv_displs[rank_] * es, s + send_displs[rank_] * es, send_counts[rank_]);
  auto w = make_work<ScheduleWork>(kName, label, rank_, size_, options_.wait);
  w->phases.push_back(std::move(m));
  ProgressRegistry::get().add(w);
  start(*w);
  return w;
}

namespace {
void check_p2p(int peer, int tag, int size, const char* what) {
  if (peer < 0 || peer >= size) throw Error(std::string("comm: ") + what + ": peer out of range");
  if (tag < 0 || tag > 32767) throw Error(std::string("comm: ") + what + ": tag must be in [0, 32767]");
}
}  // namespace

std::shared_ptr<Work> MpiCommunicator::send(const void* buf, int64_t count, DType dtype, int peer,
                                            int tag, const std::string& label) {
  check_count(count, "send");
  check_p2p(peer, tag, size_, "send");
  const int64_t es = dtype_size(dtype);
  auto w = make_work<RequestWork>("send", label, rank_, size_, options_.wait);
  std::lock_guard<std::mutex> lock(issue_mu_);
  int64_t o = 0;
  do {  // a zero-count send is still a message
    w->reqs.emplace_back();
    check(MPI_Isend(static_cast<const char*>(buf) + o * es,
                    static_cast<int>(std::min(kMaxMessageElems, count - o)), mpi_type(dtype), peer, tag,
                    comm_, &w->reqs.back()),
          "MPI_Isend");
    o += kMaxMessageElems;
  } while (o < count);
  return w;
}

std::shared_ptr<Work> MpiCommunicator::recv(void* buf, int64_t count, DType dtype, int peer, int tag,
                                            const std::string& label) {
  check_count(count, "recv");
  check_p2p(peer, tag, size_, "recv");
  const int64_t es = dtype_size(dtype);
  auto w = make_work<RequestWork>("recv", label, rank_, size_, options_.wait);
  std::lock_guard<std::mutex> lock(issue_mu_);
  int64_t o = 0;
  do {
    w->reqs.emplace_back();
    check(MPI_Irecv(static_cast<char*>(buf) + o * es,
                    static_cast<int>(std::min(kMaxMessageElems, count - o)), mpi_type(dtype), peer, tag,
                    comm_, &w->reqs.back()),
          "MPI_Irecv");
    o += kMaxMessageElems;
  } while (o < count);
  return w;
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  MPI_Comm nc = MPI_COMM_NULL;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &nc), "MPI_Comm_split");
  }
  if (nc == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<Communicator>(new MpiCommunicator(Adopt{}, nc, options_, memory_));
}

int MpiCommunicator::machine() {
  std::lock_guard<std::mutex> lock(issue_mu_);
  MPI_Comm shared = MPI_COMM_NULL;
  check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &shared), "MPI_Comm_split_type");
  int mine = 0, lowest = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &mine);
  const int rc = MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, shared);
  MPI_Comm_free(&shared);
  check(rc, "MPI_Allreduce (machine)");
  return lowest;
}

}  // namespace shardlm::comm
