// PNG files of 8-bit RGB pictures (generated samples), written without a compression library: the
// image data is zlib's stored (uncompressed) form, which every PNG reader takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::report {

// The bytes of a PNG of `width` x `height` pixels, rgb holding width·height·3 bytes row by row.
// Throws std::invalid_argument for a size that is empty or does not match.
std::string encode_png(const std::vector<uint8_t>& rgb, int64_t width, int64_t height);

}  // namespace shardlm::report
