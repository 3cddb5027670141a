#include "ckpt/sharded.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <stdexcept>

#include "ckpt/json_no_duplicates.h"
#include "ckpt/safetensors.h"
#include "files/replace_file.h"

namespace shardlm::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::param: return "param";
    case Kind::exp_avg: return "exp_avg";
    case Kind::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("checkpoint: " + path + ": " + what);
}

// One rank's part of one unit of one kind: elements [lo, hi) of the unit's padded buffer, at
// `data` (element lo).
struct Held {
  int64_t lo = 0, hi = 0;
  float* data = nullptr;
};

Held held(const ShardedLayout& L, int k, int rank, int u, float* buf) {
  const UnitLayout& K = L.kinds[k][u];
  const int64_t len = L.flat.units[u].padded / K.parts;
  const int64_t lo = K.part_of[rank] * len;
  return {lo, lo + len, buf ? buf + K.at : nullptr};
}

// Calls fn(param, tensor_begin, tensor_end, data) for each parameter's part inside `h` (unit u).
template <class Fn>
void for_each_slice(const model::UnitDesc& unit, const Held& h, Fn&& fn) {
  for (const auto& p : unit.params) {
    const int64_t a = std::max(h.lo, p.offset), b = std::min(h.hi, p.offset + p.exported_numel());
    if (a < b) fn(p, a - p.offset, b - p.offset, h.data ? h.data + (a - h.lo) : nullptr);
  }
}

std::string slice_name(int k, const std::string& tensor) { return std::string(kind_name(Kind(k))) + "/" + tensor; }

}  // namespace

std::string hex64(uint64_t x) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(x));
  return s;
}

FileSummary summarize_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  FileSummary s;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      XXH64_freeState(st);
      fail(path, std::string("cannot read: ") + std::strerror(errno));
    }
    if (n == 0) break;
    XXH64_update(st, buf.data(), static_cast<size_t>(n));
    s.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  s.xxh64 = XXH64_digest(st);
  XXH64_freeState(st);
  return s;
}

namespace {

void write_text_durably(const std::string& path, const std::string& text) {
  try {
    files::replace_file(path, text);  // fsynced before the rename
  } catch (const std::exception& e) {
    fail(path, e.what());
  }
  fsync_dir(fs::path(path).parent_path().string());
}

int64_t int_field(const json& j, const char* key, const std::string& path, const std::string& where) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 0)
    fail(path, where + " needs '" + key + "' as an integer >= 0");
  return j[key].get<int64_t>();
}

}  // namespace

ShardedLayout whole_layout(const model::FlatLayout& flat) {
  ShardedLayout L;
  L.flat = flat;
  for (auto& k : L.kinds)
    for (const model::UnitSpan& span : flat.units) k.push_back({1, span.offset, {0}, {true}});
  return L;
}

void check_layout(const ShardedLayout& L) {
  for (int k = 0; k < kNumKinds; ++k) {
    if (L.kinds[k].size() != L.flat.units.size()) throw std::logic_error("checkpoint layout: a unit count differs");
    int64_t at = 0;
    for (size_t u = 0; u < L.flat.units.size(); ++u) {
      const UnitLayout& K = L.kinds[k][u];
      const bool ok = K.parts >= 1 && L.flat.units[u].padded % K.parts == 0 && K.at == at &&
                      static_cast<int>(K.part_of.size()) == L.world && static_cast<int>(K.writes.size()) == L.world;
      if (!ok) throw std::logic_error("checkpoint layout: unit " + std::to_string(u) + " of " + kind_name(Kind(k)));
      for (int part : K.part_of)
        if (part < 0 || part >= K.parts) throw std::logic_error("checkpoint layout: a part index out of range");
      at += L.flat.units[u].padded / K.parts;
    }
  }
}

std::string rank_file_name(int rank, int world) {
  char s[64];
  std::snprintf(s, sizeof s, "rank-%05d-of-%05d.safetensors", rank, world);
  return s;
}

int64_t held_elements(const ShardedLayout& L, int k) {
  int64_t held = 0;
  for (size_t u = 0; u < L.flat.units.size(); ++u) held += L.flat.units[u].padded / L.kinds[k][u].parts;
  return held;
}

