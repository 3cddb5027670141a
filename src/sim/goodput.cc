#include "sim/goodput.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace shardlm::sim {

double level_kept(double rate, double interval_s, double save_s, double restart_s) {
  if (interval_s <= 0) return 0;
  if (rate <= 0) return interval_s / (interval_s + save_s);
  // expm1 keeps the small-λ case exact: E = e^{λR} (e^{λ(τ+C)} − 1) / λ.
  const double expected = std::exp(rate * restart_s) * std::expm1(rate * (interval_s + save_s)) / rate;
  return interval_s / expected;
}

double young_interval(double save_s, double rate) {
  return rate > 0 ? std::sqrt(2 * save_s / rate) : std::numeric_limits<double>::infinity();
}

namespace {

// The whole number of steps between saves that keeps most: the kept fraction is unimodal in τ, so
// the best whole step count is next to the continuous optimum, found by golden-section search.
GoodputLevel best_level(double rate, double save_s, double restart_s, double step_s) {
  GoodputLevel l;
  l.rate = rate, l.save_s = save_s, l.restart_s = restart_s;
  l.young_s = young_interval(save_s, rate);
  if (rate <= 0) {  // never fails: never save (the interval is unbounded)
    l.every_steps = 0, l.kept = 1;
    return l;
  }
  auto kept = [&](double tau) { return level_kept(rate, tau, save_s, restart_s); };
  double lo = step_s, hi = std::max(4 * l.young_s, 4 * step_s);
  for (int i = 0; i < 200 && hi - lo > 1e-9 * hi; ++i) {
    const double a = lo + (hi - lo) * 0.381966, b = lo + (hi - lo) * 0.618034;
    if (kept(a) < kept(b)) lo = a;
    else hi = b;
  }
  const double steps = std::max(1.0, std::floor(lo / step_s));
  l.every_steps = static_cast<int64_t>(kept(steps * step_s) >= kept((steps + 1) * step_s) ? steps : steps + 1);
  l.interval_s = static_cast<double>(l.every_steps) * step_s;
  l.kept = kept(l.interval_s);
  return l;
}

void check(double v, double lo, double hi, const std::string& what) {
  if (!std::isfinite(v) || v < lo || v > hi)
    throw std::invalid_argument(what + ": must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                                std::to_string(v));
}

}  // namespace

bool snapshot_survives_node_loss(int64_t world, int64_t per_node, int64_t parity_group) {
  if (world <= 1 || per_node < 1) return false;
  const int64_t nodes = (world + per_node - 1) / per_node;
  for (int64_t n = 0; n < nodes; ++n) {
    auto lost = [&](int64_t r) { return r / per_node == n; };
    for (int64_t r = n * per_node; r < std::min(world, (n + 1) * per_node); ++r) {
      if (parity_group <= 0) {
        const int64_t stride = per_node < world && world % per_node == 0 ? per_node : 1;
        if (lost((r - stride + world) % world)) return false;  // the partner copy went with it
        continue;
      }
      const int64_t first = r / parity_group * parity_group;
      if (lost((first + parity_group) % world)) return false;  // the parity went with it
      for (int64_t m = first; m < first + parity_group; ++m)
        if (m != r && lost(m)) return false;  // XOR rebuilds one lost member, not two
    }
  }
  return true;
}

Goodput goodput(const GoodputInput& in) {
  check(in.step_s, 1e-9, 1e9, "step time (s)");
  check(in.mtbf_hours, 1e-6, 1e12, "--mtbf-hours");
  check(in.snapshot_survives, 0, 1, "--snapshot-survives");
  check(in.restart_s, 0, 1e9, "--restart-s");
  check(in.checkpoint_s, 0, 1e12, "checkpoint time (s)");
  check(in.snapshot_s, 0, 1e12, "snapshot time (s)");
  if (in.nodes < 1) throw std::invalid_argument("nodes: must be >= 1");
  const double rate = in.nodes / (in.mtbf_hours * 3600);
  const bool snapshots = in.snapshot_s > 0 && in.snapshot_survives > 0;
  const double q = snapshots ? in.snapshot_survives : 0;
  // Without snapshots every failure falls back to the disk checkpoint.
  Goodput g;
  g.checkpoint = best_level(rate, in.checkpoint_s, in.restart_s + in.checkpoint_read_s, in.step_s);
  g.fraction = g.checkpoint.kept;
  if (!snapshots) return g;
  // With them, where they pay for themselves (a snapshot that costs more than the work it saves
  // on the failures it recovers is not taken).
  Goodput s;
  s.checkpoint = best_level((1 - q) * rate, in.checkpoint_s, in.restart_s + in.checkpoint_read_s, in.step_s);
  s.snapshot = best_level(q * rate, in.snapshot_s, in.restart_s + in.snapshot_s, in.step_s);
  s.fraction = s.checkpoint.kept * s.snapshot.kept;
  return s.fraction > g.fraction ? s : g;
}

}  // namespace shardlm::sim
