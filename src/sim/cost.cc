#include "sim/cost.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace shardlm::sim {

using plan::Op;

namespace {

double log_distance(int64_t a, int64_t b) {
  const double r = std::log(static_cast<double>(a) / static_cast<double>(b));
  return r * r;
}

// The measured row nearest by `distance` among those at the nearest thread count, and the factor
// that scales its rates linearly to `threads`. A profile whose figures are per device (a GPU's,
// per_thread false) is measured once, whatever --threads: its rows are taken as they are.
template <class Row, class Distance>
std::pair<const Row*, double> nearest(const std::vector<Row>& rows, int threads, bool per_thread, Distance distance) {
  if (!per_thread) threads = 1;
  int at = rows.front().threads;
  for (const Row& r : rows)
    if (std::abs(r.threads - threads) < std::abs(at - threads)) at = r.threads;
  const Row* best = nullptr;
  for (const Row& r : rows)
    if (r.threads == at && (!best || distance(r) < distance(*best))) best = &r;
  return {best, per_thread ? static_cast<double>(threads) / at : 1.0};
}

}  // namespace

double bus_factor(Collective c, int n) {
  if (n <= 1) return 0;
  const double f = static_cast<double>(n - 1) / n;
  return c == Collective::all_reduce ? 2 * f : f;
}

double collective_seconds(const LinkCost& link, Collective c, double S, int n) {
  if (n <= 1) return 0;  // a group of one moves nothing and waits for no one
  const double messages = c == Collective::all_to_all ? n - 1 : 1;  // latencies paid in turn
  return link.latency_s * messages + S * bus_factor(c, n) / link.bus_bw;  // s + bytes / (bytes/s)
}

double size_efficiency(const Tier& tier, double S) {
  const std::vector<SizeEfficiency>& t = tier.by_size;
  if (t.empty()) return 1;
  if (S <= t.front().bytes) return t.front().fraction;
  if (S >= t.back().bytes) return t.back().fraction;
  const auto hi = std::upper_bound(t.begin(), t.end(), S, [](double s, const SizeEfficiency& e) { return s < e.bytes; });
  const auto lo = hi - 1;
  const double u = std::log(S / lo->bytes) / std::log(hi->bytes / lo->bytes);
  return std::exp((1 - u) * std::log(lo->fraction) + u * std::log(hi->fraction));
}

double ring_seconds(const Tier& tier, const LinkCost& link, Collective c, double S, int n) {
  if (n <= 1) return 0;
  return link.latency_s + S * bus_factor(c, n) / (link.bus_bw * size_efficiency(tier, S));
}

namespace {

// The span of the group over `axes` that holds the rank at `base` coordinates.
GroupSpan span_from(const plan::Mesh& mesh, const std::vector<int>& axes, std::vector<int> coords, int devices_per_node) {
  GroupSpan g;
  g.ranks = mesh.group_size(axes);
  std::vector<std::pair<int, int>> counts;  // (node, ranks of the group on it)
  for (int i = 0; i < g.ranks; ++i) {
    int rest = i;
    for (auto a = axes.rbegin(); a != axes.rend(); ++a) {
      coords[*a] = rest % mesh[*a].size;
      rest /= mesh[*a].size;
    }
    const int node = mesh.rank_of(coords) / devices_per_node;
    auto at = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == node; });
    if (at == counts.end()) counts.emplace_back(node, 1);
    else ++at->second;
  }
  g.nodes = static_cast<int>(counts.size());
  for (const auto& c : counts) g.per_node = std::max(g.per_node, c.second);
  return g;
}

}  // namespace

GroupSpan span_of(const plan::Mesh& mesh, const std::vector<int>& axes, int devices_per_node) {
  const int n = mesh.group_size(axes);
  if (n <= 1 || devices_per_node <= 0) return {n, 1, n};
  // The first group and the last: where node boundaries do not fall on group boundaries (a world
  // that is no multiple of the node), a later group straddles one though the first does not.
  const GroupSpan first = span_from(mesh, axes, mesh.coords(0), devices_per_node);
  const GroupSpan last = span_from(mesh, axes, mesh.coords(mesh.rank_count() - 1), devices_per_node);
  return {n, std::max(first.nodes, last.nodes), std::max(first.per_node, last.per_node)};
}

GroupSpan contiguous_span(int ranks, int devices_per_node) {
  const int dpn = std::max(1, devices_per_node);
  return {ranks, (ranks + dpn - 1) / dpn, std::min(ranks, dpn)};
}

