// CPU backend: fused multi-tensor kernels of AMP and the optimizers. Each loops over all tensors of
// one call and applies the shared per-element math (amp_math.h, optim_math.h).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/amp_math.h"
#include "runtime/kernels/cpu/cpu_backend.h"
#include "runtime/kernels/norm_check.h"
#include "runtime/kernels/per_tensor_check.h"
#include "runtime/kernels/cpu/dispatch.h"
#include "runtime/kernels/cpu/stream_casts.h"
#include "runtime/core/dtype_dispatch.h"
#include "runtime/kernels/optim_math.h"

namespace amp {

namespace {
bool skip_requested(const Tensor& found_inf) { return found_inf.defined() && found_inf.data<float>()[0] != 0.0f; }

// The factor a step multiplies each gradient by to clip it (clip_by_norm's), 1 without clipping.
float clip_factor(const NormClip& clip) {
  if (!clip.total_norm.defined()) return 1.0f;
  require_device_scalar(clip.total_norm, DType::f32, kCPU, "optimizer step: the clipped norm");
  return math::clip_coefficient(clip.total_norm.data<float>()[0], static_cast<float>(clip.max_norm));
}

// h, its lr read from lr (1-element f64) when that is defined.
template <class Hyper>
Hyper with_lr(Hyper h, const Tensor& lr) {
  if (!lr.defined()) return h;
  require_device_scalar(lr, DType::f64, kCPU, "optimizer step: lr");
  h.lr = lr.data<double>()[0];
  return h;
}

void require_f32(const Tensor& t, const char* what) {
  if (t.dtype() != DType::f32)
    throw std::invalid_argument(std::string(what) + " must be float32, got " + dtype_name(t.dtype()));
}

// The serial kernels below run on one thread's range (cpu::parallel_chunks); see dispatch.h.

// Unscales d[0, n) in place; returns 1 when any original value was inf or NaN.
template <class T>
AMP_SIMD_CLONES int unscale_range(T* d, long n, float inv) {
  using C = typename Elem<T>::Compute;
  int bad = 0;
  for (long i = 0; i < n; ++i) {
    const C u = math::unscale_element(Elem<T>::load(d[i]), inv);
    bad |= math::is_nonfinite(u) ? 1 : 0;
    d[i] = Elem<T>::store(u);
  }
  return bad;
}

template <class T>
AMP_SIMD_CLONES int nonfinite_range(const T* d, long n, float inv) {
  int bad = 0;
  for (long i = 0; i < n; ++i) bad |= math::unscaled_is_nonfinite(Elem<T>::load(d[i]), inv) ? 1 : 0;
  return bad;
}

// Parameters, gradients, optimizer state and the parameters' low-precision copies are distinct
// tensors: the pointers never alias. The flags that decide which arrays are written are template
// arguments, so that the loop body has no conditional store and vectorises; the rest of the math's
// branches become selects. The copies (element type L; NoCopy: none) are written block by block,
// right after the block's update, while it is in the L1 cache: a loop of their own, because the
// rounding's NaN branch keeps the update's loop from vectorising when the two are one loop.
constexpr long kCopyBlock = 1024;

template <class L>
inline void store_copies(const float* __restrict p, L* __restrict lp, long n) {
  if constexpr (!std::is_same_v<L, NoCopy>) {
    // Not read again before the next forward, by which time they would have left the cache.
    if constexpr (std::is_same_v<L, BFloat16>)
      if (cpu::stream_to_bf16(p, lp, n)) return;
    for (long i = 0; i < n; ++i) lp[i] = Elem<L>::store(p[i]);  // cast()'s rounding (nearest even)
  }
}

// Plain: the common case, without nesterov or maximize, with a momentum buffer that exists (not the
// first step); Decay: a weight decay. Fixing those makes the update's remaining branches few enough
// for GCC to unswitch them all and vectorise (with all five left to the run time it stops
// unswitching and the loop stays scalar).
template <bool Momentum, bool Store, bool Plain, bool Decay, class L>
AMP_SIMD_CLONES void sgd_range(float* __restrict p, float* __restrict g, float* __restrict b, L* __restrict lp, long n,
                               float inv, float clip, bool first, math::SgdCoef c) {
  if constexpr (!Momentum) c.momentum = 0.0f;  // as it is whenever there is no buffer
  if constexpr (!Decay) c.weight_decay = 0.0f;
  if constexpr (Plain) c.nesterov = c.maximize = first = false;
  for (long b0 = 0; b0 < n; b0 += kCopyBlock) {
    const long e = std::min(n, b0 + kCopyBlock);
    for (long i = b0; i < e; ++i) {
      const float gi = math::read_gradient(g[i], inv, clip);
      if constexpr (Store) g[i] = gi;  // the gradient read is written back, as PyTorch's fused kernels do
      math::sgd_update(&p[i], gi, Momentum ? &b[i] : nullptr, first, c);
    }
    if constexpr (!std::is_same_v<L, NoCopy>) store_copies(p + b0, lp + b0, e - b0);
  }
  if constexpr (!std::is_same_v<L, NoCopy>) cpu::stream_fence();
}

template <bool Amsgrad, bool Store, class L>
AMP_SIMD_CLONES void adam_range(float* __restrict p, float* __restrict g, float* __restrict m, float* __restrict v,
                                float* __restrict vmax, L* __restrict lp, long n, float inv, float clip,
                                math::AdamCoef c) {
  c.amsgrad = Amsgrad;
  for (long b0 = 0; b0 < n; b0 += kCopyBlock) {
    const long e = std::min(n, b0 + kCopyBlock);
    for (long i = b0; i < e; ++i) {
      const float gi = math::read_gradient(g[i], inv, clip);
      if constexpr (Store) g[i] = gi;
      math::adam_update(&p[i], gi, &m[i], &v[i], Amsgrad ? &vmax[i] : nullptr, c);
    }
    if constexpr (!std::is_same_v<L, NoCopy>) store_copies(p + b0, lp + b0, e - b0);
  }
  if constexpr (!std::is_same_v<L, NoCopy>) cpu::stream_fence();
}

// The loop both optimizer steps share: for each parameter t (fp32, as its gradient), each thread's
// range [i, i + n) of it, with `lp` the range's low-precision copies (null when there are none):
// range(t, i, n, lp), L the copies' element type (NoCopy: none).
template <class Range>
void for_each_parameter_range(const char* param_name, const char* grad_name, const std::vector<Tensor>& params,
                              const std::vector<Tensor>& grads, const std::vector<Tensor>& copies, Range&& range) {
  dispatch_copies(low_precision_copies_dtype(params, copies), [&](auto L_tag) { using L = decltype(L_tag);
    for (size_t t = 0; t < params.size(); ++t) {
      require_f32(params[t], param_name);
      require_f32(grads[t], grad_name);
      L* lp = nullptr;
      if constexpr (!std::is_same_v<L, NoCopy>) lp = copies[t].data<L>();
      cpu::parallel_chunks(static_cast<long>(params[t].numel()),
                           [&](long i, long e) { range(t, i, e - i, lp ? lp + i : lp); });
    }
  });
}

// Sum of norm_term(|x|, p) over x[0, n) (cpu::lane_sum: the same from every clone).
template <class T>
AMP_SIMD_CLONES double norm_range(const T* x, long n, double p) {
  auto at = [x](long i) { return static_cast<double>(Elem<T>::load(x[i])); };
  if (p == 2.0) return cpu::lane_sum(n, [&](long i) { return at(i) * at(i); });  // without norm_term's dispatch on p
  return cpu::lane_sum(n, [&](long i) { return math::norm_term(std::fabs(at(i)), p); });
}

// norm_range's p = 2 over x unscaled as unscale_and_check stores it (inv 1: x itself, the same sum).
template <class T>
AMP_SIMD_CLONES double unscaled_squares_range(const T* x, long n, float inv) {
  auto at = [x, inv](long i) {
    return static_cast<double>(Elem<T>::load(Elem<T>::store(math::unscale_element(Elem<T>::load(x[i]), inv))));
  };
  return cpu::lane_sum(n, [&](long i) { return at(i) * at(i); });
}
}  // namespace

void CpuBackend::unscale_and_check(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf,
                                   const Tensor& per_tensor) {
  if (grads.empty()) return;
  check_per_tensor(per_tensor, grads.size());
  const DType dt = grads[0].dtype();
  for (const Tensor& g : grads)
    if (g.dtype() != dt)
      throw std::invalid_argument(std::string("unscale_and_check: all gradients of one call must share a dtype, got ") +
                                  dtype_name(dt) + " and " + dtype_name(g.dtype()));
  const float inv = math::inverse_scale(scale.data<float>()[0]);
  bool any = false;
  cpu::dispatch_float(dt, [&](auto T_tag) {
    using T = decltype(T_tag);
    for (size_t i = 0; i < grads.size(); ++i) {
      T* d = grads[i].data<T>();
      int bad = 0;
      cpu::parallel_chunks(static_cast<long>(grads[i].numel()), [&](long b, long e) {
        const int found = unscale_range(d + b, e - b, inv);
#pragma omp atomic
        bad |= found;
      });
      any = any || bad != 0;
      if (bad != 0 && per_tensor.defined()) per_tensor.data<float>()[i] = 1.0f;
    }
  });
  if (any) found_inf.data<float>()[0] = 1.0f;
}

void CpuBackend::check_finite(const std::vector<Tensor>& xs, const Tensor& scale, Tensor& found_inf,
                              const Tensor& per_tensor) {
  check_per_tensor(per_tensor, xs.size());
  const float inv = scale.defined() ? math::inverse_scale(scale.data<float>()[0]) : 1.0f;
  bool any = false;
  for (size_t i = 0; i < xs.size(); ++i) {
    int bad = 0;
    cpu::dispatch_float(xs[i].dtype(), [&](auto T_tag) {
      using T = decltype(T_tag);
      const T* d = xs[i].data<T>();
      cpu::parallel_chunks(static_cast<long>(xs[i].numel()), [&](long b, long e) {
        const int found = nonfinite_range(d + b, e - b, inv);
#pragma omp atomic
        bad |= found;
      });
    });
    any = any || bad != 0;
    if (bad != 0 && per_tensor.defined()) per_tensor.data<float>()[i] = 1.0f;
  }
  if (any) found_inf.data<float>()[0] = 1.0f;
}

void CpuBackend::nonfinite_flags_if_found(const std::vector<Tensor>& xs, const Tensor& scale, const Tensor& found_inf,
                                          const Tensor& per_tensor) {
  if (!found_inf.defined() || found_inf.dtype() != DType::f32 || found_inf.numel() != 1 || !found_inf.device().is_cpu())
    throw std::invalid_argument("nonfinite_flags_if_found: found_inf must be a 1-element float32 tensor on the CPU");
  check_per_tensor(per_tensor, xs.size());
  if (found_inf.data<float>()[0] == 0.0f || !per_tensor.defined()) return;
  Tensor found = found_inf;
  check_finite(xs, scale, found, per_tensor);
}

void CpuBackend::update_scale(Tensor& scale, Tensor& tracker, const Tensor& found_inf, const ScaleUpdateHyper& h) {
  require_f32(scale, "scale");
  if (tracker.dtype() != DType::i64 || tracker.numel() != 2)
    throw std::invalid_argument("scaler tracker must be int64 [growth_tracker, hysteresis_left]");
  math::update_scale(scale.data<float>(), tracker.data<int64_t>(), found_inf.data<float>()[0], h.growth_factor,
                     h.backoff_factor, h.growth_interval, h.hysteresis, h.min_scale, h.max_scale);
}

void CpuBackend::sgd_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                          const std::vector<Tensor>& bufs, Tensor& step_count, const SgdHyper& h,
                          const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                          const Tensor& lr, const NormClip& clip) {
  if (skip_requested(found_inf)) return;
  const float inv = grad_scale.defined() ? math::inverse_scale(grad_scale.data<float>()[0]) : 1.0f;
  const float factor = clip_factor(clip);
  const bool first = step_count.data<float>()[0] == 0.0f;
  const math::SgdCoef c = math::sgd_coef(with_lr(h, lr));
  const bool plain = h.momentum != 0.0 && !h.nesterov && !h.maximize && !first;
  const bool decay = h.weight_decay != 0.0;
  const bool store = (grad_scale.defined() || clip.total_norm.defined()) && h.keep_unscaled_grads;
  auto range = [&](size_t t, long i, long n, auto* lp) {
    float* b = h.momentum != 0.0 ? bufs[t].data<float>() + i : nullptr;
    cpu::with_flags(
        [&](auto momentum, auto store_grad, auto plain_case, auto decay_case) {
          sgd_range<momentum.value, store_grad.value, plain_case.value, decay_case.value>(
              params[t].data<float>() + i, grads[t].data<float>() + i, b, lp, n, inv, factor, first, c);
        },
        b != nullptr, store, plain, decay);
  };
  for_each_parameter_range("SGD parameter", "SGD gradient", params, grads, copies, range);
  step_count.data<float>()[0] += 1.0f;
}

