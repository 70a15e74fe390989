// The CUDA backend against the CPU backend, op by op, and the parts of it that run without a GPU.
//
// - CudaHost.*: no device needed. The CUDA seam fails cleanly, and the host halves of the backend
//   (multi-tensor plan, row-major-to-column-major GEMM mapping, broadcast indexing, device-side
//   loads and stores) are checked against independent references.
// - CudaVsCpu.*: every Backend method on the same inputs on both devices. Each op has a tolerance;
//   0 means bit-identical, which is what the shared per-element math promises for IEEE-exact
//   operations; otherwise a per-element bound (see matches and matches_sum). They run on a GPU or
//   on the emulated one (preset cuda-emu); elsewhere they are skipped with the reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "amp/autocast.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "runtime/kernels/cuda/broadcast_index.h"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cuda_graph.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/gemm_layout.h"
#include "runtime/kernels/cuda/host_staging.h"
#include "runtime/kernels/cuda/multi_tensor_plan.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/core/tensor.h"
#include "emulated_counters.h"
#include "test_util.h"

#if defined(AMP_CUDA_EMU)
#include "emu.h"  // the emulated GPU's launch records
#endif

namespace amp {
namespace {

constexpr Device kGPU{DeviceType::cuda, 0};
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// ------------------------------------------------------------------------------------------------
// Without a device

TEST(CudaHost, SeamReportsAClearReasonOrInitialises) {
  EXPECT_TRUE(cuda_built());
  std::string reason;
  if (cuda_usable(&reason)) {
    EXPECT_NO_THROW(cuda_init(0));
    EXPECT_TRUE(backend_available(DeviceType::cuda));
    return;
  }
  (void)cudaGetLastError();
  EXPECT_FALSE(reason.empty());
  try {
    cuda_init(0);
    ADD_FAILURE() << "cuda_init succeeded without a usable device";
  } catch (const std::invalid_argument& e) {  // what the machine has does not fit the request: exit 2
    const std::string what = e.what();
    EXPECT_NE(what.find(reason), std::string::npos) << what;
    std::printf("cuda_init(0) without a device: %s\n", e.what());
  }
  // Nothing was registered, and using the device says so instead of crashing.
  EXPECT_FALSE(backend_available(DeviceType::cuda));
  EXPECT_THROW(backend_for(kGPU), std::runtime_error);
}

// A GPU selected before MPI_Init (amp_train, from the launcher's node-local rank) is the only one
// cuda_init then accepts: a launcher and an MPI that disagree on the node's ranks are refused with
// both figures, not run on two GPUs. In a child process (the context is one per process).
TEST(CudaHost, ADeviceSelectedBeforeMpiInitMustBeTheOneCudaInitIsGiven) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "needs 2 devices";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (cuda_select_device_before_mpi(0, count + 1)) std::_Exit(3);  // more ranks than GPUs: nothing selected
        if (!cuda_select_device_before_mpi(1, 2)) std::_Exit(4);
        int current = -1;
        if (cudaGetDevice(&current) != cudaSuccess || current != 1) std::_Exit(5);
        try {
          cuda_init(0, 2);
          std::_Exit(6);
        } catch (const std::invalid_argument& e) {  // the launch does not fit: exit 2
          std::fprintf(stderr, "%s\n", e.what());
        }
        cuda_init(1, 2);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      "GPU 1 was selected before MPI_Init from the launcher's node-local rank, but MPI places this process at "
      "node-local rank 0 of 2");
}

TEST(CudaHost, MultiTensorPlanCoversEveryChunkOnceWithinLimits) {
  const std::vector<int64_t> numels = {0, 1, 65536, 65537, 5 * 65536 + 3, 0, 300 * 65536, 7, 65535, 1000000};
  for (int max_tensors : {1, 2, 3, 110}) {
    for (int max_blocks : {1, 4, 320}) {
      const auto plan = cuda::plan_multi_tensor(numels, 65536, max_tensors, max_blocks);
      std::set<std::pair<int, int>> seen;
      for (const auto& launch : plan) {
        ASSERT_LE(static_cast<int>(launch.tensors.size()), max_tensors);
        ASSERT_LE(static_cast<int>(launch.block_slot.size()), max_blocks);
        ASSERT_FALSE(launch.block_slot.empty());
        ASSERT_EQ(launch.block_slot.size(), launch.block_chunk.size());
        for (size_t b = 0; b < launch.block_slot.size(); ++b) {
          const int t = launch.tensors[static_cast<size_t>(launch.block_slot[b])];
          ASSERT_TRUE(seen.insert({t, launch.block_chunk[b]}).second) << "chunk covered twice";
        }
      }
      int64_t chunks = 0;
      for (int64_t n : numels) chunks += (n + 65535) / 65536;
      EXPECT_EQ(static_cast<int64_t>(seen.size()), chunks);
      EXPECT_EQ(cuda::multi_tensor_block_count(numels, 65536), chunks);
      for (const auto& [t, c] : seen) EXPECT_LT(int64_t{c} * 65536, numels[static_cast<size_t>(t)]);
    }
  }
  // Chunks that need several launches are shared out evenly: for 1311 chunks, 5 launches of at
  // most 263 (the last 259), not 4 of 320 and one of 31, which would leave most SMs idle.
  {
    const auto plan = cuda::plan_multi_tensor({1311 * 65536}, 65536, 110, 320);
    ASSERT_EQ(plan.size(), 5u);
    for (const auto& launch : plan) {
      EXPECT_GE(launch.block_slot.size(), 259u);
      EXPECT_LE(launch.block_slot.size(), 263u);
    }
  }
  // A model's worth of gradients (100 tensors, 10 M elements) takes a handful of launches.
  std::vector<int64_t> model(100, 100000);
  EXPECT_LE(cuda::plan_multi_tensor(model, 65536, 110, 320).size(), 1u);
}

// An element-wise call over small tensors (one chunk each, at most max_tensors a launch) takes smaller
// chunks for them until every launch that moves more than 1 MB has a block per SM, without touching
// the large tensors' launches: GPT-2 small's parameters (48 matrices, 98 biases and LayerNorm weights,
// the embeddings) under AdamW with bf16 copies (30 bytes an element, 30 tensors a launch) on 132 SMs,
// alone and as one call. A call that has the blocks, or moves little, keeps 65536.
TEST(CudaHost, ElementWiseCallsSpreadSmallTensorsOverTheSms) {
  const int sms = 132;
  std::vector<int64_t> small, all = {50257 * 768, 1024 * 768};
  for (int layer = 0; layer < 12; ++layer) {
    for (int64_t n : {768, 768, 2304, 768, 768, 768, 3072, 768}) small.push_back(n);
    for (int64_t n : {768 * 2304, 768 * 768, 768 * 3072, 3072 * 768}) all.push_back(n);
  }
  small.push_back(768);
  small.push_back(768);
  all.insert(all.end(), small.begin(), small.end());
  for (const std::vector<int64_t>& numels : {small, all}) {
    size_t launches = 0;
    int thin = 0;
    for (const cuda::ChunkedGroup& g : cuda::element_wise_groups(numels, 30, sms, 65536, 128, 30, 320)) {
      std::vector<int64_t> n;
      for (int t : g.tensors) n.push_back(numels[static_cast<size_t>(t)]);
      for (const auto& launch : cuda::plan_multi_tensor(n, g.chunk_size, 30, 320)) {
        ++launches;
        int64_t elements = 0;
        for (size_t b = 0; b < launch.block_slot.size(); ++b)
          elements += std::min(g.chunk_size, n[static_cast<size_t>(launch.tensors[static_cast<size_t>(launch.block_slot[b])])] -
                                                 int64_t{launch.block_chunk[b]} * g.chunk_size);
        if (elements * 30 > (int64_t{1} << 20) && static_cast<int>(launch.block_slot.size()) < sms) ++thin;
      }
    }
    EXPECT_EQ(thin, 0) << numels.size() << " tensors";
    // At most the 4 launches the small tensors' 30-a-launch limit makes, on top of one chunk size's plan.
    EXPECT_LE(launches, cuda::plan_multi_tensor(numels, 65536, 30, 320).size() + 4) << numels.size() << " tensors";
  }
  const int64_t chunk = cuda::element_wise_chunk_size(small, 30, sms, 65536, 128, 30, 320);
  EXPECT_LT(chunk, 65536);
  std::printf("GPT-2 small's biases and LayerNorm weights under AdamW: chunks of %lld elements\n",
              static_cast<long long>(chunk));
  EXPECT_EQ(cuda::element_wise_chunk_size(std::vector<int64_t>(48, 768 * 3072), 30, sms, 65536, 128, 30, 320), 65536);
  EXPECT_EQ(cuda::element_wise_chunk_size({768, 768}, 30, sms, 65536, 128, 30, 320), 65536);
  // More SMs than a launch may have blocks: the rule asks for a full launch, not for the impossible.
  EXPECT_EQ(cuda::element_wise_chunk_size(std::vector<int64_t>(48, 768 * 3072), 30, 1000, 65536, 128, 30, 320), 65536);
}

// BLAS semantics, column-major: C = alpha op(A) op(B) + beta C with leading dimensions.
void reference_column_major_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                                 int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p + i * lda] : a[i + p * lda];
        const double bv = tb ? b[j + p * ldb] : b[p + j * ldb];
        acc += av * bv;
      }
      c[i + j * ldc] = alpha * acc + beta * c[i + j * ldc];
    }
}

TEST(CudaHost, RowMajorGemmMapsToColumnMajorCublasCall) {
  const int64_t m = 3, n = 5, k = 4;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      std::vector<double> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(k * n));
      for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5 + static_cast<double>(i) * 0.25;
      for (size_t i = 0; i < b.size(); ++i) b[i] = -1.0 + static_cast<double>(i) * 0.125;
      // Row-major reference: A stored m x k (or k x m when ta), B k x n (or n x k when tb).
      std::vector<double> want(static_cast<size_t>(m * n), 1.0), got = want;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < k; ++p)
            acc += (ta ? a[static_cast<size_t>(p * m + i)] : a[static_cast<size_t>(i * k + p)]) *
                   (tb ? b[static_cast<size_t>(j * k + p)] : b[static_cast<size_t>(p * n + j)]);
          want[static_cast<size_t>(i * n + j)] = 2.0 * acc + 0.5 * want[static_cast<size_t>(i * n + j)];
        }
      const cuda::ColumnMajorGemm g = cuda::column_major_gemm(ta, tb, m, n, k);
      ASSERT_TRUE(g.first_is_b);
      reference_column_major_gemm(g.trans_first, g.trans_second, g.m, g.n, g.k, 2.0, b.data(), g.ld_first, a.data(),
                                  g.ld_second, 0.5, got.data(), g.ldc);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(got[i], want[i]) << "ta=" << ta << " tb=" << tb;
    }
  }
}

TEST(CudaHost, BroadcastIndexMatchesCpuBroadcast) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{5}, {3, 5}}, {{3, 1}, {3, 4}}, {{1}, {2, 3}}, {{}, {4}}, {{2, 1, 4}, {3, 2, 5, 4}}, {{3, 4}, {3, 4}}};
  for (const auto& [in, out] : cases) {
    Tensor x = empty(in, DType::f32);
    backend_for(kCPU).fill_uniform(x, 7, 0, -1, 1);
    Tensor want = empty(out, DType::f32);
    backend_for(kCPU).broadcast_to(x, want);
    const cuda::BroadcastIndex idx = cuda::make_broadcast_index(in, out);
    for (int64_t i = 0; i < want.numel(); ++i)
      ASSERT_EQ(x.data<float>()[idx.offset(i)], want.data<float>()[i]) << shape_str(in) << " -> " << shape_str(out);
  }
  EXPECT_THROW(cuda::make_broadcast_index({3}, {4}), std::invalid_argument);
  EXPECT_THROW(cuda::make_broadcast_index({2, 3}, {3}), std::invalid_argument);
}

// ------------------------------------------------------------------------------------------------
// CPU versus CUDA

class CudaVsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!cuda_usable(&reason)) {
      (void)cudaGetLastError();  // clear the sticky error of the failed probe
      GTEST_SKIP() << "no usable CUDA device: " << reason;
    }
    cuda_init(0);
  }
  Backend& cpu() { return backend_for(kCPU); }
  Backend& gpu() { return backend_for(kGPU); }
  DeviceMemory& gpu_memory() { return memory_for(kGPU); }
};

// Uniform values in [lo, hi), generated on the CPU and rounded into dtype.
Tensor random_cpu(const Shape& shape, DType dt, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  Tensor t = empty(shape, dt);
  backend_for(kCPU).fill_uniform(t, seed, 0, lo, hi);
  return t;
}

// |x| in fp64, for the error bounds of sums.
Tensor abs_f64(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  for (double& x : v) x = std::fabs(x);
  return from_vector(v, t.shape(), DType::f64);
}

// tol == 0: bit-identical, except that any NaN matches any NaN (GPU arithmetic returns the
// canonical NaN where x86 keeps the operand's payload). Otherwise every element on its own:
// |cuda - cpu| <= tol * (|cpu| + rms(cpu)), the rms term standing in for an absolute tolerance
// where the result is near zero; non-finite values must agree exactly (inf with inf, NaN with NaN).
// A per-element bound: one element far off fails, however many are right.
// Either side may be on the GPU (a kernel against its reference path): both are read on the host.
// (The emulated GPU's memory is the host's, so reading a device tensor's bytes there "works"; on a
// real GPU it is a segmentation fault: both sides come to the CPU first.)
::testing::AssertionResult matches(const Tensor& gpu_result, const Tensor& cpu_side, double tol) {
  const Tensor g = gpu_result.to(kCPU), cpu_result = cpu_side.to(kCPU);
  if (g.dtype() != cpu_result.dtype() || g.shape() != cpu_result.shape())
    return ::testing::AssertionFailure() << "dtype or shape differ";
  if (tol == 0) {
    const size_t es = dtype_size(g.dtype());
    std::vector<double> gv, cv;  // converted only on the first mismatch
    for (int64_t i = 0; i < g.numel(); ++i) {
      const size_t off = static_cast<size_t>(i) * es;
      if (std::memcmp(static_cast<const char*>(g.data_ptr()) + off, static_cast<const char*>(cpu_result.data_ptr()) + off,
                      es) == 0)
        continue;
      if (gv.empty()) {
        gv = g.to_vector();
        cv = cpu_result.to_vector();
      }
      const auto k = static_cast<size_t>(i);
      if (std::isnan(gv[k]) && std::isnan(cv[k])) continue;
      return ::testing::AssertionFailure() << "element " << i << ": cuda " << gv[k] << " vs cpu " << cv[k];
    }
    return ::testing::AssertionSuccess();
  }
  const std::vector<double> gv = g.to_vector(), cv = cpu_result.to_vector();
  double sq = 0;
  size_t finite = 0;
  for (double v : cv)
    if (std::isfinite(v)) sq += v * v, ++finite;
  const double rms = finite ? std::sqrt(sq / static_cast<double>(finite)) : 0.0;
  for (size_t i = 0; i < gv.size(); ++i) {
    if (!std::isfinite(gv[i]) || !std::isfinite(cv[i])) {
      if ((std::isnan(gv[i]) && std::isnan(cv[i])) || gv[i] == cv[i]) continue;
      return ::testing::AssertionFailure() << "element " << i << ": cuda " << gv[i] << " vs cpu " << cv[i];
    }
    const double bound = tol * (std::fabs(cv[i]) + rms);
    if (std::fabs(gv[i] - cv[i]) > bound)
      return ::testing::AssertionFailure() << "element " << i << ": cuda " << gv[i] << " vs cpu " << cv[i]
                                           << ", off by " << std::fabs(gv[i] - cv[i]) << " > " << bound;
  }
  return ::testing::AssertionSuccess();
}

// The spacing of dtype's numbers at |v| (its ulp there).
double ulp_of(double v, DType dt) {
  const int mantissa = dt == DType::f64 ? 52 : dt == DType::f32 ? 23 : dt == DType::f16 ? 10 : 7;
  const int min_exp = dt == DType::f64 ? -1022 : dt == DType::f32 ? -126 : dt == DType::f16 ? -14 : -126;
  int e = 0;
  std::frexp(std::fabs(v), &e);  // |v| in [2^(e-1), 2^e)
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mantissa);
}

// Sums that both backends accumulate in fp64, in different orders, then round once into dtype:
// the fp64 sums differ by at most 2 * terms * 2^-53 * sum|x| (the classic bound for any order),
// and rounding can then land on neighbouring dtype values: one ulp of dtype more.
::testing::AssertionResult matches_sum(const Tensor& gpu_result, const Tensor& cpu_result, const Tensor& abs_sums,
                                       int64_t terms) {
  const std::vector<double> g = gpu_result.to(kCPU).to_vector(), c = cpu_result.to_vector(), a = abs_sums.to_vector();
  if (g.size() != c.size() || a.size() != c.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < g.size(); ++i) {
    const double bound = 2.0 * static_cast<double>(terms) * 0x1p-53 * a[i] + ulp_of(c[i], cpu_result.dtype());
    if (!(std::fabs(g[i] - c[i]) <= bound))
      return ::testing::AssertionFailure() << "element " << i << ": cuda " << g[i] << " vs cpu " << c[i]
                                           << ", off by " << std::fabs(g[i] - c[i]) << " > " << bound;
  }
  return ::testing::AssertionSuccess();
}

// Tolerance for ops whose device math may differ by a few ulps (exp, log, erf, tanh, pow).
double transcendental_tol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-14;
    case DType::f32: return 1e-6;
    case DType::f16: return 2e-3;
    default: return 1e-2;
  }
}

TEST_F(CudaVsCpu, Fill) {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i64}) {
    for (double v : {0.0, 1.5, -3.25, 1e10, 1.0 / 3.0}) {
      Tensor c = empty({1000}, dt), g = empty({1000}, dt, kGPU);
      host_memory().fill(c, v);
      gpu_memory().fill(g, v);
      EXPECT_TRUE(matches(g, c, 0)) << dtype_name(dt) << " " << v;
    }
  }
}

