// `shardlm report` never destroys data: --out refuses the files the report reads (however they
// are named), anything inside a checkpoint and an existing file that is not a report (unless
// --overwrite); the page goes through a temporary file of its own, so two writers never collide.
// The report also stays bounded on long or endless inputs, and lists wrong-typed values as damage.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "report/report.h"
#include "report/run_data.h"
#include "report/svg.h"
#include "run/test_util.h"

namespace {

namespace fs = std::filesystem;
using shardlm::testing::expect_one_line_error;
using shardlm::testing::Result;

Result run(const std::string& args) { return shardlm::testing::shardlm(args); }

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

// A row as train writes it (trainer.cc's record_step), with made-up figures.
nlohmann::json train_row(int64_t step) {
  nlohmann::json mem;
  for (const char* c : {"params", "grads", "optimizer", "activations", "comm", "workspace", "staging", "snapshot"})
    mem[c] = 1000000 + step % 97;
  mem["total"] = 9000000 + step % 89;
  return {{"step", step},        {"loss", 5.0 - 1e-6 * step}, {"lr", 3e-4},        {"grad_norm", 1.0 + step % 7},
          {"step_ms", 50.0},     {"compute_ms", 45.0},        {"tokens_per_s", 1300.0}, {"mfu", 0.01},
          {"comm_exposed_ms", 0}, {"mem", mem},               {"mem_max", mem},     {"mem_between_steps", mem},
          {"skipped", false},    {"skipped_steps", 0}};
}

// DIR/NAME: a run directory holding `steps` rows, run_info.json and run.json.
fs::path make_run(const fs::path& dir, const std::string& name, int64_t steps) {
  const fs::path run = dir / name;
  fs::create_directories(run);
  std::ofstream m(run / "metrics.jsonl");
  for (int64_t s = 0; s < steps; ++s) m << train_row(s).dump() << "\n";
  std::ofstream(run / "run_info.json") << R"({"starts": [{"step": 0, "command_line": "shardlm train"}]})";
  std::ofstream(run / "run.json") << R"({"id": "x"})";
  return run;
}

class ReportOut : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardlm_report_out_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    run_ = make_run(dir_, "run", 5);
    metrics_ = slurp(run_ / "metrics.jsonl");
    info_ = slurp(run_ / "run_info.json");
  }
  void TearDown() override { fs::remove_all(dir_); }
  void expect_inputs_untouched() {
    EXPECT_EQ(slurp(run_ / "metrics.jsonl"), metrics_);
    EXPECT_EQ(slurp(run_ / "run_info.json"), info_);
  }
  fs::path dir_, run_;
  std::string metrics_, info_;
};

TEST_F(ReportOut, AFileTheReportReadsIsRefusedHoweverItIsNamed) {
  fs::create_hard_link(run_ / "metrics.jsonl", dir_ / "hard-link.jsonl");
  fs::create_symlink(run_ / "run_info.json", dir_ / "sym-link.json");
  const fs::path other = make_run(dir_, "other", 3);
  const std::string other_metrics = slurp(other / "metrics.jsonl");
  const std::string r = run_.string();
  for (const std::string& out : {r + "/metrics.jsonl", r + "/../run/run_info.json", r + "/./run.json",
                                 (dir_ / "hard-link.jsonl").string(), (dir_ / "sym-link.json").string(),
                                 (other / "metrics.jsonl").string()}) {
    SCOPED_TRACE(out);
    expect_one_line_error(run("report " + r + " --compare " + other.string() + " --out " + out + " --overwrite"),
                          {"--out", "reads"});
  }
  expect_inputs_untouched();
  EXPECT_EQ(slurp(other / "metrics.jsonl"), other_metrics);
  EXPECT_EQ(slurp(run_ / "run.json"), R"({"id": "x"})");
}

TEST_F(ReportOut, SimulatedAndTraceInputsAreRefusedAsOut) {
  std::ofstream(dir_ / "sim.json") << R"({"step_ms": 40, "tokens_per_s": 1600, "mfu": 0.02})";
  std::ofstream(dir_ / "trace.json") << R"({"traceEvents": []})";
  const std::string sim = slurp(dir_ / "sim.json");
  expect_one_line_error(run("report " + run_.string() + " --simulated " + (dir_ / "sim.json").string() + " --out " +
                            (dir_ / "sim.json").string()),
                        {"--out", "reads"});
  expect_one_line_error(run("report " + run_.string() + " --trace " + (dir_ / "trace.json").string() + " --out " +
                            (dir_ / "trace.json").string() + " --overwrite"),
                        {"--out", "reads"});
  EXPECT_EQ(slurp(dir_ / "sim.json"), sim);
  EXPECT_EQ(slurp(dir_ / "trace.json"), R"({"traceEvents": []})");
}

