#include "ckpt/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using shardlm::ckpt::SafetensorsFile;
using shardlm::ckpt::SafetensorsWriter;
using shardlm::ckpt::StDType;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "shardlm_st_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (fs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string source_dir() {
  if (const char* s = std::getenv("SHARDLM_SOURCE_DIR")) return s;
  return fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

std::string python() {
  if (const char* p = std::getenv("SHARDLM_PYTHON")) return p;
  return "/usr/bin/python3";
}

// Runs a command, returns its exit status and puts stdout+stderr in *out.
int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  out->clear();
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

uint16_t bf16_bits(float f) { return uint16_t(std::bit_cast<uint32_t>(f) >> 16); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

// Whether a temporary file of PATH's writer is left beside it (PATH.tmp-PID-RANDOM).
bool temporary_left(const std::string& path) {
  const std::string prefix = fs::path(path).filename().string() + ".tmp";
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) return true;
  return false;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A raw file: 8-byte length `n` (defaults to the header's size), header, data.
std::string raw_file(const std::string& header, const std::string& data, int64_t n = -1) {
  const uint64_t len = n < 0 ? header.size() : uint64_t(n);
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char((len >> (8 * i)) & 0xff);
  return s + header + data;
}

// The message of the runtime_error `f` throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION TYPE: ") + e.what();
  }
  return "";
}

std::string open_error(const std::string& path) {
  return error_of([&] { SafetensorsFile f(path); });
}

// The content that safetensors_interop.py's expected_cpp() checks.
struct CppContent {
  std::vector<float> w;
  std::vector<int32_t> ids;
  std::vector<uint16_t> half;
  std::vector<double> d{1.0 / 3, -1e300};
  std::vector<uint8_t> bytes{0, 1, 255};
  float scalar = 7.25f;
  std::vector<float> half_f{1.0f, -2.0f, 0.15625f, std::ldexp(1.0f, 100), 0.0f, -0.5f};
  CppContent() {
    for (int i = 0; i < 24; ++i) w.push_back(float(i) * 0.5f - 3.0f);
    for (int i = -5; i < 5; ++i) ids.push_back(i);
    for (float f : half_f) half.push_back(bf16_bits(f));
  }
  void add_to(SafetensorsWriter& w_) const {
    w_.add_f32("w", {2, 3, 4}, w.data());
    w_.add("ids", "I32", {2, 5}, ids.data(), ids.size() * 4);
    w_.add("half", shardlm::DType::bf16, {6}, half.data(), half.size() * 2);
    w_.add("d", StDType::F64, {2}, d.data(), 16);
    w_.add("bytes", "U8", {3}, bytes.data(), 3);
    w_.add("scalar", StDType::F32, {}, &scalar, 4);
    w_.add("empty", StDType::F32, {0, 4}, nullptr, 0);
    w_.set_metadata("format", "pt");
    w_.set_metadata("step", "42");
  }
};

// ---------------------------------------------------------------- round trip