TEST_F(CudaVsCpu, CastEveryPairWithSpecialValues) {
  std::vector<double> v = {0.0, -0.0, 1.0, -1.5, 65504.0, 65520.0, 1e-8, 3e-8, 1e-40, 3.0e38, 1e300, 1.00048828125,
                           kInf, -kInf, kNaN};
  for (int i = 0; i < 200; ++i) v.push_back(std::ldexp(1.0 + i / 199.0, i % 60 - 30) * (i % 2 ? -1 : 1));
  for (DType from : kFloatTypes) {
    const Tensor src = from_vector(v, {static_cast<int64_t>(v.size())}, from);
    for (DType to : kFloatTypes) {
      Tensor c = empty(src.shape(), to), g = empty(src.shape(), to, kGPU);
      cpu().cast(src, c);
      gpu().cast(src.to(kGPU), g);
      EXPECT_TRUE(matches(g, c, 0)) << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

TEST_F(CudaVsCpu, UnaryOps) {
  struct Case {
    UnaryOp op;
    double alpha, lo;
    bool exact;
  };
  const Case cases[] = {{UnaryOp::neg, 0, -2, true},       {UnaryOp::exp, 0, -2, false},
                        {UnaryOp::log, 0, 0.01, false},    {UnaryOp::sqrt, 0, 0, true},
                        {UnaryOp::relu, 0, -2, true},      {UnaryOp::gelu, 0, -2, false},
                        {UnaryOp::gelu_tanh, 0, -2, false}, {UnaryOp::pow_scalar, 2.0, -2, true},
                        {UnaryOp::pow_scalar, 1.5, 0, false}, {UnaryOp::mul_scalar, 0.3, -2, true},
                        {UnaryOp::add_scalar, -0.7, -2, true}, {UnaryOp::copy, 0, -2, true}};
  for (DType dt : kFloatTypes) {
    for (const Case& k : cases) {
      const Tensor x = random_cpu({3, 1001}, dt, 11, k.lo, 2.0);
      Tensor c = empty_like(x), g = empty(x.shape(), dt, kGPU);
      cpu().unary(k.op, x, c, k.alpha);
      gpu().unary(k.op, x.to(kGPU), g, k.alpha);
      // GELU in fp32 (and the 16-bit types, computed in fp32) is arithmetic only (activation_math.h):
      // bit for bit. On the emulated GPU one host compiler rounds both sides; on a GPU this checks that
      // nvcc (--fmad=false) rounds as the CPU does. fp64's std::erf is each side's own.
      const bool exact = k.exact || (k.op == UnaryOp::gelu && dt != DType::f64);
      EXPECT_TRUE(matches(g, c, exact ? 0 : transcendental_tol(dt)))
          << dtype_name(dt) << " op " << static_cast<int>(k.op) << " alpha " << k.alpha;
    }
  }
}

// The packed (128-bit) paths of cast, unary and binary against the CPU: a size larger than the
// grid (the emulated GPU's 16 blocks of 256 threads, 4 to 8 elements each) with a tail that is not
// a whole pack, and views one element in (not aligned to a pack: the element-wise kernels) of the
// same data. Each launch is checked to be the one meant.
TEST_F(CudaVsCpu, PackedElementWisePathsAndTheirFallbacks) {
  const int64_t n = 50001;
  for (DType dt : kFloatTypes) {
    const Tensor x = random_cpu({n + 1}, dt, 31, -2, 2), y = random_cpu({n + 1}, dt, 32, 0.5, 2);
    const Tensor gx = x.to(kGPU), gy = y.to(kGPU);
    for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
      const Tensor cxv = x.view(offset, {n}), cyv = y.view(offset, {n});
      const Tensor gxv = gx.view(offset, {n}), gyv = gy.view(offset, {n});
      const std::string packed = offset == 0 ? "_packed_kernel" : "";
      for (DType to : kFloatTypes) {
        Tensor c = empty({n}, to), g = empty({n}, to, kGPU);
        cpu().cast(cxv, c);
        gpu().cast(gxv, g);
        EXPECT_TRUE(matches(g, c, 0)) << dtype_name(dt) << " -> " << dtype_name(to) << " offset " << offset;
#if defined(AMP_CUDA_EMU)
        EXPECT_NE(emu::recent_launches().back().kernel.find("cast" + (packed.empty() ? "_kernel" : packed)), std::string::npos);
#endif
      }
      Tensor c = empty({n}, dt), g = empty({n}, dt, kGPU);
      cpu().unary(UnaryOp::gelu, cxv, c, 0);
      gpu().unary(UnaryOp::gelu, gxv, g, 0);
      EXPECT_TRUE(matches(g, c, dt == DType::f64 ? transcendental_tol(dt) : 0)) << dtype_name(dt) << " offset " << offset;
#if defined(AMP_CUDA_EMU)
      EXPECT_NE(emu::recent_launches().back().kernel.find("unary" + (packed.empty() ? "_kernel" : packed)), std::string::npos);
#endif
      cpu().binary(BinaryOp::div, cxv, cyv, c);
      gpu().binary(BinaryOp::div, gxv, gyv, g);
      EXPECT_TRUE(matches(g, c, 0)) << dtype_name(dt) << " offset " << offset;
#if defined(AMP_CUDA_EMU)
      EXPECT_NE(emu::recent_launches().back().kernel.find("binary" + (packed.empty() ? "_kernel" : packed)), std::string::npos);
#endif
      // In place: the output is the first operand.
      Tensor cin = empty({n}, dt), gin = empty({n}, dt, kGPU);
      cpu().cast(cxv, cin);
      gpu().cast(gxv, gin);
      cpu().binary(BinaryOp::mul, cin, cyv, cin);
      gpu().binary(BinaryOp::mul, gin, gyv, gin);
      EXPECT_TRUE(matches(gin, cin, 0)) << dtype_name(dt) << " in place, offset " << offset;
    }
  }
}

TEST_F(CudaVsCpu, BinaryOpsWithBroadcasting) {
  const BinaryOp ops[] = {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::relu_backward,
                          BinaryOp::gelu_backward, BinaryOp::gelu_tanh_backward};
  const std::vector<std::tuple<Shape, Shape, Shape>> shapes = {
      {{4, 257}, {4, 257}, {4, 257}}, {{4, 257}, {}, {4, 257}}, {{1}, {4, 257}, {4, 257}},
      {{4, 1}, {1, 5}, {4, 5}},       {{3, 1, 5}, {4, 5}, {3, 4, 5}}};
  for (DType dt : kFloatTypes) {
    for (BinaryOp op : ops) {
      const bool exact = (op != BinaryOp::gelu_backward || dt != DType::f64) && op != BinaryOp::gelu_tanh_backward;
      for (const auto& [sa, sb, so] : shapes) {
        const Tensor a = random_cpu(sa, dt, 21), b = random_cpu(sb, dt, 22, 0.5, 2.0);
        Tensor c = empty(so, dt), g = empty(so, dt, kGPU);
        cpu().binary(op, a, b, c);
        gpu().binary(op, a.to(kGPU), b.to(kGPU), g);
        EXPECT_TRUE(matches(g, c, exact ? 0 : transcendental_tol(dt)))
            << dtype_name(dt) << " op " << static_cast<int>(op) << " " << shape_str(sa) << " " << shape_str(sb);
      }
    }
  }
  Tensor bad = empty({4, 257}, DType::f32, kGPU);
  EXPECT_THROW(gpu().binary(BinaryOp::add, bad, empty({4, 257}, DType::f16, kGPU), bad), std::invalid_argument);
}

// a + b with b in another dtype, b's cast folded into the add's pass: bit for bit the cast then the
// add on the same device, in one launch (a narrower b, and a wider one that rounds first).
TEST_F(CudaVsCpu, AddCastIsTheCastThenTheAddInOnePass) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (const auto& [ta, tb] : {std::pair{DType::f32, DType::bf16}, std::pair{DType::f32, DType::f16},
                               std::pair{DType::f64, DType::f32}, std::pair{DType::bf16, DType::f32}}) {
    const Shape s{37, 129};
    const Tensor a = random_cpu(s, ta, 95, -4, 4).to(kGPU), b = random_cpu(s, tb, 96, -4, 4).to(kGPU);
    Tensor want = empty(s, ta, kGPU), got = empty(s, ta, kGPU);
    gpu().Backend::add_cast(a, b, want);
    const int64_t before = launches();
    gpu().add_cast(a, b, got);
    if (emulated_device_counters()) {
      EXPECT_EQ(launches() - before, 1) << "one pass";
    }
    EXPECT_TRUE(matches(got, want, 0)) << dtype_name(ta) << " + " << dtype_name(tb);
  }
}

TEST_F(CudaVsCpu, BroadcastToAndSumTo) {
  // {16} and {1, 24}: out is x repeated, a whole number of 16-byte packs for every dtype (the tile
  // kernel); {2, 1, 4}, {300, 1}: a broadcast inside (element by element).
  const std::vector<std::pair<Shape, Shape>> cases = {{{7}, {300, 7}}, {{300, 1}, {300, 7}}, {{}, {5, 5}},
                                                      {{2, 1, 4}, {3, 2, 5, 4}}, {{16}, {37, 16}},
                                                      {{1, 24}, {3, 5, 24}}, {{1, 1, 16}, {4, 2, 16}}};
  for (DType dt : kFloatTypes) {
    for (const auto& [small, big] : cases) {
      const Tensor x = random_cpu(small, dt, 31);
      Tensor c = empty(big, dt), g = empty(big, dt, kGPU);
      cpu().broadcast_to(x, c);
      gpu().broadcast_to(x.to(kGPU), g);
      EXPECT_TRUE(matches(g, c, 0)) << "broadcast_to " << dtype_name(dt) << shape_str(small) << " -> " << shape_str(big);

      const Tensor y = random_cpu(big, dt, 32);
      Tensor cs = empty(small, dt), gs = empty(small, dt, kGPU);
      cpu().sum_to(y, cs);
      gpu().sum_to(y.to(kGPU), gs);
      Tensor as = empty(small, DType::f64);
      cpu().sum_to(abs_f64(y), as);
      EXPECT_TRUE(matches_sum(gs, cs, as, y.numel() / std::max<int64_t>(1, cs.numel())))
          << "sum_to " << dtype_name(dt) << " " << shape_str(big) << " -> " << shape_str(small);
    }
    // Long reductions: every element to one, and [N, M] -> [N, 1] (one block per output).
    const Tensor y = random_cpu({1000, 3000}, dt, 33);
    for (const Shape& s : {Shape{1}, Shape{1000, 1}, Shape{3000}}) {
      Tensor cs = empty(s, dt), gs = empty(s, dt, kGPU);
      cpu().sum_to(y, cs);
      gpu().sum_to(y.to(kGPU), gs);
      Tensor as = empty(s, DType::f64);
      cpu().sum_to(abs_f64(y), as);
      EXPECT_TRUE(matches_sum(gs, cs, as, y.numel() / cs.numel())) << "sum_to " << dtype_name(dt) << shape_str(s);
    }
  }
}

TEST_F(CudaVsCpu, SoftmaxAndLogSoftmax) {
  for (DType dt : kFloatTypes) {
    for (const Shape& s : {Shape{64, 1}, Shape{64, 10}, Shape{16, 1000}, Shape{3, 2, 77}}) {
      for (bool log : {false, true}) {
        const Tensor x = random_cpu(s, dt, 41, -8, 8);
        Tensor c = empty_like(x), g = empty(s, dt, kGPU);
        cpu().softmax_lastdim(x, c, log);
        gpu().softmax_lastdim(x.to(kGPU), g, log);
        // The row total is a sum of cols terms in the compute type, in a different order on each
        // device: relative error up to cols units of rounding each way, plus a few for exp and the
        // division, plus one rounding into a 16-bit dtype.
        const double u = dt == DType::f64 ? 0x1p-53 : 0x1p-24;
        const double storage = dt == DType::f16 ? 0x1p-10 : dt == DType::bf16 ? 0x1p-7 : 0.0;
        const double tol = (2.0 * static_cast<double>(s.back()) + 8.0) * u + storage;
        EXPECT_TRUE(matches(g, c, tol)) << dtype_name(dt) << " " << shape_str(s) << " log " << log;
      }
    }
  }
}

TEST_F(CudaVsCpu, NllLossAndBackward) {
  for (DType dt : kFloatTypes) {
    const int64_t rows = 1000, cols = 17;
    const Tensor logp = random_cpu({rows, cols}, dt, 51, -5, 0);
    std::vector<int64_t> t(static_cast<size_t>(rows));
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>((i * 7) % cols);
    const Tensor target = from_int64(t, {rows});
    Tensor c = empty({}, dt), g = empty({}, dt, kGPU);
    cpu().nll_loss(logp, target, c);
    gpu().nll_loss(logp.to(kGPU), target.to(kGPU), g);
    EXPECT_TRUE(matches(g, c, dt == DType::f64 ? 1e-14 : 1e-7)) << dtype_name(dt);

    const Tensor grad = from_vector({0.75}, {}, dt);
    Tensor cb = empty({rows, cols}, dt), gb = empty({rows, cols}, dt, kGPU);
    cpu().nll_loss_backward(grad, target, cb);
    gpu().nll_loss_backward(grad.to(kGPU), target.to(kGPU), gb);
    EXPECT_TRUE(matches(gb, cb, 0)) << dtype_name(dt);
  }
  // An out-of-range target cannot throw from the device: the loss is NaN.
  Tensor g = empty({}, DType::f32, kGPU);
  gpu().nll_loss(zeros({2, 3}, DType::f32, kGPU), from_int64({0, 3}, {2}, kGPU), g);
  EXPECT_TRUE(std::isnan(g.item()));
}

// The classifier's fused cross-entropy against the CPU's, with padded columns past `classes` (which
// hold the rows' largest values: in the softmax by mistake, they would move every number). Each
// row's sum is in fp64 on both sides (in another order, the GPU's rescaled by the online maximum), so
// lse differs by a few roundings of the compute type; the gradient is one rounding into the dtype
// after an exp that carries lse's.
TEST_F(CudaVsCpu, FusedCrossEntropyAndItsGradient) {
  const int64_t rows = 300, cols = 1000;
  for (DType dt : kFloatTypes) {
    for (int64_t classes : {cols, int64_t{937}}) {
      std::vector<double> v = random_cpu({rows, cols}, dt, 53, -8, 8).to_vector();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = classes; c < cols; ++c) v[static_cast<size_t>(r * cols + c)] = 40.0;
      const Tensor x = from_vector(v, {rows, cols}, dt);
      std::vector<int64_t> t(static_cast<size_t>(rows));
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>((i * 13) % static_cast<size_t>(classes));
      const Tensor target = from_int64(t, {rows});
      const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
      Tensor lc = empty({rows}, acc), c = empty({}, acc), lg = empty({rows}, acc, kGPU), g = empty({}, acc, kGPU);
      cpu().cross_entropy(x, target, classes, lc, c);
      const Tensor xg = x.to(kGPU), tg = target.to(kGPU);
      gpu().cross_entropy(xg, tg, classes, lg, g);
      const double u = acc == DType::f64 ? 0x1p-53 : 0x1p-24;
      EXPECT_TRUE(matches(lg, lc, 16 * u)) << dtype_name(dt) << " " << classes;
      EXPECT_TRUE(matches(g, c, 16 * u)) << dtype_name(dt) << " " << classes;

      const Tensor grad = from_vector({0.75}, {}, acc);
      Tensor bc = empty({rows, cols}, dt), bg = empty({rows, cols}, dt, kGPU);
      cpu().cross_entropy_backward(x, target, lc, grad, classes, bc);
      gpu().cross_entropy_backward(xg, tg, lc.to(kGPU), grad.to(kGPU), classes, bg);  // the same lse: the pass alone
      // exp may differ by an ulp or two on a GPU; then one rounding into the dtype may land apart.
      const double storage = dt == DType::f16 ? 0x1p-10 : dt == DType::bf16 ? 0x1p-7 : 0.0;
      EXPECT_TRUE(matches(bg, bc, 8 * u + storage)) << dtype_name(dt) << " " << classes;
      const std::vector<double> padded = bg.to(kCPU).to_vector();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = classes; col < cols; ++col) ASSERT_EQ(padded[static_cast<size_t>(r * cols + col)], 0.0);
    }
  }
  // An out-of-range target cannot throw from the device: the loss is NaN.
  Tensor lse = empty({2}, DType::f32, kGPU), g = empty({}, DType::f32, kGPU);
  gpu().cross_entropy(zeros({2, 3}, DType::f32, kGPU), from_int64({0, 2}, {2}, kGPU), 2, lse, g);
  EXPECT_TRUE(std::isnan(g.item()));
}

// The point of the fused loss: bf16 logits [N, V] go through the loss and its backward with no fp32
// [N, V] tensor. The device's peak over the op and its backward is the gradient's N V 2 bytes and a
// few small ones; cross_entropy (a fp32 copy, its log-softmax, nll's gradient, log-softmax's) is over
// four times that.
TEST_F(CudaVsCpu, FusedCrossEntropyNeverHoldsTheLogitsInFp32) {
  const int64_t rows = 256, cols = 2048;
  const Tensor x = random_cpu({rows, cols}, DType::bf16, 54, -4, 4).to(kGPU).set_requires_grad(true);
  std::vector<int64_t> t(static_cast<size_t>(rows));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>(i * 7 % 2000);
  const Tensor target = from_int64(t, {rows}, kGPU);
  DeviceMemory& m = gpu_memory();
  const auto peak_over = [&](auto&& fn) {
    m.synchronize();
    const size_t base = m.current_bytes();
    m.reset_peak_bytes();
    fn();
    m.synchronize();
    return static_cast<int64_t>(m.peak_bytes() - base);
  };
  const int64_t f32_logits = rows * cols * 4;
  const int64_t fused = peak_over([&] { (void)grad({fused_cross_entropy(x, target, 2000)}, {x}); });
  EXPECT_LT(fused, f32_logits) << "the fused loss's peak: " << fused << " bytes";
  const int64_t composite = peak_over([&] { (void)grad({cross_entropy(x.to(DType::f32), target)}, {x}); });
  EXPECT_GT(composite, 2 * f32_logits) << "the control: cross_entropy's peak " << composite << " bytes";
  // Logits made in the step and held by nothing else (the GPT's lm_head output; here x * 1): the
  // gradient is written over them, so the peak holds them and the gradient mul's backward makes, two
  // [N, V] bf16 tensors, not three (the control: the test holds them).
  const int64_t bf16_logits = rows * cols * 2;
  const int64_t over = peak_over([&] {
    const Tensor loss = fused_cross_entropy(mul(x, 1.0), target, 2000);  // mul's output dies here
    (void)grad({loss}, {x});
  });
  EXPECT_LT(over, 5 * bf16_logits / 2) << "written over the logits: a peak of " << over << " bytes";
  const int64_t held = peak_over([&] {
    const Tensor logits = mul(x, 1.0);
    (void)grad({fused_cross_entropy(logits, target, 2000)}, {x});
  });
  EXPECT_GE(held, 3 * bf16_logits) << "the control: logits held, a peak of " << held << " bytes";
}

TEST_F(CudaVsCpu, RandomFillsUseTheSameCounterStream) {
  for (DType dt : kFloatTypes) {
    Tensor c = empty({5000}, dt), g = empty({5000}, dt, kGPU);
    cpu().fill_uniform(c, 1234, 99, -0.5, 3.0);
    gpu().fill_uniform(g, 1234, 99, -0.5, 3.0);
    EXPECT_TRUE(matches(g, c, 0)) << "uniform " << dtype_name(dt);
    cpu().fill_normal(c, 1234, 99, 1.0, 0.02);
    gpu().fill_normal(g, 1234, 99, 1.0, 0.02);
    // Box-Muller's log and cos may differ by an ulp of fp64 between libm and CUDA.
    EXPECT_TRUE(matches(g, c, dt == DType::f64 ? 1e-14 : 1e-7)) << "normal " << dtype_name(dt);
  }
}

TEST_F(CudaVsCpu, GemmAllTransposesAndPrecisions) {
  struct Case {
    DType in, out;
    double tol;
  };
  // fp16/bf16 outputs round once from fp32: a different summation order can flip that rounding.
  // fp32 outputs of fp16/bf16 inputs differ only by the fp32 accumulation order of exact products.
  const Case cases[] = {{DType::f32, DType::f32, 1e-6}, {DType::f64, DType::f64, 1e-14},
                        {DType::f16, DType::f16, 1e-3}, {DType::f16, DType::f32, 1e-5},
                        {DType::bf16, DType::bf16, 8e-3}, {DType::bf16, DType::f32, 1e-5}};
  const int64_t m = 67, n = 45, k = 129;
  for (const Case& cs : cases) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (float beta : {0.0f, 0.5f}) {
          const Tensor a = random_cpu(ta ? Shape{k, m} : Shape{m, k}, cs.in, 61);
          const Tensor b = random_cpu(tb ? Shape{n, k} : Shape{k, n}, cs.in, 62);
          Tensor c = random_cpu({m, n}, cs.out, 63);
          Tensor g = c.to(kGPU);
          cpu().gemm(ta, tb, 1.25f, a, b, beta, c);
          gpu().gemm(ta, tb, 1.25f, a.to(kGPU), b.to(kGPU), beta, g);
          EXPECT_TRUE(matches(g, c, cs.tol)) << dtype_name(cs.in) << "->" << dtype_name(cs.out) << " ta " << ta
                                             << " tb " << tb << " beta " << beta;
        }
      }
    }
  }
  Tensor bad = empty({3, 3}, DType::f32, kGPU);
  EXPECT_THROW(gpu().gemm(false, false, 1, bad, empty({4, 3}, DType::f32, kGPU), 0, bad), std::invalid_argument);
}

TEST_F(CudaVsCpu, LinearWithAndWithoutBias) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const Tensor x = random_cpu({32, 100}, dt, 71), w = random_cpu({50, 100}, dt, 72), b = random_cpu({50}, dt, 73);
    for (bool bias : {false, true}) {
      // The op: on the CPU broadcast_to and gemm(beta = 1), on the GPU one cuBLASLt matmul with a bias epilogue.
      const Tensor c = amp::linear(x, w, bias ? b : Tensor());
      const Tensor g = amp::linear(x.to(kGPU), w.to(kGPU), bias ? b.to(kGPU) : Tensor());
      EXPECT_TRUE(matches(g, c, dt == DType::f32 ? 1e-6 : 8e-3)) << dtype_name(dt) << " bias " << bias;
    }
  }
}

// The CUDA backend's linear layer is one cuBLASLt matmul with the bias in its epilogue (no broadcast
// of the bias into y, no beta = 1 read of it): the same numbers as the composite it replaces
// (Backend::linear_forward: broadcast, then cublasGemmEx with beta = 1), bit for bit on the emulated
// GPU, whose arithmetic is one rounding of the fp32 sum plus bias in both (on a GPU they are different
// kernels: within rounding). Odd shapes; a bias that is not 16-byte aligned takes the composite.
TEST_F(CudaVsCpu, LinearBiasInTheGemmsEpilogueEqualsTheComposite) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (const auto& [r, in, o] : {std::tuple<int64_t, int64_t, int64_t>{37, 19, 23}, {130, 70, 9}, {1, 3, 300}}) {
      const Tensor x = random_cpu({r, in}, dt, 91).to(kGPU), w = random_cpu({o, in}, dt, 92).to(kGPU);
      const Tensor b = random_cpu({o}, dt, 93).to(kGPU);
      Tensor composite = empty({r, o}, dt, kGPU), fused = empty({r, o}, dt, kGPU);
      gpu().Backend::linear_forward(x, w, b, composite);
      const int64_t before = launches();
      gpu().linear_forward(x, w, b, fused);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before, 1) << "one cuBLASLt matmul";
        EXPECT_TRUE(test::bitwise_equal(fused.to(kCPU), composite.to(kCPU))) << dtype_name(dt) << " " << r << "x" << in << "x" << o;
      } else {
        EXPECT_TRUE(matches(fused, composite, dt == DType::f32 ? 1e-6 : 8e-3));
      }
      const Tensor c = amp::linear(x.to(kCPU), w.to(kCPU), b.to(kCPU));
      EXPECT_TRUE(matches(fused, c, dt == DType::f32 ? 1e-5 : 2e-2)) << dtype_name(dt);
      // x 2 or 4 bytes into its allocation: cuBLASLt told so (its preference), the same numbers.
      Tensor x_shifted_storage = empty({r * in + 1}, dt, kGPU);
      Tensor x1 = x_shifted_storage.view(1, {r, in});
      copy_(x1, x);
      Tensor y_x1 = empty({r, o}, dt, kGPU);
      const int64_t before_x1 = launches();
      gpu().linear_forward(x1, w, b, y_x1);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before_x1, 1) << "one cuBLASLt matmul for a 2- or 4-byte aligned x";
      }
      if (emulated_device_counters()) {
        EXPECT_TRUE(test::bitwise_equal(y_x1.to(kCPU), fused.to(kCPU))) << dtype_name(dt);
      } else {  // a GPU may pick another algorithm (another order of the sums) for another alignment
        EXPECT_TRUE(matches(y_x1, composite, dt == DType::f32 ? 1e-6 : 8e-3)) << dtype_name(dt);
      }
      // A bias 2 or 4 bytes into its allocation: the composite, the same numbers.
      Tensor shifted = empty({o + 1}, dt, kGPU);
      Tensor b1 = shifted.view(1, {o});
      copy_(b1, b);
      Tensor y1 = empty({r, o}, dt, kGPU);
      const int64_t before1 = launches();
      gpu().linear_forward(x, w, b1, y1);
      if (emulated_device_counters()) {
        EXPECT_GT(launches() - before1, 1) << "the composite";
      }
      EXPECT_TRUE(test::bitwise_equal(y1.to(kCPU), composite.to(kCPU))) << dtype_name(dt);
      // A bias that does not fit is an error naming it, not a fallback.
      EXPECT_THROW(gpu().linear_forward(x, w, empty({o + 1}, dt, kGPU), y1), std::invalid_argument);
    }
  }
}

// The MLP's tanh GELU in the GEMMs' epilogues (cuBLASLt's GELU_AUX_BIAS and DGELU): one matmul each
// where the hidden width is a multiple of 8, else the composite. Forward: pre is linear_forward's,
// bit for bit on the emulated GPU; y is the GELU of the fp32 sum, checked against the tanh GELU in
// double of the sum's rounding (pre): within one rounding of y, the slope (at most 1.13) times one
// rounding of pre, and 2^-11 |pre| for a fast tanh. Backward: dpre against (g w) * gelu'(pre) in
// double: the fp32 sums' bound times the slope, 2^-10 of the product for a fast tanh, one rounding.
// Both within the CPU's composite's tolerance too. These bounds are what a GPU's cuBLASLt must meet.
TEST_F(CudaVsCpu, TanhGeluInTheGemmsEpilogues) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  const auto gelu = [](double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); };
  const auto slope = [](double x) {
    const double t = std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
  };
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (const auto& [r, in, h] : {std::tuple<int64_t, int64_t, int64_t>{37, 19, 24}, {130, 72, 16}, {9, 5, 13}}) {
      const bool epilogue = h % 8 == 0;
      const Tensor x = random_cpu({r, in}, dt, 94).to(kGPU), w = random_cpu({h, in}, dt, 95).to(kGPU);
      const Tensor b = random_cpu({h}, dt, 96).to(kGPU);
      Tensor pre = empty({r, h}, dt, kGPU), y = empty({r, h}, dt, kGPU), lin = empty({r, h}, dt, kGPU);
      const int64_t before = launches();
      gpu().linear_gelu_tanh_forward(x, w, b, pre, y);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before == 1, epilogue) << "one cuBLASLt matmul where the epilogue runs";
      }
      gpu().linear_forward(x, w, b, lin);
      if (emulated_device_counters()) {
        EXPECT_TRUE(test::bitwise_equal(pre.to(kCPU), lin.to(kCPU))) << dtype_name(dt);
      } else {
        EXPECT_TRUE(matches(pre, lin, dt == DType::f32 ? 1e-6 : 8e-3)) << dtype_name(dt);
      }
      const std::vector<double> pv = pre.to(kCPU).to_vector(), yv = y.to(kCPU).to_vector();
      for (size_t i = 0; i < pv.size(); ++i) {
        const double want = gelu(pv[i]);
        const double bound = ulp_of(want, dt) + 1.13 * ulp_of(pv[i], dt) + std::ldexp(std::fabs(pv[i]), -11);
        ASSERT_LE(std::fabs(yv[i] - want), bound) << dtype_name(dt) << " element " << i << ": pre " << pv[i];
      }
      Tensor cpre = empty({r, h}, dt), cy = empty({r, h}, dt);
      cpu().linear_gelu_tanh_forward(x.to(kCPU), w.to(kCPU), b.to(kCPU), cpre, cy);
      EXPECT_TRUE(matches(y, cy, dt == DType::f32 ? 1e-5 : 2e-2)) << dtype_name(dt);

      // The input gradient of the next layer (width o) through the GELU.
      const int64_t o = 11;
      const Tensor g = random_cpu({r, o}, dt, 97).to(kGPU), w2 = random_cpu({o, h}, dt, 98).to(kGPU);
      Tensor dpre = empty({r, h}, dt, kGPU);
      const int64_t before_back = launches();
      gpu().linear_input_grad_gelu_tanh(g, w2, pre, dpre);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before_back == 1, epilogue) << "one cuBLASLt matmul where the epilogue runs";
      }
      const std::vector<double> gv = g.to(kCPU).to_vector(), wv = w2.to(kCPU).to_vector(), dv = dpre.to(kCPU).to_vector();
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < h; ++j) {
          double prod = 0, abs_sum = 0;
          for (int64_t p = 0; p < o; ++p) {
            prod += gv[static_cast<size_t>(i * o + p)] * wv[static_cast<size_t>(p * h + j)];
            abs_sum += std::fabs(gv[static_cast<size_t>(i * o + p)] * wv[static_cast<size_t>(p * h + j)]);
          }
          const size_t at = static_cast<size_t>(i * h + j);
          const double s = slope(pv[at]), want = prod * s;
          const double bound = 1.13 * (static_cast<double>(o) * 0x1p-23 * abs_sum) + std::ldexp(std::fabs(prod), -10) +
                               ulp_of(want, dt) + (epilogue ? 0.0 : 1.13 * ulp_of(prod, dt));  // the composite rounds g w
          ASSERT_LE(std::fabs(dv[at] - want), bound) << dtype_name(dt) << " (" << i << ", " << j << ")";
        }
      Tensor cd = empty({r, h}, dt);
      cpu().linear_input_grad_gelu_tanh(g.to(kCPU), w2.to(kCPU), cpre, cd);
      EXPECT_TRUE(matches(dpre, cd, dt == DType::f32 ? 1e-5 : 3e-2)) << dtype_name(dt);
      Tensor narrow = lin.view(0, {r, h - 1});
      EXPECT_THROW(gpu().linear_gelu_tanh_forward(x, w, b, pre, narrow), std::invalid_argument);
    }
  }
}

