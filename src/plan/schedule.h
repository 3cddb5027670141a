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
// 2·(P - 1 - r) + (V - 1)·P forwards. M must be a multiple of P. Throws std::invalid_argument.
Schedule interleaved_one_f_one_b(int ranks, int virtual_stages, int micro_batches);
// ZB-H1 (Zero Bubble, Qi et al. 2024): 1F1B with each backward split, rank r deferring its first r
// weight gradients, so every rank holds at most min(P, M) micro-batches (1F1B's first rank's
// figure) and the input gradients run up the pipe unblocked by weight gradients.
Schedule zb_h1(int ranks, int micro_batches);

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
