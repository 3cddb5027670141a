// --memory-budget's placement pass (plan/budget.cc): the peak stays within a budget between the
// full-offload peak and the resident one (with gradient accumulation too), a larger budget keeps at
// least as much resident, a budget the resident plan fits changes nothing, every strategy fits one
// under its resident peak, an impossible one is refused with one line giving the smallest peak
// reachable; saved activations go after the gradients and before the parameters, the first
// forward's first; the flag's sizes parse.
#include <gtest/gtest.h>

#include <string>

#include "plan/plan.h"

namespace shardlm::plan {
namespace {

model::ModelDesc small() { return model::describe(model::model_preset("small")); }

PlanConfig one_process() {
  PlanConfig c;
  c.batch = 2;
  c.seq = 64;
  return c;
}

int64_t peak(const Plan& p) { return p.peak_memory().total; }

int64_t resident_state(const Plan& p) { return p.static_memory.params + p.static_memory.grads + p.static_memory.optimizer; }

Plan full_offload(const model::ModelDesc& d, PlanConfig c, bool activations = true) {
  c.offload.kinds = {true, true, true};
  c.offload.activations = activations;
  return build_plan(d, c);
}

// With gradients accumulated over 1, 3 or 6 micro-steps (the last past kUnrolledMicroSteps).
TEST(Budget, PeakStaysWithinABudgetBetweenFullOffloadAndResident) {
  const model::ModelDesc d = small();
  for (int64_t accum : {1, 3, 6}) {
  SCOPED_TRACE("grad-accum " + std::to_string(accum));
  PlanConfig c = one_process();
  c.grad_accum = accum;
  const Plan resident = build_plan(d, c), full = full_offload(d, c);
  ASSERT_LT(peak(full), peak(resident));
  for (double f : {0.2, 0.5, 0.8}) {
    c.memory_budget = peak(full) + static_cast<int64_t>(f * static_cast<double>(peak(resident) - peak(full)));
    const Plan p = build_plan(d, c);
    EXPECT_LE(peak(p), c.memory_budget) << f;
    // Something moved, not everything.
    EXPECT_LT(resident_state(p), resident_state(resident)) << f;
    EXPECT_GT(resident_state(p), 0) << f;
    // The optimizer goes first: no parameters leave while some optimizer state stays.
    bool opt_left = false, params_gone = false;
    for (int u = 0; u < static_cast<int>(d.units.size()); ++u) {
      opt_left = opt_left || (p.placed(State::optimizer, u).parts > 0 && !p.on_disk(State::optimizer, u));
      params_gone = params_gone || p.on_disk(State::params, u);
    }
    EXPECT_FALSE(opt_left && params_gone) << f;
    // The choice is in the config, so a plan built from it (evaluation's) places alike.
    ASSERT_EQ(p.config.offload.units.size(), d.units.size());
    const Plan again = build_plan(d, p.config);
    EXPECT_EQ(peak(again), peak(p));
    std::printf("small B2 T64 grad-accum %lld: resident peak %lld, full offload %lld, budget %lld -> peak %lld (resident state %lld)\n",
                static_cast<long long>(accum), static_cast<long long>(peak(resident)), static_cast<long long>(peak(full)),
                static_cast<long long>(c.memory_budget), static_cast<long long>(peak(p)),
                static_cast<long long>(resident_state(p)));
  }
  }
}

TEST(Budget, ALargerBudgetKeepsAtLeastAsMuchResident) {
  const model::ModelDesc d = small();
  PlanConfig c = one_process();
  const int64_t lo = peak(full_offload(d, c)), hi = peak(build_plan(d, c));
  int64_t last = -1;
  for (int i = 0; i <= 8; ++i) {
    c.memory_budget = lo + (hi - lo) * i / 8;
    const Plan p = build_plan(d, c);
    EXPECT_LE(peak(p), c.memory_budget) << i;
    EXPECT_GE(resident_state(p), last) << "budget " << c.memory_budget;
    last = resident_state(p);
  }
}

TEST(Budget, ABudgetTheResidentPlanFitsChangesNothing) {
  const model::ModelDesc d = small();
  PlanConfig c = one_process();
  const Plan resident = build_plan(d, c);
  c.memory_budget = peak(resident);
  const Plan p = build_plan(d, c);
  EXPECT_EQ(peak(p), peak(resident));
  EXPECT_EQ(p.tasks.size(), resident.tasks.size());
  EXPECT_TRUE(p.windows.empty());
}

// Every strategy places state on disk under a budget below its resident peak (ddp and zero1 reduce
// a unit whose gradients moved as a bucket of its own), and stays within it.
TEST(Budget, EveryStrategyFitsABudgetUnderItsResidentPeak) {
  const model::ModelDesc d = small();
  for (Strategy s : {Strategy::ddp, Strategy::zero1, Strategy::zero2, Strategy::fsdp, Strategy::hybrid}) {
    PlanConfig c = one_process();
    c.world = 4, c.strategy = s, c.shard_group = 2;
    const int64_t resident = peak(build_plan(d, c));
    c.memory_budget = resident * 3 / 4;
    const Plan p = build_plan(d, c);
    EXPECT_LE(peak(p), c.memory_budget) << to_string(s);
    EXPECT_FALSE(p.windows.empty()) << to_string(s);
  }
}

TEST(Budget, AnImpossibleBudgetIsRefusedWithTheSmallestPeakReachable) {
  const model::ModelDesc d = small();
  PlanConfig c = one_process();
  const int64_t lo = peak(full_offload(d, c));
  c.memory_budget = lo - 1;
  try {
    build_plan(d, c);
    FAIL() << "a budget under the full-offload peak";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("--memory-budget " + std::to_string(lo - 1), 0), 0u) << what;
    // The full offload's peak, or a lower one seen on the way (windows cost memory too).
    const size_t at = what.find("smallest peak reachable is ");
    ASSERT_NE(at, std::string::npos) << what;
    const int64_t said = std::stoll(what.substr(at + 27));
    EXPECT_LE(said, lo) << what;
    EXPECT_GT(said, lo - 1) << what;  // over the budget it refused
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  c.memory_budget = lo;  // exactly the smallest peak fits
  EXPECT_LE(peak(build_plan(d, c)), lo);
}

// Where the activations are a large part of the peak (B8 T256), a budget under what every unit's
// state on disk reaches moves saved activations too: a prefix of the blocks in forward order (the
// last ones stay: they are read back at once), and parameters only once every block's that can
// move has moved.
TEST(Budget, SavedActivationsGoAfterGradientsAndBeforeParametersFirstForwardFirst) {
  const model::ModelDesc d = small();
  PlanConfig c = one_process();
  c.batch = 8, c.seq = 256;
  const int64_t state_only = peak(full_offload(d, c, false)), everything = peak(full_offload(d, c));
  ASSERT_LT(everything, state_only);
  const int U = static_cast<int>(d.units.size());
  for (double f : {0.2, 0.6, 0.95, 1.5}) {
    // f > 1: between the state-only full offload and the resident peak.
    c.memory_budget = everything + static_cast<int64_t>(f * static_cast<double>(state_only - everything));
    const Plan p = build_plan(d, c);
    EXPECT_LE(peak(p), c.memory_budget) << f;
    std::string where;
    bool some_disk = false, ram_before_disk = false, params_gone = false, grads_left = false;
    for (int u = 0; u < U; ++u) {
      const std::string w = p.activations_where(u);
      where += w + " ";
      ram_before_disk = ram_before_disk || (w == "disk" && where.find("ram") != std::string::npos);
      some_disk = some_disk || w == "disk";
      params_gone = params_gone || p.on_disk(State::params, u);
      grads_left = grads_left || (p.placed(State::grads, u).parts > 0 && !p.on_disk(State::grads, u));
    }
    EXPECT_FALSE(ram_before_disk) << f << ": " << where;
    if (f < 1) {
      EXPECT_TRUE(some_disk) << f << ": " << where;
      EXPECT_FALSE(grads_left) << f;
    }
    if (params_gone) {  // every block whose activations can move has moved
      const Plan all = full_offload(d, c);
      for (int u = 0; u < U; ++u) EXPECT_EQ(std::string(p.activations_where(u)), all.activations_where(u)) << f << " unit " << u;
    }
    const Plan again = build_plan(d, p.config);  // the choice is in the config
    EXPECT_EQ(peak(again), peak(p)) << f;
    EXPECT_EQ(again.activation_file_bytes, p.activation_file_bytes) << f;
    std::printf("small B8 T256: budget %lld -> peak %lld, activations %s\n", static_cast<long long>(c.memory_budget),
                static_cast<long long>(peak(p)), where.c_str());
  }
  // A forward-only plan keeps no activations for a backward: only state moves.
  PlanConfig loss = c;
  loss.mode = PlanConfig::Mode::loss;
  loss.memory_budget = peak(full_offload(d, loss, false));
  EXPECT_LE(peak(build_plan(d, loss)), loss.memory_budget);
}

TEST(Budget, SizesParseAndBadOnesNameTheFlag) {
  EXPECT_EQ(parse_memory_budget("4096"), 4096);
  EXPECT_EQ(parse_memory_budget("8GB"), 8000000000LL);
  EXPECT_EQ(parse_memory_budget("8gb"), 8000000000LL);
  EXPECT_EQ(parse_memory_budget("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_memory_budget("1.5KiB"), 1536);
  EXPECT_EQ(parse_memory_budget("2TB"), 2000000000000LL);
  EXPECT_EQ(parse_memory_budget("100B"), 100);
  for (const char* bad : {"", "abc", "8XB", "-5", "0", "8 GB", "1.2.3", "GB", "0.1", "8G", "99999999999TB"}) {
    try {
      parse_memory_budget(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--memory-budget: '" + std::string(bad) + "'", 0), 0u) << e.what();
    }
  }
}

// A CUDA backend's kernel scratch (model::KernelScratch) is in its tasks' workspace buffers, so
// in the peak, which a budget then holds with it counted.
TEST(Budget, TheKernelsScratchIsInThePeakABudgetHolds) {
  const model::ModelDesc d = small();
  PlanConfig c = one_process();
  const Plan cpu = build_plan(d, c);
  c.kernel_scratch.cuda = true;
  const Plan cuda = build_plan(d, c);
  const int head = static_cast<int>(d.units.size()) - 1;
  const model::UnitCosts k = d.costs(head, cuda.unit_shape(d, head, 4));
  ASSERT_GT(k.backward_kernel_scratch, 0);
  bool sized = false;
  for (const BufferDesc& b : cuda.buffers)
    if (b.role == Role::backward_ws && b.unit == head)
      sized = b.bytes == k.backward_workspace + k.backward_kernel_scratch && b.kernel_scratch == k.backward_kernel_scratch;
  EXPECT_TRUE(sized);
  // Every workspace says which of its bytes the kernels take (the executor lends exactly those);
  // the training head's forward runs its kernels in its backward's place and takes none.
  for (const BufferDesc& b : cuda.buffers) {
    if (b.role != Role::forward_ws && b.role != Role::backward_ws) continue;
    const model::UnitCosts u = d.costs(b.unit, cuda.unit_shape(d, b.unit, 4));
    const bool backward = b.role == Role::backward_ws;
    const int64_t kernels = backward ? u.backward_kernel_scratch : b.unit == head ? 0 : u.forward_kernel_scratch;
    EXPECT_EQ(b.kernel_scratch, kernels) << b.name;
    EXPECT_EQ(b.bytes, kernels + (backward ? u.backward_workspace : u.forward_workspace)) << b.name;
  }
  for (const BufferDesc& b : cpu.buffers) EXPECT_EQ(b.kernel_scratch, 0) << b.name;
  EXPECT_GT(peak(cuda), peak(cpu));
  EXPECT_LE(peak(cuda), peak(cpu) + k.forward_kernel_scratch + k.backward_kernel_scratch);
  c.memory_budget = peak(cpu);  // the CPU's resident peak: too little for the device's without offload
  const Plan fitted = build_plan(d, c);
  EXPECT_LE(peak(fitted), c.memory_budget);
  EXPECT_LT(resident_state(fitted), resident_state(cpu));
}

}  // namespace
}  // namespace shardlm::plan
