// CUDA backend: multi-tensor norms, clipping by norm and clamping, for gradient clipping. The norm
// never leaves the device: clip_by_norm reads it there.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <stdexcept>
#include <utility>
#include <vector>

#include "runtime/kernels/amp_math.h"
#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/multi_tensor_apply.cuh"
#include "runtime/kernels/norm_check.h"
#include "runtime/kernels/per_tensor_check.h"

namespace amp::cuda {

namespace {

// The CPU's max for the inf-norm (min for -inf): a NaN anywhere wins, so a NaN gradient gives a NaN norm.
struct NanMaxOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return (b > a || isnan(b)) ? b : a; }
};
struct NanMinOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return (b < a || isnan(b)) ? b : a; }
};

enum class NormKind { sum, max, min };

// --- ops and kernels

__device__ __forceinline__ double norm_fold(NormKind k, double acc, double v) {
  return k == NormKind::max ? NanMaxOp{}(acc, v) : k == NormKind::min ? NanMinOp{}(acc, v) : acc + v;
}
__device__ __forceinline__ double norm_block_reduce(NormKind k, double v) {
  return k == NormKind::max ? block_reduce(v, NanMaxOp{}) : k == NormKind::min ? block_reduce(v, NanMinOp{})
                                                                                : block_reduce(v, SumOp{});
}
__device__ __forceinline__ double norm_identity(NormKind k) {
  return k == NormKind::max ? -INFINITY : k == NormKind::min ? INFINITY : 0.0;
}

template <class T>
struct NormOp {
  double p;
  NormKind kind;
  double* partial;  // one slot per block of this dtype group
  __device__ void operator()(void* const* ptrs, int64_t begin, int64_t end, int64_t block) const {
    const T* x = static_cast<const T*>(ptrs[0]);
    double acc = norm_identity(kind);
    AMP_MT_LOOP(i, begin, end) {
      const double a = fabs(static_cast<double>(DevElem<T>::load(x[i])));
      acc = norm_fold(kind, acc, kind == NormKind::sum ? math::norm_term(a, p) : a);
    }
    acc = norm_block_reduce(kind, acc);
    if (threadIdx.x == 0) partial[block] = acc;
  }
};

// One block per chunk of x: out[k] += the sum of squares of x's chunk k, in double (the gradient
// norm's fixed chunks, comm/chunked_norm.h). scale (null: 1): each element is first unscaled as
// UnscaleOp would store it, so the sums are those of the unscaled x. found_inf (null: not asked):
// set to 1 where an element is not finite unscaled, CheckFiniteOp's test, in the same read.
template <class T>
__global__ void chunk_squares_kernel(const T* __restrict__ x, int64_t n, int64_t chunk, const float* __restrict__ scale,
                                     float* __restrict__ out, float* found_inf) {
  const int64_t k = blockIdx.x, begin = k * chunk, end = begin + chunk < n ? begin + chunk : n;
  const float inv = scale != nullptr ? math::inverse_scale(*scale) : 1.0f;
  double acc = 0.0;
  bool bad = false;
  for (int64_t i = begin + static_cast<int64_t>(threadIdx.x); i < end; i += blockDim.x) {
    const auto v = DevElem<T>::load(x[i]);
    bad |= math::unscaled_is_nonfinite(v, inv);
    const T u = DevElem<T>::store(math::unscale_element(v, inv));
    const double a = static_cast<double>(DevElem<T>::load(u));
    acc += a * a;
  }
  if (bad && found_inf != nullptr) *found_inf = 1.0f;  // every writer stores the same value
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) out[k] += static_cast<float>(acc);
}