// A bf16 weight cast from an fp32 parameter gets its gradient as the GEMM's fp32 sums on the GPU too
// (cuBLAS writing fp32 from bf16 operands): within fp32 rounding of the CPU's, which test_amp checks
// against a double oracle; a bf16 rounding on either side would be 2^-9 off, far outside the bound.
// On the GPU the bias's gradient comes from the same matmul (Backend::linear_param_grads), fp32 sums
// as well: within one bf16 rounding of the CPU's, which rounds its sum to bf16 before the cast.
TEST_F(CudaVsCpu, Bf16WeightGradientsAreFp32Sums) {
  const Tensor x = random_cpu({64, 96}, DType::f32, 81), w0 = random_cpu({40, 96}, DType::f32, 82);
  const Tensor b0 = random_cpu({40}, DType::f32, 83), r = random_cpu({64, 40}, DType::f32, 84);
  std::vector<Tensor> grads, bias_grads;
  for (Device d : {kCPU, kGPU}) {
    Tensor w = w0.to(d).clone().set_requires_grad(true), b = b0.to(d).clone().set_requires_grad(true);
    Tensor y;
    {
      autocast ac(d.type, DType::bf16);
      y = amp::linear(x.to(d), w, b);
    }
    sum(mul(y.to(DType::f32), r.to(d))).backward();
    ASSERT_EQ(w.grad().dtype(), DType::f32);
    ASSERT_EQ(b.grad().dtype(), DType::f32);
    grads.push_back(w.grad());
    bias_grads.push_back(b.grad());
  }
  EXPECT_TRUE(matches(grads[1], grads[0], 1e-6));
  EXPECT_LT(test::count_representable(grads[1].to(kCPU), 7), grads[1].numel() / 4)
      << "the GPU's gradients are fp32 sums, not bf16 values";
  EXPECT_TRUE(matches(bias_grads[1], bias_grads[0], 0x1p-8));
  EXPECT_LT(test::count_representable(bias_grads[1].to(kCPU), 7), bias_grads[1].numel() / 4)
      << "the GPU's bias gradients are fp32 sums, not bf16 values";
}

// A linear layer's weight and bias gradients in one cuBLASLt matmul (the BGRADB epilogue: the bias
// gradient reduced over the product's k, g's rows), for fp16 and bf16 g into gradients of g's dtype
// or fp32: dw is the plain GEMM's, bit for bit on the emulated GPU; db is within the fp32 sums' bound
// of g's column sums in double (r 2^-24 sum |g|) plus one rounding to its dtype. A db that is not
// 16-byte aligned takes the GEMM and sum_to: the same dw, db within one rounding to g's dtype (sum_to
// writes g's dtype, then a cast).
TEST_F(CudaVsCpu, LinearWeightAndBiasGradientsInOneMatmul) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (DType dt : {DType::f16, DType::bf16}) {
    for (DType out : {dt, DType::f32}) {
      ASSERT_TRUE(gpu().fuses_linear_param_grads(dt, out));
      for (const auto& [r, in, o] : {std::tuple<int64_t, int64_t, int64_t>{37, 19, 24}, {130, 72, 16}, {1, 3, 300}}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " -> " + dtype_name(out) + " " + std::to_string(r) + "x" +
                     std::to_string(in) + "x" + std::to_string(o));
        const Tensor g = random_cpu({r, o}, dt, 95).to(kGPU), x = random_cpu({r, in}, dt, 96).to(kGPU);
        Tensor dw = empty({o, in}, out, kGPU), db = empty({o}, out, kGPU), dw_ref = empty({o, in}, out, kGPU);
        gpu().gemm(true, false, 1.0f, g, x, 0.0f, dw_ref);
        const int64_t before = launches();
        gpu().linear_param_grads(g, x, dw, db);
        if (emulated_device_counters()) {
          EXPECT_EQ(launches() - before, 1) << "one cuBLASLt matmul";
          EXPECT_TRUE(test::bitwise_equal(dw.to(kCPU), dw_ref.to(kCPU)));
        } else {
          EXPECT_TRUE(matches(dw, dw_ref, out == DType::f32 ? 1e-5 : 8e-3));
        }
        const std::vector<double> gv = g.to(kCPU).to_vector();
        const auto unit = [](DType t) { return t == DType::f32 ? 0x1p-24 : t == DType::bf16 ? 0x1p-8 : 0x1p-11; };
        auto check_db = [&](const Tensor& got, const char* what, double u) {
          const std::vector<double> dv = got.to(kCPU).to_vector();
          int bad = 0;
          for (int64_t j = 0; j < o && bad < 5; ++j) {
            double sum = 0, abs_sum = 0;
            for (int64_t i = 0; i < r; ++i) {
              sum += gv[static_cast<size_t>(i * o + j)];
              abs_sum += std::fabs(gv[static_cast<size_t>(i * o + j)]);
            }
            const double bound = static_cast<double>(r) * 0x1p-24 * abs_sum + u * std::fabs(sum) + 1e-30;
            if (!(std::fabs(dv[static_cast<size_t>(j)] - sum) <= bound)) {
              ++bad;
              ADD_FAILURE() << what << " db[" << j << "] = " << dv[static_cast<size_t>(j)] << ", columns' sum " << sum;
            }
          }
        };
        check_db(db, "fused", unit(out));
        Tensor shifted = empty({o + 1}, out, kGPU);
        Tensor db1 = shifted.view(1, {o});
        Tensor dw1 = empty({o, in}, out, kGPU);
        const int64_t before1 = launches();
        gpu().linear_param_grads(g, x, dw1, db1);
        if (emulated_device_counters() && r > 1) {  // (one row: sum_to is a copy)
          EXPECT_GT(launches() - before1, 1) << "the GEMM and sum_to";
        }
        EXPECT_TRUE(test::bitwise_equal(dw1.to(kCPU), dw_ref.to(kCPU)));
        check_db(db1, "unaligned", unit(dt));
        EXPECT_THROW(gpu().linear_param_grads(g, x, dw, shifted), std::invalid_argument);  // o + 1 elements
      }
    }
  }
  EXPECT_FALSE(gpu().fuses_linear_param_grads(DType::f32, DType::f32));
  EXPECT_FALSE(cpu().fuses_linear_param_grads(DType::bf16, DType::f32));
}

// --- fused AMP kernels, with injected infs and NaNs

// Many gradients (more than one launch holds) and one long one (more chunks than one launch holds).
std::vector<Tensor> make_grads(DType dt, uint64_t seed) {
  std::vector<Tensor> grads;
  for (int i = 0; i < 150; ++i) grads.push_back(random_cpu({1 + i * 37}, dt, seed + static_cast<uint64_t>(i), -1e4, 1e4));
  grads.push_back(random_cpu({321 * 65536 + 5}, dt, seed + 999, -1e4, 1e4));
  return grads;
}

std::vector<Tensor> to_device(const std::vector<Tensor>& ts, Device d) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.to(d).clone());
  return out;
}

void poke(Tensor& t, int64_t i, double v) {  // sets one element of a CPU tensor, rounded into its dtype
  const Tensor one = from_vector({v}, {1}, t.dtype());
  const size_t es = dtype_size(t.dtype());
  std::memcpy(static_cast<char*>(t.data_ptr()) + static_cast<size_t>(i) * es, one.data_ptr(), es);
}

TEST_F(CudaVsCpu, UnscaleAndCheckWithInjectedNonFinites) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (int inject = 0; inject < 4; ++inject) {  // none, inf in a small grad, NaN in the long one, -inf first
      std::vector<Tensor> c = make_grads(dt, 100);
      if (inject == 1) poke(c[77], 5, kInf);
      if (inject == 2) poke(c.back(), 320 * 65536 + 1, kNaN);
      if (inject == 3) poke(c[0], 0, -kInf);
      std::vector<Tensor> g = to_device(c, kGPU);
      const Tensor scale = from_vector({65536.0 * 3}, {1});
      Tensor cf = zeros({1}), gf = zeros({1}, DType::f32, kGPU);
      const int64_t n = static_cast<int64_t>(c.size());
      Tensor cflags = zeros({n}), gflags = zeros({n}, DType::f32, kGPU);
      cpu().unscale_and_check(c, scale, cf, cflags);
      gpu().unscale_and_check(g, scale.to(kGPU), gf, gflags);
      EXPECT_EQ(gf.item(), inject == 0 ? 0.0 : 1.0) << dtype_name(dt) << " inject " << inject;
      EXPECT_EQ(gf.item(), cf.item());
      // Which gradient: the one poked, and no other (the long one's NaN sits in its 321st chunk).
      std::vector<double> want(static_cast<size_t>(n), 0.0);
      if (inject == 1) want[77] = 1.0;
      if (inject == 2) want.back() = 1.0;
      if (inject == 3) want[0] = 1.0;
      EXPECT_EQ(cflags.to_vector(), want) << dtype_name(dt) << " inject " << inject;
      EXPECT_EQ(gflags.to(kCPU).to_vector(), want) << dtype_name(dt) << " inject " << inject;
      for (size_t i = 0; i < c.size(); ++i) ASSERT_TRUE(matches(g[i], c[i], 0)) << dtype_name(dt) << " grad " << i;
    }
  }
  // found_inf is never reset by a clean pass.
  std::vector<Tensor> g = {ones({10}, DType::f32, kGPU)};
  Tensor flag = ones({1}, DType::f32, kGPU);
  gpu().unscale_and_check(g, ones({1}, DType::f32, kGPU), flag);
  EXPECT_EQ(flag.item(), 1.0);
}

TEST_F(CudaVsCpu, UpdateScaleSequences) {
  const ScaleUpdateHyper hypers[] = {{2.0, 0.5, 3, 1, 0.0f, std::numeric_limits<float>::infinity()},
                                     {2.0, 0.25, 2, 3, 1.0f, 1e5f},
                                     {1.1, 0.9, 1, 1, 0.0f, std::numeric_limits<float>::infinity()}};
  const int found[] = {0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0};
  for (const ScaleUpdateHyper& h : hypers) {
    Tensor cs = full({}, 1000.0), ct = from_vector({0.0, static_cast<double>(h.hysteresis)}, {2}, DType::i64);
    Tensor gs = cs.to(kGPU).clone(), gt = ct.to(kGPU).clone();
    for (int f : found) {
      const Tensor flag = from_vector({static_cast<double>(f)}, {1});
      cpu().update_scale(cs, ct, flag, h);
      gpu().update_scale(gs, gt, flag.to(kGPU), h);
      ASSERT_TRUE(matches(gs, cs, 0)) << "scale after found_inf " << f;
      ASSERT_EQ(gt.to_vector(), ct.to_vector()) << "tracker after found_inf " << f;
    }
  }
  // Growth stops short of inf.
  Tensor gs = full({}, 3e38, DType::f32, kGPU), gt = from_vector({0.0, 1.0}, {2}, DType::i64, kGPU);
  gpu().update_scale(gs, gt, zeros({1}, DType::f32, kGPU), {2.0, 0.5, 1, 1, 0.0f, std::numeric_limits<float>::infinity()});
  EXPECT_FLOAT_EQ(static_cast<float>(gs.item()), 3e38f);
}

struct OptimState {
  std::vector<Tensor> params, grads, s1, s2, s3;
  Tensor step;
};

OptimState make_state(Device d, const OptimState* from = nullptr) {
  OptimState s;
  if (from) {
    s.params = to_device(from->params, d);
    s.grads = to_device(from->grads, d);
    s.s1 = to_device(from->s1, d);
    s.s2 = to_device(from->s2, d);
    s.s3 = to_device(from->s3, d);
    s.step = from->step.to(d).clone();
    return s;
  }
  for (int i = 0; i < 40; ++i) {
    const Shape shape{1 + i * 1111};
    s.params.push_back(random_cpu(shape, DType::f32, 200 + static_cast<uint64_t>(i)));
    s.grads.push_back(random_cpu(shape, DType::f32, 300 + static_cast<uint64_t>(i), -0.1, 0.1));
    s.s1.push_back(zeros(shape));
    s.s2.push_back(zeros(shape));
    s.s3.push_back(zeros(shape));
  }
  s.step = zeros({1});
  return s;
}

void expect_state_matches(const OptimState& g, const OptimState& c, double tol, const std::string& what) {
  for (size_t i = 0; i < c.params.size(); ++i) {
    ASSERT_TRUE(matches(g.params[i], c.params[i], tol)) << what << " param " << i;
    ASSERT_TRUE(matches(g.s1[i], c.s1[i], tol)) << what << " state1 " << i;
    ASSERT_TRUE(matches(g.s2[i], c.s2[i], tol)) << what << " state2 " << i;
    ASSERT_TRUE(matches(g.s3[i], c.s3[i], tol)) << what << " state3 " << i;
  }
  ASSERT_TRUE(matches(g.step, c.step, 0)) << what << " step count";
}

TEST_F(CudaVsCpu, SgdStepsAndSkips) {
  const SgdHyper hypers[] = {{0.1, 0.0, 0.0, 0.0, false, false},
                             {0.05, 0.9, 0.1, 1e-2, false, true},
                             {0.05, 0.9, 0.0, 0.0, true, false}};
  for (const SgdHyper& h : hypers) {
    OptimState c = make_state(kCPU);
    OptimState g = make_state(kGPU, &c);
    const int found[] = {0, 1, 0, 0, 1};
    for (int f : found) {
      const Tensor flag = from_vector({static_cast<double>(f)}, {1});
      const OptimState before = make_state(kCPU, &c);
      cpu().sgd_step(c.params, c.grads, c.s1, c.step, h, flag, Tensor(), {});
      gpu().sgd_step(g.params, g.grads, g.s1, g.step, h, flag.to(kGPU), Tensor(), {});
      expect_state_matches(g, c, 0, "sgd");
      if (f) expect_state_matches(g, before, 0, "skipped sgd step");
    }
    // An undefined found_inf means "no check": the step is taken.
    cpu().sgd_step(c.params, c.grads, c.s1, c.step, h, Tensor(), Tensor(), {});
    gpu().sgd_step(g.params, g.grads, g.s1, g.step, h, Tensor(), Tensor(), {});
    expect_state_matches(g, c, 0, "sgd without found_inf");
    // Still-scaled gradients with grad_scale: unscaled in the step's own pass and written back; not
    // written back with keep_unscaled_grads false (Optimizer::set_keep_unscaled_grads), the same step.
    const Tensor scale = from_vector({1024.0}, {1});
    SgdHyper unkept = h;
    unkept.keep_unscaled_grads = false;
    OptimState c2 = make_state(kCPU, &c), g2 = make_state(kGPU, &g);
    const OptimState scaled = make_state(kCPU, &c);
    cpu().sgd_step(c.params, c.grads, c.s1, c.step, h, Tensor(), scale, {});
    gpu().sgd_step(g.params, g.grads, g.s1, g.step, h, Tensor(), scale.to(kGPU), {});
    expect_state_matches(g, c, 0, "sgd with grad_scale");
    cpu().sgd_step(c2.params, c2.grads, c2.s1, c2.step, unkept, Tensor(), scale, {});
    gpu().sgd_step(g2.params, g2.grads, g2.s1, g2.step, unkept, Tensor(), scale.to(kGPU), {});
    expect_state_matches(c2, c, 0, "sgd with grad_scale, gradients not kept (cpu)");
    expect_state_matches(g2, c, 0, "sgd with grad_scale, gradients not kept (gpu)");
    for (size_t i = 0; i < c.grads.size(); ++i) {
      ASSERT_TRUE(matches(c2.grads[i], scaled.grads[i], 0)) << "still scaled " << i;
      ASSERT_TRUE(matches(g2.grads[i], scaled.grads[i], 0)) << "still scaled " << i;
      ASSERT_TRUE(matches(g.grads[i], c.grads[i], 0)) << "written back " << i;
    }
    ASSERT_FALSE(matches(c.grads[0], scaled.grads[0], 0)) << "the kept gradients were unscaled";
  }
}

TEST_F(CudaVsCpu, AdamStepsAndSkips) {
  const AdamHyper hypers[] = {{1e-3, 0.9, 0.999, 1e-8, 0.0, false, false, false},
                              {1e-3, 0.9, 0.999, 1e-8, 1e-2, true, false, true},
                              {1e-2, 0.8, 0.99, 1e-6, 1e-2, false, true, false},
                              {0.6, 0.3, 0.99, 1e-6, 0.0, false, true, true}};  // lerp's other branch
  for (const AdamHyper& h : hypers) {
    OptimState c = make_state(kCPU);
    OptimState g = make_state(kGPU, &c);
    const int found[] = {0, 1, 0, 0, 1, 0};
    bool keep = true;
    for (int f : found) {
      const Tensor flag = from_vector({static_cast<double>(f)}, {1});
      const OptimState before = make_state(kGPU, &g);
      const Tensor scale = from_vector({f ? 1.0 : 256.0}, {1});  // also the fused unscale
      // Every other step leaves the gradients scaled (keep_unscaled_grads false): the same state.
      AdamHyper hk = h;
      hk.keep_unscaled_grads = keep;
      keep = !keep;
      cpu().adam_step(c.params, c.grads, c.s1, c.s2, c.s3, c.step, hk, flag, scale, {});
      gpu().adam_step(g.params, g.grads, g.s1, g.s2, g.s3, g.step, hk, flag.to(kGPU), scale.to(kGPU), {});
      // The fp64 bias corrections use pow, which may differ by an ulp between libm and CUDA.
      expect_state_matches(g, c, 1e-7, "adam");
      if (f) expect_state_matches(g, make_state(kCPU, &before), 0, "skipped adam step");
    }
  }
}

// Clipping by the norm in the step's pass (NormClip): bit for bit clip_by_norm then the step on the
// device, parameters, moments and the gradients written back, for Adam(W) and SGD with momentum, still
// scaled (the fused unscale first) or not, a norm that clips and one that does not; and the CPU's
// fused step as AdamStepsAndSkips bounds it.
TEST_F(CudaVsCpu, ClippingInTheStepIsClipThenStep) {
  const AdamHyper adam{1e-3, 0.9, 0.999, 1e-8, 1e-2, true, false, false, true};
  const SgdHyper sgd{0.1, 0.9, 0.0, 1e-4, false, false, true};
  for (bool use_adam : {true, false})
    for (bool scaled : {false, true})
      for (double max_norm : {0.05, 1e3}) {
        OptimState cpu_fused = make_state(kCPU);
        OptimState fused = make_state(kGPU, &cpu_fused), apart = make_state(kGPU, &cpu_fused);
        const Tensor scale = from_vector({256.0}, {1});
        const Tensor norm = from_vector({1.7}, {1});  // the clipping factor 0.05 / 1.7, or 1
        for (int step = 0; step < 2; ++step) {
          const std::string what = std::string(use_adam ? "adam" : "sgd") + (scaled ? " scaled" : "") +
                                   " max_norm " + std::to_string(max_norm) + " step " + std::to_string(step);
          Tensor found = zeros({1}, DType::f32, kGPU);
          if (scaled) gpu().unscale_and_check(apart.grads, scale.to(kGPU), found);
          gpu().clip_by_norm(apart.grads, norm.to(kGPU), max_norm);
          const NormClip clip{norm.to(kGPU), max_norm}, cpu_clip{norm, max_norm};
          const Tensor gs = scaled ? scale.to(kGPU) : Tensor(), cs = scaled ? scale : Tensor();
          if (use_adam) {
            gpu().adam_step(apart.params, apart.grads, apart.s1, apart.s2, apart.s3, apart.step, adam, Tensor(), Tensor(), {});
            gpu().adam_step(fused.params, fused.grads, fused.s1, fused.s2, fused.s3, fused.step, adam, Tensor(), gs, {},
                            Tensor(), clip);
            cpu().adam_step(cpu_fused.params, cpu_fused.grads, cpu_fused.s1, cpu_fused.s2, cpu_fused.s3, cpu_fused.step,
                            adam, Tensor(), cs, {}, Tensor(), cpu_clip);
          } else {
            gpu().sgd_step(apart.params, apart.grads, apart.s1, apart.step, sgd, Tensor(), Tensor(), {});
            gpu().sgd_step(fused.params, fused.grads, fused.s1, fused.step, sgd, Tensor(), gs, {}, Tensor(), clip);
            cpu().sgd_step(cpu_fused.params, cpu_fused.grads, cpu_fused.s1, cpu_fused.step, sgd, Tensor(), cs, {},
                           Tensor(), cpu_clip);
          }
          expect_state_matches(fused, apart, 0, what);
          for (size_t i = 0; i < apart.grads.size(); ++i)
            ASSERT_TRUE(matches(fused.grads[i], apart.grads[i], 0)) << what << " gradient written back " << i;
          expect_state_matches(fused, cpu_fused, 1e-7, what + " against the CPU");
        }
      }
}

// One tensor of 60,000 elements: SGD with momentum moves 1.2 MB of it in one chunk of 65536, one
// block; on the emulated GPU's 2 SMs the step runs as 2 blocks of 32768 elements (the second a
// partial one). Bit for bit the CPU's.
TEST_F(CudaVsCpu, AStepInSmallerChunksMatchesTheCpu) {
  const Shape shape{60000};
  std::vector<Tensor> cp{random_cpu(shape, DType::f32, 61)}, cg{random_cpu(shape, DType::f32, 62, -0.1, 0.1)};
  std::vector<Tensor> cb{zeros(shape)};
  std::vector<Tensor> gp{cp[0].to(kGPU)}, gg{cg[0].to(kGPU)}, gb{cb[0].to(kGPU)};
  Tensor cstep = zeros({1}), gstep = zeros({1}, DType::f32, kGPU);
  const SgdHyper h{0.05, 0.9, 0.0, 1e-2, false, false};
  for (int i = 0; i < 3; ++i) {
    cpu().sgd_step(cp, cg, cb, cstep, h, Tensor(), Tensor(), {});
    gpu().sgd_step(gp, gg, gb, gstep, h, Tensor(), Tensor(), {});
  }
  EXPECT_TRUE(matches(gp[0], cp[0], 0));
  EXPECT_TRUE(matches(gb[0], cb[0], 0));
#if defined(AMP_CUDA_EMU)
  if (cuda::context().sm_count() == 2) {  // the emulated GPU's default (AMP_EMU_SMS)
    const auto launches = emu::recent_launches();
    const auto it = std::find_if(launches.rbegin(), launches.rend(), [](const emu::LaunchRecord& r) {
      return r.kernel.find("multi_tensor_kernel") != std::string::npos;
    });
    ASSERT_NE(it, launches.rend());
    EXPECT_EQ(it->grid_x, 2u) << "chunks of 32768";
  }
#endif
}

