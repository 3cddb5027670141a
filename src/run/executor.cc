#include "run/executor.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "kernels/cpu.h"

namespace shardlm::run {

using plan::Op;
using plan::Stream;
using plan::Task;
using Clock = std::chrono::steady_clock;

CommGroups::CommGroups(comm::Communicator& world, const plan::Plan& plan) : world_(world) {
  if (plan.config.strategy == plan::Strategy::hybrid && plan.shard_size < world.size()) {
    const int G = plan.shard_size, r = world.rank();
    shard_ = world.split(r / G, r);
    replicate_ = world.split(r % G, r);
  }
}

comm::Communicator& CommGroups::get(plan::Group g) const {
  switch (g) {
    case plan::Group::world: return world();
    case plan::Group::shard: return shard();
    case plan::Group::replicate: return replicate();
  }
  return world();
}

Executor::Executor(const model::ModelDesc& desc, const plan::Plan& plan, const CommGroups& comms, int threads,
                   std::chrono::milliseconds timeout)
    : desc_(desc),
      plan_(plan),
      comms_(comms),
      timeout_(timeout),
      acts_(desc, plan.config.batch, plan.config.seq),
      ws_(desc, plan.config.batch, plan.config.seq, threads) {
  const plan::Strategy s = plan.config.strategy;
  sharded_params_ = s == plan::Strategy::fsdp || s == plan::Strategy::hybrid;
  sharded_grads_ = sharded_params_ || s == plan::Strategy::zero2;
  sharded_optimizer_ = s != plan::Strategy::ddp;
  shard_index_ = plan.shard_size > 1 ? comms.world().rank() % plan.shard_size : 0;
  const int64_t full = plan.layout.total, shard = full / plan.shard_size;
  params_ = Buffer(MemCategory::params, sizeof(float) * (sharded_params_ ? shard : full));
  grads_ = Buffer(MemCategory::grads, sizeof(float) * (sharded_grads_ ? shard : full));
  exp_avg_ = Buffer(MemCategory::optimizer, sizeof(float) * (sharded_optimizer_ ? shard : full));
  exp_avg_sq_ = Buffer(MemCategory::optimizer, sizeof(float) * (sharded_optimizer_ ? shard : full));
  trace_.rank = comms.world().rank();
  auto fault_step = [&](const char* var) -> int64_t {
    const char* v = std::getenv(var);
    int rank = -1;
    long long step = -1;
    if (v && std::sscanf(v, "%d:%lld", &rank, &step) == 2 && rank == comms.world().rank()) return step;
    return -1;
  };
  fault_skip_step_ = fault_step("SHARDLM_FAULT_SKIP_COLLECTIVE");
  fault_kill_step_ = fault_step("SHARDLM_FAULT_KILL");
  // Every rank's trace clock starts at the same moment (to within a barrier's latency), so the
  // ranks' slices line up in one timeline.
  comms.world().barrier("trace clock")->wait(timeout_);
  t0_ = Clock::now();
  sample_memory();
}

Executor::~Executor() = default;

double Executor::now_us() const { return std::chrono::duration<double, std::micro>(Clock::now() - t0_).count(); }

void Executor::sample_memory() {
  const MemSnapshot live = MemoryTracker::global().live();
  std::lock_guard<std::mutex> lock(trace_mu_);
  trace_.memory.push_back({now_us(), live.bytes});
}

Executor::Shard Executor::shard_of(int u) const {
  const auto& span = plan_.layout.units[u];
  const int64_t len = span.padded / plan_.shard_size;
  return {span.offset, len, shard_index_ * len};
}

float* Executor::local(const Buffer& buf, bool sharded, int u) const {
  const Shard s = shard_of(u);
  return sharded ? buf.f32() + s.unit_offset / plan_.shard_size : buf.f32() + s.unit_offset + s.begin;
}

float* Executor::full_params(int u) {
  if (!sharded_params_) return params_.f32() + plan_.layout.units[u].offset;
  std::lock_guard<std::mutex> lock(buffers_mu_);
  return dynamic_.at("gathered u" + std::to_string(u)).f32();
}

float* Executor::full_grads(int u) {
  if (!sharded_grads_) return grads_.f32() + plan_.layout.units[u].offset;
  std::lock_guard<std::mutex> lock(buffers_mu_);
  return dynamic_.at("grad u" + std::to_string(u)).f32();
}

void Executor::init_params(uint64_t seed) {
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(u);
    const int64_t begin = sharded_params_ ? s.begin : 0;
    const int64_t end = sharded_params_ ? s.begin + s.len : plan_.layout.units[u].padded;
    float* dst = sharded_params_ ? local(params_, true, u) : params_.f32() + s.unit_offset;
    layers::init_unit(desc_.units[u], desc_.config, seed, dst, begin, std::min(end, desc_.units[u].numel));
  }
}

