// Each unit kind of the layer table alone: its carved activation and workspace sizes are the
// model's figures, its backward matches finite differences of its forward, and its recompute
// rebuilds bitwise what the forward kept.
#include "layers/layers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu.h"
#include "relative_error.h"

namespace shardlm::layers {
namespace {

using model::UnitKind;

struct Fixture {
  model::ModelDesc desc;
  int unit;
  int64_t B = 2, T = 70;  // two attention tiles, a ragged second one
  int threads = 2;
  model::ActQuant act_quant{};
  model::Recompute recompute = model::Recompute::none;
  model::Shape shape() const {
    model::Shape s{B, T, 4, threads};
    s.act_quant = act_quant, s.recompute = recompute;
    return s;
  }
};

model::ModelConfig config(const char* preset, bool tied = false) {
  model::ModelConfig c = model::model_preset(preset, 200);
  c.tie_embeddings = c.tie_embeddings || tied;
  return c;
}

std::vector<Fixture> fixtures() {
  std::vector<Fixture> out;
  for (const char* preset : {"tiny", "llama-tiny"})
    for (int u : {0, 1, 3}) out.push_back({model::describe(config(preset)), u});
  out.push_back({model::describe(config("llama-tiny", true)), 3});
  // A MoE block (unit 1; its experts are unit 2), dropless and with capacity drops.
  out.push_back({model::describe(config("moe-tiny")), 1});
  model::ModelConfig capped = config("moe-tiny");
  capped.capacity_factor = 0.5;
  out.push_back({model::describe(capped), 1});
  // Bidirectional attention (model::ModelConfig::causal false). (A MoE block's router would move
  // tokens between experts under the finite differences' steps; its attention is the LLaMA block's.)
  for (const char* preset : {"tiny", "llama-tiny"}) {
    model::ModelConfig c = config(preset);
    c.causal = false;
    out.push_back({model::describe(c), 1});
  }
  // A DiT's patch embedding, adaLN-Zero block and final layer with its flow loss (T: its patches).
  for (int u : {0, 1, 3}) out.push_back({model::describe(config("dit-tiny")), u, 2, 64});
  return out;
}

// A LLaMA block under selective_op, which carves its values apart (layers/llama.cc): both blocks of
// llama-tiny (q and v of grouped-query attention).
std::vector<Fixture> selective_op_fixtures() {
  std::vector<Fixture> out;
  for (int u : {1, 2}) {
    Fixture f{model::describe(config("llama-tiny")), u};
    f.recompute = model::Recompute::selective_op;
    out.push_back(f);
  }
  return out;
}

std::string describe_case(const Fixture& f) {
  return std::string(model::to_string(f.desc.units[f.unit].kind)) + (f.desc.units[f.unit].borrows >= 0 ? " (tied)" : "") +
         (f.desc.config.causal ? "" : " (bidirectional)");
}

TEST(Layers, CarvedBytesAreTheModelsFigures) {
  std::vector<Fixture> all = fixtures();
  all.push_back({model::describe(config("moe-tiny")), 2});  // the experts: state only, nothing carved
  for (const Fixture& f : selective_op_fixtures()) all.push_back(f);
  for (const Fixture& f : all) {
    const auto& u = f.desc.units[f.unit];
    MemoryPool memory;
    const Carved got = layer(u.kind).carved(*kernels::make_cpu_backend(memory), f.desc, u, f.shape());
    const model::UnitCosts want = f.desc.costs(f.unit, f.shape());
    EXPECT_EQ(got.saved, want.saved_bytes) << describe_case(f);
    EXPECT_EQ(got.recomputable, want.recomputable_bytes) << describe_case(f);
    EXPECT_EQ(got.forward_ws, want.forward_workspace) << describe_case(f);
    EXPECT_EQ(got.backward_ws, want.backward_workspace) << describe_case(f);
  }
}

// The same under context parallelism (each rank holding T of a sequence's T·cp positions), ring
// and all-to-all: a LLaMA block, and a MoE block dropless and capped, alone and beside ep, with
// and without --act-quant int8 (group 16 divides a rank's q|k|v row at cp 4).
TEST(Layers, CarvedBytesAreTheModelsFiguresUnderContextParallelism) {
  for (const char* preset : {"llama-tiny", "moe-tiny"})
    for (double capacity : {0.0, 0.5})
      for (int ep : {1, 2})
        for (int cp : {2, 4})
          for (model::ContextImpl impl : {model::ContextImpl::ring, model::ContextImpl::all_to_all})
            for (int64_t group : {0, 16}) {
            model::ModelConfig c = config(preset);
            if (c.family != model::Family::moe && (capacity > 0 || ep > 1)) continue;
            c.capacity_factor = capacity;
            c.n_kv_head = 4;  // the all-to-all form gives each of 4 ranks whole key/value heads
            const model::ModelDesc desc = model::describe(c);
            model::Shape shape{2, 16, 4, 2};
            shape.ep = ep, shape.cp = cp, shape.cp_impl = impl, shape.act_quant.group = group;
            MemoryPool memory;
            const Carved got = layer(desc.units[1].kind).carved(*kernels::make_cpu_backend(memory), desc, desc.units[1], shape);
            const model::UnitCosts want = desc.costs(1, shape);
            const std::string at = std::string(preset) + " capacity " + std::to_string(capacity) + " ep " +
                                   std::to_string(ep) + " cp " + std::to_string(cp) + " " + model::to_string(impl) +
                                   " group " + std::to_string(group);
            EXPECT_EQ(got.saved, want.saved_bytes) << at;
            EXPECT_EQ(got.recomputable, want.recomputable_bytes) << at;
            EXPECT_EQ(got.forward_ws, want.forward_workspace) << at;
            EXPECT_EQ(got.backward_ws, want.backward_workspace) << at;
            EXPECT_EQ(static_cast<int>(want.stage_share.size()), want.stages()) << at;
            double share = 0;
            for (double x : want.stage_share) share += x;
            EXPECT_NEAR(share, 1.0, 1e-12) << at;
          }
}

// Random parameters (and a borrowed unit's), inputs and buffers for one unit.
struct Bench {
  const Fixture& f;
  const model::UnitDesc& u;
  std::vector<float> params, grads, borrowed, borrowed_grads, in, out, dx, weights;
  MemoryPool memory;  // the kernels run on the vectors here; nothing is allocated through it
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend(memory);
  std::vector<int32_t> tokens, targets;
  std::vector<char> samples;  // a model whose batch is samples (a DiT's latents, noise, times, labels)
  std::vector<char> saved, recomputable, fws, bws;
  explicit Bench(const Fixture& fx) : f(fx), u(fx.desc.units[fx.unit]) {
    std::mt19937 rng(5);
    std::normal_distribution<float> n(0.0f, 1.0f);
    const int64_t C = f.desc.config.n_embd, BT = f.B * f.T;
    const model::UnitCosts c = f.desc.costs(f.unit, f.shape());
    params.resize(u.numel);
    init_unit(u, 3, params.data(), 0, u.numel);
    for (auto& p : params) p += 0.05f * n(rng);  // norms away from exactly 1, biases non-zero
    grads.assign(u.numel, 0.0f);
    if (u.borrows >= 0) {
      const auto& b = f.desc.units[u.borrows];
      borrowed.resize(b.numel);
      init_unit(b, 4, borrowed.data(), 0, b.numel);
      for (auto& p : borrowed) p *= 5.0f;
      borrowed_grads.assign(b.numel, 0.0f);
    }
    in.resize(BT * C);
    for (auto& x : in) x = n(rng);
    out.assign(BT * C, 0.0f);
    weights.resize(BT * C);
    for (auto& w : weights) w = n(rng);
    dx = weights;
    tokens.resize(BT);
    targets.resize(BT);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % f.desc.config.vocab_size);
    for (auto& t : targets) t = static_cast<int32_t>(rng() % f.desc.config.vocab_size);
    targets[3] = -1;
    if (f.desc.values[0].sample_bytes > 0) fill_samples(rng);
    saved.assign(c.saved_bytes, 0);
    recomputable.assign(c.recomputable_bytes, 0);
    fws.assign(c.forward_workspace, 0);
    bws.assign(c.backward_workspace, 0);
  }
  void fill_samples(std::mt19937& rng) {
    const model::ModelConfig& c = f.desc.config;
    const model::DitSample at = model::dit_sample(c);
    std::normal_distribution<float> n(0.0f, 1.0f);
    samples.assign(f.B * at.bytes, 0);
    for (int64_t b = 0; b < f.B; ++b) {
      char* s = samples.data() + b * at.bytes;
      for (int64_t i = 0; i < c.latent_values(); ++i) {
        reinterpret_cast<float*>(s + at.latents)[i] = n(rng);
        reinterpret_cast<float*>(s + at.noise)[i] = n(rng);
      }
      *reinterpret_cast<float*>(s + at.time) = 0.2f + 0.6f * static_cast<float>(b) / static_cast<float>(f.B);
      *reinterpret_cast<int32_t*>(s + at.label) = static_cast<int32_t>(rng() % (c.num_classes + 1));
    }
  }
  UnitArgs args() {
    UnitArgs a;
    a.backend = backend.get();
    a.desc = &f.desc;
    a.unit = &u;
    a.B = f.B, a.T = f.T, a.threads = f.threads;
    a.params = params.data();
    a.grads = grads.data();
    if (u.borrows >= 0) a.borrowed_params = borrowed.data(), a.borrowed_grads = borrowed_grads.data();
    a.tokens = tokens.data(), a.targets = targets.data();
    if (!samples.empty()) a.batch = samples.data();
    a.in = in.data(), a.out = out.data();
    a.saved = saved.data(), a.recomputable = recomputable.data();
    a.forward_ws = fws.data(), a.backward_ws = bws.data();
    a.dx = dx.data();
    a.grad_scale = 1.0f;
    a.act_quant = f.act_quant, a.recompute = f.recompute;
    a.quant_key = 77;
    return a;
  }
  // The scalar whose gradient the backward computes: the head's loss, else sum(out · weights).
  double loss() {
    const LayerKind& k = layer(u.kind);
    if (k.head) return k.head(args(), HeadMode::loss);
    k.forward(args());
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * weights[i];
    return s;
  }
  void backward() {
    const LayerKind& k = layer(u.kind);
    if (k.head) {
      k.head(args(), HeadMode::train);
      return;
    }
    k.forward(args());
    if (f.recompute == model::Recompute::selective_op) {  // the backward reads what the rebuild wrote
      std::fill(recomputable.begin(), recomputable.end(), 0);
      k.recompute(args(), f.recompute);
    }
    dx = weights;
    k.backward(args());
  }
};

// Central differences in double over fp32 forwards, at a sample of elements of every parameter
// and of the input: |analytic - numeric| <= 2% of the largest analytic gradient of the tensor + 1e-4.
TEST(Layers, BackwardMatchesFiniteDifferences) {
  kernels::init_compute(2);
  std::vector<Fixture> all = fixtures();
  for (const Fixture& f : selective_op_fixtures()) all.push_back(f);
  for (const Fixture& f : all) {
    Bench b(f);
    b.backward();
    const std::vector<float> g = b.grads, g_borrowed = b.borrowed_grads, d_in = b.dx;
    std::mt19937 rng(9);
    auto check = [&](const std::string& what, std::vector<float>& x, const std::vector<float>& analytic, int64_t lo,
                     int64_t n) {
      float scale = 0;
      for (int64_t i = lo; i < lo + n; ++i) scale = std::max(scale, std::fabs(analytic[i]));
      for (int k = 0; k < 12; ++k) {
        const int64_t i = lo + static_cast<int64_t>(rng() % n);
        const float keep = x[i], h = 1e-2f * std::max(1.0f, std::fabs(keep));
        x[i] = keep + h;
        const double up = b.loss();
        x[i] = keep - h;
        const double down = b.loss();
        x[i] = keep;
        const double numeric = (up - down) / (2.0 * h);
        EXPECT_NEAR(analytic[i], numeric, 0.02 * scale + 1e-4) << describe_case(f) << " " << what << "[" << i - lo << "]";
      }
    };
    for (const auto& p : b.u.params) {
      // A step of the router's weights large enough for fp32 differences moves tokens between
      // experts; its gradient is checked against PyTorch (tests/train/moe_parity_test.cc).
      if (p.name.find("block_sparse_moe.gate") != std::string::npos) continue;
      const int64_t rows = p.exported_rows >= 0 ? p.exported_numel() : p.numel;  // padding rows get no gradient
      check(p.name, b.params, g, p.offset, rows);
    }
    if (b.u.borrows >= 0)  // a DiT block reads the embedding's conditioning parameters, not its first
      for (const auto& w : f.desc.units[b.u.borrows].params)
        check("borrowed " + w.name, b.borrowed, g_borrowed, w.offset, w.exported_numel());
    if (!model::is_embedding(b.u.kind)) check("input", b.in, d_in, 0, static_cast<int64_t>(b.in.size()));
  }
}

// A block's forward over cp ranks, simulated in one process (each stage on every rank, the
// exchanges between stages delivered by hand), equals the whole sequence's forward at every
// position: both forms of the split, causal and bidirectional attention.
TEST(Layers, ContextParallelForwardEqualsTheWholeSequence) {
  kernels::init_compute(2);
  const int P = 2;
  for (const bool causal : {true, false})
    for (const char* preset : {"tiny", "llama-tiny"})
      for (const model::ContextImpl impl : {model::ContextImpl::ring, model::ContextImpl::all_to_all}) {
        model::ModelConfig c = config(preset);
        c.causal = causal;
        Fixture f{model::describe(c), 1};
        f.T = 64;
        const std::string at = std::string(preset) + " " + model::to_string(impl) + (causal ? " causal" : " bidirectional");
        Bench whole(f);
        whole.loss();  // the forward of the whole sequence into whole.out
        const int64_t C = c.n_embd, Tr = f.T / P, BT = f.B * Tr;
        const int64_t rows = model::context_chunk_rows(f.T, P, impl);
        model::Shape shape{f.B, Tr, 4, f.threads};
        shape.cp = P, shape.cp_impl = impl;
        const model::UnitCosts costs = f.desc.costs(1, shape);
        struct Rank {
          std::vector<int64_t> starts;
          std::vector<float> in, out;
          std::vector<char> saved, recomputable, fws, bws, send, recv, first_send;
        };
        std::vector<Rank> ranks(P);
        for (int r = 0; r < P; ++r) {
          Rank& k = ranks[r];
          k.starts = model::context_chunk_starts(f.T, P, r, impl);
          k.in.resize(BT * C);
          k.out.assign(BT * C, 0.0f);
          for (int64_t b = 0; b < f.B; ++b)
            for (size_t ch = 0; ch < k.starts.size(); ++ch)
              std::copy_n(whole.in.begin() + (b * f.T + k.starts[ch]) * C, rows * C,
                          k.in.begin() + (b * Tr + static_cast<int64_t>(ch) * rows) * C);
          k.saved.assign(costs.saved_bytes, 0);
          k.recomputable.assign(costs.recomputable_bytes, 0);
          k.fws.assign(costs.forward_workspace, 0);
          k.bws.assign(costs.backward_workspace, 0);
          k.send.assign(model::exchange_header_bytes(P) + 4 * BT * 3 * C, 0);  // a header, then at most q|k|v of every row
          k.recv.assign(k.send.size(), 0);
        }
        const int stages = impl == model::ContextImpl::ring ? P + 1 : 3;
        for (int st = 0; st < stages; ++st) {
          for (int r = 0; r < P; ++r) {
            Rank& k = ranks[r];
            UnitArgs a = whole.args();
            a.T = Tr, a.cp = P, a.cp_index = r, a.cp_impl = impl, a.stage = st;
            a.in = k.in.data(), a.out = k.out.data();
            a.saved = k.saved.data(), a.recomputable = k.recomputable.data();
            a.forward_ws = k.fws.data(), a.backward_ws = k.bws.data();
            a.send = k.send.data(), a.recv = k.recv.data();
            layer(f.desc.units[1].kind).forward(a);
          }
          // What each rank receives before the next stage.
          for (int r = 0; r < P; ++r) {
            Rank& k = ranks[r];
            if (impl == model::ContextImpl::ring) {
              // Stage s >= 1 attends to the key/value block of rank r - (s - 1), which that rank
              // sent at stage 0 (k|v rows, no header).
              if (st == 0) k.first_send = k.send;
              continue;
            }
            // The all-to-all: rank r's payload from every rank q, in rank order, after a header.
            int64_t at_byte = model::exchange_header_bytes(P);
            for (int q = 0; q < P; ++q) {
              const auto* sizes = reinterpret_cast<const int64_t*>(ranks[q].send.data());
              int64_t from = model::exchange_header_bytes(P);
              for (int j = 0; j < r; ++j) from += sizes[j];
              std::copy_n(ranks[q].send.begin() + from, sizes[r], k.recv.begin() + at_byte);
              reinterpret_cast<int64_t*>(k.recv.data())[q] = sizes[r];
              at_byte += sizes[r];
            }
          }
          if (impl == model::ContextImpl::ring)
            for (int r = 0; r < P; ++r) ranks[r].recv = ranks[((r - st) % P + P) % P].first_send;
        }
        double scale = 0;
        for (float x : whole.out) scale = std::max(scale, static_cast<double>(std::fabs(x)));
        for (int r = 0; r < P; ++r)
          for (int64_t b = 0; b < f.B; ++b)
            for (size_t ch = 0; ch < ranks[r].starts.size(); ++ch)
              for (int64_t i = 0; i < rows * C; ++i) {
                const float got = ranks[r].out[(b * Tr + static_cast<int64_t>(ch) * rows) * C + i];
                const float want = whole.out[(b * f.T + ranks[r].starts[ch]) * C + i];
                ASSERT_NEAR(got, want, 1e-5 * scale) << at << " rank " << r << " sequence " << b << " chunk " << ch;
              }
      }
}

TEST(Layers, RecomputeRebuildsBitwiseWhatTheForwardKept) {
  kernels::init_compute(2);
  for (const Fixture& f : fixtures()) {
    if (!model::is_block(f.desc.units[f.unit].kind)) continue;
    Bench b(f);
    layer(b.u.kind).forward(b.args());
    const std::vector<char> saved = b.saved, recomputable = b.recomputable;
    std::fill(b.recomputable.begin(), b.recomputable.end(), 0);
    layer(b.u.kind).recompute(b.args(), model::Recompute::selective);
    EXPECT_EQ(b.recomputable, recomputable) << describe_case(f) << " selective";
    EXPECT_EQ(b.saved, saved) << describe_case(f) << " selective leaves the saved part alone";
    std::fill(b.saved.begin(), b.saved.end(), 0);
    std::fill(b.recomputable.begin(), b.recomputable.end(), 0);
    layer(b.u.kind).recompute(b.args(), model::Recompute::full);
    EXPECT_EQ(b.saved, saved) << describe_case(f) << " full";
    EXPECT_EQ(b.recomputable, recomputable) << describe_case(f) << " full";
  }
  // selective_op rebuilds k, the attention projection and up from what it kept: every value the
  // backward reads, bitwise the forward's.
  for (const Fixture& f : selective_op_fixtures()) {
    Bench b(f);
    layer(b.u.kind).forward(b.args());
    const std::vector<char> saved = b.saved, recomputable = b.recomputable;
    std::fill(b.recomputable.begin(), b.recomputable.end(), 0);
    std::fill(b.fws.begin(), b.fws.end(), 0);
    layer(b.u.kind).recompute(b.args(), model::Recompute::selective_op);
    EXPECT_EQ(b.recomputable, recomputable) << describe_case(f) << " selective-op";
    EXPECT_EQ(b.saved, saved) << describe_case(f) << " selective-op leaves the kept part alone";
  }
}

// --act-quant int8: under each recompute mode the blocks carve what the model's costs say, and
// what is kept for the backward shrinks by the int8 form of its GEMM inputs (none: saved and
// recomputable; selective: saved only; full: nothing kept, so nothing compressed).
TEST(Layers, ActQuantCarvesTheModelsFiguresAndKeepsLess) {
  for (const char* preset : {"tiny", "llama-tiny", "moe-tiny"})
    for (model::Recompute mode : {model::Recompute::none, model::Recompute::selective, model::Recompute::full}) {
      Fixture plain{model::describe(config(preset)), 1};
      plain.recompute = mode;
      Fixture quant = plain;
      quant.act_quant.group = 32;
      const auto& u = quant.desc.units[1];
      MemoryPool memory;
      const Carved got = layer(u.kind).carved(*kernels::make_cpu_backend(memory), quant.desc, u, quant.shape());
      const model::UnitCosts want = quant.desc.costs(1, quant.shape()), fp32 = plain.desc.costs(1, plain.shape());
      const std::string at = std::string(preset) + " recompute " + model::to_string(mode);
      EXPECT_EQ(got.saved, want.saved_bytes) << at;
      EXPECT_EQ(got.recomputable, want.recomputable_bytes) << at;
      EXPECT_EQ(got.forward_ws, want.forward_workspace) << at;
      EXPECT_EQ(got.backward_ws, want.backward_workspace) << at;
      if (mode == model::Recompute::full) {
        EXPECT_EQ(want.kept_bytes(mode), fp32.kept_bytes(mode)) << at;
        EXPECT_EQ(want.saved_bytes + want.recomputable_bytes, fp32.saved_bytes + fp32.recomputable_bytes) << at;
        continue;
      }
      // The GEMM inputs a block keeps: q|k|v and the attention output (saved), both norms' outputs and
      // the MLP activation (recomputable); a MoE block's MLP is its experts', on the rows they
      // received (saved) and their SwiGLU output (recomputable). int8 + a scale per 32 values
      // instead of 4 bytes each.
      const auto& c = quant.desc.config;
      const int64_t BT = quant.B * quant.T, QKV = (c.n_head + 2 * c.n_kv_head) * c.head_size();
      const bool moe = c.family == model::Family::moe;
      const int64_t rows = moe ? c.expert_rows_bound(BT, 1, BT) : BT, width = moe ? c.moe_ffn_dim : c.ffn_dim;
      using model::detail::slice;
      auto shrink = [](int64_t n) { return slice(n, 4) - slice(n, 1) - slice(n / 32, 4); };
      int64_t less = shrink(BT * QKV) + shrink(BT * c.n_embd) + (moe ? shrink(rows * c.n_embd) : 0);
      if (mode == model::Recompute::none) less += 2 * shrink(BT * c.n_embd) + shrink(rows * width);
      EXPECT_EQ(fp32.kept_bytes(mode) - want.kept_bytes(mode), less) << at;
    }
}

// The compressed block computes its forward in fp32 (output bitwise the uncompressed one's) and
// its backward from the dequantized inputs: every gradient within a few per cent of fp32's (the
// int8 error is ~1/254 of a group's largest value), but not equal (the int8 form is what it read).
// Under selective recompute the rebuilt values are fp32; under full nothing is compressed.
TEST(Layers, ActQuantGradientsAreCloseToFp32s) {
  kernels::init_compute(2);
  for (const char* preset : {"tiny", "llama-tiny", "moe-tiny"})
    for (model::Recompute mode : {model::Recompute::none, model::Recompute::selective, model::Recompute::full})
      for (bool stochastic : {false, true}) {
        const std::string at = std::string(preset) + " recompute " + model::to_string(mode) +
                               (stochastic ? " stochastic" : " nearest");
        auto run = [&](bool quantized, std::vector<float>& out) {
          Fixture f{model::describe(config(preset)), 1};
          f.recompute = mode;
          if (quantized) f.act_quant = {32, stochastic};  // divides llama-tiny's ffn_dim (160)
          Bench b(f);
          const LayerKind& k = layer(b.u.kind);
          k.forward(b.args());
          out = b.out;
          if (mode != model::Recompute::none) {
            if (mode == model::Recompute::full) std::fill(b.saved.begin(), b.saved.end(), 0);
            std::fill(b.recomputable.begin(), b.recomputable.end(), 0);
            k.recompute(b.args(), mode);
          }
          b.dx = b.weights;
          k.backward(b.args());
          std::vector<float> g = b.grads;
          g.insert(g.end(), b.borrowed_grads.begin(), b.borrowed_grads.end());  // a MoE block's experts
          g.insert(g.end(), b.dx.begin(), b.dx.end());  // the input's gradient last
          return g;
        };
        std::vector<float> out_fp32, out_int8;
        const std::vector<float> g32 = run(false, out_fp32), g8 = run(true, out_int8);
        EXPECT_EQ(out_int8, out_fp32) << at << ": the forward's output";
        Fixture f{model::describe(config(preset)), 1};
        std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> tensors;
        const model::UnitDesc& u = f.desc.units[1];
        for (const auto& p : u.params) tensors.push_back({p.name, {p.offset, p.numel}});
        const int64_t experts = u.borrows >= 0 ? f.desc.units[u.borrows].numel : 0;
        if (experts > 0) tensors.push_back({"experts", {u.numel, experts}});
        tensors.push_back({"input", {u.numel + experts, static_cast<int64_t>(g32.size()) - u.numel - experts}});
        bool differs = false;
        for (const auto& [name, range] : tensors) {
          EXPECT_LT(testing::relative_l2(g8.data() + range.first, g32.data() + range.first, range.second), 0.05)
              << at << " " << name << ": relative L2 error";
          differs = differs || !std::equal(g8.begin() + range.first, g8.begin() + range.first + range.second,
                                           g32.begin() + range.first);
        }
        EXPECT_EQ(differs, mode != model::Recompute::full) << at;
      }
}

}  // namespace
}  // namespace shardlm::layers