const char* to_string(Algorithm a) {
  switch (a) {
    case Algorithm::best: return "best";
    case Algorithm::ring: return "ring";
    case Algorithm::tree: return "tree";
    case Algorithm::nvls: return "nvls";
    case Algorithm::direct: return "direct";
  }
  return "?";
}

namespace {

// A collective's priced candidates: at most ring and tree, each with two protocols. Fixed
// storage: the planner prices collectives hundreds of thousands of times.
struct Candidates {
  CollectiveCost at[4];
  int count = 0;
  void add(const CollectiveCost& c) { at[count++] = c; }
  const CollectiveCost* begin() const { return at; }
  const CollectiveCost* end() const { return at + count; }
};

// Inside one node, or across nodes of a profile without a network (its flat inter tier).
Candidates one_tier(const HardwareProfile& hw, Collective c, double S, const GroupSpan& g) {
  const int n = g.ranks;
  const Tier& tier = g.nodes > 1 ? hw.inter : hw.intra;
  Candidates out;
  const LinkCost& link = tier.of(c, n, g.per_node);
  if (c == Collective::all_to_all) {
    out.add({collective_seconds(link, c, S, n), Algorithm::direct});
    return out;
  }
  out.add({ring_seconds(tier, link, c, S, n), Algorithm::ring});
  // NVLS reduces in the switch of a whole node (fewer devices than a node: ring, per NVIDIA/nccl issue 1455's
  // measurements NVLS gains only from 5 GPUs up).
  if (c == Collective::all_reduce && g.nodes <= 1 && hw.fabric.has_nvls && n == hw.devices_per_node)
    out.add({ring_seconds(hw.intra, hw.fabric.nvls_all_reduce, c, S, n), Algorithm::nvls});
  return out;
}

// What the group's devices on one node can push through the network at once: each its share.
double group_nics_bw(const HardwareProfile& hw, const GroupSpan& g) {
  const int dpn = hw.devices_per_node;
  return std::min(g.per_node, dpn) * hw.network.per_device_bw(dpn);
}

// All-to-all across nodes: this rank's bytes to other nodes on its own share of the NICs, those to
// its node on the fabric, the two at once.
CollectiveCost all_to_all_across(const HardwareProfile& hw, double S, const GroupSpan& g) {
  const int n = g.ranks, k = g.per_node;
  const LinkCost& fabric = hw.intra.of(Collective::all_to_all);
  const double off = S * (n - k) / n / (group_nics_bw(hw, g) / k);
  const double on = k > 1 ? S * (k - 1) / n / fabric.bus_bw : 0;
  const double alpha = fabric.latency_s * (k - 1) + hw.network.message_latency_s * (n - k);
  return {alpha + std::max(off, on), Algorithm::direct};
}

// Ring (and, for all-reduce, tree) across nodes, once per protocol NCCL could pick: the
// profile's default and, where given, LL.
Candidates ring_and_tree_across(const HardwareProfile& hw, Collective c, double S, const GroupSpan& g) {
  const Network& net = hw.network;
  const int n = g.ranks, k = g.per_node, N = g.nodes;
  const double nics = group_nics_bw(hw, g);
  const LinkCost& fabric = hw.intra.of(c);
  // Inside the node the fabric moves this size's bytes at its efficiency there (Tier::by_size).
  const double in_node_bw = fabric.bus_bw * size_efficiency(hw.intra, S);
  // Ring: one ring per NIC, each crossing every node boundary once; inside the node the fabric.
  const double ring_bw = k > 1 ? std::min(in_node_bw, nics) : nics;
  const int inter_steps = (c == Collective::all_reduce ? 2 : 1) * (N - 1);
  const double levels = std::ceil(std::log2(static_cast<double>(N)));
  const double chain = k > 1 ? 2 * S / in_node_bw : 0;  // the tree: up the node's chain and back down
  const double network = 2 * S * (N - 1) / N / nics;    // the tree: a node's share of its two trees' edges
  struct Protocol {
    double ring_step_latency_s, tree_step_latency_s, bandwidth_fraction;
    bool low_latency;
  };
  const Network::LowLatency& ll = net.low_latency;
  const Protocol protocols[] = {{net.ring_step_latency_s, net.tree_step_latency_s, 1, false},
                                {ll.ring_step_latency_s, ll.tree_step_latency_s, ll.bandwidth_fraction, true}};
  Candidates out;
  for (const Protocol& p : protocols) {
    if (p.low_latency && !ll.present) continue;
    out.add({fabric.latency_s + inter_steps * p.ring_step_latency_s +
                       S * bus_factor(c, n) / (ring_bw * p.bandwidth_fraction),
                   Algorithm::ring, true, p.low_latency});
    if (c == Collective::all_reduce)
      out.add({fabric.latency_s + 2 * levels * p.tree_step_latency_s +
                         std::max(chain, network) / (net.tree_efficiency * p.bandwidth_fraction),
                     Algorithm::tree, true, p.low_latency});
  }
  return out;
}

// The candidates of one collective on one group; unavailable ones are left out.
Candidates candidates(const HardwareProfile& hw, Collective c, double S, const GroupSpan& g) {
  if (g.nodes <= 1 || !hw.network.present) return one_tier(hw, c, S, g);
  if (c != Collective::all_to_all) return ring_and_tree_across(hw, c, S, g);
  Candidates out;
  out.add(all_to_all_across(hw, S, g));
  return out;
}

}  // namespace

