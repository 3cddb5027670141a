#include "run/calibrate.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/model.h"
#include "tensor/disk_store.h"
#include "tensor/memory.h"

namespace shardlm::run {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of `reps` back-to-back calls of `f`, the backend's queue drained before and after: a
// device's kernels return before they run, and the clock must see them done.
template <class F>
double timed(const kernels::Backend& k, F& f, int reps) {
  k.synchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) f();
  k.synchronize();
  return seconds_since(t0);
}

// Calls of `f` per timed sample: one on the host (each call's own time); on a device enough for
// about a millisecond, since a kernel of a few microseconds timed alone would read mostly its
// launch and the synchronisation, while a training step queues its kernels back to back.
template <class F>
int reps_for(const kernels::Backend& k, F& f) {
  if (k.host_memory()) return 1;
  const double one = timed(k, f, 1);
  return static_cast<int>(std::clamp(1e-3 / std::max(one, 1e-7), 1.0, 1000.0));
}

// Best time of one call of `f` over at least 3 samples and ~0.2 s (the first call untimed: pools
// and clocks ramp up).
template <class F>
double best_seconds(const kernels::Backend& k, F f) {
  f();
  const int reps = reps_for(k, f);
  double best = 1e30, spent = 0;
  for (int rep = 0; rep < 3 || (spent < 0.2 && rep < 50); ++rep) {
    const double s = timed(k, f, reps);
    best = std::min(best, s / reps), spent += s;
  }
  return best;
}

// A buffer of the backend's memory for the kernels timed here.
Buffer workspace(const kernels::Backend& k, int64_t bytes, Buffer::Fill fill = Buffer::Fill::zero) {
  return k.alloc(MemCategory::workspace, static_cast<size_t>(bytes), fill);
}

// `values` in a buffer of the backend's memory: uploaded, as a device's memory is not the host's
// to write (the CPU backend's upload is a copy).
template <class T>
Buffer uploaded(const kernels::Backend& k, const std::vector<T>& values) {
  Buffer b = workspace(k, static_cast<int64_t>(sizeof(T) * values.size()), Buffer::Fill::none);
  k.upload(b.data(), values.data(), b.bytes());
  return b;
}

// n floats, each `v`, in the backend's memory.
Buffer floats(const kernels::Backend& k, int64_t n, float v) {
  return uploaded(k, std::vector<float>(static_cast<size_t>(n), v));
}

// A block's GEMM (small's qkv at B=4, T=256: 1024 x 384 x 1152, about 1 GFLOP): the compute
// timed beside collectives and beside disk copies, against alone.
class BlockGemm {
 public:
  explicit BlockGemm(const kernels::Backend& k)
      : k_(k), x_(workspace(k, 4 * kM * kK)), w_(workspace(k, 4 * kK * kN)), y_(workspace(k, 4 * kM * kN)) {}
  void operator()() {
    k_.dense_forward(y_.f32(), x_.f32(), w_.f32(), kM, kK, kN);
    k_.synchronize();
  }
  // Median of ten runs after one untimed.
  double alone() {
    (*this)();
    std::vector<double> times;
    for (int i = 0; i < 10; ++i) {
      const auto t0 = Clock::now();
      (*this)();
      times.push_back(seconds_since(t0));
    }
    return median(times);
  }
  // Median time of the runs wholly inside `busy` (run on another thread; it ends by returning);
  // 0 where none fell inside it.
  template <class F>
  double beside(F busy) {
    std::atomic<bool> done{false};
    std::thread other([&] {
      busy();
      done = true;
    });
    std::vector<double> times;
    while (!done) {
      const auto t0 = Clock::now();
      (*this)();
      if (!done) times.push_back(seconds_since(t0));
    }
    other.join();
    return times.empty() ? 0 : median(times);
  }

 private:
  static constexpr int64_t kM = 1024, kK = 384, kN = 1152;
  const kernels::Backend& k_;
  Buffer x_, w_, y_;
};

// Median time of one call of `f` over at least 5 samples and ~0.3 s (the first call untimed),
// each sample starting from caches another 64 MiB has passed through: what a kernel meets inside
// a training step, where the weights and activations of every other unit pass between its runs,
// on a machine whose speed varies (the best warm run would be optimistic).
template <class F>
double typical_seconds(const kernels::Backend& k, F f) {
  // From the pool's cache after the first call: allocating it costs no page faults then.
  Buffer other = workspace(k, 64 << 20, Buffer::Fill::none);
  f();
  const int reps = reps_for(k, f);
  std::vector<double> times;
  double spent = 0;
  while (times.size() < 5 || (spent < 0.3 && times.size() < 50)) {
    k.zero(other.data(), other.bytes());
    const double s = timed(k, f, reps);
    times.push_back(s / reps);
    spent += s;
  }
  return median(times);
}

// FLOP/s of one (N, C) × (C, OC) GEMM.
double gemm_flops(const kernels::Backend& k, int64_t N, int64_t C, int64_t OC) {
  Buffer a = floats(k, N * C, 0.5f), w = floats(k, OC * C, 0.25f), out = workspace(k, 4 * N * OC);
  return 2.0 * N * C * OC / best_seconds(k, [&] { k.dense_forward(out.f32(), a.f32(), w.f32(), N, C, OC); });
}

json fig(double v, const std::string& source) { return {{"value", v}, {"source", source}}; }

