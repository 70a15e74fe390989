// AMP scenarios ported from PyTorch's GradScaler tests: the control-versus-scaled pattern (one
// model trained without scaling that simply skips the poisoned iteration, one trained with the
// scaler and an injected inf), autocast's dtypes and cache, underflow, and bf16 against PyTorch.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "amp/grad_scaler.h"
#include "models/mlp.h"
#include "runtime/autograd.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

enum class Clip { none, unscale_then_clip, clip_scaled };
enum class Opt { sgd, sgd_momentum, adamw };

struct Case {
  bool fp16 = false;
  Clip clip = Clip::none;
  bool penalty = false;
  int accumulate = 1;
  Opt opt = Opt::sgd;
  bool inject = true;
  bool enabled = true;
};

constexpr int kSkipIter = 2;
constexpr double kMaxNorm = 0.2;

std::shared_ptr<nn::Sequential> make_model() {
  Generator gen(7);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(8, 8, gen)).push_back(std::make_shared<nn::Linear>(8, 8, gen));
  return m;
}

std::unique_ptr<optim::Optimizer> make_opt(Opt o, const std::vector<Tensor>& p) {
  switch (o) {
    case Opt::sgd: return std::make_unique<optim::SGD>(p, optim::SgdOptions{1.0});
    case Opt::sgd_momentum: return std::make_unique<optim::SGD>(p, optim::SgdOptions{1.0, 0.9});
    case Opt::adamw: return std::make_unique<optim::AdamW>(p, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01});
  }
  return nullptr;
}

std::vector<std::pair<Tensor, Tensor>> make_data() {
  Generator g(11);
  std::vector<std::pair<Tensor, Tensor>> d;
  for (int i = 0; i < 4; ++i) {
    Tensor x = randn({8, 8}, g);
    d.emplace_back(x, randn({8, 8}, g));
  }
  return d;
}

Tensor grad_norm_of(const std::vector<Tensor>& grads) {
  Tensor sq = scalar_tensor(0.0);
  for (const Tensor& g : grads) sq = add(sq, sum(pow(g, 2.0)));
  return sqrt(sq);
}

// Trains one model; scaler == nullptr is the control.
void train(nn::Sequential& model, optim::Optimizer& opt, GradScaler* scaler, const Case& c) {
  const auto data = make_data();
  const std::vector<Tensor> params = model.parameters();
  for (size_t i = 0; i < data.size(); ++i) {
    const bool poisoned = c.inject && static_cast<int>(i) == kSkipIter;
    if (i % static_cast<size_t>(c.accumulate) == 0) opt.zero_grad();
    Tensor loss;
    {
      autocast ac(DeviceType::cpu, DType::f16, c.fp16);
      loss = mse_loss(model(data[i].first), data[i].second);
      if (c.accumulate > 1) loss = div(loss, static_cast<double>(c.accumulate));
    }
    if (c.penalty) {
      std::vector<Tensor> g;
      if (scaler) {
        g = grad({scaler->scale(loss)}, params, {}, true, true);
        const double inv = 1.0 / scaler->get_scale();
        for (Tensor& t : g) t = mul(t, inv);
      } else {
        g = grad({loss}, params, {}, true, true);
      }
      autocast ac(DeviceType::cpu, DType::f16, c.fp16);
      loss = add(loss, grad_norm_of(g));
    }
    const bool last_micro = (i + 1) % static_cast<size_t>(c.accumulate) == 0;
    if (scaler == nullptr) {
      loss.backward();
      if (c.clip != Clip::none) clip_grad_norm_(params, kMaxNorm);
      if (last_micro && !poisoned) opt.step();
      continue;
    }
    scaler->scale(loss).backward();
    if (poisoned && scaler->is_enabled()) {
      Tensor g = model.named_parameters()[2].second.grad();  // 1.weight
      g.data<float>()[0] = INFINITY;
    }
    if (!last_micro) continue;
    if (c.clip == Clip::unscale_then_clip) {
      scaler->unscale_(opt);
      clip_grad_norm_(params, kMaxNorm);
    } else if (c.clip == Clip::clip_scaled) {
      clip_grad_norm_(params, kMaxNorm * scaler->get_scale());
    }
    scaler->step(opt);
    scaler->update();
  }
}

