#include "model/model.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace shardlm::model
