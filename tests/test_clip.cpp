// Gradient clipping against PyTorch's clip_grad_norm_ on the MLP, and against closed forms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "amp/clip_grad.h"
#include "runtime/kernels/backend.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

TEST(ClipGradNorm, TotalNormMatchesPyTorchAndClips) {
  const std::string f = "mlp_pytorch.safetensors";
  auto mlp = test::fixture_mlp();
  mse_loss((*mlp)(test::fixture_tensor(f, "x")), test::fixture_tensor(f, "y")).backward();
  const auto params = mlp->parameters();
  const double max_norm = 0.5 * test::fixture_tensor(f, "clip.total_norm").item();
  const Tensor total = clip_grad_norm_(params, max_norm);
  EXPECT_TRUE(test::all_close(total.reshape({1}), test::fixture_tensor(f, "clip.total_norm"), 1e-5, 1e-7));
  // Every gradient was scaled by max_norm / (total + 1e-6): the new norm is max_norm (up to the eps).
  double sq = 0;
  for (const Tensor& p : params)
    for (double v : p.grad().to_vector()) sq += v * v;
  EXPECT_NEAR(std::sqrt(sq), max_norm, 1e-5 * max_norm);
  // Below the threshold nothing changes.
  const auto before = params[0].grad().to_vector();
  clip_grad_norm_(params, 10.0 * max_norm);
  EXPECT_EQ(params[0].grad().to_vector(), before);
}

// Each tensor's own norm, for every order, against the closed forms for a = [1, -4, 2], b = [3, 0.5],
// c = [] (rounded once to float32); on a GPU too with the tensors on two devices (one pass each),
// bit for bit what each device gives alone.
TEST(ClipGradNorm, TensorNormsAreEachTensorsOwn) {
  const Tensor a = from_vector({1.0, -4.0, 2.0}, {3}), b = from_vector({3.0, 0.5}, {2}), c = zeros({0});
  const std::vector<std::pair<double, std::vector<double>>> cases = {
      {2.0, {std::sqrt(21.0), std::sqrt(9.25), 0.0}}, {1.0, {7.0, 3.5, 0.0}}, {INFINITY, {4.0, 3.0, 0.0}},
      {-INFINITY, {1.0, 0.5, INFINITY}}, {0.0, {3.0, 2.0, 0.0}}, {3.0, {std::cbrt(73.0), std::cbrt(27.125), 0.0}}};
  for (const auto& [p, want] : cases) {
    const std::vector<double> got = tensor_norms({a, b, c}, p, kCPU).to_vector();
    ASSERT_EQ(got.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      if (std::isinf(want[i])) {
        EXPECT_EQ(got[i], want[i]) << "p " << p << " tensor " << i;  // the min of nothing
      } else {
        EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << "p " << p << " tensor " << i;
      }
  }
  std::string reason;
  if (!cuda_usable(&reason)) GTEST_SKIP() << "the two-device case needs a GPU: " << reason;
  cuda_init(0);
  const Device gpu{DeviceType::cuda, 0};
  for (const auto& [p, want] : cases) {
    const std::vector<double> mixed = tensor_norms({a, b.to(gpu), c, a.to(gpu)}, p, kCPU).to_vector();
    const std::vector<double> cpu = tensor_norms({a, c}, p, kCPU).to_vector(), dev = tensor_norms({b.to(gpu), a.to(gpu)}, p, gpu).to_vector();
    EXPECT_EQ(mixed, (std::vector<double>{cpu[0], dev[0], cpu[1], dev[1]})) << "p " << p;
  }
}

// The gradient norm's fixed chunks (comm/chunked_norm.h) in one call: each chunk's sum of squares is
// norm_accumulate_each's over the chunk's own view, bit for bit, a short last chunk included, in
// every float dtype; out is added to.
TEST(ClipGradNorm, ChunkSumsOfSquaresAreEachChunksOwn) {
  Backend& be = backend_for(kCPU);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const int64_t n = 5 * 1024 + 77, chunks = 6;
    Generator g(9);
    const Tensor x = rand_uniform({n}, -3, 3, g, dt);
    Tensor got = full({chunks}, 0.5, DType::f32), want = full({chunks}, 0.5, DType::f32);
    be.chunk_sums_of_squares(x, 1024, got, Tensor());
    std::vector<Tensor> views;
    for (int64_t k = 0; k < chunks; ++k) views.push_back(x.view(k * 1024, {std::min<int64_t>(1024, n - k * 1024)}));
    be.norm_accumulate_each(views, 2.0, want);
    EXPECT_EQ(got.to_vector(), want.to_vector()) << dtype_name(dt);
    EXPECT_NEAR(got.to_vector()[5], 0.5 + 77 * 3.0, 77 * 3.0 * 0.5) << "the short chunk: 77 squares of about 3";
  }
  Tensor wrong = zeros({5}, DType::f32);
  EXPECT_THROW(be.chunk_sums_of_squares(zeros({5 * 1024 + 1}), 1024, wrong, Tensor()), std::invalid_argument);
}

