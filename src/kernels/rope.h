// The rotary embedding's frequencies, one definition for every backend's rope_table.
//
// inv_freq_i = 1 / theta^(2i / HS) for i < HS/2, in fp32 as Hugging Face's fp32
// LlamaRotaryEmbedding computes it (kernels/cpu.h says how). Llama 3.1 and later ("rope_type":
// "llama3" in config.json) rescale them by wavelength w_i = 2π / inv_freq_i against the context
// the model was first trained at (original_max_seq, say 8192):
//   w_i < original_max_seq / high_freq_factor   kept (short wavelengths: local positions)
//   w_i > original_max_seq / low_freq_factor    divided by factor (they never wrapped in training)
//   between                                     (1 − s) inv_freq_i / factor + s inv_freq_i,
//                                               s = (original_max_seq / w_i − low) / (high − low)
// in fp32 in Hugging Face's order of operations, so that an imported Llama 3.1 model's rotations
// are the ones it was trained with.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define SHARDLM_HOST_DEVICE __host__ __device__
#else
#define SHARDLM_HOST_DEVICE
#endif

namespace shardlm::kernels {

struct Rope {
  double theta = 10000;
  double factor = 0;  // 0: unscaled (LLaMA 1-3); else Llama 3.1's rescaling, with the three below
  double low_freq_factor = 1, high_freq_factor = 4;
  double original_max_seq = 8192;
};

SHARDLM_HOST_DEVICE inline float rope_inv_freq(int64_t i, int64_t HS, const Rope& r) {
  const float e = static_cast<float>(2 * i) / static_cast<float>(HS);
  const float inv = 1.0f / static_cast<float>(pow(r.theta, static_cast<double>(e)));
  if (!(r.factor > 0)) return inv;
  // torch evaluates `2π / t` as reciprocal(t) · 2π, and a Python float beside an fp32 tensor in fp32.
  const float two_pi = 6.283185307179586f;
  const float wavelen = (1.0f / inv) * two_pi;
  if (wavelen < static_cast<float>(r.original_max_seq / r.high_freq_factor)) return inv;
  const float factor = static_cast<float>(r.factor);
  if (wavelen > static_cast<float>(r.original_max_seq / r.low_freq_factor)) return inv / factor;
  const float ramp = (1.0f / wavelen) * static_cast<float>(r.original_max_seq) - static_cast<float>(r.low_freq_factor);
  const float s = ramp / static_cast<float>(r.high_freq_factor - r.low_freq_factor);
  const float scaled = (1.0f - s) * inv / factor;
  const float kept = s * inv;
  return scaled + kept;
}

}  // namespace shardlm::kernels
