// Tensors, the counter-based RNG, broadcasting and the CPU GEMMs against fp64 references.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>

#include "runtime/kernels/backend.h"
#include "runtime/kernels/cpu/cpu_tiled_gemm.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

TEST(Random, SameSeedSameNumbersOnAnyThreadCount) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  Generator g1(42);
  const Tensor a = randn({300, 400}, g1);
  omp_set_num_threads(2);
  Generator g2(42);
  const Tensor b = randn({300, 400}, g2);
  omp_set_num_threads(saved);
  EXPECT_TRUE(test::bitwise_equal(a, b));
  Generator g3(43);
  EXPECT_FALSE(test::bitwise_equal(a, randn({300, 400}, g3)));
  // Consecutive fills continue the stream instead of repeating it.
  Generator g4(42);
  const Tensor first = randn({10}, g4), second = randn({10}, g4);
  EXPECT_FALSE(test::bitwise_equal(first, second));
}

// Sums over a whole tensor (sum_to a scalar; norm_accumulate, clip_grad_norm_'s) give the same bits
// on any thread count: fp64 shows the order of the additions (an OpenMP reduction added its threads'
// partial sums, which 1, 2 and 3 threads split at other places).
TEST(Reductions, SameBitsOnAnyThreadCount) {
  const int saved = omp_get_max_threads();
  Generator g(31);
  const Tensor x = randn({300001}, g, DType::f64);
  std::vector<double> sums, norms;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    sums.push_back(sum(x).item());
    Tensor acc = zeros({1});
    backend_for(kCPU).norm_accumulate({cast(x, DType::f32)}, 2.0, acc);
    norms.push_back(acc.item());
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < sums.size(); ++i) {
    EXPECT_EQ(sums[i], sums[0]) << i + 1 << " threads";
    EXPECT_EQ(norms[i], norms[0]) << i + 1 << " threads";
  }
  const auto v = x.to_vector();
  double serial = 0.0;
  for (double e : v) serial += e;
  EXPECT_NEAR(sums[0], serial, 1e-9);
}

TEST(Random, MomentsAreRight) {
  Generator g(7);
  const auto n = randn({200000}, g).to_vector();
  double m = 0, s = 0;
  for (double v : n) m += v;
  m /= static_cast<double>(n.size());
  for (double v : n) s += (v - m) * (v - m);
  s = std::sqrt(s / static_cast<double>(n.size()));
  EXPECT_NEAR(m, 0.0, 0.01);
  EXPECT_NEAR(s, 1.0, 0.01);
  const auto u = rand_uniform({200000}, -2.0, 3.0, g).to_vector();
  double lo = 1e9, hi = -1e9, mu = 0;
  for (double v : u) { lo = std::min(lo, v); hi = std::max(hi, v); mu += v; }
  EXPECT_GE(lo, -2.0);
  EXPECT_LT(hi, 3.0);
  EXPECT_NEAR(mu / static_cast<double>(u.size()), 0.5, 0.02);
}

TEST(Tensor, BroadcastValues) {
  const Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(add(a, from_vector({10, 20, 30}, {3})).to_vector(), (std::vector<double>{11, 22, 33, 14, 25, 36}));
  EXPECT_EQ(mul(a, from_vector({2, 3}, {2, 1})).to_vector(), (std::vector<double>{2, 4, 6, 12, 15, 18}));
  EXPECT_EQ(sum_to(a, {3}).to_vector(), (std::vector<double>{5, 7, 9}));
  EXPECT_EQ(sum_to(a, {2, 1}).to_vector(), (std::vector<double>{6, 15}));
  EXPECT_EQ(sum(a).item(), 21.0);
  EXPECT_EQ(mean(a, 0).to_vector(), (std::vector<double>{2.5, 3.5, 4.5}));
  EXPECT_THROW(a.reshape({4, 2}).reshape({5}), std::invalid_argument);
}

// op(a) @ op(b) in fp64 from the (already rounded) inputs.
std::vector<double> reference_mm(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  const int64_t m = a.shape()[0], k = a.shape()[1], n = b.shape()[1];
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) c[static_cast<size_t>(i * n + j)] += va[static_cast<size_t>(i * k + p)] * vb[static_cast<size_t>(p * n + j)];
  return c;
}

