#include "sim/hardware.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace shardlm::sim {

namespace fs = std::filesystem;
using nlohmann::json;

const char* to_string(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_to_all: return "all_to_all";
  }
  return "?";
}

namespace {

// A number as the profile would write it (6 significant digits: 7.3e+10).
std::string str(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

std::runtime_error bad(const std::string& origin, const std::string& field, const std::string& why) {
  return std::runtime_error("hardware profile " + origin + ": " + field + ": " + why);
}

// The least a positive figure may be, in its own unit. Smaller is a slip of the unit, and it made
// times overflow: nic_bw 1e-300 printed "step inf ms | 0 tokens/s". A latency may still be 0.
constexpr double kMinFigure = 1e-6;

// A figure: {"value": positive number, "source": non-empty string}. `path` names it in errors.
double figure(const json& parent, const std::string& key, const std::string& path, const std::string& origin,
              bool allow_zero = false) {
  const std::string field = path.empty() ? key : path + "." + key;
  if (!parent.contains(key)) throw bad(origin, field, "missing");
  const json& f = parent.at(key);
  if (!f.is_object()) throw bad(origin, field, "must be {\"value\": N, \"source\": \"...\"}");
  if (!f.contains("source") || !f.at("source").is_string() || f.at("source").get<std::string>().empty())
    throw bad(origin, field + ".source", "missing (every figure names where it comes from)");
  if (!f.contains("value") || !f.at("value").is_number()) throw bad(origin, field + ".value", "must be a number");
  const double v = f.at("value").get<double>();
  if (!std::isfinite(v) || v < 0 || (v == 0 && !allow_zero))
    throw bad(origin, field + ".value", "must be " + std::string(allow_zero ? ">= 0" : "> 0") + ", got " + f.at("value").dump());
  if (!allow_zero && v < kMinFigure)
    throw bad(origin, field + ".value", "must be at least " + str(kMinFigure) + " (smaller is a slip of the unit), got " +
                                            f.at("value").dump());
  return v;
}

LinkCost link_cost(const json& j, const std::string& path, double memory_bw, const std::string& origin);

// A whole number of at least `least` at `parent[key]` (a group's shape, not a figure).
int whole_key(const json& parent, const std::string& key, int least, const std::string& path, const std::string& origin) {
  const std::string field = path + "." + key;
  if (!parent.contains(key) || !parent.at(key).is_number_integer())
    throw bad(origin, field, "must be a whole number");
  const int64_t v = parent.at(key).get<int64_t>();
  if (v < least || v > 1000000) throw bad(origin, field, "must be in [" + std::to_string(least) + ", 1000000], got " + std::to_string(v));
  return static_cast<int>(v);
}

// A tier's "groups": [{"ranks": n, "per_node": k, "all_gather": {latency_s, bus_bw}, ...}], each
// shape once, per_node at most ranks.
std::vector<GroupCost> group_costs(const json& rows, const std::string& path, double memory_bw, const std::string& origin) {
  if (!rows.is_array()) throw bad(origin, path, "must be a list of {ranks, per_node, and each collective's figures}");
  std::vector<GroupCost> out;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string at = path + "[" + std::to_string(i) + "]";
    const json& row = rows[i];
    if (!row.is_object()) throw bad(origin, at, "must be an object");
    GroupCost g;
    g.ranks = whole_key(row, "ranks", 2, at, origin);
    g.per_node = whole_key(row, "per_node", 1, at, origin);
    if (g.per_node > g.ranks) throw bad(origin, at + ".per_node", "is above its ranks " + std::to_string(g.ranks));
    for (const GroupCost& o : out)
      if (o.ranks == g.ranks && o.per_node == g.per_node) throw bad(origin, at, "the same group shape as an earlier row");
    for (int c = 0; c < kNumCollectives; ++c) {
      const std::string name = to_string(static_cast<Collective>(c));
      if (!row.contains(name) || !row.at(name).is_object()) throw bad(origin, at + "." + name, "missing");
      g.op[c] = link_cost(row.at(name), at + "." + name, memory_bw, origin);
    }
    out.push_back(g);
  }
  return out;
}

Tier tier(const json& j, const std::string& key, double memory_bw, const std::string& origin) {
  if (!j.contains(key) || !j.at(key).is_object()) throw bad(origin, key, "missing (an object per collective)");
  const json& t = j.at(key);
  Tier out;
  for (int c = 0; c < kNumCollectives; ++c) {
    const std::string name = to_string(static_cast<Collective>(c)), path = key + "." + name;
    if (!t.contains(name) || !t.at(name).is_object()) throw bad(origin, path, "missing");
    out.op[c] = link_cost(t.at(name), path, memory_bw, origin);
  }
  if (t.contains("groups")) out.groups = group_costs(t.at("groups"), key + ".groups", memory_bw, origin);
  return out;
}

// One collective's {latency_s, bus_bw} at `path` (e.g. "intra_node.all_gather").
LinkCost link_cost(const json& j, const std::string& path, double memory_bw, const std::string& origin) {
  LinkCost link;
  link.latency_s = figure(j, "latency_s", path, origin, true);
  if (link.latency_s > kMaxLatencySeconds)
    throw bad(origin, path + ".latency_s.value",
              "must be <= " + str(kMaxLatencySeconds) + " s (a small message's time), got " + str(link.latency_s));
  link.bus_bw = figure(j, "bus_bw", path, origin);
  if (link.bus_bw > memory_bw)
    throw bad(origin, path + ".bus_bw.value",
              str(link.bus_bw) + " bytes/s is above memory_bw " + str(memory_bw) + " (a collective's bytes pass through memory)");
  return link;
}

Fabric fabric(const json& j, const Tier& intra, double memory_bw, const std::string& origin) {
  Fabric f;
  if (!j.contains("fabric")) return f;
  const json& o = j.at("fabric");
  if (!o.is_object()) throw bad(origin, "fabric", "must be an object (link_bw, optional nvls_all_reduce)");
  f.link_bw = figure(o, "link_bw", "fabric", origin);
  // A ring sends every byte it moves over each device's link once per step: its busBw cannot pass
  // the link's rate per direction (NVLS can: the switch does the reduction).
  for (Collective c : {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce})
    if (intra.of(c).bus_bw > f.link_bw)
      throw bad(origin, std::string("intra_node.") + to_string(c) + ".bus_bw.value",
                str(intra.of(c).bus_bw) + " bytes/s is above fabric.link_bw " + str(f.link_bw) +
                    " (a ring's busBw is at most the link's rate per direction)");
  if (o.contains("nvls_all_reduce")) {
    if (!o.at("nvls_all_reduce").is_object()) throw bad(origin, "fabric.nvls_all_reduce", "must be {latency_s, bus_bw}");
    f.nvls_all_reduce = link_cost(o.at("nvls_all_reduce"), "fabric.nvls_all_reduce", memory_bw, origin);
    f.has_nvls = true;
  }
  return f;
}

Network::LowLatency low_latency(const json& o, const std::string& origin) {
  const std::string path = "network.low_latency";
  if (!o.is_object()) throw bad(origin, path, "must be an object (ring_step_latency_s, tree_step_latency_s, bandwidth_fraction)");
  Network::LowLatency ll;
  ll.present = true;
  for (auto [key, out] : {std::pair{"ring_step_latency_s", &ll.ring_step_latency_s},
                          std::pair{"tree_step_latency_s", &ll.tree_step_latency_s}}) {
    *out = figure(o, key, path, origin, true);
    if (*out > kMaxLatencySeconds)
      throw bad(origin, path + "." + key + ".value", "must be <= " + str(kMaxLatencySeconds) + " s");
  }
  ll.bandwidth_fraction = figure(o, "bandwidth_fraction", path, origin);
  if (ll.bandwidth_fraction > 1) throw bad(origin, path + ".bandwidth_fraction.value", "must be <= 1 (a fraction)");
  return ll;
}

Network network(const json& j, const std::string& origin) {
  Network n;
  if (!j.contains("network")) return n;
  const json& o = j.at("network");
  if (!o.is_object()) throw bad(origin, "network", "must be an object (nics_per_node, nic_bw, ...)");
  n.present = true;
  const double nics = figure(o, "nics_per_node", "network", origin);
  if (nics != std::floor(nics) || nics > 1e6) throw bad(origin, "network.nics_per_node.value", "must be a whole number");
  n.nics_per_node = static_cast<int>(nics);
  n.nic_bw = figure(o, "nic_bw", "network", origin);
  n.nic_efficiency = figure(o, "nic_efficiency", "network", origin);
  if (n.nic_efficiency > 1) throw bad(origin, "network.nic_efficiency.value", "must be <= 1 (a fraction of nic_bw)");
  n.tree_efficiency = figure(o, "tree_efficiency", "network", origin);
  if (n.tree_efficiency > 1) throw bad(origin, "network.tree_efficiency.value", "must be <= 1 (a fraction)");
  for (auto [key, out] : {std::pair{"ring_step_latency_s", &n.ring_step_latency_s},
                          std::pair{"tree_step_latency_s", &n.tree_step_latency_s},
                          std::pair{"message_latency_s", &n.message_latency_s}}) {
    *out = figure(o, key, "network", origin, true);
    if (*out > kMaxLatencySeconds)
      throw bad(origin, std::string("network.") + key + ".value", "must be <= " + str(kMaxLatencySeconds) + " s");
  }
  if (o.contains("low_latency")) n.low_latency = low_latency(o.at("low_latency"), origin);
  return n;
}

// A measured table: {"value": [{field: number, ...}, ...], "source": "..."}; each row's fields in
// the order given, positive, the first `whole` of them whole numbers. Absent: no rows.
std::vector<std::vector<double>> table(const json& j, const std::string& name, const std::vector<std::string>& fields,
                                       size_t whole, const std::string& origin, const std::string& parent = "") {
  std::vector<std::vector<double>> rows;
  if (!j.contains(name)) return rows;
  const json& f = j.at(name);
  const std::string key = parent.empty() ? name : parent + "." + name;
  if (!f.is_object() || !f.contains("source") || !f.at("source").is_string() || f.at("source").get<std::string>().empty())
    throw bad(origin, key, "must be {\"value\": [...], \"source\": \"...\"}");
  if (!f.contains("value") || !f.at("value").is_array()) throw bad(origin, key + ".value", "must be a list");
  for (size_t i = 0; i < f.at("value").size(); ++i) {
    const json& e = f.at("value")[i];
    const std::string path = key + ".value[" + std::to_string(i) + "]";
    std::vector<double> row;
    for (size_t c = 0; c < fields.size(); ++c) {
      const std::string& name = fields[c];
      if (!e.is_object() || !e.contains(name) || !e.at(name).is_number()) throw bad(origin, path + "." + name, "must be a number");
      const double v = e.at(name).get<double>();
      if (!std::isfinite(v) || v < kMinFigure || (c < whole && (v != std::floor(v) || v > 1e12)))
        throw bad(origin, path + "." + name,
                  (c < whole ? "must be a positive whole number" : "must be at least " + str(kMinFigure)) + ", got " +
                      e.at(name).dump());
      row.push_back(v);
    }
    rows.push_back(row);
  }
  return rows;
}

// The intra tier's published all_reduce busBw by message size (`all_reduce_by_size`, over a node's
// devices), as the fraction of the busBw its bytes moved at beyond the all-reduce latency of a
// whole node (NVLS where the node has it: NCCL's choice there). A size the line already prices
// slower than published (the smallest, latency-bound ones) takes 1.
std::vector<SizeEfficiency> by_size(const json& j, const HardwareProfile& h, const std::string& origin) {
  const std::string key = "intra_node.all_reduce_by_size";
  const auto rows = table(j.at("intra_node"), "all_reduce_by_size", {"bytes", "bus_bw"}, 1, origin, "intra_node");
  if (rows.empty()) return {};
  if (rows.size() < 2) throw bad(origin, key + ".value", "needs at least two sizes");
  const LinkCost& line = h.fabric.has_nvls ? h.fabric.nvls_all_reduce : h.intra.of(Collective::all_reduce);
  const int n = h.devices_per_node;
  const double factor = n > 1 ? 2.0 * (n - 1) / n : 1.0;
  std::vector<SizeEfficiency> out;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string row = key + ".value[" + std::to_string(i) + "]";
    if (i > 0 && rows[i][0] <= rows[i - 1][0]) throw bad(origin, row + ".bytes", "must be larger than the row before's");
    if (rows[i][1] > h.memory_bw)
      throw bad(origin, row + ".bus_bw", str(rows[i][1]) + " bytes/s is above memory_bw " + str(h.memory_bw));
    const double bytes_s = rows[i][0] * factor / line.bus_bw;                     // at the peak
    const double taken_s = rows[i][0] * factor / rows[i][1] - line.latency_s;  // as published
    out.push_back({rows[i][0], taken_s > bytes_s ? bytes_s / taken_s : 1.0});
  }
  return out;
}

