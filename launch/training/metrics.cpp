#include "launch/training/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace amp::launch {

namespace {
// JSON has no inf/NaN: a non-finite number is written as null.
nlohmann::ordered_json num(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(); }
}  // namespace

bool ends_with_end_record(const std::string& path, int64_t steps) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const off_t end = ::lseek(fd, 0, SEEK_END);
  if (end <= 0) {
    ::close(fd);
    return false;
  }
  const off_t from = end > 4096 ? end - 4096 : 0;  // an end record is far shorter
  std::string tail(static_cast<size_t>(end - from), '\0');
  const bool read = ::pread(fd, tail.data(), tail.size(), from) == static_cast<ssize_t>(tail.size());
  ::close(fd);
  if (!read || tail.back() != '\n') return false;
  tail.pop_back();
  const nlohmann::json last = nlohmann::json::parse(tail.substr(tail.rfind('\n') + 1), nullptr, false);  // npos + 1: 0
  if (!last.is_object() || !last.contains("event") || !last.contains("steps")) return false;  // a line of any shape
  const nlohmann::json &event = last["event"], &n = last["steps"];
  return event.is_string() && event.get<std::string>() == "end" && n.is_number_integer() && n.get<int64_t>() == steps;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
  if (fd_ < 0) throw std::invalid_argument("--metrics: cannot open '" + path_ + "' for writing: " + std::strerror(errno));
  // Appending after a line cut short (the file truncated or edited since): a line of its own, not
  // glued onto that one, which would spoil both.
  char last = '\n';
  const off_t end = append ? ::lseek(fd_, 0, SEEK_END) : 0;
  if (const int rd = end > 0 ? ::open(path_.c_str(), O_RDONLY | O_CLOEXEC) : -1; rd >= 0) {
    if (::pread(rd, &last, 1, end - 1) == 1 && last != '\n') {
      const ssize_t n = ::write(fd_, "\n", 1);
      (void)n;  // a failure shows at the first line's write
    }
    ::close(rd);
  }
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

// One write(2) per line. A short or failed write is cut off again (ftruncate to the length before
// it), so that no reader ever sees half a record, and the writer stops.
void MetricsWriter::line(const std::string& json, int64_t step) {
  if (fd_ < 0) return;
  const std::string text = json + '\n';
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      error_ = "--metrics: cannot write '" + path_ + "' at step " + std::to_string(step) + ": " + std::strerror(err);
      if (before >= 0 && ::ftruncate(fd_, before) != 0) error_ += " (and the partial line could not be removed)";
      ::close(fd_);
      fd_ = -1;
      return;
    }
    done += static_cast<size_t>(n);
  }
}

void MetricsWriter::write(const ResumeRecord& r) {
  line(nlohmann::ordered_json{{"event", "resume"}, {"step", r.step}, {"checkpoint", r.checkpoint}}.dump(), r.step);
}

void MetricsWriter::write(const StepRecord& r) {
  if (fd_ < 0) return;
  nlohmann::ordered_json j = {{"step", r.step},       {"loss", num(r.loss)}, {"scale", num(r.scale)},
                              {"skipped", r.skipped}, {"grad_norm", num(r.grad_norm)},
                              {"lr", r.lr},           {"step_ms", r.step_ms},
                              {"comm_bytes", r.comm_bytes}};
  if (!r.task_losses.empty()) {
    nlohmann::ordered_json tl = nlohmann::ordered_json::array();
    for (double v : r.task_losses) tl.push_back(num(v));
    j["task_losses"] = tl;
  }
  if (!r.weights.empty()) {
    nlohmann::ordered_json w = nlohmann::ordered_json::array();
    for (double v : r.weights) w.push_back(num(v));
    j["weights"] = w;
  }
  if (r.device_launches >= 0) {
    j["device_launches"] = r.device_launches;
    j["device_host_syncs"] = r.device_host_syncs;
    j["device_d2h_copies"] = r.device_d2h_copies;
    j["device_graph_launches"] = r.device_graph_launches;
    j["device_graph_ops"] = r.device_graph_ops;
    j["device_allocations"] = r.device_allocations;
  }
  line(j.dump(), r.step);
}

void MetricsWriter::write(const EvalRecord& r) {
  line(nlohmann::ordered_json{{"event", "eval"}, {"step", r.step}, {"val_loss", num(r.val_loss)}}.dump(), r.step);
}

void MetricsWriter::write(const EndRecord& r) {
  nlohmann::ordered_json j = {{"event", "end"},
                              {"steps", r.steps},
                              {"skipped_steps", r.skipped_steps},
                              {"final_scale", num(r.final_scale)},
                              {"param_checksum", r.param_checksum},
                              {"replicas_consistent", r.replicas_consistent}};
  if (!r.interrupted_by.empty()) j["interrupted_by"] = r.interrupted_by;
  if (r.device_memory_bytes > 0) j["device_memory_bytes"] = r.device_memory_bytes;
  line(j.dump(), r.steps);
}

void MetricsWriter::write(const FailedRecord& r) {
  line(nlohmann::ordered_json{{"event", "failed"}, {"steps", r.steps}, {"error", r.error}}.dump(), r.steps);
}

void MetricsWriter::close() {
  if (fd_ < 0) return;
  if (::fsync(fd_) != 0 && errno != EINVAL && error_.empty())
    error_ = "--metrics: cannot flush '" + path_ + "' to the disk: " + std::strerror(errno);
  if (::close(fd_) != 0 && error_.empty()) error_ = "--metrics: cannot close '" + path_ + "': " + std::strerror(errno);
  fd_ = -1;
}

}  // namespace amp::launch
