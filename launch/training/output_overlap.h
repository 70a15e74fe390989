// No output is written over an input or over another output, whatever names lead to it: symbolic
// links, hard links, "./x" and "x", a lock file (output_lock.h) or a checkpoint directory's entries
// named as a file. Files are compared as the kernel knows them (device and inode, after resolving
// links); a file that does not exist yet, by the directory it would be created in and its name there.
// Checked at set-up, before anything is written: a clash is a usage error naming both flags.
#pragma once
#include <string>
#include <vector>

namespace amp::launch {

struct NamedFile {
  enum class Role {
    input,             // read: --data, --init-weights, --config
    input_directory,   // read, with everything in it: --resume-from
    output,            // written: --metrics, --save-weights, and their lock files
    output_directory,  // written inside, entries named as a checkpoint's: --checkpoint-dir
  };
  std::string what;  // "--metrics", "the lock file of --save-weights"
  std::string path;
  Role role;
};

// The lock file output_lock.h takes for an output file: ".NAME.lock" beside the file a link names.
std::string lock_path_of(const std::string& output);

// Throws std::invalid_argument naming both and the file when an output is the same file as an input
// or another output, lies inside an input directory, or is an entry a checkpoint directory writes
// (.lock, step-*, .tmp-step-*, .old-step-*, and what is inside them).
void check_outputs_apart(const std::vector<NamedFile>& files);

}  // namespace amp::launch