int64_t written_elements(const ShardedLayout& L, int k, int rank) {
  for (const UnitLayout& K : L.kinds[k])
    if (K.writes[rank]) return held_elements(L, k);
  return 0;
}

FileSummary write_rank_file(const std::string& dir, const model::ModelDesc& desc, const ShardedLayout& L, int rank,
                            const RankBuffers& bufs, const SafetensorsWriter::Progress& progress,
                            SafetensorsWriter::BlockBuffer direct) {
  SafetensorsWriter w;
  check_layout(L);
  for (int k = 0; k < kNumKinds; ++k) {
    if (!bufs[k]) continue;
    for (size_t u = 0; u < desc.units.size(); ++u)
      if (L.kinds[k][u].writes[rank])
        for_each_slice(desc.units[u], held(L, k, rank, static_cast<int>(u), bufs[k]),
                     [&](const model::ParamSpec& p, int64_t a, int64_t b, const float* data) {
                       w.add_f32(slice_name(k, p.name), {b - a}, data);
                     });
  }
  w.set_metadata("format", "pt");
  // The checksum of the bytes as they go out: reading the file back would only read the page
  // cache, at the cost of a second pass over it.
  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> st(XXH64_createState(), XXH64_freeState);
  XXH64_reset(st.get(), 0);
  FileSummary s;
  w.write(dir + "/" + rank_file_name(rank, L.world), [&](const void* piece, size_t n, uint64_t written, uint64_t total) {
    XXH64_update(st.get(), piece, n);
    s.bytes = written;
    if (progress) progress(piece, n, written, total);
  }, direct);
  s.xxh64 = XXH64_digest(st.get());
  return s;
}

json make_index(const model::ModelDesc& desc, const ShardedLayout& L, const std::vector<FileSummary>& files, json meta) {
  meta["world_size"] = L.world;
  json jf = json::array();
  for (int r = 0; r < L.world; ++r)
    jf.push_back({{"name", rank_file_name(r, L.world)}, {"bytes", files[r].bytes}, {"xxh64", hex64(files[r].xxh64)}});
  meta["files"] = jf;
  json tensors = json::object();
  for (const auto& unit : desc.units)
    for (const auto& p : unit.params) tensors[p.name] = {{"shape", p.exported_shape()}, {"dtype", "F32"}};
  // Each tensor group's (unit's) split, for a reader's information: the ranges below are what loads.
  json layout = json::object();
  for (size_t u = 0; u < desc.units.size(); ++u)
    for (int k = 0; k < kNumKinds; ++k) layout[desc.units[u].name][kind_name(Kind(k))] = {{"parts", L.kinds[k][u].parts}};
  meta["layout"] = layout;
  for (int k = 0; k < kNumKinds; ++k)
    for (int r = 0; r < L.world; ++r)
      for (size_t u = 0; u < desc.units.size(); ++u)
        if (L.kinds[k][u].writes[r])
          for_each_slice(desc.units[u], held(L, k, r, static_cast<int>(u), nullptr),
                       [&](const model::ParamSpec& p, int64_t a, int64_t b, const float*) {
                         tensors[p.name][kind_name(Kind(k))].push_back({{"file", r}, {"begin", a}, {"end", b}});
                       });
  for (auto& [name, t] : tensors.items())
    for (int k = 0; k < kNumKinds; ++k)
      if (t.contains(kind_name(Kind(k)))) {
        auto& v = t[kind_name(Kind(k))];
        std::sort(v.begin(), v.end(), [](const json& x, const json& y) { return x["begin"] < y["begin"]; });
      }
  meta["tensors"] = tensors;
  return meta;
}

void commit_step(const std::string& tmp_dir, const std::string& step_dir, const json& index, const json& hf_config) {
  for (const auto& [name, j] : {std::pair{"index.json", index}, {"config.json", hf_config}}) {
    std::ofstream f(tmp_dir + "/" + name);
    f << j.dump(2) << "\n";
    if (!f) fail(tmp_dir + "/" + name, "cannot write");
  }
  commit_dir(tmp_dir, step_dir);  // fsyncs every file first
  const fs::path step(step_dir);
  write_text_durably((step.parent_path() / "latest").string(), step.filename().string() + "\n");
}

