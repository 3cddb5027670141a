#include "train/cgroups.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <vector>

namespace shardlm::train {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  return parts;
}

// mountinfo writes a space, tab, newline or backslash in a path as \ooo (octal).
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      const std::string oct = s.substr(i + 1, 3);
      if (oct.find_first_not_of("01234567") == std::string::npos) {
        out += static_cast<char>(std::stoi(oct, nullptr, 8));
        i += 3;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

struct Place {
  bool v2 = false;
  std::string path;  // the cgroup's path in its hierarchy, from /proc/self/cgroup
};

// The controller's line of /proc/self/cgroup: a v1 hierarchy naming it among its controllers
// ("cpu,cpuacct"), else the v2 line ("0::PATH"), where every controller the kernel enables lives.
std::optional<Place> place_of(const std::string& root, const std::string& controller) {
  std::ifstream f(root + "/proc/self/cgroup");
  std::string line;
  std::optional<Place> v2;
  while (std::getline(f, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty() && line.substr(0, a) == "0") v2 = Place{true, path};
    for (const std::string& c : split(controllers, ','))
      if (c == controller) return Place{false, path};
  }
  return v2;
}

// Where `place`'s hierarchy is mounted (mount point, and the hierarchy's path at that mount point:
// "/" but for a container that sees only its own subtree).
std::optional<std::pair<std::string, std::string>> mount_of(const std::string& root, const Place& place,
                                                            const std::string& controller) {
  std::ifstream f(root + "/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const std::vector<std::string> before = split(line.substr(0, dash), ' '), after = split(line.substr(dash + 3), ' ');
    if (before.size() < 5 || after.size() < 3) continue;
    const bool is_it = place.v2 ? after[0] == "cgroup2" : after[0] == "cgroup" && [&] {
      for (const std::string& o : split(after[2], ','))
        if (o == controller) return true;
      return false;
    }();
    if (is_it) return std::pair{unescape(before[4]), unescape(before[3])};
  }
  return std::nullopt;
}

std::optional<int64_t> read_number(const fs::path& file) {
  std::ifstream f(file);
  std::string word;
  if (!(f >> word) || word.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;  // "max", absent
  try {
    return static_cast<int64_t>(std::stoull(word));
  } catch (const std::out_of_range&) {
    return std::nullopt;
  }
}

int64_t stat_field(const fs::path& file, const std::string& key) {
  std::ifstream f(file);
  std::string name;
  int64_t value = 0;
  while (f >> name >> value)
    if (name == key) return value;
  return 0;
}

std::string key_of(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 ? std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) : dir;
}

// One level's limit and use; nullopt where it sets no limit. v1 writes "no limit" as the page
// counter's largest value (2^63 less a page).
std::optional<MemoryCgroup> memory_level(const fs::path& dir, bool v2) {
  const auto limit = read_number(dir / (v2 ? "memory.max" : "memory.limit_in_bytes"));
  if (!limit || *limit >= (int64_t{1} << 62)) return std::nullopt;
  const int64_t usage = read_number(dir / (v2 ? "memory.current" : "memory.usage_in_bytes")).value_or(0);
  // Inactive page cache is reclaimed before the kernel kills anything: the working set of
  // Kubernetes' eviction and cAdvisor.
  const int64_t inactive_file = stat_field(dir / "memory.stat", v2 ? "inactive_file" : "total_inactive_file");
  MemoryCgroup m;
  m.dir = dir.string();
  m.key = key_of(m.dir);
  m.limit = *limit;
  m.in_use = std::max<int64_t>(0, usage - inactive_file);
  m.available = std::max<int64_t>(0, m.limit - m.in_use);
  return m;
}

// One level's quota; nullopt where it sets none. v2: cpu.max "QUOTA PERIOD" ("max PERIOD" for
// none); v1: cpu.cfs_quota_us (-1 for none) over cpu.cfs_period_us, in microseconds.
std::optional<CpuQuota> cpu_level(const fs::path& dir, bool v2) {
  std::optional<int64_t> quota, period;
  if (v2) {
    std::ifstream f(dir / "cpu.max");
    std::string q, p;
    if (f >> q >> p && q.find_first_not_of("0123456789") == std::string::npos &&
        p.find_first_not_of("0123456789") == std::string::npos && q.size() < 18 && p.size() < 18)
      quota = std::stoll(q), period = std::stoll(p);
  } else {
    quota = read_number(dir / "cpu.cfs_quota_us");
    period = read_number(dir / "cpu.cfs_period_us");
  }
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return CpuQuota{dir.string(), key_of(dir.string()), static_cast<double>(*quota) / static_cast<double>(*period)};
}

struct Walk {
  fs::path leaf;  // this process's cgroup
  fs::path top;   // the mount point, above which the walk does not go
  bool v2 = false;
};

std::optional<Walk> walk_of(const std::string& root, const std::string& controller) {
  const auto place = place_of(root, controller);
  if (!place) return std::nullopt;
  const auto mount = mount_of(root, *place, controller);
  if (!mount) return std::nullopt;
  const auto& [point, mounted_path] = *mount;
  std::string rel;  // the cgroup's path below the mount point
  if (mounted_path == "/")
    rel = place->path;
  else if (place->path.compare(0, mounted_path.size(), mounted_path) == 0)
    rel = place->path.substr(mounted_path.size());
  // else the cgroup is outside what is mounted here: the mount point is the nearest level seen
  const fs::path top = fs::path(root + point).lexically_normal();
  fs::path leaf = (top / fs::path(rel).relative_path()).lexically_normal();
  if (!leaf.has_filename()) leaf = leaf.parent_path();  // "top/" when rel is "/"
  return Walk{leaf, top, place->v2};
}

// The level of the walk from the leaf up to the mount point with the least `figure`.
template <class Level, class Figure>
auto tightest(const Walk& walk, Level level, Figure figure) -> decltype(level(walk.leaf, walk.v2)) {
  decltype(level(walk.leaf, walk.v2)) least;
  for (fs::path dir = walk.leaf;; dir = dir.parent_path()) {
    const auto here = level(dir, walk.v2);
    if (here && (!least || figure(*here) < figure(*least))) least = here;
    if (dir == walk.top || dir == dir.parent_path()) break;
  }
  return least;
}

}  // namespace

std::optional<MemoryCgroup> memory_cgroup(const std::string& root) {
  const auto walk = walk_of(root, "memory");
  if (!walk) return std::nullopt;
  return tightest(*walk, memory_level, [](const MemoryCgroup& m) { return m.available; });
}

std::optional<CpuQuota> cpu_quota(const std::string& root) {
  const auto walk = walk_of(root, "cpu");
  if (!walk) return std::nullopt;
  return tightest(*walk, cpu_level, [](const CpuQuota& q) { return q.cpus; });
}

std::string own_cgroup_dir(const std::string& controller, const std::string& root) {
  const auto walk = walk_of(root, controller);
  return walk ? walk->leaf.string() : "";
}

}  // namespace shardlm::train
