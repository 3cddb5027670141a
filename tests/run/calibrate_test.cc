#include "run/calibrate.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <utility>

#include "comm/single_rank.h"
#include "kernels/backend.h"

namespace shardlm::run {
namespace {

TEST(Calibrate, FitRecoversAlphaAndBusBandwidth) {
  std::vector<double> x, t;
  for (double S = 4096; S <= 64 << 20; S *= 4) x.push_back(S), t.push_back(25e-6 + S / 3.5e9);
  const LineFit f = fit_alpha_beta(x, t);
  EXPECT_NEAR(f.alpha, 25e-6, 1e-9);
  EXPECT_NEAR(f.bw, 3.5e9, 1e3);
}

// Ten per cent of noise on the 256 MiB point (77 ms) must not move the 25 µs latency far, as an
// unweighted fit would (to 0 or to 290 µs).
TEST(Calibrate, FitKeepsTheLatencyWhenTheLargestSizeIsNoisy) {
  for (double noise : {0.9, 1.1}) {
    std::vector<double> x, t;
    for (double S = 4096; S <= 256 << 20; S *= 4) x.push_back(S), t.push_back(25e-6 + S / 3.5e9);
    t.back() *= noise;
    const LineFit f = fit_alpha_beta(x, t);
    EXPECT_NEAR(f.alpha, 25e-6, 1e-6) << noise;
    EXPECT_NEAR(f.bw, 3.5e9, 0.05 * 3.5e9) << noise;
  }
}

// Noise that would put the intercept below zero: no negative latency, the line through the origin.
TEST(Calibrate, FitNeverGivesANegativeLatency) {
  const LineFit f = fit_alpha_beta({1e3, 1e6, 1e7}, {0, 0.9e-3, 1.0e-2});
  EXPECT_EQ(f.alpha, 0);
  EXPECT_GT(f.bw, 0);
}

// Times that do not grow with the size have no bandwidth. The fit gave 1e30 bytes/s, which
// calibrate wrote as measured and simulate priced as free communication (96% MFU).
TEST(Calibrate, TimesThatDoNotGrowHaveNoBandwidth) {
  for (const std::vector<double>& t : {std::vector<double>{1e-3, 1e-3}, std::vector<double>{2e-3, 1e-3}}) {
    const LineFit f = fit_alpha_beta({1e6, 4e6}, t);
    EXPECT_TRUE(std::isinf(f.bw)) << f.bw;
    EXPECT_THROW(check_fit(f, 1e10, "all_reduce on 2 ranks"), std::runtime_error);
  }
}

// A fit is a link or an error: bandwidth at most what the ranks' memory bandwidth allows (the call site multiplies it by the ranks), latency in [0, 1 s].
TEST(Calibrate, FitOutsidePhysicalBoundsIsRefusedNamingTheFigure) {
  auto refusal = [](const LineFit& f) {
    try {
      check_fit(f, 3e10, "all_gather on 2 ranks");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(refusal({25e-6, 3e9}), "");
  EXPECT_EQ(refusal({0, 3e10}), "");
  for (const LineFit& bad : {LineFit{25e-6, 5e10}, LineFit{25e-6, 0}, LineFit{25e-6, std::numeric_limits<double>::quiet_NaN()},
                             LineFit{2.0, 3e9}, LineFit{-1e-6, 3e9}}) {
    const std::string e = refusal(bad);
    EXPECT_NE(e.find("all_gather on 2 ranks"), std::string::npos) << bad.alpha << " " << bad.bw << ": " << e;
    EXPECT_NE(e.find("--sizes-kib"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// The quickest calibration that still measures something: one iteration, no GEMM model fit.
CalibrateOptions quick_options(std::vector<int64_t> sizes = {4 << 10, 1 << 20}) {
  CalibrateOptions o;
  o.sizes = std::move(sizes);
  o.iters = 1;
  o.gemm_models = {"none"};
  return o;
}

// The message of what calibrate throws for `sizes` (bytes), before it measures anything.
std::string sizes_refusal(const std::vector<int64_t>& sizes) {
  MemoryPool memory;
  comm::SingleRankCommunicator world(memory);
  const CalibrateOptions o = quick_options(sizes);
  try {
    calibrate(*kernels::make_cpu_backend(memory), world, o);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// `--sizes-kib 4` (one size, all latency) fitted bus_bw 1e30; 1e12 KiB died of std::bad_alloc.
TEST(Calibrate, SizesThatCannotFitABandwidthAreRefusedBeforeMeasuring) {
  const int64_t KiB = 1024;
  for (const auto& [sizes, needle] : std::vector<std::pair<std::vector<int64_t>, std::string>>{
           {{4 * KiB}, "--sizes-kib 4:"},
           {{1024 * KiB, 1024 * KiB}, "--sizes-kib 1024,1024:"},
           {{512 * KiB, 1024 * KiB}, "--sizes-kib 512,1024:"},
           {{4 * KiB, 256 * KiB}, "--sizes-kib 4,256:"},
           {{4 * KiB, int64_t{1} << 40}, "1048576"},
           {{0, 1024 * KiB}, "--sizes-kib: 0"}}) {
    const std::string e = sizes_refusal(sizes);
    EXPECT_NE(e.find(needle), std::string::npos) << needle << " in: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// One rank has no collectives: its profile says they were not measured (it had "one rank: the
// memory bandwidth" as bus_bw and latency 0, beside comm_compute_slowdown 1 labelled measured).
TEST(Calibrate, OneRankProfileSaysItsCollectivesAreNotMeasured) {
  MemoryPool memory;
  comm::SingleRankCommunicator world(memory);
  const CalibrateOptions o = quick_options();
  const nlohmann::json j = nlohmann::json::parse(calibrate(*kernels::make_cpu_backend(memory), world, o));
  ASSERT_TRUE(j.contains("collectives_measured")) << j.dump();
  EXPECT_EQ(j["collectives_measured"], false);
  for (const char* tier : {"intra_node", "inter_node"})
    for (const char* op : {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"})
      for (const char* f : {"latency_s", "bus_bw"})
        EXPECT_EQ(j[tier][op][f]["source"].get<std::string>().find("measured by"), std::string::npos) << j[tier][op][f];
  EXPECT_NE(j["comm_compute_slowdown"]["source"].get<std::string>().find("not measured"), std::string::npos);
  // What simulate prints first: a measurement, of today (UTC), by calibrate.
  ASSERT_TRUE(j.contains("provenance")) << j.dump();
  EXPECT_EQ(j["provenance"]["source"], "measured");
  EXPECT_TRUE(std::regex_match(j["provenance"]["date"].get<std::string>(), std::regex("20[0-9]{2}-[01][0-9]-[0-3][0-9]")))
      << j["provenance"];
  EXPECT_NE(j["provenance"]["detail"].get<std::string>().find("measured by shardlm calibrate"), std::string::npos);
}

// --offload-dir: the disk under it is timed through a DiskStore and written as the three disk
// figures and the two slowdowns of copies and compute side by side, each naming the directory;
// without it the profile has none. The store's files go.
TEST(Calibrate, OffloadDirGivesTheDiskFiguresAndLeavesNothing) {
  MemoryPool memory;
  comm::SingleRankCommunicator world(memory);
  CalibrateOptions o = quick_options();
  const auto backend = kernels::make_cpu_backend(memory);
  const nlohmann::json none = nlohmann::json::parse(calibrate(*backend, world, o));
  EXPECT_FALSE(none.contains("disk_read_bw"));
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("shardlm_calibrate_disk_" + std::to_string(::getpid()));
  o.offload_dir = dir.string();
  const nlohmann::json j = nlohmann::json::parse(calibrate(*backend, world, o));
  for (const char* f : {"disk_read_bw", "disk_write_bw", "disk_latency_s"}) {
    ASSERT_TRUE(j.contains(f)) << f;
    const double v = j[f]["value"].get<double>();
    EXPECT_TRUE(std::isfinite(v) && v > 0) << f << " " << v;
    EXPECT_NE(j[f]["source"].get<std::string>().find(dir.string()), std::string::npos) << j[f];
  }
  EXPECT_LT(j["disk_latency_s"]["value"].get<double>(), 1.0);
  for (const char* f : {"compute_slowdown_beside_disk", "disk_slowdown_beside_compute"}) {
    ASSERT_TRUE(j.contains(f)) << f;
    const double v = j[f]["value"].get<double>();
    EXPECT_TRUE(std::isfinite(v) && v >= 1) << f << " " << v;
    EXPECT_NE(j[f]["source"].get<std::string>().find(dir.string()), std::string::npos) << j[f];
  }
  EXPECT_TRUE(!std::filesystem::exists(dir) || std::filesystem::is_empty(dir)) << dir;
  std::filesystem::remove_all(dir);
}

// --gemm-models NAME or NAME:BxT; anything else one line naming the flag and the entry.
TEST(Calibrate, GemmModelsTakeAnOptionalShape) {
  const GemmModel plain = parse_gemm_model("small");
  EXPECT_EQ(plain.name, "small");
  EXPECT_EQ(plain.batch, 4);
  EXPECT_EQ(plain.seq, 256);
  const GemmModel shaped = parse_gemm_model("gpt2-124m:16x1024");
  EXPECT_EQ(shaped.name, "gpt2-124m");
  EXPECT_EQ(shaped.batch, 16);
  EXPECT_EQ(shaped.seq, 1024);
  for (const std::string bad : {"nosuchmodel", "small:16", "small:0x256", "small:4x", "small:x256", "small:4x256x2",
                                "small:-4x256", ":4x256", "small:4096x4096"}) {
    try {
      (void)parse_gemm_model(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("--gemm-models: '" + bad + "'"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
  CalibrateOptions o = quick_options();
  o.gemm_models = {"small", "tiny:2"};
  EXPECT_THROW(check_calibrate_options(o), std::invalid_argument);
}

// A backend whose memory is not the host's (the CPU answering as a device, the seam that stands in
// for a GPU here) takes the device path: every buffer the backend's, filled by uploads, timed
// between synchronisations; the profile is per device (no thread scaling, one row per shape at
// the models' own B x T), with the host link's bandwidth, and refuses what a device cannot time.
TEST(Calibrate, ADeviceIsTimedThroughItsOwnMemory) {
  MemoryPool memory;
  comm::SingleRankCommunicator world(memory);
  CalibrateOptions o = quick_options();
  o.threads = 2;  // the CPU's: a device's figures ignore it
  o.device = "cuda";
  o.gemm_models = {"tiny:2x32", "tiny:1x64"};
  const auto backend = kernels::make_cpu_backend(memory, true);
  const nlohmann::json j = nlohmann::json::parse(calibrate(*backend, world, o));
  EXPECT_EQ(j["name"], "cpu-as-device");
  EXPECT_EQ(j["per_thread"], false);
  EXPECT_EQ(j["compute_dtype"], "fp32");
  EXPECT_EQ(j["activation_dtype"], "fp32");
  EXPECT_FALSE(j.contains("cores_per_node"));
  EXPECT_EQ(j["collectives_measured"], false);
  ASSERT_TRUE(j.contains("host_link_bw"));
  EXPECT_GT(j["host_link_bw"]["value"].get<double>(), 0);
  EXPECT_NE(j["host_link_bw"]["source"].get<std::string>().find("upload"), std::string::npos);
  for (const char* f : {"peak_flops", "memory_bw", "pointwise_bw", "gemm_efficiency", "host_link_bw"}) {
    EXPECT_NE(j[f]["source"].get<std::string>().find("measured by shardlm calibrate --device cuda (cpu-as-device"),
              std::string::npos)
        << f << ": " << j[f];
    EXPECT_GT(j[f]["value"].get<double>(), 0) << f;
  }
  EXPECT_NE(j["pointwise_bw"]["source"].get<std::string>().find("tiny's block activations at B=2, T=32"), std::string::npos);
  // tiny's block (4 shapes) and head at 64 rows: both entries have 64 rows, so one set; the two
  // sequence lengths are two attention rows.
  ASSERT_EQ(j["gemm_rates"]["value"].size(), 5u) << j["gemm_rates"];
  for (const auto& r : j["gemm_rates"]["value"]) {
    EXPECT_EQ(r["threads"], 1) << r;
    EXPECT_EQ(r["m"], 64) << r;
  }
  ASSERT_EQ(j["attention_rates"]["value"].size(), 2u) << j["attention_rates"];
  EXPECT_EQ(j["attention_rates"]["value"][0]["t"], 32);
  EXPECT_EQ(j["attention_rates"]["value"][1]["t"], 64);
  EXPECT_NE(j["gemm_rates"]["source"].get<std::string>().find("tiny at B=2, T=32, tiny at B=1, T=64"), std::string::npos);
  // What a device cannot time here: the disk tier, collectives.
  o.offload_dir = "/tmp";
  try {
    calibrate(*backend, world, o);
    ADD_FAILURE() << "--offload-dir on a device was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--offload-dir"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm::run