// A calendar date as YYYY-MM-DD (month 1-12, day 1-31).
bool is_date(const std::string& d) {
  if (d.size() != 10 || d[4] != '-' || d[7] != '-') return false;
  for (size_t i : {0, 1, 2, 3, 5, 6, 8, 9})
    if (!std::isdigit(static_cast<unsigned char>(d[i]))) return false;
  const int month = std::stoi(d.substr(5, 2)), day = std::stoi(d.substr(8, 2));
  return month >= 1 && month <= 12 && day >= 1 && day <= 31;
}

Provenance provenance(const json& j, const std::string& origin) {
  if (!j.contains("provenance") || !j.at("provenance").is_object())
    throw bad(origin, "provenance", "missing ({\"source\": \"measured\" | \"derived\" | \"datasheet\", \"date\": "
                                    "\"YYYY-MM-DD\"}: where the figures come from, and when)");
  const json& o = j.at("provenance");
  const auto text = [&](const char* key) {
    return o.contains(key) && o.at(key).is_string() ? o.at(key).get<std::string>() : std::string();
  };
  Provenance p{text("source"), text("date"), text("detail")};
  if (p.source != "measured" && p.source != "derived" && p.source != "datasheet")
    throw bad(origin, "provenance.source",
              (p.source.empty() ? std::string("missing") : "'" + p.source + "'") +
                  ": must be measured (timed on this hardware), derived (a measured profile carried to it) or datasheet");
  if (!is_date(p.date))
    throw bad(origin, "provenance.date",
              (p.date.empty() ? std::string("missing") : "'" + p.date + "'") +
                  ": must be a date YYYY-MM-DD (of the measurement)");
  if (o.contains("detail") && !o.at("detail").is_string()) throw bad(origin, "provenance.detail", "must be a string");
  return p;
}