// The fused steps' low-precision copies are cast(parameter) to the bit on either backend (and the
// same on both for SGD); a skipped step leaves them as they were (zeros here).
TEST_F(CudaVsCpu, OptimizerStepsWriteTheParametersLowPrecisionCopies) {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (int kind = 0; kind < 4; ++kind) {  // SGD with and without momentum, Adam with and without amsgrad
      OptimState c = make_state(kCPU);
      OptimState g = make_state(kGPU, &c);
      std::vector<Tensor> cc, gc;
      for (const Tensor& p : c.params) {
        cc.push_back(zeros(p.shape(), dt));
        gc.push_back(zeros(p.shape(), dt).to(kGPU));
      }
      const std::string what = std::string(dtype_name(dt)) + " kind " + std::to_string(kind);
      const SgdHyper sh{0.05, kind == 0 ? 0.9 : 0.0, 0.0, 1e-2, false, false};
      const AdamHyper ah{1e-2, 0.9, 0.999, 1e-8, 1e-2, true, kind == 3, false};
      for (int f : {1, 0, 0}) {
        const Tensor flag = from_vector({static_cast<double>(f)}, {1});
        if (kind < 2) {
          cpu().sgd_step(c.params, c.grads, c.s1, c.step, sh, flag, Tensor(), cc);
          gpu().sgd_step(g.params, g.grads, g.s1, g.step, sh, flag.to(kGPU), Tensor(), gc);
        } else {
          cpu().adam_step(c.params, c.grads, c.s1, c.s2, c.s3, c.step, ah, flag, Tensor(), cc);
          gpu().adam_step(g.params, g.grads, g.s1, g.s2, g.s3, g.step, ah, flag.to(kGPU), Tensor(), gc);
        }
        for (size_t i = 0; i < cc.size(); ++i) {
          const Tensor want = f ? zeros(cc[i].shape(), dt) : cast(c.params[i], dt);
          ASSERT_TRUE(matches(cc[i], want, 0)) << what << " CPU copy " << i << (f ? " (skipped)" : "");
          const Tensor gpu_want = f ? zeros(cc[i].shape(), dt) : cast(g.params[i], dt).to(kCPU);
          ASSERT_TRUE(matches(gc[i], gpu_want, 0)) << what << " GPU copy " << i << (f ? " (skipped)" : "");
          // Adam's parameters may differ by an ulp between the backends (pow); SGD's are the same.
          if (kind < 2) {
            ASSERT_TRUE(matches(gc[i], cc[i], 0)) << what << " GPU copy " << i << " vs the CPU's";
          }
        }
      }
      std::vector<Tensor> wrong = cc;
      wrong[0] = zeros({3}, dt);
      EXPECT_THROW(cpu().sgd_step(c.params, c.grads, c.s1, c.step, sh, Tensor(), Tensor(), wrong), std::invalid_argument);
      EXPECT_THROW(gpu().sgd_step(g.params, g.grads, g.s1, g.step, sh, Tensor(), Tensor(), to_device(wrong, kGPU)),
                   std::invalid_argument);
      wrong = cc;
      wrong.pop_back();  // one copy short
      EXPECT_THROW(cpu().sgd_step(c.params, c.grads, c.s1, c.step, sh, Tensor(), Tensor(), wrong), std::invalid_argument);
      wrong = cc;
      wrong[1] = zeros(cc[1].shape(), DType::f32);  // not a low-precision dtype
      EXPECT_THROW(cpu().adam_step(c.params, c.grads, c.s1, c.s2, c.s3, c.step, ah, Tensor(), Tensor(), wrong),
                   std::invalid_argument);
      EXPECT_THROW(gpu().sgd_step(g.params, g.grads, g.s1, g.step, sh, Tensor(), Tensor(), to_device(cc, kCPU)),
                   std::invalid_argument) << "copies on another device than the parameters";
    }
  }
}

TEST_F(CudaVsCpu, CheckFiniteFindsInfAndNaN) {
  for (int inject = 0; inject < 3; ++inject) {  // none, NaN, inf
    std::vector<Tensor> c = {random_cpu({70000}, DType::f32, 91), random_cpu({333}, DType::bf16, 92)};
    if (inject == 1) poke(c[1], 7, kNaN);
    if (inject == 2) poke(c[0], 69999, kInf);
    Tensor cf = zeros({1}), gf = zeros({1}).to(kGPU);
    Tensor cflags = zeros({2}), gflags = zeros({2}).to(kGPU);
    cpu().check_finite(c, Tensor(), cf, cflags);
    gpu().check_finite(to_device(c, kGPU), Tensor(), gf, gflags);
    EXPECT_EQ(cf.item(), inject == 0 ? 0.0 : 1.0);
    EXPECT_EQ(gf.item(), cf.item()) << "inject " << inject;
    // Per tensor, with the dtypes launched apart (the bf16 tensor's blocks after the f32 one's).
    const std::vector<double> want = {inject == 2 ? 1.0 : 0.0, inject == 1 ? 1.0 : 0.0};
    EXPECT_EQ(cflags.to_vector(), want) << "inject " << inject;
    EXPECT_EQ(gflags.to(kCPU).to_vector(), want) << "inject " << inject;
  }
}

// Each tensor's norm in one pass: slot i is what norm_accumulate of tensor i alone gives (bit for
// bit on the same backend: the same chunk partials folded the same way), on both devices, with the
// dtypes interleaved (each dtype is launched apart, so a tensor's partials are not where its index
// says), an empty tensor, a tensor of many chunks, and non-finite elements in one tensor only.
// The gradient norm's chunks in one launch (one block per chunk): each chunk's sum of squares against
// the CPU's, within the bound of fp64 sums in another order, a short last chunk included.
TEST_F(CudaVsCpu, ChunkSumsOfSquaresInOneLaunch) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (DType dt : kFloatTypes) {
    const int64_t n = 7 * 1024 + 300;
    const Tensor x = random_cpu({n}, dt, 57, -3, 3);
    Tensor c = full({8}, 0.25, DType::f32), g = full({8}, 0.25, DType::f32, kGPU);
    cpu().chunk_sums_of_squares(x, 1024, c, Tensor());
    const Tensor xg = x.to(kGPU);
    const int64_t before = launches();
    gpu().chunk_sums_of_squares(xg, 1024, g, Tensor());
    if (emulated_device_counters()) {
      EXPECT_EQ(launches() - before, 1) << dtype_name(dt);
    }
    std::vector<double> sq = x.to_vector(), a(8, 0.25);
    for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i / 1024)] += sq[static_cast<size_t>(i)] * sq[static_cast<size_t>(i)];
    EXPECT_TRUE(matches_sum(g, c, from_vector(a, {8}, DType::f64), 1024)) << dtype_name(dt);
  }
}

// Gradients that still carry a loss scale (a power of two, and 3): each chunk's sum is the one of
// the gradient that unscale_and_check leaves on the device, bit for bit, and x is not written; the
// CPU's, within the bound of sums in another order.
TEST_F(CudaVsCpu, ChunkSumsOfSquaresOfScaledGradients) {
  for (DType dt : kFloatTypes) {
    for (double s : {1024.0, 3.0}) {
      const int64_t n = 5 * 1024 + 9;
      const Tensor x = mul(random_cpu({n}, DType::f64, 58, -3, 3), s).to(dt), xg = x.to(kGPU);
      const Tensor scale = full({1}, s, DType::f32), scale_g = scale.to(kGPU);
      Tensor g = full({6}, 0.25, DType::f32, kGPU), want = full({6}, 0.25, DType::f32, kGPU);
      gpu().chunk_sums_of_squares(xg, 1024, g, scale_g);
      EXPECT_TRUE(test::bitwise_equal(xg.to(kCPU), x)) << dtype_name(dt) << ": read, not written";
      Tensor unscaled = xg.clone(), found = zeros({1}, DType::f32, kGPU);
      gpu().unscale_and_check({unscaled}, scale_g, found, Tensor());
      gpu().chunk_sums_of_squares(unscaled, 1024, want, Tensor());
      EXPECT_TRUE(test::bitwise_equal(g.to(kCPU), want.to(kCPU))) << dtype_name(dt) << " scale " << s;
      Tensor c = full({6}, 0.25, DType::f32);
      cpu().chunk_sums_of_squares(x, 1024, c, scale);
      std::vector<double> u = unscaled.to(kCPU).to_vector(), a(6, 0.25);
      for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i / 1024)] += u[static_cast<size_t>(i)] * u[static_cast<size_t>(i)];
      EXPECT_TRUE(matches_sum(g, c, from_vector(a, {6}, DType::f64), 1024)) << dtype_name(dt) << " scale " << s;
    }
  }
}

// The chunk sums of a vector that is not stored (gradients at their planned bucket slots, one rank):
// bit for bit chunk_sums_of_squares of the vector written out, with a scale or without (3 rounds the
// unscaled elements), and the pieces only read. Pieces of every size: one element, some not a
// multiple of 4, one across several chunks, a chunk with none, one at each end; one launch. 200
// small pieces take two launches, one piece across both. A chunk that meets more pieces than one
// launch takes (single elements 3 apart) goes the default's way alone, with the same sums. Pieces out of order, overlapping, or not float32 are refused.
TEST_F(CudaVsCpu, GatheredChunkSumsAreTheWrittenVectorsBitForBit) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  struct Case { std::vector<int64_t> offsets, sizes; int64_t n; int64_t launches; };
  std::vector<Case> cases = {{{0, 1004, 1100, 1105, 4096, 6000}, {1, 90, 3, 2900, 1900, 1}, 6001, 1},
                             {{}, {}, 2048, 1}};
  Case split{{}, {}, 2400, 2};  // 200 pieces of 10, 12 apart: two launches, piece 85 across them
  for (int64_t i = 0; i < 200; ++i) split.offsets.push_back(12 * i), split.sizes.push_back(10);
  cases.push_back(split);
  Case many{{}, {}, 3000, -1};  // 400 single elements, 3 apart: chunk 0 meets more than a launch takes
  for (int64_t i = 0; i < 400; ++i) many.offsets.push_back(3 * i), many.sizes.push_back(1);
  cases.push_back(many);
  uint64_t seed = 90;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.offsets.size()) + " pieces in " + std::to_string(c.n));
    std::vector<Tensor> pieces;
    std::vector<double> flat(static_cast<size_t>(c.n), 0.0);
    for (size_t i = 0; i < c.offsets.size(); ++i) {
      const Tensor p = mul(random_cpu({c.sizes[i]}, DType::f64, seed++, -3, 3), 3.0).to(DType::f32);
      const std::vector<double> v = p.to_vector();
      std::copy(v.begin(), v.end(), flat.begin() + c.offsets[i]);
      pieces.push_back(p.to(kGPU));
    }
    const std::vector<Tensor> before = to_device(pieces, kCPU);
    const Tensor whole = from_vector(flat, {c.n}, DType::f32).to(kGPU);
    const int64_t chunks = (c.n + 1023) / 1024;
    for (double s : {0.0, 3.0, 1024.0}) {
      const Tensor scale = s > 0 ? full({1}, s, DType::f32, kGPU) : Tensor();
      Tensor got = full({chunks}, 0.25, DType::f32, kGPU), want = full({chunks}, 0.25, DType::f32, kGPU);
      gpu().chunk_sums_of_squares(whole, 1024, want, scale);
      const int64_t at = launches();
      gpu().chunk_sums_of_squares_gathered(pieces, c.offsets, c.n, 1024, got, scale);
      if (emulated_device_counters() && c.launches > 0) {
        EXPECT_EQ(launches() - at, c.launches) << "scale " << s;
      }
#if defined(AMP_CUDA_EMU)
      if (c.launches > 0) {
        EXPECT_NE(emu::recent_launches().back().kernel.find("chunk_squares_gather_kernel"), std::string::npos);
      }
#endif
      EXPECT_TRUE(test::bitwise_equal(got.to(kCPU), want.to(kCPU))) << "scale " << s;
    }
    for (size_t i = 0; i < pieces.size(); ++i)
      EXPECT_TRUE(test::bitwise_equal(pieces[i].to(kCPU), before[i])) << "piece " << i << " written";
  }
  Tensor out = zeros({2}, DType::f32, kGPU);
  const Tensor a = zeros({8}, DType::f32, kGPU), b = zeros({8}, DType::bf16, kGPU);
  EXPECT_THROW(gpu().chunk_sums_of_squares_gathered({a, a}, {100, 104}, 2048, 1024, out, Tensor()), std::invalid_argument);
  EXPECT_THROW(gpu().chunk_sums_of_squares_gathered({a, a}, {200, 100}, 2048, 1024, out, Tensor()), std::invalid_argument);
  EXPECT_THROW(gpu().chunk_sums_of_squares_gathered({a}, {2044}, 2048, 1024, out, Tensor()), std::invalid_argument);
  EXPECT_THROW(gpu().chunk_sums_of_squares_gathered({b}, {0}, 2048, 1024, out, Tensor()), std::invalid_argument);
  EXPECT_THROW(gpu().chunk_sums_of_squares_gathered({a}, {0, 8}, 2048, 1024, out, Tensor()), std::invalid_argument);
}

// The norm's read as the loss scaler's check (GradScaler::check_inf_ with a fused pass): the GPU's
// chunk sums set found_inf exactly where the CPU's check_finite finds an element that is not finite
// unscaled, flat in every dtype and gathered (by the gathering kernel, and a chunk of too many pieces
// that goes the default's way), and not for a finite element whose square overflows a chunk's float32 sum. The per-tensor
// flags then: none where found_inf is 0 (the planted inf unread), the CPU's where it is set, the
// dtypes interleaved.
TEST_F(CudaVsCpu, ChunkSumsOfSquaresFindWhatTheCpuFinds) {
  const double values[] = {kInf, kNaN, -kInf, 2.0, 1e30};
  for (DType dt : kFloatTypes) {
    for (double v : values) {
      if (dt == DType::f16 && std::isfinite(v) && v > 65504) continue;
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(v));
      Tensor x = random_cpu({5 * 1024 + 9}, dt, 61, -3, 3);
      poke(x, 4000, v);
      const Tensor scale = full({1}, 1024.0, DType::f32);
      Tensor want = zeros({1});
      cpu().check_finite({x}, scale, want, Tensor());
      Tensor found = zeros({1}, DType::f32, kGPU), sums = zeros({6}, DType::f32, kGPU);
      gpu().chunk_sums_of_squares(x.to(kGPU), 1024, sums, scale.to(kGPU), found);
      EXPECT_EQ(found.item(), want.item());
      EXPECT_EQ(want.item(), std::isfinite(v) ? 0.0 : 1.0) << "the control";
    }
  }
  for (int64_t size : {9, 1}) {  // 300 pieces 10 apart (a launch a chunk), or single elements 3 apart (the default's way)
    for (double v : values) {
      SCOPED_TRACE("pieces of " + std::to_string(size) + " " + std::to_string(v));
      std::vector<Tensor> pieces;
      std::vector<int64_t> offsets;
      for (int64_t i = 0; i < 300; ++i) {
        pieces.push_back(random_cpu({size}, DType::f32, 70 + static_cast<uint64_t>(i), -3, 3));
        offsets.push_back(size == 9 ? 10 * i : 3 * i);
      }
      poke(pieces[250], 0, v);
      const int64_t n = offsets.back() + pieces.back().numel() + 5;
      Tensor want = zeros({1});
      cpu().check_finite(pieces, Tensor(), want, Tensor());
      Tensor found = zeros({1}, DType::f32, kGPU), sums = zeros({(n + 1023) / 1024}, DType::f32, kGPU);
      gpu().chunk_sums_of_squares_gathered(to_device(pieces, kGPU), offsets, n, 1024, sums, Tensor(), found);
      EXPECT_EQ(found.item(), want.item());
    }
  }
  std::vector<Tensor> c = {random_cpu({70000}, DType::f32, 91), random_cpu({333}, DType::bf16, 92),
                           random_cpu({5000}, DType::f32, 93)};
  poke(c[1], 7, kInf);
  const std::vector<Tensor> g = to_device(c, kGPU);
  Tensor flags = zeros({3}).to(kGPU);
  gpu().nonfinite_flags_if_found(g, Tensor(), zeros({1}).to(kGPU), flags);
  EXPECT_EQ(flags.to(kCPU).to_vector(), (std::vector<double>{0, 0, 0}));
  gpu().nonfinite_flags_if_found(g, Tensor(), full({1}, 1.0, DType::f32, kGPU), flags);
  Tensor cflags = zeros({3}), cf = zeros({1});
  cpu().check_finite(c, Tensor(), cf, cflags);
  EXPECT_EQ(flags.to(kCPU).to_vector(), cflags.to_vector());
  EXPECT_EQ(cflags.to_vector(), (std::vector<double>{0, 1, 0})) << "the control";
}

