// Autocast: dtypes per device type and cast list, the cast cache, underflow, and bf16 against
// PyTorch. (PyTorch's GradScaler tests are ported in test_grad_scaling.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "amp/grad_scaler.h"
#include "models/mlp.h"
#include "runtime/ops/autograd.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

TEST(Autocast, DtypesUnderFp16) {
  Generator gen(0);
  nn::Linear lin(4, 3, gen);
  const Tensor x = randn({2, 4}, gen);
  Tensor out, loss;
  {
    autocast ac(DeviceType::cpu, DType::f16, true, true, CastLists::cuda);
    EXPECT_TRUE(is_autocast_enabled(DeviceType::cpu));
    EXPECT_FALSE(is_autocast_enabled(DeviceType::cuda)) << "a CPU region leaves CUDA ops alone";
    out = lin(x);
    loss = mse_loss(out, zeros({2, 3}));
    EXPECT_EQ(add(out, ones({2, 3})).dtype(), DType::f32) << "ordinary promotion: f16[2,3] + f32[2,3]";
    EXPECT_EQ(add(out, ones({})).dtype(), DType::f16) << "a 0-dim f32 does not widen a dimensioned f16";
    EXPECT_EQ(relu(out).dtype(), DType::f16) << "pass-through keeps the input dtype";
    EXPECT_EQ(softmax(out).dtype(), DType::f32) << "CUDA's fp32 list";
    EXPECT_EQ(mm(x, x, false, true).dtype(), DType::f16) << "mm is a lower-precision op";
    EXPECT_EQ(mm(x.to(DType::f64), x.to(DType::f64), false, true).dtype(), DType::f64) << "fp64 is not eligible";
  }
  EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
  EXPECT_EQ(out.dtype(), DType::f16);
  EXPECT_EQ(loss.dtype(), DType::f32);
  loss.backward();
  EXPECT_EQ(lin.weight.grad().dtype(), DType::f32);
  EXPECT_EQ(lin.bias.grad().dtype(), DType::f32);
}

// PyTorch's CPU lists: softmax, exp, log, pow and sum are not fp32 ops there; a CPU region's default
// dtype is bfloat16 and a CUDA region's float16.
TEST(Autocast, CpuListsAndDefaultsPerDeviceType) {
  Generator gen(1);
  const Tensor x = randn({2, 4}, gen).to(DType::bf16);
  {
    autocast ac(DeviceType::cpu);
    EXPECT_EQ(get_autocast_dtype(DeviceType::cpu), DType::bf16);
    EXPECT_EQ(softmax(x).dtype(), DType::bf16);
    EXPECT_EQ(exp(x).dtype(), DType::bf16);
    EXPECT_EQ(sum(x).dtype(), DType::bf16);
    EXPECT_EQ(mse_loss(x, x).dtype(), DType::f32) << "mse_loss is on the CPU's fp32 list too";
    EXPECT_EQ(matmul(x.to(DType::f32), x.to(DType::f32).reshape({4, 2})).dtype(), DType::bf16);
  }
  {
    autocast ac(DeviceType::cuda);
    EXPECT_EQ(get_autocast_dtype(DeviceType::cuda), DType::f16);
    EXPECT_EQ(matmul(x.to(DType::f32), x.to(DType::f32).reshape({4, 2})).dtype(), DType::f32)
        << "a CUDA region does not touch CPU tensors";
  }
}

