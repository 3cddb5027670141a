#include "report/report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <stdexcept>

#include "files/replace_file.h"
#include "report/run_data.h"
#include "report/svg.h"
#include "report/trace_summary.h"

namespace shardlm::report {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// What the page writes in its head, and so how a file is known as a report: --out replaces one
// without asking (train refreshes its page every time) and refuses any other file.
constexpr const char* kMarker = R"(<meta name="generator" content="shardlm report">)";
// Pages written before the marker was: their head began with this title.
constexpr const char* kOldMarker = "<title>shardlm report: ";

struct Stats {
  int n = 0;
  double median = NAN, p10 = NAN, p90 = NAN, min = NAN, max = NAN;
};

double quantile(const std::vector<double>& sorted, double q) {
  return sorted[static_cast<size_t>(std::lround(q * static_cast<double>(sorted.size() - 1)))];
}

// Over the steps after the first when there are more (Sample leaves it out): the first carries
// start-up (page faults, the allocator's first blocks) and is not what the run sustains.
Stats stats_of(const RunData& run, const std::string& key) {
  const auto it = run.samples.find(key);
  if (it == run.samples.end()) return {};
  std::vector<double> v = it->second.values();
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.n = static_cast<int>(it->second.count());
  s.median = quantile(v, 0.5), s.p10 = quantile(v, 0.1), s.p90 = quantile(v, 0.9), s.min = it->second.min(), s.max = it->second.max();
  return s;
}

std::string num(double v, int digits = 4) {
  if (!std::isfinite(v)) return "—";
  return fmt::format("{:.{}g}", v, digits);
}

std::string bytes(double b) {
  if (!std::isfinite(b)) return "—";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::abs(b) >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.{}f} {}", b, u == 0 ? 0 : 1, units[u]);
}

std::string section(const std::string& id, const std::string& title, const std::string& body) {
  return fmt::format(R"(<section id="{}"><h2>{}</h2>{}</section>)", id, escape(title), body) + "\n";
}

std::string note(const std::string& text) { return R"(<p class="note">)" + escape(text) + "</p>"; }

// A table from a header and rows of cells (cells already HTML).
std::string table(const std::string& id, const std::vector<std::string>& head, const std::vector<std::vector<std::string>>& rows) {
  std::string out = fmt::format(R"(<table id="{}"><tr>)", id);
  for (const auto& h : head) out += "<th>" + escape(h) + "</th>";
  out += "</tr>";
  for (const auto& r : rows) {
    out += "<tr>";
    for (const auto& c : r) out += "<td>" + c + "</td>";
    out += "</tr>";
  }
  return out + "</table>";
}

struct Page {
  RunData run;
  std::vector<RunData> others;  // --compare
  json simulated;               // null: none
  std::vector<std::string> trace_paths;  // the traces read
  std::vector<TraceSummary> traces;
  std::vector<std::string> problems;
};

// A training row's "step" is the step's index; an evaluation's is the steps done before it (as the
// console counts, "step 6/6" being index 5). Charts put both on the steps-done axis (RunData's
// series are), so an evaluation sits above the step it follows.
Series series_of(const RunData& r, const std::string& key, const std::string& label, const std::string& colour,
                 bool dashed = false) {
  const auto it = r.by_step.find(key);
  return it == r.by_step.end() ? Series{label, {}, {}, colour, dashed, false, 0} : it->second.series(label, colour, dashed);
}

// A count read from a file as a whole number (0 where it is none, or beyond what int64 holds).
int64_t whole(double v) { return std::isfinite(v) && std::abs(v) < 9e18 ? static_cast<int64_t>(v) : 0; }

// A run_info.json start's step.
int64_t start_step(const json& start) { return whole(number(start, "step")); }

const json& starts_of(const RunData& r) {
  static const json none = json::array();
  return r.info.is_object() && r.info.contains("starts") && r.info["starts"].is_array() ? r.info["starts"] : none;
}

