// The exchange stream's handler: a staged unit's routed rows between ranks, or a ring step.
#include "run/executor.h"

#include <stdexcept>
#include <vector>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::Task;

// A staged unit's routed rows to the ranks of the task's axes. The send buffer's header says how
// many bytes go to each rank; one all_to_all of the headers tells every rank what comes from each,
// then the payloads move, packed rank after rank behind the receive buffer's header, which records
// what came from each. What left this rank for the others is the task's figure in the trace.
void Executor::exchange(const Task& t, Run& r) {
  comm::Communicator& c = comms_.exchange(t.axes);
  const int P = c.size();
  const std::string lbl = label(t, r.step);
  if (t.ring_step != 0) return ring_step(t, r, c, lbl);
  const char* send = r.data(t.io.send);
  char* recv = r.data(t.io.recv);
  std::vector<int64_t> out(P), in(P);
  backend_.download(out.data(), send, sizeof(int64_t) * P);
  comms_.exchange_host(t.axes).all_to_all(out.data(), in.data(), sizeof(int64_t), DType::int8, lbl + " (sizes)")
      ->wait(timeout_);
  const int64_t header = model::exchange_header_bytes(P);
  std::vector<int64_t> out_at(P), in_at(P);
  int64_t sent = header, received = header, moved = 0;
  for (int j = 0; j < P; ++j) {
    out_at[j] = sent, in_at[j] = received;
    sent += out[j], received += in[j];
    if (j != c.rank()) moved += out[j];
  }
  if (sent > r.plan.buffers[t.io.send].bytes || received > r.plan.buffers[t.io.recv].bytes)
    throw std::logic_error("executor: " + lbl + " moves more than its buffers' planned bound");
  backend_.upload(recv, in.data(), sizeof(int64_t) * P);
  c.all_to_all_v(send, out, out_at, recv, in, in_at, DType::int8, lbl)->wait(timeout_);
  r.moved[t.id] = moved;
}

// A ring step: the whole send buffer to the rank `ring_step` further round the task's axes, the
// same size from the rank as far back. The tag keeps a pass's steps apart.
void Executor::ring_step(const Task& t, Run& r, comm::Communicator& c, const std::string& lbl) {
  const int P = c.size(), me = c.rank();
  const int64_t bytes = r.plan.buffers[t.io.send].bytes;
  if (r.plan.buffers[t.io.recv].bytes != bytes) throw std::logic_error("executor: " + lbl + " has unequal ring buffers");
  const int tag = 2 * t.stage + (t.reverse ? 1 : 0);
  auto got = c.recv(r.data(t.io.recv), bytes, DType::int8, (me - t.ring_step + P) % P, tag, lbl + " (recv)");
  auto sent = c.send(r.data(t.io.send), bytes, DType::int8, (me + t.ring_step + P) % P, tag, lbl + " (send)");
  got->wait(timeout_);
  sent->wait(timeout_);
  r.moved[t.id] = bytes;
}

}  // namespace shardlm::run