TEST_F(ReportOut, NothingIsWrittenInsideACheckpoint) {
  const fs::path step = run_ / "ckpt" / "step_3";
  fs::create_directories(step);
  std::ofstream(step / "index.json") << R"({"format": "shardlm-sharded-1"})";
  std::ofstream(step / "rank-00000-of-00001.safetensors") << "weights";
  std::ofstream(run_ / "ckpt" / "latest") << "step_3";
  for (const fs::path& out : {step / "rank-00000-of-00001.safetensors", step / "index.json", step / "page.html",
                              run_ / "ckpt" / "page.html"}) {
    SCOPED_TRACE(out);
    expect_one_line_error(run("report " + run_.string() + " --out " + out.string() + " --overwrite"), {"checkpoint"});
  }
  EXPECT_EQ(slurp(step / "rank-00000-of-00001.safetensors"), "weights");
  EXPECT_EQ(slurp(step / "index.json"), R"({"format": "shardlm-sharded-1"})");
  EXPECT_EQ(listing(step), (std::set<std::string>{"index.json", "rank-00000-of-00001.safetensors"}));
  EXPECT_EQ(listing(run_ / "ckpt"), (std::set<std::string>{"latest", "step_3"}));
}

TEST_F(ReportOut, AnExistingFileThatIsNotAReportNeedsOverwrite) {
  const fs::path notes = dir_ / "notes.html";
  std::ofstream(notes) << "my notes";
  expect_one_line_error(run("report " + run_.string() + " --out " + notes.string()), {"notes.html", "--overwrite"});
  EXPECT_EQ(slurp(notes), "my notes");
  ASSERT_EQ(run("report " + run_.string() + " --out " + notes.string() + " --overwrite").code, 0);
  EXPECT_NE(slurp(notes).find("</html>"), std::string::npos);
  // A page the report wrote is replaced without asking: train refreshes its own every time.
  std::ofstream(notes, std::ios::app) << "<!-- stale -->";
  const Result again = run("report " + run_.string() + " --out " + notes.string());
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_EQ(slurp(notes).find("stale"), std::string::npos);
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"notes.html", "run"}));
}

TEST_F(ReportOut, ADirectoryIsRefusedAndNothingLeftBehind) {
  fs::create_directories(dir_ / "pages");
  const auto before = listing(dir_);
  expect_one_line_error(run("report " + run_.string() + " --out " + (dir_ / "pages").string()), {"pages", "directory"});
  expect_one_line_error(run("report " + run_.string() + " --out " + (dir_ / "pages").string() + "/ --overwrite"),
                        {"directory"});
  EXPECT_EQ(listing(dir_), before);
  EXPECT_TRUE(fs::is_empty(dir_ / "pages"));
  EXPECT_EQ(listing(run_), (std::set<std::string>{"metrics.jsonl", "run.json", "run_info.json"}));
}

// A fixed temporary name (OUT.tmp) is followed through a symbolic link someone left there; the
// temporary file must be one the writer created, so the link's target is untouched.
TEST_F(ReportOut, TheTemporaryFileNeverFollowsALink) {
  std::ofstream(dir_ / "victim") << "precious";
  fs::create_symlink(dir_ / "victim", run_ / "report.html.tmp");
  const Result r = run("report " + run_.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(dir_ / "victim"), "precious");
  EXPECT_TRUE(fs::is_symlink(run_ / "report.html.tmp"));
  EXPECT_NE(slurp(run_ / "report.html").find("</html>"), std::string::npos);
}

// Writers of the same page at once (train's own refresh and a command, or two commands): every
// write succeeds, the page is whole, and no temporary file is left.
TEST_F(ReportOut, ConcurrentWritersNeverCollide) {
  shardlm::report::ReportOptions opt;
  opt.run_dir = run_.string();
  std::vector<std::thread> writers;
  std::atomic<int> failures{0};
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        try {
          shardlm::report::write_report(opt);
        } catch (const std::exception&) {
          ++failures;
        }
      }
    });
  for (auto& t : writers) t.join();
  EXPECT_EQ(failures.load(), 0);
  const std::string page = slurp(run_ / "report.html");
  EXPECT_EQ(page.rfind("</html>\n"), page.size() - 8);
  EXPECT_EQ(listing(run_), (std::set<std::string>{"metrics.jsonl", "report.html", "run.json", "run_info.json"}));
}

