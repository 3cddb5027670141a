// Internal to the trainer: one rank's run as trainer.cc and run_state_io.cc share it (the
// Session), and the clock both time their work with. Not an interface for other parts.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/async_writer.h"
#include "ckpt/snapshot.h"
#include "comm/communicator.h"
#include "data/corpus.h"
#include "data/latents.h"
#include "model/model.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/run_dir.h"
#include "train/trainer.h"

namespace shardlm::train {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A save whose rank files are being written (--async-save) or have just been: what its commit
// needs.
struct PendingSave {
  int64_t step = 0;
  nlohmann::json meta;  // index.json's run state, as it was when the state was copied
  Clock::time_point t0;
  double paused_ms = 0;  // the training thread's time in save() (all of it when synchronous)
  double waited_ms = 0;  // --async-save: the training thread's wait for the write to end
};

// Everything one rank's run holds: data, model, plan, communicators, kernels, executor.
struct Session {
  const TrainConfig& cfg;
  const TrainHooks& hooks;  // the test seams the run was started with
  comm::Communicator& world;
  MemoryPool& memory;  // the run's: every buffer of it is charged here, and metrics read it
  int rank, N;
  bool lead, talk;
  std::chrono::milliseconds timeout;
  DataMeta meta;
  // The splits: token corpora for a language model, latent sets for a diffusion model (the other
  // pair empty).
  std::optional<data::TokenCorpus> train_data, val_data;
  std::optional<data::LatentSet> train_latents, val_latents;
  model::ModelDesc desc;
  RunState state;
  plan::Plan plan;
  std::unique_ptr<kernels::Backend> backend;  // made before the comm groups and executor, gone after them
  run::CommGroups comms;  // staged through host memory when the backend's is a device's
  run::Executor ex;
  CheckedLog metrics;  // rank 0's DIR/metrics.jsonl: a failed write stops the run
  int64_t lead_pid = -1;  // names the temporary directory every rank writes a checkpoint into
  std::string run_id;     // which run this is (DIR/run.json, run_dir.h): recorded in its snapshots
  std::unique_ptr<ckpt::SnapshotStore> snapshots;  // with --snapshot-every or --resume auto
  // Resumed from a snapshot: the steps the run that took it had done past it (rank 0, from the
  // run's metrics.jsonl; -1 unknown).
  int64_t steps_lost = -1;
  // The ranks' hosts a snapshot records ([[host, first rank, last rank], ...]), found at the first.
  nlohmann::json snapshot_placement;
  std::optional<PendingSave> pending;
  double last_step_ms = 0;  // paces --async-save's writer
  // --async-save: the background writer and its staging copy (declared last: it joins its
  // thread before the model it writes goes away).
  std::unique_ptr<ckpt::AsyncRankWriter> writer;

  Session(const TrainConfig& c, comm::Communicator& w, MemoryPool& memory, const model::ModelConfig& mc,
          const DataMeta& m, const TrainHooks& h, const run::OffloadOptions& offload);
};

}  // namespace shardlm::train
