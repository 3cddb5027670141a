#include "plan/draft.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace shardlm::plan {

int PlanDraft::add(Op op, int unit, int micro, std::vector<int> deps) {
  Task t;
  t.op = op, t.unit = unit, t.micro = micro;
  switch (info(op).stream) {
    case OpStream::compute: t.stream = kCompute; break;
    case OpStream::comm: t.stream = kComm; break;
    case OpStream::exchange: t.stream = exchange_stream(); break;
    case OpStream::send: t.stream = named_stream("send"); break;
    case OpStream::recv: t.stream = named_stream("recv"); break;
    case OpStream::copy: throw std::logic_error(std::string("plan: ") + to_string(op) + " is the offload pass's");
  }
  for (int d : deps)
    if (d >= 0) t.deps.push_back(d);
  return append(std::move(t));
}

int PlanDraft::append(Task t) {
  t.id = static_cast<int>(tasks_.size());
  tasks_.push_back(std::move(t));
  return tasks_.back().id;
}

int PlanDraft::exchange_stream() { return named_stream("exchange"); }

int PlanDraft::named_stream(const char* name) {
  auto it = std::find(plan_.streams.begin(), plan_.streams.end(), name);
  if (it == plan_.streams.end()) it = plan_.streams.insert(plan_.streams.end(), name);
  return static_cast<int>(it - plan_.streams.begin());
}

int PlanDraft::buffer(const std::string& name, Role role, MemCategory category, int64_t bytes, int unit, DType dtype) {
  auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;
  BufferDesc b;
  b.id = static_cast<int>(plan_.buffers.size());
  b.name = name, b.role = role, b.category = category, b.dtype = dtype, b.bytes = bytes, b.unit = unit;
  plan_.buffers.push_back(b);
  by_name_[name] = b.id;
  return b.id;
}

std::vector<int> PlanDraft::within_slice(std::vector<int> axes, int u) const {
  const int a = plan_.mesh.find(desc_.units[u].sliced_over);
  axes.erase(std::remove(axes.begin(), axes.end(), a), axes.end());
  return axes;
}

void PlanDraft::stage(int t, int64_t full_elems, int64_t shard_elems, int elem) {
  if (elem == 4) return;
  const int b = buffer("staging " + at(t).name(&desc_), Role::staging, MemCategory::comm,
                       (full_elems + shard_elems) * elem, at(t).unit, DType::bf16);
  scratch(t, b);
  at(t).io.staging = b;
  at(t).copy_bytes = full_elems * 4;
}

void PlanDraft::reduction_scratch(int t, int64_t count) {
  if (!cfg_.reduction_scratch) return;
  const int group = plan_.mesh.group_size(at(t).axes);
  const int64_t bytes = cfg_.reduction_scratch(at(t).op, count, cfg_.reduce_bytes, group);
  if (bytes <= 0) return;
  const int b = buffer("comm scratch " + at(t).name(&desc_), Role::staging, MemCategory::comm, bytes, at(t).unit,
                       float_dtype(cfg_.reduce_bytes));
  scratch(t, b);
  at(t).io.comm_scratch = b;
}

}  // namespace shardlm::plan
