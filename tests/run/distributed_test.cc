// Every strategy, run by real processes under mpirun, against one process with the same global
// batch: losses per step and final parameters. Plus the failure modes: a rank that skips a
// collective, a rank that dies.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <tuple>

#include "ckpt/safetensors.h"
#include "comm/options.h"
#include "model/model.h"
#include "plan/plan.h"
#include "test_util.h"
#include "train/checkpoint.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::shardlm;
using testing::step_losses;

struct Layout {
  std::string strategy;
  int ranks;
  int shard_group;
  std::string dtypes = "";  // extra flags: bf16 parameters and/or reduction
  double loss_tol = 1e-5;   // relative, per step
  double param_tol = 1e-5;  // ||delta|| / ||p||, per tensor
  std::string model = "tiny";
  double gather_bucket_mb = 0;  // --gather-bucket-mb (0: one all_gather per unit)
  std::string keep = "";        // --keep-gathered ("": none)
  int cp = 1;                   // --cp: ranks each sequence is split over
  std::string cp_impl = "all-to-all";  // --cp-impl
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << l.model << " " << l.strategy << " x" << l.ranks << " " << l.dtypes << " gather buckets " << l.gather_bucket_mb << " keep " << l.keep
      << " cp " << l.cp << " " << l.cp_impl;
}

class DistributedSlow : public ::testing::TestWithParam<Layout> {
 protected:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --eps 1e-6 --save-every 5";
    runs_.create("dist");
    dir_ = runs_.dir;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  // 5 steps of the tiny model, saving the parameters at the end. AdamW's eps is 1e-6, not 1e-8:
  // the attention key bias has an exactly zero gradient in exact arithmetic (softmax ignores a
  // constant added to every score of a row), so its fp32 gradient is rounding noise of ~1e-11
  // that AdamW, with a tiny eps, normalises into lr-sized steps of random sign — different noise
  // for a different reduction order. eps = 1e-6 keeps those steps far below the tolerance while
  // leaving every real gradient (>= 1e-4 here) in Adam's normalised regime.
  static std::string args(const std::string& out, int batch, const std::string& model = "tiny") {
    return runs_.args(out, 5, batch, model);
  }
  // The model and plan configuration args() trains, as the executor sees them.
  static model::ModelDesc tiny(const std::string& model = "tiny") { return model::describe(model::model_preset(model, 256)); }
  static plan::PlanConfig plan_config(const std::string& strategy, int ranks, int batch) {
    plan::PlanConfig pc;
    pc.strategy = plan::parse_strategy(strategy);
    pc.world = ranks;
    pc.batch = batch;
    pc.seq = 32;
    return pc;
  }
  // The communicator's staging for one reduction under the MPI backend's defaults (what the
  // executor allocates, and the plan's reduction_scratch).
  static int64_t mpi_reduction_scratch(plan::Op op, int64_t count, int elem, int group) {
    return comm::mpi_scratch_bytes(comm::MpiOptions{},
                                   op == plan::Op::reduce_scatter ? comm::Reduction::reduce_scatter : comm::Reduction::all_reduce,
                                   count, elem == 2 ? DType::bf16 : DType::fp32, group);
  }
  // A mixture-of-experts run's steps (metrics.jsonl in `got`) against the one-process reference's
  // (in `want`): losses within 1e-5, loads and dropped fractions equal (none dropped where
  // `dropless`), and each rank's memory plan `p`'s: its state between steps exactly, each
  // category's peak within 1%. From step `routed_alike_until` on, the routing figures are not
  // compared and the losses only within `later_rel` (see the int8 test). Returns the steps compared.
  static int expect_moe_steps_match(const fs::path& got_dir, const fs::path& want_dir, const plan::Plan& p,
                                    const std::string& s, bool dropless, int routed_alike_until = 1 << 30,
                                    double later_rel = 1e-5) {
    const MemSnapshot want_mem = p.max_memory();
    const auto want = testing::read_metrics(want_dir / "metrics.jsonl");
    const auto got = testing::read_metrics(got_dir / "metrics.jsonl");
    int steps = 0;
    for (size_t i = 0, j = 0; i < got.size(); ++i) {
      const auto& row = got[i];
      if (!row.contains("loss")) continue;
      while (j < want.size() && !want[j].contains("loss")) ++j;
      if (j >= want.size()) {
        ADD_FAILURE() << s << ": more steps than the reference";
        break;
      }
      const auto& ref = want[j++];
      ++steps;
      const std::string at = s + " step " + row["step"].dump();
      const bool alike = row["step"].get<int>() < routed_alike_until;
      for (const char* key : {"loss", "aux_loss", "z_loss"})
        EXPECT_NEAR(row[key].get<double>(), ref[key].get<double>(), (alike ? 1e-5 : later_rel) * std::fabs(ref[key].get<double>()))
            << at << " " << key;
      if (alike) {
        for (const char* key : {"dropped_frac", "expert_load_min", "expert_load_max"})
          EXPECT_EQ(row[key].get<double>(), ref[key].get<double>()) << at << " " << key;
        // The same routings' figures, summed in another order.
        EXPECT_NEAR(row["expert_load_imbalance"].get<double>(), ref["expert_load_imbalance"].get<double>(), 1e-12) << at;
      }
      if (dropless) {
        EXPECT_EQ(row["dropped_frac"].get<double>(), 0.0) << at;
      }
      const auto& held = row["mem_between_steps"];
      EXPECT_EQ(held["params"].get<int64_t>(), p.static_memory.params) << at;
      EXPECT_EQ(held["grads"].get<int64_t>(), p.static_memory.grads) << at;
      EXPECT_EQ(held["optimizer"].get<int64_t>(), p.static_memory.optimizer) << at;
      for (int c = 0; c < kNumMemCategories; ++c) {
        const auto cat = static_cast<MemCategory>(c);
        const double used = row["mem_max"][to_string(cat)].get<double>(), planned = static_cast<double>(want_mem.bytes[c]);
        EXPECT_NEAR(used, planned, 0.01 * planned) << at << " " << to_string(cat);
      }
    }
    return steps;
  }
  // Every parameter tensor of two runs' checkpoints of step `step` within `tol` (relative, in
  // norm), read as a resume reads them (any layout into one process's): Hugging Face's export
  // refuses models it cannot express (a capacity-limited MoE), and these must compare too.
  // Returns the tensors' names; `worst` (if given) gets the largest relative difference.
  static std::vector<std::string> expect_same_weights(const fs::path& a_run, const fs::path& b_run, int step,
                                                      const std::string& s, double tol = 1e-5, double* worst = nullptr) {
    const fs::path at = fs::path("ckpt") / ("step_" + std::to_string(step));
    const model::ModelDesc desc = model::describe(train::read_checkpoint_config((a_run / at).string()));
    const model::FlatLayout layout = model::flat_layout(desc);
    std::vector<float> a(layout.total), b(layout.total);
    train::load_checkpoint((a_run / at).string(), desc, layout, a.data(), nullptr, nullptr);
    train::load_checkpoint((b_run / at).string(), desc, layout, b.data(), nullptr, nullptr);
    std::vector<std::string> names;
    for (size_t u = 0; u < desc.units.size(); ++u)
      for (const model::ParamSpec& param : desc.units[u].params) {
        const int64_t first = layout.units[u].offset + param.offset;
        double diff = 0, norm = 0;
        for (int64_t i = first; i < first + param.numel; ++i) diff += (a[i] - b[i]) * double(a[i] - b[i]), norm += a[i] * double(a[i]);
        EXPECT_LE(std::sqrt(diff), tol * std::sqrt(norm)) << s << " " << param.name;
        if (worst && norm > 0) *worst = std::max(*worst, std::sqrt(diff / norm));
        names.push_back(param.name);
      }
    return names;
  }
  static inline testing::TinyRuns runs_;
  static inline fs::path dir_;
};

