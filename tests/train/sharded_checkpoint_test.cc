// Sharded checkpoints without processes: every rank of a plan writes its file from a known
// state, and every rank of another plan (strategy, rank count) loads its element ranges back.
// The plans are the real ones (plan::build_plan), so this is the N -> M resharding matrix the
// trainer's save() and resume() run, rank by rank, in one process.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "ckpt/safetensors.h"
#include "ckpt/sharded.h"
#include "train/checkpoint.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Saved {  // a strategy on a number of ranks
  std::string strategy;
  int ranks;
};

plan::Plan make_plan(const model::ModelDesc& desc, const Saved& s) {
  plan::PlanConfig pc;
  pc.strategy = plan::parse_strategy(s.strategy);
  pc.world = s.ranks;
  pc.shard_group = s.strategy == "hybrid" ? (s.ranks % 2 == 0 ? 2 : 1) : 0;
  pc.batch = 1;
  pc.seq = 16;
  return plan::build_plan(desc, pc);
}

// Element e of kind k of the whole flat buffer of `flat`: a function of the tensor and the
// element within it alone (layouts pad differently), finite, and 0 in the padding (as the
// executor keeps it).
float truth(const model::ModelDesc& desc, const model::FlatLayout& flat, int k, int64_t e) {
  for (size_t u = 0; u < desc.units.size(); ++u) {
    const int64_t at = e - flat.units[u].offset;
    if (at < 0 || at >= flat.units[u].padded) continue;
    for (size_t i = 0; i < desc.units[u].params.size(); ++i) {
      const auto& p = desc.units[u].params[i];
      if (at >= p.offset && at < p.offset + p.exported_numel())
        return static_cast<float>(k + 1) + 1e-7f * static_cast<float>((u * 7919 + i * 104729 + (at - p.offset)) % 1000003);
    }
    return 0.0f;
  }
  return 0.0f;
}

// Rank r's buffers of every kind as the executor would hold them under layout L.
std::vector<std::vector<float>> rank_state(const model::ModelDesc& desc, const ckpt::ShardedLayout& L, int r) {
  std::vector<std::vector<float>> out(ckpt::kNumKinds);
  for (int k = 0; k < ckpt::kNumKinds; ++k) {
    out[k].resize(ckpt::held_elements(L, k));
    for (size_t u = 0; u < L.flat.units.size(); ++u) {
      const ckpt::UnitLayout& K = L.kinds[k][u];
      const auto& span = L.flat.units[u];
      const int64_t len = span.padded / K.parts, lo = K.part_of[r] * len;
      float* dst = out[k].data() + K.at;
      for (int64_t i = 0; i < len; ++i) dst[i] = truth(desc, L.flat, k, span.offset + lo + i);
    }
  }
  return out;
}

ckpt::RankBuffers buffers(std::vector<std::vector<float>>& s) { return {s[0].data(), s[1].data(), s[2].data()}; }

class ShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_sharded_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "ckpt");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves as `s` would (every rank's file, then the index, then latest); returns the step dir.
  std::string save(const model::ModelDesc& desc, const Saved& s, const std::string& name) {
    return save(desc, sharded_layout(make_plan(desc, s), s.ranks), s.strategy, name);
  }
  std::string save(const model::ModelDesc& desc, const ckpt::ShardedLayout& L, const std::string& strategy,
                   const std::string& name) {
    const Saved s{strategy, L.world};
    const std::string step = (dir_ / "ckpt" / name).string(), tmp = step + ".tmp-1";
    fs::create_directories(tmp);
    std::vector<ckpt::FileSummary> files;
    for (int r = 0; r < s.ranks; ++r) {
      auto state = rank_state(desc, L, r);
      files.push_back(ckpt::write_rank_file(tmp, desc, L, r, buffers(state)));
    }
    const json index = ckpt::make_index(desc, L, files, {{"format", ckpt::kIndexFormat}, {"step", 3}, {"strategy", s.strategy}});
    ckpt::commit_step(tmp, step, index, json{{"n_layer", desc.config.n_layer}});
    return step;
  }

  // Every rank of `s` loads and holds bitwise what it would hold had it run the saved state.
  void expect_loads(const model::ModelDesc& desc, const std::string& step, const Saved& s, const std::string& what) {
    expect_loads(desc, step, sharded_layout(make_plan(desc, s), s.ranks), s, what);
  }
  void expect_loads(const model::ModelDesc& desc, const std::string& step, const ckpt::ShardedLayout& L,
                    const Saved& s, const std::string& what) {
    const json index = ckpt::read_index(step);
    ckpt::check_index_against_model(step, index, desc, true);
    for (int f = 0; f < index["world_size"].get<int>(); ++f) ckpt::verify_file(step, index, f);
    for (int r = 0; r < s.ranks; ++r) {
      auto want = rank_state(desc, L, r);
      std::vector<std::vector<float>> got(ckpt::kNumKinds);
      for (int k = 0; k < ckpt::kNumKinds; ++k) got[k].assign(want[k].size(), -1.0f);
      ckpt::load_rank(step, index, desc, L, r, buffers(got));
      for (int k = 0; k < ckpt::kNumKinds; ++k) {
        for (size_t i = 0; i < want[k].size(); ++i)
          if (std::memcmp(&got[k][i], &want[k][i], 4)) {
            ADD_FAILURE() << "element " << i << " got " << got[k][i] << " want " << want[k][i];
            break;
          }
        ASSERT_EQ(0, std::memcmp(got[k].data(), want[k].data(), sizeof(float) * want[k].size()))
            << what << " -> " << s.strategy << " x" << s.ranks << " rank " << r << " kind " << k;
      }
    }
  }
  fs::path dir_;
};

// Saved by {ddp, zero2, fsdp, hybrid} at N in {1..4}, loaded at M in {1..4} under another
// strategy (zero1 too): parameters and both AdamW moments bitwise.
TEST_F(ShardedCheckpoint, EveryStrategyAndRankCountLoadsUnderEveryOther) {
  for (const std::string model : {"tiny", "llama-tiny"}) {
    const model::ModelDesc desc = model::describe(model::model_preset(model, 300));
    for (const std::string saver : {"ddp", "zero2", "fsdp", "hybrid"})
      for (int n = 1; n <= 4; ++n) {
        const std::string what = model + " " + saver + " x" + std::to_string(n);
        const std::string step = save(desc, {saver, n}, "step_" + saver + std::to_string(n));
        // Each rank writes only its own bytes: the files add up to the state once.
        uint64_t payload = 0;
        for (int r = 0; r < n; ++r) {
          const ckpt::SafetensorsFile f(step + "/" + ckpt::rank_file_name(r, n));
          for (const auto& name : f.names()) payload += f.info(name).bytes;
        }
        EXPECT_EQ(payload, 3 * 4 * static_cast<uint64_t>(desc.num_params_exported())) << what;
        for (const std::string loader : {"ddp", "zero1", "zero2", "fsdp", "hybrid"})
          for (int m = 1; m <= 4; ++m)
            if (loader != saver) expect_loads(desc, step, {loader, m}, what);
      }
  }
}

// A plan whose units are placed differently from one another, as experts are placed apart from
// dense weights: on 4 ranks (dp_replicate 2 × dp_shard 2) unit u's parameters are split 4 ways
// over both axes, 2 ways over dp_shard or 2 ways over dp_replicate (u mod 3), its moments 4 ways
// or whole. Its checkpoint loads under every strategy, and every strategy's loads into it.
plan::Plan mixed_plan(const model::ModelDesc& desc) {
  plan::Plan p = make_plan(desc, {"fsdp", 4});  // padded to 16 × 4 elements: any split of 4 divides
  p.mesh = plan::Mesh({{plan::AxisRole::replicate, 2}, {plan::AxisRole::shard, 2}});
  const plan::Placement both{{0, 1}, 4}, shard{{1}, 2}, replicate{{0}, 2}, whole{};
  std::vector<plan::UnitPlacement> units;
  for (size_t u = 0; u < desc.units.size(); ++u) {
    const plan::Placement& params = u % 3 == 0 ? both : u % 3 == 1 ? shard : replicate;
    units.push_back({params, params, u % 2 ? whole : both});
  }
  p.set_placement(units);
  return p;
}