// Gradients that still carry a loss scale: each chunk's sum is that of the elements as
// unscale_and_check leaves them (times the inverse, stored in their dtype), without writing them.
// Where that storing rounds (a scale of 3 on 16-bit gradients), the scaled sum divided by the
// scale squared is another number.
Tensor scaled_gradient(DType dt, double s, uint64_t seed) {
  Generator g(seed);
  return mul(rand_uniform({4 * 1024 + 5}, -3, 3, g, DType::f64), s).to(dt);
}

Tensor unscaled_chunk_sums(Backend& be, const Tensor& x, const Tensor& scale) {
  Tensor copy = x.clone(), found = zeros({1}, DType::f32, x.device());
  be.unscale_and_check({copy}, scale, found, Tensor());
  Tensor sums = full({5}, 0.5, DType::f32, x.device());
  be.chunk_sums_of_squares(copy, 1024, sums, Tensor());
  return sums;
}

TEST(ClipGradNorm, ChunkSumsOfSquaresUnscaleAsTheyRead) {
  Backend& be = backend_for(kCPU);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (double s : {1024.0, 3.0}) {
      const Tensor x = scaled_gradient(dt, s, 13), before = x.clone(), scale = full({1}, s, DType::f32);
      Tensor got = full({5}, 0.5, DType::f32);
      be.chunk_sums_of_squares(x, 1024, got, scale);
      const Tensor want = unscaled_chunk_sums(be, x, scale);
      EXPECT_TRUE(test::bitwise_equal(got, want)) << dtype_name(dt) << " scale " << s;
      EXPECT_TRUE(test::bitwise_equal(x, before)) << "read, not written";
      if ((dt == DType::bf16 || dt == DType::f16) && s == 3.0) {  // a shortcut that would not do
        Tensor scaled = full({5}, 0.5, DType::f32);
        be.chunk_sums_of_squares(x, 1024, scaled, Tensor());
        EXPECT_NE(static_cast<float>(0.5 + (scaled.to_vector()[2] - 0.5) / (s * s)), want.to_vector()[2]) << dtype_name(dt);
      }
    }
  }
  Tensor out = zeros({5}, DType::f32);
  EXPECT_THROW(be.chunk_sums_of_squares(zeros({5 * 1024}), 1024, out, full({2}, 2.0)), std::invalid_argument);
}

// The chunk sums of a vector that is not stored, on the CPU (the default: the vector written out):
// those of the vector, bit for bit, with the pieces where the offsets say and zeros between.
TEST(ClipGradNorm, GatheredChunkSumsAreTheWrittenVectors) {
  Backend& be = backend_for(kCPU);
  Generator g(21);
  const std::vector<int64_t> offsets = {3, 1030, 2100}, sizes = {1020, 7, 1500};
  std::vector<Tensor> pieces;
  Tensor whole = zeros({4000});
  for (size_t i = 0; i < offsets.size(); ++i) {
    pieces.push_back(rand_uniform({sizes[i]}, -3, 3, g, DType::f32));
    Tensor slot = whole.view(offsets[i], {sizes[i]});
    copy_(slot, pieces.back());
  }
  for (double s : {0.0, 3.0}) {
    const Tensor scale = s > 0 ? full({1}, s, DType::f32) : Tensor();
    Tensor got = full({4}, 0.5, DType::f32), want = full({4}, 0.5, DType::f32);
    be.chunk_sums_of_squares(whole, 1024, want, scale);
    be.chunk_sums_of_squares_gathered(pieces, offsets, 4000, 1024, got, scale);
    EXPECT_TRUE(test::bitwise_equal(got, want)) << "scale " << s;
  }
  Tensor shifted = full({4}, 0.5, DType::f32), want = full({4}, 0.5, DType::f32);
  be.chunk_sums_of_squares(whole, 1024, want, Tensor());
  be.chunk_sums_of_squares_gathered(pieces, {3, 2050, 2100}, 4000, 1024, shifted, Tensor());
  EXPECT_FALSE(test::bitwise_equal(shifted, want)) << "the control: a piece in the next chunk";
  EXPECT_THROW(be.chunk_sums_of_squares_gathered(pieces, {3, 1000, 2100}, 4000, 1024, shifted, Tensor()),
               std::invalid_argument);
}