// Skipped updates and resumes, drawn as vertical lines on the step charts.
std::vector<Marker> markers_of(const RunData& r) {
  std::vector<Marker> out;
  for (double x : r.skipped_at) out.push_back({x, fmt::format("step {}: update skipped", x)});
  for (const json& s : starts_of(r))
    if (start_step(s) > 0) out.push_back({static_cast<double>(start_step(s)), fmt::format("resumed at step {}", start_step(s))});
  return out;
}

// The run's series of `key` against steps, with the compared runs' dashed beside it.
void add_overlaid(Chart& c, const Page& p, const std::string& key, const std::string& label) {
  c.series.push_back(series_of(p.run, key, label, color(0)));
  for (size_t i = 0; i < p.others.size(); ++i)
    c.series.push_back(series_of(p.others[i], key, p.others[i].name + ": " + label, color(static_cast<int>(i) + 2), true));
}

std::string loss_charts(const Page& p) {
  Chart by_step{"loss-step", "Loss against step", "steps done", "loss (nats/token)"};
  add_overlaid(by_step, p, "loss", "loss");
  by_step.series.push_back(p.run.val_loss.series("val_loss", color(1), false, true));
  for (size_t i = 0; i < p.others.size(); ++i)
    by_step.series.push_back(p.others[i].val_loss.series(p.others[i].name + ": val_loss", color(static_cast<int>(i) + 2), true, true));
  by_step.markers = markers_of(p.run);
  Chart by_tokens{"loss-tokens", "Loss against tokens trained", "tokens", "loss (nats/token)"};
  by_tokens.series.push_back(p.run.loss_by_tokens.series("loss", color(0)));
  for (size_t i = 0; i < p.others.size(); ++i)
    by_tokens.series.push_back(p.others[i].loss_by_tokens.series(p.others[i].name + ": loss", color(static_cast<int>(i) + 2), true));
  Chart lr{"lr", "Learning rate", "steps done", "lr"};
  add_overlaid(lr, p, "lr", "lr");
  Chart norm{"grad-norm", "Gradient norm (before clipping)", "steps done", "global norm"};
  add_overlaid(norm, p, "grad_norm", "grad_norm");
  norm.markers = markers_of(p.run);
  norm.log_y = true;
  return render_svg(by_step) + render_svg(by_tokens) + render_svg(lr) + render_svg(norm);
}

std::string moe_charts(const Page& p) {
  if (!p.run.moe) return "";
  Chart router{"moe-loss", "Router losses", "steps done", "loss"};
  router.series.push_back(series_of(p.run, "aux_loss", "aux_loss", color(0)));
  router.series.push_back(series_of(p.run, "z_loss", "z_loss", color(1)));
  Chart load{"expert-load", "Expert load (tokens routed to an expert / mean)", "steps done", "load"};
  load.series.push_back(series_of(p.run, "expert_load_max", "expert_load_max", color(3)));
  load.series.push_back(series_of(p.run, "expert_load_min", "expert_load_min", color(2)));
  load.series.push_back(series_of(p.run, "dropped_frac", "dropped_frac", color(4)));
  return section("moe", "Mixture of experts", render_svg(router) + render_svg(load));
}

std::vector<std::string> stats_row(const std::string& name, const Stats& s) {
  return {escape(name), num(s.median), num(s.p10) + " – " + num(s.p90), num(s.min) + " – " + num(s.max), std::to_string(s.n)};
}

// A chart of `key` against step with the median drawn across it.
Chart with_median(const Page& p, const std::string& id, const std::string& title, const char* key, const std::string& unit) {
  Chart c{id, title, "steps done", unit};
  add_overlaid(c, p, key, key);
  const Stats s = stats_of(p.run, key);
  if (s.n) c.levels.push_back({s.median, "median " + num(s.median), "#555"});
  c.markers = markers_of(p.run);
  return c;
}

// Steps done at a training row (its "step" is the step's index).
int64_t steps_done(const json& row) { return whole(number(row, "step")) + 1; }

