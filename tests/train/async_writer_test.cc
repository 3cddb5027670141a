// The background writer of --async-save (ckpt/async_writer.h) on the real plans' layouts, in one
// process: its file is bitwise the synchronous write's even when the state changes while it
// writes (it writes the staging copy), its staging bytes are accounted under `staging` and equal
// the plan's figure for the rank that writes the most, and a failed write is reported, not lost.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "ckpt/async_writer.h"
#include "ckpt/sharded.h"
#include "train/checkpoint.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

std::string bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

plan::Plan staged_plan(const model::ModelDesc& desc, const std::string& strategy, int ranks, bool stage) {
  plan::PlanConfig pc;
  pc.strategy = plan::parse_strategy(strategy);
  pc.world = ranks;
  pc.batch = 1;
  pc.seq = 16;
  pc.stage_checkpoint = stage;
  return plan::build_plan(desc, pc);
}

class AsyncWriter : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_async_writer_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "sync");
    fs::create_directories(dir_ / "async");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  MemoryPool memory_;
  const model::ModelDesc desc_ = model::describe(model::model_preset("tiny", 256));
};


TEST_F(AsyncWriter, WritesTheSynchronousBytesFromItsStagingCopy) {
  for (const auto& [strategy, ranks] : {std::pair{std::string("fsdp"), 2}, {"zero1", 2}, {"ddp", 2}, {"zero2", 3}}) {
    const plan::Plan p = staged_plan(desc_, strategy, ranks, true);
    const ckpt::ShardedLayout L = sharded_layout(p, ranks);
    EXPECT_EQ(p.static_memory.staging, p.static_memory.params + p.static_memory.optimizer + kCheckpointIoBytes) << strategy;
    EXPECT_EQ(staged_plan(desc_, strategy, ranks, false).static_memory.staging, 0) << strategy;
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::vector<float>> state(ckpt::kNumKinds);
      for (int k = 0; k < ckpt::kNumKinds; ++k) {
        state[k].resize(ckpt::held_elements(L, k));
        for (size_t i = 0; i < state[k].size(); ++i) state[k][i] = 0.001f * static_cast<float>((i * 31 + k * 7 + r) % 997);
      }
      const ckpt::RankBuffers bufs{state[0].data(), state[1].data(), state[2].data()};
      const std::string name = ckpt::rank_file_name(r, ranks);
      const ckpt::FileSummary want = ckpt::write_rank_file((dir_ / "sync").string(), desc_, L, r, bufs);
      const auto live_staging = [&] { return memory_.tracker().live()[MemCategory::staging]; };
      const int64_t before = live_staging();
      {
        ckpt::AsyncRankWriter w(memory_, desc_, L, r);
        // The lowest rank writes every kind it holds: the plan's figure; no rank stages more.
        EXPECT_EQ(live_staging() - before, w.staging_bytes()) << strategy << " rank " << r;
        if (r == 0) {
          EXPECT_EQ(w.staging_bytes(), p.static_memory.staging) << strategy;
        }
        EXPECT_LE(w.staging_bytes(), p.static_memory.staging) << strategy << " rank " << r;
        // Odd ranks' writes are paced (--async-save spreads a write over the steps): the same bytes.
        w.start((dir_ / "async").string(), bufs, {}, std::chrono::milliseconds(r % 2 == 1 ? 50 : 0));
        for (auto& s : state) std::fill(s.begin(), s.end(), -1.0f);  // training goes on
        w.wait();
        ASSERT_EQ(w.state(), ckpt::AsyncRankWriter::State::written) << w.take_error();
        const ckpt::FileSummary got = w.take_result();
        EXPECT_EQ(w.state(), ckpt::AsyncRankWriter::State::idle);
        EXPECT_EQ(got.bytes, want.bytes);
        EXPECT_EQ(got.xxh64, want.xxh64);
        EXPECT_EQ(bytes_of(dir_ / "async" / name), bytes_of(dir_ / "sync" / name)) << strategy << " rank " << r;
      }
      EXPECT_EQ(live_staging(), before) << "staging freed with the writer";
    }
  }
}

TEST_F(AsyncWriter, AFailedWriteIsReportedAndLeavesNoFile) {
  const plan::Plan p = staged_plan(desc_, "fsdp", 2, true);
  const ckpt::ShardedLayout L = sharded_layout(p, 2);
  std::vector<std::vector<float>> state(ckpt::kNumKinds, std::vector<float>(L.flat.total / 2, 0.5f));
  ckpt::AsyncRankWriter w(memory_, desc_, L, 1);
  w.start((dir_ / "async").string(), {state[0].data(), state[1].data(), state[2].data()},
          [](const void*, size_t, uint64_t written, uint64_t total) {
            if (2 * written >= total) throw std::runtime_error("disk full (injected)");
          });
  EXPECT_THROW(w.start((dir_ / "async").string(), {}), std::logic_error);  // one write at a time
  w.wait();
  ASSERT_EQ(w.state(), ckpt::AsyncRankWriter::State::failed);
  EXPECT_EQ(w.take_error(), "disk full (injected)");
  EXPECT_TRUE(fs::is_empty(dir_ / "async")) << "the partial temporary file was left";
  EXPECT_EQ(w.state(), ckpt::AsyncRankWriter::State::idle);
}

}  // namespace
}  // namespace shardlm::train
