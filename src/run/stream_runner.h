// The executor's stream runner: each of a plan's streams is an in-order queue on a thread of its
// own (compute on the caller's, whose kernels use the OpenMP pool; the others issue collectives
// and copies and wait for them). A task's run starts once the runs it depends on have finished;
// what reads a copy-stream task's result also waits for the backend's mark of it (the copy lane).
// What a task does is the caller's.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/backend.h"
#include "plan/plan.h"

namespace shardlm::run {

// One run of a task, on its stream's thread: `micro` is the micro-step of the step it belongs to,
// `waited_ms` how long it waited for its dependencies.
using TaskBody = std::function<void(const plan::Task& task, int64_t micro, double waited_ms)>;

// Runs every stream of `plan` to its end. The first exception a task throws stops the other
// streams at their next wait and is rethrown here, after every thread has ended.
void run_streams(const plan::Plan& plan, const kernels::Backend& backend, const TaskBody& body);

}  // namespace shardlm::run
