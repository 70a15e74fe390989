#include "launch/training/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <stdexcept>

#include "launch/training/output_path.h"
#include "runtime/core/fnv1a.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModel = "model.safetensors";
constexpr const char* kOptimizer = "optimizer.safetensors";
constexpr const char* kMeta = "trainer.json";
constexpr const char* kTempPrefix = ".tmp-step-";
constexpr const char* kTrashPrefix = ".old-step-";  // a checkpoint being pruned

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// step-NNNNNNNN -> NNNNNNNN; -1 for any other name.
int64_t step_of(const std::string& name) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0) return -1;
  const std::string digits = name.substr(5);
  if (digits.empty() || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

std::string read_file(const fs::path& p, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec))
    throw std::invalid_argument(p.string() + ": missing (" + what + "): a partial or damaged checkpoint");
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw std::invalid_argument(p.string() + ": cannot be read");
  return bytes;
}

std::string checksum(const std::string& bytes) { return hex64(fnv1a(bytes.data(), bytes.size())); }

// trainer.json's own checksum: over its compact text without the "checksum" key (nlohmann::json
// keeps keys sorted, and numbers print so that they read back the same).
std::string meta_checksum(nlohmann::json meta) {
  meta.erase("checksum");
  return checksum(meta.dump());
}

// Writes bytes to path and flushes them to the disk.
void write_synced(const fs::path& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(path.string() + ": cannot create: " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      throw std::runtime_error(path.string() + ": write failed (disk full?): " + err);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0)
    throw std::runtime_error(path.string() + ": cannot flush to disk: " + std::strerror(errno));
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

safetensors::NamedTensors optimizer_tensors(const optim::OptimizerStateDict& sd) {
  safetensors::NamedTensors out;
  for (const auto& [id, entries] : sd.state)
    for (const auto& [name, t] : entries) out.emplace_back("state." + std::to_string(id) + "." + name, t);
  return out;
}

optim::OptimizerStateDict optimizer_state(const safetensors::NamedTensors& tensors, const nlohmann::json& groups,
                                          const std::string& file) {
  optim::OptimizerStateDict sd;
  sd.param_groups = groups;
  for (const auto& [name, t] : tensors) {
    const size_t dot = name.find('.', 6);
    if (name.compare(0, 6, "state.") != 0 || dot == std::string::npos)
      throw std::invalid_argument(file + ": unexpected tensor '" + name + "' (expected state.<id>.<name>)");
    const std::string id = name.substr(6, dot - 6);
    if (id.empty() || id.find_first_not_of("0123456789") != std::string::npos || id.size() > 9)
      throw std::invalid_argument(file + ": tensor '" + name + "' has no parameter id");
    sd.state[std::stoll(id)][name.substr(dot + 1)] = t;
  }
  return sd;
}

}  // namespace

bool is_checkpoint_entry(const std::string& name) {
  return step_of(name) >= 0 || name == ".lock" || name.rfind(kTempPrefix, 0) == 0 || name.rfind(kTrashPrefix, 0) == 0;
}

int64_t checkpoint_step_of(const std::string& name) { return step_of(name); }

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const int64_t step = step_of(it->path().filename().string());
    if (step >= 0 && it->is_directory(ec)) found.emplace_back(step, it->path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(path);
  return out;
}

std::vector<std::string> remove_stale_checkpoint_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, std::strlen(kTempPrefix), kTempPrefix) != 0 &&
        name.compare(0, std::strlen(kTrashPrefix), kTrashPrefix) != 0)
      continue;
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos || !writer_is_gone(name.substr(dot + 1))) continue;
    std::error_code rm;
    if (fs::remove_all(it->path(), rm) > 0 && !rm) removed.push_back(it->path().string());
  }
  return removed;
}

void check_checkpoint_dir(const std::string& dir, std::string* made) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec)) && !fs::is_directory(dir, ec))
    throw std::invalid_argument("--checkpoint-dir " + dir + ": exists and is not a directory");
  fs::path top;  // the topmost of the directories create_directories will make
  for (fs::path p = normal_directory(dir); !p.empty() && !fs::exists(fs::symlink_status(p, ec)); p = p.parent_path()) {
    top = p;
    if (p == p.parent_path()) break;
  }
  fs::create_directories(dir, ec);
  if (ec) throw std::invalid_argument("--checkpoint-dir " + dir + ": cannot create the directory: " + ec.message());
  if (made != nullptr) *made = top.string();
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw std::invalid_argument("--checkpoint-dir " + dir + ": the directory is not writable");
  // An entry with a checkpoint's name that is not a directory (a file the user keeps there) would be
  // passed over by --resume and replaced by the checkpoint of its step: refused before any step.
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code st;
    const std::string name = it->path().filename().string();
    const int64_t step = step_of(name);  // only the names a checkpoint is written under (step-%08lld)
    if (step >= 0 && name == step_name(step) && !fs::is_directory(it->path(), st))
      throw std::invalid_argument("--checkpoint-dir " + dir + ": " + it->path().filename().string() +
                                  " has a checkpoint's name but is not a directory: move it out of the way (the "
                                  "checkpoint of its step would replace it)");
  }
}

