// bench_mlp: the reference workload (an MLP of 3 x 4096, batch 512, MSE, SGD) per precision mode.
// Prints the step time, GFLOP/s, the time of the step's GEMMs alone on the same library, the
// scaler's own cost and the peak memory. Figures, not assertions: see docs/BENCHMARKS.md for measurements.
#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "launch/bench/bench_timing.h"
#include "amp/grad_scaler.h"
#include "models/mlp.h"
#include "runtime/kernels/backend.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/sgd.h"
#include "runtime/ops/random.h"
#include "runtime/kernels/cpu/threads.h"

using namespace amp;
namespace po = boost::program_options;
using Clock = launch::BenchClock;
using launch::median;
using launch::ms_since;

namespace {

struct Mode {
  std::string name;
  bool autocasting;
  DType dtype;
  bool scaler;
};

struct StepFigures {
  double step_ms, scaler_ms, peak_mb;
};

StepFigures time_steps(const Mode& m, int64_t width, int64_t layers, int64_t batch, int warmup, int steps, double momentum,
                       Device dev) {
  Generator gen(1);
  auto model = models::make_mlp({width, width, width, layers}, gen, dev);
  const Tensor x = randn({batch, width}, gen, DType::f32, dev), y = randn({batch, width}, gen, DType::f32, dev);
  optim::SGD opt(model->parameters(), optim::SgdOptions{.lr = 1e-4, .momentum = momentum});
  GradScaler scaler(GradScalerOptions{.enabled = m.scaler});
  Backend& b = backend_for(dev);
  DeviceMemory& mem = memory_for(dev);
  std::vector<double> step_ms, scaler_ms, peak;
  for (int s = 0; s < warmup + steps; ++s) {
    mem.synchronize();
    mem.reset_peak_bytes();
    const auto t0 = Clock::now();
    opt.zero_grad();
    Tensor loss;
    {
      autocast ac(dev.type, m.dtype, m.autocasting, true, CastLists::cuda);
      loss = mse_loss((*model)(x), y);
    }
    // The scaler's own work, timed with the device drained around each part: scale(), the
    // read-only inf/NaN check inside step() (timed alone, outside the step, on a copy of the same
    // pass), and update(). step() without unscale_ divides the scale out inside the fused optimizer.
    mem.synchronize();
    auto ts = Clock::now();
    Tensor scaled = scaler.scale(loss);
    mem.synchronize();
    double sc = ms_since(ts);
    scaled.backward();
    scaler.step(opt);
    mem.synchronize();  // else update()'s wait takes in the backward and the step (on a GPU: seen on an H200 as 79 %)
    ts = Clock::now();
    scaler.update();
    mem.synchronize();
    sc += ms_since(ts);
    const double total = ms_since(t0);
    if (m.scaler) {
      Tensor flag = zeros({1}, DType::f32, dev);
      ts = Clock::now();
      b.check_finite(opt.grads(), Tensor(), flag);
      mem.synchronize();
      sc += ms_since(ts);
    }
    if (s >= warmup) {
      step_ms.push_back(total);
      scaler_ms.push_back(sc);
      peak.push_back(static_cast<double>(mem.peak_bytes()) / (1 << 20));  // every live tensor, weights included
    }
  }
  return {median(step_ms), median(scaler_ms), median(peak)};
}

// The GEMMs one step runs, alone: per layer the forward, the weight gradient, and the input
// gradient for every layer but the first (the input needs none). Same shapes and dtypes as the step.
double time_gemms(const Mode& m, int64_t width, int64_t layers, int64_t batch, int warmup, int steps, bool with_first_dx,
                  Device dev) {
  Generator gen(2);
  const DType dt = m.autocasting ? m.dtype : DType::f32;
  const Tensor x = cast(randn({batch, width}, gen, DType::f32, dev), dt), w = cast(randn({width, width}, gen, DType::f32, dev), dt);
  const Tensor g = cast(randn({batch, width}, gen, DType::f32, dev), dt);
  Tensor out = empty({batch, width}, dt, dev), gw = empty({width, width}, dt, dev), gx = empty({batch, width}, dt, dev);
  Backend& b = backend_for(dev);
  DeviceMemory& mem = memory_for(dev);
  std::vector<double> t;
  for (int s = 0; s < warmup + steps; ++s) {
    mem.synchronize();
    const auto t0 = Clock::now();
    for (int64_t l = 0; l < layers; ++l) {
      b.gemm(false, true, 1.0f, x, w, 0.0f, out);
      b.gemm(true, false, 1.0f, g, x, 0.0f, gw);
      if (l > 0 || with_first_dx) b.gemm(false, false, 1.0f, g, w, 0.0f, gx);
    }
    mem.synchronize();
    if (s >= warmup) t.push_back(ms_since(t0));
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t width = 4096, layers = 3, batch = 512;
  int warmup = 1, steps = 3, threads = 0;
  double momentum = 0.0;
  std::string modes_arg = "fp32,fp16,bf16,bf16+scaler,fp16-noscaler";
  std::string device_arg = "cpu";
  po::options_description opts("bench_mlp: step time of the seeds' MLP per precision mode");
  opts.add_options()("help,h", "print this help")
      ("width", po::value(&width)->default_value(width), "hidden width")
      ("layers", po::value(&layers)->default_value(layers), "Linear layers")
      ("batch", po::value(&batch)->default_value(batch), "batch size")
      ("warmup", po::value(&warmup)->default_value(warmup), "untimed steps")
      ("steps", po::value(&steps)->default_value(steps), "timed steps (the median is printed)")
      ("threads", po::value(&threads)->default_value(threads), "CPU threads (0: all cores)")
      ("momentum", po::value(&momentum)->default_value(momentum), "SGD momentum (the seeds' workload: 0)")
      ("device", po::value(&device_arg)->default_value(device_arg), "cpu|cuda")
      ("modes", po::value(&modes_arg)->default_value(modes_arg),
       "comma-separated: fp32, fp16 (with the scaler), fp16-noscaler, bf16, bf16+scaler");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    po::notify(vm);
    if (device_arg != "cpu" && device_arg != "cuda")
      throw po::error("invalid value '" + device_arg + "' for option '--device' (valid: cpu, cuda)");
    if (width < 1 || layers < 1 || batch < 1 || steps < 1 || warmup < 0 || threads < 0)
      throw po::error("--width, --layers, --batch and --steps must be >= 1; --warmup and --threads >= 0");
    if (width > (1 << 20) || batch > (1 << 24) || layers > (1 << 16))  // products stay exact in int64_t
      throw po::error("--width is at most 2^20, --batch 2^24 and --layers 2^16");
    if (!(momentum >= 0.0 && momentum < 1.0)) throw po::error("--momentum must be in [0, 1)");
  } catch (const po::error& e) {
    std::fprintf(stderr, "bench_mlp: error: %s\n", e.what());
    return 2;
  }
  if (vm.count("help")) {
    std::ostringstream os;
    os << opts;
    std::printf("%s", os.str().c_str());
    return 0;
  }
  if (threads > 0) set_num_threads(threads);
  Device dev = kCPU;
  if (device_arg == "cuda") {
    try {
      cuda_init(0);
    } catch (const std::exception& e) {  // no driver or no GPU: a prerequisite, as amp_train's exit 2
      std::fprintf(stderr, "bench_mlp: error: --device cuda: %s\n", e.what());
      return 2;
    }
    dev = Device{DeviceType::cuda, 0};
  }

  const std::vector<Mode> all = {{"fp32", false, DType::f32, false},
                                 {"fp16", true, DType::f16, true},
                                 {"fp16-noscaler", true, DType::f16, false},
                                 {"bf16", true, DType::bf16, false},
                                 {"bf16+scaler", true, DType::bf16, true}};
  std::vector<Mode> modes;
  std::stringstream ss(modes_arg);
  for (std::string tok; std::getline(ss, tok, ',');) {
    auto it = std::find_if(all.begin(), all.end(), [&](const Mode& m) { return m.name == tok; });
    if (it == all.end()) {
      std::fprintf(stderr, "bench_mlp: error: unknown mode '%s' in --modes\n", tok.c_str());
      return 2;
    }
    modes.push_back(*it);
  }
  if (modes.empty()) {  // --modes '' timed nothing and exited 0
    std::fprintf(stderr, "bench_mlp: error: --modes is empty: name at least one mode\n");
    return 2;
  }

  try {
    const double flops = 2.0 * static_cast<double>(batch) * static_cast<double>(width * width) * static_cast<double>(3 * layers - 1);
    std::printf("MLP %lld x %lld, batch %lld, %s, %d thread(s), %d timed steps (median)\n", static_cast<long long>(layers),
                static_cast<long long>(width), static_cast<long long>(batch), dev.str().c_str(), get_num_threads(), steps);
    std::printf("%-14s %10s %9s %11s %11s %10s %9s %9s %9s\n", "mode", "step_ms", "GFLOP/s", "gemms_ms", "step/gemms",
                "9gemms_ms", "scaler_ms", "scaler%", "peak_MiB");
    double fp32_ms = 0;
    for (const Mode& m : modes) {
      const StepFigures f = time_steps(m, width, layers, batch, warmup, steps, momentum, dev);
      const double g = time_gemms(m, width, layers, batch, warmup, steps, false, dev);
      const double g9 = time_gemms(m, width, layers, batch, warmup, steps, true, dev);
      if (m.name == "fp32") fp32_ms = f.step_ms;
      std::printf("%-14s %10.1f %9.1f %11.1f %11.3f %10.1f %9.2f %8.2f%% %9.0f\n", m.name.c_str(), f.step_ms,
                  flops / f.step_ms / 1e6, g, f.step_ms / g, g9, f.scaler_ms, 100.0 * f.scaler_ms / f.step_ms, f.peak_mb);
      if (fp32_ms > 0 && m.name != "fp32") std::printf("%-14s step time / fp32 step time = %.3f\n", "", f.step_ms / fp32_ms);
      std::fflush(stdout);
    }
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "bench_mlp: error: out of memory for an MLP of %lld x %lld at batch %lld: give a smaller "
                 "--width, --batch or --layers\n", static_cast<long long>(layers), static_cast<long long>(width),
                 static_cast<long long>(batch));
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mlp: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