TEST_P(DistributedSlow, MatchesOneProcessWithTheSameGlobalBatch) {
  const Layout l = GetParam();
  const int B = 2, dp = l.ranks / l.cp;  // the ranks of a cp group read the same sequences
  const std::string single = "single_" + l.model + "_" + std::to_string(dp);
  if (!fs::exists(dir_ / single / "metrics.jsonl")) {
    const auto r = shardlm(args(single, B * dp, l.model));
    ASSERT_EQ(r.code, 0) << r.out;
  }
  const std::string name = l.model + "_" + l.strategy + "_" + std::to_string(l.ranks) + (l.dtypes.empty() ? "" : "_bf16") +
                           (l.gather_bucket_mb > 0 ? "_buckets" : "") + (l.keep.empty() ? "" : "_keep") +
                           (l.cp > 1 ? "_cp" + std::to_string(l.cp) + "_" + l.cp_impl : "");
  std::string extra = " --strategy " + l.strategy + " " + l.dtypes;
  if (l.cp > 1) extra += " --cp " + std::to_string(l.cp) + " --cp-impl " + l.cp_impl;
  if (!l.keep.empty()) extra += " --keep-gathered " + l.keep;
  if (l.gather_bucket_mb > 0) extra += " --gather-bucket-mb " + std::to_string(l.gather_bucket_mb);
  if (l.shard_group > 0) extra += " --shard-group " + std::to_string(l.shard_group);
  const auto r = l.ranks == 1 ? shardlm(args(name, B, l.model) + extra) : mpirun(l.ranks, args(name, B, l.model) + extra);
  ASSERT_EQ(r.code, 0) << r.out;

  // Memory is accounted, not guessed: between steps each rank holds exactly the plan's (sharded)
  // state; within a step every category's highest bytes (the maximum over ranks) are the plan's —
  // gathered parameters, full gradients, activations, workspace and comm (bf16 casts and the
  // communicator's staging for each reduction) included — within 1%.
  plan::PlanConfig pc = plan_config(l.strategy, l.ranks, B);
  pc.reduction_scratch = mpi_reduction_scratch;
  pc.shard_group = l.shard_group;
  pc.param_bytes = l.dtypes.find("--param-dtype bf16") != std::string::npos ? 2 : 4;
  pc.reduce_bytes = l.dtypes.find("--reduce-dtype bf16") != std::string::npos ? 2 : 4;
  pc.gather_bucket_mb = l.gather_bucket_mb;
  if (!l.keep.empty()) pc.keep_gathered = {l.keep};
  pc.cp = l.cp;
  pc.cp_impl = model::parse_context_impl(l.cp_impl);
  const model::ModelDesc desc = tiny(l.model);
  const plan::Plan p = plan::build_plan(desc, pc);
  const MemSnapshot want = p.max_memory();
  for (const auto& row : testing::read_metrics(dir_ / name / "metrics.jsonl")) {
    if (!row.contains("loss")) continue;
    const auto& held = row["mem_between_steps"];
    EXPECT_EQ(held["params"].get<int64_t>(), p.static_memory.params);
    EXPECT_EQ(held["grads"].get<int64_t>(), p.static_memory.grads);
    EXPECT_EQ(held["optimizer"].get<int64_t>(), p.static_memory.optimizer);
    for (int c = 0; c < kNumMemCategories; ++c) {
      const auto cat = static_cast<MemCategory>(c);
      const double got = row["mem_max"][to_string(cat)].get<double>(), planned = static_cast<double>(want.bytes[c]);
      EXPECT_NEAR(got, planned, 0.01 * planned) << to_string(cat) << " step " << row["step"];
    }
  }
  if (l.strategy == "fsdp" || l.strategy == "zero2") {
    EXPECT_EQ(p.static_memory.grads * pc.world, p.layout.total * 4);
  }

  const auto want_losses = step_losses(dir_ / single / "metrics.jsonl");
  const auto got = step_losses(dir_ / name / "metrics.jsonl");
  ASSERT_EQ(want_losses.size(), 5u);
  ASSERT_EQ(got.size(), 5u);
  for (int s = 0; s < 5; ++s) EXPECT_NEAR(got[s], want_losses[s], l.loss_tol * std::fabs(want_losses[s])) << "step " << s;

  size_t params = 0;
  for (const auto& u : desc.units) params += u.params.size();
  double worst = 0;
  EXPECT_EQ(expect_same_weights(dir_ / single, dir_ / name, 5, name, l.param_tol, &worst).size(), params);
  std::cout << "worst ||delta||/||p|| over tensors: " << worst << "\n";
}

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (int n : {1, 2, 3, 4})
    for (const char* s : {"ddp", "zero1", "zero2", "fsdp"}) out.push_back({s, n, 0});
  out.push_back({"hybrid", 4, 2});
  out.push_back({"hybrid", 2, 1});
  // LLaMA (grouped-query attention, untied head) under every strategy at 2, 3 and 4 ranks.
  for (int n : {2, 3, 4})
    for (const char* s : {"ddp", "zero1", "zero2", "fsdp"}) out.push_back({s, n, 0, "", 1e-5, 1e-5, "llama-tiny"});
  out.push_back({"hybrid", 4, 2, "", 1e-5, 1e-5, "llama-tiny"});
  // Mixed precision: bf16 carries 8 significant bits (relative rounding 2^-9), so gathered
  // parameters and reduced gradients differ from fp32 by ~0.2% each. With bf16 reduction only,
  // over 5 AdamW steps the losses stay within 1e-3 of the fp32 single process and the
  // parameters within 1e-2 (measured 4e-3). With bf16 gathered parameters the forward itself
  // runs on rounded weights and AdamW's near-sign updates of size lr (5 × 3e-3, as large as the
  // 0.01–0.02 init) follow slightly different directions: losses within 1e-2 (measured 3.6e-3)
  // and parameters within 0.15 (measured 0.076, on small biases and residual projections).
  const std::string bf16 = "--param-dtype bf16 --reduce-dtype bf16";
  out.push_back({"fsdp", 2, 0, bf16, 1e-2, 0.15});
  out.push_back({"hybrid", 4, 2, bf16, 1e-2, 0.15});
  out.push_back({"ddp", 3, 0, "--reduce-dtype bf16", 1e-3, 1e-2});
  out.push_back({"zero2", 2, 0, "--reduce-dtype bf16", 1e-3, 1e-2});
  // All-gather buckets (0.4 MiB: tiny's two blocks share a gather; in bf16 the head too): the
  // buckets' comm staging and the gathered units alive together are the plan's, as measured.
  out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, "tiny", 0.4});
  out.push_back({"hybrid", 4, 2, bf16, 1e-2, 0.15, "tiny", 0.4});
  out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, "llama-tiny", 0.4});
  // Half of every unit kept from its forward to its backward: the kept parts (in the wire dtype)
  // and the rest's staging are the plan's, as measured.
  out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, "tiny", 0, "all:0.5"});
  out.push_back({"hybrid", 4, 2, bf16, 1e-2, 0.15, "llama-tiny", 0, "all:0.5"});
  // Context parallel, heads split over cp (all-to-all): cp alone, cp × data parallel, each strategy
  // kind; the ranks of a cp group hold 1/cp of each sequence's positions, so the one-process
  // reference has the data-parallel ranks' batch.
  out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, "tiny", 0, "", 2});
  out.push_back({"ddp", 2, 0, "", 1e-5, 1e-5, "tiny", 0, "", 2});
  out.push_back({"fsdp", 4, 0, "", 1e-5, 1e-5, "tiny", 0, "", 4});
  out.push_back({"zero2", 4, 0, "", 1e-5, 1e-5, "tiny", 0, "", 2});
  out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, "llama-tiny", 0, "", 2});
  out.push_back({"fsdp", 4, 0, "", 1e-5, 1e-5, "llama-tiny", 0, "", 2});
  out.push_back({"hybrid", 4, 2, "", 1e-5, 1e-5, "llama-tiny", 0, "", 2});
  // Ring attention: cp 2 and 4 alone, cp 2 × fsdp 2, and the other strategy kinds.
  for (const char* model : {"tiny", "llama-tiny"}) {
    out.push_back({"fsdp", 2, 0, "", 1e-5, 1e-5, model, 0, "", 2, "ring"});
    out.push_back({"fsdp", 4, 0, "", 1e-5, 1e-5, model, 0, "", 4, "ring"});
    out.push_back({"fsdp", 4, 0, "", 1e-5, 1e-5, model, 0, "", 2, "ring"});
  }
  out.push_back({"ddp", 2, 0, "", 1e-5, 1e-5, "llama-tiny", 0, "", 2, "ring"});
  out.push_back({"zero2", 4, 0, "", 1e-5, 1e-5, "tiny", 0, "", 2, "ring"});
  out.push_back({"hybrid", 4, 2, "", 1e-5, 1e-5, "llama-tiny", 0, "", 2, "ring"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Strategies, DistributedSlow, ::testing::ValuesIn(layouts()), [](const auto& info) {
  return (info.param.model == "tiny" ? "" : "llama_") + info.param.strategy + "_np" + std::to_string(info.param.ranks) +
         (info.param.shard_group ? "_g" + std::to_string(info.param.shard_group) : "") +
         (info.param.dtypes.empty() ? "" : "_bf16") + (info.param.gather_bucket_mb > 0 ? "_buckets" : "") + (info.param.keep.empty() ? "" : "_keep") +
         (info.param.cp > 1 ? "_cp" + std::to_string(info.param.cp) + (info.param.cp_impl == "ring" ? "_ring" : "") : "");
});

// A checkpoint written under one strategy and rank count resumes under another with the same
// global batch and continues the uninterrupted run's losses.
TEST_F(DistributedSlow, ResumeAcrossStrategiesAndRankCounts) {
  const std::string base = " --steps 6 --save-every 3";
  auto run = [&](int ranks, const std::string& name, int batch, const std::string& extra) {
    std::string a = args(name, batch) + base + extra;
    const auto r = ranks == 1 ? shardlm(a) : mpirun(ranks, a);
    EXPECT_EQ(r.code, 0) << r.out;
  };
  run(1, "resume_full", 4, "");
  run(2, "resume_fsdp2", 2, " --strategy fsdp");
  const std::string ck = (dir_ / "resume_fsdp2" / "ckpt" / "step_3").string();
  run(4, "resume_ddp4", 1, " --strategy ddp --resume " + ck);
  const auto full = step_losses(dir_ / "resume_full" / "metrics.jsonl");
  const auto resumed = step_losses(dir_ / "resume_ddp4" / "metrics.jsonl");
  ASSERT_EQ(full.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(resumed[i], full[3 + i], 1e-5 * std::fabs(full[3 + i])) << "step " << 3 + i;
}

// Gradient accumulation: micro-steps accumulate locally and communicate once, or (zero2, fsdp,
// hybrid with --reduce-each-micro-step) reduce-scatter every micro-step into the held shard; N
// ranks with --batch B --grad-accum K match one process with --batch N·B --grad-accum K. K = 5:
// the plan repeats its middle micro-step (Plan::repeat), gathers and reductions included. Each
// category's measured peak is the plan's.
TEST_F(DistributedSlow, GradientAccumulationMatchesOneProcess) {
  const int K = 5;
  const auto single = shardlm(args("accum_single", 4) + " --grad-accum " + std::to_string(K));
  ASSERT_EQ(single.code, 0) << single.out;
  const auto want = step_losses(dir_ / "accum_single" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 5u);
  struct Case {
    std::string strategy;
    int ranks;
    bool each;
  };
  std::map<std::string, int64_t> grads_peak;
  for (const Case& k : {Case{"fsdp", 2, false}, Case{"zero1", 2, false}, Case{"fsdp", 2, true}, Case{"zero2", 2, true},
                        Case{"hybrid", 4, true}}) {
    const std::string name = "accum_" + k.strategy + (k.each ? "_each" : "");
    std::string flags = " --grad-accum " + std::to_string(K) + " --strategy " + k.strategy;
    if (k.strategy == "hybrid") flags += " --shard-group 2";
    if (k.each) flags += " --reduce-each-micro-step";
    const auto r = mpirun(k.ranks, args(name, 4 / k.ranks) + flags);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto got = step_losses(dir_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), 5u);
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i])) << name << " step " << i;

    plan::PlanConfig pc = plan_config(k.strategy, k.ranks, 4 / k.ranks);
    pc.grad_accum = K, pc.shard_group = k.strategy == "hybrid" ? 2 : 0, pc.reduce_each_micro_step = k.each;
    pc.reduction_scratch = mpi_reduction_scratch;
    const plan::Plan p = plan::build_plan(tiny(), pc);
    const MemSnapshot planned = p.max_memory();
    for (const auto& row : testing::read_metrics(dir_ / name / "metrics.jsonl")) {
      if (!row.contains("loss")) continue;
      for (int c = 0; c < kNumMemCategories; ++c) {
        const auto cat = static_cast<MemCategory>(c);
        const double used = row["mem_max"][to_string(cat)].get<double>(), plan_bytes = static_cast<double>(planned.bytes[c]);
        EXPECT_NEAR(used, plan_bytes, 0.01 * plan_bytes) << name << " " << to_string(cat) << " step " << row["step"];
      }
    }
    grads_peak[name] = planned.bytes[static_cast<int>(MemCategory::grads)];
  }
  // Never more gradient memory; on `tiny` no less either, its tied embedding's gradients (the
  // largest) being alive through every backward (Plan.ReducingEachMicroStep... shows the saving).
  EXPECT_LE(grads_peak["accum_fsdp_each"], grads_peak["accum_fsdp"]);
}

