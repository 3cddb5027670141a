#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <omp.h>
#include <random>
#include <stdexcept>

#include "data/sampler.h"
#include "kernels/cpu.h"
#include "train/checkpoint.h"
#include "train/schedule.h"
#include "trace/trace.h"

namespace shardlm::train {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

json mem_json(const MemSnapshot& s) {
  json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[to_string(static_cast<MemCategory>(c))] = s.bytes[c];
  j["total"] = s.total;
  return j;
}

std::string progress_bar(int64_t done, int64_t total, int width = 20) {
  const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  std::string bar(width + 2, '.');
  bar.front() = '[';
  bar.back() = ']';
  bar.replace(1, filled, filled, '#');
  return bar;
}

}  // namespace

std::string checkpoint_dir(const std::string& out, int64_t step) { return out + "/ckpt/step_" + std::to_string(step); }

DataMeta read_data_meta(const std::string& prefix) {
  DataMeta m;
  const std::string path = prefix + "_meta.json";
  std::ifstream f(path);
  if (!f) return m;
  try {
    const json j = json::parse(f);
    m.tokenizer = j.at("tokenizer").get<std::string>();
    m.vocab_size = j.at("vocab_size").get<int64_t>();
  } catch (const std::exception&) {
    throw std::runtime_error(path + ": expected {\"tokenizer\": name, \"vocab_size\": n}");
  }
  return m;
}

void write_data_meta(const std::string& prefix, const DataMeta& meta) {
  const std::string path = prefix + "_meta.json", tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << json{{"tokenizer", meta.tokenizer}, {"vocab_size", meta.vocab_size}}.dump() << "\n";
    if (!f) throw std::runtime_error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

double evaluate(ModelState& model, const data::TokenShard& shard, int64_t B, int64_t T, int64_t max_windows) {
  const int64_t n = data::num_eval_windows(shard.size(), T);
  if (n <= 0) throw std::runtime_error(shard.path() + ": too few tokens for one window of " + std::to_string(T));
  const int64_t count = max_windows > 0 ? std::min(n, max_windows) : n;
  const int64_t stride = n / count;
  layers::Activations acts(model.desc(), B, T);
  layers::BackwardWorkspace ws(model.desc(), B, T, omp_get_max_threads());
  double total = 0;
  for (int64_t first = 0; first < count; first += B) {
    const int64_t rows = std::min(B, count - first);
    for (int64_t b = 0; b < B; ++b) {
      if (b < rows) {
        data::eval_window(shard, (first + b) * stride, T, acts.inputs + b * T, acts.targets + b * T);
      } else {  // a short last batch: pad with ignored rows
        std::fill(acts.inputs + b * T, acts.inputs + (b + 1) * T, 0);
        std::fill(acts.targets + b * T, acts.targets + (b + 1) * T, -1);
      }
    }
    total += model.run_batch(acts, ws, false, 0.0f);
  }
  return total / static_cast<double>(count * T);
}

double unigram_entropy(const data::TokenShard& shard) {
  std::vector<int64_t> counts(65536, 0);
  const uint16_t* t = shard.data();
  for (int64_t i = 0; i < shard.size(); ++i) ++counts[t[i]];
  double h = 0;
  const double n = static_cast<double>(shard.size());
  for (int64_t c : counts)
    if (c > 0) h -= (c / n) * std::log(c / n);
  return h;
}

std::vector<int32_t> generate(ModelState& model, const std::vector<int32_t>& prompt, int32_t start_token,
                              const SampleConfig& cfg) {
  const auto& c = model.config();
  std::vector<int32_t> ids = prompt.empty() ? std::vector<int32_t>{start_token} : prompt;
  const size_t n_prompt = ids.size();
  std::mt19937_64 rng(cfg.seed);
  std::vector<float> logits(c.vocab_size);
  std::vector<int32_t> order(c.vocab_size);
  // No KV cache: each token reruns the window, which is fine for the short samples this serves.
  for (int64_t i = 0; i < cfg.tokens; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), c.max_seq);
    layers::Activations acts(model.desc(), 1, T);
    layers::BackwardWorkspace ws(model.desc(), 1, T, omp_get_max_threads());
    std::copy(ids.end() - T, ids.end(), acts.inputs);
    model.logits_at(acts, ws, T, T - 1, logits.data());
    int32_t next;
    if (cfg.temperature <= 0) {
      next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      std::iota(order.begin(), order.end(), 0);
      int64_t k = cfg.top_k > 0 ? std::min<int64_t>(cfg.top_k, c.vocab_size) : c.vocab_size;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
      std::vector<double> p(k);
      const double top = logits[order[0]];
      for (int64_t j = 0; j < k; ++j) p[j] = std::exp((logits[order[j]] - top) / cfg.temperature);
      std::discrete_distribution<int64_t> pick(p.begin(), p.end());
      next = order[pick(rng)];
    }
    ids.push_back(next);
  }
  return std::vector<int32_t>(ids.begin() + static_cast<int64_t>(n_prompt), ids.end());
}