// Forward and backward FLOP/s of one unit GEMM with the kernels its layers run: Conv1D linear
// (GPT-2 blocks), nn.Linear dense (LLaMA blocks), or the head fused with its loss (one task,
// 6·M·K·N FLOPs: both rates are its rate).
std::pair<double, double> unit_gemm_flops(const kernels::Backend& k, model::UnitKind kind, const model::GemmShape& g,
                                          int64_t padded_vocab) {
  const int64_t M = g.M, K = g.K, N = g.N;
  if (model::is_head(kind)) {
    const int64_t chunk = model::detail::head_chunk_rows(M);
    Buffer x = floats(k, M * K, 0.5f), w = floats(k, padded_vocab * K, 0.01f), dx = workspace(k, 4 * M * K),
           dw = workspace(k, 4 * padded_vocab * K), scratch = workspace(k, 4 * k.head_scratch(chunk, padded_vocab));
    std::vector<int32_t> host_targets(M);
    for (int64_t i = 0; i < M; ++i) host_targets[i] = static_cast<int32_t>(i % N);
    const Buffer targets = uploaded(k, host_targets);
    const double rate = g.flops() * 3 / typical_seconds(k, [&] {
      k.lm_head_cross_entropy(dx.f32(), dw.f32(), x.f32(), w.f32(), targets.as<int32_t>(), M, K, N, padded_vocab,
                              1.0f / M, chunk, scratch.f32(), nullptr);
    });
    return {rate, rate};
  }
  const bool conv1d = kind == model::UnitKind::gpt2_block;
  Buffer x = floats(k, M * K, 0.5f), w = floats(k, K * N, 0.25f), b = workspace(k, 4 * N), y = floats(k, M * N, 0.125f),
         dx = workspace(k, 4 * M * K), dw = workspace(k, 4 * K * N), db = workspace(k, 4 * N);
  const double forward = g.flops() / typical_seconds(k, [&] {
    if (conv1d) k.linear_forward(y.f32(), x.f32(), w.f32(), b.f32(), M, K, N);
    else k.dense_forward(y.f32(), x.f32(), w.f32(), M, K, N);
  });
  const double backward = 2 * g.flops() / typical_seconds(k, [&] {
    if (conv1d) k.linear_backward(dx.f32(), dw.f32(), db.f32(), y.f32(), x.f32(), w.f32(), M, K, N);
    else k.dense_backward(dx.f32(), dw.f32(), y.f32(), x.f32(), w.f32(), M, K, N);
  });
  return {forward, backward};
}

// Bytes per second of the blocks' pointwise kernels as the cost model counts them (each array
// read or written once): layer norm, RMSNorm, GELU, SwiGLU and the residual add, forward and
// backward, over a block's activations (N rows, width C, MLP width F; by default small's at B=4,
// T=256: 1024 x 384 x 1536): on a CPU mostly cache resident, as in training, and the
// transcendental ones compute-bound, as in training; on a GPU at the run's own size, since a
// kernel over small arrays there reads mostly its launch.
double pointwise_bandwidth(const kernels::Backend& k, int64_t N, int64_t C, int64_t F) {
  const int64_t NC = N * C, NF = N * F;
  Buffer x = floats(k, NF * 2, 0.5f), y = floats(k, NF * 2, 0.25f), z = floats(k, NF * 2, 0.125f), w = floats(k, F, 1.0f),
         bias = floats(k, F, 0.0f), dw = floats(k, F, 0.0f), db = floats(k, F, 0.0f), mean = floats(k, N, 0.0f),
         rstd = floats(k, N, 1.0f);
  double bytes = 0, seconds = 0;
  auto time = [&](double moved, auto f) { bytes += 4 * moved, seconds += typical_seconds(k, f); };
  time(2.0 * NC, [&] { k.layernorm_forward(y.f32(), mean.f32(), rstd.f32(), x.f32(), w.f32(), bias.f32(), N, C); });
  time(3.0 * NC, [&] { k.layernorm_backward(z.f32(), dw.f32(), db.f32(), y.f32(), x.f32(), w.f32(), mean.f32(), rstd.f32(), N, C); });
  time(2.0 * NC, [&] { k.rmsnorm_forward(y.f32(), rstd.f32(), x.f32(), w.f32(), N, C, 1e-5f); });
  time(3.0 * NC, [&] { k.rmsnorm_backward(z.f32(), dw.f32(), y.f32(), x.f32(), w.f32(), rstd.f32(), N, C); });
  time(2.0 * NF, [&] { k.gelu_forward(y.f32(), x.f32(), NF); });
  time(3.0 * NF, [&] { k.gelu_backward(z.f32(), y.f32(), x.f32(), NF); });
  time(3.0 * NF, [&] { k.swiglu_forward(y.f32(), x.f32(), N, F); });
  time(5.0 * NF, [&] { k.swiglu_backward(z.f32(), y.f32(), x.f32(), N, F); });
  time(3.0 * NC, [&] { k.residual_forward(z.f32(), x.f32(), y.f32(), NC); });
  return bytes / seconds;
}

// Forward and backward FLOP/s (as the model counts them) of a block's causal attention.
std::pair<double, double> attention_flops(const kernels::Backend& k, const model::ModelConfig& c, const model::Shape& s,
                                          double flops, int threads) {
  const int64_t B = s.B, T = s.T, NH = c.n_head, NKV = c.n_kv_head, HS = c.head_size();
  const int64_t qkv_elems = B * T * (NH + 2 * NKV) * HS, out_elems = B * T * NH * HS;
  std::vector<float> host_qkv(qkv_elems);
  for (int64_t i = 0; i < qkv_elems; ++i) host_qkv[i] = 0.01f * static_cast<float>(i % 97);
  Buffer qkv = uploaded(k, host_qkv), dqkv = workspace(k, 4 * qkv_elems), out = workspace(k, 4 * out_elems),
         dout = floats(k, out_elems, 0.001f), lse = workspace(k, 4 * B * NH * T),
         scratch = workspace(k, 4 * k.attention_backward_scratch(B, T, NH, NKV, HS, threads));
  const double forward =
      flops / typical_seconds(k, [&] { k.attention_forward(out.f32(), lse.f32(), qkv.f32(), B, T, NH, NKV, HS); });
  const double backward = 2 * flops / typical_seconds(k, [&] {
    k.attention_backward(dqkv.f32(), dout.f32(), qkv.f32(), out.f32(), lse.f32(), B, T, NH, NKV, HS, scratch.f32());
  });
  return {forward, backward};
}