// chunk_squares_kernel<float> over a vector that is not stored: up to kGatherPieces pieces, piece j
// holding the vector's elements [begin[j], end[j]) (ascending, apart), zeros elsewhere. Block k sums
// chunk first_chunk + k; each thread reads the elements the flat kernel's thread reads, in the same
// order, and adds the same squares (0 where no piece lies), so the sums are that kernel's, bit for bit.
inline constexpr int kGatherPieces = 128;
struct GatherPieces {
  const float* ptr[kGatherPieces];
  int64_t begin[kGatherPieces], end[kGatherPieces];
  int count;
};
__global__ void chunk_squares_gather_kernel(GatherPieces p, int64_t first_chunk, int64_t n, int64_t chunk,
                                            const float* __restrict__ scale, float* __restrict__ out, float* found_inf) {
  const int64_t k = first_chunk + blockIdx.x, begin = k * chunk, end = begin + chunk < n ? begin + chunk : n;
  const float inv = scale != nullptr ? math::inverse_scale(*scale) : 1.0f;
  double acc = 0.0;
  bool bad = false;
  int j = 0;  // the first piece that ends after i (i only grows)
  for (int64_t i = begin + static_cast<int64_t>(threadIdx.x); i < end; i += blockDim.x) {
    while (j < p.count && p.end[j] <= i) ++j;
    const float x = j < p.count && p.begin[j] <= i ? p.ptr[j][i - p.begin[j]] : 0.0f;
    bad |= math::unscaled_is_nonfinite(DevElem<float>::load(x), inv);
    const float u = DevElem<float>::store(math::unscale_element(DevElem<float>::load(x), inv));
    const double a = static_cast<double>(DevElem<float>::load(u));
    acc += a * a;
  }
  if (bad && found_inf != nullptr) *found_inf = 1.0f;
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) out[blockIdx.x] += static_cast<float>(acc);
}

// Block b folds the partials [r.begin[b], r.end[b]) in a fixed order into out[b], as the CPU does:
// out = max(out, norm) for the inf-norm (min for -inf), out += sum otherwise. One block for
// norm_accumulate; one per tensor, kFinishSlots a launch, for norm_accumulate_each.
inline constexpr int kFinishSlots = 256;
struct FinishRanges {
  int32_t begin[kFinishSlots], end[kFinishSlots];
};
__global__ void __launch_bounds__(1024) norm_finish_kernel(const double* partial, FinishRanges r, NormKind kind, float* out) {
  const int b = static_cast<int>(blockIdx.x);
  // out enters the fold once, through thread 0.
  double acc = kind != NormKind::sum && threadIdx.x == 0 ? static_cast<double>(out[b]) : norm_identity(kind);
  for (int64_t i = r.begin[b] + static_cast<int64_t>(threadIdx.x); i < r.end[b]; i += blockDim.x)
    acc = norm_fold(kind, acc, partial[i]);
  acc = norm_block_reduce(kind, acc);
  if (threadIdx.x == 0) {
    if (kind != NormKind::sum) out[b] = static_cast<float>(acc);
    else out[b] += static_cast<float>(acc);
  }
}

template <class T>
struct ClipOp {
  const float* total_norm;
  float max_norm;
  __device__ void operator()(void* const* ptrs, int64_t begin, int64_t end, int64_t) const {
    using C = typename DevElem<T>::Compute;
    // torch.nn.utils.clip_grads_with_norm_'s factor, applied always.
    const C a = static_cast<C>(static_cast<double>(math::clip_coefficient(*total_norm, max_norm)));
    T* x = static_cast<T*>(ptrs[0]);
    AMP_MT_LOOP(i, begin, end) x[i] = DevElem<T>::store(static_cast<C>(DevElem<T>::load(x[i])) * a);
  }
};

template <class T>
struct ClampOp {
  double lo, hi;
  __device__ void operator()(void* const* ptrs, int64_t begin, int64_t end, int64_t) const {
    using C = typename DevElem<T>::Compute;
    const C l = static_cast<C>(lo), h = static_cast<C>(hi);
    T* x = static_cast<T*>(ptrs[0]);
    AMP_MT_LOOP(i, begin, end) {
      const C v = DevElem<T>::load(x[i]);
      const C t = v < l ? l : v;  // std::max(v, l)
      x[i] = DevElem<T>::store(h < t ? h : t);  // std::min(t, h)
    }
  }
};

template <class T>
struct CheckFiniteOp {
  float* found_inf;      // null: only the flags (nonfinite_flags_if_found)
  const float* scale;    // null: 1
  double* block_flags;   // null: not asked for; else 1 or 0 per block (fold_block_flags)
  const float* only_if;  // null: always; else x is read only where *only_if is set (block flag 0 otherwise)
  __device__ void operator()(void* const* p, int64_t begin, int64_t end, int64_t block) const {
    if (only_if != nullptr && *only_if == 0.0f) {  // the same for every thread of the block
      if (threadIdx.x == 0 && block_flags != nullptr) block_flags[block] = 0.0;
      return;
    }
    const T* x = static_cast<const T*>(p[0]);
    const float inv = scale != nullptr ? math::inverse_scale(*scale) : 1.0f;
    bool bad = false;
    AMP_MT_LOOP(i, begin, end) { bad = bad || math::unscaled_is_nonfinite(DevElem<T>::load(x[i]), inv); }
    if (bad && found_inf != nullptr) *found_inf = 1.0f;  // every writer stores the same value, so the race is benign
    write_block_flag(block_flags, block, bad);
  }
};

