// The emulated GPU's stand-in for cuDNN's fused attention (runtime/kernels/cuda/cudnn_sdpa.h, the
// seam the CUDA backend calls): exact causal attention in double, each result rounded once to float
// and then to the tensors' dtype, enqueued as one operation on the stream as the library's kernels
// are, so that a CUDA graph captures it and the launch log prices it (op "cudnn"). Deterministic by
// construction. The backward asks for a workspace (each row's dO . O, as cuDNN's backward keeps it)
// and uses it, so the backend's workspace from its allocator is exercised.
//
// AMP_EMU_CUDNN=0 makes the library absent, for the tests of --attention auto's fallback and of
// --attention cudnn's refusal.
#include "runtime/kernels/cuda/cudnn_sdpa.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "device.h"
#include "emu.h"
#include "launch_log.h"
#include "runtime/core/half.h"

namespace amp::cudnn_sdpa {
namespace {

bool switched_off() {
  const char* v = std::getenv("AMP_EMU_CUDNN");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

double load(DType t, const void* p, int64_t i) {
  const uint16_t b = static_cast<const uint16_t*>(p)[i];
  return t == DType::bf16 ? bf16_bits_to_f32(b) : f16_bits_to_f32(b);
}
void store(DType t, void* p, int64_t i, double v) {
  const float f = static_cast<float>(v);
  static_cast<uint16_t*>(p)[i] = t == DType::bf16 ? f32_to_bf16_bits(f) : f32_to_f16_bits(f);
}

// Element d of row t's head h of part (0 q, 1 k, 2 v) of sample b in a [B, T, 3C] tensor.
struct Qkv {
  const Shape& s;
  int64_t at(int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) const {
    const int64_t C = s.H * s.D;
    return (b * s.T + t) * 3 * C + part * C + h * s.D + d;
  }
  int64_t out(int64_t b, int64_t t, int64_t h, int64_t d) const { return (b * s.T + t) * s.H * s.D + h * s.D + d; }
};

void check(const Shape& s, const char* what, const void* p, int64_t bytes) {
  if (p == nullptr || !emu::is_device_range(p, static_cast<size_t>(bytes)))
    throw std::invalid_argument(std::string("cuDNN (emulated): ") + what + " is not " + std::to_string(bytes) +
                                " bytes of device memory (B " + std::to_string(s.B) + ", T " + std::to_string(s.T) + ")");
}

// Logs one operation (the cost model prices op "cudnn" at the library's measured rate) and
// enqueues body, which the dry run does not run.
void submit(const char* name, const Shape& s, cudaStream_t stream, int64_t read, int64_t written, int64_t flops,
            std::function<void()> body) {
  if (emu::launch_log_on())
    emu::log_line("cudnn",
                  std::string(",\"name\":\"") + name + "\",\"B\":" + std::to_string(s.B) + ",\"T\":" + std::to_string(s.T) +
                      ",\"H\":" + std::to_string(s.H) + ",\"D\":" + std::to_string(s.D) + ",\"read\":" +
                      std::to_string(read) + ",\"written\":" + std::to_string(written) + ",\"flops\":" + std::to_string(flops),
                  stream);
  std::function<bool()> step = [] { return true; };
  if (!emu::dry_run()) step = [body = std::move(body)] {
      body();
      return true;
    };
  const cudaError_t e = emu::enqueue(stream, emu::Op{name, std::move(step)});
  if (e != cudaSuccess) throw std::runtime_error(std::string("cuDNN (emulated): ") + name + ": " + cudaGetErrorString(e));
  emu::count_launch(stream);
}

int64_t causal_pairs(const Shape& s) { return s.B * s.H * s.T * (s.T + 1) / 2; }

}  // namespace

std::string unavailable(DType dtype, int64_t head_dim) {
  if (switched_off()) return "libcudnn.so.9 was not found (the emulated GPU's stand-in is off: AMP_EMU_CUDNN=0)";
  return unsupported_shape(dtype, head_dim);
}

std::string describe() {
  return switched_off() ? "no cuDNN (the emulated GPU's stand-in is off: AMP_EMU_CUDNN=0)"
                        : "cuDNN stand-in (the emulated GPU: exact attention in double)";
}

size_t forward_workspace(const Shape&) { return 0; }
size_t backward_workspace(const Shape& s) { return static_cast<size_t>(s.B * s.H * s.T) * sizeof(float); }

void forward(const Shape& s, cudaStream_t stream, const void* qkv, void* y, float* stats, void*) {
  const int64_t C = s.H * s.D, rows = s.B * s.T;
  check(s, "qkv", qkv, rows * 3 * C * 2);
  check(s, "y", y, rows * C * 2);
  check(s, "stats", stats, s.B * s.H * s.T * 4);
  submit("cudnn_sdpa_forward", s, stream, rows * 3 * C * 2, rows * C * 2 + s.B * s.H * s.T * 4,
         4 * causal_pairs(s) * s.D, [s, qkv, y, stats] {
           const Qkv at{s};
           std::vector<double> p(static_cast<size_t>(s.T));
           for (int64_t b = 0; b < s.B; ++b)
             for (int64_t h = 0; h < s.H; ++h)
               for (int64_t i = 0; i < s.T; ++i) {
                 double m = -INFINITY;
                 for (int64_t j = 0; j <= i; ++j) {
                   double dot = 0.0;
                   for (int64_t d = 0; d < s.D; ++d)
                     dot += load(s.dtype, qkv, at.at(b, i, 0, h, d)) * load(s.dtype, qkv, at.at(b, j, 1, h, d));
                   p[static_cast<size_t>(j)] = s.scale * dot;
                   m = std::max(m, p[static_cast<size_t>(j)]);
                 }
                 double l = 0.0;
                 for (int64_t j = 0; j <= i; ++j) l += std::exp(p[static_cast<size_t>(j)] - m);
                 stats[(b * s.H + h) * s.T + i] = static_cast<float>(m + std::log(l));
                 for (int64_t d = 0; d < s.D; ++d) {
                   double acc = 0.0;
                   for (int64_t j = 0; j <= i; ++j)
                     acc += std::exp(p[static_cast<size_t>(j)] - m) * load(s.dtype, qkv, at.at(b, j, 2, h, d));
                   store(s.dtype, y, at.out(b, i, h, d), acc / l);
                 }
               }
         });
}

void backward(const Shape& s, cudaStream_t stream, const void* qkv, const void* y, const void* gy, const float* stats,
              void* dqkv, void* workspace) {
  const int64_t C = s.H * s.D, rows = s.B * s.T;
  check(s, "qkv", qkv, rows * 3 * C * 2);
  check(s, "y", y, rows * C * 2);
  check(s, "gy", gy, rows * C * 2);
  check(s, "stats", stats, s.B * s.H * s.T * 4);
  check(s, "dqkv", dqkv, rows * 3 * C * 2);
  check(s, "workspace", workspace, static_cast<int64_t>(backward_workspace(s)));
  submit("cudnn_sdpa_backward", s, stream, rows * (3 * C + 2 * C) * 2 + s.B * s.H * s.T * 4, rows * 3 * C * 2,
         10 * causal_pairs(s) * s.D, [s, qkv, y, gy, stats, dqkv, workspace] {
           const Qkv at{s};
           float* delta = static_cast<float*>(workspace);
           const auto P = [&](int64_t b, int64_t h, int64_t i, int64_t j) {  // softmax from the forward's stats
             double dot = 0.0;
             for (int64_t d = 0; d < s.D; ++d)
               dot += load(s.dtype, qkv, at.at(b, i, 0, h, d)) * load(s.dtype, qkv, at.at(b, j, 1, h, d));
             return std::exp(s.scale * dot - static_cast<double>(stats[(b * s.H + h) * s.T + i]));
           };
           const size_t TD = static_cast<size_t>(s.T * s.D);
           std::vector<double> dq(TD), dk(TD), dv(TD);
           for (int64_t b = 0; b < s.B; ++b)
             for (int64_t h = 0; h < s.H; ++h) {
               std::fill(dq.begin(), dq.end(), 0.0);
               std::fill(dk.begin(), dk.end(), 0.0);
               std::fill(dv.begin(), dv.end(), 0.0);
               for (int64_t i = 0; i < s.T; ++i) {
                 double dd = 0.0;
                 for (int64_t d = 0; d < s.D; ++d)
                   dd += load(s.dtype, gy, at.out(b, i, h, d)) * load(s.dtype, y, at.out(b, i, h, d));
                 delta[(b * s.H + h) * s.T + i] = static_cast<float>(dd);
               }
               for (int64_t i = 0; i < s.T; ++i)
                 for (int64_t j = 0; j <= i; ++j) {
                   const double p = P(b, h, i, j);
                   double dp = 0.0;
                   for (int64_t d = 0; d < s.D; ++d)
                     dp += load(s.dtype, gy, at.out(b, i, h, d)) * load(s.dtype, qkv, at.at(b, j, 2, h, d));
                   const double ds = p * (dp - static_cast<double>(delta[(b * s.H + h) * s.T + i])) * s.scale;
                   for (int64_t d = 0; d < s.D; ++d) {
                     const size_t id = static_cast<size_t>(i * s.D + d), jd = static_cast<size_t>(j * s.D + d);
                     dq[id] += ds * load(s.dtype, qkv, at.at(b, j, 1, h, d));
                     dk[jd] += ds * load(s.dtype, qkv, at.at(b, i, 0, h, d));
                     dv[jd] += p * load(s.dtype, gy, at.out(b, i, h, d));
                   }
                 }
               for (int64_t t = 0; t < s.T; ++t)
                 for (int64_t d = 0; d < s.D; ++d) {
                   const size_t td = static_cast<size_t>(t * s.D + d);
                   store(s.dtype, dqkv, at.at(b, t, 0, h, d), dq[td]);
                   store(s.dtype, dqkv, at.at(b, t, 1, h, d), dk[td]);
                   store(s.dtype, dqkv, at.at(b, t, 2, h, d), dv[td]);
                 }
             }
         });
}

}  // namespace amp::cudnn_sdpa