// gemm_rates and attention_rates: each distinct weight GEMM of the models' first block and head,
// and the first block's attention, each model at its own batch and sequence, at each thread
// count of `counts`.
std::pair<json, json> kernel_rates(const kernels::Backend& k, const std::vector<GemmModel>& models,
                                   const std::vector<int>& counts) {
  json rates = json::array(), attention = json::array();
  for (int t : counts) {
    k.init_compute(t);
    std::vector<std::tuple<int64_t, int64_t, int64_t>> seen;
    std::vector<std::pair<int64_t, int64_t>> seen_attention;
    for (const GemmModel& m : models) {
      const model::ModelDesc desc = model::describe(model::model_preset(m.name));
      const model::Shape shape{m.batch, m.seq, 4, t};
      for (size_t u = 0; u < desc.units.size(); ++u) {
        const model::UnitKind kind = desc.units[u].kind;
        if (!(model::is_head(kind) || desc.units[u].layer == 0)) continue;
        const model::UnitCosts costs = desc.costs(static_cast<int>(u), shape);
        const int64_t HS = desc.config.head_size();
        if (costs.attention_flops > 0 &&
            std::find(seen_attention.begin(), seen_attention.end(), std::make_pair(shape.T, HS)) == seen_attention.end()) {
          seen_attention.emplace_back(shape.T, HS);
          const auto [forward, backward] = attention_flops(k, desc.config, shape, costs.attention_flops, t);
          attention.push_back({{"t", shape.T}, {"hs", HS}, {"threads", t}, {"forward", forward}, {"backward", backward}});
        }
        for (const model::GemmShape& g : costs.gemms) {
          if (std::find(seen.begin(), seen.end(), std::make_tuple(g.M, g.K, g.N)) != seen.end()) continue;
          seen.emplace_back(g.M, g.K, g.N);
          const auto [forward, backward] = unit_gemm_flops(k, kind, g, desc.config.padded_vocab());
          rates.push_back({{"m", g.M}, {"k", g.K}, {"n", g.N}, {"threads", t}, {"forward", forward}, {"backward", backward}});
        }
      }
    }
  }
  k.init_compute(counts.back());
  return {rates, attention};
}

// The profile entry of one collective from its (S·factor, seconds) points. all_to_all's time is
// latency · (n−1) + S·factor/busBw (each rank sends n−1 messages): its latency is the fitted
// intercept over n−1. On one rank there is nothing to time: the entry says so.
json collective_entry(const std::vector<double>& xs, const std::vector<double>& ts, const std::string& name,
                      bool per_peer, int n, double memory_bw, bool judge, const std::string& here, size_t num_sizes) {
  if (n <= 1)  // collectives_measured: false says so to whoever reads the profile
    return {{"latency_s", fig(0, "not measured: one rank has no collectives; 0 stands in")},
            {"bus_bw", fig(memory_bw, "not measured: one rank has no collectives; the memory bandwidth stands in")}};
  const LineFit f = fit_alpha_beta(xs, ts);
  // Rank 0's figures are the ones written: it judges them. The n ranks copy at once, each at up to
  // the memory bandwidth one rank measured (with one compute thread, far below the machine's).
  if (judge) {
    std::string points;  // what was timed, for whoever reads a refusal
    for (size_t i = 0; i < xs.size(); ++i)
      points += (i ? ", " : "") + std::to_string(static_cast<int64_t>(xs[i])) + " B " + std::to_string(ts[i] * 1e3) + " ms";
    check_fit(f, n * memory_bw, name + " on " + std::to_string(n) + " ranks (S·factor and median time: " + points + ")");
  }
  const std::string line = per_peer ? "t = a·(n−1) + S·factor/busBw" : "t = a + S·factor/busBw";
  return {{"latency_s", fig(per_peer ? f.alpha / (n - 1) : f.alpha,
                            here + ": intercept of " + line + (per_peer ? ", over n−1 (per peer message)" : ""))},
          {"bus_bw", fig(f.bw, here + ": slope of " + line + ", " + std::to_string(num_sizes) + " sizes")}};
}

}  // namespace

namespace {
// The models of --gemm-models ("none": no rates).
std::vector<GemmModel> gemm_models_of(const CalibrateOptions& o) {
  std::vector<GemmModel> out;
  if (o.gemm_models == std::vector<std::string>{"none"}) return out;
  for (const std::string& m : o.gemm_models) out.push_back(parse_gemm_model(m));
  return out;
}

}  // namespace

void check_calibrate_options(const CalibrateOptions& o) {
  if (o.iters < 1 || o.iters > kMaxIters)
    throw std::invalid_argument("--iters: must be in [1, " + std::to_string(kMaxIters) + "], got " + std::to_string(o.iters));
  (void)gemm_models_of(o);  // each named model and shape checked
  if (o.sizes.empty()) return;  // the default sizes
  std::string list;
  for (int64_t s : o.sizes) {
    if (!list.empty()) list += ',';
    list += std::to_string(s / 1024);
    if (s < 1024 || s > kMaxSize || s % 1024 != 0)
      throw std::invalid_argument("--sizes-kib: " + std::to_string(s / 1024) + " is not a whole number of KiB in [1, " +
                                  std::to_string(kMaxSize / 1024) + "] (each rank holds two buffers of the size)");
  }
  const auto [smallest, largest] = std::minmax_element(o.sizes.begin(), o.sizes.end());
  if (*smallest == *largest || *largest < kMinLargestSize || *largest < kMinSizeSpread * *smallest)
    throw std::invalid_argument("--sizes-kib " + list + ": a bandwidth fit needs at least two different sizes, the largest >= " +
                                std::to_string(kMinLargestSize / 1024) + " KiB (where bandwidth, not latency, sets the time) and >= " +
                                std::to_string(kMinSizeSpread) + " x the smallest (default 4,16,...,262144)");
}

