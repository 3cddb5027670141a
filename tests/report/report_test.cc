// `shardlm report` end to end: a short real run's page rendered by headless Chromium, whose DOM
// must hold every chart with as many points as metrics.jsonl has rows, the final loss of its last
// line, and no console message (the page has no script at all); bad input gives one line or a page
// that names what is missing. The trace breakdown is checked on a hand-made trace.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "report/svg.h"
#include "report/trace_summary.h"
#include "run/test_util.h"

namespace {

namespace fs = std::filesystem;
using shardlm::testing::Result;

Result run(const std::string& args) { return shardlm::testing::shardlm(args); }

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The page as Chromium renders it; `console` gets Chromium's log (console messages included).
std::string rendered_dom(const fs::path& page, std::string& console) {
  EXPECT_EQ(shardlm::testing::run_command("command -v chromium").code, 0)
      << "chromium not found: bash scripts/setup.sh installs it (Debian's chromium)";
  const fs::path dom = page.string() + ".dom", log = page.string() + ".log";
  const Result r = shardlm::testing::run_command(
      "(timeout 120 chromium --headless --no-sandbox --disable-gpu --enable-logging=stderr --v=0 --dump-dom 'file://" +
      fs::absolute(page).string() + "' > " + dom.string() + " 2> " + log.string() + ")");
  console = slurp(log);
  EXPECT_EQ(r.code, 0) << r.out << console;
  return slurp(dom);
}

// An attribute of the element that starts at `pos`.
std::string attribute(const std::string& dom, size_t pos, const std::string& name) {
  const size_t end = dom.find('>', pos);
  const std::string tag = dom.substr(pos, end - pos);
  const std::regex re("\\s" + name + "=\"([^\"]*)\"");
  std::smatch m;
  return std::regex_search(tag, m, re) ? m[1].str() : "";
}

// chart id -> series name -> points drawn (counted from the polyline's coordinates).
std::map<std::string, std::map<std::string, int>> charts_of(const std::string& dom) {
  std::map<std::string, std::map<std::string, int>> out;
  for (size_t svg = dom.find("<svg"); svg != std::string::npos; svg = dom.find("<svg", svg + 1)) {
    const std::string chart = attribute(dom, svg, "data-chart");
    const size_t end = dom.find("</svg>", svg);
    auto& series = out[chart];
    for (size_t pl = dom.find("<polyline", svg); pl < end; pl = dom.find("<polyline", pl + 1)) {
      const std::string pts = attribute(dom, pl, "points");
      int pairs = 0;
      std::istringstream in(pts);
      for (std::string xy; in >> xy;) pairs += xy.find(',') != std::string::npos;
      EXPECT_EQ(std::to_string(pairs), attribute(dom, pl, "data-points")) << chart;
      series[attribute(dom, pl, "data-series")] = pairs;
    }
  }
  return out;
}

class Report : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    runs_.threads = 2;
    const Result c = runs_.create("report");
    ASSERT_EQ(c.code, 0) << c.out;
    // 6 steps, an evaluation at step 3 and the final one: 2 val_loss rows.
    const Result r = run(runs_.args("run", 6) + " --eval-every 3 --trace " + (runs_.out("run") / "trace.json").string());
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { runs_.remove(); }
  static inline shardlm::testing::TinyRuns runs_;
};

TEST_F(Report, TrainingWritesTheReportAndItsRunInfo) {
  EXPECT_TRUE(fs::exists(runs_.out("run") / "report.html"));
  const auto info = nlohmann::json::parse(slurp(runs_.out("run") / "run_info.json"));
  EXPECT_NE(info["starts"][0]["command_line"].get<std::string>().find("--eval-every 3"), std::string::npos);
  EXPECT_GT(info["plan_mem"]["params"].get<int64_t>(), 0);
  // The commit the binary was built from (looked up at build time, not configure time), with
  // "-dirty" where tracked files differ from it; "unknown" outside a git checkout.
  const std::string commit = info["git_commit"].get<std::string>();
  const std::string src = std::getenv("SHARDLM_SOURCE_DIR");
  const Result head = shardlm::testing::run_command("git -C " + src + " rev-parse --short=12 HEAD");
  if (head.code == 0) {
    EXPECT_EQ(commit.substr(0, 12), head.out.substr(0, 12)) << "rebuild after a commit";
    EXPECT_TRUE(commit.size() == 12 || commit.substr(12) == "-dirty") << commit;
  } else {
    EXPECT_EQ(commit, "unknown");
  }
  // What ran: fsdp (the default) on one rank is ddp's plan.
  EXPECT_EQ(info["config"]["strategy"], "ddp (asked fsdp)");
}

