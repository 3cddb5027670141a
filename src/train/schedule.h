// The learning rate of each step: a linear warmup, then a decay to min_lr over the last
// `decay_fraction` of the remaining steps, holding lr before it (warmup-stable-decay, as
// torchtitan's decay_ratio and MiniCPM's WSD; 1, the default, decays from the end of warmup as
// nanoGPT's and llm.c's cosine).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace shardlm::train {

enum class LrDecay { cosine, linear, sqrt, none };
// "cosine" | "linear" | "sqrt" | "none"; std::invalid_argument naming --lr-decay otherwise.
inline LrDecay parse_lr_decay(const std::string& name) {
  if (name == "cosine") return LrDecay::cosine;
  if (name == "linear") return LrDecay::linear;
  if (name == "sqrt") return LrDecay::sqrt;
  if (name == "none") return LrDecay::none;
  throw std::invalid_argument("--lr-decay: must be cosine, linear, sqrt or none, got '" + name + "'");
}

struct LrSchedule {
  float lr = 6e-4f, min_lr = 6e-5f;
  int64_t warmup = 100, total = 1000;
  LrDecay decay = LrDecay::cosine;
  double decay_fraction = 1;  // in (0, 1]

  // The first step of the decay: warmup + the stable phase.
  int64_t decay_start() const {
    const int64_t after = std::max<int64_t>(0, total - warmup);
    return std::max(warmup, total - static_cast<int64_t>(std::llround(static_cast<double>(after) * decay_fraction)));
  }

  // step is 0-based: step 0 already has a non-zero rate (lr / warmup), as in nanoGPT.
  float at(int64_t step) const {
    if (step < warmup) return lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
    if (decay == LrDecay::none) return lr;
    if (step >= total) return min_lr;
    const int64_t start = decay_start();
    if (step < start) return lr;
    const double progress = static_cast<double>(step - start) / static_cast<double>(std::max<int64_t>(1, total - start));
    double left = 0;  // the share of lr - min_lr still above min_lr
    switch (decay) {
      case LrDecay::cosine: left = 0.5 * (1.0 + std::cos(M_PI * progress)); break;
      case LrDecay::linear: left = 1.0 - progress; break;
      case LrDecay::sqrt: left = 1.0 - std::sqrt(progress); break;
      case LrDecay::none: left = 1; break;
    }
    return static_cast<float>(min_lr + left * (lr - min_lr));
  }
};

}  // namespace shardlm::train
