#include "trace/trace.h"

#include "files/replace_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
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
  // A write that fails (disk full, file size limit) must stop the run with its reason, not
  // leave a cut trace behind a successful exit.
  std::string tmp;
  const int fd = files::create_temporary(path, tmp, O_WRONLY);
  if (fd < 0) throw std::runtime_error("trace: cannot write " + path + ": " + std::strerror(errno));
  try {
    files::write_all(fd, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    bool first = true;
    for (const auto& part : rank_parts) {
      if (part.empty()) continue;
      if (!first) files::write_all(fd, ",\n");
      files::write_all(fd, part);
      first = false;
    }
    files::write_all(fd, "\n]}\n");
  } catch (const std::exception& e) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw std::runtime_error("trace: cannot write " + path + ": " + e.what());
  }
  try {
    files::commit_temporary(fd, tmp, path);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("trace: ") + e.what());
  }
}

}  // namespace shardlm::trace
