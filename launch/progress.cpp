#include "launch/progress.h"

#include <cmath>
#include <cstdio>
#include <string>

#include "launch/training/figures.h"

namespace amp::launch {

namespace {
// A duration as a person reads it: 42s, 12m05s, 3h07m, 41d (an ETA of 1185395620s was printed so).
std::string duration_text(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  const long long n = std::llround(s);
  if (n < 60) std::snprintf(buf, sizeof buf, "%llds", n);
  else if (n < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", n / 60, n % 60);
  else if (n < 2 * 86400) std::snprintf(buf, sizeof buf, "%lldh%02lldm", n / 3600, n % 3600 / 60);
  else std::snprintf(buf, sizeof buf, "%lldd", n / 86400);
  return buf;
}

class ProgressPrinter final : public ProgressSink {
 public:
  ProgressPrinter(const TrainConfig& cfg, const models::ModelSpec& spec, int64_t start_step, int64_t samples_per_step)
      : steps_(cfg.steps), log_every_(cfg.log_every), start_step_(start_step), samples_per_step_(samples_per_step),
        // Samples per second, or tokens per second for a language model (block_size tokens a sample).
        tokens_per_sample_(spec.tokens_per_sample()), unit_(spec.unit()) {}

  void step(const StepRecord& r, int64_t skipped, double elapsed, bool stopping) override {
    if (log_every_ <= 0 || !(r.step % log_every_ == 0 || r.step == steps_ || stopping)) return;
    const int64_t done = r.step - start_step_;
    const double rate = static_cast<double>(done * samples_per_step_) * tokens_per_sample_ / elapsed;
    const double eta = elapsed / static_cast<double>(done) * static_cast<double>(steps_ - r.step);
    std::printf("step %lld/%lld  loss %s  lr %.4g  scale %g  skipped %lld  %.0f %s/s  ETA %s",
                static_cast<long long>(r.step), static_cast<long long>(steps_), number_str(r.loss).c_str(), r.lr,
                r.scale, static_cast<long long>(skipped), rate, unit_, duration_text(eta).c_str());
    if (r.device_launches >= 0)
      std::printf("  [emulated GPU: %lld launches, %lld host syncs, %lld D2H copies%s]",
                  static_cast<long long>(r.device_launches), static_cast<long long>(r.device_host_syncs),
                  static_cast<long long>(r.device_d2h_copies),
                  r.device_graph_launches > 0
                      ? (", " + std::to_string(r.device_graph_launches) + " CUDA graph launch of " +
                         std::to_string(r.device_graph_ops) + " operations").c_str()
                      : "");
    std::printf("\n");
    std::fflush(stdout);
  }

  void validation(int64_t step, double loss) override {
    std::printf("step %lld: validation loss %s\n", static_cast<long long>(step), number_str(loss).c_str());
    std::fflush(stdout);
  }

  void device_memory(size_t bytes) override {
    if (log_every_ <= 0) return;
    std::printf("device memory: %.2f GiB at most (rank 0's GPU, beyond its CUDA context, as the driver counts it: "
                "cudaMemGetInfo)\n", static_cast<double>(bytes) / (1u << 30));
    std::fflush(stdout);
  }

 private:
  int64_t steps_, log_every_, start_step_, samples_per_step_;
  double tokens_per_sample_;
  const char* unit_;
};
}  // namespace

std::shared_ptr<ProgressSink> progress_printer(const TrainConfig& cfg, const models::ModelSpec& spec,
                                               int64_t start_step, int64_t samples_per_step) {
  return std::make_shared<ProgressPrinter>(cfg, spec, start_step, samples_per_step);
}

}  // namespace amp::launch
