#include "model/model.h"

#include <gtest/gtest.h>

#include <limits>

namespace shardlm::model {
namespace {

TEST(ModelDesc, Gpt2SmallHas124MParameters) {
  const ModelDesc d = describe(model_preset("gpt2-124m"));
  EXPECT_EQ(d.num_params_exported(), 124439808);  // Hugging Face's gpt2
  EXPECT_EQ(d.units.size(), 14u);
  EXPECT_EQ(d.units[1].param("attn.c_attn.weight").shape, (std::vector<int64_t>{768, 2304}));
  EXPECT_EQ(d.units[0].params[0].shape[0], 50304);  // padded vocabulary rows
}

TEST(ModelDesc, ParamsTileTheUnitWithoutGaps) {
  const ModelDesc d = describe(model_preset("small"));
  for (const auto& u : d.units) {
    int64_t next = 0;
    for (const auto& p : u.params) {
      EXPECT_EQ(p.offset, next) << p.name;
      next += p.numel;
    }
    EXPECT_EQ(next, u.numel) << u.name;
  }
}

TEST(ModelDesc, DecayOnlyOnMatricesAndEmbeddings) {
  const ModelDesc d = describe(model_preset("tiny", 256));
  for (const auto& u : d.units)
    for (const auto& p : u.params) EXPECT_EQ(p.decay, p.shape.size() == 2) << p.name;
}

TEST(FlatLayout, PadsEveryUnitToEqualAlignedShards) {
  const ModelDesc d = describe(model_preset("small"));
  for (int64_t world : {1, 2, 3, 4, 7}) {
    const FlatLayout l = flat_layout(d, world);
    int64_t offset = 0;
    for (size_t i = 0; i < d.units.size(); ++i) {
      EXPECT_EQ(l.units[i].offset, offset);
      EXPECT_EQ(l.units[i].padded % (16 * world), 0);
      EXPECT_GE(l.units[i].padded, l.units[i].numel);
      EXPECT_LT(l.units[i].padded - l.units[i].numel, 16 * world);
      offset += l.units[i].padded;
    }
    EXPECT_EQ(l.total, offset);
  }
}

TEST(ModelConfig, RejectsHeadsThatDoNotDivideChannels) {
  ModelConfig c = model_preset("small");
  c.n_head = 5;
  try {
    c.validate();
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("n_embd"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("n_head"), std::string::npos);
  }
  EXPECT_THROW(model_preset("huge"), std::invalid_argument);
}

TEST(ModelDesc, TrainFlopsFollowSixND) {
  const ModelDesc d = describe(model_preset("gpt2-124m"));
  // 6 × (matrix weights: blocks' 12 C² and the tied head's V·C) × tokens, plus causal attention.
  const double C = 768, V = 50257, tokens = 256;
  const double N = 12 * 12 * C * C + V * C;
  EXPECT_NEAR(d.train_flops(4, 64), 6 * N * tokens + 6.0 * 12 * 64 * C * tokens, 1.0);
}

// A unit's weight GEMMs are its forward's FLOPs less causal attention (2·B·T·T·C a block), and
// each GEMM's K × N is one of the unit's weight matrices.
TEST(UnitCosts, GemmShapesAreTheWeightMatricesAndCarryTheForwardFlops) {
  for (const char* preset : {"small", "llama-small", "llama2-7b"}) {
    const ModelDesc d = describe(model_preset(preset));
    const Shape s{2, 64, 4, 1};
    for (size_t u = 0; u < d.units.size(); ++u) {
      const UnitCosts c = d.costs(static_cast<int>(u), s);
      double gemm = 0;
      for (const GemmShape& g : c.gemms) {
        EXPECT_EQ(g.M, s.B * s.T) << preset << " " << d.units[u].name;
        gemm += g.flops();
      }
      const double attention = is_block(d.units[u].kind) ? 2.0 * s.B * s.T * s.T * d.config.n_embd : 0;
      EXPECT_NEAR(gemm + attention, c.forward_flops, 1e-9 * c.forward_flops) << preset << " " << d.units[u].name;
    }
  }
}

// Hugging Face's parameter counts of the real shapes (no allocation: a description only).
TEST(ModelDesc, RealShapesHaveTheirPublishedParameterCounts) {
  EXPECT_EQ(describe(model_preset("llama2-7b")).num_params_exported(), 6738415616);
  EXPECT_EQ(describe(model_preset("llama2-13b")).num_params_exported(), 13015864320);
  EXPECT_EQ(describe(model_preset("llama2-70b")).num_params_exported(), 68976648192);
  EXPECT_EQ(describe(model_preset("llama3-8b")).num_params_exported(), 8030261248);
  EXPECT_EQ(describe(model_preset("llama3-70b")).num_params_exported(), 70553706496);
  const ModelDesc g3 = describe(model_preset("gpt3-175b"));
  EXPECT_NEAR(g3.num_params_exported(), 175e9, 1e9);
}

TEST(ModelDesc, LlamaUnitsCarryHuggingFaceNamesAndGroupedQueryShapes) {
  const ModelDesc d = describe(model_preset("llama-tiny", 300));
  ASSERT_EQ(d.units.size(), 4u);
  EXPECT_EQ(d.units[0].params[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(d.units[0].params[0].shape, (std::vector<int64_t>{384, 64}));  // padded rows
  EXPECT_EQ(d.units[0].params[0].exported_shape(), (std::vector<int64_t>{300, 64}));
  EXPECT_EQ(d.units[1].param("self_attn.k_proj.weight").shape, (std::vector<int64_t>{32, 64}));  // 2 of 4 heads
  EXPECT_EQ(d.units[1].param("mlp.gate_proj.weight").shape, (std::vector<int64_t>{160, 64}));
  // q, k, v and gate, up are adjacent: one (out, in) matrix each pair.
  EXPECT_EQ(d.units[1].param("self_attn.k_proj.weight").offset,
            d.units[1].param("self_attn.q_proj.weight").offset + 64 * 64);
  EXPECT_EQ(d.units[1].param("mlp.up_proj.weight").offset, d.units[1].param("mlp.gate_proj.weight").offset + 160 * 64);
  EXPECT_TRUE(d.units[3].has_param("lm_head.weight"));
  EXPECT_EQ(d.units[3].borrows, -1);
  ModelConfig tied = model_preset("llama-tiny", 300);
  tied.tie_embeddings = true;
  const ModelDesc t = describe(tied);
  EXPECT_FALSE(t.units[3].has_param("lm_head.weight"));
  EXPECT_EQ(t.units[3].borrows, 0);
  for (const auto& u : d.units)
    for (const auto& p : u.params) EXPECT_EQ(p.decay, p.shape.size() == 2) << p.name;
}

TEST(ModelDesc, UnitsReadAndWriteTheResidualStreamInOrder) {
  for (const char* preset : {"tiny", "llama-tiny"}) {
    const ModelDesc d = describe(model_preset(preset, 256));
    std::vector<int> written(d.values.size(), 0);
    written[0] = 1;  // the batch
    for (const auto& u : d.units) {
      for (int v : u.reads) EXPECT_TRUE(written[v]) << u.name << " reads " << d.values[v].name << " before it exists";
      if (u.writes >= 0) written[u.writes] = 1;
    }
  }
}

TEST(ModelConfig, RejectsKeyValueHeadsThatDoNotDivideHeads) {
  ModelConfig c = model_preset("llama-tiny", 256);
  c.n_kv_head = 3;
  try {
    c.validate();
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head"), std::string::npos);
  }
}

TEST(UnitCosts, RecomputeKeepsLessAndBf16HalvesActivations) {
  const ModelDesc d = describe(model_preset("llama-small", 256));
  const UnitCosts f = d.costs(1, {4, 256, 4, 1}), h = d.costs(1, {4, 256, 2, 1});
  EXPECT_GT(f.kept_bytes(Recompute::none), f.kept_bytes(Recompute::selective));
  EXPECT_EQ(f.kept_bytes(Recompute::full), 0);
  EXPECT_EQ(f.recompute_flops(Recompute::full), f.forward_flops);
  EXPECT_NEAR(static_cast<double>(h.saved_bytes), f.saved_bytes / 2.0, 0.01 * f.saved_bytes);
}

TEST(ModelDesc, MixtralShapesHaveTheirPublishedParameterCounts) {
  EXPECT_EQ(describe(model_preset("mixtral-8x7b")).num_params_exported(), 46702792704);
  EXPECT_NEAR(describe(model_preset("mixtral-8x22b")).num_params_exported(), 140.6e9, 0.1e9);
}

// Each MoE block is followed by its experts: a state-only unit it borrows, expert after expert
// (w1, w3, w2; a multiple of 16 elements each), with Mixtral's names. --moe-every M puts MoE in
// blocks M-1, 2M-1, ... and LLaMA's dense blocks elsewhere.
TEST(ModelDesc, MoeBlocksBorrowTheirExpertsLaidOutExpertAfterExpert) {
  ModelConfig c = model_preset("moe-tiny", 300);
  c.n_layer = 4, c.moe_every = 2;
  const ModelDesc d = describe(c);
  std::vector<std::string> kinds;
  for (const auto& u : d.units) kinds.push_back(to_string(u.kind));
  EXPECT_EQ(kinds, (std::vector<std::string>{"llama_embedding", "llama_block", "moe_block", "moe_experts", "llama_block",
                                             "moe_block", "moe_experts", "llama_head"}));
  const UnitDesc &block = d.units[2], &experts = d.units[3];
  EXPECT_EQ(block.borrows, 3);
  EXPECT_TRUE(is_state_only(experts.kind));
  EXPECT_EQ(experts.name, "layers.1.experts");
  EXPECT_EQ(block.param("block_sparse_moe.gate.weight").shape, (std::vector<int64_t>{4, 64}));
  const int64_t per_expert = 3 * 128 * 64;
  EXPECT_EQ(per_expert % 16, 0);
  EXPECT_EQ(experts.numel, 4 * per_expert);
  for (int j = 0; j < 4; ++j) {
    const std::string e = "model.layers.1.block_sparse_moe.experts." + std::to_string(j) + ".";
    EXPECT_EQ(experts.param(e + "w1.weight").offset, j * per_expert);
    EXPECT_EQ(experts.param(e + "w3.weight").shape, (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(experts.param(e + "w2.weight").shape, (std::vector<int64_t>{64, 128}));
  }
  const UnitCosts none = d.costs(3, {2, 16, 4, 1});
  EXPECT_EQ(none.forward_flops, 0);
  EXPECT_EQ(none.saved_bytes + none.backward_workspace, 0);
  // The block's GEMMs carry the routed tokens at k per token.
  const UnitCosts k = d.costs(2, {2, 16, 4, 1});
  double gemm = 0;
  for (const auto& g : k.gemms) gemm += g.flops();
  EXPECT_DOUBLE_EQ(gemm + k.attention_flops, k.forward_flops);
  EXPECT_EQ(k.gemms[3].M, 2 * 16 * 2);
}

TEST(ModelConfig, MoeSettingsAreCheckedNamingTheField) {
  auto refused = [](ModelConfig c, const std::string& needle) {
    try {
      c.validate();
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const ModelConfig moe = model_preset("moe-tiny", 300);
  ModelConfig c = moe;
  c.top_k = 0, refused(c, "top_k");
  c = moe, c.top_k = 5, refused(c, "top_k");
  c = moe, c.capacity_factor = -1, refused(c, "capacity_factor");
  c = moe, c.n_experts = 0, refused(c, "n_experts");
  c = model_preset("tiny", 300), c.n_experts = 4, refused(c, "mixture-of-experts");
  c = moe, c.capacity_factor = 1.25;
  EXPECT_EQ(c.expert_capacity(32), 20);  // ceil(1.25 · 32 · 2 / 4)
  EXPECT_EQ(c.routed_rows_bound(32), 64);
  c.capacity_factor = 0.5;
  EXPECT_EQ(c.routed_rows_bound(32), 32);
}

// A capacity factor of 1e18 and up overflowed the capacity's conversion to an integer (negative:
// every token dropped). An expert takes each of a group's tokens at most once, so a capacity
// beyond the group's tokens is dropless, whatever the factor; the least positive factor still
// leaves an expert one row.
TEST(ModelConfig, ExpertCapacityNeverExceedsTheGroupsTokensNorOverflows) {
  ModelConfig c = model_preset("moe-tiny", 300);
  for (const double factor : {2.0, 1e17, 1e18, 1e30, 1e300, std::numeric_limits<double>::max()}) {
    c.capacity_factor = factor;
    EXPECT_EQ(c.expert_capacity(32), 32) << factor;
    EXPECT_EQ(c.expert_capacity(int64_t{1} << 40), int64_t{1} << 40) << factor;
    EXPECT_EQ(c.routed_rows_bound(32), 64) << factor;
    EXPECT_EQ(c.expert_rows_bound(32, 2, 32), 2 * 64) << factor;
  }
  c.capacity_factor = std::numeric_limits<double>::denorm_min();
  EXPECT_EQ(c.expert_capacity(32), 1);
  EXPECT_EQ(c.expert_capacity(0), 0);
}

// The CUDA kernels' own scratch (model::KernelScratch) in GPT-2 124M's costs at B16 T1024, by
// hand. The training head's call holds the most: its 2048-row slab of logits and row losses
// (fp32), the embedding matrix and x as bf16 operands, and one slab's logits gradient in bf16 (every
// piece a multiple of 512 bytes already). A block's: the MLP's backward, dout (N x 4C) then x
// (N x 4C) in bf16. The CPU takes none; with fp32 GEMMs the head takes its slab alone.
TEST(KernelScratch, TheHeadsSlabAndOperandCopiesAreTheMostOneCallHolds) {
  const ModelDesc d = describe(model_preset("gpt2-124m"));
  const int64_t Vp = 50304, C = 768, N = 16 * 1024, slab = 2048;
  Shape s{16, 1024, 4, 1};
  s.kernels.cuda = true;
  const int head = static_cast<int>(d.units.size()) - 1, block = 1;
  const int64_t logits = 4 * (slab * Vp + 2 * slab), operands = 2 * Vp * C + 2 * N * C, dlogits = 2 * slab * Vp;
  EXPECT_EQ(d.costs(head, s).backward_kernel_scratch, logits + operands + dlogits);
  EXPECT_EQ(d.costs(head, s).forward_kernel_scratch, logits + 4 * N + operands);  // targets on the host too
  EXPECT_EQ(d.costs(block, s).backward_kernel_scratch, 2 * N * C + 2 * N * 4 * C);
  EXPECT_EQ(d.costs(0, s).forward_kernel_scratch, 0);  // the embedding takes none
  s.kernels.bf16_gemm = false;
  EXPECT_EQ(d.costs(head, s).backward_kernel_scratch, logits);
  s.kernels = {};  // the CPU's
  EXPECT_EQ(d.costs(head, s).backward_kernel_scratch, 0);
  EXPECT_EQ(d.costs(block, s).backward_kernel_scratch, 0);
  KernelScratch cuda;
  cuda.cuda = true;
  EXPECT_EQ(cuda.dense_forward(3, 5, 7), 1024);  // pieces round up to 512 bytes each
  cuda.head_rows = 256;  // within the plan's rows the head takes no slab
  EXPECT_EQ(cuda.head(N, C, Vp, 256, true, false), operands + 2 * 256 * Vp);
}

}  // namespace
}  // namespace shardlm::model