// Where the parser is: the keys and array positions from the document's root ("a.b[2].c").
class JsonPath {
 public:
  bool on(json::parse_event_t event, const json& parsed) {
    using E = json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      element_started();
      frames_.push_back({event == E::array_start, "", 0});
    } else if (event == E::object_end || event == E::array_end) {
      frames_.pop_back();
    } else if (event == E::key) {
      frames_.back().key = parsed.get<std::string>();
    } else {
      element_started();
    }
    return true;
  }
  // The value being read: an array's next element, an object's current key.
  std::string where() const {
    std::string out;
    for (size_t i = 0; i < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      const bool innermost = i + 1 == frames_.size();
      if (f.array) {
        out += "[" + std::to_string(innermost ? f.started : f.started - 1) + "]";
      } else if (!f.key.empty()) {
        if (!out.empty()) out += '.';
        out += f.key;
      }
    }
    return out;
  }

 private:
  struct Frame {
    bool array;
    std::string key;
    int64_t started;  // elements of an array begun so far
  };
  void element_started() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().started;
  }
  std::vector<Frame> frames_;
};

// The profile's JSON; a syntax error or a number beyond a double's range is one line naming the
// file and, where the parser got that far, the field.
json parse_json(const std::string& text, const std::string& origin) {
  JsonPath path;
  try {
    return json::parse(text, [&](int, json::parse_event_t event, json& parsed) { return path.on(event, parsed); });
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    if (const size_t tag = what.find("] "); what.front() == '[' && tag != std::string::npos) what.erase(0, tag + 2);
    const std::string field = path.where();
    if (e.id == 406)  // out_of_range.406: "number overflow parsing '1e400'"
      throw bad(origin, field.empty() ? "(root)" : field, "a number beyond the range of a double (" + what + ")");
    throw std::runtime_error("hardware profile " + origin + ": not valid JSON" + (field.empty() ? "" : " at " + field) +
                             ": " + what);
  }
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

}  // namespace

