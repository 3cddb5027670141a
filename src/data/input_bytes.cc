#include "data/input_bytes.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace shardlm::data {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("tokenize: " + path + ": " + what);
}

}  // namespace

class InputBytes::Source {
 public:
  virtual ~Source() = default;
  virtual size_t read(char* buf, size_t n) = 0;
};

namespace {

std::FILE* open_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("tokenize: cannot open input file " + path + ": " + std::strerror(errno));
  return f;
}

class PlainSource : public InputBytes::Source {
 public:
  explicit PlainSource(const std::string& path) : path_(path), f_(open_file(path)) {}
  ~PlainSource() override { std::fclose(f_); }
  size_t read(char* buf, size_t n) override {
    const size_t got = std::fread(buf, 1, n, f_);
    if (got < n && std::ferror(f_)) fail(path_, std::string("cannot read: ") + std::strerror(errno));
    return got;
  }

 private:
  std::string path_;
  std::FILE* f_;
};

// zlib's gz reader: it reads concatenated members and checks each one's CRC and length.
class GzipSource : public InputBytes::Source {
 public:
  explicit GzipSource(const std::string& path) : path_(path), f_(gzopen(path.c_str(), "rb")) {
    if (!f_) throw std::runtime_error("tokenize: cannot open input file " + path + ": " + std::strerror(errno));
  }
  ~GzipSource() override { gzclose(f_); }
  size_t read(char* buf, size_t n) override {
    const int got = gzread(f_, buf, static_cast<unsigned>(std::min<size_t>(n, 1u << 30)));
    int code = Z_OK;
    const char* message = gzerror(f_, &code);
    if (got < 0 || (code != Z_OK && code != Z_BUF_ERROR)) fail(path_, std::string("corrupt gzip data: ") + message);
    if (got > 0 && gzdirect(f_)) fail(path_, "is not gzip data (its name ends in .gz)");
    // A stream cut short: zlib returns what it has, then Z_BUF_ERROR ("unexpected end of file").
    if (got == 0 && code == Z_BUF_ERROR) fail(path_, std::string("truncated gzip data: ") + message);
    return static_cast<size_t>(got);
  }

 private:
  std::string path_;
  gzFile f_;
};

// zstd's streaming decompression, frame after frame.
class ZstdSource : public InputBytes::Source {
 public:
  explicit ZstdSource(const std::string& path)
      : path_(path), f_(open_file(path)), stream_(ZSTD_createDStream()), in_(ZSTD_DStreamInSize()) {
    if (!stream_) {
      std::fclose(f_);
      fail(path, "cannot start zstd decompression");
    }
  }
  ~ZstdSource() override {
    ZSTD_freeDStream(stream_);
    std::fclose(f_);
  }
  size_t read(char* buf, size_t n) override {
    ZSTD_outBuffer out{buf, n, 0};
    while (true) {
      const size_t consumed = pending_.pos;
      const size_t left = ZSTD_decompressStream(stream_, &out, &pending_);
      if (ZSTD_isError(left)) fail(path_, std::string("corrupt zstd data: ") + ZSTD_getErrorName(left));
      // A call that moved nothing says nothing of the frame (at a frame's end it asks for the
      // next one's header).
      if (out.pos > 0 || pending_.pos > consumed) mid_frame_ = left != 0;
      if (out.pos > 0) return out.pos;
      if (pending_.pos < pending_.size) continue;
      const size_t got = std::fread(in_.data(), 1, in_.size(), f_);
      if (got < in_.size() && std::ferror(f_)) fail(path_, std::string("cannot read: ") + std::strerror(errno));
      if (got == 0) {
        if (mid_frame_) fail(path_, "truncated zstd data (the last frame ends early)");
        return 0;
      }
      pending_ = {in_.data(), got, 0};
    }
  }

 private:
  std::string path_;
  std::FILE* f_;
  ZSTD_DStream* stream_;
  std::vector<char> in_;
  ZSTD_inBuffer pending_{nullptr, 0, 0};
  bool mid_frame_ = false;
};

}  // namespace

InputBytes::InputBytes(const std::string& path) {
  if (path.ends_with(".gz")) source_ = std::make_unique<GzipSource>(path);
  else if (path.ends_with(".zst")) source_ = std::make_unique<ZstdSource>(path);
  else source_ = std::make_unique<PlainSource>(path);
}

InputBytes::~InputBytes() = default;

size_t InputBytes::read(char* buf, size_t n) { return n == 0 ? 0 : source_->read(buf, n); }

std::string InputBytes::content_name(const std::string& path) {
  if (path.ends_with(".gz")) return path.substr(0, path.size() - 3);
  if (path.ends_with(".zst")) return path.substr(0, path.size() - 4);
  return path;
}

}  // namespace shardlm::data