TEST(Safetensors, RoundTripSeveralDtypesAndMetadata) {
  TempDir dir;
  const std::string path = dir / "rt.safetensors";
  CppContent c;
  SafetensorsWriter w;
  c.add_to(w);
  w.write(path);
  EXPECT_FALSE(temporary_left(path));

  SafetensorsFile f(path);
  EXPECT_TRUE(f.is_open());
  const auto names = f.names();
  EXPECT_EQ(names.size(), 7u);
  for (const char* n : {"w", "ids", "half", "d", "bytes", "scalar", "empty"}) EXPECT_TRUE(f.has(n)) << n;
  EXPECT_FALSE(f.has("nope"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("step"), "42");

  EXPECT_EQ(f.info("w").dtype, StDType::F32);
  EXPECT_EQ(f.info("w").shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(f.info("w").bytes, 96u);
  EXPECT_EQ(f.info("ids").dtype, StDType::I32);
  EXPECT_EQ(f.info("half").dtype, StDType::BF16);
  EXPECT_EQ(f.info("scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(f.info("scalar").numel(), 1);
  EXPECT_EQ(f.info("empty").numel(), 0);
  EXPECT_EQ(f.info("empty").bytes, 0u);

  // Header padded so the data starts 8-aligned; each tensor aligned to its element size.
  const std::string raw = read_bytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(raw[i])) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  for (const auto& name : names) {
    const auto& ti = f.info(name);
    EXPECT_EQ(ti.offset % shardlm::ckpt::st_dtype_size(ti.dtype), 0u) << name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data(name)) % shardlm::ckpt::st_dtype_size(ti.dtype), 0u) << name;
  }

  std::vector<float> w2(24);
  f.read_f32("w", w2.data(), 24);
  EXPECT_EQ(w2, c.w);
  f.read_f32("w", w2.data(), std::vector<int64_t>{2, 3, 4});
  EXPECT_EQ(w2, c.w);
  EXPECT_EQ(std::memcmp(f.data("ids"), c.ids.data(), 40), 0);
  EXPECT_EQ(std::memcmp(f.data("d"), c.d.data(), 16), 0);
  EXPECT_EQ(std::memcmp(f.data("bytes"), c.bytes.data(), 3), 0);
  std::vector<float> h(6);
  f.read_f32("half", h.data(), 6);  // bf16 widened
  EXPECT_EQ(h, c.half_f);
  float s = 0;
  f.read_f32("scalar", &s, 1);
  EXPECT_EQ(s, 7.25f);
  f.read_f32("empty", nullptr, 0);

  // Move keeps the mapping valid.
  SafetensorsFile g = std::move(f);
  EXPECT_FALSE(f.is_open());
  EXPECT_TRUE(g.has("w"));
  g.read_f32("w", w2.data(), 24);
  EXPECT_EQ(w2, c.w);
}

TEST(Safetensors, WriteReplacesExistingFile) {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  std::vector<float> a{1, 2, 3}, b{4, 5};
  {
    SafetensorsWriter w;
    w.add_f32("a", {3}, a.data());
    w.write(path);
  }
  {
    SafetensorsWriter w;
    w.add_f32("b", {2}, b.data());
    w.write(path);
  }
  SafetensorsFile f(path);
  EXPECT_FALSE(f.has("a"));
  EXPECT_TRUE(f.has("b"));
  EXPECT_FALSE(temporary_left(path));
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Through an O_DIRECT block buffer the file is the buffered write's byte for byte, whether it
// ends mid-block or fills blocks exactly, spans several blocks, or lands on a file system
// without O_DIRECT (/dev/shm: written buffered); progress sees every byte once, in order.
TEST(Safetensors, DirectWriteThroughABlockBufferGivesTheSameFile) {
  TempDir dir;
  constexpr size_t kBlock = 16384;
  std::unique_ptr<char, decltype(&std::free)> block(static_cast<char*>(std::aligned_alloc(4096, kBlock)), &std::free);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{4096}, size_t{3 * kBlock}, size_t{10007}}) {
    std::vector<float> a(n), b(n / 3 + 1);
    for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i % 1013);
    for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
    SafetensorsWriter w;
    w.add_f32("a", {static_cast<int64_t>(a.size())}, a.data());
    w.add_f32("b", {static_cast<int64_t>(b.size())}, b.data());
    w.write(dir / "buffered.safetensors");
    uint64_t seen = 0;
    for (const std::string& where : {dir / "direct.safetensors", std::string("/dev/shm/shardlm_st_direct.safetensors")}) {
      seen = 0;
      w.write(where, [&](const void*, size_t k, uint64_t written, uint64_t) { EXPECT_EQ(written, seen += k); },
              {block.get(), kBlock});
      EXPECT_EQ(file_bytes(where), file_bytes(dir / "buffered.safetensors")) << n << " " << where;
      EXPECT_EQ(seen, fs::file_size(where)) << n;
      fs::remove(where);
    }
  }
  EXPECT_THROW(SafetensorsWriter().write(dir / "x.safetensors", {}, {block.get() + 8, 4096}), std::logic_error);
}

