#pragma once

#include <cmath>
#include <cstdint>

namespace shardlm::train {

// Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at step `total`.
// step is 0-based: step 0 already has a non-zero rate (lr / warmup), as in nanoGPT.
inline float learning_rate(int64_t step, int64_t total, int64_t warmup, float lr, float min_lr) {
  if (step < warmup) return lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (step >= total) return min_lr;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + coeff * (lr - min_lr));
}

}  // namespace shardlm::train