LineFit fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t) {
  // Least squares of t = a + b·x in relative error (each point weighted 1/t²), so that the
  // sizes from 4 KiB to 256 MiB count alike: unweighted, a few per cent of noise on the largest
  // time would swamp every small size's latency. bw = 1/b. A negative intercept is 0.
  double floor = 0;
  for (double ti : t)
    if (ti > 0 && (floor == 0 || ti < floor)) floor = ti;
  double sw = 0, sx = 0, st = 0, sxx = 0, sxt = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ti = std::max(t[i], floor), w = ti > 0 ? 1 / (ti * ti) : 1;
    sw += w, sx += w * x[i], st += w * t[i], sxx += w * x[i] * x[i], sxt += w * x[i] * t[i];
  }
  const double den = sw * sxx - sx * sx;
  double b = den > 0 ? (sw * sxt - sx * st) / den : 0, a = (st - b * sx) / sw;
  if (a < 0) {  // refit through the origin
    a = 0;
    b = sxx > 0 ? sxt / sxx : 0;
  }
  return {a, b > 0 ? 1.0 / b : std::numeric_limits<double>::infinity()};
}

void check_fit(const LineFit& f, double memory_bw, const std::string& what) {
  auto refuse = [&](const std::string& why) {
    throw std::runtime_error("calibrate: " + what + ": " + why +
                             "; measure again on a quieter machine, with larger --sizes-kib or more --iters");
  };
  if (!std::isfinite(f.bw) || f.bw <= 0) refuse("the times do not grow with the size (no bandwidth to fit)");
  if (f.bw > memory_bw)
    refuse("the fitted bus bandwidth " + std::to_string(f.bw) + " bytes/s is above what the ranks' memory bandwidth allows, " +
           std::to_string(memory_bw));
  if (!(f.alpha >= 0 && f.alpha <= kMaxLatencySeconds))
    refuse("the fitted latency " + std::to_string(f.alpha) + " s is not in [0, " + std::to_string(kMaxLatencySeconds) + "] s");
}

namespace {
// Every rank measures at once, as in training; where ranks × threads exceed the cores, each thread
// had a share of one and its rates are that much lower. The cost model time-slices the cores
// itself (by the simulated layout's busy threads), so per-thread figures are stated as if alone
// on a core: multiplied back by this.
double time_slicing(int ranks, int threads) {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1.0, ranks * threads / cores);
}

void undo_time_slicing(json& rows, int ranks) {
  for (json& r : rows) {
    const double f = time_slicing(ranks, r["threads"].get<int>());
    r["forward"] = r["forward"].get<double>() * f;
    r["backward"] = r["backward"].get<double>() * f;
  }
}
}  // namespace

namespace {

// The disk under `dir` as the disk tier uses it: one 64 MiB file through DiskStore (io_uring and
// O_DIRECT where the kernel and filesystem allow, each transfer checksummed), 256 single 4 KiB
// reads at scattered offsets for a request's latency, then written and read in 4 MiB transfers
// (best of three passes). Then as a training step meets it: the file written and read 16 times on
// one thread while block GEMMs run on the compute threads, which gives how much slower each runs
// beside the other.
struct DiskFigures {
  double read_bw = 0, write_bw = 0, latency_s = 0;
  double compute_slowdown = 1;  // a GEMM's time beside the copies over alone
  double disk_slowdown = 1;     // the copies' time beside GEMMs over alone (median passes)
  std::string how;
};
DiskFigures measure_disk(const std::string& dir, bool dir_was_there, const kernels::Backend& k, int rank) {
  const int64_t file_bytes = int64_t{64} << 20, chunk = int64_t{4} << 20;
  DiskFigures d;
  DiskStoreOptions options;
  options.remove_dir = !dir_was_there;
  DiskStore store(dir, options, "calibrate-" + std::to_string(rank));
  d.how = store.describe();
  const int f = store.create("calibrate-" + std::to_string(rank) + ".bin", file_bytes);
  Buffer buf = k.alloc(MemCategory::staging, chunk, Buffer::Fill::zero);
  auto write_pass = [&] {
    for (int64_t at = 0; at < file_bytes; at += chunk) store.write(f, at, buf.data(), chunk);
  };
  auto read_pass = [&] {
    for (int64_t at = 0; at < file_bytes; at += chunk) store.read(f, at, buf.data(), chunk);
  };
  // Before any pass writes: the store checks each read against the write it reads back, and a
  // 4 KiB read of a 4 MiB write is not one; creation's zeros it checks as zeros.
  const int n = 256;
  std::vector<double> one;
  for (int i = 0; i < n; ++i) {
    const int64_t at = (static_cast<int64_t>(i) * 7919 % (file_bytes / kDiskAlign)) * kDiskAlign;
    const auto t0 = Clock::now();
    store.read(f, at, buf.data(), kDiskAlign);
    one.push_back(seconds_since(t0));
  }
  std::vector<double> writes, reads, both;
  for (int pass = 0; pass < 3; ++pass) {
    auto t0 = Clock::now();
    write_pass();
    writes.push_back(seconds_since(t0));
    t0 = Clock::now();
    read_pass();
    reads.push_back(seconds_since(t0));
    both.push_back(writes.back() + reads.back());
  }
  d.write_bw = static_cast<double>(file_bytes) / *std::min_element(writes.begin(), writes.end());
  d.read_bw = static_cast<double>(file_bytes) / *std::min_element(reads.begin(), reads.end());
  d.latency_s = median(one);

  constexpr int kPasses = 16;  // ~1 GiB: long enough for many GEMMs to fall inside
  BlockGemm gemm(k);
  const double gemm_alone = gemm.alone();
  double copies_beside = 0;
  const double gemm_beside = gemm.beside([&] {
    const auto t0 = Clock::now();
    for (int pass = 0; pass < kPasses; ++pass) write_pass(), read_pass();
    copies_beside = seconds_since(t0);
  });
  if (gemm_beside > 0) d.compute_slowdown = std::max(1.0, gemm_beside / gemm_alone);
  d.disk_slowdown = std::max(1.0, copies_beside / (kPasses * median(both)));
  return d;
}

}  // namespace

