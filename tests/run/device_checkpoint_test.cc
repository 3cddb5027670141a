// A device run's checkpoints and snapshots, under mpirun, through the strict CPU-as-device backend
// (SHARDLM_TEST_CPU_AS_DEVICE: its buffers fault when host code reads them in place,
// kernels/guarded_pages.h), so what passes here moves state only through the backend's downloads
// and uploads. Its checkpoint files are a CPU run's of the same state byte for byte (synchronous
// and --async-save); a device run killed after a save resumes with the uninterrupted run's losses;
// a device run's checkpoint resumes on the CPU and a CPU run's on a device with them too; a device
// run relaunched after a rank was killed continues from its in-memory snapshot alike; offloaded
// state saves and resumes as resident state does; a device run's checkpoint exports to Hugging
// Face as a CPU run's, and --init-from on a device starts where the CPU run does.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "ckpt/snapshot.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using testing::mpirun;
using testing::Result;
using testing::step_losses;

constexpr const char* kDevice = "-x SHARDLM_TEST_CPU_AS_DEVICE=1";

class DeviceCheckpointSlow : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.flags = "--lr 3e-3 --save-every 3 --timeout 60 --strategy fsdp";
    runs_.create("device_ckpt");
  }
  static void TearDownTestSuite() { runs_.remove(); }
  void TearDown() override {
    for (const char* name : {"dev_snap"}) ckpt::remove_snapshot_segments(ckpt::snapshot_prefix(out(name)) + "-");
  }
  static std::string out(const std::string& name) { return runs_.out(name).string(); }
  // 6 steps of run NAME on 2 ranks, on the device when `device`; `env` more mpirun flags. Not
  // quiet: the header says which backend ran and the save lines what was saved.
  static Result train(const std::string& name, bool device, const std::string& extra = "", const std::string& env = "") {
    std::string a = runs_.args(name, 6);
    a.erase(a.find(" --quiet"), 8);
    const Result r = mpirun(2, a + " " + extra, std::string(device ? kDevice : "") + " " + env);
    EXPECT_NE(r.out.find(device ? "kernels cpu-as-device" : "kernels cpu,"), std::string::npos) << name << ": " << r.out;
    return r;
  }
  static std::vector<double> losses(const std::string& name) { return step_losses(fs::path(out(name)) / "metrics.jsonl"); }
  static std::string bytes(const fs::path& file) {
    std::ifstream f(file, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
  // Every file of checkpoint step N of run `a` is byte for byte run `b`'s.
  static void expect_same_checkpoint(const std::string& a, const std::string& b, int step) {
    const fs::path da = runs_.out(a) / "ckpt" / ("step_" + std::to_string(step)), db = runs_.out(b) / "ckpt" / da.filename();
    int files = 0;
    for (const auto& e : fs::directory_iterator(da)) {
      ++files;
      EXPECT_TRUE(bytes(e.path()) == bytes(db / e.path().filename())) << b << "'s " << e.path().filename() << " differs from " << a << "'s";
    }
    EXPECT_EQ(files, 4) << da;  // config.json, index.json, a file per rank
  }
  // The last three of `all`: steps 4-6, what a run resumed from step 3 into a new directory logs.
  static std::vector<double> tail(const std::vector<double>& all) { return {all.end() - 3, all.end()}; }
  static inline testing::TinyRuns runs_;
};

TEST_F(DeviceCheckpointSlow, ADeviceRunsCheckpointIsTheCpuRunsAndResumesOnEither) {
  ASSERT_EQ(train("cpu", false).code, 0);
  const std::vector<double> want = losses("cpu");
  ASSERT_EQ(want.size(), 6u);
  const Result killed = train("dev", true, "", "-x SHARDLM_FAULT_KILL=0:4");
  ASSERT_NE(killed.code, 0);
  expect_same_checkpoint("cpu", "dev", 3);
  const Result resumed = train("dev", true, "--resume " + out("dev"));
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_EQ(losses("dev"), want);
  expect_same_checkpoint("cpu", "dev", 6);

  const Result on_cpu = train("dev_on_cpu", false, "--resume " + out("dev") + "/ckpt/step_3");
  ASSERT_EQ(on_cpu.code, 0) << on_cpu.out;
  EXPECT_EQ(losses("dev_on_cpu"), tail(want));
  const Result on_dev = train("cpu_on_dev", true, "--resume " + out("cpu") + "/ckpt/step_3");
  ASSERT_EQ(on_dev.code, 0) << on_dev.out;
  EXPECT_EQ(losses("cpu_on_dev"), tail(want));
}

TEST_F(DeviceCheckpointSlow, ADeviceRunsBackgroundSaveAndSnapshotsHoldTheCpuRunsState) {
  if (!fs::exists(fs::path(out("cpu")) / "metrics.jsonl")) ASSERT_EQ(train("cpu", false).code, 0);
  const std::vector<double> want = losses("cpu");
  const Result async = train("dev_async", true, "--async-save");
  ASSERT_EQ(async.code, 0) << async.out;
  EXPECT_NE(async.out.find("written in the background"), std::string::npos) << async.out;
  expect_same_checkpoint("cpu", "dev_async", 3);
  expect_same_checkpoint("cpu", "dev_async", 6);
  // Rank 1 killed as step 5 begins in a run snapshotting every step: the relaunch takes the
  // snapshot of step 5 (the state after 5 steps, newer than the step-3 checkpoint).
  ASSERT_NE(train("dev_snap", true, "--snapshot-every 1", "-x SHARDLM_FAULT_KILL=1:5").code, 0);
  const Result r = train("dev_snap", true, "--snapshot-every 1 --resume auto");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from the in-memory snapshot of step 5"), std::string::npos) << r.out;
  EXPECT_EQ(losses("dev_snap"), want);
}

// Offloaded state on a device lives in host memory (run/host_store.h): a checkpoint packs it on
// the device from there, downloads it, and a resume goes the other way.
TEST_F(DeviceCheckpointSlow, ADeviceRunsOffloadedStateSavesAndResumesAlike) {
  if (!fs::exists(fs::path(out("cpu")) / "metrics.jsonl")) ASSERT_EQ(train("cpu", false).code, 0);
  const Result r = train("dev_offload", true, "--offload params,grads,optimizer --resume " + out("cpu") + "/ckpt/step_3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" in host memory ("), std::string::npos) << r.out;
  EXPECT_EQ(losses("dev_offload"), tail(losses("cpu")));
  expect_same_checkpoint("cpu", "dev_offload", 6);
}

// A device run's checkpoint exports to Hugging Face as a CPU run's does, byte for byte; a device
// run started from either (--init-from: the sharded step, each rank its ranges, or the export,
// read whole and uploaded) has the CPU run's losses from the same start.
TEST_F(DeviceCheckpointSlow, ADeviceRunsExportAndInitFromAreTheCpuRuns) {
  if (!fs::exists(fs::path(out("cpu")) / "metrics.jsonl")) ASSERT_EQ(train("cpu", false).code, 0);
  ASSERT_EQ(train("dev_src", true).code, 0);
  for (const std::string run : {"cpu", "dev_src"}) {
    const Result x = testing::shardlm("ckpt export --format hf --ckpt " + out(run) + "/ckpt/step_6 --out " + out(run + "_hf"));
    ASSERT_EQ(x.code, 0) << x.out;
  }
  for (const char* f : {"model.safetensors", "config.json"})
    EXPECT_TRUE(bytes(runs_.out("dev_src_hf") / f) == bytes(runs_.out("cpu_hf") / f)) << f;
  for (const std::string from : {out("dev_src") + "/ckpt/step_6", out("dev_src_hf")}) {
    const std::string tag = from == out("dev_src_hf") ? "hf" : "sharded";
    ASSERT_EQ(train("init_cpu_" + tag, false, "--init-from " + from).code, 0);
    const Result r = train("init_dev_" + tag, true, "--init-from " + from);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(losses("init_dev_" + tag), losses("init_cpu_" + tag)) << tag;
    EXPECT_NE(losses("init_dev_" + tag)[0], losses("cpu")[0]) << "not a fresh start";
  }
}

}  // namespace
}  // namespace shardlm
