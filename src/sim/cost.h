// The cost model: how long each task of a plan takes on a hardware profile.
//  - compute: FLOPs / (peak × GEMM efficiency) + pointwise bytes / memory bandwidth; where the
//    profile has measured rates, a unit's weight GEMMs and attention at the nearest measured
//    shape's rate;
//  - collectives: α + S · factor(n) / busBw (nccl-tests' definitions: S the whole buffer,
//    factor (n−1)/n for all-gather and reduce-scatter, 2(n−1)/n for all-reduce), α and busBw
//    those of the link tier the group spans (inside a node, or across nodes);
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
// Which collective a plan op is priced as (norm_reduce gathers each rank's four figures).
Collective collective_of(plan::Op op);

class CostModel {
 public:
  // `threads`: compute threads per rank (a per-thread CPU profile multiplies its peak by it).
  // `expert_load`: the busiest expert's routed rows over the mean (model::Shape::expert_load): the
  // busiest rank's expert side and the exchanges are priced at that rank's load (the model's
  // figures), which the step waits for.
  CostModel(const model::ModelDesc& desc, const plan::Plan& plan, const HardwareProfile& hw, int threads,
            double expert_load = 1);
  // Seconds task `t` takes at full speed (compute slowed by communication is the simulator's).
  double seconds(const plan::Task& t) const;
  // Ranks of the group a collective spans, and whether it crosses a node boundary.
  int group_size(const plan::Task& t) const;
  bool crosses_nodes(const plan::Task& t) const;
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
  std::vector<std::vector<double>> stage_share_;  // per unit: each stage's share of its work (model::UnitCosts)
  std::vector<std::vector<double>> stage_load_;   // per unit: the busiest rank's work per stage over its share
  // Per unit, forward [0] and backward [1]: each exchange's bytes at the busiest rank.
  std::vector<std::array<std::vector<int64_t>, 2>> exchange_bytes_;
  // Per unit, with measured rates (empty without): the forward FLOPs they price (weight GEMMs,
  // attention) and their seconds forward and backward.
  struct Measured {
    double flops = 0, forward_s = 0, backward_s = 0;
  };
  std::vector<Measured> measured_;
};

}  // namespace shardlm::sim
