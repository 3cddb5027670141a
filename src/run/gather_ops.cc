// Gather handlers: a unit's (or a bucket's) parameter shards into gathered parameters, in the
// wire dtype, and ZeRO-1/2's gather of the updated parameter parts.
#include "run/executor.h"

#include <vector>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::State;
using plan::Task;

void Executor::all_gather(const Task& t, Run& r) {
  if (t.first_unit >= 0) return gather_bucket(t, r);
  if (t.io.restore_from >= 0) return gather_rest(t, r);
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  const Shard s = shard_of(State::params, t.unit);
  float* full = r.f32(t.io.params);
  float* mine = held(State::params, t.unit, &r);
  if (t.io.staging < 0) {
    c.all_gather(mine, full, s.len, DType::fp32, lbl)->wait(timeout_);
  } else {  // bf16: [what the group gathers | one shard] staging, cast, gather, widen.
    uint16_t* whole = r.live[t.io.staging].as<uint16_t>();
    uint16_t* own = whole + s.len * c.size();
    backend_.fp32_to_bf16(own, mine, s.len);
    c.all_gather(own, whole, s.len, DType::bf16, lbl)->wait(timeout_);
    backend_.bf16_to_fp32(full, whole, s.len * c.size());
  }
  if (t.io.keep_into >= 0) keep_part(t, r);
}

// Copies a partly kept unit's kept part (the first kept_elems of each rank's shard) out of its
// gathered buffer, in the wire dtype: the values are the gather's, bf16 ones narrowed exactly.
void Executor::keep_part(const Task& t, Run& r) {
  const Shard s = shard_of(State::params, t.unit);
  const int64_t len = s.len, kept = r.plan.kept_elems[t.unit];
  const float* full = r.f32(t.io.params);
  char* part = r.data(t.io.keep_into);
  const int elem = r.plan.config.param_bytes;
  for (int q = 0; q < comms_.get(t.axes).size(); ++q) to_wire(part + q * kept * elem, full + q * len, kept, elem);
}

// A partly kept unit's backward gather: the rest of each rank's shard (after its kept part),
// gathered in place rank after rank into staging, then each rank's kept part and rest copied
// (widened) into the gathered buffer: the whole gather's values, bit for bit.
void Executor::gather_rest(const Task& t, Run& r) {
  const Shard s = shard_of(State::params, t.unit);
  const int64_t len = s.len, kept = r.plan.kept_elems[t.unit], rest = len - kept;
  const int elem = r.plan.config.param_bytes;
  comm::Communicator& c = comms_.get(t.axes);
  char* whole = r.data(t.io.staging);
  char* own = whole + c.rank() * rest * elem;
  to_wire(own, held(State::params, t.unit, &r) + kept, rest, elem);
  c.all_gather(own, whole, rest, float_dtype(elem), label(t, r.step))->wait(timeout_);
  float* full = r.f32(t.io.params);
  const char* part = r.data(t.io.restore_from);
  for (int q = 0; q < c.size(); ++q) {
    from_wire(full + q * len, part + q * kept * elem, kept, elem);
    from_wire(full + q * len + kept, whole + q * rest * elem, rest, elem);
  }
}

// A floating array into a collective's wire dtype (`elem` bytes: bf16 narrowed, fp32 copied),
// and back.
void Executor::to_wire(void* dst, const float* src, int64_t n, int elem) const {
  if (elem == 2) backend_.fp32_to_bf16(static_cast<uint16_t*>(dst), src, n);
  else backend_.copy(dst, src, 4 * n);
}

void Executor::from_wire(float* dst, const void* src, int64_t n, int elem) const {
  if (elem == 2) backend_.bf16_to_fp32(dst, static_cast<const uint16_t*>(src), n);
  else backend_.copy(dst, src, 4 * n);
}

// A bucket of units, one collective: this rank's shards of the units, back to back (cast to
// bf16 as each unit's own gather would) in its own slot of the staging buffer, gathered in
// place rank after rank, then
// each rank's part of each unit copied (widened) into the unit's gathered buffer. The values are
// those of one gather per unit, bit for bit.
void Executor::gather_bucket(const Task& t, Run& r) {
  const int step = t.last_unit >= t.first_unit ? 1 : -1;
  std::vector<int> units;
  int64_t shards = 0;
  for (int u = t.first_unit;; u += step) {
    units.push_back(u);
    shards += shard_of(State::params, u).len;
    if (u == t.last_unit) break;
  }
  // A bucket's units are placed alike: one group, one slot per rank.
  comm::Communicator& c = comms_.get(t.axes);
  const int elem = r.plan.config.param_bytes;
  char* whole = r.data(t.io.staging);
  char* own = whole + c.rank() * shards * elem;  // in place: this rank's slot of the gathered
  int64_t at = 0;
  for (int u : units) {
    const Shard s = shard_of(State::params, u);
    to_wire(own + at * elem, held(State::params, u, &r), s.len, elem);
    at += s.len;
  }
  c.all_gather(own, whole, shards, float_dtype(elem), label(t, r.step))->wait(timeout_);
  for (int q = 0; q < c.size(); ++q) {
    at = q * shards;
    for (size_t i = 0; i < units.size(); ++i) {
      const int64_t len = shard_of(State::params, units[i]).len;
      from_wire(r.f32(t.io.bucket[i]) + q * len, whole + at * elem, len, elem);
      at += len;
    }
  }
}

// In place on this rank's parameters of the unit: the group's optimizer ranges tile them.
void Executor::param_gather(const Task& t, Run& r) {
  const Shard s = shard_of(State::optimizer, t.unit);
  float* whole = held(State::params, t.unit, &r);
  comms_.get(t.axes).all_gather(whole + (s.begin - shard_of(State::params, t.unit).begin), whole, s.len,
                                DType::fp32, label(t, r.step))->wait(timeout_);
}

}  // namespace shardlm::run