// The slowest step after the first against the medians: where a straggler (a slowed link, a busy
// host) shows, and whether it was spent waiting on communication.
std::string slowest_step_note(const RunData& s) {
  if (s.slowest_step.is_null()) return "";
  const json& row = s.slowest_step;
  return fmt::format(R"(<p id="slowest-step" data-step="{}">Slowest step: {}, {} ms (median {} ms), of which communication )"
                     R"(exposed {} ms (median {} ms).</p>)",
                     steps_done(row), steps_done(row), num(number(row, "step_ms")), num(stats_of(s, "step_ms").median),
                     num(number(row, "comm_exposed_ms")), num(stats_of(s, "comm_exposed_ms").median));
}

std::string throughput_section(const Page& p) {
  Chart time = with_median(p, "step-ms", "Step time (wall, and the step's own compute_ms)", "step_ms", "ms");
  time.series.push_back(series_of(p.run, "compute_ms", "compute_ms", color(1)));
  const RunData& s = p.run;
  const std::string body =
      render_svg(with_median(p, "tokens-per-s", "Tokens per second (all ranks)", "tokens_per_s", "tokens/s")) +
      render_svg(time) +
      render_svg(with_median(p, "comm-exposed",
                             "Communication exposed per step (the most any rank waited on collectives; a slow link raises it)",
                             "comm_exposed_ms", "ms")) +
      slowest_step_note(s) + render_svg(with_median(p, "mfu", "Model FLOPs utilisation", "mfu", "MFU")) +
      table("throughput-stats", {"", "median", "p10 – p90", "min – max", "steps"},
            {stats_row("tokens/s", stats_of(s, "tokens_per_s")), stats_row("step_ms", stats_of(s, "step_ms")),
             stats_row("compute_ms", stats_of(s, "compute_ms")), stats_row("MFU", stats_of(s, "mfu")),
             stats_row("comm_exposed_ms", stats_of(s, "comm_exposed_ms"))}) +
      note("Statistics leave out the first step (start-up) when there are others.");
  return section("throughput", "Throughput", body);
}


std::string memory_table(const Page& p) {
  if (p.run.peak_step.is_null()) return note("No step recorded memory yet.");
  const json& row = p.run.peak_step;
  const json plan = p.run.info.is_object() ? p.run.info.value("plan_mem", json()) : json();
  const json sim = p.simulated.is_object() ? p.simulated.value("mem", json()) : json();
  std::vector<std::vector<std::string>> rows;
  for (const std::string& c : kMemCategories) {
    const double measured = number(row, "mem", c.c_str());
    if (!std::isfinite(measured) && !std::isfinite(number(plan, c.c_str()))) continue;
    rows.push_back({c, bytes(measured), bytes(number(plan, c.c_str())), bytes(number(sim, c.c_str())),
                    bytes(number(row, "mem_between_steps", c.c_str()))});
  }
  rows.push_back({"<b>total</b>", "<b>" + bytes(number(row, "mem", "total")) + "</b>", bytes(number(plan, "total")),
                  bytes(number(sim, "total")), bytes(number(row, "mem_between_steps", "total"))});
  return fmt::format("<p>Peak at step {} (per rank: each category the maximum over ranks).</p>", steps_done(row)) +
         table("memory-peak", {"category", "measured at the peak step", "plan (explain)", "simulated", "held between steps"}, rows) +
         (plan.is_null() ? note("The plan's prediction is missing (run_info.json has no plan_mem).") : "");
}

std::string memory_section(const Page& p) {
  Chart c{"memory", "Memory per category at each step's peak (bytes, per rank)", "steps done", "bytes"};
  int i = 0;
  for (const std::string& cat : kMemCategories) {
    const auto it = p.run.by_step.find("mem." + cat);
    if (it != p.run.by_step.end() && it->second.max_y() > 0) c.series.push_back(it->second.series(cat, color(i)));
    ++i;
  }
  c.series.push_back(series_of(p.run, "mem.total", "total", "#000"));
  for (size_t k = 0; k < p.others.size(); ++k)
    c.series.push_back(series_of(p.others[k], "mem.total", p.others[k].name + ": total", color(static_cast<int>(k) + 2), true));
  return section("memory-section", "Memory", render_svg(c) + memory_table(p));
}

