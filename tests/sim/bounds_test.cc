#include "sim/bounds.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/plan.h"
#include "sim/cost.h"
#include "sim/planner.h"
#include "sim/simulator.h"

namespace shardlm::sim {
namespace {

using plan::PlanConfig;
using plan::Strategy;

std::string preset_dir() { return std::string(std::getenv("SHARDLM_SOURCE_DIR")) + "/configs/hardware"; }
HardwareProfile preset(const std::string& name) { return load_hardware(preset_dir() + "/" + name + ".json", preset_dir()); }

// Milliseconds a plan's tasks on one stream ("compute", "comm", "exchange") take at full speed,
// every run counted.
double busy_ms(const model::ModelDesc& desc, const plan::Plan& p, const HardwareProfile& hw, int threads,
               const std::string& stream) {
  const CostModel cost(desc, p, hw, threads);
  double s = 0;
  for (const plan::Task& t : p.tasks)
    if (p.streams[t.stream] == stream) s += cost.seconds(t) * static_cast<double>(p.runs(t));
  return s * 1e3;
}

struct Checked {
  int plans = 0, sharded = 0, exchanges = 0, waits = 0, ends = 0;
};

// Every bound against the plan built: compute and exchanges equal to their streams' work, comm at
// most the comm stream's, the step at most the simulated one, the peak at most the plan's.
void check(const std::string& name, const model::ModelDesc& desc, const PlanConfig& c, const HardwareProfile& hw, int threads, Checked& n) {
  plan::Plan p;
  try {
    p = plan::build_plan(desc, c);
  } catch (const std::invalid_argument&) {
    EXPECT_THROW(plan::plan_frame(desc, c), std::invalid_argument) << flags_of(c);  // or the frame too
    return;
  }
  const plan::Plan frame = plan::plan_frame(desc, c);
  EXPECT_TRUE(frame.tasks.empty() && frame.buffers.empty());
  EXPECT_EQ(frame.static_memory.params, p.static_memory.params);
  EXPECT_EQ(frame.static_memory.optimizer, p.static_memory.optimizer);
  EXPECT_EQ(frame.mesh.to_string(), p.mesh.to_string());
  const StepBounds b = step_bounds(desc, bounds_frame(desc, frame, hw), c, hw, threads);
  const double compute = busy_ms(desc, p, hw, threads, "compute"), comm = busy_ms(desc, p, hw, threads, "comm");
  const double exchange = busy_ms(desc, p, hw, threads, "exchange");
  EXPECT_NEAR(b.exchange_ms, exchange, 1e-9 * exchange) << name << " " << flags_of(c);
  n.exchanges += exchange > 0;
  n.waits += b.waited_ms > 0;
  n.ends += b.ends_ms > 0;
  EXPECT_NEAR(b.compute_ms, compute, 1e-9 * compute) << name << " " << flags_of(c);
  EXPECT_LE(b.comm_ms, comm * (1 + 1e-12)) << name << " " << flags_of(c);
  EXPECT_LE(b.step_ms(), simulate(desc, p, hw, threads).step_ms * (1 + 1e-12)) << name << " " << flags_of(c);
  EXPECT_LE(b.peak_bytes, p.peak_memory().total) << name << " " << flags_of(c);
  if (c.recompute != model::Recompute::full) {  // else only inputs are kept, which the bound leaves out
    EXPECT_GT(b.peak_bytes, p.static_memory.params + p.static_memory.grads + p.static_memory.optimizer);
  }
  ++n.plans;
  if (c.world > 1 && c.strategy != Strategy::ddp) {
    EXPECT_GT(b.comm_ms, 0) << name << " " << flags_of(c);  // bounds something
    ++n.sharded;
  }
}

TEST(Bounds, AreBelowThePlansFiguresAndComputeIsTheComputeStreamsWork) {
  HardwareProfile hw = preset("h100-80gb-datasheet");
  hw.devices_per_node = 2;
  struct Case {
    const char* model;
    int ranks;
    int64_t seq, sequences;
    std::vector<int> eps, cps;
  };
  Checked n;
  int each = 0;  // plans reducing each micro-step
  for (const Case& k : {Case{"llama-tiny", 4, 256, 8, {1}, {1, 2}}, Case{"moe-tiny", 8, 128, 2, {1, 2, 4}, {1, 2}},
                        Case{"tiny", 2, 128, 6, {1}, {1}}, Case{"moe-tiny", 4, 128, 24, {2}, {1}}}) {
    const model::ModelDesc desc = model::describe(model::model_preset(k.model, k.seq));
    for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid})
      for (int g : s == Strategy::hybrid ? std::vector<int>{2, 4} : std::vector<int>{0})
        for (int ep : k.eps)
          for (int cp : k.cps)
            for (model::ContextImpl impl : {model::ContextImpl::ring, model::ContextImpl::all_to_all})
              for (int64_t B : {int64_t{1}, k.sequences})
                for (model::Recompute r : {model::Recompute::full, model::Recompute::selective_op, model::Recompute::selective,
                                           model::Recompute::none})
                  for (int bytes : {4, 2})
                    for (int keep = 0; keep < 3; ++keep) {
                      if (cp == 1 && impl != model::ContextImpl::ring) continue;
                      if (r == model::Recompute::selective_op && (desc.config.family != model::Family::llama || cp > 1)) continue;
                      PlanConfig c = for_hardware(PlanConfig{}, hw);
                      c.world = k.ranks, c.seq = k.seq, c.strategy = s, c.shard_group = g, c.ep = ep, c.cp = cp;
                      c.cp_impl = impl, c.batch = B, c.grad_accum = k.sequences * cp / B, c.recompute = r;
                      c.param_bytes = c.reduce_bytes = bytes;
                      c.gather_bucket_mb = keep == 1 ? 1.0 : 0.0;
                      if (keep == 2) c.keep_gathered = {"all"};
                      check(k.model, desc, c, hw, 1, n);
                      const bool sharded_grads = s == Strategy::zero2 || s == Strategy::fsdp || s == Strategy::hybrid;
                      if (sharded_grads && c.grad_accum > 1 && keep == 0) {
                        c.reduce_each_micro_step = true;
                        check(k.model, desc, c, hw, 1, n);
                        ++each;
                      }
                    }
  }
  EXPECT_GT(each, 100);
  EXPECT_GT(n.plans, 800);
  EXPECT_GT(n.sharded, 500);
  EXPECT_GT(n.exchanges, 300);
  EXPECT_GT(n.waits, 200);
  EXPECT_GT(n.ends, 1000);
}

