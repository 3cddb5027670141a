#include "train/run_state_io.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <functional>
#include <stdexcept>
#include <unistd.h>

#include "ckpt/hf_config.h"
#include "ckpt/sharded.h"
#include "train/agreement.h"
#include "train/snapshots.h"

namespace shardlm::train {

using nlohmann::json;

namespace {

// Runs fn on every rank and tells every rank whether any threw: each failing rank reports its
// own line, and every rank throws AgreedFailure, so none waits for another that gave up.
void every_rank_or_all_fail(Session& s, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "failed";
  }
  const int64_t mine = error.empty() ? 0 : 1;
  std::vector<int64_t> all(s.N);
  s.world.all_gather(&mine, all.data(), 2, DType::fp32, "checkpoint agreement")->wait(s.timeout);
  if (std::find(all.begin(), all.end(), 1) != all.end()) throw AgreedFailure(error, !error.empty());
}

ckpt::RankBuffers rank_buffers(Session& s) {
  using St = plan::State;
  return {s.ex.local_state(St::params), s.ex.local_state(St::exp_avg), s.ex.local_state(St::exp_avg_sq)};
}

// Each rank verifies every N-th file of the sharded checkpoint `dir` (size, checksum, header
// against the index) and reads only its own element ranges into the buffers `bufs` names.
void load_sharded(Session& s, const std::string& dir, const ckpt::RankBuffers& bufs, bool optimizer) {
  every_rank_or_all_fail(s, [&] {
    const json index = ckpt::read_index(dir);
    ckpt::verify_checkpoint(dir, index, s.desc, optimizer, s.rank, s.N);
    ckpt::load_rank(dir, index, s.desc, sharded_layout(s.plan, s.N), s.rank, bufs);
  });
}

// What index.json records besides the tensors: state.json's fields, the model and the plan.
json index_meta(Session& s) {
  json config = ckpt::to_hf_config(s.desc.config);
  config["shardlm_tokenizer"] = s.state.tokenizer;
  return {{"format", ckpt::kIndexFormat},
          {"step", s.state.step},
          {"optimizer", {{"adamw_step", s.state.adam_step}}},
          {"tokenizer", s.state.tokenizer},
          // Batches are a pure function of (seed, step), so the step is the data position.
          {"data", {{"sampler", "hash(seed, step, micro_step, sequence)"}, {"next_step", s.state.step}}},
          {"rng", {{"seed", s.state.seed}}},
          {"run", s.state.run},
          {"schedule",
           {{"lr", s.cfg.lr}, {"min_lr", s.cfg.min_lr}, {"warmup_steps", s.cfg.warmup}, {"total_steps", s.cfg.steps}}},
          {"strategy", plan::to_string(s.plan.config.strategy)},
          {"config", config}};
}

// Whether the test fault `f` strikes this rank in the save of checkpoint `step`.
bool fault_at(const run::FaultPoint& f, const Session& s, int64_t step) {
  return step >= 0 && f.step_of(s.rank) == step;
}

// The faults of TrainHooks in the write of the rank file (on the writing thread under
// --async-save): kill_mid_write and fail_write, once half the file's bytes are written.
ckpt::SafetensorsWriter::Progress write_faults(const Session& s, int64_t step) {
  const bool kill = fault_at(s.hooks.kill_mid_write, s, step), fail = fault_at(s.hooks.fail_write, s, step);
  if (!kill && !fail) return {};
  return [kill](const void*, size_t, uint64_t written, uint64_t total) {
    if (2 * written < total) return;
    if (kill) std::raise(SIGKILL);
    throw std::runtime_error("checkpoint: write failed: injected");
  };
}

std::string pending_tmp(const Session& s) {
  return checkpoint_dir(s.cfg.out, s.pending->step) + ".tmp-" + std::to_string(s.lead_pid);
}

// Every rank's file of the pending save is durable (this rank's: `mine`). The all-gather of the
// files' sizes and checksums is the barrier after which all are; then rank 0 writes index.json,
// moves the directory into place and only then points ckpt/latest at it.
// TrainHooks::kill_in_save (test-only) kills that rank by SIGKILL before the barrier.
void commit_save(Session& s, const ckpt::FileSummary& mine) {
  if (fault_at(s.hooks.kill_in_save, s, s.pending->step)) std::raise(SIGKILL);
  std::vector<ckpt::FileSummary> files(s.N);
  static_assert(sizeof(ckpt::FileSummary) == 16);
  s.world.all_gather(&mine, files.data(), 4, DType::fp32, "checkpoint files")->wait(s.timeout);
  const std::string step_dir = checkpoint_dir(s.cfg.out, s.pending->step), tmp = pending_tmp(s);
  const PendingSave p = *std::exchange(s.pending, std::nullopt);
  on_lead_or_all_fail(s.world, s.timeout, [&] {
    const json index = ckpt::make_index(s.desc, sharded_layout(s.plan, s.N), files, p.meta);
    ckpt::commit_step(tmp, step_dir, index, index["config"]);
    ckpt::keep_last(s.cfg.out + "/ckpt", s.cfg.keep_last);
  });
  if (s.talk) {
    uint64_t most = 0, total = 0;
    for (const auto& f : files) most = std::max(most, f.bytes), total += f.bytes;
    fmt::print("checkpoint {}: {:.1f} MB in {} file(s), at most {:.1f} MB per rank, {:.0f} ms{}\n", step_dir, total / 1e6,
               s.N, most / 1e6, ms_since(p.t0),
               s.writer ? fmt::format(" (written in the background: training paused {:.0f} ms to stage it, waited {:.0f} ms "
                                      "for the write)", p.paused_ms, p.waited_ms)
                        : "");
    std::fflush(stdout);
  }
}

// Every rank's host name, by rank (collective): where a snapshot's states were taken.
std::vector<std::string> rank_hosts(Session& s) {
  constexpr int kChars = 64;
  std::vector<char> mine(kChars, 0), all(static_cast<size_t>(kChars) * s.N);
  if (::gethostname(mine.data(), kChars - 1) != 0) mine[0] = '?';
  s.world.all_gather(mine.data(), all.data(), kChars, DType::int8, "host names")->wait(s.timeout);
  std::vector<std::string> hosts;
  for (int r = 0; r < s.N; ++r) hosts.emplace_back(all.data() + static_cast<size_t>(r) * kChars);
  return hosts;
}

// The hosts as runs of consecutive ranks, [[host, first rank, last rank], ...]; empty (not
// known) past kMaxPlacementRuns (the snapshot header's room for the run state is some 15 KB).
json placement(const std::vector<std::string>& hosts) {
  constexpr size_t kMaxPlacementRuns = 64;
  json runs = json::array();
  for (size_t r = 0; r < hosts.size(); ++r) {
    if (!runs.empty() && runs.back()[0] == hosts[r]) runs.back()[2] = r;
    else runs.push_back({hosts[r], r, r});
  }
  return runs.size() <= kMaxPlacementRuns ? runs : json::array();
}

// ", host H (ranks a-b of N) lost" for each host of the snapshot's placement `taken` that holds
// no rank now; "" where the snapshot recorded none.
std::string lost_hosts(const json& taken, int taken_world, const std::vector<std::string>& now) {
  if (!taken.is_array()) return "";
  std::string out;
  for (const json& run : taken) {
    const std::string host = run[0].get<std::string>();
    if (std::find(now.begin(), now.end(), host) != now.end()) continue;
    const int64_t a = run[1].get<int64_t>(), b = run[2].get<int64_t>();
    out += fmt::format(", host {} (rank{} {} of {}) lost", host, a == b ? "" : "s",
                       a == b ? std::to_string(a) : fmt::format("{}-{}", a, b), taken_world);
  }
  return out;
}

}  // namespace