void CpuBackend::adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                           const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                           const std::vector<Tensor>& max_exp_avg_sqs, Tensor& step_count, const AdamHyper& h,
                           const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                           const Tensor& lr, const NormClip& clip) {
  if (skip_requested(found_inf)) return;
  const float inv = grad_scale.defined() ? math::inverse_scale(grad_scale.data<float>()[0]) : 1.0f;
  const float factor = clip_factor(clip);
  const float step = step_count.data<float>()[0] + 1.0f;
  const math::AdamCoef c = math::adam_coef(with_lr(h, lr), step);
  const bool store = (grad_scale.defined() || clip.total_norm.defined()) && h.keep_unscaled_grads;
  auto range = [&](size_t t, long i, long n, auto* lp) {
    float* vmax = h.amsgrad ? max_exp_avg_sqs[t].data<float>() + i : nullptr;
    cpu::with_flags(
        [&](auto amsgrad, auto store_grad) {
          adam_range<amsgrad.value, store_grad.value>(params[t].data<float>() + i, grads[t].data<float>() + i,
                                                      exp_avgs[t].data<float>() + i, exp_avg_sqs[t].data<float>() + i,
                                                      vmax, lp, n, inv, factor, c);
        },
        vmax != nullptr, store);
  };
  for_each_parameter_range("Adam parameter", "Adam gradient", params, grads, copies, range);
  step_count.data<float>()[0] = step;
}