// --- launchers

void finish_ranges(const double* partial, const std::vector<std::pair<int64_t, int64_t>>& ranges, NormKind kind,
                   float* out) {
  for (size_t b = 0; b < ranges.size(); b += kFinishSlots) {
    const size_t n = std::min(ranges.size() - b, static_cast<size_t>(kFinishSlots));
    FinishRanges r{};
    int64_t folded = 0;
    for (size_t i = 0; i < n; ++i) {
      r.begin[i] = static_cast<int32_t>(ranges[b + i].first);
      r.end[i] = static_cast<int32_t>(ranges[b + i].second);
      folded += ranges[b + i].second - ranges[b + i].first;
    }
    declare_launch_cost(8 * folded + 4 * static_cast<int64_t>(n), 4 * static_cast<int64_t>(n), folded);
    AMP_LAUNCH(static_cast<unsigned>(n), 1024, 0, context().stream(), norm_finish_kernel)(partial, r, kind, out + b);
    AMP_CUDA_CHECK_LAUNCH();
  }
}

// The order in which the multi-tensor ops visit xs: grouped by dtype (f32, f64, f16, bf16), each
// group in xs's order. A tensor of a non-floating dtype is refused (with the CPU backend's message)
// before anything is launched: it would get no block, and a norm's partial slots for its chunks
// would stay unwritten.
std::vector<size_t> dtype_group_order(const std::vector<Tensor>& xs) {
  for (const Tensor& x : xs) {
    require_cuda(x, "tensor of a multi-tensor op");
    if (!is_floating(x.dtype()))
      throw std::invalid_argument(std::string("expected a floating dtype, got ") + dtype_name(x.dtype()));
  }
  std::vector<size_t> order;
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (size_t i = 0; i < xs.size(); ++i)
      if (xs[i].dtype() == dt) order.push_back(i);
  return order;
}

// Calls f(T{}, ptrs, numels) once per dtype present in xs, in dtype_group_order.
template <class F>
void for_each_dtype_group(const std::vector<Tensor>& xs, F&& f) {
  const std::vector<size_t> order = dtype_group_order(xs);
  for (size_t g = 0; g < order.size();) {
    const DType dt = xs[order[g]].dtype();
    std::vector<std::array<void*, 1>> ptrs;
    std::vector<int64_t> numels;
    for (; g < order.size() && xs[order[g]].dtype() == dt; ++g) {
      ptrs.push_back({xs[order[g]].data_ptr()});
      numels.push_back(xs[order[g]].numel());
    }
    dispatch_float(dt, [&](auto T_tag) { f(T_tag, ptrs, numels); });
  }
}

int64_t chunks_of(const Tensor& x) { return (x.numel() + kChunkSize - 1) / kChunkSize; }

// The norm's partial of every chunk of xs into partial (NormOp, in dtype_group_order), then
// out[s] folded from the partials ranges[s] (norm_finish_kernel).
void norm_partials_and_finish(const std::vector<Tensor>& xs, double p, double* partial,
                              const std::vector<std::pair<int64_t, int64_t>>& ranges, float* out) {
  const NormKind kind = !std::isinf(p) ? NormKind::sum : p > 0 ? NormKind::max : NormKind::min;
  int64_t chunks = 0;
  for (const Tensor& x : xs) chunks += chunks_of(x);
  if (chunks > INT32_MAX) throw std::invalid_argument("norm: more than 2^31 chunks");  // the finish's ranges are 32-bit
  int64_t offset = 0;
  for_each_dtype_group(xs, [&](auto T_tag, const auto& ptrs, const std::vector<int64_t>& numels) {
    using T = decltype(T_tag);
    multi_tensor_apply<1>(ptrs, numels, NormOp<T>{p, kind, partial + offset}, MtCost{static_cast<int64_t>(sizeof(T)), 0, 2, 8});
    offset += multi_tensor_block_count(numels, kChunkSize);
  });
  finish_ranges(partial, ranges, kind, out);
}

}  // namespace

