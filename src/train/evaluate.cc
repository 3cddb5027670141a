#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>

#include "data/sampler.h"

namespace shardlm::train {

namespace {

plan::Plan forward_plan(const model::ModelDesc& desc, plan::PlanConfig c, plan::PlanConfig::Mode mode, int64_t B,
                        int64_t T) {
  c.mode = mode;
  c.batch = B;
  c.seq = T;
  c.grad_accum = 1;
  c.split_sequence = false;  // any length; the ranks of a cp group compute the same windows
  return plan::build_plan(desc, c);
}

}  // namespace

double evaluate(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                const data::TokenCorpus& shard, int64_t B, int64_t T, int64_t max_windows, int rank) {
  if (B <= 0) throw std::invalid_argument("evaluation batch must be positive, got " + std::to_string(B));
  const int64_t n = data::num_eval_windows(shard.size(), T);
  if (n <= 0) throw std::runtime_error(shard.path() + ": too few tokens for one window of " + std::to_string(T));
  const int64_t count = max_windows > 0 ? std::min(n, max_windows) : n;
  const plan::Plan plan = forward_plan(desc, training, plan::PlanConfig::Mode::loss, B, T);
  // Ranks with different data-parallel coordinates take different windows.
  const int64_t stride = n / count, N = plan.dp_size(), dp = plan.dp_index(rank);
  double total = 0;
  for (int64_t first = 0; first < count; first += N * B) {
    run::StepInputs in;
    in.batch = [&](int, int32_t* inputs, int32_t* targets) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t w = first + dp * B + b;
        if (w < count) {
          data::eval_window(shard, w * stride, T, inputs + b * T, targets + b * T);
        } else {  // past the last window: an ignored row
          std::fill(inputs + b * T, inputs + (b + 1) * T, 0);
          std::fill(targets + b * T, targets + (b + 1) * T, -1);
        }
      }
    };
    total += ex.run(plan, -1, in).loss_sum;
  }
  return total / static_cast<double>(count * T);
}

void fill_flow_samples(const model::ModelConfig& mc, const data::LatentSet& set, uint64_t seed, int64_t step,
                       int64_t first, int64_t B, char* batch, int64_t bytes) {
  const model::DitSample at = model::dit_sample(mc);
  if (bytes != B * at.bytes) throw std::logic_error("fill_flow_samples: a batch of the wrong size");
  const int64_t L = mc.latent_values();
  for (int64_t b = 0; b < B; ++b) {
    char* s = batch + b * at.bytes;
    const int64_t j = first + b;
    const int64_t record = step >= 0 ? data::latent_record(seed, step, j, set.size()) : j % set.size();
    set.read_channels_first(record, reinterpret_cast<float*>(s + at.latents));
    const data::FlowDraw d =
        data::flow_draw(seed, step, j, step >= 0 ? mc.cond_drop : 0.0, reinterpret_cast<float*>(s + at.noise), L);
    *reinterpret_cast<float*>(s + at.time) = d.time;
    *reinterpret_cast<int32_t*>(s + at.label) = d.drop_label ? static_cast<int32_t>(mc.num_classes) : set.label(record);
  }
}

double evaluate_flow(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                     const data::LatentSet& set, int64_t B, uint64_t seed, int64_t max_records, int rank) {
  if (B <= 0) throw std::invalid_argument("evaluation batch must be positive, got " + std::to_string(B));
  const int64_t T = desc.config.patch_tokens();
  const plan::Plan plan = forward_plan(desc, training, plan::PlanConfig::Mode::loss, B, T);
  const int64_t N = plan.dp_size(), dp = plan.dp_index(rank), per_forward = N * B;
  const int64_t wanted = max_records > 0 ? std::min(set.size(), max_records) : set.size();
  const int64_t count = (wanted + per_forward - 1) / per_forward * per_forward;
  double total = 0;
  for (int64_t first = 0; first < count; first += per_forward) {
    run::StepInputs in;
    in.samples = [&](int64_t, char* batch, int64_t bytes) {
      fill_flow_samples(desc.config, set, seed, -1, first + dp * B, B, batch, bytes);
    };
    total += ex.run(plan, -1, in).loss_sum;
  }
  return total / static_cast<double>(count * T);
}

