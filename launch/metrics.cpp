#include "launch/metrics.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace amp::launch {

namespace {
// JSON has no inf/NaN: a non-finite number is written as null.
nlohmann::ordered_json num(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(); }
}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  out_.open(path_, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::invalid_argument("--metrics: cannot open '" + path_ + "' for writing");
}

MetricsWriter::~MetricsWriter() {
  if (out_.is_open()) out_.close();
}

// One write per line: the line is built first, then written and flushed whole.
void MetricsWriter::line(const std::string& json) {
  out_.write((json + '\n').data(), static_cast<std::streamsize>(json.size() + 1));
  out_.flush();
  if (!out_) throw std::runtime_error("--metrics: cannot write '" + path_ + "'");
}

void MetricsWriter::write(const StepRecord& r) {
  if (!out_.is_open()) return;
  nlohmann::ordered_json j = {{"step", r.step},       {"loss", num(r.loss)}, {"scale", num(r.scale)},
                              {"skipped", r.skipped}, {"grad_norm", num(r.grad_norm)},
                              {"lr", r.lr},           {"step_ms", r.step_ms}};
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
  }
  line(j.dump());
}

void MetricsWriter::write(const EvalRecord& r) {
  if (!out_.is_open()) return;
  line(nlohmann::ordered_json{{"event", "eval"}, {"step", r.step}, {"val_loss", num(r.val_loss)}}.dump());
}

void MetricsWriter::write(const EndRecord& r) {
  if (!out_.is_open()) return;
  nlohmann::ordered_json j = {{"event", "end"},
                              {"steps", r.steps},
                              {"skipped_steps", r.skipped_steps},
                              {"final_scale", num(r.final_scale)},
                              {"param_checksum", r.param_checksum},
                              {"replicas_consistent", r.replicas_consistent}};
  if (!r.interrupted_by.empty()) j["interrupted_by"] = r.interrupted_by;
  line(j.dump());
}

void MetricsWriter::close() {
  if (!out_.is_open()) return;
  out_.flush();
  const bool ok = static_cast<bool>(out_);
  out_.close();
  if (!ok) throw std::runtime_error("--metrics: cannot write '" + path_ + "'");
}

}  // namespace amp::launch
