// Chrome trace event JSON (Perfetto opens it), shared by real and simulated runs: one process
// per rank, one thread per stream, a complete ("X") slice per task and memory per category as
// counter ("C") tracks.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/plan.h"
#include "tensor/memory.h"

namespace shardlm::trace {

struct Slice {
  std::string name;
  int stream;  // index into RankTrace::streams
  int64_t step;
  double start_us, dur_us;
  int64_t moved = -1;  // bytes a collective whose size is known only at run time sent (-1: none such)
};

struct MemorySample {
  double ts_us;
  std::array<int64_t, kNumMemCategories> bytes;
};

// What one rank recorded.
struct RankTrace {
  int rank = 0;
  std::vector<std::string> streams{"compute", "comm"};  // the plan's streams: one thread each
  std::vector<Slice> slices;
  std::vector<MemorySample> memory;
  // This rank's events as a JSON array body (comma-separated objects, no brackets), so that
  // ranks can send their parts as bytes and rank 0 can join them without parsing.
  std::string events_json() const;
};

// Writes {"traceEvents": [...], "displayTimeUnit": "ms"} from the ranks' events_json parts,
// atomically (tmp + rename).
void write_trace(const std::string& path, const std::vector<std::string>& rank_parts);

}  // namespace shardlm::trace
