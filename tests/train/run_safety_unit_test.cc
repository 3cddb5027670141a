// The pieces behind the run-safety end-to-end tests (tests/cli/run_safety_test.cc), alone: where
// a resumed run cuts its metrics log, the checked log's behaviour on a full disk, the settings
// ranks must agree on, and the resume identity check.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt/hf_config.h"
#include "train/agreement.h"
#include "train/resume_check.h"
#include "train/run_dir.h"

namespace shardlm::train {
namespace {

namespace fs = std::filesystem;

TEST(MetricsBefore, KeepsTheSavedRunsRowsAndDropsHalfLines) {
  const std::vector<std::string> log = {
      R"({"step": 0, "loss": 5})", R"({"step": 1, "loss": 4})", R"({"step": 2, "val_loss": 4})",
      R"({"step": 2, "loss": 3})", R"({"step": 3, "loss": 2})", R"({"step": 4, "val_loss": 2})",
      R"({"step": 4, "lo)",  // a killed run's last line
  };
  // Resuming at step 2: steps 0 and 1 ran, and the evaluation after them is the saved run's.
  EXPECT_EQ(metrics_before(log, 2), (std::vector<std::string>(log.begin(), log.begin() + 3)));
  EXPECT_EQ(metrics_before(log, 0), std::vector<std::string>{});
  EXPECT_EQ(metrics_before(log, 4), (std::vector<std::string>(log.begin(), log.begin() + 6)));
}

// A log on a disk that fills up: the write throws naming the file and the reason, and the file
// still ends with the last whole line (the partial write is cut back off).
TEST(CheckedLog, AFailedWriteThrowsWithTheReasonAndLeavesWholeLines) {
  const fs::path path = fs::temp_directory_path() / ("shardlm_checked_log_" + std::to_string(::getpid()));
  fs::remove(path);
  // A file size limit stands in for a full disk (EFBIG once a write would pass it).
  auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit small = old_limit;
  small.rlim_cur = 1000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  {
    CheckedLog log;
    log.open(path.string());
    try {
      for (int i = 0; i < 100; ++i) log << "{\"step\": " << i << ", \"pad\": \"" << std::string(60, 'x') << "\"}\n" << std::flush;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find(path.string() + ": cannot write: File too large"), std::string::npos) << error;
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  ASSERT_FALSE(text.str().empty());
  EXPECT_EQ(text.str().back(), '\n');
  EXPECT_LE(text.str().size(), 1000u);
  fs::remove(path);
}

TEST(RankSettings, LeaveOutWhatIsTheProcesssOwn) {
  TrainConfig a, b;
  b.threads = a.threads + 1;
  b.quiet = !a.quiet;
  b.out = "elsewhere";
  b.timeout_s = a.timeout_s + 1;
  b.peak_gflops = 7;
  b.overwrite = true;
  EXPECT_EQ(rank_settings(a), rank_settings(b));
  b.trace = "t.json";  // whether there is a trace decides its gathers
  EXPECT_NE(rank_settings(a), rank_settings(b));
}

// Ranks on machines that hold different token files under one name are told apart: by size, and
// at one size by the content of blocks spread over the file (a copy whose tail is still zeros).
TEST(RankSettings, TellDifferentTokenFilesUnderOneNameApart) {
  const fs::path prefix = fs::temp_directory_path() / ("shardlm_settings_" + std::to_string(::getpid()));
  TrainConfig c;
  c.data = prefix.string();
  const auto data_files = [&] {
    for (const auto& [field, value] : rank_settings(c))
      if (field.rfind("data files", 0) == 0) return value;
    return std::string("(no field)");
  };
  EXPECT_EQ(data_files(), "absent / absent");
  std::string corpus(1 << 20, '\0');
  for (size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<char>(i * 7919 % 251);
  std::ofstream(prefix.string() + "_train.bin", std::ios::binary) << corpus;
  std::ofstream(prefix.string() + "_val.bin") << "01234";
  const std::string whole = data_files();
  EXPECT_NE(whole.find("1048576 bytes, "), std::string::npos) << whole;
  EXPECT_NE(whole.find(" / 5 bytes, "), std::string::npos) << whole;
  std::fill(corpus.begin() + corpus.size() / 2, corpus.end(), '\0');  // half copied, the rest preallocated
  std::ofstream(prefix.string() + "_train.bin", std::ios::binary) << corpus;
  const std::string half = data_files();
  EXPECT_NE(half.find("1048576 bytes, "), std::string::npos) << half;
  EXPECT_NE(half, whole);
  fs::remove(prefix.string() + "_train.bin");
  fs::remove(prefix.string() + "_val.bin");
}

TEST(ResumeCheck, NamesEveryChangeAndHonoursOverrides) {
  TrainConfig saved;
  saved.data = "/data/x";
  const auto identity = run_identity(saved, 2);
  TrainConfig now = saved;
  now.lr = 1e-3f;
  now.steps = saved.steps + 10;
  try {
    check_resume_matches(now, 2, identity, "ck/state.json");
    FAIL() << "a changed lr and steps were accepted";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("lr is 0.001 (saved 0.0006)"), std::string::npos) << what;
    EXPECT_NE(what.find("steps is 1010 (saved 1000)"), std::string::npos) << what;
    EXPECT_NE(what.find("--resume-override lr,steps"), std::string::npos) << what;
  }
  now.resume = "ck";
  now.resume_override = {"lr", "steps"};
  EXPECT_NO_THROW(check_resume_matches(now, 2, identity, "ck/state.json"));
  // The same global batch on other ranks is the same run; another global batch is not.
  TrainConfig same = saved;
  same.batch = saved.batch * 2;
  EXPECT_NO_THROW(check_resume_matches(same, 1, identity, "ck/state.json"));
  EXPECT_THROW(check_resume_matches(same, 2, identity, "ck/state.json"), std::runtime_error);
  now.resume_override = {"min_lr", "nonsense"};
  EXPECT_THROW(check_resume_matches(now, 2, identity, "ck/state.json"), std::invalid_argument);
}

// A mixture-of-experts checkpoint's routing is the resumed run's unless --resume-override names
// the change, which is then said in one line; --init-from compares only what the weights
// compute with, and --resume-override there names only that.
TEST(ResumeCheck, RoutingIsTheCheckpointsUnlessOverridden) {
  const model::ModelConfig saved = model::model_preset("moe-tiny", 300);
  model::ModelConfig now = saved;
  now.top_k = 1, now.capacity_factor = 1.25, now.norm_topk = false;
  TrainConfig cfg;
  cfg.resume = "ck";
  try {
    check_routing_matches(cfg, now, saved, "ck/config.json");
    FAIL() << "another routing was accepted";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ck/config.json: "), std::string::npos) << what;
    EXPECT_NE(what.find("top-k is 1 (saved 2)"), std::string::npos) << what;
    EXPECT_NE(what.find("capacity-factor is 1.25 (saved dropless)"), std::string::npos) << what;
    EXPECT_NE(what.find("no-norm-topk is true (saved false)"), std::string::npos) << what;
    EXPECT_NE(what.find("--resume-override top-k,no-norm-topk,capacity-factor if that is meant"), std::string::npos) << what;
  }
  cfg.resume_override = {"top-k", "capacity_factor", "no-norm-topk"};
  EXPECT_NO_THROW(check_resume_override_use(cfg));
  EXPECT_EQ(check_routing_matches(cfg, now, saved, "ck/config.json"),
            (std::vector<std::string>{"--resume-override top-k: top-k changed from 2 to 1",
                                      "--resume-override no-norm-topk: no-norm-topk changed from false to true",
                                      "--resume-override capacity-factor: capacity-factor changed from dropless to 1.25"}));
  EXPECT_EQ(check_routing_matches(cfg, saved, saved, "ck/config.json"), std::vector<std::string>{});

  // The loss coefficients as the checkpoint records them (Mixtral's router_aux_loss_coef, a k-th
  // of --aux-loss-coef): the same run's 0.01 at k = 3 is the same.
  model::ModelConfig k3 = saved;
  k3.top_k = 3, k3.aux_loss_coef = 0.01;
  const model::ModelConfig k3_saved = ckpt::from_hf_config(ckpt::to_hf_config(k3), "ck/config.json");
  cfg.resume_override.clear();
  EXPECT_EQ(check_routing_matches(cfg, k3, k3_saved, "ck/config.json"), std::vector<std::string>{});
  model::ModelConfig losses = saved;
  losses.aux_loss_coef = 0.5, losses.z_loss_coef = 0;
  EXPECT_THROW(check_routing_matches(cfg, losses, saved, "ck/config.json"), std::runtime_error);

  // --init-from: the new run's losses are its own; the routing is the weights'.
  TrainConfig init;
  init.init_from = "hf";
  EXPECT_EQ(check_routing_matches(init, losses, saved, "hf/config.json"), std::vector<std::string>{});
  EXPECT_THROW(check_routing_matches(init, now, saved, "hf/config.json"), std::runtime_error);
  init.resume_override = {"top-k", "capacity-factor", "no-norm-topk"};
  EXPECT_NO_THROW(check_resume_override_use(init));
  EXPECT_EQ(check_routing_matches(init, now, saved, "hf/config.json").size(), 3u);
  init.resume_override = {"top-k", "lr"};
  EXPECT_THROW(check_resume_override_use(init), std::invalid_argument);
  init.resume_override = {"aux-loss-coef"};
  EXPECT_THROW(check_resume_override_use(init), std::invalid_argument);
  init.init_from.clear(), init.resume_override = {"top-k"};
  EXPECT_THROW(check_resume_override_use(init), std::invalid_argument);
}

// The ranks of a cp group read the same batch: cp 2 on 2 ranks is one data-parallel rank's
// batch a step (the run one rank with --cp 1 makes), not two.
TEST(ResumeCheck, GlobalBatchCountsDataParallelRanksOnly) {
  TrainConfig saved;
  saved.data = "/data/x";
  saved.batch = 2;
  saved.grad_accum = 3;
  saved.cp = 2;
  EXPECT_EQ(run_identity(saved, 2)["global-batch"], 6);
  saved.strategy = "ddp";
  EXPECT_EQ(run_identity(saved, 4)["global-batch"], 12);
  TrainConfig one_rank = saved;
  one_rank.cp = 1;
  EXPECT_NO_THROW(check_resume_matches(one_rank, 1, run_identity(saved, 2), "ck/state.json"));
  try {
    check_resume_matches(one_rank, 2, run_identity(saved, 2), "ck/state.json");
    FAIL() << "twice the sequences a step were accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("global-batch is 12 (saved 6) [data-parallel ranks x batch x grad-accum = 2 x 2 x 3]"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm::train