TEST(Safetensors, WriterRejectsBadInput) {
  std::vector<float> a(6);
  SafetensorsWriter w;
  EXPECT_THROW(w.add("a", "F32", {2, 3}, a.data(), 20), std::invalid_argument);  // bytes mismatch
  EXPECT_THROW(w.add("a", "F99", {2, 3}, a.data(), 24), std::invalid_argument);  // unknown dtype
  EXPECT_THROW(w.add("a", "F32", {-1, 3}, a.data(), 24), std::invalid_argument);
  EXPECT_THROW(w.add("__metadata__", "F32", {6}, a.data(), 24), std::invalid_argument);
  w.add("a", "F32", {2, 3}, a.data(), 24);
  EXPECT_THROW(w.add("a", "F32", {6}, a.data(), 24), std::invalid_argument);  // twice
  // Unwritable location: a runtime_error naming the path, and no file left behind.
  const std::string bad = "/nonexistent_dir_shardlm/x.safetensors";
  const std::string msg = error_of([&] { w.write(bad); });
  EXPECT_NE(msg.find(bad), std::string::npos) << msg;
}

// ---------------------------------------------------------------- python interop

TEST(Safetensors, PythonReadsCppFile) {
  TempDir dir;
  const std::string path = dir / "cpp.safetensors";
  CppContent c;
  SafetensorsWriter w;
  c.add_to(w);
  w.write(path);
  std::string out;
  const std::string script = source_dir() + "/tests/ckpt/safetensors_interop.py";
  const int rc = run(python() + " " + script + " check " + path, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}

TEST(Safetensors, CppReadsPythonFile) {
  TempDir dir;
  const std::string path = dir / "py.safetensors";
  std::string out;
  const std::string script = source_dir() + "/tests/ckpt/safetensors_interop.py";
  ASSERT_EQ(run(python() + " " + script + " write " + path, &out), 0) << out;

  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("source"), "python");
  EXPECT_EQ(f.metadata().at("n"), "5");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a.weight", "b", "c", "e", "k"}));  // by offset

  EXPECT_EQ(f.info("a.weight").shape, (std::vector<int64_t>{3, 4}));
  std::vector<float> a(12);
  f.read_f32("a.weight", a.data(), 12);
  for (int i = 0; i < 12; ++i) EXPECT_NEAR(a[i], -1.0 + 2.0 * i / 11.0, 1e-6) << i;

  EXPECT_EQ(f.info("b").dtype, StDType::I64);
  int64_t b[3];
  std::memcpy(b, f.data("b"), 24);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[1], -2);
  EXPECT_EQ(b[2], int64_t(1) << 40);

  std::vector<float> c(4);
  f.read_f32("c", c.data(), 4);  // F16 widened, including a subnormal
  EXPECT_EQ(c[0], 1.0f);
  EXPECT_EQ(c[1], -2.5f);
  EXPECT_EQ(c[2], 65504.0f);
  EXPECT_EQ(c[3], std::ldexp(1.0f, -24));

  std::vector<float> e(3);
  f.read_f32("e", e.data(), std::vector<int64_t>{3});
  EXPECT_EQ(e, (std::vector<float>{0.5f, -1.0f, 256.0f}));

  int8_t k[3];
  std::memcpy(k, f.data("k"), 3);
  EXPECT_EQ(k[0], -128);
  EXPECT_EQ(k[2], 127);
}

// ---------------------------------------------------------------- malformed files