namespace {
// One tensor folded into acc: acc += sum |x|^p, or acc = max (min for p = -inf) of acc and |x|, a
// NaN winning.
void fold_norm(const Tensor& x, double p, double& acc) {
  const bool extremum = std::isinf(p);
  const bool lowest = extremum && p < 0.0;  // p = -inf: the smallest |x|
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    const T* d = x.data<T>();
    const long n = static_cast<long>(x.numel());
    if (extremum) {
      // NaN is tracked apart: OpenMP's max and min reductions would drop it when combining threads.
      double mx = 0.0, mn = INFINITY;
      bool nan = false;
#pragma omp parallel for schedule(static) reduction(max : mx) reduction(min : mn) reduction(|| : nan) if (n > cpu::kParallelGrain)
      for (long i = 0; i < n; ++i) {
        const double a = std::fabs(static_cast<double>(Elem<T>::load(d[i])));
        nan = nan || std::isnan(a);
        mx = a > mx ? a : mx;
        mn = a < mn ? a : mn;
      }
      acc = (nan || std::isnan(acc)) ? NAN : lowest ? std::min(acc, mn) : std::max(acc, mx);
    } else {
      acc += cpu::sum_of_chunks(n, [&](long b, long e) { return norm_range(d + b, e - b, p); });
    }
  });
}