// t / 3 is a true division, as PyTorch's (the trainer divides the loss by K this way): for 5, 7 and
// 10, float(x / 3) and float(x * float(1 / 3)) differ in the last bit.
// fp32 + a 16-bit tensor of one shape (the GPT's residual plus a branch under autocast) reads the
// 16-bit operand as its promotion in the add's pass: bit for bit add(a, b.to(fp32)), and so are the
// gradients (b's in its own dtype).
TEST(Tensor, AddOfAWideAndANarrowTensorIsThePromotedAdd) {
  for (DType narrow : {DType::bf16, DType::f16}) {
    Generator g(5);
    const Tensor a = rand_uniform({6, 33}, -3, 3, g, DType::f32).set_requires_grad(true);
    const Tensor b = rand_uniform({6, 33}, -3, 3, g, narrow).set_requires_grad(true);
    const Tensor w = rand_uniform({6, 33}, -1, 1, g, DType::f32);
    const Tensor fused = add(a, b), composite = add(a, b.to(DType::f32));
    EXPECT_EQ(fused.dtype(), DType::f32);
    EXPECT_TRUE(test::bitwise_equal(fused, composite));
    const std::vector<Tensor> gf = grad({sum(mul(fused, w))}, {a, b}), gc = grad({sum(mul(composite, w))}, {a, b});
    EXPECT_EQ(gf[1].dtype(), narrow);
    EXPECT_TRUE(test::bitwise_equal(gf[0], gc[0]));
    EXPECT_TRUE(test::bitwise_equal(gf[1], gc[1]));
  }
}

TEST(Tensor, DivisionByAScalarDivides) {
  const std::vector<double> got = div(from_vector({5.0, 7.0, 10.0}, {3}), 3.0).to_vector();
  const float want[] = {5.0f / 3.0f, 7.0f / 3.0f, 10.0f / 3.0f};
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], static_cast<double>(want[i]));
  EXPECT_NE(5.0f / 3.0f, 5.0f * static_cast<float>(1.0 / 3.0)) << "the values do not tell the two apart";
}

TEST(Gemm, ReducedPrecisionAgainstFp64) {
  Generator g(3);
  const Tensor a32 = randn({37, 129}, g), b32 = randn({129, 23}, g);
  for (DType dt : {DType::f16, DType::bf16}) {
    const Tensor a = cast(a32, dt), b = cast(b32, dt);
    const auto ref = reference_mm(a, b);
    // Output in the input dtype: one rounding of an fp32-accumulated sum.
    const Tensor c = matmul(a, b);
    ASSERT_EQ(c.dtype(), dt);
    const double ulp = dt == DType::f16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    const auto vc = c.to_vector();
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_LE(std::fabs(vc[i] - ref[i]), ulp * std::fabs(ref[i]) + 1e-4) << dtype_name(dt) << " element " << i;
    // fp32 output: no final rounding, so it is much closer.
    Tensor c32 = empty({37, 23});
    backend_for(kCPU).gemm(false, false, 1.0f, a, b, 0.0f, c32);
    EXPECT_TRUE(test::all_close(c32, from_vector(ref, {37, 23}), 1e-5, 1e-4)) << dtype_name(dt);
  }
}

TEST(Gemm, TransposesAndBetaAgainstFp64) {
  Generator g(5);
  const Tensor a = randn({19, 7}, g), b = randn({11, 19}, g);
  // c = 2 * a^T @ b^T + 0.5 * c0, for every dtype path.
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const Tensor at = cast(a, dt), bt = cast(b, dt);
    Tensor c = full({7, 11}, 1.0, dt);
    backend_for(kCPU).gemm(true, true, 2.0f, at, bt, 0.5f, c);
    const Tensor ref = add(mul(mm(cast(at, DType::f64), cast(bt, DType::f64), true, true), 2.0), 0.5);
    const double tol = dt == DType::f32 ? 1e-5 : (dt == DType::f16 ? 2e-3 : 1e-2);
    EXPECT_TRUE(test::all_close(c, ref, tol, tol)) << dtype_name(dt);
  }
}

