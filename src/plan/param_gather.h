// The parameter gather pass, one of the passes over a built plan (DESIGN: "A schedule, then
// passes"): where a unit's optimizer state is split over axes its parameters are not (ZeRO-1/2),
// it adds after the optimizer one param_gather per such unit over those axes, bringing every rank
// the parts the others updated.
#pragma once

#include "model/model.h"
#include "plan/plan.h"

namespace shardlm::plan {

void param_gather_pass(Plan& plan, const model::ModelDesc& desc);

}  // namespace shardlm::plan