CollectiveCost collective_cost(const HardwareProfile& hw, Collective c, double S, const GroupSpan& g, Algorithm a) {
  if (g.ranks <= 1) return {0, c == Collective::all_to_all ? Algorithm::direct : Algorithm::ring};
  const Candidates all = candidates(hw, c, S, g);
  const CollectiveCost* pick = nullptr;
  for (const CollectiveCost& x : all)
    if ((a == Algorithm::best || x.algorithm == a) && (!pick || x.seconds < pick->seconds)) pick = &x;
  if (!pick) return {0, a, false};
  return *pick;
}

double p2p_seconds(const HardwareProfile& hw, double S, bool crosses_nodes) {
  if (crosses_nodes && hw.network.present)
    return hw.network.message_latency_s + S / hw.network.per_device_bw(hw.devices_per_node);
  const LinkCost& link = (crosses_nodes ? hw.inter : hw.intra).of(Collective::all_to_all);
  return link.latency_s + S / link.bus_bw;
}

Collective collective_of(Op op) {
  switch (plan::info(op).collective) {
    case plan::OpCollective::all_gather: return Collective::all_gather;
    case plan::OpCollective::reduce_scatter: return Collective::reduce_scatter;
    case plan::OpCollective::all_reduce: return Collective::all_reduce;
    case plan::OpCollective::all_to_all: return Collective::all_to_all;
    case plan::OpCollective::point_to_point:
    case plan::OpCollective::none: break;
  }
  throw std::invalid_argument(std::string("not a collective: ") + plan::to_string(op));
}

CostModel::CostModel(const model::ModelDesc& desc, const plan::Plan& plan, const HardwareProfile& hw, int threads,
                     double expert_load, Spans spans)
    : desc_(desc), plan_(plan), hw_(hw), spans_(std::move(spans)) {
  peak_ = hw.peak_flops * (hw.per_thread ? threads : 1);
  if (hw.per_thread && hw.cores_per_node > 0) {
    const int64_t busy = static_cast<int64_t>(std::min(plan.config.world, hw.devices_per_node)) * threads;
    oversubscription_ = std::max(1.0, static_cast<double>(busy) / hw.cores_per_node);
  }
  rate_ = peak_ * hw.gemm_efficiency;
  attention_rate_ = peak_ * hw.attention_efficiency;
  for (const plan::Task& t : plan.tasks) {
    if (plan::info(t.op).stream == plan::OpStream::compute) continue;
    bool known = false;
    for (const auto& s : spans_) known = known || s.first == t.axes;
    if (!known) spans_.emplace_back(t.axes, span_of(plan.mesh, t.axes, hw.devices_per_node));
  }
  pointwise_bw_ = hw.pointwise_bw > 0 ? hw.pointwise_bw * (hw.per_thread ? threads : 1) : hw.memory_bw;
  // The same micro-batch shape the plan's memory figures use (Plan::to_text).
  for (size_t u = 0; u < desc.units.size(); ++u) {
    const model::Shape shape = plan.unit_shape(desc, static_cast<int>(u), 4, expert_load);
    const model::UnitCosts c = desc.costs(static_cast<int>(u), shape);
    pointwise_.push_back(c.pointwise_bytes);
    full_rebuild_.push_back(shape.recompute == model::Recompute::full);
    if (hw.attention_efficiency > 0 && hw.attention_rates.empty()) attention_.push_back(c.attention_flops);
    for (bool backward : {false, true}) {
      stage_share_[backward].push_back(backward && !c.backward_stage_share.empty() ? c.backward_stage_share : c.stage_share);
      stage_load_[backward].push_back(backward && !c.backward_stage_load.empty() ? c.backward_stage_load : c.stage_load);
    }
    exchange_bytes_.emplace_back();
    for (bool backward : {false, true})
      for (const model::Exchange& x : c.exchanges_of(backward)) exchange_bytes_.back()[backward].push_back(x.expected_bytes);
    if (hw.gemm_rates.empty() && hw.attention_rates.empty()) continue;
    Measured m;
    auto rate_of = [&](const model::GemmShape& g) {
      const auto [r, scale] = nearest(hw.gemm_rates, threads, hw.per_thread, [&](const GemmRate& x) {
        return log_distance(g.M, x.M) + log_distance(g.K, x.K) + log_distance(g.N, x.N);
      });
      return std::pair{r->forward * scale, r->backward * scale};
    };
    double flops = 0, forward = 0, backward = 0;
    if (!hw.gemm_rates.empty()) {
      for (const model::GemmShape& g : c.gemms) {
        const auto [fwd, bwd] = rate_of(g);
        flops += g.flops();
        forward += g.flops() / fwd;
        backward += 2 * g.flops() / bwd;
      }
      if (shape.recompute == model::Recompute::selective_op)
        for (const model::GemmShape& g : c.op_rebuilt_gemms) {
          m.op_rebuild_flops += g.flops();
          m.op_rebuild_s += g.flops() / rate_of(g).first;
        }
    }
    if (!hw.attention_rates.empty() && c.attention_flops > 0) {
      const int64_t T = plan.config.seq, HS = desc.config.head_size();
      const auto [r, scale] = nearest(hw.attention_rates, threads, hw.per_thread, [&](const AttentionRate& m) {
        return log_distance(T, m.T) + log_distance(HS, m.HS);
      });
      flops += c.attention_flops;
      forward += c.attention_flops / (r->forward * scale);
      backward += 2 * c.attention_flops / (r->backward * scale);
    }
    m.flops = flops, m.forward_s = forward, m.backward_s = backward;
    measured_.push_back(m);
  }
}

