#include "ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "ckpt/json_no_duplicates.h"
#include "files/replace_file.h"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this code maps it as is");

namespace shardlm::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct DTypeRow {
  StDType t;
  const char* name;
  int size;
};

constexpr DTypeRow kDTypes[] = {
    {StDType::BOOL, "BOOL", 1},       {StDType::U8, "U8", 1},   {StDType::I8, "I8", 1},
    {StDType::F8_E5M2, "F8_E5M2", 1}, {StDType::F8_E4M3, "F8_E4M3", 1},
    {StDType::I16, "I16", 2},         {StDType::U16, "U16", 2}, {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2},       {StDType::I32, "I32", 4}, {StDType::U32, "U32", 4},
    {StDType::F32, "F32", 4},         {StDType::F64, "F64", 8}, {StDType::I64, "I64", 8},
    {StDType::U64, "U64", 8},
};

const DTypeRow* find_dtype(const std::string& name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return &r;
  return nullptr;
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

std::string errno_text() { return std::strerror(errno); }

// numel of a shape, or -1 if a dimension is negative or the product overflows int64.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // inf / nan
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // zero
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    const ssize_t w = ::write(fd, c, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error("safetensors: " + path + ": write failed: " + errno_text());
    }
    c += w;
    n -= size_t(w);
  }
}

// fsync a file or directory by path; throws std::runtime_error with `what` as prefix.
void fsync_path(const std::string& path, bool directory, const std::string& what) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(what + ": cannot open " + path + " to sync: " + errno_text());
  const int rc = ::fsync(fd);
  const std::string err = errno_text();
  ::close(fd);
  if (rc != 0) throw std::runtime_error(what + ": fsync " + path + " failed: " + err);
}

std::string parent_dir(const std::string& path) {
  fs::path p = fs::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

// The data section must be the tensors and nothing else, as the format's reference reader
// demands: in offset order they start at 0, each where the one before ends (no gap, no overlap),
// and the last ends at the end of the file. Returns what is wrong ("" if nothing).
std::string layout_error(std::vector<std::pair<std::string, const TensorInfo*>> ranges, uint64_t data_bytes) {
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) {
    if (a.second->offset != b.second->offset) return a.second->offset < b.second->offset;
    return a.second->bytes < b.second->bytes;
  });
  uint64_t end = 0;
  std::string last;
  for (const auto& [name, info] : ranges) {
    if (info->offset < end) return "tensor '" + name + "' overlaps tensor '" + last + "' in the data section";
    if (info->offset > end)
      return "data bytes [" + std::to_string(end) + ", " + std::to_string(info->offset) + ") " +
             (last.empty() ? "before the first tensor '" + name + "'" : "between tensors '" + last + "' and '" + name + "'") +
             " belong to no tensor";
    end = info->offset + info->bytes;
    last = name;
  }
  if (end != data_bytes)
    return std::to_string(data_bytes - end) + " bytes after " + (last.empty() ? "the header" : "the last tensor '" + last + "'") +
           " belong to no tensor (the file has " + std::to_string(data_bytes) + " data bytes, the tensors " +
           std::to_string(end) + ")";
  return "";
}

}  // namespace

const char* st_dtype_name(StDType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.name;
  return "?";
}

bool st_dtype_known(const std::string& name) { return find_dtype(name) != nullptr; }

StDType st_dtype_from_name(const std::string& name) {
  const DTypeRow* r = find_dtype(name);
  if (!r) throw std::invalid_argument("safetensors: unknown dtype '" + name + "'");
  return r->t;
}

int st_dtype_size(StDType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.size;
  return 0;
}

StDType to_st_dtype(DType t) {
  switch (t) {
    case DType::fp32: return StDType::F32;
    case DType::bf16: return StDType::BF16;
    case DType::fp16: return StDType::F16;
    case DType::int8: return StDType::I8;
  }
  throw std::invalid_argument("safetensors: no safetensors dtype for this DType");
}

int64_t TensorInfo::numel() const { return checked_numel(shape); }

// ---------------------------------------------------------------- writer

