#include "report/png.h"

#include <array>
#include <stdexcept>

namespace shardlm::report {

namespace {

uint32_t crc32(const std::string& bytes, size_t from) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = from; i < bytes.size(); ++i) c = table[(c ^ static_cast<uint8_t>(bytes[i])) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

void put32(std::string& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xff));
}

// A chunk: length, type, data, and the CRC of type and data.
void chunk(std::string& out, const char* type, const std::string& data) {
  put32(out, static_cast<uint32_t>(data.size()));
  const size_t from = out.size();
  out += type;
  out += data;
  put32(out, crc32(out, from));
}

// zlib's stream of `raw` in stored deflate blocks (at most 65535 bytes each), with its Adler-32.
std::string zlib_stored(const std::string& raw) {
  std::string z = "\x78\x01";
  size_t at = 0;
  do {
    const size_t n = std::min<size_t>(65535, raw.size() - at);
    z.push_back(at + n == raw.size() ? 1 : 0);  // BFINAL on the last block, BTYPE 00
    z.push_back(static_cast<char>(n & 0xff)), z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xff)), z.push_back(static_cast<char>((~n >> 8) & 0xff));
    z.append(raw, at, n);
    at += n;
  } while (at < raw.size());
  uint32_t a = 1, b = 0;
  for (unsigned char ch : raw) a = (a + ch) % 65521, b = (b + a) % 65521;
  put32(z, (b << 16) | a);
  return z;
}

}  // namespace

std::string encode_png(const std::vector<uint8_t>& rgb, int64_t width, int64_t height) {
  if (width <= 0 || height <= 0 || width > (1 << 20) || height > (1 << 20) ||
      static_cast<int64_t>(rgb.size()) != width * height * 3)
    throw std::invalid_argument("png: " + std::to_string(rgb.size()) + " bytes for " + std::to_string(width) + " x " +
                                std::to_string(height) + " RGB pixels");
  std::string raw;
  raw.reserve(static_cast<size_t>(height * (1 + 3 * width)));
  for (int64_t y = 0; y < height; ++y) {
    raw.push_back(0);  // filter: none
    raw.append(reinterpret_cast<const char*>(rgb.data()) + y * width * 3, static_cast<size_t>(width * 3));
  }
  std::string ihdr;
  put32(ihdr, static_cast<uint32_t>(width));
  put32(ihdr, static_cast<uint32_t>(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, adaptive filters, no interlace
  std::string out = "\x89PNG\r\n\x1a\n";
  chunk(out, "IHDR", ihdr);
  chunk(out, "IDAT", zlib_stored(raw));
  chunk(out, "IEND", "");
  return out;
}

}  // namespace shardlm::report
