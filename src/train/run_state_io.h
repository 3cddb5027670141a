// The trainer's state in and out of a run (internal to train/): the starting state (a resumed
// checkpoint, --init-from weights, or an in-memory snapshot) and, while it runs, checkpoints
// (synchronous or --async-save) and snapshots. Which step saves is the trainer's call; the file
// formats are ckpt/'s. Every function is collective: every rank of the session calls it alike,
// and a failure on any rank ends every rank (AgreedFailure) rather than leaving one waiting.
#pragma once

#include "ckpt/snapshot.h"
#include "train/session.h"

namespace shardlm::train {

// s.cfg.resume into the executor's state and s.state: a sharded checkpoint each rank reading its
// own ranges (after checking its share of the files), an older whole one read whole.
void resume(Session& s);
// s.cfg.init_from's parameters (a sharded checkpoint or a Hugging Face directory); the AdamW
// moments stay zero.
void init_from(Session& s);
// The in-memory snapshot --resume auto chose, into the executor's state and s.state.
void resume_from_snapshot(Session& s, const ckpt::SnapshotChoice& chosen);

// A checkpoint of s.state.step into DIR/ckpt/step_N, committed (index.json, then ckpt/latest)
// once every rank's file is durable: now, or under --async-save by a later settle_save(). Waits
// for the previous save first: one save at a time.
void save(Session& s);
// --async-save: commits the pending save if every rank's write has ended (with `wait`: after
// this rank's has). Does nothing without one.
void settle_save(Session& s, bool wait);
// Every rank's state into shared memory, with its partner copy or parity.
void take_snapshot(Session& s);

}  // namespace shardlm::train
