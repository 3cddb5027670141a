#include "report/trace_summary.h"

#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace shardlm::report {

using nlohmann::json;

namespace {

struct Slice {
  int rank;
  std::string stream, op;
  int64_t step;
  double start, end;
};

using Intervals = std::vector<std::pair<double, double>>;

// Sorted, non-overlapping: busy time is the union, since slices on one stream may nest.
Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& iv : v) {
    if (!out.empty() && iv.first <= out.back().second) out.back().second = std::max(out.back().second, iv.second);
    else out.push_back(iv);
  }
  return out;
}

double length(const Intervals& v) {
  double t = 0;
  for (const auto& iv : v) t += iv.second - iv.first;
  return t;
}

double overlap(const Intervals& a, const Intervals& b) {
  double t = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    t += std::max(0.0, std::min(a[i].second, b[j].second) - std::max(a[i].first, b[j].first));
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return t;
}

// The X slices of the trace; stream names from thread_name metadata (else the slice's cat).
std::vector<Slice> slices_of(const json& events, std::vector<std::string>& problems) {
  std::map<std::pair<int, int>, std::string> names;
  for (const json& e : events)
    if (e.is_object() && e.value("ph", "") == "M" && e.value("name", "") == "thread_name" && e.contains("args"))
      names[{e.value("pid", 0), e.value("tid", 0)}] = e["args"].value("name", "");
  std::vector<Slice> out;
  int64_t bad = 0;
  for (const json& e : events) {
    if (!e.is_object() || e.value("ph", "") != "X") continue;
    if (!e.contains("ts") || !e["ts"].is_number() || !e.contains("dur") || !e["dur"].is_number() || !e.contains("args") ||
        !e["args"].is_object() || !e["args"].contains("step") || !e["args"]["step"].is_number_integer()) {
      ++bad;
      continue;
    }
    if (e["args"]["step"].get<int64_t>() < 0) continue;  // evaluation and sampling: no training step
    const int pid = e.value("pid", 0), tid = e.value("tid", 0);
    const auto it = names.find({pid, tid});
    const std::string stream = it != names.end() ? it->second : e.value("cat", std::to_string(tid));
    const std::string name = e.value("name", "?");
    const double ts = e["ts"].get<double>();
    out.push_back({pid, stream, name.substr(0, name.find(' ')), e["args"]["step"].get<int64_t>(), ts,
                   ts + e["dur"].get<double>()});
  }
  if (bad) problems.push_back(fmt::format("{} slice(s) without ts, dur or args.step; left out", bad));
  return out;
}

// The step whose slowest rank took the median time (the first step aside when there are more).
int64_t typical_step(const std::vector<Slice>& slices, int64_t& steps) {
  std::map<int64_t, std::map<int, std::pair<double, double>>> span;  // step -> rank -> [start, end]
  for (const Slice& s : slices) {
    auto [it, fresh] = span[s.step].try_emplace(s.rank, s.start, s.end);
    if (!fresh) it->second.first = std::min(it->second.first, s.start), it->second.second = std::max(it->second.second, s.end);
  }
  std::vector<std::pair<double, int64_t>> times;
  for (const auto& [step, ranks] : span) {
    double most = 0;
    for (const auto& [r, iv] : ranks) most = std::max(most, iv.second - iv.first);
    times.push_back({most, step});
  }
  steps = static_cast<int64_t>(times.size());
  if (times.size() > 1) times.erase(times.begin());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2].second;
}

RankTime rank_time(int rank, const std::vector<const Slice*>& mine) {
  RankTime t;
  t.rank = rank;
  std::map<std::string, Intervals> by_stream;
  double lo = 1e300, hi = -1e300;
  for (const Slice* s : mine) {
    by_stream[s->stream].push_back({s->start, s->end});
    lo = std::min(lo, s->start), hi = std::max(hi, s->end);
  }
  Intervals compute, comm;
  for (auto& [stream, iv] : by_stream) {
    iv = merged(iv);
    t.stream_us[stream] = length(iv);
    if (stream == "compute") compute = iv;
    else if (is_comm_stream(stream)) comm.insert(comm.end(), iv.begin(), iv.end());
  }
  comm = merged(comm);
  t.step_us = hi - lo;
  t.compute_us = length(compute);
  t.comm_us = length(comm);
  t.hidden_us = overlap(comm, compute);
  return t;
}

void summarize(const std::vector<Slice>& slices, TraceSummary& out) {
  out.step = typical_step(slices, out.steps);
  std::map<int, std::vector<const Slice*>> by_rank;
  std::map<std::string, double> ops;
  for (const Slice& s : slices)
    if (s.step == out.step) by_rank[s.rank].push_back(&s), ops[s.op] += s.end - s.start;
  for (const auto& [rank, mine] : by_rank) out.ranks.push_back(rank_time(rank, mine));
  for (const auto& [op, us] : ops) out.ops.push_back({op, us / by_rank.size()});
  std::sort(out.ops.begin(), out.ops.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (size_t i = 0; i < out.ranks.size(); ++i)
    if (out.slowest < 0 || out.ranks[i].step_us > out.ranks[out.slowest].step_us) out.slowest = static_cast<int>(i);
  const int first = out.ranks.front().rank, last = out.ranks.back().rank;
  if (last - first + 1 != static_cast<int>(out.ranks.size()))
    out.problems.push_back(fmt::format("step {}: ranks {}..{} expected, {} recorded slices", out.step, first, last, out.ranks.size()));
}

}  // namespace

bool is_comm_stream(const std::string& stream) { return stream != "compute" && stream != "copy"; }

TraceSummary summarize_trace_text(const std::string& text, const std::string& name) {
  TraceSummary out;
  out.path = name;
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    out.problems.push_back(name + ": not valid JSON (cut short or corrupt); no time breakdown");
    return out;
  }
  const json* events = j.is_array() ? &j : (j.is_object() && j.contains("traceEvents") ? &j["traceEvents"] : nullptr);
  if (!events || !events->is_array()) {
    out.problems.push_back(name + ": no \"traceEvents\" array (not a Chrome trace); no time breakdown");
    return out;
  }
  const std::vector<Slice> slices = slices_of(*events, out.problems);
  if (slices.empty()) {
    out.problems.push_back(name + ": no task slices with a step (not a shardlm trace?); no time breakdown");
    return out;
  }
  summarize(slices, out);
  out.ok = true;
  return out;
}

TraceSummary summarize_trace(const std::string& path) {
  std::error_code ec;
  const auto type = std::filesystem::status(path, ec).type();
  if (!ec && type != std::filesystem::file_type::regular && type != std::filesystem::file_type::not_found) {
    TraceSummary out;  // a FIFO or a device could be read forever
    out.path = path;
    out.problems.push_back(path + ": not a regular file; not read, no time breakdown");
    return out;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    TraceSummary out;
    out.path = path;
    out.problems.push_back(path + ": cannot be read (not written yet? the trace is written at the end of a run)");
    return out;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return summarize_trace_text(ss.str(), path);
}

}  // namespace shardlm::report