// An input that is not a regular file (a FIFO nobody writes, /dev/zero) is refused with one line,
// not read forever.
TEST_F(ReportOut, AFifoOrDeviceInputIsRefusedNotReadForever) {
  const auto refused = [&](const std::string& args, std::initializer_list<std::string> needles) {
    const Result r = shardlm::testing::run_command("timeout 30 " + shardlm::testing::shardlm_binary() + " report " + args);
    expect_one_line_error(r, needles);
  };
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  refused(run_.string() + " --simulated " + (dir_ / "fifo").string(), {"fifo", "not a regular file"});
  refused(run_.string() + " --trace " + (dir_ / "fifo").string(), {"fifo", "not a regular file"});
  fs::remove(run_ / "run_info.json");
  fs::create_symlink(dir_ / "fifo", run_ / "run_info.json");
  refused(run_.string(), {"run_info.json", "not a regular file"});
  fs::remove(run_ / "run_info.json");
  fs::remove(run_ / "metrics.jsonl");
  fs::create_symlink("/dev/zero", run_ / "metrics.jsonl");
  refused(run_.string(), {"metrics.jsonl", "not a regular file"});
  EXPECT_FALSE(fs::exists(run_ / "report.html"));
}

// A value of the wrong type in a row or in --simulated is named in the page's list of what is
// missing or damaged; the rest of the row is still drawn.
TEST_F(ReportOut, WrongTypedValuesAreListedAsDamaged) {
  std::ofstream m(run_ / "metrics.jsonl");
  nlohmann::json a = train_row(0), b = train_row(1), c = train_row(2), d = train_row(3);
  a["loss"] = "abc";
  b["skipped"] = "yes";
  c["mem"]["total"] = "big";
  d["lr"] = nlohmann::json::array({1});
  m << a.dump() << "\n" << b.dump() << "\n" << c.dump() << "\n" << d.dump() << "\n"
    << R"({"step": 3, "val_loss": "low"})" << "\n";
  m.close();
  std::ofstream(dir_ / "sim.json") << R"({"step_ms": "fast", "tokens_per_s": 1600, "mem": {"total": "lots"}})";
  const Result r = run("report " + run_.string() + " --simulated " + (dir_ / "sim.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string page = slurp(run_ / "report.html");
  const size_t problems = page.find("What is missing or damaged");
  ASSERT_NE(problems, std::string::npos);
  const std::string listed = page.substr(problems, page.find("</section>", problems) - problems);
  for (const char* needle :
       {"line 1: &quot;loss&quot;", "line 2: &quot;skipped&quot;", "line 3: &quot;mem.total&quot;",
        "line 4: &quot;lr&quot;", "line 5: &quot;val_loss&quot;", "sim.json: &quot;step_ms&quot;",
        "sim.json: &quot;mem.total&quot;"})
    EXPECT_NE(listed.find(needle), std::string::npos) << needle << " in " << listed;
  EXPECT_NE(page.find(R"(data-series="lr" data-points="3")"), std::string::npos);  // the others' lr drawn
}

// A restart that kept the log (steps 0..4, then 2..5 again): the old timeline's rows from step 2
// on give way, so the run is one curve of 6 steps whose figures are the new timeline's.
TEST_F(ReportOut, ARestartOverLoggedStepsIsOneCurve) {
  std::ofstream m(run_ / "metrics.jsonl", std::ios::app);
  for (int64_t s = 2; s < 6; ++s) {
    nlohmann::json row = train_row(s);
    row["loss"] = 1.0 + 0.1 * s;
    row["mem"]["total"] = s == 2 ? 1 : 2;  // the old timeline's larger totals are no peak
    m << row.dump() << "\n";
  }
  m.close();
  ASSERT_EQ(run("report " + run_.string()).code, 0);
  const std::string page = slurp(run_ / "report.html");
  EXPECT_NE(page.find(R"(<b id="steps">6</b>)"), std::string::npos);
  EXPECT_NE(page.find(R"(data-series="loss" data-points="6" data-rows="6")"), std::string::npos);
  EXPECT_NE(page.find(R"(id="final-loss" data-value="1.5")"), std::string::npos);
  EXPECT_NE(page.find("Peak at step 2 "), std::string::npos);  // step index 1: the old timeline's last kept row
}

// The reduction keeps a long series' extremes: a spike and a dip among a million points are drawn.
TEST(SeriesBuilder, KeepsBoundedPointsAndTheExtremes) {
  shardlm::report::SeriesBuilder b;
  for (int i = 0; i < 1000000; ++i) b.add(i, i == 123457 ? 100.0 : i == 876543 ? -100.0 : std::sin(i * 1e-3));
  const auto s = b.series("x", "#000");
  EXPECT_EQ(s.rows, 1000000);
  EXPECT_LE(s.x.size(), 2 * shardlm::report::SeriesBuilder::kMaxBuckets + 2);
  EXPECT_GT(s.x.size(), shardlm::report::SeriesBuilder::kMaxBuckets);
  EXPECT_EQ(s.x.front(), 0);
  EXPECT_EQ(s.x.back(), 999999);
  EXPECT_TRUE(std::is_sorted(s.x.begin(), s.x.end()));
  EXPECT_EQ(*std::max_element(s.y.begin(), s.y.end()), 100.0);
  EXPECT_EQ(*std::min_element(s.y.begin(), s.y.end()), -100.0);
  shardlm::report::SeriesBuilder small(true);  // log axis: non-positive values cannot be drawn
  for (double y : {1.0, 0.0, std::nan(""), 2.0}) small.add(small.rows(), y);
  EXPECT_EQ(small.series("y", "#000").y, (std::vector<double>{1.0, 2.0}));
}

// A long run's statistics come from a bounded, deterministic thinning of its values; the count
// and the extremes stay exact, and the first step (start-up) stays out.
TEST(Sample, ThinsALongRunButKeepsItsCountAndExtremes) {
  shardlm::report::Sample s;
  s.add(1e9);  // the first step
  for (int i = 0; i < 300000; ++i) s.add(i == 12345 ? -7.0 : i == 234567 ? 5000.0 : i % 1000);
  s.add(std::nan(""));
  EXPECT_EQ(s.count(), 300000);
  EXPECT_LE(s.values().size(), shardlm::report::Sample::kMaxKept);
  EXPECT_EQ(s.min(), -7.0);
  EXPECT_EQ(s.max(), 5000.0);
  std::vector<double> v = s.values();
  std::sort(v.begin(), v.end());
  EXPECT_NEAR(v[v.size() / 2], 500, 5);
  shardlm::report::Sample one;
  one.add(3);
  EXPECT_EQ(one.values(), std::vector<double>{3});  // the first alone when it is all
}

// The peak resident memory of `shardlm ARGS` run as a child, in KiB (-1: it failed).
long child_peak_rss_kib(const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    const std::string binary = shardlm::testing::shardlm_binary();
    argv.push_back(const_cast<char*>(binary.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::freopen("/dev/null", "w", stdout);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  struct rusage use {};
  if (::wait4(pid, &status, 0, &use) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return use.ru_maxrss;
}

// A long run's page: the metrics are streamed and each chart keeps a bounded number of points,
// so memory does not grow with the rows (it was about 5 KB a row: 200,000 rows took 1 GB).
TEST(ReportScaleSlow, LongMetricsStayInBoundedMemoryAndChartsBounded) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_report_scale_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const int64_t rows = 200000;
  const fs::path run_dir = make_run(dir, "long", rows);
  const long kib = child_peak_rss_kib({"report", run_dir.string()});
  ASSERT_GT(kib, 0);
  EXPECT_LT(kib, 150 * 1024) << "peak RSS " << kib << " KiB";
  const std::string page = slurp(run_dir / "report.html");
  const size_t at = page.find(R"(data-series="loss" data-points=")");
  ASSERT_NE(at, std::string::npos);
  const int64_t points = std::stoll(page.substr(at + 32));
  EXPECT_GT(points, 1000);
  EXPECT_LE(points, 4000);
  EXPECT_NE(page.find(fmt::format(R"(data-rows="{}")", rows)), std::string::npos);
  EXPECT_NE(page.find(R"(<b id="steps">200000</b>)"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
