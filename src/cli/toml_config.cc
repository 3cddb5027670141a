#include "cli/toml_config.h"

#include <toml++/toml.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <optional>
#include <sys/stat.h>
#include <unistd.h>

namespace shardlm::cli {

namespace {

void check_file(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw CLI::FileError(fmt::format("config {}: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw CLI::FileError(fmt::format("config {}: is a directory, not a TOML file", path));
  if (!S_ISREG(st.st_mode)) throw CLI::FileError(fmt::format("config {}: not a regular file", path));
  if (::access(path.c_str(), R_OK) != 0)
    throw CLI::FileError(fmt::format("config {}: cannot read: {}", path, std::strerror(errno)));
}

// A TOML scalar as the text its option parses; nullopt for arrays, tables and dates.
std::optional<std::string> scalar_text(const toml::node& node) {
  if (node.is_string()) return *node.value<std::string>();
  if (node.is_boolean()) return *node.value<bool>() ? "true" : "false";
  if (node.is_integer()) return std::to_string(*node.value<int64_t>());
  if (node.is_floating_point()) return fmt::format("{}", *node.value<double>());  // shortest exact form
  return std::nullopt;
}

}  // namespace

void apply_toml_config(const std::string& path, CLI::App* cmd) {
  check_file(path);
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw CLI::ConfigError(fmt::format("config {}: line {}: {}", path, e.source().begin.line, e.description()));
  }
  for (const auto& [key, node] : table) {
    std::string flag(key.str());
    std::replace(flag.begin(), flag.end(), '_', '-');
    CLI::Option* opt = flag == "config" ? nullptr : cmd->get_option_no_throw("--" + flag);
    if (opt == nullptr) throw CLI::ConfigError(fmt::format("config {}: unknown key '{}'", path, key.str()));
    const auto text = scalar_text(node);
    if (!text)
      throw CLI::ConfigError(fmt::format("config {}: key '{}' must be a string, number or boolean", path, key.str()));
    // A flag takes no value on the command line; CLI11 would read any number as a count (9 = set).
    if (opt->get_expected_max() == 0 && !node.is_boolean())
      throw CLI::ConfigError(fmt::format("config {}: key '{}' is a switch: it must be true or false", path, key.str()));
    if (opt->count() > 0) continue;  // given on the command line
    try {
      opt->add_result(*text);
      opt->run_callback();  // converts and runs the option's checks
    } catch (const CLI::ParseError& e) {
      throw CLI::ConfigError(fmt::format("config {}: key '{}': {}", path, key.str(), e.what()));
    }
  }
}

}  // namespace shardlm::cli