int CostModel::group_size(const plan::Task& t) const { return plan_.mesh.group_size(t.axes); }

GroupSpan CostModel::span(const plan::Task& t) const {
  for (const auto& [axes, g] : spans_)
    if (axes == t.axes) return g;
  return span_of(plan_.mesh, t.axes, hw_.devices_per_node);  // an axis set no task of the plan names
}

double CostModel::compute_seconds(const plan::Task& t) const {
  // Bytes the task's pointwise kernels (and the memory-bound optimizer passes) move.
  double bytes = 0, pointwise = 0;
  const auto& st = plan_.static_memory;
  using plan::OpWork;
  const OpWork work = plan::info(t.op).work;
  switch (work) {
    case OpWork::unit_fwd:
    case OpWork::unit_rebuild:
    case OpWork::unit_fwd_bwd: pointwise = t.unit >= 0 ? pointwise_[t.unit] : 0; break;
    // The backward reads the forward's values and writes their gradients: about twice.
    case OpWork::unit_bwd: pointwise = t.unit >= 0 ? 2.0 * pointwise_[t.unit] : 0; break;
    // AdamW reads params, grads and both moments and writes params and moments.
    // One unit's task (the disk tier splits them per unit, and its state is in windows, not in
    // the static figures): that unit's part of each.
    case OpWork::adamw:
      bytes = t.unit < 0 ? 2.0 * (st.params + st.optimizer) + st.grads
                         : 4.0 * (2.0 * (plan_.held_elems(plan::State::params, t.unit) + 2 * plan_.held_elems(plan::State::optimizer, t.unit)) +
                                  plan_.held_elems(plan::State::grads, t.unit));
      break;
    case OpWork::grads_pass:
      bytes = t.unit < 0 ? static_cast<double>(st.grads) : 4.0 * plan_.held_elems(plan::State::grads, t.unit);
      break;
    case OpWork::none: break;
  }
  // A unit's weight GEMMs and attention at their measured rates, when the profile has them.
  double gemm_flops = 0, gemm_s = 0;
  if (!measured_.empty() && t.unit >= 0) {
    const Measured& m = measured_[t.unit];
    switch (work) {
      case OpWork::unit_fwd: gemm_flops = m.flops, gemm_s = m.forward_s; break;
      case OpWork::unit_fwd_bwd: gemm_flops = 3 * m.flops, gemm_s = m.forward_s + m.backward_s; break;
      case OpWork::unit_bwd: gemm_flops = 2 * m.flops, gemm_s = m.backward_s; break;
      case OpWork::unit_rebuild:
        if (full_rebuild_[t.unit]) gemm_flops = m.flops, gemm_s = m.forward_s;
        else gemm_flops = m.op_rebuild_flops, gemm_s = m.op_rebuild_s;
        break;
      default: break;
    }
  }
  // The blocks' attention at its own efficiency: forward once, backward twice, recomputed under full recompute.
  double attention_flops = 0;
  if (!attention_.empty() && t.unit >= 0) {
    const double a = attention_[t.unit];
    switch (work) {
      case OpWork::unit_fwd: attention_flops = a; break;
      case OpWork::unit_fwd_bwd: attention_flops = 3 * a; break;
      case OpWork::unit_bwd: attention_flops = 2 * a; break;
      case OpWork::unit_rebuild: attention_flops = full_rebuild_[t.unit] ? a : 0; break;
      default: break;
    }
  }
  // One stage of a staged unit's pass does its share of the unit's work (t.flops is already its own),
  // and the busiest rank `load` times that (the plan's figures are balanced).
  double load = 1;
  const bool backward = t.op == Op::backward;
  if (t.stage >= 0 && t.unit >= 0 && !stage_share_[backward][t.unit].empty()) {
    const double share = stage_share_[backward][t.unit][t.stage];
    pointwise *= share, gemm_flops *= share, gemm_s *= share, attention_flops *= share;
    if (!stage_load_[backward][t.unit].empty()) load = stage_load_[backward][t.unit][t.stage];
  }
  // A speculative update's copy of the state it overwrites (--pipeline-optimizer): read and written once.
  bytes += 2.0 * static_cast<double>(t.copy_bytes);
  // Gradient buffers start at zero: the task that allocates them writes each byte once.
  for (int b : t.allocs)
    if (plan_.buffers[b].role == plan::Role::full_grads) bytes += static_cast<double>(plan_.buffers[b].bytes);
  // FLOP / (FLOP/s) + B / (B/s)
  const double attention_s = attention_flops > 0 ? attention_flops / attention_rate_ : 0;
  const double unit_work = (t.flops - gemm_flops - attention_flops) / rate_ + gemm_s + attention_s + pointwise / pointwise_bw_;
  return (load * unit_work + bytes / hw_.memory_bw) * oversubscription_;
}