double measure_gemm_gflops() {
  // The best of repeated large square GEMMs over ~0.3 s: short runs (a few ms) catch the thread
  // pool and the clock still ramping up and under-read the peak by 30% or more.
  const int64_t n = 2048;
  Buffer a(MemCategory::workspace, 4 * n * n), b(MemCategory::workspace, 4 * n * n), c(MemCategory::workspace, 4 * n * n);
  std::fill(a.f32(), a.f32() + n * n, 0.5f);
  std::fill(b.f32(), b.f32() + n * n, 0.25f);
  double best = 1e30, spent = 0;
  for (int rep = 0; rep < 3 || (spent < 300 && rep < 50); ++rep) {
    auto t0 = Clock::now();
    kernels::matmul(false, false, n, n, n, 1.0f, a.f32(), n, b.f32(), n, 0.0f, c.f32(), n);
    const double ms = ms_since(t0);
    spent += ms;
    if (rep > 0) best = std::min(best, ms);
  }
  return 2.0 * n * n * n / (best * 1e-3) / 1e9;
}

namespace {

// The whole model on this rank, gathered from the executor's shards (collective), for
// evaluation, sampling and checkpoints. With optimizer state when `with_optimizer`.
ModelState gather_model(run::Executor& ex, const model::ModelConfig& mc, uint64_t seed, bool with_optimizer) {
  ModelState whole(mc, seed, with_optimizer);
  const auto& layout = ex.plan().layout;
  Buffer full(MemCategory::comm, sizeof(float) * layout.total);
  ex.gather_full(run::Executor::State::params, full.f32());
  whole.copy_from(ModelState::Kind::params, layout, full.f32());
  if (with_optimizer) {
    ex.gather_full(run::Executor::State::exp_avg, full.f32());
    whole.copy_from(ModelState::Kind::exp_avg, layout, full.f32());
    ex.gather_full(run::Executor::State::exp_avg_sq, full.f32());
    whole.copy_from(ModelState::Kind::exp_avg_sq, layout, full.f32());
  }
  return whole;
}

void load_into(run::Executor& ex, const std::string& ckpt_dir, const model::ModelConfig& mc, uint64_t seed) {
  ModelState whole(mc, seed, true);
  load_checkpoint(ckpt_dir, whole, true);
  const auto& layout = ex.plan().layout;
  Buffer full(MemCategory::comm, sizeof(float) * layout.total);
  whole.copy_to(ModelState::Kind::params, layout, full.f32());
  ex.load_full(run::Executor::State::params, full.f32());
  whole.copy_to(ModelState::Kind::exp_avg, layout, full.f32());
  ex.load_full(run::Executor::State::exp_avg, full.f32());
  whole.copy_to(ModelState::Kind::exp_avg_sq, layout, full.f32());
  ex.load_full(run::Executor::State::exp_avg_sq, full.f32());
}

// The per-category maximum over ranks of a memory snapshot (collective).
MemSnapshot max_over_ranks(comm::Communicator& world, const MemSnapshot& mine, std::chrono::milliseconds timeout) {
  std::vector<int64_t> all(kNumMemCategories * world.size());
  world.all_gather(mine.bytes.data(), all.data(), 2 * kNumMemCategories, DType::fp32, "memory")->wait(timeout);
  MemSnapshot out;
  for (int r = 0; r < world.size(); ++r)
    for (int c = 0; c < kNumMemCategories; ++c) out.bytes[c] = std::max(out.bytes[c], all[r * kNumMemCategories + c]);
  for (int c = 0; c < kNumMemCategories; ++c) out.total += out.bytes[c];
  return out;
}

}  // namespace