// Ring attention's point-to-point traffic as the executor records it (each exchange slice of the
// trace is one send and one receive between ring neighbours): per block and step, K − 1 forward
// steps of a key/value block (B·T rows of 2·NKV·HS floats) and 2K − 3 backward steps of one such
// block each (K − 1 gradient accumulators, K − 2 key/value blocks).
TEST_F(DistributedSlow, RingStepsMoveOneBlockEach) {
  const int K = 4, steps = 2, B = 2;
  const fs::path trace_path = dir_ / "ring_trace.json";
  const auto r = mpirun(K, args("ring_trace", B, "llama-tiny") + " --steps " + std::to_string(steps) +
                               " --strategy fsdp --cp 4 --cp-impl ring --trace " + trace_path.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const model::ModelDesc desc = tiny("llama-tiny");
  const int64_t block = 4 * B * (32 / K) * 2 * desc.config.n_kv_head * desc.config.head_size();
  std::ifstream f(trace_path);
  ASSERT_TRUE(f) << trace_path;
  const nlohmann::json trace = nlohmann::json::parse(f);
  std::map<std::tuple<int, int64_t, bool>, std::vector<int64_t>> moved;  // (rank, step, backward) -> bytes
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || e["args"]["step"].get<int64_t>() < 0) continue;
    const std::string name = e["name"];
    if (name.rfind("exchange ", 0) != 0) continue;
    ASSERT_TRUE(e["args"].contains("bytes moved")) << name;
    moved[{e["pid"].get<int>(), e["args"]["step"].get<int64_t>(), name.find(" grads") != std::string::npos}].push_back(
        e["args"]["bytes moved"].get<int64_t>());
  }
  EXPECT_EQ(moved.size(), static_cast<size_t>(K * steps * 2));  // every rank, step and direction
  for (const auto& [key, got] : moved) {
    const auto& [rank, step, backward] = key;
    EXPECT_EQ(got.size(), static_cast<size_t>(desc.config.n_layer * (backward ? 2 * K - 3 : K - 1)))
        << rank << " " << step << " " << backward;
    for (int64_t b : got) EXPECT_EQ(b, block) << rank << " " << step;
  }
}

