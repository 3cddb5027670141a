// The disk tier's handlers (--offload): a window is the plan's buffer, the file this rank's.
#include "run/executor.h"

#include <stdexcept>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::State;
using plan::Task;

namespace {
State window_state(const plan::Plan& plan, const Task& t) {
  for (int s = 0; s < plan::kNumStateBuffers; ++s)
    if (plan.window(s, t.unit) == t.io.window) return State(s);
  throw std::logic_error("executor: " + t.name() + " names no window of its unit");
}
}  // namespace

// Saved activations (a buffer with a disk_offset) go to their slot of the activations file.
void Executor::reload(const Task& t, Run& r) {
  const plan::BufferDesc& b = r.plan.buffers[t.io.window];
  if (b.disk_offset >= 0) return store_->tier()->read(activation_file(r), b.disk_offset, r.data(b.id), b.bytes);
  store_->disk_read(window_state(r.plan, t), t.unit, r.data(t.io.window));
}
void Executor::write_back(const Task& t, Run& r) {
  const plan::BufferDesc& b = r.plan.buffers[t.io.window];
  if (b.disk_offset >= 0) return store_->tier()->write(activation_file(r), b.disk_offset, r.data(b.id), b.bytes);
  store_->disk_write(window_state(r.plan, t), t.unit, r.data(t.io.window));
}
int Executor::activation_file(const Run& r) const {
  if (store_->activation_file() < 0 || r.plan.activation_file_bytes > plan_.activation_file_bytes)
    throw std::logic_error("executor: a plan offloads activations past the activations file this executor made");
  return store_->activation_file();
}
// Only its allocations and frees (the plan's): the compute stream's point where windows come and go.
void Executor::window_sync(const Task&, Run&) {}

}  // namespace shardlm::run
