#include "plan/arena.h"

#include <algorithm>

namespace shardlm::plan {
namespace {

// Which tasks finish before a task starts in every schedule: its deps, the task before it on its
// stream, and theirs, as one bitset per task.
class Precedence {
 public:
  explicit Precedence(const Plan& plan) : words_((plan.tasks.size() + 63) / 64), before_(plan.tasks.size() * words_, 0) {
    std::vector<int> last(plan.streams.size(), -1);
    for (const Task& t : plan.tasks) {  // list order: every dep comes earlier in the list
      uint64_t* mine = row(t.id);
      auto inherit = [&](int d) {
        const uint64_t* theirs = row(d);
        for (size_t w = 0; w < words_; ++w) mine[w] |= theirs[w];
        mine[d / 64] |= uint64_t{1} << (d % 64);
      };
      for (int d : t.deps) inherit(d);
      if (last[t.stream] >= 0) inherit(last[t.stream]);
      last[t.stream] = t.id;
    }
  }
  bool before(int earlier, int later) const { return (row(later)[earlier / 64] >> (earlier % 64)) & 1; }

 private:
  uint64_t* row(int t) { return &before_[static_cast<size_t>(t) * words_]; }
  const uint64_t* row(int t) const { return &before_[static_cast<size_t>(t) * words_]; }
  size_t words_;
  std::vector<uint64_t> before_;
};

// One life of a buffer: allocated by a task (at its start, or at its end where handed off) and
// freed by a later one (-1: never, within the step).
struct Life {
  int alloc = -1, free = -1;
  bool handed = false;
};

std::vector<std::vector<Life>> lives_of(const Plan& plan) {
  std::vector<std::vector<Life>> lives(plan.buffers.size());
  for (const Task& t : plan.tasks) {
    for (int a : t.allocs) lives[a].push_back({t.id, -1, false});
    for (int f : t.frees)
      if (!lives[f].empty() && lives[f].back().free < 0) lives[f].back().free = t.id;
    for (int a : t.hands_off) lives[a].push_back({t.id, -1, true});
  }
  return lives;
}

}  // namespace

ArenaLayout lay_out_arena(const Plan& plan) {
  const Precedence order(plan);
  const std::vector<std::vector<Life>> lives = lives_of(plan);
  auto in_repeat = [&](int t) { return t >= 0 && plan.tasks[t].micro == plan.repeat.micro; };
  auto on_compute = [&](int t) { return t >= 0 && plan.tasks[t].stream == kCompute; };
  // x's life ends before y's begins in every schedule.
  auto ends_before = [&](const Life& x, const Life& y) {
    if (x.free < 0) return false;
    return x.free == y.alloc ? y.handed : order.before(x.free, y.alloc);
  };
  // Lives in the repeated micro-step (Plan::repeat) recur once a run; the runs of the compute
  // stream follow one another, so two lives there, on the compute stream only, ordered in one run
  // are ordered across runs too. Lives touching another stream may overlap the next run's.
  auto repeated = [&](const Life& l) { return plan.repeat.micro >= 0 && (in_repeat(l.alloc) || in_repeat(l.free)); };
  auto compute_only = [&](const Life& l) { return on_compute(l.alloc) && on_compute(l.free); };
  auto may_share = [&](int a, int b) {
    for (const Life& x : lives[a])
      for (const Life& y : lives[b]) {
        if (repeated(x) && repeated(y) && !(compute_only(x) && compute_only(y))) return false;
        if (!ends_before(x, y) && !ends_before(y, x)) return false;
      }
    return true;
  };

  ArenaLayout layout;
  layout.offset.assign(plan.buffers.size(), -1);
  std::vector<int> by_size;
  for (const BufferDesc& b : plan.buffers)
    if (!lives[b.id].empty() && b.bytes > 0) by_size.push_back(b.id);
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) { return plan.buffers[a].bytes > plan.buffers[b].bytes; });
  auto padded = [](int64_t bytes) { return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign; };
  std::vector<int> placed;
  std::vector<std::pair<int64_t, int64_t>> taken;  // [begin, end) of the placed buffers it may live beside
  for (int b : by_size) {
    taken.clear();
    for (int o : placed)
      if (!may_share(o, b)) taken.push_back({layout.offset[o], layout.offset[o] + padded(plan.buffers[o].bytes)});
    std::sort(taken.begin(), taken.end());
    const int64_t n = padded(plan.buffers[b].bytes);
    int64_t at = 0;
    for (const auto& [begin, end] : taken) {
      if (at + n <= begin) break;
      at = std::max(at, end);
    }
    layout.offset[b] = at;
    layout.bytes = std::max(layout.bytes, at + n);
    placed.push_back(b);
  }
  return layout;
}

}  // namespace shardlm::plan
