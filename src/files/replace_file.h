// Writing a file that a reader may open at any moment and another writer may be writing too (train
// refreshing its page while `shardlm report` writes it, two ranks' calibrate runs, a user's file
// or link already sitting at the temporary's name): the bytes go to a temporary file in the
// target's directory under a name no other writer picks, created exclusively (so never through a
// symbolic link someone left there), are flushed to disk and renamed over the target. A reader
// sees the old file or the new one, never half of one; the last rename wins; a failure leaves no
// temporary file behind.
#pragma once

#include <string>
#include <string_view>

namespace shardlm::files {

// Creates TARGET.tmp-PID-RANDOM, a name no other writer uses, with O_CREAT | O_EXCL | O_NOFOLLOW
// | O_CLOEXEC added to FLAGS (O_WRONLY or O_RDWR, maybe O_DIRECT) and mode 0644 before the umask.
// Returns its descriptor and sets TMP to its name, or returns -1 with errno set (TMP then names
// the last name tried).
int create_temporary(const std::string& target, std::string& tmp, int flags);

// Writes all of TEXT to FD (retrying short writes). Throws std::runtime_error with errno's text.
void write_all(int fd, std::string_view text);

// Flushes FD to disk, closes it and renames TMP over TARGET. Throws std::runtime_error (one line
// naming TARGET) after removing TMP when any of those fails; FD is closed either way.
void commit_temporary(int fd, const std::string& tmp, const std::string& target);

// Replaces PATH by TEXT. Throws std::runtime_error (one line naming PATH) when PATH names a
// directory or cannot be written; nothing is left behind then (no temporary file).
void replace_file(const std::string& path, const std::string& text);

}  // namespace shardlm::files