void keep_last(const std::string& ckpt_root, int64_t keep) {
  if (keep <= 0) return;
  static const std::regex step_re(R"(step_(\d+))");
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(ckpt_root)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, step_re)) steps.push_back({std::stoll(m[1]), e.path()});
  }
  std::sort(steps.rbegin(), steps.rend());
  for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) fs::remove_all(steps[i].second);
}

bool is_sharded(const std::string& dir) { return fs::exists(fs::path(dir) / "index.json"); }

std::string resolve_checkpoint(const std::string& path) {
  const fs::path p(path);
  if (!fs::is_directory(p)) fail(path, "is not a directory");
  if (fs::exists(p / "index.json") || fs::exists(p / "model.safetensors")) return path;
  for (const fs::path& latest : {p / "ckpt" / "latest", p / "latest"}) {
    if (!fs::exists(latest)) continue;
    std::ifstream f(latest);
    std::string name;
    std::getline(f, name);
    if (name.empty() || name.find('/') != std::string::npos) fail(latest.string(), "does not name a step directory");
    const fs::path step = latest.parent_path() / name;
    if (!fs::exists(step / "index.json")) fail(latest.string(), "names " + step.string() + ", which holds no index.json");
    return step.string();
  }
  fail(path, "is no checkpoint: no index.json, and no ckpt/latest naming one");
}

json read_index(const std::string& step_dir) {
  const std::string path = step_dir + "/index.json";
  json j;
  try {
    j = read_json_no_duplicates(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("checkpoint: ") + e.what());
  }
  if (!j.is_object()) fail(path, "is not a JSON object");
  if (!j.contains("format") || j["format"] != kIndexFormat)
    fail(path, "field 'format' is " + (j.contains("format") ? j["format"].dump() : std::string("missing")) +
                   "; this shardlm reads \"" + kIndexFormat + "\"");
  const int64_t world = int_field(j, "world_size", path, "the index");
  if (world < 1 || world > kMaxWorld)
    fail(path, "field 'world_size' is " + std::to_string(world) + "; a checkpoint is saved by 1 to " +
                   std::to_string(kMaxWorld) + " ranks");
  if (!j.contains("files") || !j["files"].is_array() || static_cast<int64_t>(j["files"].size()) != world)
    fail(path, "'files' must list world_size (" + std::to_string(world) + ") files");
  for (int64_t r = 0; r < world; ++r) {
    const json& file = j["files"][r];
    if (!file.is_object() || !file.contains("name") || !file["name"].is_string() || !file.contains("xxh64") ||
        !file["xxh64"].is_string())
      fail(path, "each of 'files' needs 'name', 'bytes' and 'xxh64'");
    // Rank r's file has its fixed name: nothing else in (or outside) the directory is read.
    const std::string want = rank_file_name(static_cast<int>(r), static_cast<int>(world));
    if (file["name"] != want)
      fail(path, "files[" + std::to_string(r) + "] field 'name' is " + file["name"].dump() + "; rank " +
                     std::to_string(r) + " of " + std::to_string(world) + " writes " + want);
    int_field(file, "bytes", path, "file " + want);
  }
  // "layout" (each tensor group's split; absent from checkpoints written before it) informs;
  // the ranges of "tensors" are what loads. Its shape is still checked.
  if (j.contains("layout")) {
    if (!j["layout"].is_object()) fail(path, "'layout' must be an object");
    for (const auto& [group, kinds] : j["layout"].items()) {
      if (!kinds.is_object()) fail(path, "layout '" + group + "' must be an object");
      for (const auto& [kind, split] : kinds.items())
        if (!split.is_object() || !split.contains("parts") || !split["parts"].is_number_integer() || split["parts"].get<int64_t>() < 1)
          fail(path, "layout '" + group + "' " + kind + " needs 'parts' as an integer >= 1");
    }
  }
  if (!j.contains("tensors") || !j["tensors"].is_object()) fail(path, "has no 'tensors' object");
  for (const auto& [name, t] : j["tensors"].items()) {
    if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array() || t.value("dtype", "") != "F32")
      fail(path, "tensor " + name + " needs 'shape' and dtype F32");
    for (const auto& d : t["shape"])
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 40))
        fail(path, "tensor " + name + ": shape " + t["shape"].dump() + " must hold integers >= 0");
    for (int k = 0; k < kNumKinds; ++k) {
      const char* kn = kind_name(Kind(k));
      if (!t.contains(kn)) continue;
      if (!t[kn].is_array()) fail(path, "tensor " + name + ": '" + kn + "' must be a list of ranges");
      for (const auto& piece : t[kn]) {
        const std::string where = "tensor " + name + " " + kn + " range";
        const int64_t file = int_field(piece, "file", path, where);
        if (file >= world || int_field(piece, "begin", path, where) >= int_field(piece, "end", path, where))
          fail(path, where + " " + piece.dump() + " names no file or is empty");
      }
    }
  }
  return j;
}

