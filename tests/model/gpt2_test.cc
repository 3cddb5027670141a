#include "model/gpt2.h"

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
  const double N = d.num_params_exported() - 1024.0 * 768;  // matmul params: all but wpe
  const double flops = d.train_flops(4, 64);
  EXPECT_NEAR(flops, 6 * N * 256 + 6.0 * 12 * 64 * 768 * 256, 1.0);
}

}  // namespace
}  // namespace shardlm::model