// The norm's read is also the loss scaler's check (GradScaler::check_inf_ with a fused pass): found_inf
// is set exactly where check_finite, a separate pass, finds an element that is not finite unscaled,
// in every dtype, flat and gathered; not where a finite element's square overflows the float32 sum
// (so not read off the sums), nor is it reset.
TEST(ClipGradNorm, ChunkSumsOfSquaresFindWhatCheckFiniteFinds) {
  Backend& be = backend_for(kCPU);
  struct Case {
    const char* what;
    double value, scale;  // x[3000] = value, the gradients scaled by scale
  };
  const Case cases[] = {{"inf", INFINITY, 1.0}, {"NaN", NAN, 1.0}, {"finite", 2.0, 1.0},
                        {"finite scaled, inf unscaled", 3e38, 0.5}, {"a square past float32's range", 1e30, 1.0},
                        {"a square past double's range", 1e200, 1.0}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (const Case& c : cases) {
      if (dt == DType::f16 && std::isfinite(c.value) && c.value > 65504) continue;  // not a half
      if (dt != DType::f64 && c.value > 1e100) continue;  // only a double holds it
      SCOPED_TRACE(std::string(dtype_name(dt)) + ": " + c.what);
      Tensor x = scaled_gradient(DType::f64, 1.0, 5);
      x.data<double>()[3000] = c.value;
      x = x.to(dt);
      const Tensor scale = full({1}, c.scale, DType::f32);
      Tensor want = zeros({1}, DType::f32), found = zeros({1}, DType::f32), sums = zeros({5}, DType::f32);
      be.check_finite({x}, scale, want, Tensor());
      be.chunk_sums_of_squares(x, 1024, sums, scale, found);
      EXPECT_EQ(found.to_vector(), want.to_vector());
      if (c.scale == 1.0) {
        EXPECT_EQ(want.to_vector()[0], std::isfinite(c.value) ? 0.0 : 1.0) << "the control";
      }
      Tensor plain = zeros({5}, DType::f32);
      be.chunk_sums_of_squares(x, 1024, plain, scale);
      EXPECT_TRUE(test::bitwise_equal(sums, plain)) << "the sums are unchanged by the check";
      if (std::string(c.what) == "a square past float32's range" && dt != DType::f16) {
        EXPECT_TRUE(std::isinf(sums.to_vector()[2])) << "the control: the chunk's float32 sum overflows";
      }
      // Gathered: the same vector in two pieces.
      Tensor gfound = zeros({1}, DType::f32), gsums = zeros({5}, DType::f32);
      const Tensor x32 = x.to(DType::f32);
      be.chunk_sums_of_squares_gathered({x32.view(0, {2000}), x32.view(2000, {x.numel() - 2000})}, {0, 2000},
                                        x.numel(), 1024, gsums, scale, gfound);
      Tensor want32 = zeros({1}, DType::f32);
      be.check_finite({x32}, scale, want32, Tensor());
      EXPECT_EQ(gfound.to_vector(), want32.to_vector()) << "gathered";
    }
  }
  Tensor set = full({1}, 1.0, DType::f32), sums = zeros({5}, DType::f32);
  be.chunk_sums_of_squares(scaled_gradient(DType::f32, 1.0, 5), 1024, sums, Tensor(), set);
  EXPECT_EQ(set.to_vector(), std::vector<double>{1.0}) << "never reset";
}