// Every error is one line that names the file.
void expect_names_file(const std::string& msg, const std::string& path) {
  ASSERT_FALSE(msg.empty()) << "expected an error for " << path;
  EXPECT_EQ(msg.find("WRONG EXCEPTION"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(SafetensorsErrors, MissingFile) {
  TempDir dir;
  const std::string p = dir / "absent.safetensors";
  expect_names_file(open_error(p), p);
}

TEST(SafetensorsErrors, EmptyAndTooShort) {
  TempDir dir;
  const std::string p0 = dir / "empty.safetensors", p1 = dir / "short.safetensors";
  write_bytes(p0, "");
  write_bytes(p1, "abc");
  for (const auto& p : {p0, p1}) {
    const std::string m = open_error(p);
    expect_names_file(m, p);
    EXPECT_NE(m.find("too short"), std::string::npos) << m;
  }
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  TempDir dir;
  const std::string p = dir / "len.safetensors";
  write_bytes(p, raw_file("{}", "", 1000));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("header length"), std::string::npos) << m;
  const std::string q = dir / "huge.safetensors";
  write_bytes(q, raw_file("{}", "", int64_t(1) << 62));
  expect_names_file(open_error(q), q);
}

TEST(SafetensorsErrors, BadJson) {
  TempDir dir;
  const std::string p = dir / "json.safetensors";
  write_bytes(p, raw_file("{\"a\": {\"dtype\": \"F32\",", ""));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("JSON"), std::string::npos) << m;
  const std::string q = dir / "array.safetensors";
  write_bytes(q, raw_file("[1, 2]  ", ""));
  expect_names_file(open_error(q), q);
  const std::string r = dir / "meta.safetensors";
  write_bytes(r, raw_file("{\"__metadata__\": {\"k\": 3}}", ""));
  expect_names_file(open_error(r), r);
}

TEST(SafetensorsErrors, OffsetsOutOfRange) {
  TempDir dir;
  const std::string p = dir / "range.safetensors";
  write_bytes(p, raw_file(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", std::string(8, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("'t'"), std::string::npos) << m;
  const std::string q = dir / "reversed.safetensors";
  write_bytes(q, raw_file(R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", std::string(8, '\0')));
  expect_names_file(open_error(q), q);
  const std::string r = dir / "negative.safetensors";
  write_bytes(r, raw_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", std::string(8, '\0')));
  expect_names_file(open_error(r), r);
}

TEST(SafetensorsErrors, OverlappingOffsets) {
  TempDir dir;
  const std::string p = dir / "overlap.safetensors";
  write_bytes(p, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                          R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          std::string(12, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("overlaps"), std::string::npos) << m;
}

TEST(SafetensorsErrors, UnknownDtype) {
  TempDir dir;
  const std::string p = dir / "dtype.safetensors";
  write_bytes(p, raw_file(R"({"t": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}})", std::string(4, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("F33"), std::string::npos) << m;
  EXPECT_NE(m.find("'t'"), std::string::npos) << m;
}

TEST(SafetensorsErrors, ShapeBytesMismatch) {
  TempDir dir;
  const std::string p = dir / "shape.safetensors";
  write_bytes(p, raw_file(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", std::string(8, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("'t'"), std::string::npos) << m;
  const std::string q = dir / "shape2.safetensors";
  write_bytes(q, raw_file(R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 8]}})", std::string(8, '\0')));
  expect_names_file(open_error(q), q);
}

TEST(SafetensorsErrors, MissingTensorAndWrongRead) {
  TempDir dir;
  const std::string p = dir / "ok.safetensors";
  std::vector<float> a{1, 2, 3, 4};
  std::vector<int32_t> ids{1, 2};
  SafetensorsWriter w;
  w.add_f32("a", {2, 2}, a.data());
  w.add("ids", "I32", {2}, ids.data(), 8);
  w.write(p);
  SafetensorsFile f(p);
  float out[8];
  std::string m = error_of([&] { f.info("missing"); });
  expect_names_file(m, p);
  EXPECT_NE(m.find("missing"), std::string::npos) << m;
  m = error_of([&] { f.read_f32("missing", out, 4); });
  expect_names_file(m, p);
  m = error_of([&] { f.read_f32("a", out, 5); });  // wrong numel
  expect_names_file(m, p);
  EXPECT_NE(m.find("'a'"), std::string::npos) << m;
  m = error_of([&] { f.read_f32("a", out, std::vector<int64_t>{4}); });  // wrong shape
  expect_names_file(m, p);
  m = error_of([&] { f.read_f32("ids", out, 2); });  // not a float type
  expect_names_file(m, p);
  EXPECT_NE(m.find("'ids'"), std::string::npos) << m;
}

TEST(SafetensorsErrors, TruncatedValidFile) {
  TempDir dir;
  const std::string p = dir / "trunc.safetensors";
  std::vector<float> a(100, 1.0f);
  SafetensorsWriter w;
  w.add_f32("a", {100}, a.data());
  w.write(p);
  fs::resize_file(p, fs::file_size(p) - 4);
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("'a'"), std::string::npos) << m;
}

// The layout is exactly header + tensors: bytes after the last tensor, a gap between two or
// before the first, and a tensor named twice (nlohmann's parser would keep one of the two
// entries) were all read as a good file.
TEST(SafetensorsErrors, TrailingBytesAfterTheLastTensor) {
  TempDir dir;
  const std::string p = dir / "trailing.safetensors";
  write_bytes(p, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", std::string(12, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("4 bytes after the last tensor 'a'"), std::string::npos) << m;
  const std::string q = dir / "no_tensors.safetensors";
  write_bytes(q, raw_file(R"({"__metadata__": {"format": "pt"}})", std::string(8, '\0')));
  expect_names_file(open_error(q), q);
}

TEST(SafetensorsErrors, GapBetweenTensorsOrBeforeTheFirst) {
  TempDir dir;
  const std::string p = dir / "gap.safetensors";
  write_bytes(p, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                          R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                          std::string(20, '\0')));
  std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("[8, 12) between tensors 'a' and 'b' belong to no tensor"), std::string::npos) << m;
  const std::string q = dir / "lead.safetensors";
  write_bytes(q, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", std::string(12, '\0')));
  m = open_error(q);
  expect_names_file(m, q);
  EXPECT_NE(m.find("before the first tensor 'a'"), std::string::npos) << m;
}

TEST(SafetensorsErrors, TensorNamedTwice) {
  TempDir dir;
  const std::string p = dir / "twice.safetensors";
  write_bytes(p, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                          R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                          std::string(12, '\0')));
  const std::string m = open_error(p);
  expect_names_file(m, p);
  EXPECT_NE(m.find("key 'a' appears twice"), std::string::npos) << m;
}

// ---------------------------------------------------------------- atomic directories

void fill_files(const std::string& dir, const std::string& tag, int n) {
  for (int i = 0; i < n; ++i) {
    std::vector<float> v(1000, float(i));
    SafetensorsWriter w;
    w.add_f32("v", {1000}, v.data());
    w.set_metadata("tag", tag);
    w.write(dir + "/f" + std::to_string(i) + ".safetensors");
  }
  write_bytes(dir + "/manifest.txt", tag + " " + std::to_string(n));
}

// The directory holds exactly the complete set written by fill_files(tag, n).
bool complete(const std::string& dir, const std::string& tag, int n) {
  if (read_bytes(dir + "/manifest.txt") != tag + " " + std::to_string(n)) return false;
  int count = 0;
  for (const auto& e : fs::directory_iterator(dir)) (void)e, ++count;
  if (count != n + 1) return false;
  for (int i = 0; i < n; ++i) {
    try {
      SafetensorsFile f(dir + "/f" + std::to_string(i) + ".safetensors");
      if (f.metadata().at("tag") != tag) return false;
    } catch (...) {
      return false;
    }
  }
  return true;
}

std::vector<std::string> leftovers(const std::string& parent, const std::string& stem) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string n = e.path().filename().string();
    if (n != stem && n.rfind(stem, 0) == 0) v.push_back(n);
  }
  return v;
}

TEST(WriteDirAtomically, CreatesThenReplaces) {
  TempDir dir;
  const std::string final_dir = dir / "ckpt";
  shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "old", 3); });
  EXPECT_TRUE(complete(final_dir, "old", 3));
  EXPECT_TRUE(leftovers(dir.path(), "ckpt").empty());

  shardlm::ckpt::write_dir_atomically(final_dir + "/", [&](const std::string& tmp) {
    EXPECT_NE(tmp, final_dir);
    EXPECT_TRUE(complete(final_dir, "old", 3));  // the old one stays readable while writing
    fill_files(tmp, "new", 5);
  });
  EXPECT_TRUE(complete(final_dir, "new", 5));
  EXPECT_TRUE(leftovers(dir.path(), "ckpt").empty());
}

TEST(WriteDirAtomically, CreatesMissingParents) {
  TempDir dir;
  const std::string final_dir = dir / "runs/a/step_10";
  shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "x", 1); });
  EXPECT_TRUE(complete(final_dir, "x", 1));
}

