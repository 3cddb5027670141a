// `train --config FILE.toml`: toml++ parses the file and each key's value goes straight to its
// CLI11 option as a value. Values are never turned back into command-line words, where an empty
// string (`out = ""`) made CLI11 take the next word as the value and a string starting with '-'
// read as a flag. A key applies only to options the command line left unset, so the command line
// wins over the file.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace shardlm::cli {

// Reads PATH and sets every option of `cmd` it names that the command line did not, through the
// option's own conversion and checks. Keys are flag names spelt with '-' or '_'. Throws
// CLI::FileError or CLI::ConfigError, one line starting "config PATH: ", for a missing,
// unreadable or non-regular file (a directory read as an empty file would run the defaults), a
// syntax error (with its line), an unknown key, a value that is not a string, number or boolean,
// or a value its option refuses.
void apply_toml_config(const std::string& path, CLI::App* cmd);

}  // namespace shardlm::cli