// The per-tensor flags after a fused check: nothing where found_inf says the pass found nothing
// (the gradients are not read: an inf planted there goes unseen), check_finite's flags where it found.
TEST(ClipGradNorm, NonfiniteFlagsOnlyWhereTheCheckFound) {
  Backend& be = backend_for(kCPU);
  Tensor a = full({300}, 1.0), b = full({5000}, 2.0), c = full({7}, 3.0);
  b.data<float>()[4321] = INFINITY;
  const Tensor scale = full({1}, 4.0, DType::f32);
  Tensor flags = zeros({3}, DType::f32);
  be.nonfinite_flags_if_found({a, b, c}, scale, zeros({1}, DType::f32), flags);
  EXPECT_EQ(flags.to_vector(), (std::vector<double>{0, 0, 0}));
  be.nonfinite_flags_if_found({a, b, c}, scale, full({1}, 1.0, DType::f32), flags);
  EXPECT_EQ(flags.to_vector(), (std::vector<double>{0, 1, 0}));
  EXPECT_THROW(be.nonfinite_flags_if_found({a, b, c}, scale, full({1}, 1.0, DType::f32), zeros({2}, DType::f32)),
               std::invalid_argument);
  EXPECT_THROW(be.nonfinite_flags_if_found({a, b, c}, scale, Tensor(), flags), std::invalid_argument);
  EXPECT_THROW(be.nonfinite_flags_if_found({a, b, c}, scale, zeros({2}, DType::f32), flags), std::invalid_argument);
}

TEST(ClipGradNorm, InfNormAndNonFinite) {
  Tensor a = zeros({3}).set_requires_grad(true), b = zeros({2}).set_requires_grad(true);
  a.set_grad(from_vector({1.0, -4.0, 2.0}, {3}));
  b.set_grad(from_vector({3.0, 0.5}, {2}));
  EXPECT_EQ(clip_grad_norm_({a, b}, 100.0, INFINITY).item(), 4.0);
  EXPECT_NEAR(clip_grad_norm_({a, b}, 100.0, 1.0).item(), 10.5, 1e-6);
  b.grad().data<float>()[1] = NAN;
  EXPECT_THROW(clip_grad_norm_({a, b}, 1.0, 2.0, /*error_if_nonfinite=*/true), std::runtime_error);
  EXPECT_TRUE(std::isnan(clip_grad_norm_({a, b}, 1.0).item()));  // PyTorch's default: scale by NaN
}

// torch.nn.utils 2.x takes the norm of the per-tensor norms, accepts every norm_type that
// torch.linalg.vector_norm does, and any max_norm. Expected values by hand: a = [1, -4, 2],
// b = [3, 0.5].
TEST(ClipGradNorm, EveryNormTypeAndMaxNormAsPyTorch) {
  Tensor a = zeros({3}).set_requires_grad(true), b = zeros({2}).set_requires_grad(true);
  auto reset = [&] {
    a.set_grad(from_vector({1.0, -4.0, 2.0}, {3}));
    b.set_grad(from_vector({3.0, 0.5}, {2}));
  };
  reset();
  EXPECT_EQ(get_total_norm({a.grad(), b.grad()}, -INFINITY).item(), 0.5) << "min |x|";
  EXPECT_EQ(get_total_norm({a.grad(), b.grad()}, 0.0).item(), 2.0) << "the count of tensors with a nonzero";
  EXPECT_NEAR(get_total_norm({a.grad(), b.grad()}, 3.0).item(), std::cbrt(100.125), 1e-5);
  // p = 1/2: each norm is (sum sqrt|x|)^2, and so is the norm of the two.
  const double half = std::pow(1.0 + 2.0 + std::sqrt(2.0) + std::sqrt(3.0) + std::sqrt(0.5), 2.0);
  EXPECT_NEAR(get_total_norm({a.grad(), b.grad()}, 0.5).item(), half, 1e-5 * half);
  EXPECT_EQ(get_total_norm({}).item(), 0.0);
  // A negative max_norm flips the gradients: the factor is (5.5 + 1e-6)^-1 * -1.
  const Tensor total = clip_grad_norm_({a, b}, -1.0);
  EXPECT_EQ(total.item(), 5.5);
  const float coef = (1.0f / (5.5f + 1e-6f)) * -1.0f;
  EXPECT_EQ(a.grad().to_vector()[1], static_cast<double>(-4.0f * coef));
  // clip_grads_with_norm_ with a norm the caller computed.
  reset();
  clip_grads_with_norm_({a, b}, 2.0, scalar_tensor(4.0));
  EXPECT_EQ(b.grad().to_vector()[0], static_cast<double>(3.0f * ((1.0f / (4.0f + 1e-6f)) * 2.0f)));
  // The error names the order as Python prints it.
  b.grad().data<float>()[0] = INFINITY;
  try {
    clip_grad_norm_({a, b}, 1.0, 2.0, true);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("The total norm of order 2.0 for gradients from `parameters` is non-finite", 0), 0u)
        << e.what();
  }
}

