#include "data/unicode.h"

#include <algorithm>
#include <array>

namespace shardlm::data {
namespace {

// Classes of the Basic Multilingual Plane, expanded from the range table once.
struct BmpTable {
  std::array<CharClass, 0x10000> cls{};
  BmpTable() {
    using namespace unicode_detail;
    for (int r = 0; r < kNumClassRanges; ++r) {
      const ClassRange& cr = kClassRanges[r];
      for (uint32_t c = cr.lo; c <= cr.hi && c < 0x10000; ++c) cls[c] = cr.cls;
    }
  }
};

const BmpTable& bmp() {
  static const BmpTable table;
  return table;
}

}  // namespace

CharClass char_class(uint32_t cp) {
  if (cp < 0x10000) return bmp().cls[cp];
  if (cp > 0x10FFFF) return CharClass::kOther;
  using namespace unicode_detail;
  const ClassRange* end = kClassRanges + kNumClassRanges;
  // First range whose hi >= cp.
  const ClassRange* it =
      std::lower_bound(kClassRanges, end, cp, [](const ClassRange& r, uint32_t c) { return r.hi < c; });
  if (it != end && it->lo <= cp) return it->cls;
  return CharClass::kOther;
}

const char* unicode_table_version() { return unicode_detail::kUnicodeVersion; }

namespace unicode_detail {

namespace {
std::array<CharClass, 128> ascii_classes() {
  std::array<CharClass, 128> a{};
  for (uint32_t c = 0; c < 128; ++c) a[c] = char_class(c);
  return a;
}
}  // namespace

const std::array<CharClass, 128> kAsciiClasses = ascii_classes();

CodePoint decode_utf8_multibyte(const unsigned char* s, size_t n, size_t i) {
  const unsigned char b0 = s[i];
  const CodePoint bad{kInvalidCodePoint, 1, CharClass::kOther};
  uint32_t len, cp, min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return bad;  // continuation byte, C0/C1 (overlong 2-byte), F5..FF
  }
  if (n - i < len) return bad;
  for (uint32_t k = 1; k < len; ++k) {
    const unsigned char b = s[i + k];
    if ((b & 0xC0) != 0x80) return bad;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return bad;
  return {cp, len, char_class(cp)};
}

}  // namespace unicode_detail

}  // namespace shardlm::data
