#include "layers/layers.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace shardlm::layers {

const LayerKind& layer(model::UnitKind kind) {
  static const LayerKind table[] = {
#define SHARDLM_LAYER_KIND(name, place) name##_kind(),
      SHARDLM_UNIT_KINDS(SHARDLM_LAYER_KIND)
#undef SHARDLM_LAYER_KIND
  };
  static_assert(sizeof(table) / sizeof(table[0]) == model::kNumUnitKinds);
  return table[static_cast<int>(kind)];
}

double vocabulary_pass(const UnitArgs& a, HeadMode mode, const float* normed, const float* weight, float* dweight,
                       float* dnormed, float* logits_ws) {
  const kernels::Backend& be = *a.backend;
  const auto& c = a.desc->config;
  const int64_t BT = a.B * a.T, C = c.n_embd, V = c.vocab_size, Vp = c.padded_vocab();
  const int64_t chunk = model::detail::head_chunk_rows(BT);
  if (mode == HeadMode::logits && !a.all_logits) {  // generation: the last position's logits
    const int32_t ignore = -1;
    be.lm_head_cross_entropy(nullptr, nullptr, normed + (a.T - 1) * C, weight, &ignore, 1, C, V, Vp, 0.0f, 1, logits_ws,
                             a.logits);
    return 0;
  }
  if (mode != HeadMode::train) {
    const double loss = be.lm_head_cross_entropy(nullptr, nullptr, normed, weight, a.targets, BT, C, V, Vp, 0.0f, chunk,
                                                 logits_ws, mode == HeadMode::logits ? a.logits : nullptr);
    return mode == HeadMode::logits ? 0 : loss;
  }
  be.zero(dnormed, sizeof(float) * BT * C);
  return be.lm_head_cross_entropy(dnormed, dweight, normed, weight, a.targets, BT, C, V, Vp, a.grad_scale, chunk,
                                  logits_ws, nullptr);
}

void MoeStats::add(const MoeStats& o) {
  aux_loss += o.aux_loss, z_loss += o.z_loss, routed += o.routed, dropped += o.dropped;
  if (o.min_load >= 0) min_load = min_load < 0 ? o.min_load : std::min(min_load, o.min_load);
  max_load = std::max(max_load, o.max_load);
  imbalance_sum += o.imbalance_sum, routings += o.routings;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t hash_name(const std::string& s) {  // FNV-1a: stable across builds and platforms
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}
// A standard normal from one 64-bit draw (Box-Muller on its two 32-bit halves).
float normal_from(uint64_t r) {
  const double u1 = (static_cast<double>(r >> 32) + 1.0) / 4294967297.0;
  const double u2 = static_cast<double>(r & 0xffffffffull) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}
}  // namespace

Kept take_kept(Carver& cv, int64_t n, int64_t group) {
  Kept k;
  k.n = n, k.group = group;
  if (group > 0) {
    k.q = cv.take<int8_t>(n);
    k.scales = cv.take<float>(n / group);
  } else {
    k.f = cv.take<float>(n);
  }
  return k;
}

Kept first_values(const Kept& k, int64_t n) {
  if (n > k.n || (k.quantized() && n % k.group != 0))
    throw std::logic_error("first_values: " + std::to_string(n) + " of " + std::to_string(k.n) + " values in groups of " +
                           std::to_string(k.group));
  Kept first = k;
  first.n = n;
  return first;
}

void store(const UnitArgs& a, const Kept& k, const char* name) {
  if (!k.quantized()) return;
  a.backend->quantize_int8(k.q, k.scales, k.f, k.n, k.group, a.act_quant.stochastic,
                           splitmix64(a.quant_key ^ hash_name(name)));
}

const float* load(const UnitArgs& a, const Kept& k, float* scratch) {
  if (!k.quantized()) return k.f;
  a.backend->dequantize_int8(scratch, k.q, k.scales, k.n, k.group);
  return scratch;
}

void init_unit(const model::UnitDesc& u, uint64_t seed, float* dst, int64_t begin, int64_t end) {
  for (const auto& p : u.params) {
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
    if (lo >= hi) continue;
    // Rows past the real vocabulary are padding: zero, so they never win a softmax.
    const int64_t real = p.exported_numel();
    const uint64_t key = splitmix64(seed ^ hash_name(p.name));
#pragma omp parallel for schedule(static)
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t e = i - p.offset;
      float v = 0.0f;
      if (e < real) v = p.init.std > 0 ? p.init.std * normal_from(splitmix64(key + static_cast<uint64_t>(e))) : p.init.value;
      dst[i - begin] = v;
    }
  }
}

}  // namespace shardlm::layers