std::string trace_block(const TraceSummary& t, int index) {
  std::string out = fmt::format(R"(<h3>{}</h3>)", escape(t.path));
  if (!t.ok) return out + note("No time breakdown: see the problems above.");
  // The trace numbers steps from 0; the page counts steps done, as the charts do.
  out += fmt::format("<p>Step {} (the median of {} steps by the slowest rank's time); slowest rank: <b id=\"slowest-rank-{}\">{}</b>.</p>",
                     t.step + 1, t.steps, index, t.ranks[t.slowest].rank);
  const double total = t.ranks.empty() ? 0 : t.ranks[0].step_us;
  std::vector<std::vector<std::string>> ops;
  for (const auto& [op, us] : t.ops)
    ops.push_back({escape(op), num(us / 1000, 4),
                   fmt::format(R"(<span class="bar" style="width:{:.0f}px"></span>)", total > 0 ? 200 * std::min(1.0, us / total) : 0)});
  out += table(fmt::format("trace-ops-{}", index), {"op", "ms in the step (mean over ranks)", ""}, ops);
  std::vector<std::vector<std::string>> ranks;
  for (const RankTime& r : t.ranks) {
    std::string streams;
    for (const auto& [s, us] : r.stream_us) streams += fmt::format("{} {} ms; ", escape(s), num(us / 1000, 4));
    ranks.push_back({std::to_string(r.rank), num(r.step_us / 1000, 4), num(r.compute_us / 1000, 4), num(r.comm_us / 1000, 4),
                     r.comm_us > 0 ? fmt::format("{:.0f}%", 100 * r.hidden_us / r.comm_us) : "—", streams});
  }
  return out + table(fmt::format("trace-ranks-{}", index),
                     {"rank", "step ms", "compute busy ms", "comm busy ms", "comm hidden under compute", "per stream"}, ranks);
}

std::string trace_section(const Page& p) {
  if (p.traces.empty())
    return section("trace", "Where the time went",
                   note("No trace: train with --trace FILE (written at the end of the run) or give `shardlm report --trace FILE`."));
  std::string body;
  for (size_t i = 0; i < p.traces.size(); ++i) body += trace_block(p.traces[i], static_cast<int>(i));
  return section("trace", "Where the time went", body);
}

std::string simulated_section(const Page& p) {
  if (p.simulated.is_null()) return "";
  const RunData& s = p.run;
  const Stats step = stats_of(s, "step_ms"), compute = stats_of(s, "compute_ms");
  const Stats tps = stats_of(s, "tokens_per_s"), mfu = stats_of(s, "mfu");
  const Stats exposed = stats_of(s, "comm_exposed_ms");
  const double mem = number(s.peak_step, "mem", "total");
  auto row = [](const std::string& what, double predicted, double measured, bool as_bytes) {
    const double err = 100 * (predicted - measured) / measured;
    return std::vector<std::string>{what, as_bytes ? bytes(predicted) : num(predicted), as_bytes ? bytes(measured) : num(measured),
                                    std::isfinite(err) ? fmt::format("{:+.1f}%", err) : "—"};
  };
  const json& j = p.simulated;
  return section("simulated", "Simulated against measured",
                 table("simulated-table", {"", "simulated", "measured (median)", "difference"},
                       {row("step ms (measured: compute_ms, the step itself)", number(j, "step_ms"), compute.median, false),
                        row("wall step ms", number(j, "step_ms"), step.median, false),
                        row("tokens/s", number(j, "tokens_per_s"), tps.median, false), row("MFU", number(j, "mfu"), mfu.median, false),
                        row("comm exposed ms", number(j, "comm_exposed_ms"), exposed.median, false),
                        row("peak memory per rank", number(j, "mem", "total"), mem, true)}));
}