TEST_F(Report, RenderedPageHasEveryChartTheFinalLossAndNoConsoleMessage) {
  const fs::path page = runs_.out("run") / "page.html";
  const Result r = run("report " + runs_.out("run").string() + " --out " + page.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::string console;
  const std::string dom = rendered_dom(page, console);
  ASSERT_NE(dom.find("</html>"), std::string::npos) << dom.substr(0, 500) << console;
  EXPECT_EQ(console.find("CONSOLE"), std::string::npos) << console;
  EXPECT_EQ(dom.find("<script"), std::string::npos);  // no script: nothing that could log an error

  const auto rows = shardlm::testing::read_metrics(runs_.out("run") / "metrics.jsonl");
  int steps = 0, evals = 0;
  for (const auto& row : rows) (row.contains("loss") ? steps : evals) += 1;
  ASSERT_EQ(steps, 6);
  ASSERT_EQ(evals, 2);
  const auto charts = charts_of(dom);
  const std::map<std::string, std::map<std::string, int>> expected = {
      {"loss-step", {{"loss", steps}, {"val_loss", evals}}},
      {"loss-tokens", {{"loss", steps}}},
      {"lr", {{"lr", steps}}},
      {"grad-norm", {{"grad_norm", steps}}},
      {"tokens-per-s", {{"tokens_per_s", steps}}},
      {"step-ms", {{"step_ms", steps}, {"compute_ms", steps}}},
      {"comm-exposed", {{"comm_exposed_ms", steps}}},
      {"mfu", {{"mfu", steps}}},
      {"memory", {{"total", steps}, {"params", steps}, {"activations", steps}}}};
  for (const auto& [chart, series] : expected) {
    ASSERT_TRUE(charts.count(chart)) << "chart " << chart << " not drawn";
    for (const auto& [name, n] : series) EXPECT_EQ(charts.at(chart).at(name), n) << chart << " / " << name;
  }

  // The final loss shown is the last training row's, to the last digit.
  double last_loss = 0;
  for (const auto& row : rows)
    if (row.contains("loss")) last_loss = row["loss"].get<double>();
  const size_t at = dom.find("id=\"final-loss\"");
  ASSERT_NE(at, std::string::npos);
  EXPECT_DOUBLE_EQ(std::stod(attribute(dom, dom.rfind('<', at), "data-value")), last_loss);
  EXPECT_NE(dom.find(">" + [&] { std::ostringstream s; s.precision(6); s << last_loss; return s.str(); }() + "<"), std::string::npos);

  // The slowest step after the first, where a straggler shows: its step_ms is the largest of them.
  double slowest = 0;
  int64_t slowest_step = -1, row_index = 0;
  for (const auto& row : rows) {
    if (!row.contains("loss")) continue;
    if (row_index++ > 0 && row["step_ms"].get<double>() > slowest)
      slowest = row["step_ms"].get<double>(), slowest_step = row["step"].get<int64_t>() + 1;
  }
  const size_t slow = dom.find("id=\"slowest-step\"");
  ASSERT_NE(slow, std::string::npos);
  EXPECT_EQ(attribute(dom, dom.rfind('<', slow), "data-step"), std::to_string(slowest_step));

  // Nothing missing; the trace broken down on the run's one rank.
  EXPECT_NE(dom.find("data-problems=\"0\""), std::string::npos);
  EXPECT_NE(dom.find("id=\"trace-ranks-0\""), std::string::npos);
  EXPECT_NE(dom.find("id=\"slowest-rank-0\">0<"), std::string::npos);
  EXPECT_NE(dom.find("id=\"memory-peak\""), std::string::npos);
}

TEST_F(Report, CompareAndSimulatedAreShown) {
  const fs::path sim = runs_.dir / "sim.json";
  const Result s = shardlm::testing::run_command(shardlm::testing::shardlm_binary() +
                                                 " simulate --model tiny --batch 2 --seq 32 --threads 2 --json > " + sim.string());
  ASSERT_EQ(s.code, 0) << s.out;
  const Result other = run(runs_.args("other", 4) + " --lr 1e-3 --no-report");
  ASSERT_EQ(other.code, 0) << other.out;
  EXPECT_FALSE(fs::exists(runs_.out("other") / "report.html"));  // --no-report
  const fs::path page = runs_.dir / "compare.html";
  const Result r = run("report " + runs_.out("run").string() + " --compare " + runs_.out("other").string() + " --simulated " +
                       sim.string() + " --out " + page.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::string console;
  const auto charts = charts_of(rendered_dom(page, console));
  EXPECT_EQ(charts.at("loss-step").at("other: loss"), 4);
  EXPECT_EQ(charts.at("lr").at("other: lr"), 4);
  EXPECT_NE(slurp(page).find("id=\"simulated-table\""), std::string::npos);
}

TEST_F(Report, DamagedMetricsAndCorruptTraceAreNamedInThePage) {
  const fs::path dir = runs_.dir / "damaged";
  fs::create_directories(dir);
  const std::string lines = slurp(runs_.out("run") / "metrics.jsonl");
  std::ofstream(dir / "metrics.jsonl") << lines << "{\"step\": 6, \"loss\": 2.";  // a line cut short
  std::ofstream(dir / "trace.json") << "{\"traceEvents\": [{\"ph\": \"X\", ";     // a trace cut short
  const Result r = run("report " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string page = slurp(dir / "report.html");
  EXPECT_NE(page.find("metrics.jsonl line 9: not JSON"), std::string::npos);
  EXPECT_NE(page.find("trace.json: not valid JSON"), std::string::npos);
  EXPECT_NE(page.find("run_info.json: not there"), std::string::npos);
  std::string console;
  EXPECT_EQ(charts_of(rendered_dom(dir / "report.html", console)).at("loss-step").at("loss"), 6);
}

// Train's own writers (run_info.json and the page) go through temporary files they create
// themselves: a link left at a fixed temporary name (NAME.tmp) is not followed.
TEST_F(Report, TrainsOwnWritersNeverFollowALinkAtATemporaryName) {
  const fs::path dir = runs_.out("linked");
  fs::create_directories(dir);
  std::ofstream(runs_.dir / "victim") << "precious";
  fs::create_symlink(runs_.dir / "victim", dir / "run_info.json.tmp");
  fs::create_symlink(runs_.dir / "victim", dir / "report.html.tmp");
  const Result r = run(runs_.args("linked", 2));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(runs_.dir / "victim"), "precious");
  EXPECT_TRUE(fs::is_symlink(dir / "run_info.json.tmp"));
  EXPECT_TRUE(nlohmann::json::parse(slurp(dir / "run_info.json")).contains("starts"));
  EXPECT_NE(slurp(dir / "report.html").find("</html>"), std::string::npos);
}

// A run resumed from its step-3 checkpoint is one curve of 6 steps with the resume marked, and the
// page lists both command lines.
TEST_F(Report, ResumedRunIsOneCurveWithTheResumeMarked) {
  ASSERT_EQ(run(runs_.args("resumed", 6) + " --save-every 3").code, 0);
  const Result r = run(runs_.args("resumed", 6) + " --save-every 3 --resume " + (runs_.out("resumed") / "ckpt" / "step_3").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto info = nlohmann::json::parse(slurp(runs_.out("resumed") / "run_info.json"));
  ASSERT_EQ(info["starts"].size(), 2u);
  EXPECT_EQ(info["starts"][1]["step"], 3);
  std::string console;
  const std::string dom = rendered_dom(runs_.out("resumed") / "report.html", console);
  EXPECT_EQ(charts_of(dom).at("loss-step").at("loss"), 6);
  EXPECT_NE(dom.find("resumed at step 3"), std::string::npos);
  EXPECT_NE(dom.find("step 3: "), std::string::npos);  // the resume's command line
}

// Two ranks: the trace breakdown has a row per rank and names the slowest of them.
TEST_F(Report, TwoRanksEachHaveATraceRow) {
  const Result r = shardlm::testing::mpirun(
      2, runs_.args("ranks", 3) + " --threads 1 --trace " + (runs_.out("ranks") / "trace.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(slurp(runs_.out("ranks") / "run_info.json"))["config"]["strategy"], "fsdp");
  std::string console;
  const std::string dom = rendered_dom(runs_.out("ranks") / "report.html", console);
  EXPECT_EQ(charts_of(dom).at("loss-step").at("loss"), 3);
  const size_t table = dom.find("id=\"trace-ranks-0\"");
  ASSERT_NE(table, std::string::npos);
  const std::string rows = dom.substr(table, dom.find("</table>", table) - table);
  EXPECT_NE(rows.find("<tr><td>0</td>"), std::string::npos);
  EXPECT_NE(rows.find("<tr><td>1</td>"), std::string::npos);
  EXPECT_NE(dom.find("data-problems=\"0\""), std::string::npos);
  const size_t slowest = dom.find("id=\"slowest-rank-0\">");
  ASSERT_NE(slowest, std::string::npos);
  const char rank = dom[dom.find('>', slowest) + 1];
  EXPECT_TRUE(rank == '0' || rank == '1') << rank;
}

// A step whose loss was NaN (the fault seam) and whose update was skipped: no point for its loss
// (metrics.jsonl holds null), a marker at it; a run stopped by a NaN still leaves its page.
TEST_F(Report, SkippedStepIsMarkedAndItsNaNLossNotDrawn) {
  const Result r = shardlm::testing::run_command("SHARDLM_FAULT_NAN_LOSS=0:2 " + shardlm::testing::shardlm_binary() + " " +
                                                 runs_.args("skip", 5) + " --on-nonfinite skip");
  ASSERT_EQ(r.code, 0) << r.out;
  std::string console;
  const std::string dom = rendered_dom(runs_.out("skip") / "report.html", console);
  const auto charts = charts_of(dom);
  EXPECT_EQ(charts.at("loss-step").at("loss"), 4);
  EXPECT_EQ(charts.at("lr").at("lr"), 5);
  const size_t chart = dom.find("data-chart=\"loss-step\"");
  ASSERT_NE(chart, std::string::npos);
  EXPECT_EQ(attribute(dom, dom.find("<g data-markers", chart), "data-markers"), "1");
  EXPECT_NE(dom.find("step 3: update skipped"), std::string::npos);

  const Result stopped = shardlm::testing::run_command("SHARDLM_FAULT_NAN_LOSS=0:2 " + shardlm::testing::shardlm_binary() +
                                                       " " + runs_.args("stop", 5));
  EXPECT_NE(stopped.code, 0);
  EXPECT_EQ(charts_of(slurp(runs_.out("stop") / "report.html")).at("lr").at("lr"), 3);
}

// A mixture of experts: the router's losses and the expert load, a point per step.
TEST_F(Report, MixtureOfExpertsRunHasRouterCharts) {
  const Result r = run(runs_.args("moe", 3, 2, "moe-tiny"));
  ASSERT_EQ(r.code, 0) << r.out;
  std::string console;
  const auto charts = charts_of(rendered_dom(runs_.out("moe") / "report.html", console));
  EXPECT_EQ(charts.at("moe-loss").at("aux_loss"), 3);
  EXPECT_EQ(charts.at("moe-loss").at("z_loss"), 3);
  EXPECT_EQ(charts.at("expert-load").at("expert_load_max"), 3);
  EXPECT_FALSE(charts_of(slurp(runs_.out("run") / "report.html")).count("moe-loss"));  // a dense run has none
}

TEST(ReportBadInput, EmptyMissingAndForeignDirectoriesAreOneLine) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_report_bad_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "empty");
  fs::create_directories(dir / "tensorboard");
  std::ofstream(dir / "tensorboard" / "events.out.tfevents.1") << "not ours";
  shardlm::testing::expect_one_line_error(run("report " + (dir / "empty").string()), {"not a shardlm run directory", "empty"});
  shardlm::testing::expect_one_line_error(run("report " + (dir / "tensorboard").string()), {"not a shardlm run directory"});
  shardlm::testing::expect_one_line_error(run("report " + (dir / "nope").string()), {"no such directory", "nope"});
  EXPECT_FALSE(fs::exists(dir / "empty" / "report.html"));
  fs::remove_all(dir);
}

TEST(ReportBadInput, ARunThatHasRecordedNothingYetIsAPageSayingSo) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_report_young_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "run.json") << "{\"id\": \"x\"}";
  const Result r = run("report " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string page = slurp(dir / "report.html");
  EXPECT_NE(page.find("no training step recorded yet"), std::string::npos);
  EXPECT_NE(page.find("no data to draw"), std::string::npos);
  fs::remove_all(dir);
}

// Two ranks, three steps; rank 1 is slower in every step. Step 0 is left out as start-up, so the
// typical step is the median of steps 1 and 2 by the slowest rank's time.
TEST(TraceSummary, TypicalStepHiddenCommunicationAndSlowestRank) {
  std::string events = R"({"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"compute"}},
    {"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"comm"}},
    {"ph":"M","name":"thread_name","pid":1,"tid":0,"args":{"name":"compute"}},
    {"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"comm"}})";
  auto slice = [](int pid, int tid, const char* name, int step, double ts, double dur) {
    return ",\n" + nlohmann::json{{"ph", "X"}, {"name", name}, {"pid", pid}, {"tid", tid}, {"ts", ts}, {"dur", dur},
                                  {"args", {{"step", step}}}}.dump();
  };
  const double len[] = {500, 100, 300};  // step 2 is the median of steps 1 and 2 (index 1 of sorted {100+, 300+})
  double t0 = 0;
  for (int step = 0; step < 3; ++step) {
    for (int rank = 0; rank < 2; ++rank) {
      const double c = len[step] * (rank ? 1.5 : 1.0);
      events += slice(rank, 0, "forward h.0 [0]", step, t0, c / 2);
      events += slice(rank, 0, "backward h.0 [0]", step, t0 + c / 2, c / 2);
      events += slice(rank, 1, "reduce_scatter h.0", step, t0 + c / 2, c);  // half of it under the backward
    }
    t0 += 1000;
  }
  events += slice(0, 0, "forward h.0 [0]", -1, t0, 5000);  // an evaluation's: no training step
  const auto s = shardlm::report::summarize_trace_text("{\"traceEvents\": [" + events + "]}", "t.json");
  ASSERT_TRUE(s.ok) << (s.problems.empty() ? "" : s.problems[0]);
  EXPECT_EQ(s.steps, 3);
  EXPECT_EQ(s.step, 2);
  ASSERT_EQ(s.ranks.size(), 2u);
  EXPECT_EQ(s.ranks[s.slowest].rank, 1);
  EXPECT_DOUBLE_EQ(s.ranks[0].comm_us, 300);
  EXPECT_DOUBLE_EQ(s.ranks[0].hidden_us, 150);
  EXPECT_DOUBLE_EQ(s.ranks[1].step_us, 450 / 2.0 + 450);
  ASSERT_FALSE(s.ops.empty());
  EXPECT_EQ(s.ops[0].first, "reduce_scatter");  // the longest op first
  EXPECT_DOUBLE_EQ(s.ops[0].second, (300 + 450) / 2.0);
}

// A long run's curve is thinned to what a page can hold, its first and last points kept; NaN (a
// skipped step's loss) and, on a log axis, non-positive values are not drawn.
TEST(Svg, LongSeriesAreThinnedAndUndrawablePointsLeftOut) {
  shardlm::report::Series s{"loss", {}, {}, "#000"};
  for (int i = 0; i < 10000; ++i) s.x.push_back(i), s.y.push_back(i == 5 ? NAN : 1.0 + i);
  shardlm::report::Chart c{"long", "t", "x", "y"};
  c.series.push_back(s);
  const std::string svg = shardlm::report::render_svg(c);
  EXPECT_NE(svg.find("data-points=\"3334\" data-rows=\"9999\""), std::string::npos) << svg.substr(0, 400);
  c.log_y = true;
  c.series[0].y[7] = -1;
  EXPECT_NE(shardlm::report::render_svg(c).find("data-rows=\"9998\""), std::string::npos);
  shardlm::report::Chart empty{"none", "t", "x", "y"};
  empty.series.push_back({"loss", {1, 2}, {NAN, NAN}, "#000"});
  EXPECT_NE(shardlm::report::render_svg(empty).find("no data to draw"), std::string::npos);
}

TEST(TraceSummary, ForeignAndCutTracesAreProblemsNotCrashes) {
  EXPECT_FALSE(shardlm::report::summarize_trace_text("{\"traceEvents\": [", "cut.json").ok);
  EXPECT_FALSE(shardlm::report::summarize_trace_text("{\"foo\": 1}", "foreign.json").ok);
  EXPECT_FALSE(shardlm::report::summarize_trace_text(R"({"traceEvents": [{"ph":"X","name":"a","ts":0,"dur":1}]})", "nostep").ok);
  EXPECT_FALSE(shardlm::report::summarize_trace("/nonexistent/trace.json").ok);
}

}  // namespace
