// A run directory on a filesystem without file locks (some NFS and Lustre mounts refuse flock)
// used to refuse every run ("cannot lock DIR/.lock: Function not implemented"). It now trains,
// unlocked, and says so once; the offload tier's header says so too.
#include <gtest/gtest.h>

#include "test_util.h"

namespace shardlm {
namespace {

TEST(NoFileLocksSlow, ARunGoesOnUnlockedAndSaysSo) {
  testing::TinyRuns runs;
  ASSERT_EQ(runs.create("nolocks").code, 0);
  std::string args = runs.args("run", 2) + " --offload params";
  args.erase(args.find(" --quiet"), 8);  // the header names the offload tier
  const testing::Result r =
      testing::run_command("LD_PRELOAD=" SHARDLM_NO_FLOCK_PRELOAD " " + testing::shardlm_binary() + " " + args);
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string warning = "its filesystem keeps no file locks (Function not implemented)";
  EXPECT_NE(r.out.find(warning), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(warning), r.out.rfind(warning)) << "said more than once: " << r.out;
  EXPECT_NE(r.out.find("unlocked (the filesystem keeps no file locks)"), std::string::npos) << r.out;
  EXPECT_EQ(testing::step_losses(runs.out("run") / "metrics.jsonl").size(), 2u);
  runs.remove();
}

}  // namespace
}  // namespace shardlm
