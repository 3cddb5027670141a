// Selective unsharding changes when parameters are gathered, never what is computed: the losses
// of 2-rank FSDP runs with --keep-gathered none, all, one unit and parts of units (whose backward
// gathers only the rest), fp32 and bf16 gathers, are the same bits.
#include <gtest/gtest.h>
#include <unistd.h>

#include "run/test_util.h"

namespace shardlm::testing {
namespace {

TEST(KeepGathered, SameLossesAsRegathering) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm_keep_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  make_corpus(dir);
  for (const std::string dtype : {"fp32", "bf16"}) {
    std::vector<std::vector<double>> losses;
    const std::vector<std::string> keeps = {"none", "all", "h.0", "all:0.5", "h.1:0.25,h.0"};
    for (const std::string& keep : keeps) {
      const std::string out = (dir / (dtype + "_" + keep)).string();
      const Result r = mpirun(2, "train --model tiny --batch 2 --seq 32 --threads 1 --strategy fsdp --grad-accum 2 --steps 2 "
                                 "--eval-windows 1 --sample-tokens 0 --peak-gflops 100 --quiet --keep-gathered " + keep +
                                 " --param-dtype " + dtype + " --data " + (dir / "tok").string() + " --out " + out);
      ASSERT_EQ(r.code, 0) << keep << ": " << r.out;
      losses.emplace_back();
      for (const auto& row : read_metrics(std::filesystem::path(out) / "metrics.jsonl"))
        if (row.contains("loss")) losses.back().push_back(row["loss"].get<double>());
    }
    ASSERT_EQ(losses[0].size(), 2u) << dtype;
    for (size_t i = 1; i < keeps.size(); ++i) EXPECT_EQ(losses[i], losses[0]) << dtype << " " << keeps[i];
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardlm::testing