HardwareProfile parse_hardware(const std::string& text, const std::string& origin) {
  const json j = parse_json(text, origin);
  if (!j.is_object()) throw std::runtime_error("hardware profile " + origin + ": not a JSON object");
  HardwareProfile h;
  h.origin = origin;
  if (!j.contains("name") || !j.at("name").is_string()) throw bad(origin, "name", "missing (a string)");
  h.name = j.at("name").get<std::string>();
  h.provenance = provenance(j, origin);
  if (!j.contains("compute_dtype") || !j.at("compute_dtype").is_string()) throw bad(origin, "compute_dtype", "missing");
  h.compute_dtype = j.at("compute_dtype").get<std::string>();
  if (h.compute_dtype != "bf16" && h.compute_dtype != "fp32")
    throw bad(origin, "compute_dtype", "must be bf16 or fp32, got " + h.compute_dtype);
  h.activation_dtype = h.compute_dtype;
  if (j.contains("activation_dtype")) {
    if (!j.at("activation_dtype").is_string()) throw bad(origin, "activation_dtype", "must be bf16 or fp32");
    h.activation_dtype = j.at("activation_dtype").get<std::string>();
    if (h.activation_dtype != "bf16" && h.activation_dtype != "fp32")
      throw bad(origin, "activation_dtype", "must be bf16 or fp32, got " + h.activation_dtype);
  }
  if (j.contains("per_thread") && !j.at("per_thread").is_boolean()) throw bad(origin, "per_thread", "must be true or false");
  h.per_thread = j.value("per_thread", false);
  h.peak_flops = figure(j, "peak_flops", "", origin);
  h.fp32_peak_flops = figure(j, "fp32_peak_flops", "", origin);
  h.gemm_efficiency = figure(j, "gemm_efficiency", "", origin);
  if (h.gemm_efficiency > 1) throw bad(origin, "gemm_efficiency.value", "must be <= 1 (a fraction of peak_flops)");
  if (j.contains("attention_efficiency")) {
    h.attention_efficiency = figure(j, "attention_efficiency", "", origin);
    if (h.attention_efficiency > 1) throw bad(origin, "attention_efficiency.value", "must be <= 1 (a fraction of peak_flops)");
  }
  h.memory_bw = figure(j, "memory_bw", "", origin);
  if (j.contains("pointwise_bw")) h.pointwise_bw = figure(j, "pointwise_bw", "", origin);
  if (j.contains("storage_bw")) h.storage_bw = figure(j, "storage_bw", "", origin);
  if (j.contains("host_link_bw")) h.host_link_bw = figure(j, "host_link_bw", "", origin);
  if (j.contains("disk_read_bw")) h.disk_read_bw = figure(j, "disk_read_bw", "", origin);
  if (j.contains("disk_write_bw")) h.disk_write_bw = figure(j, "disk_write_bw", "", origin);
  if (j.contains("disk_latency_s")) {
    h.disk_latency_s = figure(j, "disk_latency_s", "", origin);
    if (h.disk_latency_s > kMaxLatencySeconds)
      throw bad(origin, "disk_latency_s.value", "must be at most " + std::to_string(kMaxLatencySeconds) + " s");
  }
  for (auto [name, field] : {std::pair{"compute_slowdown_beside_disk", &h.compute_slowdown_beside_disk},
                             std::pair{"disk_slowdown_beside_compute", &h.disk_slowdown_beside_compute},
                             std::pair{"comm_slowdown_beside_compute", &h.comm_slowdown_beside_compute}}) {
    if (!j.contains(name)) continue;
    *field = figure(j, name, "", origin);
    if (*field < 1) throw bad(origin, std::string(name) + ".value", "must be >= 1 (a slowdown)");
  }
  const double dpn = figure(j, "devices_per_node", "", origin);
  if (dpn != std::floor(dpn) || dpn > 1e6) throw bad(origin, "devices_per_node.value", "must be a whole number");
  h.devices_per_node = static_cast<int>(dpn);
  if (j.contains("cores_per_node")) {
    const double cores = figure(j, "cores_per_node", "", origin);
    if (cores != std::floor(cores) || cores > 1e6) throw bad(origin, "cores_per_node.value", "must be a whole number");
    h.cores_per_node = static_cast<int>(cores);
  }
  h.device_memory = static_cast<int64_t>(figure(j, "device_memory", "", origin, true));
  h.comm_compute_slowdown = figure(j, "comm_compute_slowdown", "", origin);
  if (h.comm_compute_slowdown < 1) throw bad(origin, "comm_compute_slowdown.value", "must be >= 1 (a slowdown)");
  for (const auto& r : table(j, "gemm_rates", {"m", "k", "n", "threads", "forward", "backward"}, 4, origin))
    h.gemm_rates.push_back({static_cast<int64_t>(r[0]), static_cast<int64_t>(r[1]), static_cast<int64_t>(r[2]),
                            static_cast<int>(r[3]), r[4], r[5]});
  for (const auto& r : table(j, "attention_rates", {"t", "hs", "threads", "forward", "backward"}, 3, origin))
    h.attention_rates.push_back({static_cast<int64_t>(r[0]), static_cast<int64_t>(r[1]), static_cast<int>(r[2]), r[3], r[4]});
  h.intra = tier(j, "intra_node", h.memory_bw, origin);
  h.fabric = fabric(j, h.intra, h.memory_bw, origin);
  h.intra.by_size = by_size(j, h, origin);
  h.network = network(j, origin);
  // The network is described one way: NICs per node (network) or one flat figure (inter_node).
  if (h.network.present && j.contains("inter_node"))
    throw bad(origin, "inter_node", "give either inter_node (one figure for the network) or network (NICs per node), not both");
  // With a network, a group across nodes is priced from it; the inter tier stays unused.
  h.inter = h.network.present ? h.intra : tier(j, "inter_node", h.memory_bw, origin);
  if (j.contains("collectives_measured") && !j.at("collectives_measured").is_boolean())
    throw bad(origin, "collectives_measured", "must be true or false");
  h.collectives_measured = j.value("collectives_measured", true);
  return h;
}