void Executor::allocate(const Task& t) {
  if (t.allocs.empty()) return;
  {
    std::lock_guard<std::mutex> lock(buffers_mu_);
    // Gradient buffers accumulate and start at zero; what a collective fills whole need not.
    for (const auto& a : t.allocs)
      dynamic_[a.name] = Buffer(a.category, a.bytes, a.category == MemCategory::grads ? Buffer::Fill::zero : Buffer::Fill::none);
  }
  sample_memory();
}

void Executor::release(const Task& t) {
  if (t.frees.empty()) return;
  {
    std::lock_guard<std::mutex> lock(buffers_mu_);
    for (const auto& f : t.frees) dynamic_.erase(f);
  }
  sample_memory();
}

std::string Executor::label(const Task& t, int64_t step) const {
  std::string s = plan::to_string(t.op);
  if (t.op == Op::all_reduce && t.first_unit >= 0)
    s += " units " + desc_.units[t.first_unit].name + ".." + desc_.units[t.last_unit].name;
  else if (t.unit >= 0)
    s += " unit " + desc_.units[t.unit].name;
  return s + " step " + std::to_string(step);
}

// Sums a double over a communicator exactly and identically on every rank: gather every rank's
// bits, add in rank order.
double Executor::sum_over(comm::Communicator& c, double local, const std::string& label) {
  std::vector<double> all(c.size());
  c.all_gather(&local, all.data(), 2, DType::fp32, label)->wait(timeout_);
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

void Executor::run_comm(const Task& t, int64_t step) {
  if (step == fault_skip_step_) {  // a rank gone astray: never issues this collective
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  comm::Communicator& c = comms_.get(t.group);
  const std::string lbl = label(t, step);
  const bool bf16_params = plan_.config.param_bytes == 2, bf16_grads = plan_.config.reduce_bytes == 2;
  // bf16 collectives go through the task's staging buffer: [whole unit | one shard], as uint16.
  auto staging = [&]() {
    std::lock_guard<std::mutex> lock(buffers_mu_);
    return dynamic_.at(t.staging_buffer()).as<uint16_t>();
  };
  // All-reduce `n` floats in place, in bf16 when asked: cast, reduce, widen.
  auto all_reduce = [&](float* buf, int64_t n) {
    if (!bf16_grads) return c.all_reduce(buf, n, DType::fp32, lbl)->wait(timeout_);
    uint16_t* tmp = staging();
    kernels::fp32_to_bf16(tmp, buf, n);
    c.all_reduce(tmp, n, DType::bf16, lbl)->wait(timeout_);
    kernels::bf16_to_fp32(buf, tmp, n);
  };
  switch (t.op) {
    case Op::all_gather: {
      const Shard s = shard_of(t.unit);
      if (!bf16_params) {
        c.all_gather(local(params_, true, t.unit), full_params(t.unit), s.len, DType::fp32, lbl)->wait(timeout_);
        break;
      }
      uint16_t* whole = staging();
      uint16_t* mine = whole + s.len * plan_.shard_size;
      kernels::fp32_to_bf16(mine, local(params_, true, t.unit), s.len);
      c.all_gather(mine, whole, s.len, DType::bf16, lbl)->wait(timeout_);
      kernels::bf16_to_fp32(full_params(t.unit), whole, s.len * plan_.shard_size);
      break;
    }
    case Op::param_gather: {  // in place on the whole parameter buffer
      const Shard s = shard_of(t.unit);
      float* unit = params_.f32() + s.unit_offset;
      c.all_gather(unit + s.begin, unit, s.len, DType::fp32, lbl)->wait(timeout_);
      break;
    }
    case Op::reduce_scatter: {
      const Shard s = shard_of(t.unit);
      if (!bf16_grads) {
        c.reduce_scatter(full_grads(t.unit), local(grads_, true, t.unit), s.len, DType::fp32, lbl)->wait(timeout_);
        break;
      }
      uint16_t* whole = staging();
      uint16_t* mine = whole + s.len * plan_.shard_size;
      kernels::fp32_to_bf16(whole, full_grads(t.unit), s.len * plan_.shard_size);
      c.reduce_scatter(whole, mine, s.len, DType::bf16, lbl)->wait(timeout_);
      kernels::bf16_to_fp32(local(grads_, true, t.unit), mine, s.len);
      break;
    }
    case Op::all_reduce:
      if (t.first_unit >= 0) {  // a bucket: consecutive units, one contiguous range
        const int64_t begin = plan_.layout.units[t.first_unit].offset;
        const auto& last = plan_.layout.units[t.last_unit];
        all_reduce(grads_.f32() + begin, last.offset + last.padded - begin);
      } else {  // hybrid: this rank's gradient shard across the replicas
        all_reduce(local(grads_, true, t.unit), shard_of(t.unit).len);
      }
      break;
    default: throw std::logic_error("executor: " + t.name() + " is not a collective");
  }
}

void Executor::run_compute(const Task& t, int64_t step, const BatchFn& batch, float grad_scale, float grad_clip,
                           const AdamW& opt, int64_t adam_t, StepResult& result) {
  const layers::Dims d = layers::dims_of(desc_.config, plan_.config.batch, plan_.config.seq);
  const int U = static_cast<int>(desc_.units.size()), fin = U - 1;
  const auto& units = desc_.units;
  auto block_input = [&](int u) { return u == 1 ? acts_.embedded : acts_.block(u - 2).out; };
  switch (t.op) {
    case Op::forward:
      if (t.unit == 0) {
        batch(t.micro, acts_.inputs, acts_.targets);
        layers::embedding_forward(layers::embedding_view(units[0], full_params(0)), acts_.inputs, acts_.embedded, d);
      } else {
        layers::block_forward(layers::block_view(units[t.unit], full_params(t.unit)), block_input(t.unit),
                              acts_.block(t.unit - 1), d);
      }
      break;
    case Op::head: {
      const float* x = fin >= 2 ? acts_.block(fin - 2).out : acts_.embedded;
      const auto p = layers::final_norm_view(units[fin], full_params(fin));
      const auto g = layers::final_norm_view(units[fin], full_grads(fin));
      const auto emb_g = layers::embedding_view(units[0], full_grads(0));
      layers::final_norm_forward(p, x, acts_, d);
      result.loss_sum += layers::head_loss(p, layers::embedding_view(units[0], full_params(0)), x, acts_, d, ws_, &g,
                                           &emb_g, grad_scale);
      break;
    }
    case Op::backward:
      if (t.unit == 0) {
        layers::embedding_backward(layers::embedding_view(units[0], full_grads(0)), acts_.inputs, ws_.dresidual, d);
      } else {
        layers::block_backward(layers::block_view(units[t.unit], full_params(t.unit)),
                               layers::block_view(units[t.unit], full_grads(t.unit)), block_input(t.unit),
                               acts_.block(t.unit - 1), ws_, d);
      }
      break;
    case Op::grad_norm: {
      // Gradients are either whole and identical on every rank (DDP, ZeRO-1) or sharded over the
      // shard group (and identical across replicas): sum the squares over what is distinct.
      const int64_t n = grads_.bytes() / sizeof(float);
      double sq = kernels::sum_squares(grads_.f32(), n);
      if (sharded_grads_) sq = sum_over(comms_.shard(), sq, "grad_norm step " + std::to_string(step));
      result.grad_norm = std::sqrt(sq);
      if (grad_clip > 0 && result.grad_norm > grad_clip)
        kernels::scale(grads_.f32(), n, static_cast<float>(grad_clip / result.grad_norm));
      break;
    }
    case Op::optimizer:
      for (int u = 0; u < U; ++u) {
        const Shard s = shard_of(u);
        float* p = local(params_, sharded_params_, u);
        float* g = local(grads_, sharded_grads_, u);
        float* m = local(exp_avg_, sharded_optimizer_, u);
        float* v = local(exp_avg_sq_, sharded_optimizer_, u);
        const int64_t lo = sharded_optimizer_ ? s.begin : 0;
        const int64_t hi = sharded_optimizer_ ? s.begin + s.len : plan_.layout.units[u].padded;
        for (const auto& spec : units[u].params) {  // this shard's part of each parameter
          const int64_t a = std::max(lo, spec.offset), b = std::min(hi, spec.offset + spec.numel);
          if (a >= b) continue;
          kernels::adamw_update(p + (a - lo), g + (a - lo), m + (a - lo), v + (a - lo), b - a, opt.lr, opt.beta1,
                                opt.beta2, opt.eps, spec.decay ? opt.weight_decay : 0.0f, adam_t);
        }
      }
      break;
    default: throw std::logic_error("executor: " + t.name() + " is not a compute task");
  }
}

StepResult Executor::step(int64_t step, const BatchFn& batch, float grad_scale, float grad_clip, const AdamW& opt,
                          int64_t t) {
  StepResult result;
  if (step == fault_kill_step_) std::raise(SIGKILL);
  std::memset(grads_.data(), 0, grads_.bytes());
  const size_t n = plan_.tasks.size();
  std::vector<char> done(n, 0);
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr failure;
  bool stop = false;

  // Waits for a task's dependencies; returns ms spent waiting on the other stream's tasks.
  auto wait_deps = [&](const Task& task) {
    auto t0 = Clock::now();
    std::unique_lock<std::mutex> lock(mu);
    for (int dep : task.deps) {
      cv.wait(lock, [&] { return done[dep] || stop; });
      if (stop) return -1.0;
    }
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto finish = [&](const Task& task, double start_us) {
    const double end = now_us();
    {
      std::lock_guard<std::mutex> lock(trace_mu_);
      trace_.slices.push_back({task.name(&desc_), task.stream, step, start_us, end - start_us});
    }
    std::lock_guard<std::mutex> lock(mu);
    done[task.id] = 1;
    cv.notify_all();
  };
  auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failure) failure = e;
    stop = true;
    cv.notify_all();
  };

  std::thread comm_thread([&] {
    try {
      // This thread only casts for bf16 collectives: one OpenMP thread, so it never competes
      // with the compute stream's pool; denormals flushed as on every compute thread.
      kernels::init_compute(1);
      for (const Task& task : plan_.tasks) {
        if (task.stream != Stream::comm) continue;
        if (wait_deps(task) < 0) return;
        const double start = now_us();
        allocate(task);
        run_comm(task, step);
        release(task);
        finish(task, start);
      }
    } catch (...) {
      fail(std::current_exception());
    }
  });
  try {
    for (const Task& task : plan_.tasks) {
      if (task.stream != Stream::compute) continue;
      const double waited = wait_deps(task);
      if (waited < 0) break;
      result.comm_exposed_ms += waited;
      const double start = now_us();
      allocate(task);
      run_compute(task, step, batch, grad_scale, grad_clip, opt, t, result);
      release(task);
      finish(task, start);
    }
  } catch (...) {
    fail(std::current_exception());
  }
  comm_thread.join();
  if (failure) std::rethrow_exception(failure);
  result.loss_sum = sum_over(comms_.world(), result.loss_sum, "loss step " + std::to_string(step));
  return result;
}

void Executor::gather_full(State which, float* full) {
  const Buffer& buf = which == State::params ? params_ : which == State::exp_avg ? exp_avg_ : exp_avg_sq_;
  const bool sharded = which == State::params ? sharded_params_ : sharded_optimizer_;
  if (!sharded) {
    std::memcpy(full, buf.data(), buf.bytes());
    return;
  }
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(u);
    comms_.shard()
        .all_gather(local(buf, true, u), full + s.unit_offset, s.len, DType::fp32, "gather state unit " + desc_.units[u].name)
        ->wait(timeout_);
  }
}

void Executor::load_full(State which, const float* full) {
  Buffer& buf = which == State::params ? params_ : which == State::exp_avg ? exp_avg_ : exp_avg_sq_;
  const bool sharded = which == State::params ? sharded_params_ : sharded_optimizer_;
  if (!sharded) {
    std::memcpy(buf.data(), full, buf.bytes());
    return;
  }
  for (int u = 0; u < static_cast<int>(desc_.units.size()); ++u) {
    const Shard s = shard_of(u);
    std::memcpy(local(buf, true, u), full + s.unit_offset + s.begin, sizeof(float) * s.len);
  }
}

}  // namespace shardlm::run
