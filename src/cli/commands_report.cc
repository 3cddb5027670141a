// `shardlm report`: the run report (report/report.h) of a run directory, written as one HTML file.
#include <fmt/format.h>

#include "cli/subcommands.h"
#include "report/report.h"

namespace shardlm::cli {

void add_report_command(CLI::App& app, ReportArgs& a) {
  a.cmd = app.add_subcommand("report", "write a run's report: one self-contained HTML page (loss, throughput, memory, time)");
  a.cmd->add_option("run_dir", a.opt.run_dir, "the run directory (train's --out)")->group("Data")->required();
  a.cmd->add_option("--out", a.opt.out,
                    "the page to write (default RUN_DIR/report.html); never a file the report reads or one inside a checkpoint")
      ->group("Output");
  a.cmd->add_flag("--overwrite", a.opt.overwrite, "replace an existing --out that is not a report this command wrote")
      ->group("Output");
  a.cmd->add_option("--compare", a.opt.compare, "other run directories whose curves are overlaid")->group("Data")->expected(1, -1);
  a.cmd->add_option("--simulated", a.opt.simulated, "`shardlm simulate --json` output, shown beside the measurement")->group("Data");
  a.cmd->add_option("--trace", a.opt.traces, "Chrome trace(s) to break down (default: the one the run wrote)")->group("Data")->expected(1, -1);
}

int run_report(const ReportArgs& a) {
  fmt::print("{}\n", report::write_report(a.opt));
  return 0;
}

}  // namespace shardlm::cli
