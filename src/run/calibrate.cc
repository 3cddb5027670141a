#include "run/calibrate.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

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

// Best time of `f` over at least 3 runs and ~0.2 s (the first untimed: pools and clocks ramp up).
template <class F>
double best_seconds(F f) {
  f();
  double best = 1e30, spent = 0;
  for (int rep = 0; rep < 3 || (spent < 0.2 && rep < 50); ++rep) {
    const auto t0 = Clock::now();
    f();
    const double s = seconds_since(t0);
    best = std::min(best, s), spent += s;
  }
  return best;
}

// FLOP/s of one (N, C) × (C, OC) GEMM.
double gemm_flops(const kernels::Backend& k, int64_t N, int64_t C, int64_t OC) {
  Buffer a(MemCategory::workspace, 4 * N * C), w(MemCategory::workspace, 4 * OC * C), out(MemCategory::workspace, 4 * N * OC);
  std::fill(a.f32(), a.f32() + N * C, 0.5f);
  std::fill(w.f32(), w.f32() + OC * C, 0.25f);
  return 2.0 * N * C * OC / best_seconds([&] { k.dense_forward(out.f32(), a.f32(), w.f32(), N, C, OC); });
}

json fig(double v, const std::string& source) { return {{"value", v}, {"source", source}}; }

}  // namespace

LineFit fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t) {
  // Least squares of t = a + b·x; bw = 1/b. A negative intercept (noise at small sizes) is 0.
  const double n = static_cast<double>(x.size());
  double sx = 0, st = 0, sxx = 0, sxt = 0;
  for (size_t i = 0; i < x.size(); ++i) sx += x[i], st += t[i], sxx += x[i] * x[i], sxt += x[i] * t[i];
  const double den = n * sxx - sx * sx;
  double b = den > 0 ? (n * sxt - sx * st) / den : 0, a = (st - b * sx) / n;
  if (a < 0) {  // refit through the origin
    a = 0;
    b = sxx > 0 ? sxt / sxx : 0;
  }
  return {a, b > 0 ? 1.0 / b : 1e30};
}