// The trace of a 2-rank fsdp run: a process per rank, a thread per stream, every task of the
// plan once per step on its stream in plan order, no task starting before its dependencies
// ended, memory counters for every category. And the distributed metrics carry their fields.
TEST_F(DistributedSlow, TraceHasEveryTaskInPlanOrderAfterItsDependencies) {
  const int steps = 2;
  const fs::path trace_path = dir_ / "trace.json";
  const auto r = mpirun(2, args("trace", 2) + " --steps " + std::to_string(steps) + " --strategy fsdp --trace " +
                               trace_path.string());
  ASSERT_EQ(r.code, 0) << r.out;

  const model::ModelDesc desc = tiny();
  const plan::Plan p = plan::build_plan(desc, plan_config("fsdp", 2, 2));

  std::ifstream f(trace_path);
  ASSERT_TRUE(f) << trace_path;
  const nlohmann::json trace = nlohmann::json::parse(f);
  // slices[rank][step][stream]: (start, end) in stream order.
  std::map<int, std::map<int64_t, std::map<int, std::vector<std::pair<double, double>>>>> slices;
  std::map<int, std::map<int, std::vector<std::string>>> names;  // [rank][stream], step 0's names
  std::map<int, std::set<std::string>> threads, counters, forward_only;
  std::set<int> processes;
  for (const auto& e : trace["traceEvents"]) {
    const std::string ph = e["ph"];
    const int pid = e["pid"];
    if (ph == "M" && e["name"] == "process_name") processes.insert(pid);
    if (ph == "M" && e["name"] == "thread_name") threads[pid].insert(e["args"]["name"].get<std::string>());
    if (ph == "C")
      for (const auto& [k, v] : e["args"].items()) counters[pid].insert(k);
    if (ph != "X") continue;
    const int tid = e["tid"];
    const int64_t step = e["args"]["step"];
    if (step < 0) {  // evaluation and sampling: forward-only plans on the same executor
      forward_only[pid].insert(e["name"].get<std::string>().substr(0, 4));
      continue;
    }
    const double ts = e["ts"], dur = e["dur"];
    ASSERT_GE(dur, 0);
    slices[pid][step][tid].push_back({ts, ts + dur});
    if (slices[pid].size() == 1) names[pid][tid].push_back(e["name"]);
  }
  EXPECT_EQ(processes, (std::set<int>{0, 1}));
  for (int rank : {0, 1}) EXPECT_EQ(forward_only[rank], (std::set<std::string>{"all_", "forw", "loss"})) << rank;
  for (int rank : {0, 1}) {
    EXPECT_EQ(threads[rank], (std::set<std::string>{"compute", "comm"}));
    EXPECT_EQ(counters[rank], (std::set<std::string>{"params", "grads", "optimizer", "activations", "comm", "workspace",
                                                      "snapshot", "staging"}));
    ASSERT_EQ(slices[rank].size(), static_cast<size_t>(steps));
    // The plan's tasks per stream, in order: position k of stream s is task order[s][k].
    std::map<int, std::vector<int>> order;
    for (const auto& t : p.tasks) order[static_cast<int>(t.stream)].push_back(t.id);
    for (const auto& [stream, ids] : order) {
      ASSERT_EQ(names[rank][stream].size(), ids.size()) << "rank " << rank << " stream " << stream;
      for (size_t k = 0; k < ids.size(); ++k) EXPECT_EQ(names[rank][stream][k], p.tasks[ids[k]].name(&desc));
    }
    for (auto& [step, by_stream] : slices[rank]) {
      std::vector<std::pair<double, double>> when(p.tasks.size(), {-1, -1});
      for (auto& [stream, spans] : by_stream) {
        // Recorded at completion: order them by start, then they are the stream's queue order.
        std::sort(spans.begin(), spans.end());
        ASSERT_EQ(spans.size(), order[stream].size());
        for (size_t k = 0; k < spans.size(); ++k) {
          if (k > 0) {
            EXPECT_GE(spans[k].first, spans[k - 1].second) << "stream " << stream << " overlaps itself";
          }
          when[order[stream][k]] = spans[k];
        }
      }
      for (const auto& t : p.tasks)
        for (int d : t.deps)
          EXPECT_GE(when[t.id].first, when[d].second)
              << "rank " << rank << " step " << step << ": " << t.name(&desc) << " started before " << p.tasks[d].name(&desc)
              << " ended";
    }
  }

  const auto rows = testing::read_metrics(dir_ / "trace" / "metrics.jsonl");
  int step_rows = 0;
  for (const auto& row : rows) {
    if (!row.contains("loss")) continue;
    ++step_rows;
    EXPECT_GE(row["comm_exposed_ms"].get<double>(), 0.0);
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0.0);
    for (const char* k : {"params", "grads", "optimizer", "activations", "comm", "workspace", "staging", "total"})
      EXPECT_TRUE(row["mem"].contains(k)) << k;
  }
  EXPECT_EQ(step_rows, steps);
}