TEST_F(CudaVsCpu, PerTensorNormsInOnePassAreEachTensorsOwnNorm) {
  for (double p : {2.0, 1.0, 3.0, kInf, -kInf, 0.0}) {
    for (int inject = 0; inject < 3; ++inject) {  // none, NaN, inf (in tensor 2 only)
      std::vector<Tensor> c = {random_cpu({333}, DType::f16, 71), random_cpu({70000}, DType::f32, 72),
                               random_cpu({1000}, DType::bf16, 73), empty({0}, DType::f32),
                               random_cpu({200000}, DType::f32, 74), random_cpu({17}, DType::f64, 75),
                               random_cpu({5}, DType::f16, 76)};
      if (inject == 1) poke(c[2], 7, kNaN);
      if (inject == 2) poke(c[2], 999, kInf);
      const std::vector<Tensor> g = to_device(c, kGPU);
      const double start = std::isinf(p) && p < 0 ? kInf : 0.25;  // a max or sum starts from what is there
      Tensor cn = full({static_cast<int64_t>(c.size())}, start, DType::f32), gn = cn.to(kGPU).clone();
      cpu().norm_accumulate_each(c, p, cn);
      gpu().norm_accumulate_each(g, p, gn);
      const std::vector<double> cv = cn.to_vector(), gv = gn.to(kCPU).to_vector();
      for (size_t i = 0; i < c.size(); ++i) {
        SCOPED_TRACE("p " + std::to_string(p) + " inject " + std::to_string(inject) + " tensor " + std::to_string(i));
        Tensor one_c = full({1}, start, DType::f32), one_g = one_c.to(kGPU).clone();
        cpu().norm_accumulate({c[i]}, p, one_c);
        gpu().norm_accumulate({g[i]}, p, one_g);
        const auto same = [](double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
        EXPECT_TRUE(same(gv[i], one_g.item())) << gv[i] << " vs " << one_g.item();
        EXPECT_TRUE(same(cv[i], one_c.item())) << cv[i] << " vs " << one_c.item();
        if (std::isfinite(cv[i])) {
          EXPECT_NEAR(gv[i], cv[i], 1e-6 * std::fabs(cv[i]));
        } else {
          EXPECT_EQ(std::isnan(gv[i]), std::isnan(cv[i]));
          EXPECT_FALSE(std::isfinite(gv[i]));
        }
        if (i != 2 && p != 0.0 && !(i == 3 && p < 0)) {  // the min of no element stays inf
          EXPECT_TRUE(std::isfinite(cv[i]));  // a bad element stays in its tensor
        }
      }
    }
  }
  Tensor wrong = zeros({2}, DType::f32, kGPU);
  EXPECT_THROW(gpu().norm_accumulate_each({ones({3}, DType::f32, kGPU)}, 2.0, wrong), std::invalid_argument);
  Tensor wrong_cpu = zeros({2});
  EXPECT_THROW(cpu().norm_accumulate_each({ones({3})}, 2.0, wrong_cpu), std::invalid_argument);
}

TEST_F(CudaVsCpu, NormsClippingAndClamping) {
  for (double p : {2.0, 1.0, kInf}) {
    for (int inject = 0; inject < 3; ++inject) {  // none, NaN, inf
      std::vector<Tensor> c = {random_cpu({70000}, DType::f32, 81), random_cpu({333}, DType::f16, 82),
                               random_cpu({1}, DType::bf16, 83), random_cpu({200000}, DType::f64, 84)};
      if (inject == 1) poke(c[1], 7, kNaN);
      if (inject == 2) poke(c[0], 69999, kInf);
      const std::vector<Tensor> g = to_device(c, kGPU);
      Tensor cn = from_vector({0.5}, {1}), gn = cn.to(kGPU).clone();
      cpu().norm_accumulate(c, p, cn);
      gpu().norm_accumulate(g, p, gn);
      const double cv = cn.item(), gv = gn.item();
      if (inject == 0) {
        EXPECT_TRUE(matches(gn, cn, 1e-6)) << "p " << p;
      } else {
        // A non-finite gradient must give a non-finite norm on both devices, never a finite one.
        EXPECT_FALSE(std::isfinite(gv)) << "p " << p << " inject " << inject;
        EXPECT_EQ(std::isnan(cv), std::isnan(gv)) << "p " << p << " inject " << inject;
      }
    }
  }
  std::vector<Tensor> c = {random_cpu({70000}, DType::f32, 91), random_cpu({333}, DType::f16, 92),
                           random_cpu({5000}, DType::f64, 93)};
  std::vector<Tensor> g = to_device(c, kGPU);
  for (double norm : {10.0, 0.01}) {
    const Tensor total = from_vector({norm}, {1});
    cpu().clip_by_norm(c, total, 1.0);
    gpu().clip_by_norm(g, total.to(kGPU), 1.0);
    for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(matches(g[i], c[i], 0)) << "clip " << i;
  }
  poke(c[0], 3, kNaN);
  g = to_device(c, kGPU);
  cpu().clamp(c, -0.5, 0.25);
  gpu().clamp(g, -0.5, 0.25);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(matches(g[i], c[i], 0)) << "clamp " << i;
}

TEST_F(CudaVsCpu, AllocatorCountsBytesAndReusesBlocks) {
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  cuda::context().allocator().empty_cache();
  const size_t base = b.current_bytes();
  b.reset_peak_bytes();
  void* p = b.allocate(1000);
  EXPECT_EQ(b.current_bytes(), base + 1000);
  void* q = b.allocate(3 << 20);
  EXPECT_EQ(b.peak_bytes(), base + 1000 + (3u << 20));
  b.deallocate(q, 3 << 20);
  b.deallocate(p, 1000);
  EXPECT_EQ(b.current_bytes(), base);
  EXPECT_EQ(b.peak_bytes(), base + 1000 + (3u << 20));
  void* again = b.allocate(1000);  // the same rounded size comes back from the cache
  EXPECT_EQ(again, p);
  b.deallocate(again, 1000);
  EXPECT_EQ(b.allocate(0), nullptr);
}

// device_peak_bytes is the most the driver counted for the process beyond its context, at every
// segment the allocator took, not only what it holds when asked: a segment larger than every figure so
// far, given back to the driver (empty_cache) before the question, is in it.
TEST_F(CudaVsCpu, DevicePeakBytesKeepsAReleasedSegment) {
  DeviceMemory& m = gpu_memory();
  m.synchronize();
  cuda::CachingAllocator& alloc = cuda::context().allocator();
  alloc.empty_cache();
  const size_t before = m.device_peak_bytes();
  ASSERT_GE(before, cuda::Context::kCublasWorkspaceBytes) << "cuBLAS's workspace is the process's";
  const size_t big =
      cuda::CachingAllocator::segment_size(cuda::CachingAllocator::round_size(before + (size_t{64} << 20)));
  size_t free_before = 0, free_held = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  void* p = m.allocate(big);
  ASSERT_EQ(cudaMemGetInfo(&free_held, &total), cudaSuccess);
  ASSERT_GE(free_before - free_held, big) << "the allocation did not come from the driver";
  m.deallocate(p, big);
  m.synchronize();
  alloc.empty_cache();
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  ASSERT_GE(free_after, free_held + big) << "the segment was not given back";
  const size_t peak = m.device_peak_bytes();
  EXPECT_GE(peak, big) << "the released segment is not in the figure";
  // At most what was held before (no more than the figure so far) and the segment, rounded by the driver.
#if defined(AMP_CUDA_EMU)
  EXPECT_LE(peak, before + big);
#else
  EXPECT_LE(peak, before + big + (size_t{64} << 20));
#endif
  EXPECT_EQ(host_memory().device_peak_bytes(), 0u) << "the CPU has no driver's count";
}

#if defined(AMP_CUDA_EMU)
// The bias gradient, [N, M] -> [M]: it used to go to one thread per column (16 blocks on this
// device, each thread walking a column alone) or to one block per column walking it with stride M
// (uncoalesced). Now a block owns 32 adjacent columns and its warps read 32 adjacent elements: grid
// ceil(M / 32) x splits, block 32 x 8. Few columns over many rows are split over more blocks (grid.y),
// whose partial sums a second kernel adds; many columns need one split.
TEST_F(CudaVsCpu, BiasGradientSumIsCoalescedOverColumns) {
  for (int64_t m : {int64_t{40}, int64_t{8192}}) {
    const Tensor y = random_cpu({3000, m}, DType::f32, 71);
    Tensor cs = empty({m}, DType::f32), gs = empty({m}, DType::f32, kGPU);
    cpu().sum_to(y, cs);
    gpu().sum_to(y.to(kGPU), gs);
    const auto launches = emu::recent_launches();
    auto it = std::find_if(launches.rbegin(), launches.rend(),
                           [](const emu::LaunchRecord& r) { return r.kernel.find("sum_columns_kernel") != std::string::npos; });
    ASSERT_NE(it, launches.rend()) << "the columns kernel did not run";
    const emu::LaunchRecord& l = *it;
    EXPECT_EQ(l.grid_x, static_cast<unsigned>((m + 31) / 32));
    EXPECT_EQ(l.block_x, 32u);
    EXPECT_EQ(l.block_y, 8u);
    if (m == 40) {
      EXPECT_GT(l.grid_y, 1u) << "2 column blocks over 3000 rows: the rows should be split";
      EXPECT_NE(launches.back().kernel.find("sum_column_partials_kernel"), std::string::npos);
    } else {
      EXPECT_EQ(l.grid_y, 1u);
      EXPECT_EQ(it, launches.rbegin());
    }
    EXPECT_TRUE(matches_sum(gs, cs, [&] {
      Tensor as = empty({m}, DType::f64);
      cpu().sum_to(abs_f64(y), as);
      return as;
    }(), 3000));
  }
}
#endif

// Shapes that change from step to step: a large cached block serves smaller requests by splitting,
// instead of a new cudaMalloc for every distinct size (which piled up 110 MiB here before).
TEST_F(CudaVsCpu, AllocatorSplitsLargeBlocksSoVaryingShapesDoNotPileUp) {
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  cuda::CachingAllocator& alloc = cuda::context().allocator();
  alloc.empty_cache();
  const size_t base = alloc.reserved_bytes();
  for (size_t mib = 20; mib >= 2; mib -= 2) {
    void* p = b.allocate(mib << 20);
    b.deallocate(p, mib << 20);
  }
  EXPECT_LE(alloc.reserved_bytes() - base, size_t{20} << 20);
  // Two pieces of one segment do not overlap, and they merge back when both are free.
  char* p = static_cast<char*>(b.allocate(size_t{6} << 20));
  char* q = static_cast<char*>(b.allocate(size_t{8} << 20));
  EXPECT_TRUE(q >= p + (size_t{6} << 20) || p >= q + (size_t{8} << 20));
  b.deallocate(p, size_t{6} << 20);
  b.deallocate(q, size_t{8} << 20);
  void* whole = b.allocate(size_t{20} << 20);
  EXPECT_LE(alloc.reserved_bytes() - base, size_t{20} << 20) << "the pieces did not merge back";
  b.deallocate(whole, size_t{20} << 20);
}

// A 768-wide GPT's fp32 weights (2.25, 6.75, 9 and 9 MiB a layer): each used to round up to 2 MiB in
// a cudaMalloc of its own (384 MiB for 324 MiB of weights, the same again for the gradients and each
// optimizer state: a quarter of a GiB of GPT-2 small's step). Now blocks round up to 512 bytes and
// requests under 10 MiB share 32 MiB segments: at most one segment's worth more than the bytes asked.
// Requests of 10 MiB or more still take their own segment, rounded up to 2 MiB.
TEST_F(CudaVsCpu, AllocatorPacksMidSizedBlocksIntoSharedSegments) {
  using A = cuda::CachingAllocator;
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  A& alloc = cuda::context().allocator();
  const bool packed = alloc.packed();  // off where freed blocks are poisoned (every cuda-emu test)
  alloc.set_packed(true);
  alloc.empty_cache();
  const size_t base = alloc.reserved_bytes();
  std::vector<std::pair<char*, size_t>> blocks;
  size_t asked = 0;
  for (int layer = 0; layer < 12; ++layer)
    for (const size_t n : {768 * 768, 768 * 2304, 768 * 3072, 3072 * 768}) {
      const size_t bytes = n * sizeof(float);
      blocks.emplace_back(static_cast<char*>(b.allocate(bytes)), bytes);
      asked += bytes;
    }
  EXPECT_EQ(asked, size_t{324} << 20);
  EXPECT_LE(alloc.reserved_bytes() - base, asked + A::kSharedSegment) << "blocks were padded";
  for (size_t i = 0; i < blocks.size(); ++i)  // no two blocks overlap
    for (size_t j = i + 1; j < blocks.size(); ++j)
      EXPECT_TRUE(blocks[i].first + blocks[i].second <= blocks[j].first ||
                  blocks[j].first + blocks[j].second <= blocks[i].first)
          << "blocks " << i << " and " << j << " overlap";
  for (const auto& [p, bytes] : blocks) b.deallocate(p, bytes);
  b.synchronize();
  alloc.empty_cache();
  EXPECT_EQ(alloc.reserved_bytes(), base) << "the shared segments were not given back whole";
  EXPECT_EQ(A::round_size(768 * 768 * 4), size_t{768 * 768 * 4});
  EXPECT_EQ(A::segment_size(A::round_size((size_t{12} << 20) + 1)), size_t{14} << 20);
  EXPECT_EQ(A::segment_size(A::round_size(size_t{3} << 20)), A::kSharedSegment);
  // Not packed (poisoning's checks): a large block rounds up to 2 MiB, in a segment of its own.
  EXPECT_EQ(A::round_size(768 * 768 * 4, false), size_t{4} << 20);
  EXPECT_EQ(A::segment_size(A::round_size(size_t{3} << 20, false), false), size_t{4} << 20);
  const char* poison = std::getenv("AMP_CUDA_POISON_FREED");
  EXPECT_EQ(packed, !(poison != nullptr && std::string(poison) == "1"));
  alloc.set_packed(packed);
}

// A segment made during a capture gives the graph's pool the block asked for; the rest goes to the
// global cache, where eager work may use it while the graph lives (it was the pool's, unusable until
// the graph went).
TEST_F(CudaVsCpu, ASegmentMadeDuringACaptureGivesThePoolOnlyTheBlockAskedFor) {
  using A = cuda::CachingAllocator;
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  A& alloc = cuda::context().allocator();
  const bool packed = alloc.packed();
  alloc.set_packed(true);
  alloc.empty_cache();
  const size_t base = alloc.reserved_bytes(), asked = size_t{6} << 20, eager = size_t{8} << 20;
  const cudaStream_t stream = cuda::context().stream();
  const int pool = alloc.create_pool();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  alloc.use_pool(pool);
  char* g = static_cast<char*>(b.allocate(asked));  // nothing cached: a new shared segment
  alloc.use_pool(0);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(alloc.reserved_bytes() - base, A::kSharedSegment);
  EXPECT_EQ(alloc.pool_bytes(pool), asked);
  char* e = static_cast<char*>(b.allocate(eager));
  EXPECT_EQ(alloc.reserved_bytes() - base, A::kSharedSegment) << "eager work did not get the segment's rest";
  EXPECT_TRUE(e >= g + asked || e + eager <= g);
  b.deallocate(e, eager);
  b.deallocate(g, asked);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  alloc.release_pool(pool);
  b.synchronize();
  alloc.empty_cache();
  EXPECT_EQ(alloc.reserved_bytes(), base) << "the segment's pieces did not merge back whole";
  alloc.set_packed(packed);
}

#if defined(AMP_CUDA_EMU)
// Where the driver has no room for a shared segment, a request under 10 MiB takes a segment of its
// own, rounded up to 2 MiB; where nothing fits, OutOfMemory names the request. Run in a child process
// whose emulated GPU has 96 MiB (AMP_EMU_MEMORY_MB, read once per process).
TEST_F(CudaVsCpu, AllocatorTakesASegmentOfItsOwnWhenTheDriverHasNoRoomForAShared) {
  using A = cuda::CachingAllocator;
  if (std::getenv("AMP_EMU_MEMORY_MB") == nullptr) {
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    const int rc = std::system(("AMP_EMU_MEMORY_MB=96 '" + self +
                                "' --gtest_filter=CudaVsCpu.AllocatorTakesASegmentOfItsOwnWhenTheDriverHasNoRoomForAShared")
                                   .c_str());
    EXPECT_EQ(rc, 0) << "the run with 96 MiB failed (its output is above)";
    return;
  }
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  A& alloc = cuda::context().allocator();
  alloc.set_packed(true);
  alloc.empty_cache();
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  ASSERT_LE(total, size_t{96} << 20);
  ASSERT_GT(free, size_t{24} << 20);
  void* filler = nullptr;  // leaves 20 MiB: no room for 32
  ASSERT_EQ(cudaMalloc(&filler, free - (size_t{20} << 20)), cudaSuccess);
  const size_t base = alloc.reserved_bytes(), three = size_t{3} << 20;
  void* p = b.allocate(three);
  EXPECT_EQ(alloc.reserved_bytes() - base, size_t{4} << 20);
  std::string what;
  try {
    b.allocate(size_t{30} << 20);
  } catch (const cuda::OutOfMemory& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("tried to allocate 31457280 bytes"), std::string::npos) << what;
  b.deallocate(p, three);
  b.synchronize();
  ASSERT_EQ(cudaFree(filler), cudaSuccess);
  alloc.empty_cache();
}
#endif

// A graph-private pool: what a capture allocates comes from the blocks eager steps left in the cache
// (no cudaMalloc), returns to the pool when freed, and is not handed to eager work while the graph
// lives, since every replay writes it again; once the graph is gone the blocks serve eager work.
TEST_F(CudaVsCpu, AllocationsDuringACaptureStayInTheGraphsPrivatePool) {
  DeviceMemory& b = gpu_memory();
  b.synchronize();
  cuda::CachingAllocator& alloc = cuda::context().allocator();
  alloc.empty_cache();  // no piece left by an earlier test for the warm-up's blocks to come from
  const size_t small = 4096, large = size_t{6} << 20;
  // Warm-up: an eager step's blocks go back to the global cache.
  b.deallocate(b.allocate(small), small);
  b.deallocate(b.allocate(large), large);
  const size_t reserved = alloc.reserved_bytes();
  const cudaStream_t stream = cuda::context().stream();
  const int pool = alloc.create_pool();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  alloc.use_pool(pool);
  void* s1 = b.allocate(small);
  void* l1 = b.allocate(large);
  b.deallocate(s1, small);  // freed during the capture: back to the pool
  b.deallocate(l1, large);
  void* s2 = b.allocate(small);  // the pool serves the capture again
  EXPECT_EQ(s2, s1);
  b.deallocate(s2, small);
  alloc.use_pool(0);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "the capture was invalidated";
  EXPECT_EQ(alloc.reserved_bytes(), reserved) << "the capture called cudaMalloc instead of taking warm blocks";
  EXPECT_EQ(alloc.pool_bytes(pool), small + large);
  // Eager work gets other memory while the graph lives.
  void* e1 = b.allocate(small);
  void* e2 = b.allocate(large);
  EXPECT_NE(e1, s1);
  EXPECT_NE(e2, l1);
  b.deallocate(e1, small);
  b.deallocate(e2, large);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  alloc.release_pool(pool);
  EXPECT_EQ(alloc.pool_bytes(pool), 0u);
  // A miss during a capture (nothing cached of that size) allocates without invalidating it.
  const int pool2 = alloc.create_pool();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  alloc.use_pool(pool2);
  void* fresh = b.allocate(size_t{40} << 20);
  alloc.use_pool(0);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "cudaMalloc invalidated the capture";
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  b.deallocate(fresh, size_t{40} << 20);
  alloc.release_pool(pool2);
  alloc.empty_cache();  // the next tests start from an empty cache, as they would alone
}

// A sequence of ops captured once (after an eager warm-up) replays as its eager runs do, bit for bit;
// a replay is one graph launch with no kernel launched on its own, no host synchronisation and no
// allocation. A read-back inside the work is refused, and the stream works afterwards.
TEST_F(CudaVsCpu, ACapturedSequenceOfOpsReplaysAsItsEagerRuns) {
  const Tensor x = random_cpu({33, 17}, DType::f32, 3).to(kGPU), w0 = random_cpu({17, 9}, DType::f32, 4);
  const auto step = [&x](Tensor& w) {
    const Tensor y = relu(matmul(x, w));
    add_(w, mul(mm(x, y, true, false), -1e-3));
  };
  const int replays = 5;
  Tensor eager = w0.to(kGPU).clone(), graphed = w0.to(kGPU).clone();
  for (int i = 0; i < 1 + replays; ++i) step(eager);
  step(graphed);  // the warm-up
  cuda::CudaGraph graph([&] { step(graphed); });
  gpu_memory().synchronize();
  cuda::CachingAllocator& alloc = cuda::context().allocator();
  const size_t reserved = alloc.reserved_bytes(), current = alloc.current_bytes();
  const std::optional<DeviceCounters> before = emulated_device_counters();
  for (int i = 0; i < replays; ++i) graph.replay();
  const std::optional<DeviceCounters> after = emulated_device_counters();
  EXPECT_EQ(alloc.reserved_bytes(), reserved);
  EXPECT_EQ(alloc.current_bytes(), current);
  if (before) {
    const DeviceCounters d = *after - *before;
    EXPECT_EQ(d.graph_launches, replays);
    EXPECT_GT(d.graph_ops, 0);
    EXPECT_EQ(d.launches, 0);
    EXPECT_EQ(d.host_syncs, 0);
  }
  EXPECT_TRUE(matches(graphed, eager.to(kCPU), 0));
  EXPECT_THROW(cuda::CudaGraph([&] { (void)sum(graphed).item(); }), std::runtime_error);
  step(eager);
  EXPECT_TRUE(std::isfinite(sum(eager).item()));
}

// An optimizer step captured once and replayed under a changing learning rate (a scheduler's) steps
// with each replay's lr: the kernels read it from the optimizer's device scalar, written before each
// replay (write_lr), not from the launch's arguments, which the graph keeps as captured. Against the
// same optimizer stepped eagerly with the same lrs, bit for bit; fails with the kernels taking h.lr.
TEST_F(CudaVsCpu, ACapturedOptimizerStepTakesEachReplaysLearningRate) {
  for (int kind = 0; kind < 2; ++kind) {  // SGD with momentum, AdamW
    SCOPED_TRACE(kind == 0 ? "SGD" : "AdamW");
    auto make = [kind](Tensor p) -> std::unique_ptr<optim::Optimizer> {
      if (kind == 0) return std::make_unique<optim::SGD>(std::vector<Tensor>{p}, optim::SgdOptions{0.1, 0.9});
      optim::AdamOptions o;
      o.lr = 0.1;
      o.weight_decay = 0.01;
      return std::make_unique<optim::AdamW>(std::vector<Tensor>{p}, o);
    };
    const Tensor init = random_cpu({1000}, DType::f32, 11), grad = random_cpu({1000}, DType::f32, 12).to(kGPU);
    Tensor eager = init.to(kGPU), graphed = init.to(kGPU);
    eager.set_requires_grad(true);
    graphed.set_requires_grad(true);
    eager.set_grad(grad.clone());
    graphed.set_grad(grad.clone());
    auto oe = make(eager), og = make(graphed);
    oe->step();
    og->step();  // the warm-up: the state exists before the capture
    cuda::CudaGraph graph([&] { og->step(); });
    for (double lr : {0.05, 0.2, 0.01}) {
      oe->set_lr(lr);
      oe->step();
      og->set_lr(lr);
      og->write_lr();
      graph.replay();
    }
    EXPECT_TRUE(matches(graphed, eager.detach().to(kCPU), 0));
  }
}

// With AMP_CUDA_POISON_FREED=1 (every test of the cuda-emu preset) a recycled block comes back as
// NaN bytes, so a kernel that skips part of its output cannot hide behind the values a previous
// tensor left there.
TEST_F(CudaVsCpu, RecycledBlocksArePoisonedOnTheEmulatedGpu) {
  const char* poison = std::getenv("AMP_CUDA_POISON_FREED");
  if (!emulated_device_counters() || poison == nullptr || std::string(poison) != "1")
    GTEST_SKIP() << "on the emulated GPU with AMP_CUDA_POISON_FREED=1 (every cuda-emu test has it)";
  DeviceMemory& b = gpu_memory();
  void* p = b.allocate(4096);
  ASSERT_EQ(cudaMemsetAsync(p, 0, 4096, cuda::context().stream()), cudaSuccess);
  b.deallocate(p, 4096);
  // Other cached blocks of that size (earlier tests') may come first: take blocks until p returns.
  std::vector<void*> taken;
  while (taken.size() < 10000 && (taken.empty() || taken.back() != p)) taken.push_back(b.allocate(4096));
  ASSERT_EQ(taken.back(), p);
  std::vector<unsigned char> host(4096);
  b.copy_to_host(host.data(), p, 4096);
  for (unsigned char c : host) ASSERT_EQ(c, 0xff);
  for (void* q : taken) b.deallocate(q, 4096);
}

TEST_F(CudaVsCpu, TensorRoundTripAndItem) {
  const Tensor x = random_cpu({1000}, DType::bf16, 5);
  EXPECT_TRUE(matches(x.to(kGPU).clone(), x, 0));
  EXPECT_DOUBLE_EQ(scalar_tensor(2.5, DType::f32, kGPU).item(), 2.5);
}

// Every fp16 and bf16 bit pattern through the device's loads (a cast kernel to fp32), and fp32
// values around every rounding case through its stores, against the CPU's conversions. Run in
// kernels, so that on a GPU it is nvcc's device code that is checked.
TEST_F(CudaVsCpu, DeviceLoadsAndStoresMatchTheCpuConversionsBitForBit) {
  for (DType narrow : {DType::f16, DType::bf16}) {
    std::vector<double> patterns;
    Tensor bits = empty({65536}, narrow);
    for (uint32_t b = 0; b < 65536; ++b) static_cast<uint16_t*>(bits.data_ptr())[b] = static_cast<uint16_t>(b);
    Tensor c = empty({65536}, DType::f32), g = empty({65536}, DType::f32, kGPU);
    cpu().cast(bits, c);
    gpu().cast(bits.to(kGPU), g);
    EXPECT_TRUE(matches(g, c, 0)) << "load " << dtype_name(narrow);
    // Stores: fp32 values at, just below and just above every representable value's halfway points.
    Tensor wide = empty({65536 * 3}, DType::f32);
    for (uint32_t b = 0; b < 65536; ++b) {
      const float v = c.data<float>()[b];
      float* w = wide.data<float>() + 3 * b;
      w[0] = v;
      w[1] = std::nextafter(v, std::numeric_limits<float>::infinity());
      w[2] = std::nextafter(v, -std::numeric_limits<float>::infinity());
    }
    Tensor cn = empty({65536 * 3}, narrow), gn = empty({65536 * 3}, narrow, kGPU);
    cpu().cast(wide, cn);
    gpu().cast(wide.to(kGPU), gn);
    EXPECT_TRUE(matches(gn, cn, 0)) << "store " << dtype_name(narrow);
  }
}

// Polling a read-back that is not ready must leave nothing in CUDA's last-error slot: the next
// launch check would report the NotReady as an error (every step of --device cuda died at step 2).
TEST_F(CudaVsCpu, PollingAReadbackLeavesNoErrorForTheNextLaunch) {
  Tensor busy = empty({1 << 22}, DType::f32, kGPU);
  gpu_memory().fill(busy, 1.0);  // the read-back queues behind this
  Tensor x = full({1}, 3.0, DType::f32, kGPU), y = empty({8}, DType::f32, kGPU);
  auto rb = gpu_memory().start_readback({x});
  const bool was_ready = rb->ready();
  EXPECT_NO_THROW(gpu_memory().fill(y, 2.0));
  EXPECT_EQ(rb->values(), std::vector<double>{3.0});
  if (emulated_device_counters()) {
    EXPECT_FALSE(was_ready) << "the emulated device ran the fill at once";
  }
}

// Read-backs are made every step: they must neither allocate pinned memory nor synchronise (the
// old one called cudaMallocHost and, on destruction, cudaFreeHost, which waits for the device).
TEST_F(CudaVsCpu, ReadbacksNeitherAllocateNorSynchronise) {
  const auto before = emulated_device_counters();
  if (!before) GTEST_SKIP() << "host synchronisations are counted on the emulated GPU only";
  Tensor x = full({1}, 5.0, DType::f32, kGPU);
  for (int step = 0; step < 20; ++step) {
    auto late = gpu_memory().start_readback({x, x});
    auto unread = gpu_memory().start_readback({x});  // dropped without being read
  }
  const auto after = emulated_device_counters();
  EXPECT_EQ(after->host_syncs - before->host_syncs, 0);
  auto rb = gpu_memory().start_readback({x});
  EXPECT_EQ(rb->values(), std::vector<double>{5.0});
}

// A read-back of more values than the first slots hold (a multi-task step reads a loss a task: more
// than 16 values were refused, and every step of --model mtl --tasks 12 or more died on a GPU).
TEST_F(CudaVsCpu, AReadbackTakesAnyNumberOfValues) {
  std::vector<Tensor> many;
  std::vector<double> want;
  for (int i = 0; i < 105; ++i) {
    many.push_back(full({1}, i + 0.5, DType::f32, kGPU));
    want.push_back(i + 0.5);
  }
  {
    auto small = gpu_memory().start_readback({many[0]});  // a free slot of the smallest size, after this
    EXPECT_EQ(small->values(), std::vector<double>{0.5});
  }
  auto rb = gpu_memory().start_readback(many);  // too many for that slot: another, as large as asked
  EXPECT_EQ(rb->values(), want);
  auto small = gpu_memory().start_readback({many[3]});  // while the large one is busy
  EXPECT_EQ(small->values(), std::vector<double>{3.5});
}

// fp16 GEMMs accumulate in fp32 and round once into fp16. cuBLAS may otherwise split k and round
// each partial sum into fp16 (reduced-precision reduction), which cuda_context.cpp disallows.
// Reference: the exact sum of the fp16 products; wherever it is not so close to a halfway point
// between fp16 values that fp32 accumulation error could cross it, the result must be its rounding.
// --allow-tf32: an fp32 product's inputs are rounded to TF32's 10 mantissa bits first (each term then
// within about 2^-10 of the exact one), sums in fp32. Off, the default: within fp32's bound. On, the
// product departs from the fp32 one by more than fp32's bound somewhere (the setting reached cuBLAS).
TEST_F(CudaVsCpu, Fp32ProductsInTf32OnlyWhenAllowed) {
  const int64_t m = 48, n = 40, k = 256;
  const Tensor a = random_cpu({m, k}, DType::f32, 71, -1.0, 1.0), b = random_cpu({k, n}, DType::f32, 72, -1.0, 1.0);
  const std::vector<double> av = a.to_vector(), bv = b.to_vector();
  Tensor off = empty({m, n}, DType::f32, kGPU), on = empty({m, n}, DType::f32, kGPU);
  gpu().gemm(false, false, 1.0f, a.to(kGPU), b.to(kGPU), 0.0f, off);
  cuda_set_allow_tf32(true);
  gpu().gemm(false, false, 1.0f, a.to(kGPU), b.to(kGPU), 0.0f, on);
  cuda_set_allow_tf32(false);
  const std::vector<double> ov = off.to(kCPU).to_vector(), tv = on.to(kCPU).to_vector();
  int beyond_fp32 = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0, abs_sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double t = av[static_cast<size_t>(i * k + p)] * bv[static_cast<size_t>(p * n + j)];
        exact += t;
        abs_sum += std::fabs(t);
      }
      const size_t at = static_cast<size_t>(i * n + j);
      const double fp32_bound = static_cast<double>(k + 1) * 0x1p-24 * abs_sum;
      ASSERT_LE(std::fabs(ov[at] - exact), fp32_bound) << "TF32 off, element (" << i << ", " << j << ")";
      ASSERT_LE(std::fabs(tv[at] - exact), 0x1p-10 * abs_sum + fp32_bound) << "TF32 on, element (" << i << ", " << j << ")";
      if (std::fabs(tv[at] - exact) > fp32_bound) ++beyond_fp32;
    }
  EXPECT_GT(beyond_fp32, 0) << "no product is less exact than fp32 with TF32 allowed: the setting did not reach cuBLAS";
}