std::string kv_table(const std::string& id, const json& obj) {
  std::vector<std::vector<std::string>> rows;
  if (obj.is_object())
    for (const auto& [k, v] : obj.items()) rows.push_back({escape(k), escape(v.is_string() ? v.get<std::string>() : v.dump())});
  return table(id, {"", ""}, rows);
}

// The commit and the machine's fields as one flat list of rows.
json machine_rows(const json& info) {
  json rows{{"git commit", text(info, "git_commit", "?")}};
  if (info.contains("machine") && info["machine"].is_object())
    for (const auto& [k, v] : info["machine"].items()) rows[k] = v;
  return rows;
}

std::string config_section(const Page& p) {
  const json& info = p.run.info;
  if (!info.is_object()) return section("config", "Run", note("run_info.json is missing: no command line, commit or machine to show."));
  std::string starts;
  for (const json& s : starts_of(p.run))
    starts += fmt::format(R"(<pre class="cmd">step {}: {}</pre>)", start_step(s), escape(text(s, "command_line", "")));
  return section("config", "Run",
                 "<h3>Command line (each start of the run)</h3>" + starts + "<h3>Build and machine</h3>" +
                     kv_table("machine", machine_rows(info)) +
                     "<h3>Configuration</h3>" + kv_table("configuration", info.value("config", json())) +
                     (p.run.identity.is_object() ? "<h3>run.json (what defines the run)</h3>" + kv_table("identity", p.run.identity) : ""));
}

std::string summary_section(const Page& p) {
  const json& last = p.run.last_step;
  const json& last_eval = p.run.last_eval;
  const double planned = p.run.info.is_object() ? number(p.run.info, "config", "steps") : NAN;
  // Full precision: the figure must be the one metrics.jsonl holds, not a rounding of it.
  return section("summary", "Summary",
                 fmt::format(R"(<ul><li>steps recorded: <b id="steps">{}</b>{}</li>)", p.run.steps,
                             std::isfinite(planned) ? fmt::format(" of {}", planned) : "") +
                     fmt::format(R"(<li>last step: {}; final loss <b id="final-loss" data-value="{}">{}</b></li>)",
                                 last.is_null() ? "—" : std::to_string(steps_done(last)), num(number(last, "loss"), 17),
                                 num(number(last, "loss"), 6)) +
                     fmt::format(R"(<li>last validation loss <b id="final-val-loss" data-value="{}">{}</b> (step {})</li>)",
                                 num(number(last_eval, "val_loss"), 17), num(number(last_eval, "val_loss"), 6),
                                 last_eval.is_null() ? "—" : num(number(last_eval, "step"), 17)) +
                     fmt::format("<li>tokens trained: {}</li><li>skipped updates: {}</li></ul>", num(p.run.tokens, 6),
                                 p.run.skipped));
}

std::string problems_section(const Page& p) {
  std::string items;
  for (const auto& pr : p.problems) items += "<li>" + escape(pr) + "</li>";
  return items.empty() ? R"(<section id="problems" data-problems="0"></section>)"
                       : fmt::format(R"(<section id="problems" data-problems="{}"><h2>What is missing or damaged</h2><ul>{}</ul></section>)",
                                     p.problems.size(), items);
}

