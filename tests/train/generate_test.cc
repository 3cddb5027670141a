// train::generate: drawing one of SampleConfig::stop_tokens ends the continuation, without it, as
// Hugging Face's generate stops at the model's end token; nothing else changes what is drawn.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "one_process_engine.h"
#include "train/evaluate.h"

namespace shardlm::train {
namespace {

TEST(Generate, EndsBeforeAStopToken) {
  shardlm::testing::OneProcessEngine m(model::model_preset("tiny", 300),
                                       shardlm::testing::plan_config(1, 16, plan::PlanConfig::Mode::logits));
  m.ex.init_params(42);
  SampleConfig greedy;
  greedy.tokens = 24;
  greedy.temperature = 0;
  const std::vector<int32_t> prompt = {5, 6, 7};
  const std::vector<int32_t> all = generate(m.ex, m.desc, m.plan.config, prompt, 0, greedy);
  ASSERT_EQ(all.size(), 24u);
  for (const size_t at : {size_t{0}, size_t{9}, size_t{23}}) {
    SampleConfig stopping = greedy;
    stopping.stop_tokens = {-7, all[at]};
    std::vector<int32_t> shown;
    const std::vector<int32_t> got =
        generate(m.ex, m.desc, m.plan.config, prompt, 0, stopping, [&](int32_t id) { shown.push_back(id); });
    const auto first = std::find(all.begin(), all.end(), all[at]);
    EXPECT_EQ(got, std::vector<int32_t>(all.begin(), first)) << "stop token " << all[at];
    EXPECT_EQ(shown, got);
  }
  // Sampled: a stop token that cannot be drawn (not below vocab_limit) changes nothing.
  SampleConfig sampled;
  sampled.tokens = 24;
  sampled.vocab_limit = 200;
  const std::vector<int32_t> drawn = generate(m.ex, m.desc, m.plan.config, prompt, 0, sampled);
  sampled.stop_tokens = {250};
  EXPECT_EQ(generate(m.ex, m.desc, m.plan.config, prompt, 0, sampled), drawn);
}

}  // namespace
}  // namespace shardlm::train