TEST_F(CudaVsCpu, HalfGemmAccumulatesInFp32AndRoundsOnce) {
  const int64_t m = 48, n = 40, k = 1024;
  const Tensor a = random_cpu({m, k}, DType::f16, 61, 0.0, 1.0), b = random_cpu({k, n}, DType::f16, 62, 0.0, 1.0);
  Tensor g = empty({m, n}, DType::f16, kGPU);
  gpu().gemm(false, false, 1.0f, a.to(kGPU), b.to(kGPU), 0.0f, g);
  const std::vector<double> av = a.to_vector(), bv = b.to_vector(), gv = g.to(kCPU).to_vector();
  int checked = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0, abs_sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        exact += av[static_cast<size_t>(i * k + p)] * bv[static_cast<size_t>(p * n + j)];
        abs_sum += std::fabs(av[static_cast<size_t>(i * k + p)] * bv[static_cast<size_t>(p * n + j)]);
      }
      const double slack = static_cast<double>(k) * 0x1p-24 * abs_sum;  // fp32 accumulation, any order
      auto to_half = [](double v) { return Elem<Half>::load(Elem<Half>::store(static_cast<float>(v))); };
      if (to_half(exact - slack) != to_half(exact + slack)) continue;  // too close to call
      ++checked;
      ASSERT_EQ(gv[static_cast<size_t>(i * n + j)], to_half(exact)) << "element (" << i << ", " << j << ")";
    }
  EXPECT_GT(checked, m * n / 2);
}

// Norms, clipping and the finite check take floating tensors only, as on the CPU; an int64 tensor is
// refused before anything runs (it used to get no block, leaving the norm's partial slots unwritten).
TEST_F(CudaVsCpu, MultiTensorOpsRefuseNonFloatingTensors) {
  const std::vector<Tensor> mixed = {ones({70000}, DType::f32, kGPU), zeros({70000}, DType::i64, kGPU)};
  Tensor out = zeros({1}, DType::f32, kGPU);
  EXPECT_THROW(gpu().norm_accumulate(mixed, 2.0, out), std::invalid_argument);
  EXPECT_THROW(gpu().check_finite(mixed, Tensor(), out), std::invalid_argument);
  const std::vector<Tensor> mixed_cpu = {ones({7}, DType::f32), zeros({7}, DType::i64)};
  Tensor out_cpu = zeros({1}, DType::f32);
  EXPECT_THROW(cpu().norm_accumulate(mixed_cpu, 2.0, out_cpu), std::invalid_argument);
}

// --- the transformer primitives

// The embedding's rows added into a gradient another use made first (a tied classifier's): each
// named row's sum rounded as the zeroed table would hold it, then added: the bits of embedding_backward
// into zeros then add(), in every dtype (16-bit ones round twice). In a tied model (GPT's wte: autocast's
// bf16 copy made first, or by the classifier; fp16's, its gradient cast where it is taken) the zeroed table and the engine's add are gone: the
// backward launches one kernel fewer than with two tables (no fill; two tables need no add), where
// the engine's add would make it one more, and the gradient is the two tables' added, bit for bit.
TEST_F(CudaVsCpu, EmbeddingRowsAddIntoATiedClassifiersGradient) {
  for (DType dt : kFloatTypes) {
    const int64_t V = 40, C = 37, N = 300;
    std::vector<int64_t> ix(static_cast<size_t>(N));
    for (size_t i = 0; i < ix.size(); ++i) ix[i] = static_cast<int64_t>((i * i * 7 + 3) % static_cast<size_t>(V));
    const Tensor idx = from_int64(ix, {N}, kGPU), g = random_cpu({N, C}, dt, 64).to(kGPU);
    const Tensor so_far = random_cpu({V, C}, dt, 65).to(kGPU);
    Tensor zeroed = zeros({V, C}, dt, kGPU), fused = so_far.clone();
    gpu().embedding_backward(g, idx, zeroed);
    gpu().embedding_backward_add(g, idx, fused);
    EXPECT_TRUE(test::bitwise_equal(fused.to(kCPU), add(so_far, zeroed).to(kCPU))) << dtype_name(dt);
  }
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  const Tensor table = random_cpu({50, 16}, DType::f32, 66), probe = random_cpu({24, 50}, DType::f32, 67).to(kGPU);
  const Tensor x0 = random_cpu({2, 16}, DType::f32, 68).to(kGPU);
  std::vector<int64_t> ix;
  for (int64_t i = 0; i < 24; ++i) ix.push_back((i * 5) % 17);
  const Tensor idx = from_int64(ix, {24}, kGPU);
  for (int mode = 0; mode < 3; ++mode) {
    const bool copy_first = mode != 1;
    const DType amp = mode == 2 ? DType::f16 : DType::bf16;
    SCOPED_TRACE(std::string(dtype_name(amp)) + (copy_first ? ": the copy made first" : ": the copy made by the classifier"));
    auto backward_launches = [&](const Tensor& emb_w, const Tensor& cls_w) {
      autocast ac(DeviceType::cuda, amp, true, true, CastLists::cuda);
      if (copy_first) (void)linear(x0, cls_w, Tensor());
      const Tensor logits = linear(mul(embedding(emb_w, idx), 2.0), cls_w, Tensor());
      const Tensor loss = sum(mul(logits.to(DType::f32), probe));
      const int64_t before = launches();
      loss.backward();
      return launches() - before;
    };
    const Tensor w = table.to(kGPU).set_requires_grad(true);
    const int64_t tied = backward_launches(w, w);
    const Tensor w1 = table.to(kGPU).set_requires_grad(true), w2 = table.to(kGPU).set_requires_grad(true);
    const int64_t apart = backward_launches(w1, w2);
    EXPECT_TRUE(test::bitwise_equal(w.grad().to(kCPU), add(w1.grad(), w2.grad()).to(kCPU)));
    if (emulated_device_counters()) {
      EXPECT_EQ(tied, apart - 1);
    }
  }
}

TEST_F(CudaVsCpu, EmbeddingAndItsScatterAddBackward) {
  // {vocab, columns, indices, index pattern}: repeats spread over the sorted positions; few rows in
  // long runs that cross many of the backward's chunks of sorted positions (the emulated GPU's 2
  // SMs: chunks of about n / 32) and more columns than a tile; an index out of range (skipped);
  // distinct rows.
  struct Case { int64_t V, C, N; int pattern; };
  for (const Case k : {Case{37, 19, 300, 0}, Case{5, 70, 1001, 1}, Case{1000, 33, 45, 2}}) {
    for (DType dt : kFloatTypes) {
      const int64_t V = k.V, C = k.C, N = k.N;
      const Tensor w = random_cpu({V, C}, dt, 61);
      std::vector<int64_t> ix(static_cast<size_t>(N));
      for (size_t i = 0; i < ix.size(); ++i)
        ix[i] = k.pattern == 0 ? static_cast<int64_t>((i * i * 7 + 3) % static_cast<size_t>(V))
                : k.pattern == 1 ? (i % 97 == 13 ? -1 : static_cast<int64_t>((i * 3) % static_cast<size_t>(V)))
                                 : static_cast<int64_t>((i * 17) % static_cast<size_t>(V));
      const Tensor idx = from_int64(ix, {N});
      if (k.pattern != 1) {  // the forward of an index out of range differs (NaN; the CPU throws)
        Tensor c = empty({N, C}, dt), g = empty({N, C}, dt, kGPU);
        cpu().embedding(w, idx, c);
        gpu().embedding(w.to(kGPU), idx.to(kGPU), g);
        EXPECT_TRUE(matches(g, c, 0)) << dtype_name(dt);
      }
      // Added into a gradient that is not zero. The CPU adds the rows in the order of n, rounding
      // into dtype at each addition; the GPU sums each row's run in the compute type (fp32; fp64
      // for f64) in the order of n and adds it once: not bit-identical. Per element, with m the
      // rows added to it and S = |w0| + sum|g|, each side is within m (u + u_c) S of the exact sum
      // (u the dtype's unit roundoff, u_c the compute type's), plus one ulp of the final rounding.
      const Tensor grad = random_cpu({N, C}, dt, 62), w0 = random_cpu({V, C}, dt, 63);
      Tensor cw = random_cpu({V, C}, dt, 63), gw = w0.to(kGPU);  // w0's values; to(kCPU) would share its storage
      cpu().embedding_backward(grad, idx, cw);
      gpu().embedding_backward(grad.to(kGPU), idx.to(kGPU), gw);
      const std::vector<double> gv = grad.to_vector(), w0v = w0.to_vector(), cv = cw.to_vector();
      const std::vector<double> gpv = gw.to(kCPU).to_vector();
      std::vector<double> mass(w0v.size()), count(w0v.size(), 0);
      for (size_t i = 0; i < w0v.size(); ++i) mass[i] = std::fabs(w0v[i]);
      for (int64_t n = 0; n < N; ++n) {
        const int64_t v = ix[static_cast<size_t>(n)];
        if (v < 0 || v >= V) continue;
        for (int64_t c = 0; c < C; ++c) {
          mass[static_cast<size_t>(v * C + c)] += std::fabs(gv[static_cast<size_t>(n * C + c)]);
          count[static_cast<size_t>(v * C + c)] += 1;
        }
      }
      const double u = dt == DType::f64 ? 0x1p-53 : dt == DType::f32 ? 0x1p-24 : dt == DType::f16 ? 0x1p-11 : 0x1p-8;
      const double uc = dt == DType::f64 ? 0x1p-53 : 0x1p-24;
      int bad = 0;
      for (size_t i = 0; i < cv.size() && bad < 5; ++i) {
        const double bound = 2 * (count[i] + 1) * (u + uc) * mass[i] + ulp_of(cv[i], dt);
        if (!(std::fabs(gpv[i] - cv[i]) <= bound)) {
          ++bad;
          ADD_FAILURE() << "embedding_backward " << dtype_name(dt) << " V=" << V << " C=" << C << " N=" << N
                        << ": element " << i << ": cuda " << gpv[i] << " vs cpu " << cv[i] << " > " << bound;
        }
      }
      // Deterministic: the same bits a second time.
      Tensor again = w0.to(kGPU);
      gpu().embedding_backward(grad.to(kGPU), idx.to(kGPU), again);
      EXPECT_TRUE(matches(again, gw, 0)) << dtype_name(dt);
    }
  }
  // An index out of range cannot throw from the device: its row is NaN (the CPU throws).
  Tensor g = empty({2, 3}, DType::f32, kGPU);
  gpu().embedding(ones({4, 3}, DType::f32, kGPU), from_int64({1, 4}, {2}, kGPU), g);
  const std::vector<double> v = g.to_vector();
  EXPECT_EQ(v[0], 1.0);
  EXPECT_TRUE(std::isnan(v[3]));
  Tensor c = empty({2, 3});
  EXPECT_THROW(cpu().embedding(ones({4, 3}), from_int64({1, 4}, {2}), c), std::out_of_range);
}

TEST_F(CudaVsCpu, LayerNormForwardAndBackward) {
  for (DType dt : kFloatTypes) {
    // Odd shapes, and ones of more rows than a block takes (the emulated GPU's 2 SMs: 8 blocks of
    // the rows, partial sums added in a second pass), more columns than a block's threads, and more
    // than the one-pass backward takes (2100: the input's gradient and the parameters' apart).
    for (const Shape& s : {Shape{7, 1}, Shape{33, 48}, Shape{3, 5, 300}, Shape{1001, 45}, Shape{3, 233, 37},
                           Shape{9, 2100}}) {
      const int64_t C = s.back(), rows = shape_numel(s) / C;
      const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
      const Tensor x = random_cpu(s, dt, 71, -3, 5), w = random_cpu({C}, dt, 72), b = random_cpu({C}, dt, 73);
      Tensor cy = empty(s, dt), cm = empty({rows}, st), cr = empty({rows}, st);
      Tensor gy = empty(s, dt, kGPU), gm = empty({rows}, st, kGPU), gr = empty({rows}, st, kGPU);
      cpu().layer_norm(x, w, b, 1e-5, cy, cm, cr);
      gpu().layer_norm(x.to(kGPU), w.to(kGPU), b.to(kGPU), 1e-5, gy, gm, gr);
      // Statistics are fp64 sums of C terms in two orders (they differ by up to 2 C 2^-53 of the
      // sum of |x|, and |x| <= 5 here while |mean| >= ~1/4 of it), rounded once into the compute
      // type; the element math is shared, so y differs only through them, plus one rounding into
      // a 16-bit dtype.
      const double u = dt == DType::f64 ? 0x1p-52 : 0x1p-23;
      const double storage = dt == DType::f16 ? 0x1p-10 : dt == DType::bf16 ? 0x1p-7 : 0.0;
      const double stats = 2 * u + 8.0 * static_cast<double>(C) * 0x1p-53;
      EXPECT_TRUE(matches(gm, cm, stats)) << dtype_name(dt) << shape_str(s);
      EXPECT_TRUE(matches(gr, cr, stats)) << dtype_name(dt) << shape_str(s);
      EXPECT_TRUE(matches(gy, cy, 16 * u + 8 * stats + storage)) << dtype_name(dt) << shape_str(s);

      const Tensor grad = random_cpu(s, dt, 74);
      Tensor cgx = empty(s, dt), cgw = empty({C}, dt), cgb = empty({C}, dt);
      Tensor ggx = empty(s, dt, kGPU), ggw = empty({C}, dt, kGPU), ggb = empty({C}, dt, kGPU);
      cpu().layer_norm_backward(grad, x, w, cm, cr, cgx, cgw, cgb, false);
      gpu().layer_norm_backward(grad.to(kGPU), x.to(kGPU), w.to(kGPU), cm.to(kGPU), cr.to(kGPU), ggx, ggw, ggb, false);
      // The parameters' gradients are column sums over the rows: the CPU's in fp64 in row order, the
      // GPU's in tiles, accumulating in the compute type (fp32; fp64 for f64) in a fixed order of
      // splits (not bit-identical: a per-element bound). Any order of summation of `rows` terms t
      // in unit roundoff u is within rows u sum|t| of the exact sum (2 u more for the product and the
      // fp32 rounding), then both round into dtype: one ulp of it.
      {
        const std::vector<double> gv = grad.to_vector(), xv = x.to_vector(), mv = cm.to_vector(), rv = cr.to_vector();
        const std::vector<double> cw = cgw.to_vector(), cb = cgb.to_vector();
        const std::vector<double> gpw = ggw.to(kCPU).to_vector(), gpb = ggb.to(kCPU).to_vector();
        const double uc = dt == DType::f64 ? 0x1p-53 : 0x1p-24;
        for (int64_t c = 0; c < C; ++c) {
          double aw = 0, ab = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const size_t i = static_cast<size_t>(r * C + c);
            aw += std::fabs(gv[i] * (xv[i] - mv[static_cast<size_t>(r)]) * rv[static_cast<size_t>(r)]);
            ab += std::fabs(gv[i]);
          }
          const size_t k = static_cast<size_t>(c);
          const double bw = (static_cast<double>(rows) + 2) * uc * aw + uc * std::fabs(cw[k]) + ulp_of(cw[k], dt);
          const double bb = (static_cast<double>(rows) + 2) * uc * ab + uc * std::fabs(cb[k]) + ulp_of(cb[k], dt);
          EXPECT_LE(std::fabs(gpw[k] - cw[k]), bw) << "gw[" << c << "] " << dtype_name(dt) << shape_str(s);
          EXPECT_LE(std::fabs(gpb[k] - cb[k]), bb) << "gb[" << c << "] " << dtype_name(dt) << shape_str(s);
        }
      }
      EXPECT_TRUE(matches(ggx, cgx, (4.0 * static_cast<double>(C) + 16.0) * u + storage)) << dtype_name(dt) << shape_str(s);
    }
  }
}

// The shapes reach both kernels: rows of 16-byte packs where the innermost dims stay (a run of 8 or
// 16 elements, or 20 for 4- and 8-byte types, or the whole tensor), element by element elsewhere.
// LayerNorm with autocast's casts in its passes: the output written straight in the next linear's
// dtype, the backward reading the gradient in it. Bit for bit the separate passes on the same device
// (layer_norm then cast; cast then layer_norm_backward), in one launch forward; fp64 into fp32
// included, whose output is rounded twice (to fp64, then fp32) as the passes do.
TEST_F(CudaVsCpu, LayerNormCastsInItsPassesBitForBit) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (const auto& [dt, low] : {std::pair{DType::f32, DType::bf16}, std::pair{DType::f32, DType::f16},
                                std::pair{DType::f64, DType::f32}}) {
    for (const Shape& s : {Shape{33, 48}, Shape{1001, 45}, Shape{3, 7, 300}}) {
      const int64_t C = s.back(), rows = shape_numel(s) / C;
      const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
      const Tensor x = random_cpu(s, dt, 75, -3, 5).to(kGPU), w = random_cpu({C}, dt, 76).to(kGPU);
      const Tensor b = random_cpu({C}, dt, 77).to(kGPU);
      Tensor wide = empty(s, dt, kGPU), want = empty(s, low, kGPU), got = empty(s, low, kGPU);
      Tensor m1 = empty({rows}, st, kGPU), r1 = empty({rows}, st, kGPU), m2 = empty({rows}, st, kGPU), r2 = empty({rows}, st, kGPU);
      gpu().layer_norm(x, w, b, 1e-5, wide, m1, r1);
      gpu().cast(wide, want);
      const int64_t before = launches();
      gpu().layer_norm_cast(x, w, b, 1e-5, got, m2, r2);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before, 1) << "one pass";
      }
      EXPECT_TRUE(matches(got, want, 0)) << dtype_name(dt) << " into " << dtype_name(low) << shape_str(s);
      EXPECT_TRUE(matches(m2, m1, 0) && matches(r2, r1, 0));

      const Tensor g = random_cpu(s, low, 78).to(kGPU);
      Tensor g_wide = empty(s, dt, kGPU);
      gpu().cast(g, g_wide);
      Tensor gx1 = empty(s, dt, kGPU), gw1 = empty({C}, dt, kGPU), gb1 = empty({C}, dt, kGPU);
      Tensor gx2 = empty(s, dt, kGPU), gw2 = empty({C}, dt, kGPU), gb2 = empty({C}, dt, kGPU);
      gpu().layer_norm_backward(g_wide, x, w, m1, r1, gx1, gw1, gb1, false);
      gpu().layer_norm_backward_cast(g, x, w, m1, r1, gx2, gw2, gb2, false, Tensor());
      EXPECT_TRUE(matches(gx2, gx1, 0)) << dtype_name(dt) << " from " << dtype_name(low) << shape_str(s);
      EXPECT_TRUE(matches(gw2, gw1, 0)) << dtype_name(dt) << " from " << dtype_name(low) << shape_str(s);
      EXPECT_TRUE(matches(gb2, gb1, 0)) << dtype_name(dt) << " from " << dtype_name(low) << shape_str(s);
    }
  }
}

// LayerNorm's backward adding into the residual stream's gradient (the add's, which reaches x first):
// bit for bit the separate passes on the device (the backward, then the add), every float dtype; and
// in a block under bf16 autocast, every gradient bit for bit the control's (LayerNorm reading x through
// an identity of its own, so the engine adds), with the add's launch gone: the control's backward
// makes two launches more (the identity's backward and the add), not one.
TEST_F(CudaVsCpu, LayerNormAddsIntoTheResidualStreamsGradient) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const Shape s{37, 300};
    const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
    const Tensor x = random_cpu(s, dt, 85, -3, 5).to(kGPU), w = random_cpu({300}, dt, 86).to(kGPU);
    const Tensor g = random_cpu(s, dt, 87).to(kGPU), so_far = random_cpu(s, dt, 88).to(kGPU);
    Tensor y = empty(s, dt, kGPU), mean = empty({37}, st, kGPU), rstd = empty({37}, st, kGPU);
    gpu().layer_norm(x, w, w, 1e-5, y, mean, rstd);
    Tensor gx = empty(s, dt, kGPU), gw = empty({300}, dt, kGPU), gb = empty({300}, dt, kGPU);
    gpu().layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb, false);
    Tensor want = empty(s, dt, kGPU);
    gpu().binary(BinaryOp::add, so_far, gx, want);
    Tensor acc = so_far.clone();
    gpu().layer_norm_backward(g, x, w, mean, rstd, acc, gw, gb, true);
    EXPECT_TRUE(matches(acc, want, 0)) << dtype_name(dt);
  }
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  const Tensor x = random_cpu({4, 16, 64}, DType::f32, 89, -3, 3).to(kGPU).set_requires_grad(true);
  const Tensor w = random_cpu({64}, DType::f32, 90, 0.5, 1.5).to(kGPU).set_requires_grad(true);
  const Tensor b = random_cpu({64}, DType::f32, 91).to(kGPU).set_requires_grad(true);
  const Tensor lw = random_cpu({64, 64}, DType::f32, 92, -0.2, 0.2).to(kGPU).set_requires_grad(true);
  const Tensor probe = random_cpu({4, 16, 64}, DType::f32, 93).to(kGPU);
  const auto block = [&](const Tensor& ln_input) {
    autocast ac(DeviceType::cuda, DType::bf16, true, true, CastLists::cuda);
    return add(x, linear(layer_norm_into_linear(ln_input, w, b, 1e-5, lw), lw, Tensor()));
  };
  const Tensor fused_loss = sum(mul(block(x), probe)), control_loss = sum(mul(block(mul(x, 1.0)), probe));
  int64_t before = launches();
  const std::vector<Tensor> gf = grad({fused_loss}, {x, w, b, lw});
  const int64_t fused_launches = launches() - before;
  before = launches();
  const std::vector<Tensor> gc = grad({control_loss}, {x, w, b, lw});
  const int64_t control_launches = launches() - before;
  for (size_t i = 0; i < gf.size(); ++i) EXPECT_TRUE(matches(gf[i], gc[i], 0)) << "input " << i;
  if (emulated_device_counters()) {
    EXPECT_EQ(control_launches - fused_launches, 2);
  }
}

