// One process: a plan of a model and its executor over a single-rank communicator, on the CPU
// backend, for tests that run plans of their own (parity with the references, a forward for its
// logits, generate). The compute threads are set to 2 first.
#pragma once

#include <chrono>
#include <memory>

#include "comm/single_rank.h"
#include "kernels/cpu.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "tensor/memory.h"

namespace shardlm::testing {

struct OneProcessEngine {
  bool threads_ready = (kernels::init_compute(2), true);
  model::ModelDesc desc;
  plan::Plan plan;
  MemoryPool memory;
  comm::SingleRankCommunicator world{memory};
  run::CommGroups comms;
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend(memory);
  run::Executor ex;

  OneProcessEngine(const model::ModelConfig& mc, const plan::PlanConfig& pc)
      : desc(model::describe(mc)), plan(plan::build_plan(desc, pc)), comms(world, plan),
        ex(desc, plan, comms, 2, std::chrono::seconds(60), *backend) {}
};

// A plan config of `batch` windows of `seq` tokens on 2 threads.
inline plan::PlanConfig plan_config(int64_t batch, int64_t seq, plan::PlanConfig::Mode mode) {
  plan::PlanConfig pc;
  pc.batch = batch, pc.seq = seq, pc.threads = 2, pc.mode = mode;
  return pc;
}

}  // namespace shardlm::testing