// acc into an f32 slot: stored for a max or min (acc started from the slot), added for a sum.
void store_norm(double p, double acc, float& slot) {
  if (std::isinf(p)) slot = static_cast<float>(acc);
  else slot += static_cast<float>(acc);
}
}  // namespace

void CpuBackend::norm_accumulate(const std::vector<Tensor>& xs, double p, Tensor& out) {
  double acc = std::isinf(p) ? static_cast<double>(out.data<float>()[0]) : 0.0;
  for (const Tensor& x : xs) fold_norm(x, p, acc);
  store_norm(p, acc, out.data<float>()[0]);
}

void CpuBackend::norm_accumulate_each(const std::vector<Tensor>& xs, double p, Tensor& out) {
  check_norms_output(xs, out);
  float* slots = out.data<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    double acc = std::isinf(p) ? static_cast<double>(slots[i]) : 0.0;
    fold_norm(xs[i], p, acc);
    store_norm(p, acc, slots[i]);
  }
}

// Each chunk's sum is norm_accumulate_each's on the chunk's view (unscaled), bit for bit: a chunk
// below the parallel grain is one lane sum (unscaled_squares_range, norm_range's p = 2), added to 0.0
// (and to the other threads' zero partials there). found_inf: a chunk holds an element that is not
// finite unscaled exactly when its sum is not finite (squares of finite floats, halves or bfloat16s
// cannot reach double's overflow; an inf or NaN makes the sum inf or NaN), and then the chunk is read
// again by check_finite's test, which also decides for double elements.
void CpuBackend::chunk_sums_of_squares(const Tensor& x, int64_t chunk, Tensor& out, const Tensor& scale,
                                       const Tensor& found_inf) {
  if (chunk < 1 || chunk > cpu::kParallelGrain) throw std::invalid_argument("chunk_sums_of_squares: a chunk of " + std::to_string(chunk));
  const long n = static_cast<long>(x.numel()), c = static_cast<long>(chunk), chunks = (n + c - 1) / c;
  if (out.dtype() != DType::f32 || out.numel() != chunks)
    throw std::invalid_argument("chunk_sums_of_squares: expected float32 out of " + std::to_string(chunks) + " elements");
  if (scale.defined() && (scale.dtype() != DType::f32 || scale.numel() != 1 || !scale.device().is_cpu()))
    throw std::invalid_argument("chunk_sums_of_squares: scale must be a 1-element float32 tensor on the CPU");
  if (found_inf.defined() && (found_inf.dtype() != DType::f32 || found_inf.numel() != 1 || !found_inf.device().is_cpu()))
    throw std::invalid_argument("chunk_sums_of_squares: found_inf must be a 1-element float32 tensor on the CPU");
  const float inv = scale.defined() ? math::inverse_scale(scale.data<float>()[0]) : 1.0f;
  float* o = out.data<float>();
  int bad = 0;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    const T* d = x.data<T>();
    cpu::parallel_chunks(chunks, [&](long b, long e) {
      int found = 0;
      for (long k = b; k < e; ++k) {
        const long len = std::min(c, n - k * c);
        const double sum = unscaled_squares_range(d + k * c, len, inv);
        o[k] += static_cast<float>(0.0 + sum);
        if (found_inf.defined() && !std::isfinite(sum)) found |= nonfinite_range(d + k * c, len, inv);
      }
#pragma omp atomic
      bad |= found;
    }, std::max(1L, cpu::kParallelGrain / c));
  });
  if (bad != 0 && found_inf.defined()) found_inf.data<float>()[0] = 1.0f;
}

void CpuBackend::clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) {
  const float coef = math::clip_coefficient(total_norm.data<float>()[0], static_cast<float>(max_norm));
  for (const Tensor& x : xs) {
    Tensor t = x;
    unary(UnaryOp::mul_scalar, t, t, coef);
  }
}

void CpuBackend::clamp(const std::vector<Tensor>& xs, double lo, double hi) {
  for (const Tensor& x : xs) {
    cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
      using C = typename Elem<T>::Compute;
      T* d = x.data<T>();
      const long n = static_cast<long>(x.numel());
      const C l = static_cast<C>(lo), hh = static_cast<C>(hi);
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
      for (long i = 0; i < n; ++i) d[i] = Elem<T>::store(std::min(std::max(static_cast<C>(Elem<T>::load(d[i])), l), hh));
    });
  }
}

}  // namespace amp