namespace {

// "gpt2-124m at B=16, T=1024, small at B=4, T=256".
std::string models_text(const std::vector<GemmModel>& models) {
  std::string out;
  for (const GemmModel& m : models)
    out += (out.empty() ? "" : ", ") + m.name + " at B=" + std::to_string(m.batch) + ", T=" + std::to_string(m.seq);
  return out;
}

// A profile name from a device's: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3".
std::string slug(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c))) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "device" : out;
}

// Today as YYYY-MM-DD (UTC): the date a profile's provenance gives its measurement.
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[16];
  std::strftime(text, sizeof text, "%Y-%m-%d", &utc);
  return text;
}

// Bytes per second as GB/s, 3 significant digits.
std::string gb(double bytes_per_s) {
  std::ostringstream o;
  o.precision(3);
  o << bytes_per_s / 1e9;
  return o.str();
}

// Bytes per second of upload (host to device) and download (device to host) of 256 MiB from and to
// pageable host memory, as the run's copies use it (the best of a few).
const char* const kCollectives[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"};

std::pair<double, double> host_link(const kernels::Backend& k) {
  const int64_t bytes = int64_t{256} << 20;
  std::vector<char> host(static_cast<size_t>(bytes), 1);
  Buffer dev = workspace(k, bytes, Buffer::Fill::none);
  const double up = bytes / best_seconds(k, [&] { k.upload(dev.data(), host.data(), bytes); });
  const double down = bytes / best_seconds(k, [&] { k.download(host.data(), dev.data(), bytes); });
  return {up, down};
}

}  // namespace

GemmModel parse_gemm_model(const std::string& text) {
  const auto bad = [&](const std::string& why) {
    return std::invalid_argument("--gemm-models: '" + text + "': " + why + " (NAME or NAME:BxT, e.g. gpt2-124m:16x1024)");
  };
  GemmModel m;
  const size_t colon = text.find(':');
  m.name = text.substr(0, colon);
  if (m.name.empty()) throw bad("no model name");
  try {
    (void)model::model_preset(m.name);
  } catch (const std::exception& e) {
    throw bad(e.what());
  }
  if (colon == std::string::npos) return m;
  const std::string shape = text.substr(colon + 1);
  const size_t x = shape.find('x');
  const auto whole = [&](const std::string& s, int64_t& out) {
    if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
    out = std::stoll(s);
    return out > 0;
  };
  if (x == std::string::npos || !whole(shape.substr(0, x), m.batch) || !whole(shape.substr(x + 1), m.seq))
    throw bad("the shape is not BxT with B and T positive whole numbers");
  if (m.batch * m.seq > kMaxGemmRows) throw bad("B x T above " + std::to_string(kMaxGemmRows) + " rows");
  return m;
}