std::string hardware_dir(const char* chosen) {
  if (chosen) return chosen;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && is_dir(exe.parent_path().parent_path() / "configs" / "hardware"))
    return (exe.parent_path().parent_path() / "configs" / "hardware").string();
#ifdef SHARDLM_HARDWARE_DIR_DEFAULT
  if (is_dir(SHARDLM_HARDWARE_DIR_DEFAULT)) return SHARDLM_HARDWARE_DIR_DEFAULT;
#endif
  return "configs/hardware";
}

std::vector<std::string> preset_names(const std::string& preset_dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(preset_dir, ec))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

void require_collectives(const HardwareProfile& hw, int ranks) {
  if (ranks > 1 && !hw.collectives_measured)
    throw std::runtime_error("hardware profile " + hw.origin +
                             ": collectives_measured is false (calibrated on one rank, which has no collectives to time): it "
                             "cannot price " + std::to_string(ranks) + " ranks; calibrate under mpirun -np N");
}

std::string provenance_line(const HardwareProfile& hw) {
  const Provenance& p = hw.provenance;
  const std::string what = p.source == "measured" ? "measured on the hardware it describes, " + p.date
                           : p.source == "derived" ? "derived from a measured profile, measured " + p.date
                                                   : "datasheet figures, nothing measured (as of " + p.date + ")";
  return "hardware: " + hw.origin + " (" + hw.name + "): " + what + (p.detail.empty() ? "" : "; " + p.detail);
}