const char* kStyle = R"(body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1340px}
h1{font-size:20px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}h3{font-size:14px}
figure.chart{display:inline-block;width:640px;margin:8px 12px 8px 0;vertical-align:top}figcaption{font-weight:600;margin-bottom:2px}
.key{font-weight:400;margin-left:10px;font-size:12px}.key i{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}
.plot{fill:#fcfcfc;stroke:#bbb}.grid{stroke:#eee}.tick{font-size:10px;fill:#555}.label{font-size:11px;fill:#333}
.marker{stroke:#d62728;stroke-dasharray:3 2;stroke-width:1}table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;font-size:13px}pre.cmd{white-space:pre-wrap;background:#f4f4f4;padding:6px}
.bar{display:inline-block;height:10px;background:#1f77b4}#problems li{color:#a00}.note{color:#666;font-size:12px})";

std::string page_html(const Page& p) {
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  return fmt::format("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{}<title>shardlm report: {}</title><style>{}</style></head><body>\n",
                     kMarker, escape(p.run.name), kStyle) +
         fmt::format("<h1>shardlm run report: {}</h1><p>{} — written {}{}</p>\n", escape(p.run.name), escape(p.run.dir), when,
                     p.others.empty() ? "" : fmt::format(", compared with {} other run(s) (dashed)", p.others.size())) +
         summary_section(p) + problems_section(p) + section("loss", "Loss and optimisation", loss_charts(p)) + moe_charts(p) +
         throughput_section(p) + memory_section(p) + trace_section(p) + simulated_section(p) + config_section(p) + "</body></html>\n";
}

// The traces to summarise: those given, else the one the run recorded, else DIR/trace.json.
std::vector<std::string> trace_paths(const ReportOptions& opt, const RunData& run) {
  if (!opt.traces.empty()) return opt.traces;
  if (run.info.is_object() && run.info.contains("trace") && run.info["trace"].is_string() && !run.info["trace"].get<std::string>().empty()) {
    // A run directory copied elsewhere with its trace inside still finds it there.
    const fs::path recorded = run.info["trace"].get<std::string>();
    const fs::path moved = fs::path(run.dir) / recorded.filename();
    return {!fs::exists(recorded) && fs::exists(moved) ? moved.string() : recorded.string()};
  }
  if (fs::exists(fs::path(run.dir) / "trace.json")) return {(fs::path(run.dir) / "trace.json").string()};
  return {};
}

json read_simulated(const std::string& path, std::vector<std::string>& problems) {
  const std::string what = "--simulated " + path;
  require_regular_file(path, what);
  std::ifstream f(path);
  if (!f) throw std::runtime_error("report: " + what + ": cannot be read");
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("step_ms")) {
    problems.push_back(what + ": not the output of `shardlm simulate --json` (no step_ms); left out");
    return nullptr;
  }
  std::vector<std::string> mem = kMemCategories;
  mem.push_back("total");
  for (auto& problem : type_problems(j, {"step_ms", "tokens_per_s", "mfu", "comm_exposed_ms"}, "mem", mem, what))
    problems.push_back(std::move(problem));
  return j;
}

void gather_problems(Page& p) {
  for (const auto& s : p.run.problems) p.problems.push_back(s);
  for (const RunData& o : p.others)
    for (const auto& s : o.problems) p.problems.push_back(o.name + ": " + s);
  for (const TraceSummary& t : p.traces)
    for (const auto& s : t.problems) p.problems.push_back(s);
  if (p.run.steps == 0) p.problems.push_back(p.run.dir + ": no training step recorded yet");
}

Page read_page(const ReportOptions& opt) {
  Page p;
  for (const auto& t : opt.traces) require_regular_file(t, "--trace " + t);
  p.run = load_run(opt.run_dir);
  for (const auto& d : opt.compare) p.others.push_back(load_run(d));
  if (!opt.simulated.empty()) p.simulated = read_simulated(opt.simulated, p.run.problems);
  p.trace_paths = trace_paths(opt, p.run);
  for (const auto& t : p.trace_paths) p.traces.push_back(summarize_trace(t));
  gather_problems(p);
  return p;
}

// --- Where the page may go: never over what the report reads, into a checkpoint, or over a file
// the report did not write (unless --overwrite).

// The files the report reads, as far as the options say (a run's recorded trace comes later).
std::vector<std::string> named_inputs(const ReportOptions& opt) {
  std::vector<std::string> inputs = opt.traces;
  if (!opt.simulated.empty()) inputs.push_back(opt.simulated);
  std::vector<std::string> dirs = opt.compare;
  dirs.push_back(opt.run_dir);
  for (const auto& d : dirs)
    for (const char* file : {"metrics.jsonl", "run_info.json", "run.json", "trace.json"}) inputs.push_back((fs::path(d) / file).string());
  return inputs;
}

// One file by identity (device and inode: hard links, symbolic links) or, where either does not
// exist yet, by canonical name (./RUN/../RUN/metrics.jsonl).
bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  std::error_code ea, eb;
  const fs::path ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

void refuse_inputs(const std::string& label, const std::string& out, const std::vector<std::string>& inputs) {
  for (const auto& in : inputs)
    if (same_file(out, in))
      throw std::runtime_error(fmt::format("report: {} is a file the report reads ({}); write the page elsewhere", label, in));
}

bool holds_safetensors(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

// A checkpoint's step directory (the sharded index, or weights in safetensors files: an export
// too) or a run's ckpt/ directory.
bool is_checkpoint_dir(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir / "index.json", ec)) {
    std::ifstream f(dir / "index.json");
    const json index = json::parse(f, nullptr, false);
    if (text(index, "format", "").rfind("shardlm-", 0) == 0) return true;
  }
  if (dir.filename() == "ckpt" && (fs::exists(dir / "latest", ec) || fs::exists(dir.parent_path() / "metrics.jsonl", ec) ||
                                   fs::exists(dir.parent_path() / "run.json", ec)))
    return true;
  return holds_safetensors(dir);
}

void refuse_checkpoint(const std::string& label, const std::string& out) {
  std::error_code ec;
  fs::path dir = fs::weakly_canonical(fs::absolute(out, ec), ec).parent_path();
  if (ec) return;
  for (;; dir = dir.parent_path()) {
    if (is_checkpoint_dir(dir))
      throw std::runtime_error(fmt::format("report: {} lies inside the checkpoint directory {}; write the page elsewhere", label, dir.string()));
    if (dir == dir.parent_path()) return;
  }
}

bool is_report(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string head(4096, '\0');
  f.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(f.gcount()));
  return head.find(kMarker) != std::string::npos || head.find(kOldMarker) != std::string::npos;
}

