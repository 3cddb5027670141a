// A schedule as data: for each rank of a pipeline (its position on the pipe), the ordered actions
// it runs in one step, each one micro-batch's forward or backward of one stage. The plan builder
// walks a schedule into compute tasks; without pipeline parallelism it is the one-stage schedule
// (for each micro-batch, its forward, then its backward), today's order.
//
// Stages are numbered along the model, 0 (the embedding's end) to stages - 1 (the head's); a rank
// holds one or more of them (interleaved and V-shaped schedules hold several: "virtual stages").
// A schedule is checked on its own (check_schedule): every action once, no cycle of waits across
// ranks when each runs its actions in order, and activations in flight as the builder stated.
#pragma once

#include <string>
#include <vector>

namespace shardlm::plan {

// A zero-bubble schedule splits a backward in two: the gradient of the stage's input (which the
// stage before waits for) and of its weights (which nothing across ranks waits for).
enum class Phase { forward, backward, backward_input, backward_weight };
const char* to_string(Phase p);  // "forward", "backward", "backward-input", "backward-weight"

// Which backward phases a schedule's actions hold: none (a forward-only step: evaluation,
// generation), whole backwards, or each split into backward_input and backward_weight.
enum class Backward { none, whole, split };

struct Action {
  int micro = 0;  // micro-batch
  int stage = 0;
  Phase phase = Phase::forward;
  bool operator==(const Action&) const = default;
};

struct Schedule {
  std::string name;  // "one-stage", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"
  int ranks = 1, stages = 1, micro_batches = 1;
  Backward backward = Backward::whole;
  std::vector<int> rank_of_stage;             // by stage
  std::vector<std::vector<Action>> actions;   // by rank, in the order the rank runs them
  // By rank: the most micro-batch stages whose forward has run and whose backward has not
  // finished (the weight gradient, where split) the builder promises; each holds one stage's
  // saved activations.
  std::vector<int> stated_in_flight;
  bool operator==(const Schedule&) const = default;
};

// For each micro-batch its forward, then its backward (none: forwards only): one rank, one stage.
Schedule one_stage(int micro_batches, Backward backward = Backward::whole);
// GPipe: every micro-batch's forward, then every backward; M micro-batches in flight.
Schedule gpipe(int ranks, int micro_batches);
// 1F1B (PipeDream-Flush): rank r runs min(P - 1 - r, M) forwards, then alternates one forward
// and one backward, then the backwards left; at most min(P - r, M) in flight.
Schedule one_f_one_b(int ranks, int micro_batches);
// Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + P, ..., r + (V - 1)·P, runs
// micro-batches in groups of P through each of its stages in turn, and warms up with
// 2·(P - 1 - r) + (V - 1)·P forwards. M must be a multiple of P (else std::invalid_argument, one
// line naming --grad-accum).
Schedule interleaved_one_f_one_b(int ranks, int virtual_stages, int micro_batches);
// ZB-H1 (Zero Bubble, Qi et al. 2024): 1F1B with each backward split, rank r deferring its first r
// weight gradients, so every rank holds at most min(P, M) micro-batches (1F1B's first rank's
// figure) and the input gradients run up the pipe unblocked by weight gradients.
Schedule zb_h1(int ranks, int micro_batches);
// ZB-V (Zero Bubble, Qi et al. 2024; "Pipeline Parallelism with Controllable Memory"): 2P stages
// of half a 1F1B stage each, rank r holding stage r (chunk 0) and stage 2P - 1 - r (chunk 1), so
// a micro-batch runs down the ranks and back up. The first and the last stage share rank 0, whose
// backward starts where its last forward ended (no hop back with the loss), the turn (stages
// P - 1 and P) stays on rank P - 1, and every rank holds one early and one late stage, so no rank
// waits longer than another between a forward and its backward: their memory is even, where
// 1F1B's first rank holds P stages and its last one. Rank r's order follows when the work reaches
// it, in unit slots: micro-batch 0's chunk-1 forward arrives 2·(P - r) - 1 slots after its
// chunk-0 one, so rank r warms up with that many chunk-0 forwards; its first input gradient
// comes back 2·r + 1 slots later, which r chunk-1 and chunk-0 forward pairs fill; then chunk 1's
// forward, input and weight gradient P - r times while the first chunk-0 backwards travel back,
// and from there each chunk's forward, input and weight gradient in turn. At the end the input
// gradients (which the ranks before wait for) go first and the weight gradients, which nothing
// waits for, fill the slots the pipe's drain leaves idle. Every rank holds at most 2P stages
// (1F1B's first rank's P full ones): min(M, 2P - 1 - r) chunk-0 and min(M, r + 1) chunk-1 stages
// at its first input gradient, never more after, since each later forward follows a weight
// gradient. With M >= 2P - 1 a step takes 6M + P - 1 slots: a rank idles only before the work
// reaches it and after it leaves. Fewer micro-batches run the order of 2P - 1 with those past M
// left out: dropping every action of some micro-batches from a schedule that cannot deadlock
// leaves one that cannot either (the same global order still runs them).
Schedule zbv(int ranks, int micro_batches);

// The schedule --pp-schedule names ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv") over
// `ranks` ranks with `virtual_stages` stages a rank (--pp-virtual: above 1 only for
// interleaved-1f1b; zbv holds its two whatever it is told, 1 or 2) and `micro_batches`
// micro-batches. Throws std::invalid_argument, one line naming --pp-schedule or --pp-virtual.
Schedule schedule_by_name(const std::string& name, int ranks, int virtual_stages, int micro_batches);

// What check_schedule found: `error` empty when the schedule is sound, else the first problem;
// per rank, the most micro-batch stages in flight at once, and each action's time slot when every
// action takes one slot and starts as soon as its rank and its dependencies allow (by rank, in
// action order; the grid printer draws them). On an error the figures are partial.
struct ScheduleCheck {
  std::string error;
  std::vector<int> peak_in_flight;
  std::vector<std::vector<int>> slot;
  int slots = 0;  // the step's length in slots
  bool ok() const { return error.empty(); }
};
// Checks that every (micro-batch, stage, phase) the schedule's `backward` calls for is listed once,
// on the rank holding its stage; that running each rank's actions in order, an action starting
// once its dependencies finished (the forward of the stage before; the backward of the stage
// after and this stage's forward; the weight gradient after the input gradient), finishes every
// action (no deadlock); and that no rank exceeds its stated activations in flight.
ScheduleCheck check_schedule(const Schedule& s);

// The schedule as a grid: a row per rank, a column per time slot (check_schedule's), "F3" / "B3" /
// "W3" for micro-batch 3's forward / backward (or input gradient) / weight gradient, "." idle; with
// several stages a rank, the stage follows the micro-batch ("F3.5"). An unsound schedule's grid
// lists the problem instead.
std::string schedule_grid(const Schedule& s);

}  // namespace shardlm::plan