// LayerNorm's backward writing the residual gradient's cast for the branch (gx_low): bit for bit
// cast(gx) after the pass, with and without accumulating, into bf16 and fp16; in the one pass (rows
// up to 2048 wide, fp32 x) with no launch of its own, elsewhere (a 2100-wide row, fp64 x) cast after.
TEST_F(CudaVsCpu, LayerNormBackwardWritesTheBranchsCastOfItsGradient) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (const auto& [dt, s] : {std::pair{DType::f32, Shape{37, 300}}, std::pair{DType::f32, Shape{9, 2100}},
                              std::pair{DType::f64, Shape{37, 300}}}) {
    const int64_t C = s.back(), rows = shape_numel(s) / C;
    const bool one_pass = dt == DType::f32 && C <= 2048;
    const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
    const Tensor x = random_cpu(s, dt, 131, -3, 5).to(kGPU), w = random_cpu({C}, dt, 132).to(kGPU);
    const Tensor g = random_cpu(s, DType::bf16, 133).to(kGPU), so_far = random_cpu(s, dt, 134, -50, 50).to(kGPU);
    Tensor y = empty(s, dt, kGPU), mean = empty({rows}, st, kGPU), rstd = empty({rows}, st, kGPU);
    gpu().layer_norm(x, w, w, 1e-5, y, mean, rstd);
    for (DType low_dt : {DType::bf16, DType::f16}) {
      for (bool accumulate : {false, true}) {
        Tensor gx = so_far.clone(), gw = empty({C}, dt, kGPU), gb = empty({C}, dt, kGPU), low = empty(s, low_dt, kGPU);
        Tensor gx_plain = so_far.clone(), gw_plain = empty({C}, dt, kGPU), gb_plain = empty({C}, dt, kGPU);
        int64_t before = launches();
        gpu().layer_norm_backward_cast(g, x, w, mean, rstd, gx_plain, gw_plain, gb_plain, accumulate, Tensor());
        const int64_t plain = launches() - before;
        before = launches();
        gpu().layer_norm_backward_cast(g, x, w, mean, rstd, gx, gw, gb, accumulate, low);
        const int64_t with_low = launches() - before;
        Tensor want = empty(s, low_dt, kGPU);
        gpu().cast(gx, want);
        EXPECT_TRUE(matches(low, want, 0)) << dtype_name(dt) << shape_str(s) << " into " << dtype_name(low_dt);
        EXPECT_TRUE(matches(gx, gx_plain, 0) && matches(gw, gw_plain, 0) && matches(gb, gb_plain, 0));
        if (emulated_device_counters()) {
          EXPECT_EQ(with_low - plain, one_pass ? 0 : 1) << dtype_name(dt) << shape_str(s);
        }
      }
    }
    Tensor gx = empty(s, dt, kGPU), gw = empty({C}, dt, kGPU), gb = empty({C}, dt, kGPU), wrong = empty({rows, C + 1}, DType::bf16, kGPU);
    EXPECT_THROW(gpu().layer_norm_backward_cast(g, x, w, mean, rstd, gx, gw, gb, false, wrong), std::invalid_argument);
  }
}

// The residual add and the LayerNorm after it in one launch: the sum and the output bit for bit the
// separate passes' (add_cast or add, then layer_norm_cast: the Backend's default), statistics too;
// an fp32 stream with a bf16, fp16 or fp32 branch into bf16, fp16 or fp32, and fp64 with fp32.
TEST_F(CudaVsCpu, AddThenLayerNormInOnePassBitForBit) {
  const auto launches = [] { return emulated_device_counters() ? emulated_device_counters()->launches : 0; };
  for (const auto& [dt, branch, out] : {std::tuple{DType::f32, DType::bf16, DType::bf16},
                                        std::tuple{DType::f32, DType::f16, DType::f16},
                                        std::tuple{DType::f32, DType::f32, DType::f32},
                                        std::tuple{DType::f32, DType::bf16, DType::f32},
                                        std::tuple{DType::f64, DType::f32, DType::f32}}) {
    for (const Shape& s : {Shape{33, 48}, Shape{3, 7, 300}, Shape{5, 1030}}) {
      const int64_t C = s.back(), rows = shape_numel(s) / C;
      const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
      const Tensor a = random_cpu(s, dt, 95, -3, 5).to(kGPU), b = random_cpu(s, branch, 96, -2, 2).to(kGPU);
      const Tensor w = random_cpu({C}, dt, 97).to(kGPU), bias = random_cpu({C}, dt, 98).to(kGPU);
      Tensor h1 = empty(s, dt, kGPU), y1 = empty(s, out, kGPU), m1 = empty({rows}, st, kGPU), r1 = empty({rows}, st, kGPU);
      Tensor h2 = empty(s, dt, kGPU), y2 = empty(s, out, kGPU), m2 = empty({rows}, st, kGPU), r2 = empty({rows}, st, kGPU);
      gpu().Backend::add_layer_norm_cast(a, b, w, bias, 1e-5, h1, y1, m1, r1);
      const int64_t before = launches();
      gpu().add_layer_norm_cast(a, b, w, bias, 1e-5, h2, y2, m2, r2);
      if (emulated_device_counters()) {
        EXPECT_EQ(launches() - before, 1) << "one pass";
      }
      const std::string what = std::string(dtype_name(dt)) + " + " + dtype_name(branch) + " into " + dtype_name(out) + shape_str(s);
      EXPECT_TRUE(matches(h2, h1, 0)) << what;
      EXPECT_TRUE(matches(y2, y1, 0)) << what;
      EXPECT_TRUE(matches(m2, m1, 0) && matches(r2, r1, 0)) << what;
    }
  }
  // Refused: a branch wider than the stream (add() would widen the sum), and shapes that differ.
  const Tensor a = random_cpu({4, 64}, DType::f32, 99).to(kGPU), w = random_cpu({64}, DType::f32, 100).to(kGPU);
  Tensor h = empty({4, 64}, DType::f32, kGPU), y = empty({4, 64}, DType::bf16, kGPU);
  Tensor m = empty({4}, DType::f32, kGPU), r = empty({4}, DType::f32, kGPU);
  EXPECT_THROW(gpu().add_layer_norm_cast(a, random_cpu({4, 64}, DType::f64, 101).to(kGPU), w, w, 1e-5, h, y, m, r),
               std::invalid_argument);
  EXPECT_THROW(gpu().add_layer_norm_cast(a, random_cpu({2, 128}, DType::f32, 102).to(kGPU), w, w, 1e-5, h, y, m, r),
               std::invalid_argument);
}

TEST_F(CudaVsCpu, PermuteEveryOrderOfFourDims) {
  for (const Shape& s : {Shape{2, 3, 4, 5}, Shape{2, 3, 5, 8}, Shape{3, 2, 4, 16}})
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i64}) {
    Tensor x = empty(s, dt);
    host_memory().fill(x, 0);
    if (dt == DType::i64)
      for (int64_t i = 0; i < x.numel(); ++i) x.data<int64_t>()[i] = i;
    else
      x = random_cpu(s, dt, 81);
    std::vector<int64_t> perm = {0, 1, 2, 3};
    do {
      Shape os(4);
      for (size_t d = 0; d < 4; ++d) os[d] = s[static_cast<size_t>(perm[d])];
      Tensor c = empty(os, dt), g = empty(os, dt, kGPU);
      cpu().permute(x, perm, c);
      gpu().permute(x.to(kGPU), perm, g);
      ASSERT_TRUE(matches(g, c, 0)) << dtype_name(dt) << shape_str(s) << " " << perm[0] << perm[1] << perm[2] << perm[3];
    } while (std::next_permutation(perm.begin(), perm.end()));
  }
}

TEST_F(CudaVsCpu, DropoutMaskUsesTheSameCounterStream) {
  for (DType dt : kFloatTypes) {
    Tensor c = empty({5000}, dt), g = empty({5000}, dt, kGPU);
    cpu().dropout_mask(c, 9, 1234, 0.3);
    gpu().dropout_mask(g, 9, 1234, 0.3);
    EXPECT_TRUE(matches(g, c, 0)) << dtype_name(dt);
    // Counters from a device base (base[0] * per_base, read by the kernel): the same stream as the
    // offset 1234 = 4 + 41 * 30 given on the host; a different base, a different mask.
    Tensor base_c = from_int64({41}, {1}), base_g = base_c.to(kGPU);
    Tensor cb = empty({5000}, dt), gb = empty({5000}, dt, kGPU);
    cpu().dropout_mask(cb, 9, 4, 0.3, base_c, 30);
    gpu().dropout_mask(gb, 9, 4, 0.3, base_g, 30);
    EXPECT_TRUE(matches(gb, c, 0)) << dtype_name(dt);
    EXPECT_TRUE(matches(cb, c, 0)) << dtype_name(dt);
    fill_(base_g, 42.0);
    gpu().dropout_mask(gb, 9, 4, 0.3, base_g, 30);
    EXPECT_FALSE(matches(gb, c, 0)) << dtype_name(dt);
    // A base that is not one int64 on the mask's device is refused, naming it.
    for (Backend* be : {&cpu(), &gpu()}) {
      Tensor& m = be == &cpu() ? cb : gb;
      const Device d = m.device(), other = be == &cpu() ? kGPU : kCPU;
      for (const Tensor& bad : {full({1}, 41.0, DType::f32, d), from_int64({41, 42}, {2}, d), from_int64({41}, {1}, other)}) {
        try {
          be->dropout_mask(m, 9, 4, 0.3, bad, 30);
          ADD_FAILURE() << "a bad counter base was taken on " << d.str();
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("dropout: the counter base"), std::string::npos) << e.what();
        }
      }
    }
  }
}

// An optimizer step's lr tensor that is not one float64 beside the parameters is refused, on both
// backends, naming it (the optimizers always pass their own lr_tensor).
TEST_F(CudaVsCpu, AnOptimizerStepRefusesABadLrTensor) {
  for (Backend* be : {&cpu(), &gpu()}) {
    const Device d = be == &cpu() ? kCPU : kGPU;
    const Device other = be == &cpu() ? kGPU : kCPU;
    Tensor p = ones({8}, DType::f32, d), g = ones({8}, DType::f32, d), step = zeros({1}, DType::f32, d);
    const SgdHyper h{0.1, 0.0, 0.0, 0.0, false, false};
    for (const Tensor& bad : {full({1}, 0.1, DType::f32, d), full({2}, 0.1, DType::f64, d), full({1}, 0.1, DType::f64, other)}) {
      try {
        be->sgd_step({p}, {g}, {}, step, h, Tensor(), Tensor(), {}, bad);
        ADD_FAILURE() << "a bad lr was taken on " << d.str();
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("optimizer step: lr"), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(p.to_vector()[0], 1.0) << "a refused step moved the parameters";
  }
}

// Host-to-device copies staged through pinned slots: the source may be overwritten as soon as the
// call returns (the device gets the bytes of the call), slots are reused once their copies are done,
// no copy waits for the device (a pageable copy, which may, counts as a host sync on the emulated
// GPU), and a copy while the stream captures a graph is refused with a reason.
TEST_F(CudaVsCpu, HostToDeviceCopiesGoThroughReusedPinnedSlots) {
  cuda::HostStaging staging;
  const cudaStream_t s = cuda::context().stream();
  const std::optional<DeviceCounters> before = emulated_device_counters();
  std::vector<Tensor> dst;
  std::vector<float> src;
  for (int i = 0; i < 6; ++i) {
    const int64_t n = 1000 + 30000 * i;  // 4 KB to 600 KB: several slot sizes
    src.assign(static_cast<size_t>(n), static_cast<float>(i + 1));
    dst.push_back(empty({n}, DType::f32, kGPU));
    staging.copy(dst.back().data_ptr(), src.data(), src.size() * sizeof(float), s);
    std::fill(src.begin(), src.end(), -1.0f);  // reused at once by the caller
  }
  if (before) {
    EXPECT_EQ(emulated_device_counters()->host_syncs, before->host_syncs) << "a staged copy waited for the device";
  }
  for (int i = 0; i < 6; ++i) {
    const std::vector<double> v = dst[static_cast<size_t>(i)].to_vector();
    EXPECT_EQ(v.front(), i + 1);
    EXPECT_EQ(v.back(), i + 1);
  }
  const size_t made = staging.slots();
  EXPECT_LE(made, 6u);
  for (int round = 0; round < 3; ++round)  // the copies above are done (read back): their slots serve again
    for (int i = 0; i < 6; ++i) {
      src.assign(static_cast<size_t>(1000 + 30000 * i), 7.0f);
      staging.copy(dst[static_cast<size_t>(i)].data_ptr(), src.data(), src.size() * sizeof(float), s);
      memory_for(kGPU).synchronize();
    }
  EXPECT_EQ(staging.slots(), made) << "done slots were not reused";
  EXPECT_EQ(dst[5].to_vector()[5], 7.0);
  // A copy above kMaxStagedBytes goes directly: no slot of its size is pinned for the rest of the run.
  const int64_t big = static_cast<int64_t>(cuda::HostStaging::kMaxStagedBytes / sizeof(float)) + 1;
  std::vector<float> large(static_cast<size_t>(big), 3.0f);
  Tensor large_dst = empty({big}, DType::f32, kGPU);
  staging.copy(large_dst.data_ptr(), large.data(), large.size() * sizeof(float), s);
  EXPECT_EQ(staging.slots(), made);
  EXPECT_EQ(large_dst.to_vector()[static_cast<size_t>(big - 1)], 3.0);
  if (before) {  // the emulated GPU counts what the driver may do with pageable memory
    const int64_t syncs = emulated_device_counters()->host_syncs;
    const float one = 1.0f;
    ASSERT_EQ(cudaMemcpyAsync(dst[0].data_ptr(), &one, sizeof one, cudaMemcpyHostToDevice, s), cudaSuccess);
    EXPECT_EQ(emulated_device_counters()->host_syncs, syncs + 1);
  }
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_THROW(staging.copy(dst[0].data_ptr(), src.data(), 4, s), std::logic_error);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// Causal attention written out in double from qkv [B, T, 3C] and gy [B, T, C]: y, each row's
// log-sum-exp, and the three gradients (dv_j = sum_i p_ij gy_i; ds_ij = p_ij (gy_i . v_j - gy_i .
// y_i); dq_i = scale sum_j ds_ij k_j; dk_j = scale sum_i ds_ij q_i).
struct AttentionInDouble {
  std::vector<double> y, lse, dqkv;
};
AttentionInDouble attention_in_double(const std::vector<double>& x, const std::vector<double>& g, int64_t B, int64_t T,
                                      int64_t H, int64_t D, double scale) {
  const int64_t C = H * D;
  AttentionInDouble r{std::vector<double>(static_cast<size_t>(B * T * C)), std::vector<double>(static_cast<size_t>(B * H * T)),
                      std::vector<double>(static_cast<size_t>(B * T * 3 * C), 0.0)};
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return static_cast<size_t>((b * T + t) * 3 * C + part * C + h * D + d);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> P(static_cast<size_t>(T * T), 0.0);
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> sc(static_cast<size_t>(i + 1));
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += x[at(b, i, 0, h, d)] * x[at(b, j, 1, h, d)];
          sc[static_cast<size_t>(j)] = scale * dot;
          mx = std::max(mx, scale * dot);
        }
        for (double v : sc) sum += std::exp(v - mx);
        r.lse[static_cast<size_t>((b * H + h) * T + i)] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) P[static_cast<size_t>(i * T + j)] = std::exp(sc[static_cast<size_t>(j)] - mx) / sum;
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += P[static_cast<size_t>(i * T + j)] * x[at(b, j, 2, h, d)];
          r.y[static_cast<size_t>((b * T + i) * C + h * D + d)] = acc;
        }
      }
      for (int64_t i = 0; i < T; ++i) {
        const size_t gi = static_cast<size_t>((b * T + i) * C + h * D);
        double di = 0;
        for (int64_t d = 0; d < D; ++d) di += g[gi + static_cast<size_t>(d)] * r.y[gi + static_cast<size_t>(d)];
        for (int64_t j = 0; j <= i; ++j) {
          const double p = P[static_cast<size_t>(i * T + j)];
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += g[gi + static_cast<size_t>(d)] * x[at(b, j, 2, h, d)];
          const double ds = p * (dp - di);
          for (int64_t d = 0; d < D; ++d) {
            r.dqkv[at(b, j, 2, h, d)] += p * g[gi + static_cast<size_t>(d)];
            r.dqkv[at(b, i, 0, h, d)] += scale * ds * x[at(b, j, 1, h, d)];
            r.dqkv[at(b, j, 1, h, d)] += scale * ds * x[at(b, i, 0, h, d)];
          }
        }
      }
    }
  return r;
}

// Fused attention's y, lse and dqkv within a few units of the dtype's rounding of the largest value
// (the sums are fp32; the probabilities and their gradients are rounded to the dtype before their
// products, as FlashAttention does, and each output once).
void expect_attention_close(DType dt, const Tensor& y, const Tensor& lse, const Tensor& dqkv, const AttentionInDouble& want) {
  const double u = dt == DType::f16 ? 0x1p-11 : 0x1p-8;
  auto check = [&](const std::vector<double>& got, const std::vector<double>& ref, const char* what) {
    double largest = 0;
    for (double v : ref) largest = std::max(largest, std::fabs(v));
    int bad = 0;
    for (size_t k = 0; k < ref.size() && bad < 5; ++k)
      if (!(std::fabs(got[k] - ref[k]) <= 4 * u * largest)) {
        ++bad;
        ADD_FAILURE() << what << "[" << k << "]: cuda " << got[k] << " vs " << ref[k] << " (largest " << largest << ")";
      }
  };
  check(y.to(kCPU).to_vector(), want.y, "y");
  check(lse.to(kCPU).to_vector(), want.lse, "lse");
  check(dqkv.to(kCPU).to_vector(), want.dqkv, "dqkv");
}

// Every tensor the fused attention reads or writes must start on a 16-byte boundary (our kernels read
// 16 bytes at a time; cuDNN's graphs declare every tensor so aligned): one that does not is refused
// naming it, lse too (it was not checked: cuDNN would have refused it in the backward, where the op
// cannot fall back).
TEST_F(CudaVsCpu, FusedAttentionRefusesAMisalignedTensorNamingIt) {
  const int64_t B = 1, T = 16, H = 2, D = 32, C = H * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const DType dt = DType::bf16;
  const Tensor qkv = random_cpu({B, T, 3 * C}, dt, 303).to(kGPU), gy = random_cpu({B, T, C}, dt, 304).to(kGPU);
  const Tensor lse_buffer = empty({B * H * T + 1}, DType::f32, kGPU);
  Tensor y = empty({B, T, C}, dt, kGPU), lse = empty({B, H, T}, DType::f32, kGPU),
         dqkv = empty({B, T, 3 * C}, dt, kGPU);
  Tensor lse_off = lse_buffer.view(1, {B, H, T});  // 4 bytes in
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no error");
  };
  EXPECT_NE(
      message([&] { gpu().attention_forward(qkv, H, scale, y, lse_off); }).find("lse must start on a 16-byte boundary"),
      std::string::npos);
  gpu().attention_forward(qkv, H, scale, y, lse);
  EXPECT_NE(message([&] {
              gpu().attention_backward(qkv, y, lse_off, gy, H, scale, dqkv);
            }).find("lse must start on a 16-byte boundary"),
            std::string::npos);
  EXPECT_EQ(message([&] { gpu().attention_backward(qkv, y, lse, gy, H, scale, dqkv); }), "no error");
}

// The attention backward's policy for dS's tiles (cuda_backend.h) for a scope.
struct DsPolicy {
  explicit DsPolicy(cuda::AttentionDsPolicy p) : old(cuda::set_attention_ds_policy(p)) {}
  ~DsPolicy() { cuda::set_attention_ds_policy(old); }
  DsPolicy(const DsPolicy&) = delete;
  DsPolicy& operator=(const DsPolicy&) = delete;
  cuda::AttentionDsPolicy old;
};

// Our fused attention against attention in double from the same inputs. T = 37, 70, 130 and 260:
// partial row blocks (128 rows in the forward, 64 in the backward) and key tiles, keys of one to five
// tiles (two buffers, each taken again).
TEST_F(CudaVsCpu, FusedAttentionMatchesAttentionWrittenOutInDouble) {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const auto& [B, T, H, D] : {std::array<int64_t, 4>{3, 37, 2, 32}, std::array<int64_t, 4>{1, 70, 3, 64},
                                     std::array<int64_t, 4>{3, 130, 1, 64}, std::array<int64_t, 4>{1, 260, 2, 32}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " B " + std::to_string(B) + " T " + std::to_string(T) + " H " +
                   std::to_string(H) + " D " + std::to_string(D));
      ASSERT_TRUE(gpu().has_fused_attention(dt, D));
      const int64_t C = H * D;
      const double scale = 1.0 / std::sqrt(static_cast<double>(D));
      const Tensor qkv = random_cpu({B, T, 3 * C}, dt, 301, -1.5, 1.5), gy = random_cpu({B, T, C}, dt, 302);
      Tensor y = empty({B, T, C}, dt, kGPU), lse = empty({B, H, T}, DType::f32, kGPU);
      gpu().attention_forward(qkv.to(kGPU), H, scale, y, lse);
      Tensor dqkv = empty({B, T, 3 * C}, dt, kGPU);
      gpu().attention_backward(qkv.to(kGPU), y, lse, gy.to(kGPU), H, scale, dqkv);
      const AttentionInDouble want = attention_in_double(qkv.to_vector(), gy.to_vector(), B, T, H, D, scale);
      expect_attention_close(dt, y, lse, dqkv, want);
      // The backward keeps dS's tiles (so far, in one group of every batch) or, past its policy,
      // computes them again in the dq pass, with no scratch; which, whatever the number of batches
      // (so, of ranks). Kept, it takes batches in groups as even as they go, its scratch a group's
      // tiles: the same bits. Computed again, the same bits on the
      // emulated GPU, whose mma.sync adds a product's terms in one order whichever operand is A; on a
      // GPU, within bounds. Each case names the batches a group takes (0: computed again), and the
      // scratch is exactly delta's bytes and the group's tiles (the allocator counts requested bytes).
      const int64_t tiles = (T + 63) / 64, per_batch = tiles * (tiles + 1) / 2 * 64 * 64 * 2 * H;
      const int64_t blocks = H * tiles;  // a batch's blocks
      const std::vector<std::pair<cuda::AttentionDsPolicy, int64_t>> cases = {
          {{0, 0}, 0},                                               // no scratch allowed
          {{per_batch - 1, 0}, 0},                                   // under one batch's tiles
          {{per_batch, 0}, 1},                                       // a batch a group
          {{2 * per_batch, 0}, std::min<int64_t>(B, 2)},             // B = 3: groups of 2 and 1
          {{3 * per_batch - 1, 0}, std::min<int64_t>(B, 2)},
          {{per_batch, blocks + 1}, 0},                              // too few blocks, whatever B
          {{2 * per_batch, 2 * blocks}, std::min<int64_t>(B, 2)},    // two batches' blocks: kept, B = 1 too
          {{2 * per_batch, 2 * blocks + 1}, 0},
      };
      for (const auto& [policy, group] : cases) {
        SCOPED_TRACE("dS scratch limit " + std::to_string(policy.limit_bytes) + ", at least " +
                     std::to_string(policy.min_blocks) + " blocks");
        Tensor other = empty({B, T, 3 * C}, dt, kGPU), q = qkv.to(kGPU), g = gy.to(kGPU);
        cuda::CudaBackend& memory = cuda::cuda_backend();
        memory.reset_peak_bytes();
        const size_t before = memory.current_bytes();
        {
          const DsPolicy scoped(policy);
          gpu().attention_backward(q, y, lse, g, H, scale, other);
        }
        EXPECT_EQ(static_cast<int64_t>(memory.peak_bytes() - before), 4 * B * H * T + group * per_batch);
        expect_attention_close(dt, y, lse, other, want);
#if !defined(AMP_CUDA_EMU)
        if (group == 0) continue;
#endif
        EXPECT_TRUE(matches(other, dqkv, 0));
      }
      // The op takes these kernels without dropout (--attention fused): its output and, through
      // autograd, qkv's gradient are theirs bit for bit (with dropout it takes the composite).
      Tensor leaf = qkv.to(kGPU);
      leaf.set_requires_grad(true);
      const Tensor out = causal_attention(leaf, H, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::fused});
      EXPECT_TRUE(matches(out, y, 0));
      out.backward(gy.to(kGPU));
      EXPECT_TRUE(matches(leaf.grad(), dqkv, 0));
    }
  }
  EXPECT_FALSE(gpu().has_fused_attention(DType::f32, 64));  // fp32 keeps the composite: cuBLAS's fp32 products
  EXPECT_FALSE(gpu().has_fused_attention(DType::f64, 64));
  EXPECT_FALSE(gpu().has_fused_attention(DType::bf16, 48));
  EXPECT_FALSE(cpu().has_fused_attention(DType::f32, 64));
}