void SafetensorsWriter::add(const std::string& name, StDType dtype,
                            const std::vector<int64_t>& shape, const void* data, size_t bytes) {
  if (name.empty() || name == "__metadata__")
    throw std::invalid_argument("safetensors: invalid tensor name '" + name + "'");
  for (const auto& e : entries_)
    if (e.name == name) throw std::invalid_argument("safetensors: tensor '" + name + "' added twice");
  const int64_t n = checked_numel(shape);
  if (n < 0)
    throw std::invalid_argument("safetensors: tensor '" + name + "': bad shape " + shape_str(shape));
  const uint64_t want = uint64_t(n) * uint64_t(st_dtype_size(dtype));
  if (want != bytes)
    throw std::invalid_argument("safetensors: tensor '" + name + "': shape " + shape_str(shape) +
                                " of " + st_dtype_name(dtype) + " needs " + std::to_string(want) +
                                " bytes, got " + std::to_string(bytes));
  if (bytes > 0 && data == nullptr)
    throw std::invalid_argument("safetensors: tensor '" + name + "': null data");
  entries_.push_back(Entry{name, dtype, shape, data, bytes});
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype,
                            const std::vector<int64_t>& shape, const void* data, size_t bytes) {
  add(name, st_dtype_from_name(dtype), shape, data, bytes);
}

void SafetensorsWriter::add(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const void* data, size_t bytes) {
  add(name, to_st_dtype(dtype), shape, data, bytes);
}

