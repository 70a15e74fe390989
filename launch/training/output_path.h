// Output files (--save-weights, --metrics) are checked before the first step, so that a typo costs
// seconds, not a whole run: the directory must exist and be writable, and the file, if it exists,
// must be a regular file (a symlink is followed: the file it names is the one written).
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace amp::launch {

// Throws std::invalid_argument naming flag and path when path cannot be written as a file.
void check_output_path(const char* flag, const std::string& path);

// True when pid (a temporary's suffix: the decimal id of the process that wrote it) names no live
// process (none, or a zombie not yet reaped): the temporary is stale. False for anything else,
// including a live process of another user.
bool writer_is_gone(const std::string& pid);

// Removes the temporaries that a killed save of path left behind ("NAME.tmp.PID", safetensors.h,
// whose process is gone), and returns their names. Another live process's temporary is kept.
std::vector<std::string> remove_stale_temporaries(const std::string& path);

}  // namespace amp::launch
