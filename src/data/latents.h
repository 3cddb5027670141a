// Diffusion data: latents with a class label each, one file per split (DIR/train.bin, DIR/val.bin),
// in a small binary layout beside llm.c's token shards:
//
//   header   256 little-endian int32: [0] magic 20251203, [1] version 1, [2] records N,
//            [3] frames F, [4] height H, [5] width W, [6] channels C, [7] classes K,
//            [8] value type (0: fp32); the rest 0
//   records  N of them, each: int32 label in [0, K), then F·H·W·C fp32 values, channels last
//            (frame, row, column, channel)
//
// `shardlm make-data shapes` writes a synthetic set of this layout; the trainer reads it with
// LatentSet and draws each step's samples and their noise statelessly from (seed, step, sample).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::data {

inline constexpr int32_t kLatentMagic = 20251203;

struct LatentShape {
  int64_t frames = 0, height = 0, width = 0, channels = 0, classes = 0;
  int64_t values() const { return frames * height * width * channels; }
  bool operator==(const LatentShape&) const = default;
};

// A split's records, read whole into memory (the synthetic sets are small). Throws
// std::runtime_error naming the file for a missing, short or malformed one.
class LatentSet {
 public:
  explicit LatentSet(const std::string& path);
  const std::string& path() const { return path_; }
  const LatentShape& shape() const { return shape_; }
  int64_t size() const { return static_cast<int64_t>(labels_.size()); }
  int32_t label(int64_t i) const { return labels_.at(i); }
  // Record i's values as (C, F, H, W), the channels-first layout the models read.
  void read_channels_first(int64_t i, float* out) const;

 private:
  std::string path_;
  LatentShape shape_;
  std::vector<int32_t> labels_;
  std::vector<float> values_;  // records one after another, channels last
};

// Writes records (labels, and values channels last, labels.size() records) at `path`.
void write_latents(const std::string& path, const LatentShape& shape, const std::vector<int32_t>& labels,
                   const std::vector<float>& values);

// The synthetic "shapes" set: frames of height x width with `channels` channels, `classes` classes
// (at most 10). A class is a shape (square, disc, triangle, cross, ring: label mod 5) and a colour
// (class_colour: distinct for every class on four channels or more); each record places its class's shape at a position and size drawn from (seed,
// split, index), values in [-1, 1] (background -1 on every channel, the shape its colour). For
// frames > 1 the shape moves: class k drifts right when k is even, down when odd. Writes
// DIR/train.bin and DIR/val.bin (creating DIR); the same arguments write the same bytes.
struct ShapesOptions {
  LatentShape shape{1, 16, 16, 4, 10};
  int64_t train = 2048, val = 256;
  uint64_t seed = 1234;
};
void make_shapes(const std::string& dir, const ShapesOptions& o);
// Class `label`'s value on `channel` inside its shape (the background is −1 on every channel).
float class_colour(int32_t label, int64_t channel);
// Renders record `index` of `split` ("train" or "val") channels last into out (shape.values()).
void render_shape(const ShapesOptions& o, const std::string& split, int64_t index, int32_t label, float* out);

// The flow objective's draws for sample j of step `step` (each a pure function of its arguments,
// as the token sampler's): which record it reads, its time t = sigmoid(N(0, 1)) (logit-normal), its
// noise (n standard normals) and whether its label is dropped to the null class (probability
// cond_drop). Evaluation draws at step −1.
int64_t latent_record(uint64_t seed, int64_t step, int64_t j, int64_t records);
struct FlowDraw {
  float time = 0;
  bool drop_label = false;
};
FlowDraw flow_draw(uint64_t seed, int64_t step, int64_t j, double cond_drop, float* noise, int64_t n);

}  // namespace shardlm::data
