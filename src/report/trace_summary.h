// Where a step's time went, from a Chrome trace a run (or the simulator) wrote: the trace has a
// process per rank, a thread per stream and an "X" slice per task with args.step. The summary
// takes one typical step (the median of the steps' durations, the first step left out when there
// are others: it carries start-up costs) and reports per op and per stream time, and per rank how
// much of the communication ran hidden under compute.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardlm::report {

struct RankTime {
  int rank = 0;
  double step_us = 0;     // first slice start to last slice end of the typical step
  double compute_us = 0;  // time the compute stream was busy
  double comm_us = 0;     // time any communication stream was busy
  double hidden_us = 0;   // communication time during which compute was busy too
  std::map<std::string, double> stream_us;  // busy time per stream
};

struct TraceSummary {
  std::string path;
  bool ok = false;         // false: nothing could be read; `problems` says why
  int64_t step = -1;       // the typical step
  int64_t steps = 0;       // steps the trace holds
  std::vector<std::pair<std::string, double>> ops;  // op -> mean over ranks of its time in the step, longest first
  std::vector<RankTime> ranks;
  int slowest = -1;        // index into ranks
  std::vector<std::string> problems;
};

// Never throws for a bad file: a missing, cut or foreign trace, or one that is not a regular file
// (a FIFO: never read), is a summary with ok = false.
TraceSummary summarize_trace(const std::string& path);
// The same over a trace's text (tests and the path version).
TraceSummary summarize_trace_text(const std::string& text, const std::string& name);

// Streams that carry communication (all but compute and the host copies).
bool is_comm_stream(const std::string& stream);

}  // namespace shardlm::report
