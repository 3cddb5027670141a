// The cost model: how long each task of a plan takes on a hardware profile.
//  - compute: FLOPs / (peak × GEMM efficiency) + pointwise bytes / memory bandwidth; where the
//    profile has measured rates, a unit's weight GEMMs and attention at the nearest measured
//    shape's rate;
//  - collectives: α + S · factor(n) / busBw (nccl-tests' definitions: S the whole buffer,
//    factor (n−1)/n for all-gather and reduce-scatter, 2(n−1)/n for all-reduce), α and busBw
//    from how the group lies on the machine (collective_cost: inside a node the fabric, at the
//    fraction of its busBw a published table shows at that size; across nodes the NICs of its
//    devices in parallel, capped by the fabric);
//  - all-to-all: α · (n−1) + S · (n−1)/n / busBw, S the bytes each rank sends in all (its own
//    block included, which stays), α per peer message: each rank sends n−1 messages.
#pragma once

#include <array>
#include <vector>

#include "model/model.h"
#include "plan/plan.h"
#include "sim/hardware.h"

namespace shardlm::sim {

// factor(n) of a collective over n ranks (0 for one rank: nothing moves).
double bus_factor(Collective c, int n);
// Seconds of one collective of S bytes (the whole buffer; all_to_all: what each rank sends in
// all) over n ranks on one link.
double collective_seconds(const LinkCost& link, Collective c, double S, int n);
// The fraction of its busBw at which `tier` moves S bytes beyond its latency (Tier::by_size):
// interpolated on log scales between the published sizes, the nearest end's beyond them; 1 for
// a tier without the table.
double size_efficiency(const Tier& tier, double S);
// A ring-family collective (all-gather, reduce-scatter, all-reduce; NVLS) of S bytes over n ranks
// on `link` of `tier`: latency + S · factor(n) / (busBw · size_efficiency(S)). Every op and group
// takes the tier's all_reduce table at its own S: NCCL picks its protocol and channels by the
// message's size. (A group of fewer ranks than the table's moves larger steps, so for it this
// errs slow.)
double ring_seconds(const Tier& tier, const LinkCost& link, Collective c, double S, int n);
// Which collective a plan op is priced as (norm_reduce gathers each rank's four figures).
Collective collective_of(plan::Op op);

// How a group of ranks lies on the machine: its ranks, the nodes it spans, and the most of its
// ranks on one node. Ranks fill nodes in order (devices_per_node consecutive ranks a node).
struct GroupSpan {
  int ranks = 1, nodes = 1, per_node = 1;
};
// The group over mesh `axes` that holds rank 0 (every group of an axis set has the same shape).
GroupSpan span_of(const plan::Mesh& mesh, const std::vector<int>& axes, int devices_per_node);
// `ranks` consecutive ranks from rank 0 (as nccl-tests runs them: -np ranks, devices_per_node a node).
GroupSpan contiguous_span(int ranks, int devices_per_node);

// The algorithms a collective is priced with (NCCL's names). direct: all-to-all's and a
// point-to-point message's (each pair sends its own bytes). best: the fastest available.
enum class Algorithm { best, ring, tree, nvls, direct };
const char* to_string(Algorithm a);
struct CollectiveCost {
  double seconds = 0;
  Algorithm algorithm = Algorithm::ring;
  bool available = true;  // false: `algorithm` does not apply (tree and NVLS price all-reduce only)
  bool low_latency = false;  // priced with the network's LL protocol (Network::low_latency)
};
// Seconds of one collective of S bytes (all_to_all: what each rank sends in all) over group `g`:
//  - inside one node (or without a `network` in the profile): the intra tier (or the flat inter
//    tier) as ring_seconds prices it (all-to-all: collective_seconds); NVLS where the profile has
//    it and the group is a whole node;
//  - across nodes with a `network`: the ring's busBw is the NICs of the group's devices on a node
//    in parallel (one ring a NIC, each device its share of the node's NICs), capped by the intra
//    tier's busBw of the op at that size (× size_efficiency); α is the intra tier's plus
//    ring_step_latency_s per step that crosses the network (2(N−1) for all-reduce, N−1 for
//    all-gather/reduce-scatter over N nodes). The tree (all-reduce) pays 2·⌈log2 N⌉
//    tree_step_latency_s and moves 2S through each device inside the node (up the chain and down,
//    at that size's rate) and 2S(N−1)/N through each node's NICs, at tree_efficiency. With the
//    network's low_latency figures, ring and tree are priced a second time with LL's step
//    latencies and its fraction of the bandwidth; the faster one is the cost.
//    All-to-all sends (n−k)/n of each rank's bytes across the network on that rank's own share of
//    the NICs and (k−1)/n on the fabric, the two at once; α per peer message on each.
CollectiveCost collective_cost(const HardwareProfile& hw, Collective c, double S, const GroupSpan& g,
                               Algorithm a = Algorithm::best);
// Seconds of one message of S bytes between two ranks (a ring attention step): the intra tier's
// all_to_all figures inside a node; across nodes one device's share of the NICs and the
// network's message latency (or the flat inter tier's all_to_all figures without a network).
double p2p_seconds(const HardwareProfile& hw, double S, bool crosses_nodes);

class CostModel {
 public:
  // `threads`: compute threads per rank (a per-thread CPU profile multiplies its peak by it).
  // `expert_load`: the busiest expert's routed rows over the mean (model::Shape::expert_load): the
  // busiest rank's expert side and the exchanges are priced at that rank's load (the model's
  // figures), which the step waits for.
  // `spans`: groups whose span the caller already knows (the planner's bounds, per frame).
  using Spans = std::vector<std::pair<std::vector<int>, GroupSpan>>;
  CostModel(const model::ModelDesc& desc, const plan::Plan& plan, const HardwareProfile& hw, int threads,
            double expert_load = 1, Spans spans = {});
  // Seconds task `t` takes at full speed (compute slowed by communication is the simulator's).
  double seconds(const plan::Task& t) const;
  // Ranks of the group a collective spans, how it lies on nodes, and whether it crosses a node boundary.
  int group_size(const plan::Task& t) const;
  GroupSpan span(const plan::Task& t) const;
  bool crosses_nodes(const plan::Task& t) const { return span(t).nodes > 1; }
  // Seconds of an all-to-all (expert parallelism's token exchange) over a group of `group` ranks
  // in which each rank sends `bytes_per_rank` bytes in all, (group−1)/group of them leaving it:
  // latency · (group−1) + bytes_per_rank · (group−1)/group / bus_bw, with the profile's
  // all_to_all figures of the tier the group spans (`crosses_nodes`: the inter-node one).
  double all_to_all_seconds(double bytes_per_rank, int group, bool crosses_nodes) const;
  double flops_per_s() const { return rate_; }  // achieved GEMM FLOP/s of one rank
  double peak_flops() const { return peak_; }   // one rank's peak (the MFU denominator)

