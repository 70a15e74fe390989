// Outputs in use by a live run are refused, not shared: each run holds an exclusive lock (flock(2))
// on every output it writes (--checkpoint-dir, --metrics, --save-weights) for its whole life. A
// second run that names one of them stops at set-up with exit 2, naming the output and the process
// that holds it. The kernel releases a lock when its process ends, however it ends (kill -9
// included), so a dead run never blocks the next one.
//
// The lock of a file F is the file .F.lock beside it (beside the file a symbolic link names); the
// lock of a directory is DIR/.lock. They hold the owner's process id. A lock file is never followed:
// one that is a symbolic link, not a regular file, another user's, or that holds something else than
// a process id is refused, naming it. A run removes, as it ends, only the lock files it created (or
// found left by a run that is gone).
//
// A file written in place (--metrics) is also locked itself, by device and inode: another name for
// it (a hard link) is the same output. It is created empty at set-up when missing, and removed
// again if the run ends before writing to it.
#pragma once
#include <string>
#include <vector>

namespace amp::launch {

class OutputLocks {
 public:
  enum class Kind { directory, replaced_file, file_written_in_place };
  OutputLocks() = default;
  OutputLocks(const OutputLocks&) = delete;
  OutputLocks& operator=(const OutputLocks&) = delete;
  ~OutputLocks();  // releases every lock, removes the lock files it owns
  // Locks the output `path` given by `flag` (a directory, which must exist, or a file). Throws
  // std::invalid_argument naming the flag, the path and, when another process holds it, that process.
  void acquire(const char* flag, const std::string& path, Kind kind);

 private:
  struct Held {
    std::string flag, path;
    int fd;
    bool remove;       // a lock file this run owns, or an output it created: removed at the end
    bool only_if_empty;  // the output itself: removed only when nothing was written to it
  };
  std::vector<Held> held_;
  void lock_in_place(const char* flag, const std::string& path);
};

}  // namespace amp::launch