std::pair<int64_t, int64_t> index_tensor_count(const json& index) {
  int64_t tensors = 0, elements = 0;
  for (const auto& [name, t] : index["tensors"].items()) {
    int64_t n = 1;
    for (const auto& d : t["shape"]) n *= d.get<int64_t>();
    tensors += 1, elements += n;
  }
  return {tensors, elements};
}

void verify_file(const std::string& step_dir, const json& index, int file) {
  const json& jf = index["files"][file];
  const std::string path = step_dir + "/" + jf["name"].get<std::string>();
  if (!fs::exists(path)) fail(path, "is missing (index.json lists it)");
  const uint64_t want_bytes = jf["bytes"].get<uint64_t>(), have_bytes = fs::file_size(path);
  if (have_bytes != want_bytes)
    fail(path, "holds " + std::to_string(have_bytes) + " bytes but index.json says " + std::to_string(want_bytes) +
                   (have_bytes < want_bytes ? " (truncated)" : ""));
  const FileSummary s = summarize_file(path);
  if (hex64(s.xxh64) != jf["xxh64"].get<std::string>())
    fail(path, "checksum xxh64 " + hex64(s.xxh64) + " differs from index.json's " + jf["xxh64"].get<std::string>() +
                   " (the file is corrupt)");
  const SafetensorsFile f(path);
  std::map<std::string, int64_t> want;
  for (const auto& [name, t] : index["tensors"].items())
    for (int k = 0; k < kNumKinds; ++k)
      if (t.contains(kind_name(Kind(k))))
        for (const auto& piece : t[kind_name(Kind(k))])
          if (piece["file"] == file) want[slice_name(k, name)] = piece["end"].get<int64_t>() - piece["begin"].get<int64_t>();
  const auto names = f.names();
  for (const auto& n : names)
    if (!want.count(n)) fail(path, "holds " + n + ", which index.json does not place in this file");
  for (const auto& [n, count] : want) {
    if (!f.has(n)) fail(path, "lacks " + n + ", which index.json places in this file");
    if (f.info(n).dtype != StDType::F32 || f.info(n).numel() != count)
      fail(path, n + " holds " + std::to_string(f.info(n).numel()) + " elements but index.json's range has " +
                     std::to_string(count));
  }
}

void check_index_against_model(const std::string& step_dir, const json& index, const model::ModelDesc& desc,
                               bool optimizer) {
  const std::string path = step_dir + "/index.json";
  for (const auto& unit : desc.units)
    for (const auto& p : unit.params) {
      if (!index["tensors"].contains(p.name)) fail(path, "has no tensor " + p.name + ", which the model has");
      const json& t = index["tensors"][p.name];
      if (t["shape"].get<std::vector<int64_t>>() != p.exported_shape())
        fail(path, "tensor " + p.name + " has shape " + t["shape"].dump() + " but the model's is " +
                       json(p.exported_shape()).dump());
      for (int k = 0; k < (optimizer ? kNumKinds : 1); ++k) {
        const char* kn = kind_name(Kind(k));
        int64_t at = 0;
        if (t.contains(kn))
          for (const auto& piece : t[kn]) {
            if (piece["begin"].get<int64_t>() != at) break;
            at = piece["end"].get<int64_t>();
          }
        if (at != p.exported_numel())
          fail(path, "the ranges of " + std::string(kn) + "/" + p.name + " do not cover its " +
                         std::to_string(p.exported_numel()) + " elements exactly once");
      }
    }
}

void verify_checkpoint(const std::string& step_dir, const json& index, const model::ModelDesc& desc, bool optimizer,
                       int first, int stride) {
  for (int f = first; f < index["world_size"].get<int>(); f += stride) verify_file(step_dir, index, f);
  check_index_against_model(step_dir, index, desc, optimizer);
}

