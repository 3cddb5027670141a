// Pipeline parallelism's layout of the model (PlanConfig::pp): which stage each unit lives on and
// the schedule a step runs over them. Stages run along the model; with V virtual stages a rank the
// pipe holds pp · V of them (ZB-V two a rank), stage s on the rank the schedule says.
#pragma once

#include <vector>

#include "model/model.h"
#include "plan/plan.h"
#include "plan/schedule.h"

namespace shardlm::plan {

// Each unit's stage of S (the schedule's): the embedding on the first, the head on the last, each block on the stage
// its run of blocks falls in (c.pp_layers, else runs whose compute is as even as contiguous runs
// allow, the embedding's and the head's counted with the stages holding them), a state-only unit
// with the unit borrowing it. All 0 without pp. Throws std::invalid_argument naming --pp or
// --pp-layers for a split the model cannot take.
std::vector<int> stage_of_units(const model::ModelDesc& desc, const PlanConfig& c, int S);

// The step's schedule: without pp the one-stage schedule of the `listed` micro-steps the plan
// lists (Plan::repeat stands for the rest); with it
// c.pp_schedule's over pp ranks (grad_accum micro-batches). A forward-only plan (`train` false)
// runs each stage's forwards in stage order on the rank holding it. Throws std::invalid_argument
// naming --pp-schedule or --pp-virtual (the zero-bubble schedules, whose backwards split, too:
// the layers run a unit's backward whole).
Schedule step_schedule(const PlanConfig& c, bool train, int listed);

}  // namespace shardlm::plan