namespace {

// Each collective's latency and bus bandwidth on `world`, fitted over o.sizes (default 4 KiB to
// 256 MiB in steps of 4): a tier's figures. One rank has none to time. `judge`: this rank's
// figures are the ones written, and a fit that is no link is refused here.
json collective_tier(const kernels::Backend& k, comm::Communicator& world, const CalibrateOptions& o, double memory_bw,
                     const std::string& here, bool judge) {
  const int n = world.size();
  std::vector<int64_t> sizes = o.sizes;
  if (sizes.empty())
    for (int64_t s = 4096; s <= (256 << 20); s *= 4) sizes.push_back(s);
  json tier;
  for (int op = 0; op < 4; ++op) {
    std::vector<double> xs, ts;
    // One rank has no collectives: nothing to time (collective_entry says so).
    for (int64_t S : n > 1 ? sizes : std::vector<int64_t>{}) {
      const int64_t count = std::max<int64_t>(1, S / 4 / n);  // fp32 elements per rank (all_to_all: per peer)
      Buffer send(k.memory(), MemCategory::comm, 4 * count * n), recv(k.memory(), MemCategory::comm, 4 * count * n);
      std::vector<double> times;
      for (int it = 0; it <= o.iters; ++it) {
        world.barrier("calibrate")->wait();
        const auto t0 = Clock::now();
        if (op == 0) world.all_gather(send.f32(), recv.f32(), count, DType::fp32, "calibrate")->wait();
        if (op == 1) world.reduce_scatter(send.f32(), recv.f32(), count, DType::fp32, "calibrate")->wait();
        if (op == 2) world.all_reduce(send.f32(), count * n, DType::fp32, "calibrate")->wait();
        if (op == 3) world.all_to_all(send.f32(), recv.f32(), count, DType::fp32, "calibrate")->wait();
        if (it > 0) times.push_back(seconds_since(t0));
      }
      const double factor = n > 1 ? (op == 2 ? 2.0 : 1.0) * (n - 1) / n : 0;
      xs.push_back(4.0 * count * n * factor), ts.push_back(median(times));
    }
    tier[kCollectives[op]] =
        collective_entry(xs, ts, kCollectives[op], op == 3, n, memory_bw, judge, here, sizes.size());
  }
  return tier;
}

// How the launcher placed the ranks: `per_machine` consecutive ranks on each of `machines`
// machines (Communicator::machine), and how many machines share this rank's kernel (and cores).
struct Placement {
  int machines = 1, per_machine = 1, local_rank = 0, machines_on_kernel = 1;
};

// Collective. Throws std::invalid_argument on every rank unless each machine holds the same
// number of consecutive ranks (what the two tiers' groups, and the simulator's nodes, assume).
Placement placement_of(const kernels::Backend& k, comm::Communicator& world, const std::string& kernel_id) {
  const int n = world.size(), rank = world.rank(), machine = world.machine();
  std::unique_ptr<comm::Communicator> local = world.split(machine, rank);
  Placement p;
  p.per_machine = local->size(), p.local_rank = local->rank();
  // (machine, ranks on it, kernel) of every rank; a kernel as a 24-bit hash, exact in fp32.
  const float kernel = static_cast<float>(std::hash<std::string>{}(kernel_id) & 0xffffff);
  Buffer mine(k.memory(), MemCategory::comm, 3 * 4), all(k.memory(), MemCategory::comm, 3 * 4 * static_cast<size_t>(n));
  mine.f32()[0] = static_cast<float>(machine), mine.f32()[1] = static_cast<float>(p.per_machine), mine.f32()[2] = kernel;
  world.all_gather(mine.f32(), all.f32(), 3, DType::fp32, "calibrate placement")->wait();
  std::vector<float> machines_here;
  for (int r = 0; r < n; ++r) {
    const float* row = all.f32() + 3 * r;
    // A machine's id is its lowest rank: block placement puts rank r on machine r − r % K.
    if (static_cast<int>(row[1]) != p.per_machine || static_cast<int>(row[0]) != r - r % p.per_machine)
      throw std::invalid_argument("calibrate: the ranks are not the same number of consecutive ranks on each machine (rank " +
                                  std::to_string(r) + " is on the machine of rank " + std::to_string(static_cast<int>(row[0])) +
                                  "); place them in blocks, as mpirun does by default");
    if (row[2] == kernel && std::find(machines_here.begin(), machines_here.end(), row[0]) == machines_here.end())
      machines_here.push_back(row[0]);
  }
  p.machines = n / p.per_machine;
  p.machines_on_kernel = std::max<int>(1, static_cast<int>(machines_here.size()));
  return p;
}

// The tiers of ranks on several machines: intra_node on each machine's ranks (all machines at
// once; a stand-in where each holds one rank), inter_node across machines. inter_node's own
// figures are the widest group's (the world where machines hold several ranks), and its "groups"
// a row per shape measured: one rank a machine (every such group at once, as hybrid shard's
// replicate groups run side by side), and the world.
std::pair<json, json> two_tiers(const kernels::Backend& k, comm::Communicator& world, const CalibrateOptions& o,
                                const Placement& p, double memory_bw, const std::string& here) {
  const bool judge = world.rank() == 0;
  std::unique_ptr<comm::Communicator> local = world.split(world.rank() / p.per_machine, world.rank());
  std::unique_ptr<comm::Communicator> across = world.split(p.local_rank, world.rank());
  const std::string on_machine = here + ", the " + std::to_string(p.per_machine) + " ranks of each machine at once";
  json intra = collective_tier(k, *local, o, memory_bw, on_machine, judge);
  if (p.per_machine == 1)
    for (const char* op : kCollectives)
      for (const char* f : {"latency_s", "bus_bw"})
        intra[op][f]["source"] = "not measured: one rank a machine has no collective inside it (" + std::string(f == std::string("bus_bw") ? "the memory bandwidth" : "0") + " stands in)";
  world.barrier("calibrate")->wait();
  const std::string one_each = here + ", one rank on each of " + std::to_string(p.machines) + " machines" +
                               (p.per_machine > 1 ? " (" + std::to_string(p.per_machine) + " such groups at once)" : "");
  json row = collective_tier(k, *across, o, memory_bw, one_each, judge);
  json inter = row;
  row["ranks"] = p.machines, row["per_node"] = 1;
  inter["groups"] = json::array({row});
  if (p.per_machine > 1) {
    world.barrier("calibrate")->wait();
    const std::string all = here + ", all " + std::to_string(world.size()) + " ranks, " + std::to_string(p.per_machine) +
                            " on each of " + std::to_string(p.machines) + " machines";
    json wide = collective_tier(k, world, o, memory_bw, all, judge);
    inter = wide;
    wide["ranks"] = world.size(), wide["per_node"] = p.per_machine;
    inter["groups"] = json::array({row, wide});
  }
  return {intra, inter};
}

// A block-sized GEMM's time while large all-reduces run beside it, against alone (1 on one
// rank). The GEMM is a block's (small's qkv, about 1 GFLOP) and the all-reduces several, back to
// back, so that many GEMMs fall wholly inside them.
double comm_compute_slowdown(const kernels::Backend& k, comm::Communicator& world) {
  if (world.size() == 1) return 1;
  const int64_t count = 16 << 20;
  constexpr int kAllReduces = 6;
  Buffer buf(k.memory(), MemCategory::comm, 4 * count);
  BlockGemm gemm(k);
  world.barrier("calibrate")->wait();  // alone: every rank's GEMMs at once, nothing else
  const double alone = gemm.alone();
  world.barrier("calibrate")->wait();
  // As the executor runs them: a second thread issues the collectives and waits on them.
  const double beside = gemm.beside([&] {
    for (int i = 0; i < kAllReduces; ++i) world.all_reduce(buf.f32(), count, DType::fp32, "calibrate overlap")->wait();
  });
  return beside > 0 ? std::max(1.0, beside / alone) : 1;
}

// A large all-gather's time while block GEMMs run on the compute threads, against alone (1 on
// one rank): where the CPU drives the transport (TCP's stack, MPI's progress), the two share the
// cores. Every rank computes and communicates at once, as in a step.
double comm_slowdown_beside_compute(const kernels::Backend& k, comm::Communicator& world) {
  const int n = world.size();
  if (n == 1) return 1;
  const int64_t count = (4 << 20) / n;  // 16 MiB gathered
  constexpr int kGathers = 5;
  Buffer send(k.memory(), MemCategory::comm, 4 * count), recv(k.memory(), MemCategory::comm, 4 * count * n);
  auto gathers = [&] {
    std::vector<double> times;
    for (int i = 0; i <= kGathers; ++i) {
      world.barrier("calibrate")->wait();
      const auto t0 = Clock::now();
      world.all_gather(send.f32(), recv.f32(), count, DType::fp32, "calibrate beside compute")->wait();
      if (i > 0) times.push_back(seconds_since(t0));
    }
    return median(times);
  };
  const double alone = gathers();
  BlockGemm gemm(k);
  std::atomic<bool> stop{false};
  std::thread compute([&] {
    while (!stop) gemm();
  });
  const double beside = gathers();
  stop = true;
  compute.join();
  return std::max(1.0, beside / alone);
}

// What a profile says of where it runs: a device's link to its host and its memory, or a
// machine's ranks and cores.
void add_placement_figures(json& j, const kernels::Backend& k, const kernels::Backend::DeviceInfo& info, int ranks,
                           const Placement& placed, const std::string& here) {
  if (!k.host_memory()) {
    const auto [up, down] = host_link(k);
    j["host_link_bw"] = fig(std::min(up, down), here + ": the slower of upload " + gb(up) + " and download " + gb(down) +
                                                    " GB/s, 256 MiB to and from pageable host memory, best of a few");
    j["devices_per_node"] = fig(1, "one device measured");
    j["device_memory"] = info.memory_bytes > 0 ? fig(static_cast<double>(info.memory_bytes), here + ": the device's memory")
                                               : fig(0, "host memory: no per-device limit");
  } else {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (placed.machines == 1) {
      j["devices_per_node"] = fig(std::max(ranks, 1), "one machine: every rank is on it");
      j["cores_per_node"] = fig(cores, here + ": std::thread::hardware_concurrency");
    } else {
      j["devices_per_node"] = fig(placed.per_machine, here + ": the launcher placed " + std::to_string(placed.per_machine) +
                                                          " consecutive rank(s) on each of " + std::to_string(placed.machines) +
                                                          " machines");
      // Machines of one kernel (network namespaces, containers) time-slice its cores between them.
      j["cores_per_node"] = fig(std::max(1, cores / placed.machines_on_kernel),
                                here + ": std::thread::hardware_concurrency " + std::to_string(cores) +
                                    (placed.machines_on_kernel > 1 ? ", shared by the " + std::to_string(placed.machines_on_kernel) +
                                                                         " machines on this one kernel"
                                                                   : ""));
    }
    j["device_memory"] = fig(0, "host memory: no per-device limit");
  }
}

// The disk under `dir` (every rank its own file, as each rank's copies run), and how it and
// compute slow each other. A `dir` that was there before calibrate is left in place.
void add_disk_figures(json& j, const kernels::Backend& k, const std::string& dir, bool dir_was_there, int rank,
                      int threads, const std::string& here) {
  const DiskFigures d = measure_disk(dir, dir_was_there, k, rank);
  const std::string src = here + ": one 64 MiB file under " + dir + " (" + d.how + ")";
  j["disk_read_bw"] = fig(d.read_bw, src + ", 4 MiB reads, best of 3 passes");
  j["disk_write_bw"] = fig(d.write_bw, src + ", 4 MiB writes, best of 3 passes");
  j["disk_latency_s"] = fig(d.latency_s, src + ", the median of 256 single 4 KiB reads");
  const std::string beside = src + ": written and read 16 times on one thread while a 1024x384x1152 GEMM runs on the " +
                             std::to_string(threads) + " compute thread(s) back to back; ";
  j["compute_slowdown_beside_disk"] = fig(d.compute_slowdown, beside + "the GEMM's median time over alone");
  j["disk_slowdown_beside_compute"] = fig(d.disk_slowdown, beside + "the copies' time over alone (the median of 3 passes)");
}

}  // namespace

