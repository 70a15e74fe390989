// What a path names when it is not a regular file, in words for messages of the form "PATH: is
// <words>": "a directory", or "not a regular file (a device, FIFO or socket)". Empty for a regular
// file, and for a path that names nothing (opening it says so). Inputs and outputs are checked with
// it before they are opened: a directory is never read, a FIFO never waited on, a device never
// replaced.
#pragma once
#include <sys/stat.h>

#include <filesystem>
#include <string>

namespace amp {

inline std::string irregular_file(const std::filesystem::file_status& st) {
  if (!std::filesystem::exists(st) || std::filesystem::is_regular_file(st)) return "";
  return std::filesystem::is_directory(st) ? "a directory" : "not a regular file (a device, FIFO or socket)";
}

// The file a path names (through symbolic links).
inline std::string irregular_file(const std::string& path) {
  std::error_code ec;
  return irregular_file(std::filesystem::status(path, ec));
}

// Why a path names nothing, in words for "PATH: <words>": "no such file", or "'a.cfg' is not a
// directory" where a name on the way is a file ('a.cfg/', 'a.cfg/x'): open(2)'s ENOTDIR, which
// std::filesystem reports as a missing file.
inline std::string missing_file(const std::string& path) {
  std::error_code ec;
  for (std::filesystem::path p = std::filesystem::path(path).parent_path(); !p.empty(); p = p.parent_path()) {
    const std::filesystem::file_status st = std::filesystem::status(p, ec);
    if (std::filesystem::exists(st))
      return std::filesystem::is_directory(st) ? "no such file" : "'" + p.string() + "' is not a directory";
    if (p == p.parent_path()) break;  // the root
  }
  return "no such file";
}

// The file a writer's open() of path reaches: symbolic links followed, a dangling one to the file it
// names (which the open would create; std::filesystem::weakly_canonical stops at a dangling link and
// names the link itself). path itself when it is not a link.
inline std::filesystem::path written_through(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = path;
  for (int hops = 0; hops < 40 && std::filesystem::is_symlink(p, ec); ++hops) {  // 40: the kernel's own limit
    const std::filesystem::path to = std::filesystem::read_symlink(p, ec);
    if (ec) break;
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  return p;
}

// An open file's (fstat's st_mode): race-free where the file is already open.
inline std::string irregular_file_mode(mode_t mode) {
  if (S_ISREG(mode)) return "";
  return S_ISDIR(mode) ? "a directory" : "not a regular file (a device, FIFO or socket)";
}

}  // namespace amp