// What a region is not given it keeps from the regions around it, as torch.autocast's dtype=None and
// cache_enabled=None (torch/amp/autocast_mode.py: get_autocast_dtype, is_autocast_cache_enabled):
// a bf16 region that turns autocast off and on again stays bf16 (it became float16, the device's
// default, and a CPU matmul there float16), and a cache disabled outside stays disabled.
TEST(Autocast, ANestedRegionKeepsWhatItIsNotGiven) {
  Generator gen(2);
  const Tensor x = randn({2, 4}, gen), w = randn({4, 3}, gen);
  {
    autocast outer(DeviceType::cuda, DType::bf16);
    {
      autocast off(DeviceType::cuda, std::nullopt, false);
      autocast on(DeviceType::cuda);
      EXPECT_EQ(get_autocast_dtype(DeviceType::cuda), DType::bf16);
    }
  }
  EXPECT_EQ(get_autocast_dtype(DeviceType::cuda), DType::f16) << "outside any region: the default again";
  {
    autocast outer(DeviceType::cpu, DType::f16, true, /*cache_enabled=*/false);
    {
      autocast off(DeviceType::cpu, std::nullopt, false);
      EXPECT_EQ(matmul(x, w).dtype(), DType::f32);
      autocast on(DeviceType::cpu);
      EXPECT_EQ(matmul(x, w).dtype(), DType::f16);
      EXPECT_FALSE(is_autocast_cache_enabled());
      autocast given(DeviceType::cpu, DType::bf16, true, true);
      EXPECT_EQ(matmul(x, w).dtype(), DType::bf16);
      EXPECT_TRUE(is_autocast_cache_enabled());
    }
    {
      autocast off32(DeviceType::cpu, DType::f32, false);  // allowed when disabled; the dtype in force stays
      autocast on(DeviceType::cpu);
      EXPECT_EQ(matmul(x, w).dtype(), DType::f16);
    }
    EXPECT_FALSE(is_autocast_cache_enabled());
  }
  EXPECT_TRUE(is_autocast_cache_enabled());
  EXPECT_EQ(get_autocast_dtype(DeviceType::cpu), DType::bf16);
}

// The promote policy (dot is on CUDA's promote list): the widest of the region's dtype and the
// inputs', float32 winning, float64 inputs ignored and left alone.
TEST(Autocast, PromoteStartsFromTheRegionsDtypeAndIgnoresFloat64) {
  const Tensor h = full({3}, 1.5, DType::f16), f = full({3}, 2.0), d = full({3}, 2.0, DType::f64);
  const Tensor bh = full({3}, 1.5, DType::bf16);
  {
    autocast ac(DeviceType::cpu, DType::f16, true, true, CastLists::cuda);
    EXPECT_EQ(dot(h, f).dtype(), DType::f32) << "float32 wins";
    EXPECT_EQ(dot(h, h).dtype(), DType::f16);
    EXPECT_EQ(dot(h, f).item(), 9.0);
    EXPECT_EQ(dot(h, d).dtype(), DType::f64) << "float64 is not cast; the op's own promotion widens";
  }
  {
    autocast ac(DeviceType::cpu, DType::bf16, true, true, CastLists::cuda);
    EXPECT_EQ(dot(bh, bh).dtype(), DType::bf16);
    EXPECT_EQ(dot(h, h).dtype(), DType::f32) << "float16 in a bfloat16 region: promoted to float32";
  }
  {
    autocast ac(DeviceType::cpu, DType::bf16);  // the CPU's lists: dot is not on them
    EXPECT_EQ(dot(h, h).dtype(), DType::f16);
  }
}

// autocast_dtype answers what autocast_inputs does, for every op, input dtype and region (the
// question asked of the policy, the answer checked against real casts of real tensors), and outside
// any region it answers the input's own dtype.
TEST(Autocast, TheDtypeQueryAnswersWhatTheCastsDo) {
  const std::vector<DType> dtypes = {DType::f16, DType::bf16, DType::f32, DType::f64};
  auto check_all = [&](const char* region) {
#define AMP_CHECK_OP(op, cuda_policy, cpu_policy)                                                              \
    for (DType a : dtypes)                                                                                     \
      for (DType b : dtypes) {                                                                                 \
        Tensor x = zeros({2}, a), y = zeros({2}, b);                                                           \
        autocast_inputs(OpKind::op, {&x, &y});                                                                 \
        EXPECT_EQ(autocast_dtype(OpKind::op, a, DeviceType::cpu, {b}), x.dtype())                              \
            << region << " " << #op << " " << dtype_name(a) << " with " << dtype_name(b);                      \
        EXPECT_EQ(autocast_dtype(OpKind::op, b, DeviceType::cpu, {a}), y.dtype())                              \
            << region << " " << #op << " " << dtype_name(b) << " with " << dtype_name(a);                      \
      }
    AMP_FOR_EACH_OP_POLICY(AMP_CHECK_OP)
#undef AMP_CHECK_OP
  };
  check_all("no region");
  EXPECT_EQ(autocast_dtype(OpKind::mm, DType::f32, DeviceType::cpu), DType::f32);
  for (DType low : {DType::f16, DType::bf16}) {
    {
      autocast ac(DeviceType::cpu, low, true, true, CastLists::cuda);
      check_all("cuda lists");
      EXPECT_EQ(autocast_dtype(OpKind::mm, DType::f32, DeviceType::cpu), low);
      EXPECT_EQ(autocast_dtype(OpKind::softmax, low, DeviceType::cpu), DType::f32);
      EXPECT_EQ(autocast_dtype(OpKind::mm, DType::f32, DeviceType::cuda), DType::f32) << "another device type";
    }
    autocast ac(DeviceType::cpu, low);
    check_all("cpu lists");
  }
}