double CostModel::all_to_all_seconds(double bytes_per_rank, int group, bool crosses_nodes) const {
  const GroupSpan g = crosses_nodes ? contiguous_span(group, hw_.devices_per_node) : GroupSpan{group, 1, group};
  return collective_cost(hw_, Collective::all_to_all, bytes_per_rank, g).seconds;
}

double CostModel::seconds(const plan::Task& t) const {
  if (plan::info(t.op).stream == plan::OpStream::compute) return compute_seconds(t);  // the optimizer stream's too
  // The disk tier's copies (--offload): one request's latency and the bytes at the disk's rate on
  // the copy stream (a profile without disk figures prices them at nothing), and a resident head
  // copied within memory.
  if (plan::info(t.op).stream == plan::OpStream::copy) {
    const double bw = t.op == Op::reload ? hw_.disk_read_bw : hw_.disk_write_bw;
    const double head = 2.0 * static_cast<double>(t.copy_bytes) / hw_.memory_bw;
    return bw > 0 ? hw_.disk_latency_s + static_cast<double>(t.bytes) / bw + head : 0;
  }
  const GroupSpan g = span(t);
  // A pipeline stage's send or receive is one message to or from a neighbouring stage.
  if (plan::info(t.op).collective == plan::OpCollective::point_to_point)
    return p2p_seconds(hw_, static_cast<double>(t.bytes), g.nodes > 1);
  const Collective c = collective_of(t.op);
  // An exchange moves what the busiest rank of its group does (the model's figure at the expert
  // load; the plan's t.bytes is balanced routing's).
  const std::vector<int64_t>* exchanged = t.op == Op::exchange && t.unit >= 0 ? &exchange_bytes_[t.unit][t.reverse] : nullptr;
  const double S = exchanged && t.stage >= 0 && t.stage < static_cast<int>(exchanged->size())
                       ? static_cast<double>((*exchanged)[t.stage])
                       : static_cast<double>(t.bytes);
  // A ring step is one message each way between neighbours, on the exchange link.
  if (t.op == Op::exchange && t.ring_step != 0) return p2p_seconds(hw_, S, g.nodes > 1);
  // A collective's local copies (casts, a bucket's unpacking) read and write memory once each.
  return collective_cost(hw_, c, S, g).seconds + 2.0 * static_cast<double>(t.copy_bytes) / hw_.memory_bw;
}

}  // namespace shardlm::sim