std::string calibrate(const kernels::Backend& k, comm::Communicator& world, const CalibrateOptions& o) {
  k.init_compute(o.threads);
  const int n = world.size();
  const std::string here = "measured by shardlm calibrate (" + std::to_string(n) + " rank(s) x " +
                           std::to_string(o.threads) + " thread(s))";

  const double peak = gemm_flops(k, 2048, 2048, 2048);
  // The block GEMMs of `small` at B=4, T=256 (N = 1024 rows): qkv, MLP up and down.
  const double shapes = (gemm_flops(k, 1024, 384, 1152) + gemm_flops(k, 1024, 384, 1536) + gemm_flops(k, 1024, 1536, 384)) / 3;
  const int64_t elems = 16 << 20;
  Buffer a(MemCategory::workspace, 4 * elems), b(MemCategory::workspace, 4 * elems), c(MemCategory::workspace, 4 * elems);
  const double bw = 12.0 * elems / best_seconds([&] { k.residual_forward(c.f32(), a.f32(), b.f32(), elems); });

  std::vector<int64_t> sizes = o.sizes;
  if (sizes.empty())
    for (int64_t s = 4096; s <= (64 << 20); s *= 4) sizes.push_back(s);
  json tier;
  const char* names[] = {"all_gather", "reduce_scatter", "all_reduce"};
  for (int op = 0; op < 3; ++op) {
    std::vector<double> xs, ts;
    for (int64_t S : sizes) {
      const int64_t count = std::max<int64_t>(1, S / 4 / n);  // fp32 elements per rank
      Buffer send(MemCategory::comm, 4 * count * n), recv(MemCategory::comm, 4 * count * n);
      std::vector<double> times;
      for (int it = 0; it <= o.iters; ++it) {
        world.barrier("calibrate")->wait();
        const auto t0 = Clock::now();
        if (op == 0) world.all_gather(send.f32(), recv.f32(), count, DType::fp32, "calibrate")->wait();
        if (op == 1) world.reduce_scatter(send.f32(), recv.f32(), count, DType::fp32, "calibrate")->wait();
        if (op == 2) world.all_reduce(send.f32(), count * n, DType::fp32, "calibrate")->wait();
        if (it > 0) times.push_back(seconds_since(t0));
      }
      const double factor = n > 1 ? (op == 2 ? 2.0 : 1.0) * (n - 1) / n : 0;
      xs.push_back(4.0 * count * n * factor), ts.push_back(median(times));
    }
    json entry;
    if (n > 1) {
      const LineFit f = fit_alpha_beta(xs, ts);
      entry = {{"latency_s", fig(f.alpha, here + ": intercept of t = a + S·factor/busBw")},
               {"bus_bw", fig(f.bw, here + ": slope of t = a + S·factor/busBw, " + std::to_string(sizes.size()) + " sizes")}};
    } else {
      entry = {{"latency_s", fig(0, "one rank: nothing to measure")}, {"bus_bw", fig(bw, "one rank: the memory bandwidth")}};
    }
    tier[names[op]] = entry;
  }

  // A GEMM's time with a large all-reduce running beside it, against alone.
  double slowdown = 1;
  if (n > 1) {
    const int64_t count = 16 << 20;
    Buffer buf(MemCategory::comm, 4 * count);
    Buffer x(MemCategory::workspace, 4 * 1024 * 1536), w(MemCategory::workspace, 4 * 1536 * 1536), y(MemCategory::workspace, 4 * 1024 * 1536);
    auto gemm = [&] { k.dense_forward(y.f32(), x.f32(), w.f32(), 1024, 1536, 1536); };
    const double alone = best_seconds(gemm);
    world.barrier("calibrate")->wait();
    // As the executor runs it: a second thread waits on the collective (and drives it).
    auto work = world.all_reduce(buf.f32(), count, DType::fp32, "calibrate overlap");
    std::atomic<bool> done{false};
    std::thread waiter([&] {
      work->wait();
      done = true;
    });
    std::vector<double> beside;
    while (!done && beside.size() < 50) {
      const auto t0 = Clock::now();
      gemm();
      if (!done) beside.push_back(seconds_since(t0));
    }
    waiter.join();
    if (!beside.empty()) slowdown = std::max(1.0, median(beside) / alone);
  }

  json j{{"name", o.name},
         {"description", "this machine, fitted by shardlm calibrate; compute figures per compute thread"},
         {"compute_dtype", "fp32"},
         {"per_thread", true},
         {"peak_flops", fig(peak / o.threads, here + ": best 2048^3 GEMM, per thread")},
         {"fp32_peak_flops", fig(peak / o.threads, here + ": the same as peak_flops")},
         {"gemm_efficiency", fig(std::min(1.0, shapes / peak), here + ": small's block GEMMs (1024 rows) against the 2048^3 peak")},
         {"memory_bw", fig(bw, here + ": residual add over 64 MiB arrays")},
         {"devices_per_node", fig(std::max(n, 1), "one machine: every rank is on it")},
         {"cores_per_node", fig(std::max(1u, std::thread::hardware_concurrency()), here + ": std::thread::hardware_concurrency")},
         {"device_memory", fig(0, "host memory: no per-device limit")},
         {"comm_compute_slowdown", fig(slowdown, here + ": a GEMM beside a 64 MiB all_reduce, against alone")},
         {"intra_node", tier},
         {"inter_node", tier}};
  for (const char* c : {"all_gather", "reduce_scatter", "all_reduce"})
    for (const char* f : {"latency_s", "bus_bw"}) j["inter_node"][c][f]["source"] = "no network here: the intra_node figure";
  return j.dump(2);
}

}  // namespace shardlm::run
