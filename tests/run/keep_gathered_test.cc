// Selective unsharding changes when parameters are gathered, never what is computed: the losses
// of 2-rank FSDP runs with --keep-gathered none, all and one unit are the same bits.
#include <gtest/gtest.h>
#include <unistd.h>

#include "run/test_util.h"

namespace shardlm::testing {
namespace {

TEST(KeepGathered, SameLossesAsRegathering) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm_keep_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  make_corpus(dir);
  std::vector<std::vector<double>> losses;
  for (const std::string keep : {"none", "all", "h.0"}) {
    const Result r = mpirun(2, "train --model tiny --batch 2 --seq 32 --threads 1 --strategy fsdp --grad-accum 2 --steps 2 "
                               "--eval-windows 1 --sample-tokens 0 --peak-gflops 100 --quiet --keep-gathered " + keep +
                               " --data " + (dir / "tok").string() + " --out " + (dir / keep).string());
    ASSERT_EQ(r.code, 0) << keep << ": " << r.out;
    losses.emplace_back();
    for (const auto& row : read_metrics(dir / keep / "metrics.jsonl"))
      if (row.contains("loss")) losses.back().push_back(row["loss"].get<double>());
  }
  ASSERT_EQ(losses[0].size(), 2u);
  EXPECT_EQ(losses[1], losses[0]);
  EXPECT_EQ(losses[2], losses[0]);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardlm::testing