TEST(Autocast, CacheDisabledCastsEveryTime) {
  Generator gen(0);
  nn::Linear lin(4, 4, gen);
  const Tensor x = randn({2, 4}, gen);
  autocast ac(DeviceType::cpu, DType::f16, true, /*cache_enabled=*/false);
  EXPECT_FALSE(is_autocast_cache_enabled());
  lin(x);
  EXPECT_EQ(autocast_cache_size(), 0u);
}

TEST(Autocast, CastCacheOncePerOutermostRegion) {
  Generator gen(0);
  nn::Linear lin(4, 4, gen);
  const Tensor x = randn({2, 4}, gen);
  {
    autocast outer(DeviceType::cpu, DType::f16);
    const Tensor a = lin(x);
    const Tensor b = lin(a);  // the same weight again: no second cast
    EXPECT_EQ(autocast_cache_size(), 2u);
    {
      autocast inner(DeviceType::cpu, DType::f16);
      lin(x);
      EXPECT_EQ(autocast_cache_size(), 2u);
    }
    EXPECT_EQ(autocast_cache_size(), 2u) << "leaving an inner region keeps the cache";
    {
      autocast off(DeviceType::cpu, DType::f16, false);
      EXPECT_EQ(lin(x).dtype(), DType::f32) << "a disabled nested region runs in fp32";
    }
    EXPECT_EQ(lin(x).dtype(), DType::f16) << "the outer region is restored";
  }
  EXPECT_EQ(autocast_cache_size(), 0u);
  EXPECT_THROW(autocast(DeviceType::cpu, DType::f32), std::invalid_argument);
}

// Provided casts (an optimizer's low-precision copies) stand in for the region's casts of the
// parameters: the same numbers and gradients as casting, and they are what the forward reads.
TEST(Autocast, ProvidedCastsAreTheRegionsCasts) {
  for (DType dt : {DType::bf16, DType::f16}) {
    auto run = [&](bool provide, double factor) {
      Generator gen(4);
      nn::Linear l1(8, 16, gen), l2(16, 4, gen);
      const Tensor x = randn({5, 8}, gen);
      std::vector<Tensor> params = l1.parameters(), casts;
      for (const Tensor& p : l2.parameters()) params.push_back(p);
      for (const Tensor& p : params) casts.push_back(cast(mul(p.detach(), factor), dt));
      Tensor out;
      {
        autocast ac(DeviceType::cpu, dt);
        if (provide) autocast_provide_casts(params, casts);
        EXPECT_EQ(autocast_cache_size(), provide ? params.size() : 0u);
        out = l2(relu(l1(x)));
      }
      sum(mul(out.to(DType::f32), out.to(DType::f32))).backward();
      std::vector<Tensor> r = {out};
      for (const Tensor& p : params) r.push_back(p.grad());
      return r;
    };
    const auto cast_here = run(false, 1.0), provided = run(true, 1.0);
    for (size_t i = 0; i < cast_here.size(); ++i)
      EXPECT_TRUE(test::bitwise_equal(provided[i], cast_here[i])) << dtype_name(dt) << " result " << i;
    // Casts of 2 p are read as they are: the output is no longer the parameters'.
    EXPECT_FALSE(test::bitwise_equal(run(true, 2.0)[0], cast_here[0])) << dtype_name(dt);
  }
}

