#include "launch/training/output_overlap.h"

#include <sys/stat.h>

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <system_error>

#include "launch/training/checkpoint.h"
#include "launch/training/output_path.h"
#include "runtime/core/file_kind.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {

// A file as the kernel knows it: its device and inode when it exists; otherwise the directory it
// would be created in and its name there (a dangling link: where the link points).
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  std::string name;  // empty: the file (dev, ino) itself
  bool operator==(const FileId& o) const { return dev == o.dev && ino == o.ino && name == o.name; }
};

std::optional<FileId> identify(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return FileId{st.st_dev, st.st_ino, ""};
  const fs::path p = written_through(path.string());  // a link to a file not yet written
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (::stat(dir.c_str(), &st) != 0) return std::nullopt;  // no such directory: check_output_path says so
  return FileId{st.st_dev, st.st_ino, p.filename().string()};
}

// The resolved path's ancestors, nearest first, each with its own name: "a/b/c" gives (a/b, "c"),
// (a, "b"), ...
std::vector<std::pair<fs::path, std::string>> ancestors(const fs::path& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  std::vector<std::pair<fs::path, std::string>> out;
  while (p.has_relative_path() && p != p.parent_path()) {
    out.emplace_back(p.parent_path(), p.filename().string());
    p = p.parent_path();
  }
  return out;
}

}  // namespace

std::string lock_path_of(const std::string& output) {
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(fs::absolute(output, ec), ec);
  return (target.parent_path() / ("." + target.filename().string() + ".lock")).string();
}

void check_outputs_apart(const std::vector<NamedFile>& files) {
  using Role = NamedFile::Role;
  auto refuse = [](const NamedFile& a, const NamedFile& b, const std::string& why) {
    throw std::invalid_argument(a.what + " '" + a.path + "' and " + b.what + " '" + b.path + "' " + why);
  };
  for (size_t i = 0; i < files.size(); ++i) {
    const NamedFile& out = files[i];
    if (out.path.empty() || out.role != Role::output) continue;
    const std::optional<FileId> id = identify(out.path);
    for (size_t j = 0; j < files.size(); ++j) {
      const NamedFile& other = files[j];
      if (j == i || other.path.empty()) continue;
      if (other.role == Role::input || (other.role == Role::output && j < i)) {
        if (id && identify(other.path) == id)
          refuse(out, other,
                 other.role == Role::input
                     ? "are the same file: the run would write over its own input; give the output another name"
                     : "are the same file: give each output its own");
        continue;
      }
      // Inside a directory: compare each ancestor of the output with it.
      const std::optional<FileId> dir = identify(other.path);
      if (!dir) continue;
      for (const auto& [parent, name] : ancestors(out.path)) {
        if (other.role == Role::input_directory && identify(parent / name) == dir)
          refuse(out, other, "overlap: the output lies inside the directory the run reads; write it elsewhere");
        if (other.role == Role::output_directory && identify(parent) == dir && is_checkpoint_entry(name))
          refuse(out, other,
                 "overlap: '" + name + "' is the checkpoint directory's own (its lock, or a checkpoint that "
                 "is pruned and replaced); write it beside them under another name");
      }
    }
  }
}

}  // namespace amp::launch
