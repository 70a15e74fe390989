#include "launch/metrics.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace amp::launch {

namespace {
// JSON has no inf/NaN: a non-finite number is written as null.
nlohmann::ordered_json num(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(); }
}  // namespace

MetricsWriter::MetricsWriter(const std::string& path) : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())) {
  out_.open(tmp_, std::ios::trunc);
  if (!out_) throw std::invalid_argument("--metrics: cannot open '" + tmp_ + "' for writing");
}

MetricsWriter::~MetricsWriter() {
  if (out_.is_open()) {
    out_.close();
    std::remove(tmp_.c_str());
  }
}

void MetricsWriter::write(const StepRecord& r) {
  if (!out_.is_open()) return;
  nlohmann::ordered_json j = {{"step", r.step},       {"loss", num(r.loss)}, {"scale", num(r.scale)},
                              {"skipped", r.skipped}, {"grad_norm", num(r.grad_norm)},
                              {"lr", r.lr},           {"step_ms", r.step_ms}};
  if (r.device_launches >= 0) {
    j["device_launches"] = r.device_launches;
    j["device_host_syncs"] = r.device_host_syncs;
    j["device_d2h_copies"] = r.device_d2h_copies;
  }
  out_ << j.dump() << '\n';
}

void MetricsWriter::write(const EndRecord& r) {
  if (!out_.is_open()) return;
  nlohmann::ordered_json j = {{"event", "end"},
                              {"steps", r.steps},
                              {"skipped_steps", r.skipped_steps},
                              {"final_scale", num(r.final_scale)},
                              {"param_checksum", r.param_checksum},
                              {"replicas_consistent", r.replicas_consistent}};
  out_ << j.dump() << '\n';
}

void MetricsWriter::close() {
  if (!out_.is_open()) return;
  out_.flush();
  const bool ok = static_cast<bool>(out_);
  out_.close();
  if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw std::runtime_error("--metrics: cannot write '" + path_ + "'");
  }
}

}  // namespace amp::launch
