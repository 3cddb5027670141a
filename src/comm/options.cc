#include "comm/options.h"

#include <sstream>
#include <stdexcept>

namespace shardlm::comm {

const char* to_string(Algorithm a) {
  switch (a) {
    case Algorithm::automatic: return "automatic";
    case Algorithm::native: return "native";
    case Algorithm::direct: return "direct";
    case Algorithm::ring: return "ring";
    case Algorithm::via_all_reduce: return "via_all_reduce";
  }
  return "?";
}

Algorithm parse_algorithm(const std::string& name) {
  for (Algorithm a : {Algorithm::automatic, Algorithm::native, Algorithm::direct, Algorithm::ring,
                      Algorithm::via_all_reduce}) {
    if (name == to_string(a)) return a;
  }
  throw std::invalid_argument("comm: unknown algorithm \"" + name +
                              "\" (automatic, native, direct, ring, via_all_reduce)");
}

namespace {
int64_t parse_positive(const char* env, const char* value) {
  char* end = nullptr;
  long long v = std::strtoll(value, &end, 10);
  if (!end || *end != '\0' || v <= 0) {
    throw std::invalid_argument(std::string("comm: ") + env + "=" + value + " is not a positive integer");
  }
  return v;
}
}  // namespace

MpiOptions mpi_options_from(const SettingLookup& settings, MpiOptions o) {
  if (const char* v = settings("SHARDLM_COMM_ALGOS"); v && *v) {
    std::stringstream ss(v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        throw std::invalid_argument("comm: SHARDLM_COMM_ALGOS item \"" + item + "\" is not key=algorithm");
      }
      const std::string key = item.substr(0, eq);
      const Algorithm a = parse_algorithm(item.substr(eq + 1));
      if (key == "all_gather") o.all_gather = a;
      else if (key == "reduce_scatter") o.reduce_scatter = a;
      else if (key == "all_reduce") o.all_reduce = a;
      else if (key == "all_to_all") o.all_to_all = a;
      else if (key == "broadcast") o.broadcast = a;
      else throw std::invalid_argument("comm: SHARDLM_COMM_ALGOS key \"" + key + "\" is unknown");
    }
  }
  if (const char* v = settings("SHARDLM_COMM_CHUNK_KB"); v && *v) {
    o.chunk_bytes = parse_positive("SHARDLM_COMM_CHUNK_KB", v) * 1024;
  }
  if (const char* v = settings("SHARDLM_COMM_WINDOW"); v && *v) {
    o.window = static_cast<int>(parse_positive("SHARDLM_COMM_WINDOW", v));
  }
  return o;
}

}  // namespace shardlm::comm