std::string calibrate(const kernels::Backend& k, comm::Communicator& world, const CalibrateOptions& o) {
  check_calibrate_options(o);
  // Before the ranks' first collective, so none has made it yet: a directory there is the user's.
  const bool offload_dir_was_there = !o.offload_dir.empty() && std::filesystem::exists(o.offload_dir);
  const std::vector<GemmModel> models = gemm_models_of(o);
  const int n = world.size();
  // A device's buffers are not the host's: its collectives would be staged through host memory
  // or NCCL's, neither of which these host collectives time, and the disk tier's copies go
  // through host memory too.
  const bool device = !k.host_memory();
  if (device && n > 1)
    throw std::invalid_argument("calibrate --device " + o.device + ": one rank only (its collectives are not measured; got " +
                                std::to_string(n) + " ranks)");
  if (device && !o.offload_dir.empty())
    throw std::invalid_argument("calibrate --device " + o.device + ": not with --offload-dir (the disk tier is the host's)");
  const kernels::Backend::DeviceInfo info = k.device_info();
  // Threads are the CPU's: a device's figures are the device's whatever --threads says.
  const int threads = device ? 1 : o.threads;
  k.init_compute(threads);
  // "NVIDIA H100 80GB HBM3, kernels cuda" (the CPU standing in for a device names itself once).
  const std::string what = info.name == k.name() ? info.name : info.name + ", kernels " + k.name();
  const std::string here =
      device ? "measured by shardlm calibrate --device " + o.device + " (" + what + ", " + info.gemm_dtype + " GEMMs)"
             : "measured by shardlm calibrate (" + std::to_string(n) + " rank(s) x " + std::to_string(threads) + " thread(s))";

  const double peak = gemm_flops(k, 2048, 2048, 2048);
  // The first model's block GEMMs (by default small's at B=4, T=256: N = 1024 rows): qkv, MLP up
  // and down.
  const GemmModel first = models.empty() ? GemmModel{"small"} : models.front();
  const int64_t rows = first.batch * first.seq, C = model::model_preset(first.name).n_embd;
  const double shapes = (gemm_flops(k, rows, C, 3 * C) + gemm_flops(k, rows, C, 4 * C) + gemm_flops(k, rows, 4 * C, C)) / 3;
  const int64_t elems = 16 << 20;
  Buffer a = workspace(k, 4 * elems), b = workspace(k, 4 * elems), c = workspace(k, 4 * elems);
  const double bw = 12.0 * elems / best_seconds(k, [&] { k.residual_forward(c.f32(), a.f32(), b.f32(), elems); });
  const double pointwise = pointwise_bandwidth(k, rows, C, 4 * C);
  json rates, attention;
  if (!models.empty()) {
    world.barrier("calibrate")->wait();  // every rank's kernels at once, as in training
    std::vector<int> counts{1};
    if (threads > 1) counts.push_back(threads);
    std::tie(rates, attention) = kernel_rates(k, models, counts);
    undo_time_slicing(rates, n);
    undo_time_slicing(attention, n);
  }
  const double sliced = time_slicing(n, threads);
  const Placement placed = placement_of(k, world, o.kernel_id);
  json intra, inter;
  if (placed.machines > 1) {
    std::tie(intra, inter) = two_tiers(k, world, o, placed, bw, here);
  } else {
    intra = inter = collective_tier(k, world, o, bw, here, world.rank() == 0);
    for (const char* op : kCollectives)
      for (const char* f : {"latency_s", "bus_bw"}) inter[op][f]["source"] = "no network here: the intra_node figure";
  }
  const double slowdown = comm_compute_slowdown(k, world);
  const double comm_slowdown = comm_slowdown_beside_compute(k, world);

  const std::string block = first.name + "'s block GEMMs (" + std::to_string(rows) + " rows)";
  json j{{"name", !o.name.empty() ? o.name : device ? slug(info.name) : "cpu-local"},
         {"description", device ? "one " + what + " (" + info.gemm_dtype +
                                      " GEMMs, fp32 storage), fitted by shardlm calibrate --device " + o.device +
                                      "; compute figures per device"
                                : "this machine, fitted by shardlm calibrate; compute figures per compute thread"},
         {"provenance", {{"source", "measured"}, {"date", today()}, {"detail", here}}},
         {"compute_dtype", info.gemm_dtype},
         // What the plan's activations take: every backend here stores fp32, bf16 GEMMs or not.
         {"activation_dtype", "fp32"},
         {"per_thread", !device},
         {"memory_bw", fig(bw, here + ": residual add over 64 MiB arrays")},
         {"comm_compute_slowdown",
          fig(slowdown, n > 1 ? here + ": a 1024x384x1152 GEMM beside 64 MiB all_reduces, the median against alone"
                              : "not measured: one rank has no collectives to overlap")},
         {"comm_slowdown_beside_compute",
          fig(comm_slowdown, n > 1 ? here + ": 16 MiB all_gathers beside 1024x384x1152 GEMMs on the compute threads, the median "
                                            "against alone"
                                   : "not measured: one rank has no collectives")},
         {"collectives_measured", n > 1},
         {"intra_node", intra},
         {"inter_node", inter}};
  // A device's figures are the device's; a CPU's per compute thread, as if each had its core
  // (sliced / threads is 1 on a device: one rank, one thread).
  const double per = sliced / threads;
  j["peak_flops"] = fig(peak * per, here + (device ? ": best 2048^3 GEMM (dense_forward), back to back"
                                                   : ": best 2048^3 GEMM, per thread, as if alone on a core"));
  j["fp32_peak_flops"] =
      info.gemm_dtype == "fp32"
          ? fig(peak * per, here + ": the same as peak_flops")
          : fig(peak * per, "not measured: the " + info.gemm_dtype + " peak stands in (calibrate --compute-dtype fp32 measures fp32 GEMMs)");
  j["gemm_efficiency"] = fig(std::min(1.0, shapes / peak), here + ": " + block + " against the 2048^3 peak");
  j["pointwise_bw"] = fig(pointwise * per, here + ": the blocks' pointwise kernels (norms, GELU, SwiGLU, residual add; forward "
                                                  "and backward) over " + first.name + "'s block activations" +
                                                  (device ? " at B=" + std::to_string(first.batch) + ", T=" +
                                                                std::to_string(first.seq)
                                                          : "") +
                                                  ", bytes read and written per second" + (device ? "" : ", per thread"));
  add_placement_figures(j, k, info, n, placed, here);
  if (!rates.is_null()) {
    const std::string per = device ? "FLOP/s per device" : "FLOP/s per rank";
    j["gemm_rates"] = {{"value", rates},
                       {"source", here + ": the weight GEMMs of " + models_text(models) +
                                      " with the kernels their layers run, " + per + " forward and backward"}};
    j["attention_rates"] = {{"value", attention},
                            {"source", here + ": the first block's causal attention of " + models_text(models) + ", " + per +
                                           " (2·B·T·T·C forward, twice that backward)"}};
  }
  if (!o.offload_dir.empty()) add_disk_figures(j, k, o.offload_dir, offload_dir_was_there, world.rank(), threads, here);
  return j.dump(2);
}

}  // namespace shardlm::run