void fold_block_flags(const std::vector<Tensor>& xs, const double* block_flags, float* per_tensor) {
  std::vector<std::pair<int64_t, int64_t>> ranges(xs.size());
  int64_t blocks = 0;
  for (size_t i : dtype_group_order(xs)) {
    ranges[i] = {blocks, blocks + chunks_of(xs[i])};
    blocks += chunks_of(xs[i]);
  }
  finish_ranges(block_flags, ranges, NormKind::max, per_tensor);
}

void CudaBackend::norm_accumulate(const std::vector<Tensor>& xs, double p, Tensor& out) {
  require_cuda(out, "norm output");
  if (out.dtype() != DType::f32) throw std::invalid_argument("norm output must be float32");
  std::vector<int64_t> all;
  for (const Tensor& x : xs) all.push_back(x.numel());
  const int64_t blocks = multi_tensor_block_count(all, kChunkSize);
  Scratch partial(sizeof(double) * static_cast<size_t>(blocks > 0 ? blocks : 1));
  norm_partials_and_finish(xs, p, partial.as<double>(), {{0, blocks}}, out.data<float>());
}

void CudaBackend::norm_accumulate_each(const std::vector<Tensor>& xs, double p, Tensor& out) {
  check_norms_output(xs, out);
  if (xs.empty()) return;
  // Tensor i's partials: a contiguous run, where dtype_group_order places it.
  std::vector<std::pair<int64_t, int64_t>> ranges(xs.size());
  int64_t blocks = 0;
  for (size_t i : dtype_group_order(xs)) {
    ranges[i] = {blocks, blocks + chunks_of(xs[i])};
    blocks += chunks_of(xs[i]);
  }
  Scratch partial(sizeof(double) * static_cast<size_t>(blocks > 0 ? blocks : 1));
  norm_partials_and_finish(xs, p, partial.as<double>(), ranges, out.data<float>());
}

namespace {
// found_inf's pointer for the chunk kernels (null: undefined), checked.
float* found_inf_arg(const Tensor& found_inf, const char* what) {
  if (!found_inf.defined()) return nullptr;
  require_cuda(found_inf, what);
  if (found_inf.dtype() != DType::f32 || found_inf.numel() != 1)
    throw std::invalid_argument(std::string(what) + " must be a 1-element float32 tensor");
  return found_inf.data<float>();
}
}  // namespace

