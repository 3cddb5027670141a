// A step whose middle micro-step repeats (Plan::repeat) runs on the executor bit for bit as the
// plan that lists every micro-step: same batches in the same order, same loss, same update.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "comm/single_rank.h"
#include "kernels/cpu.h"
#include "run/executor.h"

namespace shardlm::run {
namespace {

struct Outcome {
  double loss = 0;
  std::vector<float> params;
  std::vector<int64_t> micro_steps;  // in the order the batches were asked for
};

Outcome one_step(const model::ModelDesc& desc, plan::PlanConfig pc) {
  const plan::Plan plan = plan::build_plan(desc, pc);
  MemoryPool memory;
  comm::SingleRankCommunicator world(memory);
  CommGroups comms(world, plan);
  const auto backend = kernels::make_cpu_backend(memory);
  Executor ex(desc, plan, comms, 1, std::chrono::seconds(60), *backend);
  ex.init_params(7);
  Outcome out;
  StepInputs in;
  in.batch = [&](int64_t micro, int32_t* inputs, int32_t* targets) {
    out.micro_steps.push_back(micro);
    for (int64_t i = 0; i < pc.batch * pc.seq; ++i) {
      inputs[i] = static_cast<int32_t>((micro * 31 + i * 7) % desc.config.vocab_size);
      targets[i] = static_cast<int32_t>((micro * 17 + i * 5 + 3) % desc.config.vocab_size);
    }
  };
  in.grad_scale = 1.0f / static_cast<float>(pc.batch * pc.seq * pc.grad_accum);
  in.opt.lr = 1e-2f;
  out.loss = ex.step(0, in).loss_sum;
  const float* p = ex.whole(plan::State::params);
  out.params.assign(p, p + plan.layout.total);
  return out;
}

TEST(MicroStepRepeat, RunsBitwiseAsTheUnrolledStep) {
  kernels::init_compute(1);
  const model::ModelDesc desc = model::describe(model::model_preset("llama-tiny", 64));
  for (model::Recompute r : {model::Recompute::none, model::Recompute::full}) {
    plan::PlanConfig pc;
    pc.batch = 2, pc.seq = 16, pc.grad_accum = 7, pc.recompute = r;
    const Outcome repeated = one_step(desc, pc);
    pc.unroll_micro_steps = true;
    const Outcome whole = one_step(desc, pc);
    EXPECT_EQ(repeated.micro_steps, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
    EXPECT_EQ(repeated.micro_steps, whole.micro_steps);
    EXPECT_EQ(repeated.loss, whole.loss);
    ASSERT_EQ(repeated.params.size(), whole.params.size());
    EXPECT_EQ(std::memcmp(repeated.params.data(), whole.params.data(), 4 * whole.params.size()), 0);
  }
}

}  // namespace
}  // namespace shardlm::run
