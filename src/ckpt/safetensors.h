// safetensors files (the Hugging Face weights format) and atomic checkpoint directories.
//
// Layout of a file: 8-byte little-endian header length N; N bytes of JSON, padded with spaces
// so that 8 + N is a multiple of 8; then the raw little-endian tensor data. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} with offsets relative to the
// start of the data, plus an optional "__metadata__" object of string -> string.
//
// Every error is a std::runtime_error whose message is one line starting with
// "safetensors: <path>: " (and naming the tensor where one is involved).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tensor/dtype.h"

namespace shardlm::ckpt {

// The element types of the safetensors format (names as they appear in the header).
enum class StDType { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

const char* st_dtype_name(StDType t);
// Throws std::invalid_argument for a name the format does not define.
StDType st_dtype_from_name(const std::string& name);
bool st_dtype_known(const std::string& name);
int st_dtype_size(StDType t);
// The engine's dtypes map onto the format's: fp32 -> F32, bf16 -> BF16, fp16 -> F16, int8 -> I8.
StDType to_st_dtype(DType t);

struct TensorInfo {
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;   // numel × element size
  uint64_t offset = 0;  // begin, relative to the data section
  int64_t numel() const;
};

// An aligned block buffer SafetensorsWriter::write may send a file through (see there).
struct WriteBlock {
  char* data = nullptr;
  size_t bytes = 0;
};

// Collects tensors and writes them as one file. add() does NOT copy: `data` must stay valid
// until write() returns. Tensors are laid out by decreasing element size, then by name (as the
// reference implementation does), so every tensor is aligned to its element size in a
// mapped file.
class SafetensorsWriter {
 public:
  // `bytes` must equal numel(shape) × element size; a name may be added once.
  // All throw std::invalid_argument on a bad name, dtype, shape or size.
  void add(const std::string& name, StDType dtype, const std::vector<int64_t>& shape,
           const void* data, size_t bytes);
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
           const void* data, size_t bytes);
  void add(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
           const void* data, size_t bytes);
  // Shorthand for F32 tensors: bytes = 4 × numel(shape).
  void add_f32(const std::string& name, const std::vector<int64_t>& shape, const float* data);
  void set_metadata(const std::string& key, const std::string& value);

  // Writes to a temporary file of its own beside `path` (files/replace_file.h), fsyncs, then
  // renames it over `path`: a reader never sees a half-written file under the final name. Throws std::runtime_error naming the path on an I/O failure.
  // `progress(piece, bytes, written, total)`, when given, is called after each piece of the file
  // is written — the length, the header, each tensor's data in pieces of at most 8 MiB — with that piece, in file order: a
  // checksum of the file as it is written, or fault injection (an exception from it removes the
  // temporary like an I/O failure).
  // `direct`, when given (4096-byte aligned, a multiple of 4096 bytes), is a block buffer through
  // which the file is written with O_DIRECT: the bytes go from it to the disk without a copy into
  // the page cache, which is most of a buffered write's CPU time. A file system without O_DIRECT
  // (tmpfs) gets a buffered write. The file's bytes are the same either way.
  using Progress = std::function<void(const void* piece, size_t bytes, uint64_t written, uint64_t total)>;
  using BlockBuffer = WriteBlock;
  void write(const std::string& path, const Progress& progress = {}, BlockBuffer direct = {}) const;

  // The header JSON (unpadded) that write() would produce; for tests and debugging.
  std::string header_json() const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t bytes;
  };
  std::vector<const Entry*> ordered() const;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A read-only memory map of a safetensors file, validated when opened. Move-only.
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  explicit SafetensorsFile(const std::string& path) { open(path); }
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Maps and validates the file; closes any file opened before.
  void open(const std::string& path);
  void close();
  bool is_open() const { return base_ != nullptr; }
  const std::string& path() const { return path_; }

  bool has(const std::string& name) const;
  // Throws std::runtime_error naming the file and tensor if absent.
  const TensorInfo& info(const std::string& name) const;
  const void* data(const std::string& name) const;
  // Copies tensor `name` into dst as fp32 (F32 as is; BF16 and F16 are widened). Throws unless
  // the tensor exists, has that dtype family and holds exactly `expected_numel` elements.
  void read_f32(const std::string& name, float* dst, int64_t expected_numel) const;
  // Also checks the shape.
  void read_f32(const std::string& name, float* dst, const std::vector<int64_t>& expected_shape) const;
  // Names in the order of their data offsets.
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;
  std::string path_;
  void* base_ = nullptr;
  size_t file_bytes_ = 0;
  const unsigned char* data_start_ = nullptr;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// What committing a directory does with a directory already under its final name.
//   replace: swapped out atomically, then removed (a checkpoint step rewritten, --overwrite).
//   refuse:  taken only when it is empty; anything else there fails the commit, untouched.
enum class OnExisting { replace, refuse };

// Writes a directory so that, whatever happens, `final_dir` is either absent, the complete old
// directory, or the complete new one — never half written. `fill` writes the files into a fresh
// temporary directory beside it (final_dir + ".tmp-XXXXXX", a name of its own, so nothing there
// is removed to make room); then every file and the directory are fsynced and it is moved into
// place (commit_dir). If `fill` or the commit throws, the temporary directory is removed and
// the exception propagates; the old directory is untouched.
void write_dir_atomically(const std::string& final_dir,
                          const std::function<void(const std::string& tmp_dir)>& fill,
                          OnExisting existing = OnExisting::replace);

// write_dir_atomically's second half: fsyncs every file of `tmp` and `tmp` itself, then moves it
// to `final_dir`. An existing `final_dir` is replaced with an atomic exchange where the file
// system supports it, else by renaming it aside (final_dir + ".old-<pid>"), renaming the new one
// in and deleting the old; or, with OnExisting::refuse, kept (the commit fails unless it is an
// empty directory). For directories filled by several processes, which agree on `tmp` and
// finish writing before one of them commits.
void commit_dir(const std::string& tmp, const std::string& final_dir, OnExisting existing = OnExisting::replace);
// fsyncs a directory (after a rename inside it). Throws std::runtime_error naming it.
void fsync_dir(const std::string& dir);

}  // namespace shardlm::ckpt