// From bench/published_runs.py's 25 runs on the datasheet presets (--hardware-h100
// h100-80gb-datasheet --hardware-a100 a100-80gb-datasheet) against its default, the measured and
// derived presets; recompute when either changes.
std::string datasheet_caution(const HardwareProfile& hw) {
  if (hw.provenance.source != "datasheet") return "";
  return "caution: a datasheet profile's predictions run optimistic: on the published-run table (bench/published_runs.py, "
         "25 runs) the datasheet presets predicted a median +25% more tokens/s than published (H100 rows +58%, A100 rows "
         "+23%; 5 of 25 within 15%), the presets with measured kernel rates (h100-80gb, a100-80gb) +14% (18 of 25 within 15%)";
}

HardwareProfile load_hardware(const std::string& name_or_path, const std::string& preset_dir) {
  if (name_or_path.empty()) throw std::runtime_error("--hardware: empty (a preset name or a JSON file)");
  // A path names a file (it has a '/' or ends in .json); anything else is a preset name.
  const bool is_path = name_or_path.find('/') != std::string::npos ||
                       (name_or_path.size() > 5 && name_or_path.substr(name_or_path.size() - 5) == ".json");
  fs::path file = name_or_path;
  if (!is_path) {
    file = fs::path(preset_dir) / (name_or_path + ".json");
    std::error_code ec;
    if (!fs::exists(file, ec)) {
      std::string list;
      for (const auto& n : preset_names(preset_dir)) list += (list.empty() ? "" : ", ") + n;
      throw std::runtime_error("--hardware: unknown preset '" + name_or_path + "' (presets: " +
                               (list.empty() ? "none found in " + preset_dir : list) + "; or a JSON file path)");
    }
  }
  std::ifstream in(file);
  if (!in) throw std::runtime_error("hardware profile " + file.string() + ": cannot read it (" + std::strerror(errno) + ")");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_hardware(text.str(), file.string());
}

}  // namespace shardlm::sim