void fill_rank(const json& index, const model::ModelDesc& desc, const ShardedLayout& L, int rank, const RankBuffers& bufs,
               const SliceSource& source, bool zero_first) {
  for (int k = 0; k < kNumKinds; ++k) {
    if (!bufs[k]) continue;
    for (size_t u = 0; u < desc.units.size(); ++u) {
      const Held h = held(L, k, rank, static_cast<int>(u), bufs[k]);
      if (zero_first) std::fill(h.data, h.data + (h.hi - h.lo), 0.0f);  // padding
      for_each_slice(desc.units[u], h, [&](const model::ParamSpec& p, int64_t a, int64_t b, float* dst) {
        for (const auto& piece : index["tensors"][p.name][kind_name(Kind(k))]) {
          const int64_t pb = piece["begin"].get<int64_t>(), pe = piece["end"].get<int64_t>();
          const int64_t lo = std::max(a, pb), hi = std::min(b, pe);
          if (lo >= hi) continue;
          const int64_t file = piece["file"].get<int64_t>();
          const std::string name = slice_name(k, p.name);
          const float* slice = source.data(file, name);
          if (!slice) continue;
          const float* src = slice + (lo - pb);
          float* out = dst + (lo - a);
          std::memcpy(out, src, sizeof(float) * (hi - lo));
          for (int64_t i = 0; i < hi - lo; ++i)
            if (!std::isfinite(out[i]))
              fail(source.where(file), "tensor '" + p.name + "' (" + name + ") holds a non-finite value (" +
                                           std::to_string(out[i]) + " at element " + std::to_string(lo - pb + i) + ")");
        }
      });
    }
  }
}

std::vector<int64_t> files_needed(const json& index, const model::ModelDesc& desc, const ShardedLayout& L, int rank) {
  std::set<int64_t> files;
  for (int k = 0; k < kNumKinds; ++k)
    for (size_t u = 0; u < desc.units.size(); ++u)
      for_each_slice(desc.units[u], held(L, k, rank, static_cast<int>(u), nullptr),
                     [&](const model::ParamSpec& p, int64_t a, int64_t b, const float*) {
                       for (const auto& piece : index["tensors"][p.name][kind_name(Kind(k))])
                         if (std::max(a, piece["begin"].get<int64_t>()) < std::min(b, piece["end"].get<int64_t>()))
                           files.insert(piece["file"].get<int64_t>());
                     });
  return {files.begin(), files.end()};
}

std::map<std::string, const float*> rank_slices(const model::ModelDesc& desc, const ShardedLayout& L, int rank,
                                               const RankBuffers& bufs) {
  std::map<std::string, const float*> out;
  for (int k = 0; k < kNumKinds; ++k)
    for (size_t u = 0; u < desc.units.size(); ++u)
      if (bufs[k] && L.kinds[k][u].writes[rank])
        for_each_slice(desc.units[u], held(L, k, rank, static_cast<int>(u), bufs[k]),
                       [&](const model::ParamSpec& p, int64_t, int64_t, const float* data) {
                         out[slice_name(k, p.name)] = data;
                       });
  return out;
}

void load_rank(const std::string& step_dir, const json& index, const model::ModelDesc& desc, const ShardedLayout& L,
               int rank, const RankBuffers& bufs) {
  // Files opened on first use: a rank maps only what it reads.
  struct Files final : SliceSource {
    const std::string& dir;
    const json& index;
    mutable std::map<int64_t, SafetensorsFile> open;
    Files(const std::string& d, const json& i) : dir(d), index(i) {}
    const SafetensorsFile& file(int64_t i) const {
      auto it = open.find(i);
      if (it == open.end()) it = open.emplace(i, SafetensorsFile(dir + "/" + index["files"][i]["name"].get<std::string>())).first;
      return it->second;
    }
    const float* data(int64_t i, const std::string& name) const override {
      return static_cast<const float*>(file(i).data(name));
    }
    std::string where(int64_t i) const override { return file(i).path(); }
  } files(step_dir, index);
  fill_rank(index, desc, L, rank, bufs, files, true);
}

}  // namespace shardlm::ckpt