TEST(WriteDirAtomically, FillThrowsLeavesOldUntouched) {
  TempDir dir;
  const std::string final_dir = dir / "ckpt";
  shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "old", 2); });
  EXPECT_THROW(shardlm::ckpt::write_dir_atomically(final_dir,
                                                   [](const std::string& tmp) {
                                                     fill_files(tmp, "new", 1);
                                                     throw std::runtime_error("disk on fire");
                                                   }),
               std::runtime_error);
  EXPECT_TRUE(complete(final_dir, "old", 2));
  EXPECT_TRUE(leftovers(dir.path(), "ckpt").empty());

  const std::string fresh = dir / "fresh";
  EXPECT_THROW(shardlm::ckpt::write_dir_atomically(fresh, [](const std::string&) { throw std::runtime_error("x"); }),
               std::runtime_error);
  EXPECT_FALSE(fs::exists(fresh));
}

TEST(WriteDirAtomically, RefusesToReplaceAFile) {
  TempDir dir;
  const std::string p = dir / "afile";
  write_bytes(p, "x");
  EXPECT_THROW(shardlm::ckpt::write_dir_atomically(p, [](const std::string&) {}), std::runtime_error);
  EXPECT_EQ(read_bytes(p), "x");
}

// OnExisting::refuse (ckpt export and import without --overwrite) takes an absent name or an
// empty directory, and leaves anything else as it was.
TEST(WriteDirAtomically, RefuseKeepsANonEmptyDirectory) {
  TempDir dir;
  const std::string final_dir = dir / "out";
  fs::create_directories(final_dir);
  write_bytes(final_dir + "/precious.txt", "mine");
  const std::string m = error_of([&] {
    shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "new", 1); },
                                        shardlm::ckpt::OnExisting::refuse);
  });
  EXPECT_NE(m.find(final_dir + ": exists and is not an empty directory"), std::string::npos) << m;
  EXPECT_EQ(read_bytes(final_dir + "/precious.txt"), "mine");
  EXPECT_TRUE(leftovers(dir.path(), "out").empty());

  const std::string empty = dir / "empty";
  fs::create_directories(empty);
  shardlm::ckpt::write_dir_atomically(empty, [](const std::string& tmp) { fill_files(tmp, "new", 2); },
                                      shardlm::ckpt::OnExisting::refuse);
  EXPECT_TRUE(complete(empty, "new", 2));
}

