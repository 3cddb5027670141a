// Writing a file that a reader may open at any moment and another writer may be writing too (train
// refreshing its page while `shardlm report` writes it): the text goes to a temporary file in the
// target's directory under a name no other writer picks, created exclusively (so never through a
// symbolic link someone left there), is flushed to disk and renamed over the target. A reader sees
// the old file or the new one, never half of one; the last rename wins.
#pragma once

#include <string>

namespace shardlm::report {

// Replaces PATH by TEXT. Throws std::runtime_error (one line naming PATH) when PATH names a
// directory or cannot be written; nothing is left behind then (no temporary file).
void replace_file(const std::string& path, const std::string& text);

}  // namespace shardlm::report