TEST(Autocast, ProvidedCastsAreChecked) {
  Generator gen(5);
  nn::Linear lin(4, 3, gen);
  const std::vector<Tensor> params = lin.parameters();
  std::vector<Tensor> bf16, f16;
  for (const Tensor& p : params) {
    bf16.push_back(cast(p.detach(), DType::bf16));
    f16.push_back(cast(p.detach(), DType::f16));
  }
  EXPECT_THROW(autocast_provide_casts(params, bf16), std::invalid_argument) << "outside a region";
  {
    autocast ac(DeviceType::cpu, DType::bf16);
    EXPECT_THROW(autocast_provide_casts(params, f16), std::invalid_argument) << "another dtype than the region's";
    EXPECT_THROW(autocast_provide_casts(params, {bf16[0]}), std::invalid_argument) << "counts differ";
    EXPECT_THROW(autocast_provide_casts({params[0].detach()}, {bf16[0]}), std::invalid_argument) << "not a parameter";
    EXPECT_THROW(autocast_provide_casts({params[0]}, {bf16[1]}), std::invalid_argument) << "shapes differ";
    EXPECT_EQ(autocast_cache_size(), 0u);
  }
  {
    autocast ac(DeviceType::cpu, DType::bf16, true, /*cache_enabled=*/false);
    autocast_provide_casts(params, bf16);
    EXPECT_EQ(autocast_cache_size(), 0u) << "without the cache every use casts";
  }
}

TEST(Autocast, Bf16MlpMatchesPyTorch) {
  const std::string f = "mlp_pytorch.safetensors";
  auto mlp = test::fixture_mlp();
  Tensor out;
  {
    autocast ac(DeviceType::cpu, DType::bf16);
    out = (*mlp)(test::fixture_tensor(f, "x"));
  }
  EXPECT_EQ(out.dtype(), DType::bf16);
  const Tensor loss = mse_loss(out.to(DType::f32), test::fixture_tensor(f, "y"));
  EXPECT_TRUE(test::all_close(out, test::fixture_tensor(f, "bf16.out"), 1e-2, 1e-2));
  EXPECT_TRUE(test::all_close(loss.reshape({1}), test::fixture_tensor(f, "bf16.loss"), 1e-2, 1e-3));
  loss.backward();
  for (auto& [name, p] : mlp->named_parameters())
    EXPECT_TRUE(test::all_close(p.grad(), test::fixture_tensor(f, "bf16.grad." + name), 2e-2, 2e-3)) << name;
}

// A bf16 weight cast from an fp32 parameter gets its gradient from the GEMM in fp32: the sum of the
// bf16 products accumulated in fp32, not rounded to bf16 and cast back as PyTorch makes it (that is
// the switch's other setting, checked here too). The oracle is the same sum in double, from the
// operands' bf16 values; fp16 keeps PyTorch's rounding.

TEST(Autocast, Bf16WeightGradientsAreTheGemmsFp32Sums) {
  struct Restore {
    ~Restore() { set_fp32_weight_grads(true); }
  } restore;
  Generator gen(21);
  const int64_t batch = 48, in = 24, out = 16;
  const Tensor x = randn({batch, in}, gen), r = randn({batch, out}, gen);
  for (DType low : {DType::bf16, DType::f16}) {
    // d(sum(y * r))/dW = r^T x, both operands as the region rounds them.
    const std::vector<double> xv = cast(x, low).to_vector(), rv = cast(r, low).to_vector();
    std::vector<double> ref(static_cast<size_t>(out * in), 0.0), mag(ref.size(), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t b = 0; b < batch; ++b) {
          const double t = rv[static_cast<size_t>(b * out + o)] * xv[static_cast<size_t>(b * in + i)];
          ref[static_cast<size_t>(o * in + i)] += t;
          mag[static_cast<size_t>(o * in + i)] += std::abs(t);
        }
    for (bool fused : {true, false}) {
      for (bool bucket : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(low)) + (fused ? " fp32 gradients" : " rounded gradients") +
                     (bucket ? ", into a destination" : ""));
        set_fp32_weight_grads(fused);
        Tensor w = randn({out, in}, gen).set_requires_grad(true), bias = randn({out}, gen).set_requires_grad(true);
        Tensor dst = full({out, in}, 7.0);
        if (bucket) w.set_grad_destination(dst);
        Tensor y;
        {
          autocast ac(DeviceType::cpu, low);
          y = linear(x, w, bias);
        }
        sum(mul(y.to(DType::f32), r)).backward();
        ASSERT_EQ(w.grad().dtype(), DType::f32);
        const bool exact = fused && low == DType::bf16;
        // Both ways land in the destination: the GEMM's fp32 output, or the cast of the rounded one.
        EXPECT_EQ(w.grad().data_ptr() == dst.data_ptr(), bucket);
        const std::vector<double> got = w.grad().to_vector();
        const int64_t rounded = test::count_representable(w.grad(), low == DType::bf16 ? 7 : 10);
        for (size_t k = 0; k < got.size(); ++k) {
          if (exact) {
            EXPECT_NEAR(got[k], ref[k], 1e-6 * mag[k]) << k;  // fp32 accumulation of exact products
          } else {
            EXPECT_NEAR(got[k], ref[k], std::ldexp(std::abs(ref[k]), low == DType::bf16 ? -8 : -11) + 1e-6 * mag[k]) << k;
          }
        }
        if (exact) {
          EXPECT_LT(rounded, static_cast<int64_t>(got.size()) / 4) << "fp32 sums, mostly not bf16 values";
        } else {
          EXPECT_EQ(rounded, static_cast<int64_t>(got.size())) << "every gradient is a rounded low-precision value";
        }
      }
    }
  }
}

