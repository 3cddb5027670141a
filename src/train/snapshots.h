// Train's side of in-memory snapshots (ckpt/snapshot.h holds the store): what a snapshot records
// besides the state, the plan's `snapshot` memory, and `--resume auto`'s choice between the
// newest snapshot and the newest disk checkpoint.
#pragma once

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/snapshot.h"
#include "comm/communicator.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace shardlm::train {

// Every rank's place on `plan`'s mesh, which each snapshot slot records of its state's owner.
ckpt::SnapshotMesh snapshot_mesh(const plan::Plan& plan);
// The store of run `cfg`'s snapshots (collective: every rank makes its own), charged to `memory`.
std::unique_ptr<ckpt::SnapshotStore> make_snapshot_store(const TrainConfig& cfg, comm::Communicator& world,
                                                         MemoryPool& memory, std::chrono::milliseconds timeout);

// `plan` with static_memory.snapshot the shared memory the most loaded rank maps when the run
// takes snapshots (cfg.snapshot_every > 0); unchanged otherwise.
plan::Plan with_snapshot_memory(plan::Plan plan, const TrainConfig& cfg);

// How run `cfg` on `world` ranks lays its state out: a snapshot taken at another world size is
// resharded from it.
ckpt::ShardedLayout snapshot_taken_layout(const TrainConfig& cfg, int world);
// This rank's state as a snapshot holds it: parameters, exp_avg, exp_avg_sq (host memory).
std::vector<ckpt::StatePart> snapshot_parts(run::Executor& ex, const plan::Plan& plan);
// What must equal between the run that took a snapshot and the run restoring it, for the bytes
// of each rank's state to mean the same: model, world, strategy, shard split.
nlohmann::json snapshot_layout(const plan::Plan& plan, const model::ModelDesc& desc);
// The run state a snapshot's meta records (index.json's fields: step, optimizer.adamw_step, rng,
// tokenizer, run).
RunState snapshot_state(const nlohmann::json& meta);

// --resume auto (collective): the newest snapshot of run `run_id` (the one --out holds) every
// rank holds verified (or can rebuild) at this world size and layout (else, where none, the
// newest whose every state the ranks hold at another world size, taken under the layout this
// run's settings give there: resharded on restore), unless --out's latest
// complete disk checkpoint is newer; then that checkpoint; else nothing (the run starts from step
// 0). Sets cfg.resume to the disk checkpoint or "" and returns the snapshot taken (step -1:
// none). Rank 0 prints which it took and why.
ckpt::SnapshotChoice resume_auto(TrainConfig& cfg, comm::Communicator& world, ckpt::SnapshotStore& store,
                                 const std::string& run_id);

}  // namespace shardlm::train
