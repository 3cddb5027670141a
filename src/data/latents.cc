#include "data/latents.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "files/replace_file.h"

namespace shardlm::data {

namespace {

constexpr int kHeaderInts = 256;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser on x + the golden ratio: a bijective mixer
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t key(uint64_t seed, uint64_t salt, int64_t a, int64_t b) {
  return mix(mix(mix(seed ^ salt) ^ static_cast<uint64_t>(a)) ^ static_cast<uint64_t>(b));
}
double uniform(uint64_t r) { return (static_cast<double>(r >> 11) + 0.5) / 9007199254740992.0; }  // (0, 1)
// A standard normal from one draw (Box-Muller on its two 32-bit halves).
double normal(uint64_t r) {
  const double u1 = (static_cast<double>(r >> 32) + 1.0) / 4294967297.0;
  const double u2 = static_cast<double>(r & 0xffffffffull) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

}  // namespace

LatentSet::LatentSet(const std::string& path) : path_(path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot open (a latent set: shardlm make-data shapes --out DIR writes DIR/train.bin and DIR/val.bin)");
  int32_t h[kHeaderInts];
  if (!f.read(reinterpret_cast<char*>(h), sizeof h)) bad(path, "shorter than its 1024-byte header");
  if (h[0] != kLatentMagic) bad(path, "not a latent set (magic " + std::to_string(h[0]) + ", expected 20251203)");
  if (h[1] != 1) bad(path, "version " + std::to_string(h[1]) + " (this build reads version 1)");
  if (h[8] != 0) bad(path, "value type " + std::to_string(h[8]) + " (this build reads 0: fp32)");
  shape_ = {h[3], h[4], h[5], h[6], h[7]};
  for (int i = 2; i <= 7; ++i)
    if (h[i] < 1) bad(path, "header field " + std::to_string(i) + " is " + std::to_string(h[i]) + ", must be positive");
  const int64_t n = h[2], v = shape_.values();
  labels_.resize(n);
  values_.resize(n * v);
  for (int64_t i = 0; i < n; ++i) {
    if (!f.read(reinterpret_cast<char*>(&labels_[i]), 4) ||
        !f.read(reinterpret_cast<char*>(values_.data() + i * v), 4 * v))
      bad(path, "ends inside record " + std::to_string(i) + " of " + std::to_string(n));
    if (labels_[i] < 0 || labels_[i] >= shape_.classes)
      bad(path, "record " + std::to_string(i) + " has label " + std::to_string(labels_[i]) + ", outside [0, " +
                    std::to_string(shape_.classes) + ")");
  }
  if (f.peek() != std::ifstream::traits_type::eof()) bad(path, "has bytes after its " + std::to_string(n) + " records");
}

void LatentSet::read_channels_first(int64_t i, float* out) const {
  const LatentShape& s = shape_;
  const float* in = values_.data() + i * s.values();
  const int64_t plane = s.frames * s.height * s.width;
  for (int64_t p = 0; p < plane; ++p)
    for (int64_t c = 0; c < s.channels; ++c) out[c * plane + p] = in[p * s.channels + c];
}

void write_latents(const std::string& path, const LatentShape& shape, const std::vector<int32_t>& labels,
                   const std::vector<float>& values) {
  int32_t h[kHeaderInts] = {};
  h[0] = kLatentMagic, h[1] = 1, h[2] = static_cast<int32_t>(labels.size());
  h[3] = static_cast<int32_t>(shape.frames), h[4] = static_cast<int32_t>(shape.height);
  h[5] = static_cast<int32_t>(shape.width), h[6] = static_cast<int32_t>(shape.channels);
  h[7] = static_cast<int32_t>(shape.classes);
  const int64_t v = shape.values();
  std::string bytes(reinterpret_cast<const char*>(h), sizeof h);
  for (size_t i = 0; i < labels.size(); ++i) {
    bytes.append(reinterpret_cast<const char*>(&labels[i]), 4);
    bytes.append(reinterpret_cast<const char*>(values.data() + i * v), 4 * v);
  }
  files::replace_file(path, bytes);
}

float class_colour(int32_t label, int64_t channel) {
  // Channel c is high where bit c of label + 3 is set: ten distinct colours over four channels,
  // none all low (the background's).
  return ((label + 3) >> (channel % 4)) & 1 ? 1.0f : -0.3f;
}

void render_shape(const ShapesOptions& o, const std::string& split, int64_t index, int32_t label, float* out) {
  const LatentShape& s = o.shape;
  const uint64_t salt = split == "train" ? 0x747261696eull : 0x76616cull;
  const int64_t side = std::min(s.height, s.width);
  // Size a third to a half of the frame; the centre anywhere the shape fits.
  const double r = side * (0.18 + 0.08 * uniform(key(o.seed, salt, index, 0)));
  const double cy = r + (s.height - 2 * r) * uniform(key(o.seed, salt, index, 1));
  const double cx0 = r + (s.width - 2 * r) * uniform(key(o.seed, salt, index, 2));
  const int kind = label % 5;
  std::fill(out, out + s.values(), -1.0f);
  for (int64_t f = 0; f < s.frames; ++f) {
    // Motion across frames: right for even classes, down for odd, a pixel a frame.
    const double dx = label % 2 == 0 ? static_cast<double>(f) : 0.0, dy = label % 2 == 1 ? static_cast<double>(f) : 0.0;
    for (int64_t y = 0; y < s.height; ++y)
      for (int64_t x = 0; x < s.width; ++x) {
        const double u = (x + 0.5 - cx0 - dx) / r, w = (y + 0.5 - cy - dy) / r;
        bool in = false;
        switch (kind) {
          case 0: in = std::fabs(u) <= 0.8 && std::fabs(w) <= 0.8; break;             // square
          case 1: in = u * u + w * w <= 1.0; break;                                   // disc
          case 2: in = w >= -0.9 && w <= 0.9 && std::fabs(u) <= (w + 0.9) / 1.8; break;  // triangle
          case 3: in = (std::fabs(u) <= 0.3 && std::fabs(w) <= 1) || (std::fabs(w) <= 0.3 && std::fabs(u) <= 1); break;
          default: in = u * u + w * w <= 1.0 && u * u + w * w >= 0.36; break;          // ring
        }
        if (!in) continue;
        float* px = out + ((f * s.height + y) * s.width + x) * s.channels;
        for (int64_t c = 0; c < s.channels; ++c) px[c] = class_colour(label, c);
      }
  }
}

void make_shapes(const std::string& dir, const ShapesOptions& o) {
  if (o.shape.classes < 1 || o.shape.classes > 10)
    throw std::invalid_argument("make-data shapes: --classes must be in [1, 10], got " + std::to_string(o.shape.classes));
  for (int64_t v : {o.shape.frames, o.shape.height, o.shape.width, o.shape.channels})
    if (v < 1) throw std::invalid_argument("make-data shapes: frames, height, width and channels must be positive");
  if (std::min(o.shape.height, o.shape.width) < 4)
    throw std::invalid_argument("make-data shapes: frames need height and width of at least 4");
  if (o.train < 1 || o.val < 1) throw std::invalid_argument("make-data shapes: --train and --val must be positive");
  std::filesystem::create_directories(dir);
  // Replaces only what it wrote before: a file of another kind at either name stays.
  for (const char* split : {"/train.bin", "/val.bin"}) {
    const std::string path = dir + split;
    std::ifstream f(path, std::ios::binary);
    int32_t magic = 0;
    if (f && !(f.read(reinterpret_cast<char*>(&magic), 4) && magic == kLatentMagic))
      throw std::runtime_error(path + ": exists and is not a latent set; make-data replaces only its own files");
  }
  for (const auto& [split, n] : {std::pair<std::string, int64_t>{"train", o.train}, {"val", o.val}}) {
    std::vector<int32_t> labels(n);
    std::vector<float> values(n * o.shape.values());
    for (int64_t i = 0; i < n; ++i) {
      labels[i] = static_cast<int32_t>(i % o.shape.classes);  // balanced classes
      render_shape(o, split, i, labels[i], values.data() + i * o.shape.values());
    }
    write_latents(dir + "/" + split + ".bin", o.shape, labels, values);
  }
}

int64_t latent_record(uint64_t seed, int64_t step, int64_t j, int64_t records) {
  if (records < 1) throw std::invalid_argument("latent_record: an empty latent set");
  return static_cast<int64_t>(key(seed, 0x4c4154454e54ull, step, j) % static_cast<uint64_t>(records));  // "LATENT"
}

FlowDraw flow_draw(uint64_t seed, int64_t step, int64_t j, double cond_drop, float* noise, int64_t n) {
  const uint64_t k = key(seed, 0x464c4f57ull, step, j);  // "FLOW"
  FlowDraw d;
  d.time = static_cast<float>(1.0 / (1.0 + std::exp(-normal(mix(k ^ 1)))));
  d.drop_label = uniform(mix(k ^ 2)) < cond_drop;
  for (int64_t i = 0; i < n; ++i) noise[i] = static_cast<float>(normal(mix(k + 16 + static_cast<uint64_t>(i))));
  return d;
}

}  // namespace shardlm::data