// The CPU's batched GEMM: each matrix of the batch against
// an fp64 product of its own (distinct) inputs, every transpose, alpha and beta, fp32 and bf16.
TEST(Gemm, BatchedAgainstFp64PerMatrix) {
  Generator g(11);
  const int64_t B = 5, m = 7, n = 9, k = 6;
  for (DType dt : {DType::f32, DType::bf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const Tensor a = cast(randn(ta ? Shape{B, k, m} : Shape{B, m, k}, g), dt);
        const Tensor b = cast(randn(tb ? Shape{B, n, k} : Shape{B, k, n}, g), dt);
        const Tensor c0 = cast(randn({B, m, n}, g), DType::f32);
        Tensor c = cast(c0, dt).clone();  // c0 stays the reference's input (cast to f32 is c0 itself)
        backend_for(kCPU).gemm_batched(ta, tb, 1.5f, a, b, 0.25f, c);
        for (int64_t i = 0; i < B; ++i) {
          const Tensor ai = cast(select(a, i), DType::f64), bi = cast(select(b, i), DType::f64);
          const Tensor ref = add(mul(mm(ai, bi, ta, tb), 1.5), mul(cast(select(cast(c0, dt), i), DType::f64), 0.25));
          const double tol = dt == DType::f32 ? 1e-5 : 2e-2;
          EXPECT_TRUE(test::all_close(select(c, i), ref, tol, tol)) << dtype_name(dt) << " ta " << ta << " tb " << tb << " i " << i;
        }
      }
}

// Broadcasts over leading dims, large enough to split over threads: a row added to every row of a
// [B, T, C] tensor, and the gradient's way back (sum over B to [T, C]), against plain loops.
TEST(Tensor, LeadingDimBroadcastAndSumAgainstLoops) {
  Generator g(13);
  const int64_t B = 9, T = 64, C = 96;  // 55,296 elements: above the parallel grain
  const Tensor x = randn({B, T, C}, g), row = randn({C}, g), tc = randn({T, C}, g);
  const auto vx = x.to_vector(), vr = row.to_vector(), vtc = tc.to_vector();
  const auto added = add(x, row).to_vector(), added_tc = add(tc, x).to_vector();
  const auto summed = sum_to(x, {T, C}).to_vector();
  for (int64_t i = 0; i < B * T * C; ++i) {
    ASSERT_EQ(added[static_cast<size_t>(i)], static_cast<double>(static_cast<float>(vx[static_cast<size_t>(i)] + vr[static_cast<size_t>(i % C)]))) << i;
    ASSERT_EQ(added_tc[static_cast<size_t>(i)], static_cast<double>(static_cast<float>(vtc[static_cast<size_t>(i % (T * C))] + vx[static_cast<size_t>(i)]))) << i;
  }
  for (int64_t j = 0; j < T * C; ++j) {
    double s = 0.0;
    for (int64_t b = 0; b < B; ++b) s += vx[static_cast<size_t>(b * T * C + j)];
    ASSERT_EQ(summed[static_cast<size_t>(j)], static_cast<double>(static_cast<float>(s))) << j;
  }
}

// The CPU's linear forward adds the bias to the GEMM's sums; the control is Backend's default: the bias
// broadcast into y, the product accumulated onto it. One rounding of the same fp32 sum either way
// while k fits one of oneDNN's blocks (45 here; beyond a block, the accumulation adds the bias to
// the first block's sums, the fused form to the whole sum).
TEST(Gemm, LinearForwardBiasEqualsBroadcastThenAccumulate) {
  Generator g(9);
  const Tensor x32 = randn({67, 45}, g), w32 = randn({29, 45}, g), b32 = randn({29}, g);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = cast(x32, dt), w = cast(w32, dt), b = cast(b32, dt);
    Tensor fused = empty({67, 29}, dt), control = empty({67, 29}, dt);
    backend_for(kCPU).linear_forward(x, w, b, fused);
    backend_for(kCPU).broadcast_to(b, control);
    backend_for(kCPU).gemm(false, true, 1.0f, x, w, 1.0f, control);
    EXPECT_TRUE(test::bitwise_equal(fused, control)) << dtype_name(dt);
    const Tensor ref = add(mm(cast(x, DType::f64), cast(w, DType::f64), false, true), cast(b, DType::f64));
    const double tol = dt == DType::f32 ? 1e-5 : 2e-2;
    EXPECT_TRUE(test::all_close(fused, ref, tol, tol)) << dtype_name(dt);
  }
}