// The fp32 weight gradients where they meet the rest of autograd: one cached cast used by two layers
// with the parameter's gradient bucket as destination (the reducer's case: the first gradient takes
// the bucket, the second must not write over it; the sum is fp32), and grad() or create_graph, which
// keep PyTorch's rounding (their results are the bf16 gradient cast back: bf16 values).
TEST(Autocast, Bf16WeightGradientsWithASharedCastADestinationAndGrad) {
  Generator gen(22);
  const Tensor x1 = randn({32, 16}, gen), x2 = randn({24, 16}, gen);
  Tensor w = randn({8, 16}, gen).set_requires_grad(true);
  auto loss = [&] {
    autocast ac(DeviceType::cpu, DType::bf16);  // the cache: both layers use one bf16 copy of w
    return add(sum(linear(x1, w, Tensor()).to(DType::f32)), mul(sum(linear(x2, w, Tensor()).to(DType::f32)), 3.0));
  };
  loss().backward();
  const std::vector<double> reference = w.grad().to_vector();
  w.set_grad(Tensor());
  Tensor bucket = full({8, 16}, 7.0);
  w.set_grad_destination(bucket);
  loss().backward();
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_EQ(w.grad().to_vector(), reference) << "the same sums with the bucket as destination";
  w.set_grad_destination(Tensor());
  for (bool create_graph : {false, true}) {
    Tensor one_layer;
    {
      autocast ac(DeviceType::cpu, DType::bf16);
      one_layer = sum(linear(x1, w, Tensor()).to(DType::f32));
    }
    const Tensor g = grad({one_layer}, {w}, {}, create_graph, create_graph)[0];
    ASSERT_EQ(g.dtype(), DType::f32);
    EXPECT_EQ(test::count_representable(g, 7), g.numel()) << "grad() keeps PyTorch's rounding (create_graph " << create_graph << ")";
  }
}

// Activation gradients of about 1e-8 are below fp16's smallest subnormal (6e-8): without scaling
// they flush to zero, with the default scale they survive.
TEST(Underflow, ShownNotAssumed) {
  Generator gen(3);
  nn::Linear l1(32, 32, gen), l2(32, 32, gen);
  const Tensor x = randn({16, 32}, gen), y = randn({16, 32}, gen);
  auto zeros_in_activation_grad = [&](double scale) {
    autocast ac(DeviceType::cpu, DType::f16);
    const Tensor h = l1(x);
    const Tensor loss = mul(mse_loss(l2(h), y), 1e-5);  // dL/dh ~ 1e-8
    const Tensor g = grad({mul(loss, scale)}, {h}, {}, false, false)[0];
    EXPECT_EQ(g.dtype(), DType::f16);
    int64_t z = 0;
    for (double v : g.to_vector()) z += v == 0.0;
    return static_cast<double>(z) / static_cast<double>(g.numel());
  };
  const double unscaled = zeros_in_activation_grad(1.0);
  const double scaled = zeros_in_activation_grad(GradScaler().get_scale());
  EXPECT_GT(unscaled, 0.5) << "most activation gradients flush to zero without scaling";
  EXPECT_LT(scaled, 0.01) << "scaled gradients survive";
}

}  // namespace
}  // namespace amp