// What already lies at OUT: nothing, or a page the report wrote, is fine; a directory or a
// special file never is; a link or any other file only with --overwrite.
void refuse_existing(const std::string& label, const std::string& out, bool overwrite) {
  std::error_code ec;
  const fs::file_status here = fs::symlink_status(out, ec);
  if (fs::path(out).filename().empty() || fs::is_directory(out, ec))
    throw std::runtime_error(fmt::format("report: {} is a directory; give a file name (such as {})", label,
                                         (fs::path(out) / "report.html").lexically_normal().string()));
  if (here.type() == fs::file_type::not_found) return;
  if (fs::is_symlink(here)) {
    if (!overwrite)
      throw std::runtime_error(fmt::format("report: {} is a symbolic link; --overwrite replaces the link (not what it points to)", label));
    return;
  }
  if (!fs::is_regular_file(here)) throw std::runtime_error(fmt::format("report: {} exists and is not a regular file", label));
  if (!overwrite && !is_report(out))
    throw std::runtime_error(fmt::format("report: {} exists and is not a shardlm report; --overwrite replaces it", label));
}

}  // namespace

std::string render_report(const ReportOptions& opt) { return page_html(read_page(opt)); }

std::string write_report(const ReportOptions& opt) {
  const std::string out = opt.out.empty() ? (fs::path(opt.run_dir) / "report.html").string() : opt.out;
  const std::string label = opt.out.empty() ? out : "--out " + out;
  refuse_inputs(label, out, named_inputs(opt));
  refuse_checkpoint(label, out);
  refuse_existing(label, out, opt.overwrite);
  const Page page = read_page(opt);
  refuse_inputs(label, out, page.trace_paths);
  try {
    files::replace_file(out, page_html(page));
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("report: ") + e.what());
  }
  return out;
}

}  // namespace shardlm::report