// The CPU's GEMMs give the same bits on any thread count (oneDNN's own split gave other bits on 1 and
// 2 threads for most of these shapes). The shapes take each of the plan's cuts: many tiles, one tile
// with k cut into chunks (alpha, beta and the bias applied when the chunks are added), whole columns
// of a transposed a, a batch of small products, and tiles of a product too small for them. Each is
// also checked against fp64, so that a cut that dropped or doubled a piece would fail.
TEST(Gemm, SameBitsOnAnyThreadCount) {
  struct Case {
    bool ta, tb;
    int64_t batch, m, n, k;
    float alpha, beta;
    bool bias;
  };
  const Case cases[] = {{false, true, 1, 600, 300, 200, 1.0f, 0.0f, true},     // 5 x 2 tiles, the bias
                        {true, false, 1, 64, 48, 4096, 1.0f, 0.0f, false},     // one tile, k in chunks
                        {false, false, 1, 40, 72, 1500, 0.5f, 0.25f, false},   // chunks, alpha and beta
                        {false, true, 1, 40, 40, 1100, 1.0f, 0.0f, true},      // chunks and the bias
                        {true, true, 1, 300, 200, 700, 1.0f, 0.0f, false},     // whole columns of a^T
                        {false, false, 19, 64, 64, 32, 1.0f, 0.0f, false},     // a batch, 2 to a piece
                        {false, false, 1, 1024, 256, 128, 1.0f, 0.0f, false},
                        {true, false, 1, 17, 33, 5, 2.0f, 0.5f, false}};      // one piece
  ASSERT_GT(cpu::gemm_plan(true, false, 1, 64, 48, 4096).ks, 1) << "the cases must cut k";
  ASSERT_GT(cpu::gemm_plan(false, true, 1, 40, 40, 1100).ks, 1) << "the cases must cut k under a bias";
  ASSERT_GT(cpu::gemm_plan(false, false, 19, 64, 64, 32).bg, 1) << "the cases must group a batch";
  const int saved = omp_get_max_threads();
  Generator g(21);
  // fp32 through oneDNN's sgemm, then through the primitives bf16 takes on a CPU with its kernels.
  struct Restore {
    int threads;
    ~Restore() {
      omp_set_num_threads(threads);
      cpu::use_primitives_for_f32(false);
    }
  } restore{omp_get_max_threads()};
  for (bool primitives : {false, true})
  for (const Case& cs : cases)
    for (DType dt : {DType::f32, DType::bf16}) {
      cpu::use_primitives_for_f32(primitives);
      const std::string what = std::string(dtype_name(dt)) + (primitives ? " (primitives) " : " ") +
                               std::to_string(cs.batch) + " x " + std::to_string(cs.m) + " x " + std::to_string(cs.n) +
                               " x " + std::to_string(cs.k);
      const Tensor a = cast(randn(cs.ta ? Shape{cs.batch, cs.k, cs.m} : Shape{cs.batch, cs.m, cs.k}, g), dt);
      const Tensor b = cast(randn(cs.tb ? Shape{cs.batch, cs.n, cs.k} : Shape{cs.batch, cs.k, cs.n}, g), dt);
      const Tensor bias = cast(randn({cs.n}, g), dt), c0 = cast(randn({cs.batch, cs.m, cs.n}, g), dt);
      std::vector<Tensor> results;
      for (int threads : {1, 2, 3, 5}) {
        omp_set_num_threads(threads);
        Tensor c = c0.clone();
        if (cs.bias) {
          Tensor c2 = c.view(0, {cs.m, cs.n});
          backend_for(kCPU).linear_forward(a.view(0, {cs.m, cs.k}), b.view(0, {cs.n, cs.k}), bias, c2);
        } else {
          backend_for(kCPU).gemm_batched(cs.ta, cs.tb, cs.alpha, a, b, cs.beta, c);
        }
        results.push_back(c);
      }
      omp_set_num_threads(saved);
      for (size_t i = 1; i < results.size(); ++i) EXPECT_TRUE(test::bitwise_equal(results[0], results[i])) << what << ", run " << i;
      for (int64_t i = 0; i < cs.batch; ++i) {
        const Tensor ai = cast(select(a, i), DType::f64), bi = cast(select(b, i), DType::f64);
        Tensor ref = mul(mm(ai, bi, cs.ta, cs.tb), static_cast<double>(cs.alpha));
        if (cs.beta != 0.0f) ref = add(ref, mul(cast(select(c0, i), DType::f64), static_cast<double>(cs.beta)));
        if (cs.bias) ref = add(ref, cast(bias, DType::f64));
        const double tol = dt == DType::f32 ? 2e-4 : 5e-2;
        EXPECT_TRUE(test::all_close(select(results[0], i), ref, tol, tol)) << what << ", batch entry " << i;
      }
    }
}

TEST(Tensor, ReducedPrecisionMeanDoesNotOverflow) {
  // 10,000 halves of 10: their sum (1e5) overflows fp16, their mean does not.
  const Tensor h = full({100, 100}, 10.0, DType::f16);
  EXPECT_EQ(mean(h).item(), 10.0);
  EXPECT_EQ(mean(h).dtype(), DType::f16);
  EXPECT_EQ(mean(h, 0).to_vector(), std::vector<double>(100, 10.0));
  EXPECT_EQ(mean(full({70000}, 1.0, DType::bf16)).item(), 1.0);
}

