#include "trace/trace.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace shardlm::trace {

std::string RankTrace::events_json() const {
  using nlohmann::json;
  std::string out;
  auto append = [&](const json& j) {
    if (!out.empty()) out += ",\n";
    out += j.dump();
  };
  append({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (size_t s = 0; s < streams.size(); ++s)
    append({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", s}, {"args", {{"name", streams[s]}}}});
  for (const Slice& s : slices) {
    json args{{"step", s.step}};
    if (s.moved >= 0) args["bytes moved"] = s.moved;
    append({{"ph", "X"},
            {"name", s.name},
            {"cat", streams.at(s.stream)},
            {"pid", rank},
            {"tid", s.stream},
            {"ts", s.start_us},
            {"dur", s.dur_us},
            {"args", args}});
  }
  for (const MemorySample& m : memory) {
    json args;
    for (int c = 0; c < kNumMemCategories; ++c) args[to_string(static_cast<MemCategory>(c))] = m.bytes[c];
    append({{"ph", "C"}, {"name", "memory (bytes)"}, {"pid", rank}, {"ts", m.ts_us}, {"args", args}});
  }
  return out;
}

void write_trace(const std::string& path, const std::vector<std::string>& rank_parts) {
  const std::string tmp = path + ".tmp";
  // A write that fails (disk full, file size limit) must stop the run with its reason, not
  // leave a cut trace behind a successful exit: every write, the flush and the close are checked.
  auto fail = [&](int err) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    return std::runtime_error("trace: cannot write " + path + " (through " + tmp + "): " + std::strerror(err));
  };
  {
    errno = 0;
    std::ofstream f(tmp);
    if (!f) throw fail(errno);
    f << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    bool first = true;
    for (const auto& part : rank_parts) {
      if (part.empty()) continue;
      if (!first) f << ",\n";
      f << part;
      first = false;
    }
    f << "\n]}\n";
    f.flush();
    if (!f) throw fail(errno);
    f.close();
    if (!f) throw fail(errno);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error("trace: cannot rename " + tmp + " to " + path + ": " + ec.message());
}

}  // namespace shardlm::trace