class FailureSlow : public DistributedSlow {};

TEST_F(FailureSlow, ARankThatSkipsACollectiveFailsTheJobWithItsName) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = mpirun(3, args("skip", 2) + " --timeout 3", "-x SHARDLM_FAULT_SKIP_COLLECTIVE=1:2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  // A survivor waits in the first collective rank 1 skipped, reports it by name and names the
  // rank it still waits for — not itself, not the other survivor.
  EXPECT_NE(r.out.find("all_gather unit embedding step 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("still waiting for rank 1"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("still waiting for rank 0"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("still waiting for rank 2"), std::string::npos) << r.out;
  EXPECT_LT(s, 60) << "the job took " << s << " s to fail";
}

TEST_F(FailureSlow, AKilledRankEndsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = mpirun(2, args("kill", 2), "-x SHARDLM_FAULT_KILL=1:2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(s, 60) << "the job took " << s << " s to end";
}

}  // namespace
}  // namespace shardlm

namespace shardlm {
namespace {

// A recompute case, "MODE" or "MODE:N" (on N blocks): sets `pc` and returns its train flags.
std::string recompute_case(const std::string& spec, plan::PlanConfig& pc) {
  const size_t colon = spec.find(':');
  const std::string mode = spec.substr(0, colon);
  pc.recompute = model::parse_recompute(mode);
  if (colon == std::string::npos) return " --recompute " + mode;
  pc.recompute_blocks = std::stoi(spec.substr(colon + 1));
  return " --recompute " + mode + " --recompute-blocks " + spec.substr(colon + 1);
}
// A recompute case as part of a run directory's name: "full:1" is "full_1".
std::string recompute_case_name(std::string spec) {
  std::replace(spec.begin(), spec.end(), ':', '_');
  return spec;
}

// Recompute changes memory, never numbers: under fsdp on 2 ranks, selective and full (and on LLaMA
// selective-op), on every block or on one of the two, give bitwise the losses, gradient norms and
// final parameters of none, and each mode's measured activation peak is exactly the plan's.
TEST_F(DistributedSlow, RecomputeIsBitwiseAndItsActivationPeakIsThePlans) {
  for (const std::string model : {"tiny", "llama-tiny"}) {
    std::map<std::string, int64_t> peak;
    std::vector<nlohmann::json> base;
    std::string base_weights;
    std::vector<std::string> modes{"none", "selective", "full", "full:1"};
    if (model == "llama-tiny") modes.insert(modes.end(), {"selective-op", "selective-op:1"});  // LLaMA blocks only
    for (const std::string& mode : modes) {
      const std::string name = "recompute_" + model + "_" + recompute_case_name(mode);
      plan::PlanConfig pc = plan_config("fsdp", 2, 2);
      const auto r = mpirun(2, args(name, 2, model) + " --strategy fsdp" + recompute_case(mode, pc));
      ASSERT_EQ(r.code, 0) << r.out;
      const plan::Plan p = plan::build_plan(tiny(model), pc);
      std::vector<nlohmann::json> rows;
      for (const auto& row : testing::read_metrics(dir_ / name / "metrics.jsonl")) {
        if (!row.contains("loss")) continue;
        EXPECT_EQ(row["mem_max"]["activations"].get<int64_t>(), p.max_memory()[MemCategory::activations])
            << model << " " << mode;
        rows.push_back(row);
      }
      peak[mode] = p.max_memory()[MemCategory::activations];
      std::ifstream f(testing::exported_weights(dir_ / name / "ckpt" / "step_5"), std::ios::binary);
      const std::string weights((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (mode == "none") {
        base = rows;
        base_weights = weights;
        continue;
      }
      ASSERT_EQ(rows.size(), base.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(rows[i]["loss"].get<double>(), base[i]["loss"].get<double>()) << model << " " << mode << " step " << i;
        EXPECT_EQ(rows[i]["grad_norm"].get<double>(), base[i]["grad_norm"].get<double>()) << model << " " << mode;
      }
      EXPECT_TRUE(weights == base_weights) << model << " " << mode << ": parameters differ after 5 steps";
    }
    EXPECT_LT(peak["selective"], peak["none"]) << model;
    EXPECT_LT(peak["full"], peak["selective"]) << model;
    EXPECT_LT(peak["full:1"], peak["none"]) << model;
    EXPECT_GT(peak["full:1"], peak["full"]) << model;
    if (model != "llama-tiny") continue;
    // torchtitan's op policy keeps less than selective, but a block rebuilding or running its forward
    // holds its kept q|v and gate beside the whole q|k|v and gate|up: at two tiny blocks that
    // transient sets the peak (Plan.SelectiveOpKeepsLessThanSelective compares real sizes).
    EXPECT_LE(peak["selective-op"], peak["selective"]);
    EXPECT_GT(peak["selective-op"], peak["full"]);
    EXPECT_GT(peak["selective-op:1"], peak["selective-op"]);
  }
}

}  // namespace
}  // namespace shardlm

namespace shardlm {
namespace {

// --act-quant int8 under fsdp on 2 ranks, with selective recompute (on every block, or on one,
// where the blocks keep different buffers) and without: each rank's measured activation peak is
// the plan's (smaller than fp32's), step 0's loss is fp32's bits (the forward is uncompressed)
// and the later losses stay within 2%.
TEST_F(DistributedSlow, ActQuantPeakIsThePlansAndLossesStayClose) {
  for (const std::string mode : {"none", "selective", "selective:1"}) {
    std::vector<double> losses[2];
    int64_t peak[2] = {0, 0};
    for (int q = 0; q < 2; ++q) {
      const std::string name = "act_quant_" + recompute_case_name(mode) + (q ? "_int8" : "_fp32");
      plan::PlanConfig pc = plan_config("fsdp", 2, 2);
      const auto r = mpirun(2, args(name, 2) + " --strategy fsdp" + recompute_case(mode, pc) +
                                   (q ? " --act-quant int8 --act-quant-group 32 --act-quant-rounding stochastic" : ""));
      ASSERT_EQ(r.code, 0) << r.out;
      if (q) pc.act_quant = {32, true};
      peak[q] = plan::build_plan(tiny(), pc).max_memory()[MemCategory::activations];
      for (const auto& row : testing::read_metrics(dir_ / name / "metrics.jsonl")) {
        if (!row.contains("loss")) continue;
        EXPECT_EQ(row["mem_max"]["activations"].get<int64_t>(), peak[q]) << name;
        losses[q].push_back(row["loss"].get<double>());
      }
    }
    EXPECT_LT(peak[1], peak[0]) << mode;
    ASSERT_EQ(losses[0].size(), losses[1].size());
    ASSERT_FALSE(losses[0].empty());
    EXPECT_EQ(losses[1][0], losses[0][0]) << mode;
    for (size_t i = 1; i < losses[0].size(); ++i) EXPECT_NEAR(losses[1][i], losses[0][i], 0.02 * losses[0][i]) << mode;
  }
}

// A mixture-of-experts model (moe-tiny; each block borrows its experts unit) at 2 and 4 ranks
// (--batch 4/ranks --grad-accum 2), under ddp, zero1, zero2, fsdp and hybrid, with and without
// expert parallelism, against one process with --batch 4/ranks and --grad-accum 2 × ranks: the same
// sequences in the same routing groups (a rank's micro-batch is one of the process's micro-steps,
// data/sampler.h), so the load-balancing loss, the z-loss and, with --capacity-factor, the
// dropped tokens are the same. Losses over 10 steps and the final parameters within 1e-5.
//
// With --ep K the ranks of an expert group run E / K experts each and hold only those experts'
// state (the allocator's figures are the plan's): the routed rows travel to their experts and
// back through the exchanges between the block's stages (all_to_all_v over ep), whose bytes the
// trace records.
TEST_F(DistributedSlow, MixtureOfExpertsMatchesOneProcess) {
  constexpr int kSteps = 10;
  struct Layout {
    std::string name;
    int ranks;
    std::string strategy;
    int ep = 1, shard_group = 0;
    std::string capacity = "";  // --capacity-factor ("": dropless)
    std::string flags() const {
      return " --grad-accum 2 --strategy " + strategy + " --ep " + std::to_string(ep) +
             (shard_group > 0 ? " --shard-group " + std::to_string(shard_group) : "") +
             (capacity.empty() ? "" : " --capacity-factor " + capacity);
    }
  };
  const std::vector<Layout> layouts = {
      {"ddp", 2, "ddp"},
      {"fsdp", 2, "fsdp"},
      {"ddp_ep2", 2, "ddp", 2},
      {"zero1_ep2", 2, "zero1", 2},
      {"zero2_ep2", 2, "zero2", 2},
      {"fsdp_ep2", 2, "fsdp", 2},
      {"fsdp_ep2_np4", 4, "fsdp", 2},
      {"ddp_ep4_np4", 4, "ddp", 4},
      {"hybrid_ep2_np4", 4, "hybrid", 2, 2},
      {"ddp_ep2_cap", 2, "ddp", 2, 0, "1.0"},
      {"fsdp_ep2_cap", 2, "fsdp", 2, 0, "1.0"},
      {"fsdp_ep2_np4_cap", 4, "fsdp", 2, 0, "1.0"},
      {"ddp_ep4_np4_cap", 4, "ddp", 4, 0, "1.0"}};
  for (const Layout& l : layouts) {
    const std::string s = l.name;
    model::ModelConfig config = model::model_preset("moe-tiny", 256);
    if (!l.capacity.empty()) config.capacity_factor = std::stod(l.capacity);
    const model::ModelDesc desc = model::describe(config);
    // The one process routing the same groups: a micro-step per rank and micro-step.
    const std::string single = "moe_single_np" + std::to_string(l.ranks) + (l.capacity.empty() ? "" : "_cap");
    if (!fs::exists(dir_ / single / "metrics.jsonl")) {
      const auto r = shardlm(runs_.args(single, kSteps, 4 / l.ranks, "moe-tiny") + " --grad-accum " +
                             std::to_string(2 * l.ranks) +
                             (l.capacity.empty() ? "" : " --capacity-factor " + l.capacity));
      ASSERT_EQ(r.code, 0) << r.out;
    }
    // Each rank holds its ep slice of the experts (a part of it): the allocator's state bytes are
    // the plan's, and the experts' part is 1/ep of what ep 1 holds where that held them whole.
    plan::PlanConfig pc = plan_config(l.strategy, l.ranks, 4 / l.ranks);
    pc.grad_accum = 2, pc.shard_group = l.shard_group;
    pc.reduction_scratch = mpi_reduction_scratch;
    const plan::Plan one = plan::build_plan(desc, pc);
    pc.ep = l.ep;
    const plan::Plan p = plan::build_plan(desc, pc);
    for (size_t u = 0; u < desc.units.size(); ++u)
      if (desc.units[u].kind == model::UnitKind::moe_experts && l.strategy == "ddp") {
        for (plan::State k : {plan::State::params, plan::State::grads, plan::State::optimizer})
          EXPECT_EQ(p.held_elems(k, static_cast<int>(u)) * l.ep, one.held_elems(k, static_cast<int>(u))) << s;
      }

    const fs::path trace = dir_ / ("moe_" + s + ".json");
    const auto r = mpirun(l.ranks, runs_.args("moe_" + s, kSteps, 4 / l.ranks, "moe-tiny") + l.flags() + " --trace " +
                                       trace.string());
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream tf(trace);
    int64_t exchanges = 0, moved = 0;
    const nlohmann::json events = nlohmann::json::parse(tf);
    for (const auto& e : events["traceEvents"])
      if (e["name"].get<std::string>().rfind("exchange ", 0) == 0) ++exchanges, moved += e["args"]["bytes moved"].get<int64_t>();
    EXPECT_EQ(exchanges > 0, l.ep > 1) << s;
    EXPECT_EQ(moved > 0, l.ep > 1) << s << ": routed rows travel to the other ranks' experts";

    EXPECT_EQ(expect_moe_steps_match(dir_ / ("moe_" + s), dir_ / single, p, s, l.capacity.empty()), kSteps) << s;
    int tensors = 0;
    for (const std::string& tensor : expect_same_weights(dir_ / single, dir_ / ("moe_" + s), kSteps, s))
      tensors += tensor.find(".experts.") != std::string::npos;
    EXPECT_EQ(tensors, 2 * 4 * 3) << "every expert weight of both blocks is checked";
  }
  // Capacity 1.0 drops tokens in these runs (else the _cap layouts would prove nothing more).
  double dropped = 0;
  for (const auto& row : testing::read_metrics(dir_ / "moe_single_np2_cap" / "metrics.jsonl"))
    if (row.contains("dropped_frac")) dropped += row["dropped_frac"].get<double>();
  EXPECT_GT(dropped, 0.0);
}

// --act-quant int8 (nearest) on moe-tiny under fsdp with ep 2 at 2 ranks, against one process
// routing the same groups with the same compression: a group of values lies inside one row, so a
// routed row is rounded alike on whichever rank its expert runs. Step 0's loss and loads agree
// within 1e-5 as the fp32 runs' do, each rank's memory is the plan's at every step. Later steps
// start from weights an ulp apart (the gradients summed in another order), and a value an ulp from
// a rounding boundary lands on the neighbouring int8 step: a near-tied token can then take another
// expert, after which the losses agree within 1e-3 and the final parameters within 5e-3 in norm
// (on an AVX-512 Xeon one token of 256 moved at step 3: the loss 3e-5 apart at most, the aux and
// z losses 3e-4, the parameters 1.6e-3).
TEST_F(DistributedSlow, MixtureOfExpertsWithActQuantMatchesOneProcess) {
  constexpr int kSteps = 10;  // a checkpoint every 5
  const std::string quant = " --act-quant int8 --act-quant-group 32";
  const auto one = shardlm(runs_.args("moe_aq_single", kSteps, 2, "moe-tiny") + " --grad-accum 4" + quant);
  ASSERT_EQ(one.code, 0) << one.out;
  const auto r = mpirun(2, runs_.args("moe_aq_fsdp_ep2", kSteps, 2, "moe-tiny") + " --grad-accum 2 --strategy fsdp --ep 2" + quant);
  ASSERT_EQ(r.code, 0) << r.out;
  plan::PlanConfig pc = plan_config("fsdp", 2, 2);
  pc.grad_accum = 2, pc.ep = 2, pc.act_quant = {32, false};
  pc.reduction_scratch = mpi_reduction_scratch;
  const plan::Plan p = plan::build_plan(model::describe(model::model_preset("moe-tiny", 256)), pc);
  // Stale or misplaced compressed values are off at step 0 already.
  EXPECT_EQ(expect_moe_steps_match(dir_ / "moe_aq_fsdp_ep2", dir_ / "moe_aq_single", p, "act_quant", true, 1, 1e-3), kSteps);
  EXPECT_FALSE(expect_same_weights(dir_ / "moe_aq_single", dir_ / "moe_aq_fsdp_ep2", kSteps, "act_quant", 5e-3).empty());
}

// --act-quant int8 (nearest, group 16: one head's width, so a group under the head split holds the
// values it holds in one process) with each sequence split over 2 cp ranks under fsdp, ring and
// all-to-all, GPT-2, LLaMA and a mixture of experts (and LLaMA's ring under selective recompute),
// against one process with the same compression: the compressed values are written by the stage
// that holds them last in fp32 and read across the backward's stages from scratch that lives as
// long as the pass. Losses within 1e-5 over 5 steps and step 0's gradient norm within 1e-5 (a ring
// whose later blocks read stale q|k|v is off by 4e-4 at step 1, its gradient norm 17x), every
// memory category of each rank the plan's. Parameters are not compared element by element: a value
// an ulp from a rounding boundary lands on the neighbouring int8 step, and AdamW's first steps turn
// that on an element whose gradient is near zero into a step of lr (tiny's zero-initialised biases
// end up to 7% apart in norm, while the losses stay within 1e-6).
TEST_F(DistributedSlow, ActQuantUnderContextParallelismMatchesOneProcess) {
  struct Case {
    std::string model, impl, recompute = "none";
  };
  const std::vector<Case> cases = {{"tiny", "ring"},       {"tiny", "all-to-all"},      {"llama-tiny", "ring"},
                                   {"llama-tiny", "all-to-all"}, {"moe-tiny", "ring"}, {"moe-tiny", "all-to-all"},
                                   {"llama-tiny", "ring", "selective"}};
  const std::string quant = " --act-quant int8 --act-quant-group 16";
  for (const Case& c : cases) {
    const std::string at = c.model + " " + c.impl + " " + c.recompute;
    const std::string single = "aq_cp_single_" + c.model + "_" + c.recompute;
    const std::string flags = quant + " --recompute " + c.recompute;
    if (!fs::exists(dir_ / single / "metrics.jsonl")) {
      const auto r = shardlm(runs_.args(single, 5, 2, c.model) + flags);
      ASSERT_EQ(r.code, 0) << r.out;
    }
    const std::string name = "aq_cp_" + c.model + "_" + c.impl + "_" + c.recompute;
    const auto r = mpirun(2, runs_.args(name, 5, 2, c.model) + flags + " --strategy fsdp --cp 2 --cp-impl " + c.impl);
    ASSERT_EQ(r.code, 0) << r.out;
    plan::PlanConfig pc = plan_config("fsdp", 2, 2);
    pc.cp = 2, pc.cp_impl = model::parse_context_impl(c.impl), pc.recompute = model::parse_recompute(c.recompute);
    pc.act_quant = {16, false};
    pc.reduction_scratch = mpi_reduction_scratch;
    const MemSnapshot want = plan::build_plan(tiny(c.model), pc).max_memory();
    for (const auto& row : testing::read_metrics(dir_ / name / "metrics.jsonl")) {
      if (!row.contains("loss")) continue;
      for (int k = 0; k < kNumMemCategories; ++k) {
        const auto cat = static_cast<MemCategory>(k);
        const double got = row["mem_max"][to_string(cat)].get<double>(), planned = static_cast<double>(want.bytes[k]);
        EXPECT_NEAR(got, planned, 0.01 * planned) << at << " " << to_string(cat);
      }
    }
    const auto want_losses = step_losses(dir_ / single / "metrics.jsonl"), got = step_losses(dir_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), 5u) << at;
    ASSERT_EQ(want_losses.size(), 5u) << at;
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(got[i], want_losses[i], 1e-5 * want_losses[i]) << at << " step " << i;
    const auto first_grad_norm = [](const fs::path& run) {
      for (const auto& row : testing::read_metrics(run / "metrics.jsonl"))
        if (row.contains("grad_norm")) return row["grad_norm"].get<double>();
      return -1.0;
    };
    const double norm = first_grad_norm(dir_ / single);
    EXPECT_GT(norm, 0) << at;
    EXPECT_NEAR(first_grad_norm(dir_ / name), norm, 1e-5 * norm) << at;
  }
}

// moe-tiny with each sequence split over cp ranks (ring and all-to-all), alone, beside fsdp and
// beside ep, against one process routing the same groups: a routing group stays the
// data-parallel micro-batch, its load statistics (the load-balancing loss's f_e, the logged loads)
// and, with --capacity-factor, its capacity counted over the cp group, so cp changes no routing
// decision. The one process has the data-parallel ranks' batch (--grad-accum 2 × dp). Losses
// (language, load-balancing, z) over 10 steps, the loads and dropped fraction, the final
// parameters within 1e-5, and memory per category the plan's. Each rank sends its routing
// counts to the others of its cp group (model::moe_count_bytes per rank) once per MoE block
// and micro-step: the trace's exchanges carry them.
TEST_F(DistributedSlow, MixtureOfExpertsUnderContextParallelismMatchesOneProcess) {
  constexpr int kSteps = 10;
  // Top-k routing is discontinuous: a run whose fp32 sums differ from one process's by ~1e-8 (as
  // every split of the sequence does) routes a near-tied token to the other expert, and from then
  // on legitimately differs by more than the tolerance. The suite's seed 11 has such a tie at step
  // 5 for cp2_ep2_ring (grad norm 1.6e-7 from one process's at step 4, 6.5e-5 at step 5, while cp2
  // ring at ep 1 and all-to-all at ep 2 stay near 1e-8); seed 13 has none in these 10 steps.
  struct Seed {
    int saved = runs_.seed;
    Seed() { runs_.seed = 13; }
    ~Seed() { runs_.seed = saved; }
  } seed;
  struct Layout {
    std::string name;
    int ranks, cp;
    std::string impl, strategy;
    int ep = 1;
    std::string capacity = "";  // --capacity-factor ("": dropless)
    std::string model_flags = "";
    std::string recompute = "none";  // a full rebuild reruns the stages and their exchanges, counts included
    int dp() const { return ranks / cp; }
    std::string flags() const {
      return " --grad-accum 2 --strategy " + strategy + " --cp " + std::to_string(cp) + " --cp-impl " + impl +
             " --ep " + std::to_string(ep) + (capacity.empty() ? "" : " --capacity-factor " + capacity) + model_flags +
             " --recompute " + recompute;
    }
  };
  const std::string kv4 = " --n-kv-head 4";  // all-to-all over 4 ranks needs 4 key/value heads
  const std::vector<Layout> layouts = {
      {"cp2_ring", 2, 2, "ring", "fsdp"},
      {"cp2_a2a", 2, 2, "all-to-all", "fsdp"},
      {"cp4_ring", 4, 4, "ring", "fsdp"},
      {"cp4_a2a", 4, 4, "all-to-all", "fsdp", 1, "", kv4},
      {"cp2_fsdp2_ring", 4, 2, "ring", "fsdp"},
      {"cp2_fsdp2_a2a", 4, 2, "all-to-all", "fsdp"},
      {"cp2_ep2_ring", 4, 2, "ring", "fsdp", 2},
      {"cp2_ep2_a2a_ddp", 4, 2, "all-to-all", "ddp", 2},
      {"cp2_ring_cap", 2, 2, "ring", "fsdp", 1, "1.0"},
      {"cp2_a2a_cap", 2, 2, "all-to-all", "fsdp", 1, "1.0"},
      {"cp4_ring_cap", 4, 4, "ring", "fsdp", 1, "1.0"},
      {"cp2_fsdp2_ring_cap", 4, 2, "ring", "fsdp", 1, "1.0"},
      {"cp2_ep2_a2a_cap", 4, 2, "all-to-all", "fsdp", 2, "1.0"},
      {"cp2_ring_cap_full", 2, 2, "ring", "fsdp", 1, "1.0", "", "full"},
      {"cp2_ep2_a2a_selective", 4, 2, "all-to-all", "fsdp", 2, "", "", "selective"}};
  for (const Layout& l : layouts) {
    const std::string s = l.name;
    model::ModelConfig config = model::model_preset("moe-tiny", 256);
    if (!l.capacity.empty()) config.capacity_factor = std::stod(l.capacity);
    if (!l.model_flags.empty()) config.n_kv_head = 4;
    const model::ModelDesc desc = model::describe(config);
    const int B = 4 / l.dp();
    const std::string single = "moe_cp_single_dp" + std::to_string(l.dp()) + (l.capacity.empty() ? "" : "_cap") +
                               (l.model_flags.empty() ? "" : "_kv4");
    if (!fs::exists(dir_ / single / "metrics.jsonl")) {
      const auto r = shardlm(runs_.args(single, kSteps, B, "moe-tiny") + " --grad-accum " + std::to_string(2 * l.dp()) +
                             (l.capacity.empty() ? "" : " --capacity-factor " + l.capacity) + l.model_flags);
      ASSERT_EQ(r.code, 0) << r.out;
    }
    plan::PlanConfig pc = plan_config(l.strategy, l.ranks, B);
    pc.grad_accum = 2, pc.ep = l.ep, pc.cp = l.cp, pc.cp_impl = model::parse_context_impl(l.impl);
    pc.recompute = model::parse_recompute(l.recompute);
    pc.reduction_scratch = mpi_reduction_scratch;
    const plan::Plan p = plan::build_plan(desc, pc);

    const fs::path trace = dir_ / ("moe_" + s + ".json");
    const auto r = mpirun(l.ranks, runs_.args("moe_" + s, kSteps, B, "moe-tiny") + l.flags() + " --trace " + trace.string());
    ASSERT_EQ(r.code, 0) << r.out;
    model::Shape shape;
    shape.B = B, shape.T = 32 / l.cp, shape.cp = l.cp, shape.cp_impl = pc.cp_impl;
    const int64_t counts = model::moe_count_bytes(desc, shape);
    std::ifstream tf(trace);
    std::map<int, int64_t> count_exchanges;  // rank -> exchanges that moved (cp - 1) ranks' counts
    const nlohmann::json events = nlohmann::json::parse(tf);
    for (const auto& e : events["traceEvents"])
      if (e["name"].get<std::string>().rfind("exchange ", 0) == 0 && e["args"]["step"].get<int64_t>() == 1 &&
          e["args"]["bytes moved"].get<int64_t>() == (l.cp - 1) * counts)
        ++count_exchanges[e["pid"].get<int>()];
    const int passes = l.recompute == "full" ? 2 : 1;  // a full rebuild exchanges the counts again
    for (int rank = 0; rank < l.ranks; ++rank)  // step 1: each MoE block's counts, once per micro-step and pass
      EXPECT_EQ(count_exchanges[rank], desc.config.n_layer * 2 * passes) << s << " rank " << rank;

    EXPECT_EQ(expect_moe_steps_match(dir_ / ("moe_" + s), dir_ / single, p, s, false), kSteps) << s;
    EXPECT_GT(expect_same_weights(dir_ / single, dir_ / ("moe_" + s), kSteps, s).size(), size_t{2 * 4 * 3}) << s;
  }
  // Capacity 1.0 drops tokens in these runs (else the _cap layouts would prove nothing more).
  double dropped = 0;
  for (const auto& row : testing::read_metrics(dir_ / "moe_cp_single_dp1_cap" / "metrics.jsonl"))
    if (row.contains("dropped_frac")) dropped += row["dropped_frac"].get<double>();
  EXPECT_GT(dropped, 0.0);
}

// A mixture-of-experts checkpoint written at one rank count and expert-parallel degree resumes
// at another (the sharded files load N -> M, experts included) and continues the uninterrupted
// run: saved at 2 ranks (fsdp, ep 2), resumed at 1; saved at 4 ranks (fsdp, ep 4), resumed at 2
// (fsdp, ep 2). The global batch is the same throughout; the load-balancing loss, which depends
// on the routing groups (one rank's micro-batch), is off.
TEST_F(DistributedSlow, MixtureOfExpertsResumesAtAnotherRankCount) {
  const std::string base = " --steps 6 --save-every 3 --aux-loss-coef 0";
  auto run = [&](int ranks, const std::string& name, const std::string& extra) {
    const std::string a = args(name, 4 / ranks, "moe-tiny") + base + extra;
    const auto r = ranks == 1 ? shardlm(a) : mpirun(ranks, a);
    EXPECT_EQ(r.code, 0) << r.out;
  };
  run(1, "moe_resume_full", "");
  const auto full = step_losses(dir_ / "moe_resume_full" / "metrics.jsonl");
  ASSERT_EQ(full.size(), 6u);
  auto expect_continues = [&](const std::string& name, size_t from) {
    const auto got = step_losses(dir_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), 6 - from) << name;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], full[from + i], 1e-5 * std::fabs(full[from + i])) << name << " step " << from + i;
  };
  run(2, "moe_resume_np2", " --strategy fsdp --ep 2");
  expect_continues("moe_resume_np2", 0);
  run(1, "moe_resume_np2_to_1", " --resume " + (dir_ / "moe_resume_np2" / "ckpt" / "step_3").string());
  expect_continues("moe_resume_np2_to_1", 3);
  run(4, "moe_resume_np4", " --strategy fsdp --ep 4");
  expect_continues("moe_resume_np4", 0);
  run(2, "moe_resume_np4_to_2", " --strategy fsdp --ep 2 --resume " + (dir_ / "moe_resume_np4" / "ckpt" / "step_3").string());
  expect_continues("moe_resume_np4_to_2", 3);
}

}  // namespace
}  // namespace shardlm
