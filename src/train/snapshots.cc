#include "train/snapshots.h"

#include <stdexcept>

#include <fmt/format.h>

#include "ckpt/hf_config.h"
#include "ckpt/sharded.h"
#include "train/trainer.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

// The plan run `cfg` executes on `world_size` ranks, for the state layout it holds.
plan::Plan run_plan(const TrainConfig& cfg, int world_size, model::ModelDesc& desc) {
  desc = model::describe(cfg.model_config(read_data_meta(cfg.data).vocab_size));
  return plan::build_plan(desc, plan_config(cfg, world_size));
}

}  // namespace

ckpt::SnapshotMesh snapshot_mesh(const plan::Plan& plan) {
  ckpt::SnapshotMesh mesh;
  for (const auto& axis : plan.mesh.axes()) mesh.axes.push_back(axis.name());
  for (int r = 0; r < plan.config.world; ++r) mesh.of_rank.push_back(plan.mesh.coords(r));
  return mesh;
}

std::unique_ptr<ckpt::SnapshotStore> make_snapshot_store(const TrainConfig& cfg, comm::Communicator& world,
                                                         MemoryPool& memory, std::chrono::milliseconds timeout) {
  model::ModelDesc desc;
  const plan::Plan plan = run_plan(cfg, world.size(), desc);
  return std::make_unique<ckpt::SnapshotStore>(cfg.out, world, memory,
                                               ckpt::SnapshotScheme{world.size(), cfg.snapshot_parity, cfg.machines.block},
                                               snapshot_mesh(plan), timeout);
}

plan::Plan with_snapshot_memory(plan::Plan plan, const TrainConfig& cfg) {
  if (cfg.snapshot_every <= 0) return plan;
  for (plan::State k : {plan::State::params, plan::State::grads, plan::State::optimizer})
    if (plan.any_on_disk(k))  // only a budget gets here: config validation refuses --offload with snapshots
      throw std::invalid_argument("--memory-budget " + cfg.memory_budget +
                                  " with --snapshot-every: the budget puts state on disk, and in-memory snapshots of "
                                  "offloaded state are not supported yet");
  const ckpt::SnapshotScheme scheme{plan.config.world, cfg.snapshot_parity, cfg.machines.block};
  plan.static_memory.snapshot =
      ckpt::snapshot_bytes_most(scheme, plan.static_memory.params + plan.static_memory.optimizer);
  // The placement pass measured the plan without snapshots (it leaves their memory to train/).
  if (plan.config.memory_budget > 0 && plan.peak_memory().total > plan.config.memory_budget)
    throw std::invalid_argument("--memory-budget " + cfg.memory_budget + " with --snapshot-every: the snapshots' " +
                                std::to_string(plan.static_memory.snapshot) + " bytes take the peak to " +
                                std::to_string(plan.peak_memory().total) + " bytes, over the budget");
  return plan;
}

ckpt::ShardedLayout snapshot_taken_layout(const TrainConfig& cfg, int world) {
  model::ModelDesc desc;
  const plan::Plan plan = run_plan(cfg, world, desc);
  return sharded_layout(plan, world);
}

std::vector<ckpt::StatePart> snapshot_parts(run::Executor& ex, const plan::Plan& plan) {
  using St = plan::State;
  const int64_t opt = plan.static_memory.optimizer / 2;
  return {{ex.local_state(St::params), plan.static_memory.params},
          {ex.local_state(St::exp_avg), opt},
          {ex.local_state(St::exp_avg_sq), opt}};
}

json snapshot_layout(const plan::Plan& plan, const model::ModelDesc& desc) {
  json parts = json::array();  // per unit: its parameters' and optimizer moments' parts
  for (const plan::UnitPlacement& u : plan.placement()) parts.push_back({u.params.parts, u.optimizer.parts});
  return {{"world", plan.config.world},
          {"strategy", plan::to_string(plan.config.strategy)},
          {"shard_size", plan.shard_size},
          {"parts", parts},
          {"flat_elements", plan.layout.total},
          {"model", ckpt::to_hf_config(desc.config)}};
}

RunState snapshot_state(const json& meta) {
  RunState s;
  s.step = meta.at("step").get<int64_t>();
  s.adam_step = meta.at("optimizer").at("adamw_step").get<int64_t>();
  s.seed = meta.at("rng").at("seed").get<uint64_t>();
  s.tokenizer = meta.at("tokenizer").get<std::string>();
  s.run = meta.at("run");
  return s;
}

ckpt::SnapshotChoice resume_auto(TrainConfig& cfg, comm::Communicator& world, ckpt::SnapshotStore& store,
                                 const std::string& run_id) {
  // The layout this run will hold, to know a snapshot's bytes fit it.
  model::ModelDesc desc;
  const plan::Plan plan = run_plan(cfg, world.size(), desc);
  ckpt::SnapshotChoice c = store.find_newest(plan.static_memory.params + plan.static_memory.optimizer, run_id);
  if (c.step >= 0 && c.meta.value("layout", json()) != snapshot_layout(plan, desc)) {
    c.why = fmt::format("the snapshot of step {} holds another model or split of the state", c.step);
    c.step = -1;
  }
  if (c.step < 0) {
    // A world of another size (a lost machine's survivors): the snapshots it took, resharded.
    ckpt::SnapshotChoice other = store.find_resharded(run_id);
    if (other.step >= 0) {
      model::ModelDesc taken_desc;
      const plan::Plan taken = run_plan(cfg, other.world, taken_desc);
      if (other.meta.value("layout", json()) == snapshot_layout(taken, taken_desc)) c = other;
      else
        c.why += fmt::format("; the snapshot of step {} on {} ranks holds another model or split of the state than "
                             "this run's settings give on {} ranks",
                             other.step, other.world, other.world);
    } else {
      c.why += "; " + other.why;
    }
  }
  std::string disk, disk_why;
  int64_t disk_step = -1;
  try {
    disk = ckpt::resolve_checkpoint(cfg.out);
    disk_step = read_checkpoint_state(disk).step;
  } catch (const std::exception& e) {
    disk.clear();
    disk_why = e.what();
  }
  std::string took;
  if (c.step >= 0 && c.step >= disk_step) {
    cfg.resume.clear();
    took = fmt::format("the in-memory snapshot of step {} ({})", c.step, c.why);
  } else {
    if (c.step >= 0) c.why = fmt::format("the snapshot of step {} is older than the checkpoint", c.step);
    c.step = -1;
    cfg.resume = disk;
    took = disk.empty() ? fmt::format("nothing: no usable snapshot ({}) and no checkpoint ({}); the run starts from step 0",
                                      c.why, disk_why)
                        : fmt::format("the checkpoint {} ({})", disk, c.why);
  }
  if (world.rank() == 0) {
    fmt::print("--resume auto: took {}\n", took);
    std::fflush(stdout);
  }
  return c;
}

}  // namespace shardlm::train
