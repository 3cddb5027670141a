// The `shardlm` command line: subcommands over the train, data and model parts.
#pragma once

namespace shardlm::cli {

// Parses argv, runs the subcommand and returns the process exit code. Every failure is one line
// on stderr ("shardlm: error: …") naming the file, field or flag at fault, and a non-zero code.
int run(int argc, char** argv);

}  // namespace shardlm::cli
