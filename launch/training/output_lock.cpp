#include "launch/training/output_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "launch/training/output_overlap.h"
#include "launch/training/output_path.h"
#include "runtime/core/file_kind.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {

// What the holder wrote into its lock file: its process id, or "".
std::string pid_in(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  const std::string line = n > 0 ? std::string(buf, static_cast<size_t>(n)).substr(0, std::string(buf).find('\n')) : "";
  return line.empty() || line.find_first_not_of("0123456789") != std::string::npos ? "" : line;
}

// "process 1234 (amp_train)", from what the holder wrote into its lock file and from /proc.
std::string holder_of(int fd) {
  const std::string pid = pid_in(fd);
  if (pid.empty()) return "another process";
  std::string name;
  std::ifstream comm("/proc/" + pid + "/comm");
  std::getline(comm, name);
  return "process " + pid + (name.empty() ? "" : " (" + name + ")");
}

bool same_file(int fd, const std::string& path, bool follow) {
  struct stat mine {}, there {};
  const int r = follow ? ::stat(path.c_str(), &there) : ::lstat(path.c_str(), &there);
  return ::fstat(fd, &mine) == 0 && r == 0 && mine.st_ino == there.st_ino && mine.st_dev == there.st_dev;
}

bool no_locks_here(int err) { return err == ENOSYS || err == EOPNOTSUPP || err == ENOLCK; }

}  // namespace

void OutputLocks::acquire(const char* flag, const std::string& path, Kind kind) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(fs::absolute(path, ec), ec);  // symbolic links resolved
  if (ec) throw std::invalid_argument(std::string(flag) + ": '" + path + "': cannot resolve the path: " + ec.message());
  const std::string lock = kind == Kind::directory ? (target / ".lock").string() : lock_path_of(path);
  for (const Held& h : held_)
    if (h.path == lock)
      throw std::invalid_argument(std::string(flag) + " and " + h.flag + " name the same output '" + path +
                                  "': give each its own");
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(flag) + ": '" + path + "': " + why);
  };
  for (int attempt = 0;; ++attempt) {
    if (attempt == 100) fail("its lock file '" + lock + "' keeps being replaced");
    // Never through a link (O_NOFOLLOW): a link planted as the lock would make the run write, and
    // delete, whatever file it names.
    bool created = true;
    int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno == EEXIST) {
      created = false;
      fd = ::open(lock.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0 && errno == ENOENT) continue;  // its holder just removed it
    }
    if (fd < 0 && errno == ELOOP)
      fail("its lock file '" + lock + "' is a symbolic link: a lock file is never followed; remove the link");
    if (fd < 0 && errno == EISDIR) fail("its lock file '" + lock + "' is not a regular file (a directory); remove it");
    if (fd < 0) fail("cannot create its lock file '" + lock + "': " + std::strerror(errno));
    // A failure after this run made the file removes it again: nothing is left behind.
    auto give_up = [&](const std::string& why) {
      if (created) ::unlink(lock.c_str());
      ::close(fd);
      fail(why);
    };
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) give_up("its lock file '" + lock + "' is not a regular file; remove it");
    // (A file just made may belong to another uid: root's files on NFS with root_squash are nobody's.)
    if (!created && st.st_uid != ::geteuid())
      give_up("its lock file '" + lock + "' belongs to another user (uid " + std::to_string(st.st_uid) +
              "): remove it, or choose another path");
    // One that holds something else than a lock's process id is a file of the user's: not overwritten.
    const std::string before = pid_in(fd);
    if (!created && before.empty() && st.st_size > 0)
      give_up("its lock file '" + lock + "' exists and holds something else than a run's process id: move it away, or "
              "choose another path");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (no_locks_here(err)) {  // a filesystem without locks (Lustre without -o flock)
        if (created) ::unlink(lock.c_str());
        ::close(fd);
        std::fprintf(stderr, "amp_train: warning: %s: '%s': this filesystem has no file locks (%s): another run writing "
                     "it at the same time would not be refused\n", flag, path.c_str(), std::strerror(err));
        return;
      }
      const std::string who = err == EWOULDBLOCK ? holder_of(fd) : "";
      if (err == EWOULDBLOCK) {  // the holder's file: never removed here
        ::close(fd);
        fail("in use by another run, " + who + ": two runs writing one output would overwrite each other; wait for "
             "it to end, or choose another path");
      }
      give_up("cannot lock '" + lock + "': " + std::strerror(err));
    }
    // The previous holder removes its lock file as it ends: if it did so after our open(), our lock
    // is on a file nobody else will find. Lock the file that is there now instead.
    if (!same_file(fd, lock, false)) {
      ::close(fd);
      continue;
    }
    // A lock file left by a run that is gone (kill -9) is taken over, and removed at the end like
    // our own; an empty one, or a live process's that no longer holds it, is used and left.
    const bool owned = created || (!before.empty() && writer_is_gone(before));
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))
      give_up("cannot write its lock file '" + lock + "': " + std::strerror(errno));
    held_.push_back({flag, lock, fd, owned, false});
    break;
  }
  if (kind == Kind::file_written_in_place) lock_in_place(flag, path);
}

// The output itself, by device and inode: a hard link to a file another run writes is refused.
void OutputLocks::lock_in_place(const char* flag, const std::string& path) {
  const fs::path target = written_through(path);  // through a dangling link too
  struct stat st {};
  if (::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return;  // check_output_path refuses it
  // Created (O_EXCL: this run made it, and only then may remove it) when missing, so that it has an
  // inode to lock from the start. Open for writing: NFS emulates flock with fcntl locks, which need it.
  bool created = true;
  int fd = ::open(target.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST) {
    created = false;
    fd = ::open(target.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  }
  const std::string name = target.string();
  if (fd < 0) throw std::invalid_argument(std::string(flag) + ": '" + name + "': cannot open: " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (created) ::unlink(name.c_str());
    ::close(fd);
    if (no_locks_here(err) || err == EBADF) return;  // said once, for its lock file
    throw std::invalid_argument(std::string(flag) + ": '" + name + "': " +
                                (err == EWOULDBLOCK ? std::string("in use by another run under another name (a hard link to "
                                                                  "the same file): two runs writing one file would "
                                                                  "overwrite each other; choose another path")
                                                    : "cannot lock: " + std::string(std::strerror(err))));
  }
  held_.push_back({flag, name, fd, created, true});
}

OutputLocks::~OutputLocks() {
  for (auto h = held_.rbegin(); h != held_.rend(); ++h) {
    struct stat st {};
    // While still locked: nobody can take a lock on it in between. Only what this run owns, and only
    // the file it holds (not one that has replaced it since).
    if (h->remove && same_file(h->fd, h->path, h->only_if_empty) &&
        (!h->only_if_empty || (::fstat(h->fd, &st) == 0 && st.st_size == 0)))
      ::unlink(h->path.c_str());
    ::close(h->fd);
  }
}

}  // namespace amp::launch