 private:
  double compute_seconds(const plan::Task& t) const;
  const model::ModelDesc& desc_;
  const plan::Plan& plan_;
  const HardwareProfile& hw_;
  double peak_ = 0, rate_ = 0, pointwise_bw_ = 0;
  double oversubscription_ = 1;  // compute threads on the node per core, at least 1
  std::vector<int64_t> pointwise_;  // per unit: bytes the forward's non-GEMM kernels move
  std::vector<char> full_rebuild_;  // per unit: its recompute reruns the whole forward (GEMMs, attention)
  // Per unit: the forward's attention FLOPs, priced at attention_rate_ where the profile gives an
  // attention_efficiency and no measured attention rates (else empty).
  std::vector<double> attention_;
  double attention_rate_ = 0;
  // [backward][unit]: each stage's share of the unit's work in that direction (model::UnitCosts), and
  // the busiest rank's work per stage over its share.
  std::array<std::vector<std::vector<double>>, 2> stage_share_, stage_load_;
  // Per unit, forward [0] and backward [1]: each exchange's bytes at the busiest rank.
  std::vector<std::array<std::vector<int64_t>, 2>> exchange_bytes_;
  // Per unit, with measured rates (empty without): the forward FLOPs they price (weight GEMMs,
  // attention) and their seconds forward and backward.
  struct Measured {
    double flops = 0, forward_s = 0, backward_s = 0;
    double op_rebuild_flops = 0, op_rebuild_s = 0;  // the GEMMs selective_op reruns, where the unit's mode is it
  };
  std::vector<Measured> measured_;
  // The span of each axis set the plan's collectives name (a handful), computed once.
  Spans spans_;
};

}  // namespace shardlm::sim