std::vector<float> sample_flow(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                               const std::vector<int32_t>& labels, const FlowSampling& fs) {
  const model::ModelConfig& mc = desc.config;
  const int64_t n = static_cast<int64_t>(labels.size()), L = mc.latent_values(), B = 2 * n;
  if (n == 0 || fs.steps < 1) return {};
  for (int32_t y : labels)
    if (y < 0 || y >= mc.num_classes)
      throw std::invalid_argument("class " + std::to_string(y) + " is outside [0, " + std::to_string(mc.num_classes) + ")");
  const plan::Plan plan = forward_plan(desc, training, plan::PlanConfig::Mode::logits, B, mc.patch_tokens());
  std::vector<float> x(n * L), v(B * L);
  for (int64_t j = 0; j < n; ++j) data::flow_draw(fs.seed, -2, j, 0.0, x.data() + j * L, L);
  const model::DitSample at = model::dit_sample(mc);
  for (int64_t s = 0; s < fs.steps; ++s) {
    const float t = 1.0f - static_cast<float>(s) / static_cast<float>(fs.steps);
    const float dt = 1.0f / static_cast<float>(fs.steps);
    run::StepInputs in;
    in.samples = [&](int64_t, char* batch, int64_t) {
      for (int64_t b = 0; b < B; ++b) {
        char* p = batch + b * at.bytes;
        const float* xb = x.data() + (b % n) * L;
        std::copy(xb, xb + L, reinterpret_cast<float*>(p + at.latents));
        std::copy(xb, xb + L, reinterpret_cast<float*>(p + at.noise));
        *reinterpret_cast<float*>(p + at.time) = t;
        *reinterpret_cast<int32_t*>(p + at.label) = b < n ? labels[b] : static_cast<int32_t>(mc.num_classes);
      }
    };
    in.logits = v.data();
    in.all_logits = true;
    ex.run(plan, -1, in);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < L; ++i) {
        const float vc = v[j * L + i], vu = v[(n + j) * L + i];
        x[j * L + i] -= dt * (vu + fs.cfg * (vc - vu));  // toward t = 0: dx = v dt with dt < 0
      }
  }
  return x;
}

double unigram_entropy(const data::TokenCorpus& shard) {
  std::vector<int64_t> counts(65536, 0);  // grown for LLaMA 3's ids (checked against the vocabulary first)
  data::for_each_chunk(shard, [&](int64_t, const int32_t* t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const auto id = static_cast<uint32_t>(t[i]);
      if (id >= counts.size()) counts.resize(id + size_t{1}, 0);
      ++counts[id];
    }
  });
  double h = 0;
  const double n = static_cast<double>(shard.size());
  for (int64_t c : counts)
    if (c > 0) h -= (c / n) * std::log(c / n);
  return h;
}

std::vector<int32_t> generate(run::Executor& ex, const model::ModelDesc& desc, const plan::PlanConfig& training,
                              const std::vector<int32_t>& prompt, int32_t start_token, const SampleConfig& cfg,
                              const std::function<void(int32_t)>& on_token) {
  const auto& c = desc.config;
  std::vector<int32_t> ids = prompt.empty() ? std::vector<int32_t>{start_token} : prompt;
  const size_t n_prompt = ids.size();
  std::mt19937_64 rng(cfg.seed);
  std::vector<float> logits(c.vocab_size);
  const int64_t V = cfg.vocab_limit > 0 ? std::min(cfg.vocab_limit, c.vocab_size) : c.vocab_size;
  std::vector<int32_t> order(V);
  std::map<int64_t, plan::Plan> plans;  // by window length
  // No KV cache: each token reruns the window, which is fine for the short samples this serves.
  for (int64_t i = 0; i < cfg.tokens; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), c.max_seq);
    auto it = plans.find(T);
    if (it == plans.end())
      it = plans.emplace(T, forward_plan(desc, training, plan::PlanConfig::Mode::logits, 1, T)).first;
    run::StepInputs in;
    in.batch = [&](int, int32_t* inputs, int32_t* targets) {
      std::copy(ids.end() - T, ids.end(), inputs);
      std::fill(targets, targets + T, -1);
    };
    in.logits = logits.data();
    ex.run(it->second, -1, in);
    int32_t next;
    if (cfg.temperature <= 0) {
      next = static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + V) - logits.begin());
    } else {
      std::iota(order.begin(), order.end(), 0);
      const int64_t k = cfg.top_k > 0 ? std::min<int64_t>(cfg.top_k, V) : V;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
      std::vector<double> p(k);
      const double top = logits[order[0]];
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += p[j] = std::exp((logits[order[j]] - top) / cfg.temperature);
      // Nucleus: the likeliest few whose share reaches top_p (the first always).
      if (cfg.top_p < 1) {
        int64_t kept = 1;
        for (double share = p[0] / sum; kept < k && share < cfg.top_p; ++kept) share += p[kept] / sum;
        p.resize(kept);
      }
      std::discrete_distribution<int64_t> pick(p.begin(), p.end());
      next = order[pick(rng)];
    }
    if (std::find(cfg.stop_tokens.begin(), cfg.stop_tokens.end(), next) != cfg.stop_tokens.end()) break;
    ids.push_back(next);
    if (on_token) on_token(next);
  }
  return std::vector<int32_t>(ids.begin() + static_cast<int64_t>(n_prompt), ids.end());
}

}  // namespace shardlm::train
