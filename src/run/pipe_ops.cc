// The send and recv streams' handlers: what pipeline stages pass between them.
#include "run/executor.h"

#include "run/executor_run.h"

namespace shardlm::run {

using plan::Task;

// A pipeline stage's activations (or, with `reverse`, gradients) to the rank holding the
// neighbouring stage, and their receipt there. The tag names the micro-batch, the sending stage
// and the direction, so messages between two ranks never match another's receive.
namespace {
int pipe_tag(const Task& t, int stages, int sending_stage) {
  return (t.micro * stages + sending_stage) * 2 + (t.reverse ? 1 : 0);
}
}  // namespace

void Executor::send(const Task& t, Run& r) {
  const int tag = pipe_tag(t, r.plan.schedule.stages, t.stage);
  comms_.pipe().send(r.data(t.io.send), t.bytes, DType::int8, t.peer, tag, label(t, r.step))->wait(timeout_);
  r.moved[t.id] = t.bytes;
}

void Executor::recv(const Task& t, Run& r) {
  const int tag = pipe_tag(t, r.plan.schedule.stages, t.peer_stage);
  comms_.pipe().recv(r.data(t.io.recv), t.bytes, DType::int8, t.peer, tag, label(t, r.step))->wait(timeout_);
}

}  // namespace shardlm::run
