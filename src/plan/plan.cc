#include "plan/plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

namespace shardlm::plan {

const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::ddp: return "ddp";
    case Strategy::zero1: return "zero1";
    case Strategy::zero2: return "zero2";
    case Strategy::fsdp: return "fsdp";
    case Strategy::hybrid: return "hybrid";
  }
  return "?";
}

Strategy parse_strategy(const std::string& name) {
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
    if (name == to_string(s)) return s;
  throw std::invalid_argument("strategy: unknown '" + name + "' (expected ddp, zero1, zero2, fsdp or hybrid)");
}

const char* to_string(Stream s) { return s == Stream::compute ? "compute" : "comm"; }

const char* to_string(Op op) {
  switch (op) {
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_reduce: return "all_reduce";
    case Op::forward: return "forward";
    case Op::head: return "head";
    case Op::backward: return "backward";
    case Op::grad_norm: return "grad_norm";
    case Op::optimizer: return "optimizer";
    case Op::param_gather: return "param_gather";
  }
  return "?";
}

const char* to_string(Group g) {
  switch (g) {
    case Group::world: return "world";
    case Group::shard: return "shard";
    case Group::replicate: return "replicate";
  }
  return "?";
}

std::string Task::name(const model::ModelDesc* desc) const {
  std::string s = to_string(op);
  auto add_unit = [&](int u) {
    s += ' ';
    if (desc) {
      s += desc->units[u].name;
    } else {
      s += 'u';
      s += std::to_string(u);
    }
  };
  if (op == Op::all_reduce && first_unit >= 0) {
    add_unit(first_unit);
    s += "..";
    add_unit(last_unit);
  } else if (unit >= 0) {
    add_unit(unit);
  }
  if (op == Op::forward || op == Op::backward || op == Op::head || op == Op::all_gather) {
    s += " [m";
    s += std::to_string(micro);
    s += ']';
  }
  return s;
}

bool Plan::depends_on(int later, int earlier) const {
  // A task waits for its deps and for the task before it on its own stream.
  std::vector<int> prev_on_stream(tasks.size(), -1);
  std::vector<int> last{-1, -1};
  for (const Task& t : tasks) {
    int& l = last[static_cast<int>(t.stream)];
    prev_on_stream[t.id] = l;
    l = t.id;
  }
  std::vector<char> seen(tasks.size(), 0);
  std::vector<int> stack{later};
  while (!stack.empty()) {
    const int t = stack.back();
    stack.pop_back();
    std::vector<int> preds = tasks[t].deps;
    if (prev_on_stream[t] >= 0) preds.push_back(prev_on_stream[t]);
    for (int d : preds) {
      if (d == earlier) return true;
      if (!seen[d]) seen[d] = 1, stack.push_back(d);
    }
  }
  return false;
}

namespace {
// Walks the tasks in list order; returns the snapshot at the highest total and, in `each`, every
// category's own maximum.
MemSnapshot walk_memory(const Plan& plan, MemSnapshot* each);
}  // namespace

MemSnapshot Plan::peak_memory() const { return walk_memory(*this, nullptr); }

MemSnapshot Plan::max_memory() const {
  MemSnapshot each;
  walk_memory(*this, &each);
  return each;
}

namespace {
MemSnapshot walk_memory(const Plan& plan, MemSnapshot* each) {
  const StaticMemory& static_memory = plan.static_memory;
  const std::vector<Task>& tasks = plan.tasks;
  MemSnapshot live;
  auto add = [&](MemCategory c, int64_t b) {
    live.bytes[static_cast<int>(c)] += b;
    live.total += b;
  };
  add(MemCategory::params, static_memory.params);
  add(MemCategory::grads, static_memory.grads);
  add(MemCategory::optimizer, static_memory.optimizer);
  add(MemCategory::activations, static_memory.activations);
  add(MemCategory::workspace, static_memory.workspace);
  MemSnapshot peak = live;
  std::map<std::string, BufferUse> alive;
  // Tasks in list order: every allocation precedes its frees, and the list order is one the
  // streams can run in, so this walk visits a reachable sequence of live sets.
  for (const Task& t : tasks) {
    for (const auto& a : t.allocs) {
      alive[a.name] = a;
      add(a.category, a.bytes);
    }
    if (live.total > peak.total) peak = live;
    if (each)
      for (int c = 0; c < kNumMemCategories; ++c) each->bytes[c] = std::max(each->bytes[c], live.bytes[c]);
    for (const auto& f : t.frees) {
      auto it = alive.find(f);
      if (it == alive.end()) continue;
      add(it->second.category, -it->second.bytes);
      alive.erase(it);
    }
  }
  if (each) {
    each->total = 0;
    for (int c = 0; c < kNumMemCategories; ++c) {
      each->bytes[c] = std::max(each->bytes[c], peak.bytes[c]);
      each->total += each->bytes[c];
    }
  }
  return peak;
}
}  // namespace

std::string Plan::to_text(const model::ModelDesc& desc) const {
  std::ostringstream o;
  const auto& c = config;
  o << "plan: strategy " << to_string(c.strategy) << ", " << c.world << " ranks";
  if (c.strategy == Strategy::hybrid) o << " (shard groups of " << shard_size << ")";
  o << ", B=" << c.batch << " T=" << c.seq << " grad_accum=" << c.grad_accum << ", prefetch fwd " << c.prefetch_forward
    << " bwd " << c.prefetch_backward << ", gathers in flight <= " << c.max_gathers_in_flight << "\n";
  o << "units:";
  for (size_t u = 0; u < desc.units.size(); ++u)
    o << " u" << u << "=" << desc.units[u].name << "(" << layout.units[u].padded << ")";
  o << "\n\nmemory per rank (bytes):\n";
  const MemSnapshot peak = peak_memory();
  auto line = [&](const char* name, int64_t st, MemCategory cat) {
    o << "  " << name << ": static " << st << ", at peak " << peak[cat] << " (" << peak[cat] / 1048576.0 << " MiB)\n";
  };
  line("params", static_memory.params, MemCategory::params);
  line("grads", static_memory.grads, MemCategory::grads);
  line("optimizer", static_memory.optimizer, MemCategory::optimizer);
  line("activations", static_memory.activations, MemCategory::activations);
  line("comm", 0, MemCategory::comm);
  line("workspace", static_memory.workspace, MemCategory::workspace);
  o << "  total at peak: " << peak.total << "\n\ntasks (id stream op | deps | GFLOP | MiB | allocs / frees):\n";
  double flops = 0;
  int64_t comm_bytes = 0;
  for (const Task& t : tasks) {
    o << "  " << t.id << "\t" << to_string(t.stream) << "\t" << t.name(&desc);
    if (t.stream == Stream::comm) o << " (" << to_string(t.group) << ")";
    o << " | deps";
    for (int d : t.deps) o << " " << d;
    if (t.flops > 0) o << " | " << t.flops / 1e9 << " GFLOP";
    if (t.bytes > 0) o << " | " << t.bytes / 1048576.0 << " MiB";
    for (const auto& a : t.allocs) o << " | +" << a.name << " " << a.bytes;
    for (const auto& f : t.frees) o << " | -" << f;
    o << "\n";
    flops += t.flops;
    comm_bytes += t.bytes;
  }
  o << "\ntotal: " << tasks.size() << " tasks, " << flops / 1e9 << " GFLOP, " << comm_bytes / 1048576.0
    << " MiB of collectives\n";
  return o.str();
}

}  // namespace shardlm::plan