plan::PlanConfig plan_config(const TrainConfig& cfg, int world) {
  plan::PlanConfig pc;
  pc.strategy = plan::parse_strategy(cfg.strategy);
  pc.world = world;
  pc.shard_group = cfg.shard_group;
  pc.batch = cfg.batch;
  pc.seq = cfg.seq;
  pc.grad_accum = cfg.grad_accum;
  pc.prefetch_forward = cfg.prefetch_forward;
  pc.prefetch_backward = cfg.prefetch_backward;
  pc.max_gathers_in_flight = cfg.max_gathers_in_flight;
  pc.bucket_mb = cfg.bucket_mb;
  pc.param_bytes = cfg.param_dtype == "bf16" ? 2 : 4;
  pc.reduce_bytes = cfg.reduce_dtype == "bf16" ? 2 : 4;
  return pc;
}

TrainSummary run_training(const TrainConfig& cfg, comm::Communicator& world) {
  cfg.validate();
  kernels::init_compute(cfg.threads);
  const int rank = world.rank(), N = world.size();
  const bool lead = rank == 0, talk = lead && !cfg.quiet;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.timeout_s * 1000));
  const DataMeta meta = read_data_meta(cfg.data);
  data::TokenShard train_data(cfg.data + "_train.bin");
  data::TokenShard val_data(cfg.data + "_val.bin");

  model::ModelConfig mc = cfg.model_config(meta.vocab_size);
  RunState state;
  state.seed = cfg.seed;
  state.tokenizer = meta.tokenizer;
  if (!cfg.resume.empty()) {
    const model::ModelConfig saved = read_checkpoint_config(cfg.resume);
    auto check = [&](const char* field, int64_t run, int64_t ck) {
      if (run != ck)
        throw std::runtime_error(fmt::format("checkpoint: {}/config.json: {} is {} but this run's model has {}",
                                             cfg.resume, field, ck, run));
    };
    check("n_layer", mc.n_layer, saved.n_layer);
    check("n_head", mc.n_head, saved.n_head);
    check("n_embd", mc.n_embd, saved.n_embd);
    check("vocab_size", mc.vocab_size, saved.vocab_size);
    check("n_positions", mc.max_seq, saved.max_seq);
    state = read_checkpoint_state(cfg.resume);
    if (state.seed != cfg.seed)
      throw std::runtime_error(fmt::format("checkpoint: {}/state.json: seed is {} but this run's is {}", cfg.resume,
                                           state.seed, cfg.seed));
  }
  train_data.validate_tokens(static_cast<int32_t>(mc.vocab_size));
  val_data.validate_tokens(static_cast<int32_t>(mc.vocab_size));

  const model::ModelDesc desc = model::describe(mc);
  const plan::Plan plan = plan::build_plan(desc, plan_config(cfg, N));
  run::CommGroups comms(world, plan);
  run::Executor ex(desc, plan, comms, cfg.threads, timeout);
  if (cfg.resume.empty()) ex.init_params(cfg.seed);
  else load_into(ex, cfg.resume, mc, cfg.seed);

  const int64_t B = cfg.batch, T = cfg.seq;
  std::ofstream metrics;
  if (lead) {
    std::filesystem::create_directories(cfg.out);
    metrics.open(cfg.out + "/metrics.jsonl", cfg.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!metrics) throw std::runtime_error("cannot write " + cfg.out + "/metrics.jsonl");
  }

  const double peak = cfg.peak_gflops > 0 ? cfg.peak_gflops : measure_gemm_gflops();
  const int64_t global_batch = N * B * cfg.grad_accum;
  const double step_flops = desc.train_flops(global_batch, T);
  if (talk) {
    fmt::print("model {}: {:.2f}M parameters (L={} C={} NH={} V={}), {} rank(s) x {} thread(s), strategy {}, B={} per rank "
               "T={} accum={}, GEMM peak {:.0f} GFLOP/s per rank\n",
               cfg.model, desc.num_params_exported() / 1e6, mc.n_layer, mc.n_embd, mc.n_head, mc.vocab_size, N,
               cfg.threads, plan::to_string(plan.config.strategy), B, T, cfg.grad_accum, peak);
    std::fflush(stdout);
  }

  auto run_eval = [&](int64_t step) {
    ModelState whole = gather_model(ex, mc, cfg.seed, false);
    double val = 0;
    if (lead) {
      val = evaluate(whole, val_data, B, T, cfg.eval_windows);
      metrics << json{{"step", step}, {"val_loss", val}}.dump() << "\n" << std::flush;
      if (talk) fmt::print("step {:>6} | val_loss {:.4f}\n", step, val);
    }
    return val;
  };

  TrainSummary summary;
  const float grad_scale = 1.0f / static_cast<float>(global_batch * T);
  for (int64_t step = state.step; step < cfg.steps; ++step) {
    auto t0 = Clock::now();
    MemoryTracker::global().reset_peak();
    const float lr = learning_rate(step, cfg.steps, cfg.warmup, cfg.lr, cfg.min_lr);
    auto batch = [&](int micro, int32_t* inputs, int32_t* targets) {
      data::sample_batch(train_data, cfg.seed, step, micro, rank * B, B, T, inputs, targets);
    };
    const run::StepResult r =
        ex.step(step, batch, grad_scale, cfg.grad_clip, {lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay}, step + 1);
    const double step_ms = ms_since(t0);
    const MemSnapshot mem = max_over_ranks(world, MemoryTracker::global().peak(), timeout);
    // What stays allocated between steps: the (sharded) state, activations and workspace.
    const MemSnapshot held = max_over_ranks(world, MemoryTracker::global().live(), timeout);
    double exposed = r.comm_exposed_ms;
    {
      std::vector<double> all(N);
      world.all_gather(&exposed, all.data(), 2, DType::fp32, "metrics")->wait(timeout);
      exposed = *std::max_element(all.begin(), all.end());
    }
    const double loss = r.loss_sum * grad_scale;
    const double tokens_per_s = static_cast<double>(global_batch * T) / (step_ms * 1e-3);
    const double mfu = step_flops / (step_ms * 1e-3) / (peak * 1e9 * N);
    if (lead) {
      metrics << json{{"step", step},         {"loss", loss},         {"lr", lr},
                      {"grad_norm", r.grad_norm}, {"step_ms", step_ms}, {"tokens_per_s", tokens_per_s},
                      {"mfu", mfu},           {"comm_exposed_ms", exposed}, {"mem", mem_json(mem)},
                      {"mem_between_steps", mem_json(held)}}
                     .dump()
              << "\n"
              << std::flush;
    }
    if (talk) {
      fmt::print("step {:>6}/{} {} loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.0f} ms | {:.0f} tok/s | mfu {:.1f}% | "
                 "mem {:.1f} MiB{}\n",
                 step + 1, cfg.steps, progress_bar(step + 1, cfg.steps), loss, lr, r.grad_norm, step_ms, tokens_per_s,
                 100 * mfu, mem.total / 1048576.0, N > 1 ? fmt::format(" | comm exposed {:.0f} ms", exposed) : "");
      std::fflush(stdout);
    }
    summary.final_loss = loss;
    summary.steps_done = step + 1;
    state.step = step + 1;
    if (cfg.save_every > 0 && state.step % cfg.save_every == 0) {
      ModelState whole = gather_model(ex, mc, cfg.seed, true);
      if (lead) save_checkpoint(checkpoint_dir(cfg.out, state.step), whole, state, cfg);
    }
    if (cfg.eval_every > 0 && state.step % cfg.eval_every == 0 && state.step < cfg.steps) run_eval(state.step);
  }

  summary.final_val_loss = run_eval(state.step);
  if (lead) {
    summary.val_unigram_entropy = unigram_entropy(val_data);
    if (talk)
      fmt::print("final val_loss {:.4f} nats/token vs unigram entropy of the validation tokens {:.4f} nats/token\n",
                 summary.final_val_loss, summary.val_unigram_entropy);
  }
  if (cfg.sample_tokens > 0) {
    ModelState whole = gather_model(ex, mc, cfg.seed, false);
    if (lead) {
      SampleConfig sc;
      sc.tokens = cfg.sample_tokens;
      sc.seed = cfg.seed;
      summary.sample = generate(whole, {}, meta.tokenizer == "gpt2" ? 50256 : '\n', sc);
    }
  }
  if (!cfg.trace.empty()) {
    ex.sample_memory();
    const std::string mine = ex.trace().events_json();
    const int64_t len = static_cast<int64_t>(mine.size());
    std::vector<int64_t> lens(N);
    world.all_gather(&len, lens.data(), 2, DType::fp32, "trace sizes")->wait(timeout);
    const int64_t most = *std::max_element(lens.begin(), lens.end());
    std::string padded = mine;
    padded.resize(most, ' ');
    std::string all(most * N, ' ');
    world.all_gather(padded.data(), all.data(), most, DType::int8, "trace")->wait(timeout);
    if (lead) {
      std::vector<std::string> parts;
      for (int r = 0; r < N; ++r) parts.push_back(all.substr(r * most, lens[r]));
      trace::write_trace(cfg.trace, parts);
    }
  }
  return summary;
}

}  // namespace shardlm::train