// With measured GEMM and attention rates (a calibrated CPU profile) the compute bound prices the
// units at them as the plan's tasks are priced.
TEST(Bounds, ComputeIsTheComputeStreamsWorkAtMeasuredRates) {
  HardwareProfile hw = preset("cpu-local");
  hw.gemm_rates = {{256, 64, 192, 2, 6e10, 5e10}, {512, 64, 64, 2, 4e10, 3e10}};
  hw.attention_rates = {{128, 16, 2, 2e10, 1.5e10}};
  Checked n;
  for (const char* name : {"llama-tiny", "moe-tiny", "tiny"})
    for (model::Recompute r : {model::Recompute::none, model::Recompute::selective, model::Recompute::full,
                               model::Recompute::selective_op})
      for (int blocks : {-1, 1})  // every block, or one of the two
        for (Strategy s : {Strategy::ddp, Strategy::fsdp})
          for (bool each : s == Strategy::fsdp ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
          if (r == model::Recompute::none && blocks >= 0) continue;
          if (r == model::Recompute::selective_op && std::string(name) != "llama-tiny") continue;
          const model::ModelDesc desc = model::describe(model::model_preset(name, 128));
          PlanConfig c = for_hardware(PlanConfig{}, hw);
          c.world = 2, c.strategy = s, c.seq = 128, c.batch = 2, c.grad_accum = 6, c.recompute = r;
          c.recompute_blocks = blocks;
          c.reduce_each_micro_step = each;
          check(name, desc, c, hw, 2, n);
        }
  EXPECT_EQ(n.plans, 51);
}

// Off memory (the disk tier, a budget, the pipelined optimizer) the bounds claim nothing.
TEST(Bounds, OffTheInMemoryPlanTheyAreZero) {
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 128));
  const HardwareProfile hw = preset("cpu-local");
  PlanConfig c;
  c.seq = 128;
  c.pipeline_optimizer = true;
  const StepBounds b = step_bounds(desc, bounds_frame(desc, plan::plan_frame(desc, c), hw), c, hw, 1);
  EXPECT_EQ(b.step_ms(), 0);
  EXPECT_EQ(b.peak_bytes, 0);
}

}  // namespace
}  // namespace shardlm::sim