// Loads a checkpoint into the executor's state. Sharded: load_sharded. A whole
// (older) checkpoint is read whole on every rank. That the checkpoint's run is this run,
// start_up() checked.
void resume(Session& s) {
  const std::string& dir = s.cfg.resume;
  s.state = read_checkpoint_state(dir);
  if (ckpt::is_sharded(dir)) {
    const auto t0 = Clock::now();
    load_sharded(s, dir, rank_buffers(s), true);
    s.ex.commit_local_state();  // offloaded state: what was read goes to its files; a device's is uploaded
    if (s.talk) fmt::print("resumed from {} in {:.0f} ms\n", dir, ms_since(t0));
    return;
  }
  Buffer p(s.memory, MemCategory::comm, sizeof(float) * s.plan.layout.total), m(s.memory, MemCategory::comm, p.bytes()),
      v(s.memory, MemCategory::comm, p.bytes());
  load_checkpoint(dir, s.desc, s.plan.layout, p.f32(), m.f32(), v.f32());
  s.ex.load_full(plan::State::params, p.f32());
  s.ex.load_full(plan::State::exp_avg, m.f32());
  s.ex.load_full(plan::State::exp_avg_sq, v.f32());
}

// --init-from: parameters only; the moments stay as the executor allocated them (zero). A sharded
// checkpoint is read as a resume reads it, each rank its own ranges; a Hugging Face directory or
// an llm.c model file is read whole on every rank.
void init_from(Session& s) {
  const std::string& dir = s.cfg.init_from;
  const auto t0 = Clock::now();
  if (ckpt::is_sharded(dir)) {
    load_sharded(s, dir, {s.ex.local_state(plan::State::params), nullptr, nullptr}, false);
    s.ex.commit_local_state();
  } else {
    every_rank_or_all_fail(s, [&] {
      Buffer p(s.memory, MemCategory::comm, sizeof(float) * s.plan.layout.total);
      read_initial_weights(dir, s.desc, s.plan.layout, p.f32());
      s.ex.load_full(plan::State::params, p.f32());
    });
  }
  if (s.talk) fmt::print("parameters from {} in {:.0f} ms\n", dir, ms_since(t0));
}

