#include "train/flow_samples.h"

#include <algorithm>

#include "data/latents.h"
#include "files/replace_file.h"
#include "report/png.h"

namespace shardlm::train {

namespace {

uint8_t to_byte(float v) { return static_cast<uint8_t>(std::clamp((v + 1.0f) * 0.5f, 0.0f, 1.0f) * 255.0f + 0.5f); }

// The grid of (samples, C, F, H, W) latents, `columns` samples a row, each pixel `zoom` wide.
std::string grid_png(const model::ModelConfig& c, const std::vector<float>& x, int64_t samples, int64_t columns) {
  const int64_t zoom = std::max<int64_t>(1, 64 / std::max(c.height, c.width)), gap = 2;
  const int64_t cell_w = c.frames * c.width * zoom + gap, cell_h = c.height * zoom + gap;
  const int64_t rows = (samples + columns - 1) / columns, W = columns * cell_w + gap, H = rows * cell_h + gap;
  std::vector<uint8_t> rgb(W * H * 3, 128);
  const int64_t plane = c.frames * c.height * c.width;
  for (int64_t s = 0; s < samples; ++s) {
    const float* lat = x.data() + s * c.latent_values();
    const int64_t x0 = gap + (s % columns) * cell_w, y0 = gap + (s / columns) * cell_h;
    for (int64_t f = 0; f < c.frames; ++f)
      for (int64_t y = 0; y < c.height * zoom; ++y)
        for (int64_t xx = 0; xx < c.width * zoom; ++xx) {
          const int64_t p = (f * c.height + y / zoom) * c.width + xx / zoom;
          uint8_t* px = rgb.data() + ((y0 + y) * W + x0 + f * c.width * zoom + xx) * 3;
          for (int64_t k = 0; k < 3; ++k) px[k] = to_byte(lat[std::min<int64_t>(k, c.channels - 1) * plane + p]);
        }
  }
  return report::encode_png(rgb, W, H);
}

}  // namespace

std::string write_flow_samples(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                               const std::string& dir, int64_t per_class, const FlowSampling& fs, bool lead) {
  const model::ModelConfig& c = desc.config;
  std::vector<int32_t> labels;
  for (int64_t k = 0; k < c.num_classes; ++k) labels.insert(labels.end(), per_class, static_cast<int32_t>(k));
  const std::vector<float> x = sample_flow(ex, desc, training, labels, fs);
  if (!lead) return "";
  // The latent set's layout is channels last.
  const int64_t n = static_cast<int64_t>(labels.size()), L = c.latent_values(), plane = c.frames * c.height * c.width;
  std::vector<float> last(n * L);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t ch = 0; ch < c.channels; ++ch)
      for (int64_t p = 0; p < plane; ++p) last[s * L + p * c.channels + ch] = x[s * L + ch * plane + p];
  data::write_latents(dir + "/samples.bin", {c.frames, c.height, c.width, c.channels, c.num_classes}, labels, last);
  const std::string png = dir + "/samples.png";
  files::replace_file(png, grid_png(c, x, n, per_class));
  return png;
}

}  // namespace shardlm::train