void SafetensorsWriter::add_f32(const std::string& name, const std::vector<int64_t>& shape,
                                const float* data) {
  const int64_t n = checked_numel(shape);
  if (n < 0)
    throw std::invalid_argument("safetensors: tensor '" + name + "': bad shape " + shape_str(shape));
  add(name, StDType::F32, shape, data, size_t(n) * 4);
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::ordered() const {
  std::vector<const Entry*> v;
  for (const auto& e : entries_) v.push_back(&e);
  std::sort(v.begin(), v.end(), [](const Entry* a, const Entry* b) {
    const int sa = st_dtype_size(a->dtype), sb = st_dtype_size(b->dtype);
    if (sa != sb) return sa > sb;
    return a->name < b->name;
  });
  return v;
}

std::string SafetensorsWriter::header_json() const {
  json h = json::object();
  if (!metadata_.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t off = 0;
  for (const Entry* e : ordered()) {
    h[e->name] = {{"dtype", st_dtype_name(e->dtype)},
                  {"shape", e->shape},
                  {"data_offsets", {off, off + e->bytes}}};
    off += e->bytes;
  }
  return h.dump();
}

namespace {
// Where a file's bytes go: straight to `fd`, each piece handed to the kernel's writeback as soon
// as it is written (dirty pages never pile up into one burst at the fsync), or, with a block
// buffer, gathered into it and written a whole block at a time with O_DIRECT; the last block is
// padded to the 4096-byte granule and the file cut back to its length.
class FileSink {
 public:
  FileSink(int fd, std::string path, SafetensorsWriter::BlockBuffer block) : fd_(fd), path_(std::move(path)), block_(block) {}
  void put(const char* c, size_t n) {
    if (!block_.data) {
      write_all(fd_, c, n, path_);
      ::sync_file_range(fd_, static_cast<off_t>(written_), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
      written_ += n;
      return;
    }
    while (n > 0) {
      const size_t k = std::min(n, block_.bytes - fill_);
      std::memcpy(block_.data + fill_, c, k);
      fill_ += k, c += k, n -= k, written_ += k;
      if (fill_ == block_.bytes) flush(fill_);
    }
  }
  void finish() {
    if (!block_.data || fill_ == 0) return;
    const size_t padded = (fill_ + kGranule - 1) / kGranule * kGranule;
    std::memset(block_.data + fill_, 0, padded - fill_);
    flush(padded);
    if (::ftruncate(fd_, static_cast<off_t>(written_)) != 0)
      throw std::runtime_error("safetensors: " + path_ + ": truncate failed: " + errno_text());
  }
  static constexpr size_t kGranule = 4096;

 private:
  void flush(size_t bytes) {
    write_all(fd_, block_.data, bytes, path_);
    fill_ = 0;
  }
  int fd_;
  std::string path_;
  SafetensorsWriter::BlockBuffer block_;
  size_t fill_ = 0;
  uint64_t written_ = 0;
};

bool usable_block(SafetensorsWriter::BlockBuffer b) {
  return b.data && b.bytes > 0 && b.bytes % FileSink::kGranule == 0 &&
         reinterpret_cast<uintptr_t>(b.data) % FileSink::kGranule == 0;
}
}  // namespace

void SafetensorsWriter::write(const std::string& path, const Progress& progress, BlockBuffer direct) const {
  std::string header = header_json();
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');
  const uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)((n >> (8 * i)) & 0xff);

  std::string tmp;
  if (direct.data && !usable_block(direct)) throw std::logic_error("SafetensorsWriter::write: block buffer not 4096-byte aligned");
  int fd = direct.data ? files::create_temporary(path, tmp, O_WRONLY | O_DIRECT) : -1;
  if (fd < 0) {  // no block buffer, or a file system without O_DIRECT
    direct = {};
    fd = files::create_temporary(path, tmp, O_WRONLY);
  }
  if (fd < 0) throw std::runtime_error("safetensors: " + path + ": cannot create " + tmp + ": " + errno_text());
  try {
    uint64_t written = 0, total = 8 + header.size();
    for (const Entry& e : entries_) total += e.bytes;
    FileSink sink(fd, path, direct);
    // Pieces of at most kPiece bytes, so that a paced writer's progress comes in steps small
    // enough to pace.
    constexpr size_t kPiece = size_t{8} << 20;
    auto put = [&](const void* p, size_t n) {
      for (const char* c = static_cast<const char*>(p); n > 0;) {
        const size_t k = std::min(n, kPiece);
        sink.put(c, k);
        if (progress) progress(c, k, written += k, total);
        c += k;
        n -= k;
      }
    };
    put(len, 8);
    put(header.data(), header.size());
    for (const Entry* e : ordered()) put(e->data, e->bytes);
    sink.finish();
    if (::fsync(fd) != 0) throw std::runtime_error("safetensors: " + path + ": fsync failed: " + errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp.c_str());
    throw std::runtime_error("safetensors: " + path + ": close failed: " + err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp.c_str());
    throw std::runtime_error("safetensors: " + path + ": rename from " + tmp + " failed: " + err);
  }
  fsync_path(parent_dir(path), true, "safetensors: " + path);
}

// ---------------------------------------------------------------- reader

SafetensorsFile::~SafetensorsFile() { close(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    close();
    path_ = std::move(o.path_);
    base_ = std::exchange(o.base_, nullptr);
    file_bytes_ = std::exchange(o.file_bytes_, 0);
    data_start_ = std::exchange(o.data_start_, nullptr);
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
    o.path_.clear();
    o.tensors_.clear();
    o.metadata_.clear();
  }
  return *this;
}

void SafetensorsFile::close() {
  if (base_) ::munmap(base_, file_bytes_);
  base_ = nullptr;
  file_bytes_ = 0;
  data_start_ = nullptr;
  path_.clear();
  tensors_.clear();
  metadata_.clear();
}

void SafetensorsFile::fail(const std::string& what) const {
  throw std::runtime_error("safetensors: " + path_ + ": " + one_line(what));
}

void SafetensorsFile::open(const std::string& path) {
  close();
  path_ = path;
  try {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open: " + errno_text());
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const std::string err = errno_text();
      ::close(fd);
      fail("cannot stat: " + err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("not a regular file");
    }
    const uint64_t size = uint64_t(st.st_size);
    if (size < 8) {
      ::close(fd);
      fail("too short (" + std::to_string(size) + " bytes) to hold the 8-byte header length");
    }
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const std::string err = errno_text();
    ::close(fd);
    if (p == MAP_FAILED) fail("mmap failed: " + err);
    base_ = p;
    file_bytes_ = size;

    const auto* bytes = static_cast<const unsigned char*>(base_);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(bytes[i]) << (8 * i);
    if (n > size - 8)
      fail("header length " + std::to_string(n) + " runs past the end of the file (" +
           std::to_string(size) + " bytes)");
    data_start_ = bytes + 8 + n;
    const uint64_t data_bytes = size - 8 - n;

    json h;
    try {
      h = parse_json_no_duplicates({reinterpret_cast<const char*>(bytes + 8), n});
    } catch (const std::exception& e) {
      fail(std::string("bad JSON header: ") + e.what());
    }
    if (!h.is_object()) fail("header is not a JSON object");

    std::vector<std::pair<std::string, const TensorInfo*>> ranges;
    for (auto it = h.begin(); it != h.end(); ++it) {
      const std::string& name = it.key();
      const json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) fail("__metadata__ is not a JSON object");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string()) fail("__metadata__ value of '" + m.key() + "' is not a string");
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const std::string where = "tensor '" + name + "': ";
      if (!v.is_object()) fail(where + "entry is not a JSON object");
      if (!v.contains("dtype") || !v["dtype"].is_string()) fail(where + "missing or non-string dtype");
      const std::string dt = v["dtype"].get<std::string>();
      const DTypeRow* row = find_dtype(dt);
      if (!row) fail(where + "unknown dtype '" + dt + "'");
      if (!v.contains("shape") || !v["shape"].is_array()) fail(where + "missing or non-array shape");
      TensorInfo info;
      info.dtype = row->t;
      for (const json& d : v["shape"]) {
        if (!d.is_number_unsigned()) fail(where + "shape holds a value that is not a non-negative integer");
        const uint64_t u = d.get<uint64_t>();
        if (u > uint64_t(std::numeric_limits<int64_t>::max())) fail(where + "shape dimension too large");
        info.shape.push_back(int64_t(u));
      }
      const int64_t numel = checked_numel(info.shape);
      if (numel < 0) fail(where + "shape " + shape_str(info.shape) + " overflows");
      if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2 ||
          !v["data_offsets"][0].is_number_unsigned() || !v["data_offsets"][1].is_number_unsigned())
        fail(where + "data_offsets must be two non-negative integers");
      const uint64_t begin = v["data_offsets"][0].get<uint64_t>();
      const uint64_t end = v["data_offsets"][1].get<uint64_t>();
      if (begin > end)
        fail(where + "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] are reversed");
      if (end > data_bytes)
        fail(where + "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
             "] run past the data section (" + std::to_string(data_bytes) + " bytes)");
      info.offset = begin;
      info.bytes = end - begin;
      if (uint64_t(numel) > std::numeric_limits<uint64_t>::max() / uint64_t(row->size) ||
          uint64_t(numel) * uint64_t(row->size) != info.bytes)
        fail(where + "shape " + shape_str(info.shape) + " of " + dt + " needs " +
             std::to_string(uint64_t(numel) * uint64_t(row->size)) + " bytes but data_offsets span " +
             std::to_string(info.bytes));
      auto [pos, inserted] = tensors_.emplace(name, std::move(info));
      ranges.emplace_back(name, &pos->second);
    }
    if (const std::string e = layout_error(std::move(ranges), data_bytes); !e.empty()) fail(e);
  } catch (...) {
    const bool mapped = base_ != nullptr;
    if (mapped) ::munmap(base_, file_bytes_);
    base_ = nullptr;
    file_bytes_ = 0;
    data_start_ = nullptr;
    path_.clear();
    tensors_.clear();
    metadata_.clear();
    throw;
  }
}

