// Goodput under failures: the expected fraction of wall time a run spends on steps that count,
// given how often its nodes fail, what a disk checkpoint and an in-memory snapshot cost, and how
// long a restart takes; and the checkpoint and snapshot intervals that maximise it.
//
// Failures arrive as a Poisson process at rate λ = nodes / MTBF (per node). A fraction q of them
// (`snapshot_survives`: the process dies, the node and its shared memory stay) resume from the
// latest in-memory snapshot; the rest (a node lost) from the latest disk checkpoint. Each level is
// the classic one-level model (Daly 2006, exponential failures): work in segments of τ seconds,
// each followed by a save of C seconds; a failure loses the segment and costs the restart R
// (relaunch + reading the state back) first. The expected wall time of a segment is
//     E = e^{λR}/λ · (e^{λ(τ+C)} − 1),
// so the level keeps τ/E of the time. The two levels' losses are taken as independent (their
// product; exact to first order in λ); snapshots are taken only where that beats the disk
// checkpoint alone (a snapshot costing more than the work it saves is not worth taking). Young's optimum τ* = sqrt(2C/λ) (Daly's first order) is
// the check the exact optimum is compared against; the interval is chosen in whole steps.
#pragma once

#include <cstdint>

namespace shardlm::sim {

struct GoodputInput {
  double step_s = 0;            // one training step, seconds
  int nodes = 1;                // nodes the run spans
  double mtbf_hours = 0;        // mean time between failures of one node
  double checkpoint_s = 0;      // writing a disk checkpoint (the step waits for it)
  double checkpoint_read_s = 0; // reading it back on a restart
  double snapshot_s = 0;        // taking an in-memory snapshot (0: no snapshots)
  double snapshot_survives = 0; // q: fraction of failures a snapshot recovers from
  double restart_s = 0;         // relaunching the job after a failure, before any state is read
};

struct GoodputLevel {
  double rate = 0;         // failures a second this level recovers
  double save_s = 0;       // C
  double restart_s = 0;    // R (relaunch + read)
  int64_t every_steps = 0; // the chosen interval in steps (0: the level is not used)
  double interval_s = 0;   // τ = every_steps × step_s
  double young_s = 0;      // sqrt(2C/λ)
  double kept = 1;         // the fraction of time this level keeps
};

struct Goodput {
  double fraction = 1;  // expected share of wall time on steps that count
  GoodputLevel checkpoint, snapshot;
};

// The kept fraction τ/E of one level at interval τ (seconds), exact for exponential failures.
double level_kept(double rate, double interval_s, double save_s, double restart_s);
// Young's first-order optimum sqrt(2C/λ) (infinite where λ = 0).
double young_interval(double save_s, double rate);
// Whether losing any one node leaves every rank's in-memory snapshot recoverable, with
// ckpt/snapshot.h's placement (SnapshotScheme): rank r's copy held by (r − per_node) mod N where
// per_node divides N (else r − 1), or with parity group G (> 0) the XOR of ranks gG … gG+G−1 held
// by (g+1)·G mod N and rebuilt from the group's other states. Ranks fill nodes in order.
bool snapshot_survives_node_loss(int64_t world, int64_t per_node, int64_t parity_group);

// Best whole-step intervals for both levels and the goodput they give. Throws
// std::invalid_argument (one line naming the figure) for a figure out of range.
Goodput goodput(const GoodputInput& in);

}  // namespace shardlm::sim