// Every rank's state from the in-memory snapshot --resume auto chose (its own slot, or rebuilt
// from a partner's copy or its group's parity).
void resume_from_snapshot(Session& s, const ckpt::SnapshotChoice& chosen) {
  const auto t0 = Clock::now();
  if (chosen.world == s.N) {
    s.snapshots->restore(chosen, snapshot_parts(s.ex, s.plan));
    s.ex.commit_local_state();  // a device's state: what was restored into host copies is uploaded
  } else {
    s.snapshots->restore_resharded(chosen, s.desc, snapshot_taken_layout(s.cfg, chosen.world), sharded_layout(s.plan, s.N),
                                   rank_buffers(s));
    s.ex.commit_local_state();
  }
  s.state = snapshot_state(chosen.meta);
  const std::string gone = lost_hosts(chosen.meta.value("placement", json()), chosen.world, rank_hosts(s));
  if (!s.talk) return;
  const std::string lost = s.steps_lost >= 0 ? fmt::format(", {} step(s) lost", s.steps_lost) : "";
  if (chosen.world == s.N)
    fmt::print("resumed from the in-memory snapshot of step {}{}{} in {:.0f} ms\n", s.state.step, gone, lost,
               ms_since(t0));
  else
    fmt::print("resumed from the in-memory snapshot of step {} ({} ranks -> {} ranks, resharded in memory, no checkpoint "
               "read){}{} in {:.0f} ms\n",
               s.state.step, chosen.world, s.N, gone, lost, ms_since(t0));
  std::fflush(stdout);
}

// Every rank's state into shared memory, with its partner copy or parity (collective).
void take_snapshot(Session& s) {
  const auto t0 = Clock::now();
  json meta = index_meta(s);
  meta["layout"] = snapshot_layout(s.plan, s.desc);
  if (s.snapshot_placement.is_null()) s.snapshot_placement = placement(rank_hosts(s));  // once: collective
  meta["placement"] = s.snapshot_placement;
  s.snapshots->save(s.run_id, s.state.step, meta, snapshot_parts(s.ex, s.plan));
  s.ex.release_local_state();  // a device's state was downloaded for the snapshot
  if (s.talk) {
    fmt::print("snapshot of step {}: {:.1f} MB per rank into shared memory, {:.0f} ms\n", s.state.step,
               (s.plan.static_memory.params + s.plan.static_memory.optimizer) / 1e6, ms_since(t0));
    std::fflush(stdout);
  }
}

// --async-save: a pending save commits once every rank's file is written — now, or with `wait`
// after this rank's write has ended. Collective (a save is pending on every rank alike); a failed
// write ends every rank, the failing one reporting its line.
void settle_save(Session& s, bool wait) {
  using W = ckpt::AsyncRankWriter::State;
  if (!s.writer || !s.pending) return;
  const auto t0 = Clock::now();
  if (wait) s.writer->wait();
  s.pending->waited_ms += ms_since(t0);
  const int64_t mine = static_cast<int64_t>(s.writer->state());
  std::vector<int64_t> all(s.N);
  s.world.all_gather(&mine, all.data(), 2, DType::fp32, "checkpoint write state")->wait(s.timeout);
  if (std::count(all.begin(), all.end(), int64_t(W::failed)) > 0) {
    const bool me = mine == int64_t(W::failed);
    throw AgreedFailure(me ? s.writer->take_error() : "another rank's checkpoint write failed", me);
  }
  if (std::count(all.begin(), all.end(), int64_t(W::written)) == s.N) commit_save(s, s.writer->take_result());
}

// Every rank writes its own shard into DIR/ckpt/step_N.tmp-<rank 0's pid> (temporary name,
// fsync, rename) and commit_save() follows; with --async-save a background thread writes a
// staging copy while the steps go on, and settle_save() commits. One save at a time.
void save(Session& s) {
  settle_save(s, true);
  const auto t0 = Clock::now();
  if (s.lead_pid < 0) {
    const int64_t mine = ::getpid();
    std::vector<int64_t> all(s.N);
    s.world.all_gather(&mine, all.data(), 2, DType::fp32, "checkpoint pid")->wait(s.timeout);
    s.lead_pid = all[0];
  }
  s.pending = PendingSave{s.state.step, index_meta(s), Clock::now()};
  ckpt::FileSummary mine;
  every_rank_or_all_fail(s, [&] {
    const std::string tmp = pending_tmp(s);
    std::filesystem::create_directories(tmp);
    // Paced over nine tenths of the steps until the next save: each step shares the least of the
    // write (llama-small, 2 ranks: 1.07x a normal step against 1.14x over half of them), and it
    // still ends before that save would have to wait for it.
    const auto spread = std::chrono::milliseconds(static_cast<int64_t>(0.9 * s.cfg.save_every * s.last_step_ms));
    if (s.writer) s.writer->start(tmp, rank_buffers(s), write_faults(s, s.state.step), spread);
    else mine = ckpt::write_rank_file(tmp, s.desc, sharded_layout(s.plan, s.N), s.rank, rank_buffers(s), write_faults(s, s.state.step));
    s.ex.release_local_state();  // offloaded (or a device's) state was read into host copies for the save
  });
  s.pending->paused_ms = ms_since(t0);
  if (!s.writer) commit_save(s, mine);
}

}  // namespace shardlm::train