bool SafetensorsFile::has(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    if (!base_) throw std::runtime_error("safetensors: no file open (looking for tensor '" + name + "')");
    fail("no tensor '" + name + "'");
  }
  return it->second;
}

const void* SafetensorsFile::data(const std::string& name) const {
  return data_start_ + info(name).offset;
}

void SafetensorsFile::read_f32(const std::string& name, float* dst, int64_t expected_numel) const {
  const TensorInfo& ti = info(name);
  const int64_t n = ti.numel();
  if (n != expected_numel)
    fail("tensor '" + name + "': holds " + std::to_string(n) + " elements (shape " + shape_str(ti.shape) +
         "), expected " + std::to_string(expected_numel));
  const unsigned char* src = data_start_ + ti.offset;
  switch (ti.dtype) {
    case StDType::F32:
      if (n > 0) std::memcpy(dst, src, size_t(n) * 4);
      break;
    case StDType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = std::bit_cast<float>(uint32_t(h) << 16);
      }
      break;
    case StDType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      break;
    default:
      fail("tensor '" + name + "': dtype " + st_dtype_name(ti.dtype) + " cannot be read as fp32");
  }
}

void SafetensorsFile::read_f32(const std::string& name, float* dst,
                               const std::vector<int64_t>& expected_shape) const {
  const TensorInfo& ti = info(name);
  if (ti.shape != expected_shape)
    fail("tensor '" + name + "': shape " + shape_str(ti.shape) + ", expected " + shape_str(expected_shape));
  read_f32(name, dst, checked_numel(expected_shape));
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::pair<uint64_t, std::string>> v;
  for (const auto& [name, ti] : tensors_) v.emplace_back(ti.offset, name);
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& [off, name] : v) out.push_back(std::move(name));
  return out;
}