// cuDNN's fused attention (FusedAttention::cudnn: on the emulated GPU its stand-in, on a GPU the
// library itself, which is where this test checks it) against attention in double, as our kernels
// above, with head sizes ours do not take (48, 128). q, k and v are read in place from qkv and y
// written as [B, T, C]; a second run repeats the first bit for bit (the deterministic backward); the
// op takes cuDNN's under AttentionKernels::automatic and ::cudnn, bit for bit the backend's.
TEST_F(CudaVsCpu, CudnnAttentionMatchesAttentionWrittenOutInDouble) {
  const std::string why = gpu().cudnn_attention_unavailable(DType::bf16, 64);
  if (!why.empty()) GTEST_SKIP() << why;
  for (DType dt : {DType::bf16, DType::f16}) {
    // B H T a multiple of 4 first: cudnn-frontend puts a B H T float buffer at the start of the
    // backward's workspace unrounded, so the last two shapes give cuDNN a workspace 8 or 4 bytes
    // aligned (GPT-2's shapes do not). A shape the library refuses is a failure named by its shape,
    // and the others still run.
    for (const auto& [B, T, H, D] : {std::array<int64_t, 4>{2, 37, 2, 32}, std::array<int64_t, 4>{1, 40, 2, 48},
                                     std::array<int64_t, 4>{1, 70, 3, 64}, std::array<int64_t, 4>{1, 33, 1, 128}}) {
      try {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " B " + std::to_string(B) + " T " + std::to_string(T) + " H " +
                     std::to_string(H) + " D " + std::to_string(D));
        ASSERT_EQ(gpu().cudnn_attention_unavailable(dt, D), "");
        const int64_t C = H * D;
        const double scale = 1.0 / std::sqrt(static_cast<double>(D));
        const Tensor qkv = random_cpu({B, T, 3 * C}, dt, 303, -1.5, 1.5), gy = random_cpu({B, T, C}, dt, 304);
        const Tensor q = qkv.to(kGPU), g = gy.to(kGPU);
        Tensor y[2], lse[2], dqkv[2];
        for (int run = 0; run < 2; ++run) {
          y[run] = empty({B, T, C}, dt, kGPU);
          lse[run] = empty({B, H, T}, DType::f32, kGPU);
          dqkv[run] = empty({B, T, 3 * C}, dt, kGPU);
          gpu().attention_forward(q, H, scale, y[run], lse[run], FusedAttention::cudnn);
          gpu().attention_backward(q, y[run], lse[run], g, H, scale, dqkv[run], FusedAttention::cudnn);
        }
        expect_attention_close(dt, y[0], lse[0], dqkv[0],
                               attention_in_double(qkv.to_vector(), gy.to_vector(), B, T, H, D, scale));
        EXPECT_TRUE(matches(y[1], y[0], 0));
        EXPECT_TRUE(matches(dqkv[1], dqkv[0], 0)) << "the backward is not deterministic";
        for (AttentionKernels k : {AttentionKernels::automatic, AttentionKernels::cudnn}) {
          Tensor leaf = q.clone();
          leaf.set_requires_grad(true);
          const Tensor out = causal_attention(leaf, H, {.dropout_p = 0.0, .dropout = {}, .kernels = k});
          EXPECT_TRUE(matches(out, y[0], 0));
          out.backward(g);
          EXPECT_TRUE(matches(leaf.grad(), dqkv[0], 0));
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << dtype_name(dt) << " B " << B << " T " << T << " H " << H << " D " << D << ": " << e.what();
      }
    }
  }
  EXPECT_NE(gpu().cudnn_attention_unavailable(DType::f32, 64), "");
  EXPECT_NE(gpu().cudnn_attention_unavailable(DType::bf16, 60), "");   // not a multiple of 8
  EXPECT_NE(gpu().cudnn_attention_unavailable(DType::bf16, 136), "");  // over 128
  EXPECT_NE(cpu().cudnn_attention_unavailable(DType::bf16, 64), "");
  // Asked for where it cannot run (dropout, fp32): refused, saying why; never another kernel instead.
  const Tensor qkv = random_cpu({1, 8, 3 * 64}, DType::bf16, 305).to(kGPU);
  for (auto [x, p] : {std::pair<Tensor, double>{qkv.clone(), 0.1}, {qkv.to(DType::f32), 0.0}}) {
    x.set_requires_grad(true);  // a forward that autograd records: without it, our kernels (below)
    try {
      (void)causal_attention(x, 1, {.dropout_p = p, .dropout = {7, 0, {}, 0}, .kernels = AttentionKernels::cudnn});
      ADD_FAILURE() << "taken: p " << p << " " << dtype_name(x.dtype());
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cuDNN's attention"), std::string::npos) << e.what();
    }
  }
}

#if defined(AMP_CUDA_EMU)
// Where cuDNN's backward finds no room for its workspace (its deterministic algorithm keeps dS, B H
// T^2 2 bytes, asked for at the step's peak, where the forward's trial run had room): under
// automatic, our kernels take the backward from cuDNN's y and lse, bit for bit what they give from
// them, it says so once, and the shape keeps to ours; under cudnn, OutOfMemory names the workspace
// and the flag that needs none. Run in a child process whose emulated GPU has 96 MiB, filled to 3 MiB
// short of it before the backward.
TEST_F(CudaVsCpu, CudnnAttentionFallsBackWhereItsBackwardsWorkspaceFindsNoRoom) {
  if (std::getenv("AMP_EMU_MEMORY_MB") == nullptr) {
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    const int rc = std::system(
        ("AMP_EMU_MEMORY_MB=96 '" + self +
         "' --gtest_filter=CudaVsCpu.CudnnAttentionFallsBackWhereItsBackwardsWorkspaceFindsNoRoom")
            .c_str());
    EXPECT_EQ(rc, 0) << "the run with 96 MiB failed (its output is above)";
    return;
  }
  const std::string why = gpu().cudnn_attention_unavailable(DType::bf16, 32);
  if (!why.empty()) GTEST_SKIP() << why;
  const int64_t B = 1, T = 1024, H = 2, D = 32, C = H * D;  // cuDNN's backward's workspace: 4 MiB and 8 KiB
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const DType dt = DType::bf16;
  const DsPolicy recompute({0, 0});  // our backward without dS's scratch: 8 KiB of delta
  const Tensor qkv = random_cpu({B, T, 3 * C}, dt, 311, -1.5, 1.5), gy = random_cpu({B, T, C}, dt, 312);
  const Tensor q = qkv.to(kGPU), g = gy.to(kGPU);
  DeviceMemory& b = gpu_memory();
  cuda::CachingAllocator& alloc = cuda::context().allocator();
  // The op's backward with the device's memory filled to 3 MiB short; its error, and what it said.
  const auto backward_without_room = [&](const Tensor& out, std::string& error) {
    b.synchronize();
    alloc.empty_cache();
    size_t free = 0, total = 0;
    EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
    EXPECT_GT(free, size_t{8} << 20);
    void* filler = nullptr;
    EXPECT_EQ(cudaMalloc(&filler, free - (size_t{3} << 20)), cudaSuccess);
    testing::internal::CaptureStderr();
    try {
      out.backward(g);
    } catch (const std::exception& e) {
      error = e.what();
    }
    const std::string said = testing::internal::GetCapturedStderr();
    b.synchronize();
    EXPECT_EQ(cudaFree(filler), cudaSuccess);
    return said;
  };
  {  // Asked for: no other kernels, and the message says what the memory was for.
    Tensor leaf = q.clone();
    leaf.set_requires_grad(true);
    const Tensor out = causal_attention(leaf, H, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::cudnn});
    std::string error;
    backward_without_room(out, error);
    EXPECT_NE(error.find("CUDA out of memory"), std::string::npos) << error;
    EXPECT_NE(error.find("cuDNN's attention backward's workspace, 4 MiB for batch 1 x block 1024 x 2 heads"),
              std::string::npos) << error;
    EXPECT_NE(error.find("--attention fused needs no such workspace"), std::string::npos) << error;
    EXPECT_FALSE(leaf.grad().defined());
  }
  Tensor y_cudnn = empty({B, T, C}, dt, kGPU), lse_cudnn = empty({B, H, T}, DType::f32, kGPU);
  Tensor y_own = empty({B, T, C}, dt, kGPU), lse_own = empty({B, H, T}, DType::f32, kGPU);
  Tensor want_dqkv = empty({B, T, 3 * C}, dt, kGPU);
  gpu().attention_forward(q, H, scale, y_cudnn, lse_cudnn, FusedAttention::cudnn);
  gpu().attention_backward(q, y_cudnn, lse_cudnn, g, H, scale, want_dqkv, FusedAttention::own);
  gpu().attention_forward(q, H, scale, y_own, lse_own, FusedAttention::own);
  ASSERT_FALSE(matches(y_own, y_cudnn, 0)) << "this input cannot tell our forward from cuDNN's";
  {  // Automatic: cuDNN's forward, our backward from its y and lse, said once.
    Tensor leaf = q.clone();
    leaf.set_requires_grad(true);
    const Tensor out = causal_attention(leaf, H);
    EXPECT_TRUE(matches(out, y_cudnn, 0));
    std::string error;
    const std::string said = backward_without_room(out, error);
    EXPECT_EQ(error, "");
    EXPECT_NE(said.find("notice: attention: not cuDNN's fused attention (CUDA out of memory"), std::string::npos)
        << said;
    EXPECT_NE(said.find("our own fused kernels instead"), std::string::npos) << said;
    ASSERT_TRUE(leaf.grad().defined());
    EXPECT_TRUE(matches(leaf.grad(), want_dqkv, 0));
    expect_attention_close(dt, y_cudnn, lse_cudnn, leaf.grad(),
                           attention_in_double(qkv.to_vector(), gy.to_vector(), B, T, H, D, scale));
  }
  {  // The shape keeps to ours, saying nothing more; cuDNN's library still serves the others.
    Tensor leaf = q.clone();
    leaf.set_requires_grad(true);
    testing::internal::CaptureStderr();
    const Tensor out = causal_attention(leaf, H);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
    EXPECT_TRUE(matches(out, y_own, 0));
    Tensor other = random_cpu({B, 256, 3 * C}, dt, 313, -1.5, 1.5).to(kGPU);
    Tensor y_other = empty({B, 256, C}, dt, kGPU), y_other_own = empty({B, 256, C}, dt, kGPU);
    Tensor lse_other = empty({B, H, 256}, DType::f32, kGPU);
    other.set_requires_grad(true);
    gpu().attention_forward(other, H, scale, y_other, lse_other, FusedAttention::cudnn);
    gpu().attention_forward(other, H, scale, y_other_own, lse_other, FusedAttention::own);
    ASSERT_FALSE(matches(y_other_own, y_other, 0)) << "this input cannot tell our forward from cuDNN's";
    EXPECT_TRUE(matches(causal_attention(other, H), y_other, 0));
  }
}
#endif

// A node without libcudnn (the emulated GPU's stand-in switched off): cuDNN's attention says why it
// cannot run; AttentionKernels::automatic takes our kernels, bit for bit ::fused's, and ::cudnn is
// refused naming the library.
TEST_F(CudaVsCpu, WithoutCudnnAutomaticAttentionTakesOurKernels) {
  if (!emulated_device_counters()) GTEST_SKIP() << "the emulated GPU's cuDNN stand-in can be switched off";
  Tensor qkv = random_cpu({2, 20, 3 * 64}, DType::bf16, 306).to(kGPU);
  qkv.set_requires_grad(true);
  const Tensor fused = causal_attention(qkv, 2, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::fused});
  const Tensor cudnn = causal_attention(qkv, 2);
  EXPECT_FALSE(matches(cudnn, fused, 0)) << "automatic did not take cuDNN's where it runs";
  {  // a forward autograd does not record (evaluation, sampling) takes ours under automatic and cudnn
    NoGradGuard no_grad;
    EXPECT_TRUE(matches(causal_attention(qkv, 2), fused, 0));
    EXPECT_TRUE(matches(causal_attention(qkv, 2, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::cudnn}),
                        fused, 0));
  }
  ::setenv("AMP_EMU_CUDNN", "0", 1);
  const std::string why = gpu().cudnn_attention_unavailable(DType::bf16, 32);
  const Tensor automatic = causal_attention(qkv, 2);
  bool refused = false;
  try {
    (void)causal_attention(qkv, 2, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::cudnn});
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("libcudnn.so.9 was not found") != std::string::npos;
  }
  ::unsetenv("AMP_EMU_CUDNN");
  EXPECT_NE(why.find("libcudnn.so.9 was not found"), std::string::npos) << why;
  EXPECT_TRUE(matches(automatic, fused, 0));
  EXPECT_TRUE(refused);
}

// cuDNN's graphs are built in an eager call before a CUDA graph's capture: a shape first met inside
// one is refused, saying so, as is a sequence of one token (its backward does not take it); under
// automatic the op then takes our kernels.
TEST_F(CudaVsCpu, CudnnAttentionRefusesAShapeFirstMetInACapture) {
  if (!gpu().cudnn_attention_unavailable(DType::bf16, 32).empty()) GTEST_SKIP() << "no cuDNN here";
  const cudaStream_t s = cuda::context().stream();
  Tensor qkv = random_cpu({1, 23, 3 * 64}, DType::bf16, 307).to(kGPU), y = empty({1, 23, 64}, DType::bf16, kGPU);
  Tensor lse = empty({1, 2, 23}, DType::f32, kGPU);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string what;
  try {
    gpu().attention_forward(qkv, 2, 0.125, y, lse, FusedAttention::cudnn);
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  if (graph != nullptr) {
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  EXPECT_NE(what.find("a shape first met while a CUDA graph is captured"), std::string::npos) << what;
  gpu().attention_forward(qkv, 2, 0.125, y, lse, FusedAttention::cudnn);  // eager: built
  Tensor one = random_cpu({1, 1, 3 * 64}, DType::bf16, 308).to(kGPU), y1 = empty({1, 1, 64}, DType::bf16, kGPU);
  Tensor lse1 = empty({1, 2, 1}, DType::f32, kGPU);
  EXPECT_THROW(gpu().attention_forward(one, 2, 0.125, y1, lse1, FusedAttention::cudnn), std::runtime_error);
  one.set_requires_grad(true);
  EXPECT_TRUE(matches(causal_attention(one, 2), causal_attention(one, 2, {.dropout_p = 0.0, .dropout = {},
                                                                           .kernels = AttentionKernels::fused}), 0));
}

TEST_F(CudaVsCpu, CausalSoftmaxAndTheFusedSoftmaxBackward) {
  for (DType dt : kFloatTypes) {
    for (const Shape& s : {Shape{3, 7, 7}, Shape{2, 64, 64}, Shape{1, 300, 300}}) {
      const int64_t T = s.back();
      // As softmax's bound (the row sums in two orders), over the row's valid keys.
      const double u = dt == DType::f64 ? 0x1p-53 : 0x1p-24;
      const double storage = dt == DType::f16 ? 0x1p-10 : dt == DType::bf16 ? 0x1p-7 : 0.0;
      const double tol = (2.0 * static_cast<double>(T) + 8.0) * u + storage;
      const Tensor x = random_cpu(s, dt, 91, -6, 6);
      Tensor c = empty(s, dt), g = empty(s, dt, kGPU);
      cpu().causal_softmax(x, c, 0.37);
      gpu().causal_softmax(x.to(kGPU), g, 0.37);
      EXPECT_TRUE(matches(g, c, tol)) << dtype_name(dt) << shape_str(s);
      const Tensor grad = random_cpu(s, dt, 92);
      for (bool log : {false, true}) {
        Tensor cb = empty(s, dt), gb = empty(s, dt, kGPU);
        cpu().softmax_backward(c, grad, cb, log, log ? 1.0 : 0.37);
        gpu().softmax_backward(c.to(kGPU), grad.to(kGPU), gb, log, log ? 1.0 : 0.37);
        EXPECT_TRUE(matches(gb, cb, tol + 8 * u)) << dtype_name(dt) << shape_str(s) << " log " << log;
      }
    }
  }
}

// Autocast's casts folded into attention's softmax and its backward (16-bit scores, an fp32 softmax,
// its 16-bit copy; 16-bit gradients in and out): on the GPU one pass each, whose numbers must be
// those of cast, kernel, cast (the Backend default, run on the GPU: bit-identical), and within the
// softmax's bounds of the CPU (which runs the default). Odd sizes, and rows longer than a block.
TEST_F(CudaVsCpu, SoftmaxWithAutocastsCastsInItsPass) {
  for (DType lowdt : {DType::bf16, DType::f16}) {
    for (const Shape& s : {Shape{3, 7, 7}, Shape{2, 37, 37}, Shape{1, 300, 300}}) {
      const int64_t T = s.back();
      const double u = 0x1p-24, storage = lowdt == DType::f16 ? 0x1p-10 : 0x1p-7;
      const double tol = (2.0 * static_cast<double>(T) + 8.0) * u + storage;
      const Tensor x = random_cpu(s, lowdt, 93, -6, 6);
      for (bool with_low : {false, true}) {
        Tensor cy = empty(s, DType::f32), gy = empty(s, DType::f32, kGPU), ry = empty(s, DType::f32, kGPU);
        Tensor cl = with_low ? empty(s, lowdt) : Tensor(), gl = with_low ? empty(s, lowdt, kGPU) : Tensor();
        Tensor rl = with_low ? empty(s, lowdt, kGPU) : Tensor();
        cpu().causal_softmax_cast(x, cy, cl, 0.37);
        const std::optional<DeviceCounters> before = emulated_device_counters();
        gpu().causal_softmax_cast(x.to(kGPU), gy, gl, 0.37);
        if (before) {
          EXPECT_EQ((*emulated_device_counters() - *before).launches, 1);
        }
        gpu().Backend::causal_softmax_cast(x.to(kGPU), ry, rl, 0.37);
        EXPECT_TRUE(matches(gy, ry, 0)) << dtype_name(lowdt) << shape_str(s);
        EXPECT_TRUE(matches(gy, cy, tol)) << dtype_name(lowdt) << shape_str(s);
        if (with_low) {
          EXPECT_TRUE(matches(gl, rl, 0)) << dtype_name(lowdt) << shape_str(s);
          EXPECT_TRUE(matches(gl, cl, tol)) << dtype_name(lowdt) << shape_str(s);
        }
      }
      Tensor y = empty(s, DType::f32);
      cpu().causal_softmax(x.to(DType::f32), y, 0.37);
      const Tensor grad = random_cpu(s, lowdt, 94);
      Tensor cg = empty(s, lowdt), gg = empty(s, lowdt, kGPU), rg = empty(s, lowdt, kGPU);
      cpu().softmax_backward_cast(y, grad, cg, 0.37);
      gpu().softmax_backward_cast(y.to(kGPU), grad.to(kGPU), gg, 0.37);
      gpu().Backend::softmax_backward_cast(y.to(kGPU), grad.to(kGPU), rg, 0.37);
      EXPECT_TRUE(matches(gg, rg, 0)) << dtype_name(lowdt) << shape_str(s);
      EXPECT_TRUE(matches(gg, cg, tol + 8 * u)) << dtype_name(lowdt) << shape_str(s);
    }
  }
}

// Batched GEMMs (bmm: attention's scores and values) in one cuBLAS launch, against the CPU's batched
// GEMM (one oneDNN primitive), with the GEMM test's tolerances; each matrix of the batch is distinct, so a wrong stride
// shows.
TEST_F(CudaVsCpu, BatchedGemmIsOneLaunchAndMatchesTheCpu) {
  struct Case {
    DType in, out;
    double tol;
  };
  const Case cases[] = {{DType::f32, DType::f32, 1e-6}, {DType::f64, DType::f64, 1e-14},
                        {DType::f16, DType::f16, 1e-3}, {DType::bf16, DType::bf16, 8e-3}};
  const int64_t batch = 5, m = 17, n = 13, k = 70;
  for (const Case& cs : cases) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const Tensor a = random_cpu(ta ? Shape{batch, k, m} : Shape{batch, m, k}, cs.in, 71);
        const Tensor b = random_cpu(tb ? Shape{batch, n, k} : Shape{batch, k, n}, cs.in, 72);
        Tensor c = random_cpu({batch, m, n}, cs.out, 73);
        Tensor g = c.to(kGPU);
        const Tensor ga = a.to(kGPU), gb = b.to(kGPU);
        cpu().gemm_batched(ta, tb, 1.25f, a, b, 0.5f, c);
        const std::optional<DeviceCounters> before = emulated_device_counters();
        gpu().gemm_batched(ta, tb, 1.25f, ga, gb, 0.5f, g);
        if (before) {
          EXPECT_EQ((*emulated_device_counters() - *before).launches, 1);
        }
        EXPECT_TRUE(matches(g, c, cs.tol)) << dtype_name(cs.in) << " ta " << ta << " tb " << tb;
      }
    }
  }
  Tensor bad = empty({2, 3, 3}, DType::f32, kGPU);
  EXPECT_THROW(gpu().gemm_batched(false, false, 1, bad, empty({3, 3, 3}, DType::f32, kGPU), 0, bad), std::invalid_argument);
}

}  // namespace
}  // namespace amp