TEST_F(ShardedCheckpoint, UnitsPlacedApartSaveAndLoadAcrossLayouts) {
  const model::ModelDesc desc = model::describe(model::model_preset("llama-tiny", 300));
  const ckpt::ShardedLayout mixed = sharded_layout(mixed_plan(desc), 4);
  const std::string step = save(desc, mixed, "mixed", "step_mixed");
  uint64_t payload = 0;  // replicas write once: the files hold the state once
  for (int r = 0; r < 4; ++r) {
    const ckpt::SafetensorsFile f(step + "/" + ckpt::rank_file_name(r, 4));
    for (const auto& name : f.names()) payload += f.info(name).bytes;
  }
  EXPECT_EQ(payload, 3 * 4 * static_cast<uint64_t>(desc.num_params_exported()));
  const json index = ckpt::read_index(step);
  EXPECT_EQ(index["layout"][desc.units[0].name]["param"]["parts"], 4);
  EXPECT_EQ(index["layout"][desc.units[1].name]["exp_avg"]["parts"], 1);
  for (const std::string loader : {"ddp", "zero1", "fsdp", "hybrid"})
    for (int m = 1; m <= 3; ++m) expect_loads(desc, step, {loader, m}, "mixed x4");
  // A layout that cannot be is refused naming it, though loading reads the ranges.
  json bad = index;
  bad["layout"][desc.units[0].name]["param"]["parts"] = 0;
  std::ofstream(step + "/index.json") << bad.dump();
  try {
    ckpt::read_index(step);
    ADD_FAILURE() << "a layout of 0 parts loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("layout '" + desc.units[0].name + "' param"), std::string::npos) << e.what();
  }
  for (const std::string saver : {"ddp", "fsdp", "hybrid"}) {
    const std::string from = save(desc, {saver, 2}, "step_" + saver);
    expect_loads(desc, from, mixed, {"mixed", 4}, saver + " x2");
  }
}

TEST(PlanPlacement, RefusesAPlacementThatDoesNotFitItsAxesOrPadding) {
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 300));
  plan::Plan p = make_plan(desc, {"fsdp", 2});
  std::vector<plan::UnitPlacement> units(desc.units.size());
  units[0].params = {{}, 2};  // 2 parts over no axis
  EXPECT_THROW(p.set_placement(units), std::logic_error);
  units[0].params = {{p.mesh.axis(plan::AxisRole::shard)}, 2};
  p.set_placement(units);
  EXPECT_EQ(p.held_offset(plan::State::params, 1), p.layout.units[0].padded / 2);
  EXPECT_EQ(p.held_total(plan::State::params), p.layout.total - p.layout.units[0].padded / 2);
  EXPECT_FALSE(p.held_whole(plan::State::params));
  EXPECT_TRUE(p.held_whole(plan::State::grads));
  EXPECT_THROW(p.set_placement(std::vector<plan::UnitPlacement>(1)), std::logic_error);  // one per unit
}

TEST_F(ShardedCheckpoint, LatestNamesTheNewestCompleteStepAndKeepLastPrunes) {
  const model::ModelDesc desc = model::describe(model::model_preset("tiny", 300));
  save(desc, {"fsdp", 2}, "step_2");
  save(desc, {"fsdp", 2}, "step_4");
  EXPECT_EQ(ckpt::resolve_checkpoint(dir_.string()), (dir_ / "ckpt" / "step_4").string());
  EXPECT_EQ(ckpt::resolve_checkpoint((dir_ / "ckpt" / "step_2").string()), (dir_ / "ckpt" / "step_2").string());
  ckpt::keep_last((dir_ / "ckpt").string(), 1);
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step_2"));
  EXPECT_TRUE(fs::exists(dir_ / "ckpt" / "step_4"));
  // The rank files say "format": "pt", which Hugging Face loaders require.
  const ckpt::SafetensorsFile f((dir_ / "ckpt" / "step_4" / ckpt::rank_file_name(1, 2)).string());
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

}  // namespace
}  // namespace shardlm::train