// ---------------------------------------------------------------- atomic directories

namespace {

// fsync every regular file and directory under (and including) `dir`.
void sync_tree(const fs::path& dir, const std::string& what) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_symlink()) continue;
    if (e.is_regular_file()) fsync_path(e.path().string(), false, what);
    else if (e.is_directory()) fsync_path(e.path().string(), true, what);
  }
  fsync_path(dir.string(), true, what);
}

}  // namespace

namespace {

std::string without_trailing_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// A fresh directory "<final_dir>.tmp-<pid>-<n>" beside `final_dir`, the first n whose name no
// one has: nothing already there is ever removed to make room for it. Made by mkdir, so the
// umask decides its mode as for any directory the user creates.
std::string make_temporary_dir(const std::string& final_dir, const std::string& what) {
  const std::string stem = final_dir + ".tmp-" + std::to_string(::getpid()) + "-";
  for (int n = 0;; ++n) {
    const std::string name = stem + std::to_string(n);
    if (::mkdir(name.c_str(), 0777) == 0) return name;
    if (errno != EEXIST) throw std::runtime_error(what + ": cannot create " + name + ": " + errno_text());
  }
}

}  // namespace

void write_dir_atomically(const std::string& final_dir_in, const std::function<void(const std::string& tmp_dir)>& fill,
                          OnExisting existing) {
  const std::string final_dir = without_trailing_slashes(final_dir_in);
  const std::string what = "write_dir_atomically: " + final_dir;
  if (final_dir.empty()) throw std::runtime_error("write_dir_atomically: empty directory name");
  std::string tmp;
  try {
    if (fs::exists(final_dir) && !fs::is_directory(final_dir))
      throw std::runtime_error(what + ": exists and is not a directory");
    fs::create_directories(parent_dir(final_dir));
    tmp = make_temporary_dir(final_dir, what);
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(what + ": " + one_line(e.what()));
  }
  try {
    fill(tmp);
    commit_dir(tmp, final_dir, existing);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

void commit_dir(const std::string& tmp, const std::string& final_dir_in, OnExisting existing) {
  const std::string final_dir = without_trailing_slashes(final_dir_in);
  const std::string what = "commit_dir: " + final_dir;
  const std::string parent = parent_dir(final_dir);
  try {
    sync_tree(tmp, what);
    if (existing == OnExisting::refuse) {
      // rename(2) moves a directory onto an absent name or an empty directory only: whatever
      // else is there now (created since the caller looked) stays as it is.
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
        if (errno == ENOTEMPTY || errno == EEXIST)
          throw std::runtime_error(final_dir + ": exists and is not an empty directory; nothing was replaced");
        throw std::runtime_error(what + ": cannot rename " + tmp + " into place: " + errno_text());
      }
      fsync_path(parent, true, what);
      return;
    }
    if (!fs::exists(final_dir)) {
      fs::rename(tmp, final_dir);
      fsync_path(parent, true, what);
      return;
    }
    // Swap the two names in one step; afterwards `tmp` holds the old directory.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_path(parent, true, what);
      fs::remove_all(tmp);
      fsync_path(parent, true, what);
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      throw std::runtime_error(what + ": exchanging with " + tmp + " failed: " + errno_text());
    // No atomic exchange here: move the old one aside first. A crash between the two renames
    // leaves the final name absent and the old directory complete under `old`. A directory
    // already named `old` (a crashed process's of the same pid) is never removed: the rename
    // replaces it only when empty, else fails.
    const std::string old = final_dir + ".old-" + std::to_string(::getpid());
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fsync_path(parent, true, what);
    fs::remove_all(old);
    fsync_path(parent, true, what);
  } catch (const fs::filesystem_error& e) {
    throw std::runtime_error(what + ": " + one_line(e.what()));
  }
}

void fsync_dir(const std::string& dir) { fsync_path(dir, true, "fsync_dir: " + dir); }

}  // namespace shardlm::ckpt