void run_case(const Case& c, double expected_scale, double tol) {
  auto control = make_model(), scaled = make_model();
  auto opt_c = make_opt(c.opt, control->parameters());
  auto opt_s = make_opt(c.opt, scaled->parameters());
  GradScaler scaler(GradScalerOptions{.init_scale = 128.0f, .growth_factor = 2.0f, .growth_interval = 1, .enabled = c.enabled});
  Case control_case = c;
  control_case.inject = c.inject && c.enabled;  // a disabled scaler's run has no poisoned step
  train(*control, *opt_c, nullptr, control_case);
  train(*scaled, *opt_s, &scaler, c);
  EXPECT_EQ(scaler.get_scale(), expected_scale);
  const auto pc = control->named_parameters(), ps = scaled->named_parameters();
  for (size_t k = 0; k < pc.size(); ++k)
    EXPECT_TRUE(test::all_close(ps[k].second, pc[k].second, tol, tol)) << pc[k].first;
}

// 3 clean steps (x2 each) and one skipped (x0.5): 128 * 8 * 0.5.
constexpr double kScaleAfterOneSkip = 512.0;

TEST(ControlVsScaled, Plain) { run_case({}, kScaleAfterOneSkip, 1e-6); }
TEST(ControlVsScaled, AutocastFp16) { run_case({.fp16 = true}, kScaleAfterOneSkip, 1e-3); }
TEST(ControlVsScaled, UnscaleThenClip) { run_case({.clip = Clip::unscale_then_clip}, kScaleAfterOneSkip, 1e-6); }
TEST(ControlVsScaled, ClipScaledGrads) { run_case({.clip = Clip::clip_scaled}, kScaleAfterOneSkip, 1e-5); }
TEST(ControlVsScaled, GradientPenalty) { run_case({.penalty = true}, kScaleAfterOneSkip, 1e-5); }
TEST(ControlVsScaled, Accumulation) { run_case({.accumulate = 2, .inject = false}, 512.0, 1e-6); }
TEST(ControlVsScaled, SgdMomentum) { run_case({.opt = Opt::sgd_momentum}, kScaleAfterOneSkip, 1e-5); }
TEST(ControlVsScaled, AdamW) { run_case({.opt = Opt::adamw}, kScaleAfterOneSkip, 1e-5); }
TEST(ControlVsScaled, DisabledScalerGivesPlainResults) { run_case({.enabled = false}, 1.0, 1e-6); }

TEST(ControlVsScaled, TwoModelsTwoOptimizersTwoLosses) {
  const auto data = make_data();
  auto run = [&](bool scaling, std::shared_ptr<nn::Sequential> m0, std::shared_ptr<nn::Sequential> m1,
                 GradScaler* scaler) {
    optim::SGD o0(m0->parameters(), optim::SgdOptions{1.0}), o1(m1->parameters(), optim::SgdOptions{1.0});
    for (size_t i = 0; i < data.size(); ++i) {
      o0.zero_grad();
      o1.zero_grad();
      const Tensor out0 = (*m0)(data[i].first), out1 = (*m1)(data[i].first);
      const Tensor loss0 = mse_loss(add(mul(out0, 0.3), mul(out1, 0.7)), data[i].second);
      const Tensor loss1 = mse_loss(sub(mul(out0, 0.6), mul(out1, 0.4)), data[i].second);
      if (scaling) {
        scaler->scale(loss0).backward(Tensor(), true);
        scaler->scale(loss1).backward();
        if (static_cast<int>(i) == kSkipIter) m1->named_parameters()[2].second.grad().data<float>()[0] = INFINITY;
        scaler->unscale_(o0);  // one optimizer unscaled separately
        scaler->step(o0);
        scaler->step(o1);
        EXPECT_EQ(scaler->found_inf(o1), static_cast<int>(i) == kSkipIter);
        EXPECT_FALSE(scaler->found_inf(o0));
        scaler->update();
      } else {
        loss0.backward(Tensor(), true);
        loss1.backward();
        o0.step();
        if (static_cast<int>(i) != kSkipIter) o1.step();
      }
    }
  };
  auto c0 = make_model(), c1 = make_model(), s0 = make_model(), s1 = make_model();
  GradScaler scaler(GradScalerOptions{.init_scale = 128.0f, .growth_factor = 2.0f, .growth_interval = 1});
  run(false, c0, c1, nullptr);
  run(true, s0, s1, &scaler);
  EXPECT_EQ(scaler.get_scale(), kScaleAfterOneSkip);
  for (auto [c, s] : {std::pair{c0, s0}, std::pair{c1, s1}}) {
    const auto pc = c->parameters(), ps = s->parameters();
    for (size_t k = 0; k < pc.size(); ++k) EXPECT_TRUE(test::all_close(ps[k], pc[k], 1e-5, 1e-5));
  }
}

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