TEST(Gemm, EmptyInnerDimensionLeavesBetaTimesC) {
  Tensor c = full({2, 3}, 4.0);
  backend_for(kCPU).gemm(false, false, 1.0f, empty({2, 0}), empty({0, 3}), 0.5f, c);
  EXPECT_EQ(c.to_vector(), std::vector<double>(6, 2.0));
  backend_for(kCPU).gemm(false, false, 1.0f, empty({2, 0}), empty({0, 3}), 0.0f, c);
  EXPECT_EQ(c.to_vector(), std::vector<double>(6, 0.0));
  EXPECT_THROW(backend_for(kCPU).gemm(false, false, 1.0f, empty({2, 1}), empty({2, 3}), 0.0f, c), std::invalid_argument);
}

TEST(Backend, ReadbackCarriesScalarsAndRejectsTheRest) {
  DeviceMemory& b = host_memory();
  auto r = b.start_readback({full({1}, 2.5), scalar_tensor(-1.0)});
  EXPECT_TRUE(r->ready());
  EXPECT_EQ(r->values(), (std::vector<double>{2.5, -1.0}));
  EXPECT_THROW(b.start_readback({full({2}, 1.0)}), std::invalid_argument);
  EXPECT_THROW(b.start_readback({full({1}, 1.0, DType::f64)}), std::invalid_argument);
}

TEST(Tensor, FactoriesValidate) {
  EXPECT_THROW(empty({2, -1}), std::invalid_argument);
  EXPECT_THROW(empty({int64_t{1} << 40, int64_t{1} << 30}), std::invalid_argument);
  EXPECT_THROW(from_vector({1, 2}, {3}), std::invalid_argument);
  EXPECT_THROW(full({2}, 1.0).item(), std::invalid_argument);
  Tensor i = from_int64({1, 2}, {2});
  EXPECT_THROW(i.set_requires_grad(true), std::invalid_argument);
}

// ReLU lets NaN through, as PyTorch does: a NaN in the weights or the data must reach the loss, not
// turn into a normal-looking 0. Its gradient passes there, as threshold_backward's (NaN <= 0 is false).
TEST(Activation, ReluPropagatesNaNInEveryDtype) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    const Tensor x = from_vector({nan, -1.0, 0.0, 2.0, -inf, inf}, {6}, dt);
    const std::vector<double> y = relu(x).to_vector();
    EXPECT_TRUE(std::isnan(y[0])) << dtype_name(dt);
    EXPECT_EQ(y[1], 0.0);
    EXPECT_EQ(y[2], 0.0);
    EXPECT_EQ(y[3], 2.0);
    EXPECT_EQ(y[4], 0.0);
    EXPECT_EQ(y[5], inf);
    const std::vector<double> g = relu_backward(from_vector({1, 1, 1, 1, 1, 1}, {6}, dt), x).to_vector();
    EXPECT_EQ(g, (std::vector<double>{1, 0, 0, 1, 0, 1})) << dtype_name(dt);
  }
}

// The NaN audit: every reduction, max and loss lets a NaN through as PyTorch does (softmax's row
// max must not skip it; a sum or mean of a NaN is NaN), so no NaN becomes a normal-looking number.
TEST(NaN, ReductionsSoftmaxAndLossesPropagateIt) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    const std::string name = dtype_name(dt);
    // Row 0 holds a NaN (first, in the middle, last: a max that starts from the first element or
    // compares one way only would skip it in one of the positions), row 1 does not.
    for (int at = 0; at < 3; ++at) {
      std::vector<double> v = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0};
      v[static_cast<size_t>(at)] = nan;
      const Tensor x = from_vector(v, {2, 3}, dt);
      for (const Tensor& s : {softmax(x), log_softmax(x)}) {
        const std::vector<double> y = s.to_vector();
        for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i)])) << name << " at " << at;
        for (int i = 3; i < 6; ++i) EXPECT_TRUE(std::isfinite(y[static_cast<size_t>(i)])) << name;
      }
      EXPECT_TRUE(std::isnan(sum(x).item())) << name;
      EXPECT_TRUE(std::isnan(mean(x).item())) << name;
      const std::vector<double> rows = sum(x, 1).to_vector();
      EXPECT_TRUE(std::isnan(rows[0]) && std::isfinite(rows[1])) << name;
      const std::vector<double> cols = sum(x, 0).to_vector();
      for (int c = 0; c < 3; ++c) EXPECT_EQ(std::isnan(cols[static_cast<size_t>(c)]), c == at) << name;
      EXPECT_TRUE(std::isnan(mse_loss(x, zeros({2, 3}, dt)).item())) << name;
      if (dt == DType::f32 || dt == DType::f64) {
        EXPECT_TRUE(std::isnan(cross_entropy(x, from_int64({2, 0}, {2})).item())) << name;
      }
    }
  }
}

}  // namespace
}  // namespace amp