// The temporary directory used to be FINAL.tmp-<pid>, removed first if it existed: a directory
// of the user's that happened to have that name was deleted. It now takes a name no one has.
TEST(WriteDirAtomically, NeverRemovesWhatIsBesideIt) {
  TempDir dir;
  const std::string final_dir = dir / "ckpt";
  const std::string pid = std::to_string(::getpid());
  const std::vector<std::string> beside = {final_dir + ".tmp-" + pid, final_dir + ".tmp-" + pid + "-0"};
  for (const auto& b : beside) {
    fs::create_directories(b);
    write_bytes(b + "/precious.txt", "mine");
  }
  shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "new", 1); });
  EXPECT_TRUE(complete(final_dir, "new", 1));
  for (const auto& b : beside) EXPECT_EQ(read_bytes(b + "/precious.txt"), "mine") << b;
}

// A child process writes the directory and is killed (SIGKILL) at a varying moment: afterwards
// the final name holds either the complete old or the complete new directory.
TEST(WriteDirAtomically, KilledAtAnyMomentLeavesOldOrNew) {
  TempDir dir;
  const std::string final_dir = dir / "ckpt";
  int saw_old = 0, saw_new = 0;
  for (int trial = 0; trial < 12; ++trial) {
    std::error_code ec;
    fs::remove_all(final_dir, ec);
    for (const auto& n : leftovers(dir.path(), "ckpt")) fs::remove_all(dir / n, ec);
    shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "old", 4); });

    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        shardlm::ckpt::write_dir_atomically(final_dir, [](const std::string& tmp) { fill_files(tmp, "new", 40); });
      } catch (...) {
        _exit(2);
      }
      _exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(trial * trial * 400));
    kill(pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
    ASSERT_FALSE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << "child failed to write";

    // Absent only in the non-exchange fallback, which keeps the old dir complete aside.
    if (!fs::exists(final_dir)) {
      const std::string old = final_dir + ".old-" + std::to_string(pid);
      EXPECT_TRUE(complete(old, "old", 4)) << "trial " << trial;
      continue;
    }
    const bool is_old = complete(final_dir, "old", 4), is_new = complete(final_dir, "new", 40);
    EXPECT_TRUE(is_old || is_new) << "trial " << trial << ": half-written directory under the final name";
    saw_old += is_old;
    saw_new += is_new;
  }
  // Not asserted (timing dependent), but shows the kills landed in different phases.
  std::cout << "[ info ] killed runs that left the old dir: " << saw_old << ", the new dir: " << saw_new << "\n";
}

}  // namespace