void CudaBackend::chunk_sums_of_squares(const Tensor& x, int64_t chunk, Tensor& out, const Tensor& scale,
                                        const Tensor& found_inf) {
  require_cuda(x, "chunk_sums_of_squares: input");
  require_cuda(out, "chunk_sums_of_squares: output");
  if (scale.defined()) {
    require_cuda(scale, "chunk_sums_of_squares: scale");
    if (scale.dtype() != DType::f32 || scale.numel() != 1)
      throw std::invalid_argument("chunk_sums_of_squares: scale must be a 1-element float32 tensor");
  }
  if (chunk < 1) throw std::invalid_argument("chunk_sums_of_squares: a chunk of " + std::to_string(chunk));
  const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
  if (out.dtype() != DType::f32 || out.numel() != chunks)
    throw std::invalid_argument("chunk_sums_of_squares: expected float32 out of " + std::to_string(chunks) + " elements");
  if (chunks == 0) return;
  if (chunks > 0x7fffffff) throw std::invalid_argument("chunk_sums_of_squares: more than 2^31-1 chunks");
  float* found = found_inf_arg(found_inf, "chunk_sums_of_squares: found_inf");
  Context& ctx = context();
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(n * static_cast<int64_t>(sizeof(T)) + chunks * 4 + (scale.defined() ? 4 : 0), chunks * 4,
                        (scale.defined() ? 3 : 2) * n);
    AMP_LAUNCH(static_cast<unsigned>(chunks), 256, 0, ctx.stream(), chunk_squares_kernel<T>)(
        x.data<T>(), n, chunk, scale.defined() ? scale.data<float>() : nullptr, out.data<float>(), found);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

// Launches over runs of chunks whose pieces fit one GatherPieces. A chunk that alone meets more
// pieces than that (pieces of a few elements) goes the default's way alone: its parts of the pieces
// written into a temporary of one chunk, whose sum is the same (each thread reads the same elements
// in the same order, counted from the chunk's start).
void CudaBackend::chunk_sums_of_squares_gathered(const std::vector<Tensor>& pieces, const std::vector<int64_t>& offsets,
                                                 int64_t n, int64_t chunk, Tensor& out, const Tensor& scale,
                                                 const Tensor& found_inf) {
  require_cuda(out, "chunk_sums_of_squares_gathered: output");
  float* found = found_inf_arg(found_inf, "chunk_sums_of_squares_gathered: found_inf");
  check_gathered_pieces(pieces, offsets, n, out);
  if (scale.defined()) {
    require_cuda(scale, "chunk_sums_of_squares_gathered: scale");
    if (scale.dtype() != DType::f32 || scale.numel() != 1)
      throw std::invalid_argument("chunk_sums_of_squares_gathered: scale must be a 1-element float32 tensor");
  }
  if (chunk < 1) throw std::invalid_argument("chunk_sums_of_squares_gathered: a chunk of " + std::to_string(chunk));
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (out.dtype() != DType::f32 || out.numel() != chunks)
    throw std::invalid_argument("chunk_sums_of_squares_gathered: expected float32 out of " + std::to_string(chunks) +
                                " elements");
  if (chunks > 0x7fffffff) throw std::invalid_argument("chunk_sums_of_squares_gathered: more than 2^31-1 chunks");
  // The pieces that hold something; runs of chunks [c0, c1) with the pieces [first, last) they meet.
  std::vector<size_t> held;
  for (size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].numel() > 0) held.push_back(i);
  Context& ctx = context();
  size_t first = 0;
  for (int64_t c0 = 0; c0 < chunks;) {
    while (first < held.size() && offsets[held[first]] + pieces[held[first]].numel() <= c0 * chunk) ++first;
    int64_t c1 = c0;
    size_t last = first;
    while (c1 < chunks) {
      const int64_t hi = std::min(n, (c1 + 1) * chunk);
      size_t l = last;
      while (l < held.size() && offsets[held[l]] < hi) ++l;
      if (l - first > static_cast<size_t>(kGatherPieces)) break;
      last = l;
      ++c1;
    }
    const int64_t lo = c0 * chunk;
    if (c1 == c0) {  // one chunk, too many pieces: their parts in it, counted from its start
      const int64_t hi = std::min(n, lo + chunk);
      std::vector<Tensor> parts;
      std::vector<int64_t> at;
      for (size_t i = first; i < held.size() && offsets[held[i]] < hi; ++i) {
        const Tensor& x = pieces[held[i]];
        const int64_t b = std::max(offsets[held[i]], lo), e = std::min(offsets[held[i]] + x.numel(), hi);
        parts.push_back(x.view(b - offsets[held[i]], {e - b}));
        at.push_back(b - lo);
      }
      Tensor one = out.view(c0, {1});
      Backend::chunk_sums_of_squares_gathered(parts, at, hi - lo, chunk, one, scale, found_inf);
      c0 += 1;
      continue;
    }
    GatherPieces p{};
    int64_t bytes = 0;
    const int64_t hi = std::min(n, c1 * chunk);
    for (size_t i = first; i < last; ++i) {
      const Tensor& x = pieces[held[i]];
      p.ptr[p.count] = x.data<float>();
      p.begin[p.count] = offsets[held[i]];
      p.end[p.count] = offsets[held[i]] + x.numel();
      bytes += 4 * (std::min(p.end[p.count], hi) - std::max(p.begin[p.count], lo));  // what this run reads of it
      ++p.count;
    }
    declare_launch_cost(bytes + (c1 - c0) * 4 + (scale.defined() ? 4 : 0), (c1 - c0) * 4,
                        (scale.defined() ? 3 : 2) * (hi - lo));
    AMP_LAUNCH(static_cast<unsigned>(c1 - c0), 256, 0, ctx.stream(), chunk_squares_gather_kernel)(
        p, c0, n, chunk, scale.defined() ? scale.data<float>() : nullptr, out.data<float>() + c0, found);
    AMP_CUDA_CHECK_LAUNCH();
    c0 = c1;
  }
}