std::filesystem::path normal_directory(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  return p.has_filename() ? p : p.parent_path();  // "a/b/" -> "a/b"
}

std::string save_checkpoint(const std::string& dir, int64_t step, const safetensors::NamedTensors& model,
                            const optim::OptimizerStateDict& optimizer, nlohmann::json meta, int64_t keep) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) throw std::runtime_error("--checkpoint-dir " + dir + ": cannot create the directory");
  const fs::path final_path = fs::path(dir) / step_name(step);
  const fs::path tmp = fs::path(dir) / (kTempPrefix + step_name(step).substr(5) + "." + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) throw std::runtime_error(tmp.string() + ": cannot create: " + ec.message());
  try {
    const std::string model_bytes = safetensors::serialize(model);
    const std::string opt_bytes = safetensors::serialize(optimizer_tensors(optimizer));
    meta["step"] = step;
    meta["optimizer_param_groups"] = optimizer.param_groups;
    meta["files"] = {{kModel, {{"bytes", model_bytes.size()}, {"fnv1a64", checksum(model_bytes)}}},
                     {kOptimizer, {{"bytes", opt_bytes.size()}, {"fnv1a64", checksum(opt_bytes)}}}};
    meta["checksum"] = meta_checksum(meta);
    write_synced(tmp / kModel, model_bytes);
    write_synced(tmp / kOptimizer, opt_bytes);
    write_synced(tmp / kMeta, meta.dump(2) + "\n");  // last: its presence means the others are there
    sync_directory(tmp);
    if (fs::exists(fs::symlink_status(final_path, ec)) && !fs::is_directory(final_path, ec))
      throw std::runtime_error(final_path.string() + ": exists and is not a checkpoint directory: not replaced");
    if (fs::exists(final_path, ec)) {  // a rerun of the same step replaces it: out of the step-* names first
      const fs::path old = fs::path(dir) / (kTrashPrefix + step_name(step).substr(5) + "." + std::to_string(::getpid()));
      fs::rename(final_path, old, ec);
      sync_directory(dir);
      fs::remove_all(old, ec);
    }
    fs::rename(tmp, final_path, ec);
    if (ec) throw std::runtime_error(final_path.string() + ": cannot rename the checkpoint into place: " + ec.message());
    sync_directory(dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  prune_checkpoints(dir, keep);
  return final_path.string();
}

void prune_checkpoints(const std::string& dir, int64_t keep, const std::function<void()>& between_files) {
  // Each one is first renamed out of the step-* names (atomic), then deleted: a process killed while
  // deleting leaves a .old-step-*.PID directory, which the next run removes, never a partial step-*.
  const std::vector<std::string> all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    const fs::path from = all[i];
    const fs::path trash = fs::path(dir) / (kTrashPrefix + from.filename().string().substr(5) + "." + std::to_string(::getpid()));
    std::error_code ec;
    const bool link = fs::is_symlink(from, ec);  // a checkpoint kept elsewhere, linked in: the link goes, not it
    fs::rename(from, trash, ec);
    if (ec) continue;  // still complete where it is: kept, and tried again by the next checkpoint
    sync_directory(dir);
    if (link) {
      fs::remove(trash, ec);
      continue;
    }
    for (fs::directory_iterator it(trash, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
      if (between_files) between_files();
    }
    fs::remove_all(trash, ec);
  }
}

Checkpoint load_checkpoint(const std::string& path) {
  const fs::path dir = path;
  std::error_code ec;
  if (!fs::exists(dir, ec))
    throw std::invalid_argument(path + (ec ? ": cannot be read: " + ec.message() : ": no such checkpoint (it does not exist)"));
  if (!fs::is_directory(dir, ec)) throw std::invalid_argument(path + ": not a checkpoint directory");
  if (!fs::exists(dir / kMeta, ec))  // a --checkpoint-dir given as one checkpoint: which step?
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename().string().rfind("step-", 0) == 0 && fs::exists(it->path() / kMeta, ec))
        throw std::invalid_argument(path + ": holds checkpoints (" + it->path().filename().string() +
                                    "), it is not one: give --resume --checkpoint-dir " + path +
                                    " for its latest, or --resume-from " + (dir / "step-NNNNNNNN").string());
  Checkpoint c;
  c.path = path;
  const std::string meta_text = read_file(dir / kMeta, "written last: the checkpoint never completed");
  try {
    c.meta = nlohmann::json::parse(meta_text);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument((dir / kMeta).string() + ": corrupt: " + e.what());
  }
  // A newer version's checkpoint may hold state this one would drop: refused, not half-read.
  if (c.meta.is_object() && c.meta.contains("format") &&
      (!c.meta["format"].is_number_integer() || c.meta["format"].get<int64_t>() < 1 ||
       c.meta["format"].get<int64_t>() > kCheckpointFormat))
    throw std::invalid_argument((dir / kMeta).string() + ": format " + c.meta["format"].dump() +
                                (c.meta["format"].is_number_integer() && c.meta["format"].get<int64_t>() > kCheckpointFormat
                                     ? " was written by a newer amp_train (this one reads formats 1 to " +
                                           std::to_string(kCheckpointFormat) + "): resume it with that version"
                                     : " is not a checkpoint format"));
  const auto& files = c.meta.contains("files") ? c.meta["files"] : nlohmann::json();
  if (!c.meta.contains("step") || !c.meta["step"].is_number_integer() || !files.is_object() ||
      !c.meta.contains("optimizer_param_groups"))
    throw std::invalid_argument((dir / kMeta).string() + ": corrupt: missing step, files or optimizer_param_groups");
  // Its own checksum (written by every version since format 2): a changed step, scale or position
  // is refused, not trained from.
  const bool checked = c.meta.contains("checksum");
  if (checked && (!c.meta["checksum"].is_string() || c.meta["checksum"].get<std::string>() != meta_checksum(c.meta)))
    throw std::invalid_argument((dir / kMeta).string() + ": checksum mismatch: the file was changed or damaged");
  if (!checked && !(c.meta.contains("format") && c.meta["format"] == 1))
    throw std::invalid_argument((dir / kMeta).string() + ": corrupt: no checksum");
  c.meta.erase("checksum");
  // A whole number from 1 that an int64_t holds (2^64 - 1 read as int64_t is -1).
  if (!c.meta["step"].is_number_unsigned() || c.meta["step"].get<uint64_t>() < 1 ||
      c.meta["step"].get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw std::invalid_argument((dir / kMeta).string() + ": corrupt: step " + c.meta["step"].dump() + " is not a step");
  c.step = c.meta["step"].get<int64_t>();
  const fs::path dir_name = dir.has_filename() ? dir.filename() : dir.parent_path().filename();  // "step-N/" too
  const int64_t named = step_of(dir_name.string());
  if (named >= 0 && named != c.step)
    throw std::invalid_argument((dir / kMeta).string() + ": corrupt: step " + std::to_string(c.step) + " in a directory named " +
                                dir_name.string());
  // The tensors are parsed from the bytes checked here, not from a second read of the files.
  std::map<std::string, std::string> checked_bytes;
  for (const char* name : {kModel, kOptimizer}) {
    const fs::path file = dir / name;
    std::string& bytes = checked_bytes[name];
    bytes = read_file(file, "the checkpoint is partial");
    if (!files.contains(name)) throw std::invalid_argument((dir / kMeta).string() + ": corrupt: no entry for " + name);
    const auto& want = files[name];
    if (want.value("bytes", uint64_t{0}) != bytes.size())
      throw std::invalid_argument(file.string() + ": " + std::to_string(bytes.size()) + " bytes, " +
                                  std::to_string(want.value("bytes", uint64_t{0})) +
                                  " written: the file is truncated or damaged");
    if (want.value("fnv1a64", std::string()) != checksum(bytes))
      throw std::invalid_argument(file.string() + ": checksum mismatch: the file is damaged");
  }
  c.model = safetensors::parse(checked_bytes[kModel], (dir / kModel).string());
  checked_bytes.erase(kModel);
  c.optimizer = optimizer_state(safetensors::parse(checked_bytes[kOptimizer], (dir / kOptimizer).string()),
                                c.meta["optimizer_param_groups"], (dir / kOptimizer).string());
  c.meta.erase("files");
  return c;
}

std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir) {
  const std::vector<std::string> all = list_checkpoints(dir);
  if (all.empty()) return std::nullopt;
  try {
    return load_checkpoint(all.back());
  } catch (const std::invalid_argument& e) {
    std::string older;
    for (size_t i = all.size() - 1; i-- > 0;) older += "\n  --resume-from " + all[i];
    throw std::invalid_argument(std::string(e.what()) + "\nThe newest checkpoint is unusable; " +
                                (older.empty() ? "there is no older one."
                                               : "to resume from an older complete one, move " + all.back() +
                                                     " out of " + dir + " and replace --resume with --resume-from one of:" + older));
  }
}

}  // namespace amp::launch