TEST(ClipGradValue, ClampsEveryElement) {
  Tensor a = zeros({4}).set_requires_grad(true);
  a.set_grad(from_vector({-3.0, -0.1, 0.2, 5.0}, {4}));
  clip_grad_value_({a}, 0.5);
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{-0.5, static_cast<double>(-0.1f), static_cast<double>(0.2f), 0.5}));
  clip_grad_value_({a}, -1.0);  // torch.clamp with min > max: every element becomes max
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{-1.0, -1.0, -1.0, -1.0}));
}

// Parameters on two devices, as PyTorch's clip_grad_norm_ takes them (grouped by device): every
// gradient scaled by the one coefficient, each on its own device, as an all-CPU control scales them;
// and clamped. The clip sent every gradient to the first one's backend.
TEST(ClipGradNorm, GradientsOnTwoDevicesAreClippedEachOnItsOwn) {
  std::string reason;
  if (!cuda_usable(&reason)) GTEST_SKIP() << "the two-device case needs a GPU: " << reason;
  cuda_init(0);
  const Device gpu{DeviceType::cuda, 0};
  auto make = [](Device d, const std::vector<double>& g) {
    Tensor p = zeros({static_cast<int64_t>(g.size())}, DType::f32, d).set_requires_grad(true);
    p.set_grad(from_vector(g, {static_cast<int64_t>(g.size())}).to(d));
    return p;
  };
  const std::vector<double> ga = {3.0, -4.0}, gb = {12.0, 0.5, -2.0};
  Tensor a = make(kCPU, ga), b = make(gpu, gb), ca = make(kCPU, ga), cb = make(kCPU, gb);
  const double norm = clip_grad_norm_({a, b}, 1.0).item(), control = clip_grad_norm_({ca, cb}, 1.0).item();
  EXPECT_EQ(norm, control);
  EXPECT_EQ(a.grad().to_vector(), ca.grad().to_vector());
  EXPECT_EQ(b.grad().to(kCPU).to_vector(), cb.grad().to_vector());
  EXPECT_EQ(b.grad().device(), gpu);
  Tensor va = make(gpu, ga), vb = make(kCPU, gb);
  clip_grad_value_({va, vb}, 1.0);
  EXPECT_EQ(va.grad().to(kCPU).to_vector(), (std::vector<double>{1.0, -1.0}));
  EXPECT_EQ(vb.grad().to_vector(), (std::vector<double>{1.0, 0.5, -1.0}));
}

// The NaN audit for clipping, as torch.nn.utils does it: the inf-norm (a max) of a NaN is NaN, the
// clip coefficient min(1, max_norm / NaN) is NaN and every gradient becomes NaN, and clamping keeps
// a NaN (so the scaler, which checks after clipping, still sees it).
TEST(ClipGradNorm, NaNPropagatesThroughNormsCoefficientAndClamp) {
  for (double p : {2.0, 1.0, static_cast<double>(INFINITY)}) {
    for (int at = 0; at < 3; ++at) {
      Tensor a = zeros({3}).set_requires_grad(true), b = zeros({2}).set_requires_grad(true);
      std::vector<double> va = {1.0, -4.0, 2.0};
      va[static_cast<size_t>(at)] = NAN;
      a.set_grad(from_vector(va, {3}));
      b.set_grad(from_vector({3.0, 0.5}, {2}));
      EXPECT_TRUE(std::isnan(clip_grad_norm_({a, b}, 1.0, p).item())) << "p " << p << " at " << at;
      for (double g : b.grad().to_vector()) EXPECT_TRUE(std::isnan(g)) << "p " << p;
    }
  }
  Tensor c = zeros({3}).set_requires_grad(true);
  c.set_grad(from_vector({NAN, 5.0, -5.0}, {3}));
  clip_grad_value_({c}, 1.0);
  const std::vector<double> v = c.grad().to_vector();
  EXPECT_TRUE(std::isnan(v[0]));
  EXPECT_EQ(v[1], 1.0);
  EXPECT_EQ(v[2], -1.0);
}

}  // namespace
}  // namespace amp
