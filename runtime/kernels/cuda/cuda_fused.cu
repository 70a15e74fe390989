// CUDA backend: fused AMP and optimizer kernels. found_inf, the scale, the scaler state and the step
// count stay on the device: the optimizer kernels read found_inf and return early, the scale update
// is a one-thread kernel, and nothing here waits for the device.
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "runtime/kernels/amp_math.h"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/multi_tensor_apply.cuh"
#include "runtime/kernels/optim_math.h"
#include "runtime/kernels/per_tensor_check.h"

namespace amp::cuda {

namespace {

__device__ __forceinline__ bool skip_requested(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// --- ops and kernels

template <class T>
struct UnscaleOp {
  const float* scale;
  float* found_inf;
  double* block_flags;  // null: not asked for; else 1 or 0 per block (fold_block_flags)
  __device__ void operator()(void* const* p, int64_t begin, int64_t end, int64_t block) const {
    T* g = static_cast<T*>(p[0]);
    const float inv = math::inverse_scale(*scale);
    bool bad = false;
    AMP_MT_LOOP(i, begin, end) {
      const typename DevElem<T>::Compute u = math::unscale_element(DevElem<T>::load(g[i]), inv);
      bad = bad || math::is_nonfinite(u);
      g[i] = DevElem<T>::store(u);
    }
    if (bad) *found_inf = 1.0f;  // every writer stores the same value, so the race is benign
    write_block_flag(block_flags, block, bad);
  }
};

__global__ void update_scale_kernel(float* scale, int64_t* tracker, const float* found_inf, ScaleUpdateHyper h) {
  math::update_scale(scale, tracker, *found_inf, h.growth_factor, h.backoff_factor, h.growth_interval, h.hysteresis,
                     h.min_scale, h.max_scale);
}

// Runs after every launch of a step: the count moves only when the step was taken.
__global__ void step_count_kernel(float* step_count, const float* found_inf) {
  if (!skip_requested(found_inf)) *step_count += 1.0f;
}

// 1 / grad_scale, or 1 when the gradients are already unscaled (nullptr).
__device__ __forceinline__ float grad_inverse_scale(const float* grad_scale) {
  return grad_scale != nullptr ? math::inverse_scale(*grad_scale) : 1.0f;
}

// clip_by_norm's factor for the norm at total_norm, or 1 without clipping (nullptr).
__device__ __forceinline__ float clip_factor(const float* total_norm, float max_norm) {
  return total_norm != nullptr ? math::clip_coefficient(*total_norm, max_norm) : 1.0f;
}

// The parameter's new value into its low-precision copy (element type L; NoCopy: there is none), in
// the slot after the optimizer's own tensors.
template <class L>
__device__ __forceinline__ void store_copy(void* const* p, int slot, int64_t i, float v) {
  if constexpr (!std::is_same_v<L, NoCopy>) static_cast<L*>(p[slot])[i] = DevElem<L>::store(v);
}

template <bool Momentum, class L>
struct SgdOp {
  const float* found_inf;
  const float* step_count;
  const float* grad_scale;  // non-null: the gradients are still scaled
  SgdHyper h;
  const double* lr;         // non-null: replaces h.lr
  const float* clip_norm;   // non-null: clipped by this norm (NormClip)
  float max_norm;
  __device__ void operator()(void* const* p, int64_t begin, int64_t end, int64_t) const {
    if (skip_requested(found_inf)) return;
    const float inv = grad_inverse_scale(grad_scale);
    const float clip = clip_factor(clip_norm, max_norm);
    const bool first = *step_count == 0.0f;
    SgdHyper hl = h;
    if (lr != nullptr) hl.lr = *lr;
    const math::SgdCoef c = math::sgd_coef(hl);
    float* param = static_cast<float*>(p[0]);
    float* grad = static_cast<float*>(p[1]);
    float* buf = Momentum ? static_cast<float*>(p[Momentum ? 2 : 0]) : nullptr;
    AMP_MT_LOOP(i, begin, end) {
      const float g = math::read_gradient(grad[i], inv, clip);
      if ((grad_scale != nullptr || clip_norm != nullptr) && h.keep_unscaled_grads) grad[i] = g;  // as in PyTorch
      math::sgd_update(&param[i], g, Momentum ? &buf[i] : nullptr, first, c);
      store_copy<L>(p, Momentum ? 3 : 2, i, param[i]);
    }
  }
};

template <bool Amsgrad, class L>
struct AdamOp {
  const float* found_inf;
  const float* step_count;
  const float* grad_scale;  // non-null: the gradients are still scaled
  AdamHyper h;
  const double* lr;         // non-null: replaces h.lr
  const float* clip_norm;   // non-null: clipped by this norm (NormClip)
  float max_norm;
  __device__ void operator()(void* const* p, int64_t begin, int64_t end, int64_t) const {
    if (skip_requested(found_inf)) return;
    const float inv = grad_inverse_scale(grad_scale);
    const float clip = clip_factor(clip_norm, max_norm);
    // The fp64 coefficients once per block, as PyTorch computes them once per step on the host.
    AMP_SHARED(math::AdamCoef, c);
    if (threadIdx.x == 0) {
      AdamHyper hl = h;
      if (lr != nullptr) hl.lr = *lr;
      c = math::adam_coef(hl, static_cast<double>(*step_count) + 1.0);
    }
    __syncthreads();
    float* param = static_cast<float*>(p[0]);
    float* grad = static_cast<float*>(p[1]);
    float* m = static_cast<float*>(p[2]);
    float* v = static_cast<float*>(p[3]);
    float* vmax = Amsgrad ? static_cast<float*>(p[Amsgrad ? 4 : 0]) : nullptr;
    AMP_MT_LOOP(i, begin, end) {
      const float g = math::read_gradient(grad[i], inv, clip);
      if ((grad_scale != nullptr || clip_norm != nullptr) && h.keep_unscaled_grads) grad[i] = g;
      math::adam_update(&param[i], g, &m[i], &v[i], Amsgrad ? &vmax[i] : nullptr, c);
      store_copy<L>(p, Amsgrad ? 5 : 4, i, param[i]);
    }
  }
};

// --- launchers

void require_f32(const Tensor& t, const char* what) {
  require_cuda(t, what);
  if (t.dtype() != DType::f32)
    throw std::invalid_argument(std::string(what) + " must be float32, got " + dtype_name(t.dtype()));
}

void require_same_numel(const Tensor& a, const Tensor& b, const char* what) {
  if (a.numel() != b.numel())
    throw std::invalid_argument(std::string(what) + ": " + shape_str(a.shape()) + " and " + shape_str(b.shape()) +
                                " differ in size");
}

const float* optional_flag(const Tensor& found_inf) {
  if (!found_inf.defined()) return nullptr;
  require_f32(found_inf, "found_inf");
  return found_inf.data<float>();
}

// A defined clipped norm: 1-element f32 on the device (the optimizer step reads it when it runs).
const float* optional_norm(const NormClip& clip, const std::vector<Tensor>& params) {
  if (!clip.total_norm.defined()) return nullptr;
  require_cuda(clip.total_norm, "optimizer step: the clipped norm");
  require_device_scalar(clip.total_norm, DType::f32, params.empty() ? clip.total_norm.device() : params[0].device(),
                        "optimizer step: the clipped norm");
  return clip.total_norm.data<float>();
}

// A defined lr: 1-element f64 on the device (the optimizer step reads it when it runs).
const double* optional_lr(const Tensor& lr, const std::vector<Tensor>& params) {
  if (!lr.defined()) return nullptr;
  require_cuda(lr, "optimizer step: lr");
  require_device_scalar(lr, DType::f64, params.empty() ? lr.device() : params[0].device(), "optimizer step: lr");
  return lr.data<double>();
}

// The pointers of lists[0][t], lists[1][t], ... for every t, and the element counts. Every list holds
// float32 tensors, except a last list of low-precision copies when last_is_copies (their dtype was
// checked by low_precision_copies_dtype).
template <int Depth>
void gather(const std::array<const std::vector<Tensor>*, Depth>& lists, std::vector<std::array<void*, Depth>>* ptrs,
            std::vector<int64_t>* numels, bool last_is_copies) {
  const size_t n = lists[0]->size();
  for (int d = 1; d < Depth; ++d)
    if (lists[static_cast<size_t>(d)]->size() < n)
      throw std::invalid_argument("fused optimizer step: a state list is shorter than the parameter list");
  for (size_t t = 0; t < n; ++t) {
    std::array<void*, Depth> row{};
    for (int d = 0; d < Depth; ++d) {
      const Tensor& x = (*lists[static_cast<size_t>(d)])[t];
      if (last_is_copies && d == Depth - 1) require_cuda(x, "low-precision copy");
      else require_f32(x, "optimizer tensor");
      require_same_numel((*lists[0])[t], x, "fused optimizer step");
      row[static_cast<size_t>(d)] = x.data_ptr();
    }
    ptrs->push_back(row);
    numels->push_back((*lists[0])[t].numel());
  }
}

// One fused step over `lists` (float32: parameters, gradients, state), followed by the copies when L
// is not NoCopy.
// cost: per element, without the copies (added here).
template <class L, size_t N, class Op>
void apply_step(const std::array<const std::vector<Tensor>*, N>& lists, const std::vector<Tensor>& copies,
                const Op& op, MtCost cost) {
  constexpr bool kCopies = !std::is_same_v<L, NoCopy>;
  constexpr int Depth = static_cast<int>(N) + (kCopies ? 1 : 0);
  std::array<const std::vector<Tensor>*, Depth> all{};
  for (size_t d = 0; d < N; ++d) all[d] = lists[d];
  if constexpr (kCopies) all[N] = &copies;
  std::vector<std::array<void*, Depth>> ptrs;
  std::vector<int64_t> numels;
  gather<Depth>(all, &ptrs, &numels, kCopies);
  if constexpr (kCopies) cost.written += static_cast<int64_t>(sizeof(L));
  multi_tensor_apply<Depth>(ptrs, numels, op, cost);
}

}  // namespace

void CudaBackend::unscale_and_check(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf,
                                    const Tensor& per_tensor) {
  if (grads.empty()) return;
  check_per_tensor(per_tensor, grads.size());
  require_f32(scale, "scale");
  require_f32(found_inf, "found_inf");
  const DType dt = grads[0].dtype();
  std::vector<std::array<void*, 1>> ptrs;
  std::vector<int64_t> numels;
  for (const Tensor& g : grads) {
    require_cuda(g, "gradient");
    if (g.dtype() != dt)
      throw std::invalid_argument(std::string("unscale_and_check: all gradients of one call must share a dtype, got ") +
                                  dtype_name(dt) + " and " + dtype_name(g.dtype()));
    ptrs.push_back({g.data_ptr()});
    numels.push_back(g.numel());
  }
  // With per_tensor: a flag per block (chunks of kChunkSize), folded per tensor (one dtype: in order).
  std::optional<Scratch> flags;
  if (per_tensor.defined()) {
    require_cuda(per_tensor, "per-tensor flags");
    flags.emplace(sizeof(double) * static_cast<size_t>(std::max<int64_t>(1, block_flag_count(grads))));
  }
  double* block_flags = flags ? flags->as<double>() : nullptr;
  dispatch_float(dt, [&](auto T_tag) { using T = decltype(T_tag);
    multi_tensor_apply<1>(ptrs, numels, UnscaleOp<T>{scale.data<float>(), found_inf.data<float>(), block_flags},
                          MtCost{static_cast<int64_t>(sizeof(T)), static_cast<int64_t>(sizeof(T)), 2, flags ? 8 : 0});
  });
  if (flags) fold_block_flags(grads, block_flags, per_tensor.data<float>());
}

void CudaBackend::update_scale(Tensor& scale, Tensor& tracker, const Tensor& found_inf, const ScaleUpdateHyper& h) {
  require_f32(scale, "scale");
  require_f32(found_inf, "found_inf");
  require_cuda(scale, "scale");
  require_cuda(tracker, "scaler tracker");
  if (tracker.dtype() != DType::i64 || tracker.numel() != 2)
    throw std::invalid_argument("scaler tracker must be int64 [growth_tracker, hysteresis_left]");
  declare_launch_cost(4 + 16 + 4, 4 + 16, 10);
  AMP_LAUNCH(1, 1, 0, context().stream(), update_scale_kernel)(scale.data<float>(), tracker.data<int64_t>(),
                                                               found_inf.data<float>(), h);
  AMP_CUDA_CHECK_LAUNCH();
}

void CudaBackend::sgd_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                           const std::vector<Tensor>& bufs, Tensor& step_count, const SgdHyper& h,
                           const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                           const Tensor& lr, const NormClip& clip) {
  require_f32(step_count, "step count");
  const float* flag = optional_flag(found_inf);
  const double* lr_at = optional_lr(lr, params);
  const float* gs = optional_flag(grad_scale);  // same checks: 1-element f32 on the device
  const float* cn = optional_norm(clip, params);
  const float mx = static_cast<float>(clip.max_norm);
  using Lists2 = std::array<const std::vector<Tensor>*, 2>;
  using Lists3 = std::array<const std::vector<Tensor>*, 3>;
  // float32 parameters, gradients (written back when still scaled and kept) and momentum buffers.
  const int64_t g_written = (gs != nullptr || cn != nullptr) && h.keep_unscaled_grads ? 4 : 0;
  dispatch_copies(low_precision_copies_dtype(params, copies), [&](auto L_tag) { using L = decltype(L_tag);
    if (h.momentum != 0.0f)
      apply_step<L>(Lists3{&params, &grads, &bufs}, copies, SgdOp<true, L>{flag, step_count.data<float>(), gs, h, lr_at, cn, mx},
                    MtCost{12, 8 + g_written, 6});
    else
      apply_step<L>(Lists2{&params, &grads}, copies, SgdOp<false, L>{flag, step_count.data<float>(), gs, h, lr_at, cn, mx},
                    MtCost{8, 4 + g_written, 3});
  });
  declare_launch_cost(8, 4, 1);
  AMP_LAUNCH(1, 1, 0, context().stream(), step_count_kernel)(step_count.data<float>(), flag);
  AMP_CUDA_CHECK_LAUNCH();
}

void CudaBackend::adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                            const std::vector<Tensor>& max_exp_avg_sqs, Tensor& step_count, const AdamHyper& h,
                            const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                            const Tensor& lr, const NormClip& clip) {
  require_f32(step_count, "step count");
  const float* flag = optional_flag(found_inf);
  const double* lr_at = optional_lr(lr, params);
  const float* gs = optional_flag(grad_scale);  // same checks: 1-element f32 on the device
  const float* cn = optional_norm(clip, params);
  const float mx = static_cast<float>(clip.max_norm);
  using Lists4 = std::array<const std::vector<Tensor>*, 4>;
  using Lists5 = std::array<const std::vector<Tensor>*, 5>;
  dispatch_copies(low_precision_copies_dtype(params, copies), [&](auto L_tag) { using L = decltype(L_tag);
    // float32 parameters, gradients (written back when still scaled and kept), moments (and their maximum).
    const int64_t g_written = (gs != nullptr || cn != nullptr) && h.keep_unscaled_grads ? 4 : 0;
    if (h.amsgrad)
      apply_step<L>(Lists5{&params, &grads, &exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs}, copies,
                    AdamOp<true, L>{flag, step_count.data<float>(), gs, h, lr_at, cn, mx}, MtCost{20, 16 + g_written, 16});
    else
      apply_step<L>(Lists4{&params, &grads, &exp_avgs, &exp_avg_sqs}, copies,
                    AdamOp<false, L>{flag, step_count.data<float>(), gs, h, lr_at, cn, mx}, MtCost{16, 12 + g_written, 14});
  });
  declare_launch_cost(8, 4, 1);
  AMP_LAUNCH(1, 1, 0, context().stream(), step_count_kernel)(step_count.data<float>(), flag);
  AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace amp::cuda