void CudaBackend::clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) {
  require_cuda(total_norm, "total norm");
  if (total_norm.dtype() != DType::f32) throw std::invalid_argument("total norm must be float32");
  for_each_dtype_group(xs, [&](auto T_tag, const auto& ptrs, const std::vector<int64_t>& numels) {
    using T = decltype(T_tag);
    multi_tensor_apply<1>(ptrs, numels, ClipOp<T>{total_norm.data<float>(), static_cast<float>(max_norm)},
                          MtCost{static_cast<int64_t>(sizeof(T)), static_cast<int64_t>(sizeof(T)), 1});
  });
}

void CudaBackend::clamp(const std::vector<Tensor>& xs, double lo, double hi) {
  for_each_dtype_group(xs, [&](auto T_tag, const auto& ptrs, const std::vector<int64_t>& numels) {
    using T = decltype(T_tag);
    multi_tensor_apply<1>(ptrs, numels, ClampOp<T>{lo, hi}, MtCost{static_cast<int64_t>(sizeof(T)), static_cast<int64_t>(sizeof(T)), 2});
  });
}

namespace {
// check_finite and nonfinite_flags_if_found: found (null: not written), only_if (null: always).
void check_finite_pass(const std::vector<Tensor>& xs, const Tensor& scale, float* found, const Tensor& per_tensor,
                       const float* only_if) {
  if (scale.defined()) {
    require_cuda(scale, "scale");
    if (scale.dtype() != DType::f32 || scale.numel() != 1) throw std::invalid_argument("scale must be a 1-element float32 tensor");
  }
  // With per_tensor: a flag per block (chunks of kChunkSize, as the norms' partials), folded per tensor.
  std::optional<Scratch> flags;
  if (per_tensor.defined()) {
    require_cuda(per_tensor, "per-tensor flags");
    flags.emplace(sizeof(double) * static_cast<size_t>(std::max<int64_t>(1, block_flag_count(xs))));
  }
  // Where only_if is given, what a step that found nothing costs (each block reads it and writes its
  // flag): the launch log's figure; a skipped step reads every gradient besides.
  int64_t offset = 0;
  for_each_dtype_group(xs, [&](auto T_tag, const auto& ptrs, const std::vector<int64_t>& numels) {
    using T = decltype(T_tag);
    double* block_flags = flags ? flags->as<double>() + offset : nullptr;
    const MtCost c = only_if != nullptr ? MtCost{0, 0, 0, 8, 4} : MtCost{static_cast<int64_t>(sizeof(T)), 0, 2, flags ? 8 : 0};
    multi_tensor_apply<1>(ptrs, numels,
                          CheckFiniteOp<T>{found, scale.defined() ? scale.data<float>() : nullptr, block_flags, only_if}, c);
    offset += multi_tensor_block_count(numels, kChunkSize);
  });
  if (flags) fold_block_flags(xs, flags->as<double>(), per_tensor.data<float>());
}
}  // namespace

void CudaBackend::check_finite(const std::vector<Tensor>& xs, const Tensor& scale, Tensor& found_inf,
                               const Tensor& per_tensor) {
  if (xs.empty()) return;
  check_per_tensor(per_tensor, xs.size());
  require_cuda(found_inf, "found_inf");
  if (found_inf.dtype() != DType::f32) throw std::invalid_argument("found_inf must be float32");
  check_finite_pass(xs, scale, found_inf.data<float>(), per_tensor, nullptr);
}

void CudaBackend::nonfinite_flags_if_found(const std::vector<Tensor>& xs, const Tensor& scale, const Tensor& found_inf,
                                           const Tensor& per_tensor) {
  check_per_tensor(per_tensor, xs.size());
  const float* only_if = found_inf_arg(found_inf, "found_inf");
  if (only_if == nullptr) throw std::invalid_argument("nonfinite_flags_if_found: found_inf is undefined");
  if (xs.empty() || !per_tensor.defined()) return;
  check_finite_pass(xs, scale, nullptr, per_tensor, only_if);
}

int64_t block_flag_count(const std::vector<Tensor>& xs) {
  int64_t n = 0;
  for (const Tensor& x : xs) n += chunks_of(x);
  return n;
}

}  // namespace amp::cuda
