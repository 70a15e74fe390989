// GradScaler: the update rule, the state machine and its messages, state_dict, the fused unscale
// kernel, and the extensions (hysteresis, min/max, error at min, overflow attribution).
#include <gtest/gtest.h>

#include <type_traits>

#include <cmath>
#include <functional>
#include <string>
#include <limits>

#include "amp/clip_grad.h"
#include "amp/grad_scaler.h"
#include "amp/overflow.h"
#include "runtime/kernels/backend.h"
#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

// One parameter whose gradient we set by hand, so every iteration is "clean" or "inf" on demand.
struct Rig {
  Tensor p = zeros({4}).set_requires_grad(true);
  optim::SGD opt{{p}, optim::SgdOptions{0.1}};
  void iterate(GradScaler& s, bool inf) {
    s.scale(scalar_tensor(1.0));  // as a real iteration does (and the first one creates the state)
    p.set_grad(full({4}, inf ? INFINITY : 1.0));
    s.step(opt);
    s.update();
  }
};

TEST(GradScaler, DefaultsAreTorchs) {
  GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0f);
  EXPECT_EQ(s.get_growth_factor(), 2.0f);
  EXPECT_EQ(s.get_backoff_factor(), 0.5f);
  EXPECT_EQ(s.get_growth_interval(), 2000);
  EXPECT_TRUE(s.is_enabled());
  EXPECT_EQ(s.get_growth_tracker(), 0);
}

TEST(GradScaler, ConstructorValidates) {
  EXPECT_THROW(GradScaler(GradScalerOptions{.growth_factor = 1.0f}), std::invalid_argument);
  EXPECT_THROW(GradScaler(GradScalerOptions{.backoff_factor = 1.0f}), std::invalid_argument);
  EXPECT_THROW(GradScaler(GradScalerOptions{.backoff_factor = 0.0f}), std::invalid_argument);
  EXPECT_THROW(GradScaler(GradScalerOptions{.growth_interval = 0}), std::invalid_argument);
  GradScaler s;
  EXPECT_THROW(s.set_growth_factor(0.5f), std::invalid_argument);
  EXPECT_EQ(s.get_growth_factor(), 2.0f);  // a rejected setter leaves the old value
}

TEST(GradScaler, UpdateSequenceFollowsAmpUpdateScale) {
  GradScaler s(GradScalerOptions{.init_scale = 4.0f, .growth_factor = 2.0f, .backoff_factor = 0.25f, .growth_interval = 2});
  Rig r;
  r.iterate(s, false);
  EXPECT_EQ(s.get_growth_tracker(), 1);
  EXPECT_EQ(s.get_scale(), 4.0f);
  r.iterate(s, false);
  EXPECT_EQ(s.get_growth_tracker(), 0);
  EXPECT_EQ(s.get_scale(), 8.0f);
  r.iterate(s, true);
  EXPECT_EQ(s.get_growth_tracker(), 0);
  EXPECT_EQ(s.get_scale(), 2.0f);
}

TEST(GradScaler, GrowthNeverOverflowsToInf) {
  GradScaler s(GradScalerOptions{.init_scale = 1e38f, .growth_factor = 16.0f, .growth_interval = 1});
  Rig r;
  r.iterate(s, false);
  EXPECT_EQ(s.get_scale(), 1e38f);
  EXPECT_EQ(s.get_growth_tracker(), 0);
}

TEST(GradScaler, UpdateWithNewScale) {
  GradScaler s;
  s.scale(scalar_tensor(1.0));
  s.update(1024.0f);
  EXPECT_EQ(s.get_scale(), 1024.0f);
  EXPECT_THROW(s.update(-1.0f), std::invalid_argument);
  // Positive in double, 0 in float32, or with an inverse that float32 cannot hold (below about
  // 2.9e-39: every gradient unscales to inf, and the backoff takes the scale to 0): refused, from
  // update, the options and a state dict alike. 1e-38 (inverse 1e38) is taken.
  EXPECT_THROW(s.update(1e-50), std::invalid_argument);
  EXPECT_THROW(s.update(1.5e-45), std::invalid_argument);
  EXPECT_THROW(s.update(2e-39), std::invalid_argument);
  EXPECT_THROW(s.update(1e39), std::invalid_argument);
  EXPECT_EQ(s.get_scale(), 1024.0f) << "a refused scale changed it";
  EXPECT_NO_THROW(s.update(1e-38));
  EXPECT_THROW(GradScaler(GradScalerOptions{.init_scale = 1e-50}), std::invalid_argument);
  auto sd = s.state_dict();
  sd["scale"] = 1e-50;
  EXPECT_THROW(s.load_state_dict(sd), std::invalid_argument);
  // A copy shared the scale's tensor: one's update changed the other's scale. Not copyable.
  static_assert(!std::is_copy_constructible_v<GradScaler> && std::is_move_constructible_v<GradScaler>);
}

void expect_message(const std::function<void()>& f, const std::string& msg) {
  try {
    f();
    ADD_FAILURE() << "no error; expected: " << msg;
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()), msg);
  }
}

TEST(GradScaler, StateMachineErrorsUseTorchsMessages) {
  GradScaler s;
  Rig r;
  expect_message([&] { s.unscale_(r.opt); },
                 "Attempted unscale_ but _scale is None.  This may indicate your script did not use "
                 "scaler.scale(loss or outputs) earlier in the iteration.");
  expect_message([&] { s.step(r.opt); },
                 "Attempted step but _scale is None.  This may indicate your script did not use "
                 "scaler.scale(loss or outputs) earlier in the iteration.");
  expect_message([&] { s.update(); },
                 "Attempted update but _scale is None.  This may indicate your script did not use "
                 "scaler.scale(loss or outputs) earlier in the iteration.");
  s.scale(scalar_tensor(1.0));
  r.p.set_grad(full({4}, 1.0));
  s.unscale_(r.opt);
  expect_message([&] { s.unscale_(r.opt); }, "unscale_() has already been called on this optimizer since the last update().");
  s.step(r.opt);
  expect_message([&] { s.unscale_(r.opt); }, "unscale_() is being called after step().");
  expect_message([&] { s.step(r.opt); }, "step() has already been called since the last update().");
  s.update();
  // An optimizer without any gradient records no inf check.
  r.p.set_grad(Tensor());
  expect_message([&] { s.step(r.opt); }, "No inf checks were recorded for this optimizer.");
  GradScaler s2;
  Tensor h = zeros({2}).set_requires_grad(true);
  optim::SGD opt2({h}, optim::SgdOptions{0.1});
  h.set_grad(zeros({2}, DType::f16));
  s2.scale(scalar_tensor(1.0));
  expect_message([&] { s2.unscale_(opt2); }, "Attempting to unscale FP16 gradients.");
  GradScaler s3;
  s3.scale(scalar_tensor(1.0));
  expect_message([&] { s3.update(); }, "No inf checks were recorded prior to update.");
}

// step() without unscale_ checks read-only and unscales inside the fused optimizer step; it must
// land on exactly the parameters (and gradients) that unscale_ + step gives.
TEST(GradScaler, FusedStepEqualsUnscaleThenStep) {
  for (bool adam : {false, true}) {
    for (bool poisoned : {false, true}) {
      Tensor a = from_vector({1.0, -2.0, 3.0}, {3}).set_requires_grad(true);
      Tensor b = from_vector({1.0, -2.0, 3.0}, {3}).set_requires_grad(true);
      std::unique_ptr<optim::Optimizer> oa, ob;
      if (adam) {
        oa = std::make_unique<optim::AdamW>(std::vector<Tensor>{a}, optim::AdamOptions{0.1});
        ob = std::make_unique<optim::AdamW>(std::vector<Tensor>{b}, optim::AdamOptions{0.1});
      } else {
        oa = std::make_unique<optim::SGD>(std::vector<Tensor>{a}, optim::SgdOptions{0.1, 0.9});
        ob = std::make_unique<optim::SGD>(std::vector<Tensor>{b}, optim::SgdOptions{0.1, 0.9});
      }
      GradScaler sa(GradScalerOptions{.init_scale = 3.0f}), sb(GradScalerOptions{.init_scale = 3.0f});
      for (int i = 0; i < 3; ++i) {
        const double bad = poisoned && i == 1 ? INFINITY : 0.0;
        a.set_grad(from_vector({0.3 * 3, -0.7 * 3, 0.1 * 3 + bad}, {3}));
        b.set_grad(from_vector({0.3 * 3, -0.7 * 3, 0.1 * 3 + bad}, {3}));
        sa.scale(scalar_tensor(1.0));
        sb.scale(scalar_tensor(1.0));
        sa.unscale_(*oa);
        sa.step(*oa);
        sa.update();
        const double scale = sb.get_scale();
        sb.step(*ob);  // fused path
        EXPECT_EQ(sb.found_inf(*ob), poisoned && i == 1);
        // The unscaled gradient is written back (PyTorch's fused kernels do too), unless the step
        // was skipped: then the kernel returns before touching anything.
        EXPECT_NEAR(b.grad().to_vector()[0], poisoned && i == 1 ? 0.9 : 0.9 / scale, 1e-6);
        sb.update();
      }
      EXPECT_TRUE(test::bitwise_equal(a, b)) << (adam ? "adamw" : "sgd") << (poisoned ? " with an overflow" : "");
      EXPECT_EQ(sa.get_scale(), sb.get_scale());
    }
  }
}

TEST(GradScaler, StateDictRoundTripRestoresEveryKey) {
  GradScaler a(GradScalerOptions{.init_scale = 8.0f, .growth_factor = 3.0f, .backoff_factor = 0.25f, .growth_interval = 5});
  Rig r;
  r.iterate(a, false);
  r.iterate(a, false);
  const auto sd = a.state_dict();
  EXPECT_EQ(sd.size(), 5u);
  GradScaler b(GradScalerOptions{.init_scale = 1.0f, .growth_factor = 1.5f, .backoff_factor = 0.75f, .growth_interval = 100});
  b.load_state_dict(sd);
  EXPECT_EQ(b.get_scale(), 8.0f);
  EXPECT_EQ(b.get_growth_factor(), 3.0f);
  EXPECT_EQ(b.get_backoff_factor(), 0.25f);
  EXPECT_EQ(b.get_growth_interval(), 5);
  EXPECT_EQ(b.get_growth_tracker(), 2);
  EXPECT_EQ(b.state_dict(), sd);
  EXPECT_THROW(b.load_state_dict({}), std::runtime_error);
}

TEST(GradScaler, DisabledIsATransparentPassThrough) {
  GradScaler s(GradScalerOptions{.enabled = false});
  const Tensor loss = scalar_tensor(3.0);
  EXPECT_TRUE(s.scale(loss).same(loss));
  EXPECT_EQ(s.get_scale(), 1.0f);
  Rig r;
  r.p.set_grad(full({4}, 1.0));
  s.step(r.opt);
  s.update();
  EXPECT_NEAR(r.p.to_vector()[0], -0.1, 1e-7);
  EXPECT_TRUE(s.state_dict().empty());
}

TEST(UnscaleKernel, UnscalesAndFlags) {
  Backend& b = backend_for(kCPU);
  Tensor g = full({10, 10}, 4.0);
  Tensor found = zeros({1});
  b.unscale_and_check({g}, scalar_tensor(4.0), found);  // inv_scale 0.25
  for (double v : g.to_vector()) ASSERT_EQ(v, 1.0);
  EXPECT_EQ(found.item(), 0.0);
  for (double bad : {INFINITY, NAN}) {
    Tensor h = full({10, 10}, 4.0);
    h.data<float>()[2 * 10 + 2] = static_cast<float>(bad);
    Tensor f = zeros({1});
    b.unscale_and_check({h}, scalar_tensor(4.0), f);
    EXPECT_EQ(f.item(), 1.0);
    EXPECT_EQ(h.to_vector()[0], 1.0);  // finite values are unscaled even so
  }
  Tensor a = full({3}, 1.0), c = full({3}, 1.0, DType::bf16);
  EXPECT_THROW(b.unscale_and_check({a, c}, scalar_tensor(2.0), found), std::invalid_argument);
}

// The check sees what the step applies: the unscaled gradients. A scale whose float32 inverse
// overflows (below about 2.9e-39), or a finite gradient whose unscaled value leaves float32's range,
// must skip the step, on both paths (step() alone, and unscale_ then step()). Checking the scaled
// gradients only let a step write inf and NaN into every weight and exit 0.
TEST(GradScaler, StepIsSkippedWhenTheUnscaledGradientsAreNotFinite) {
  struct Case {
    float scale;
    float grad;
  };
  for (const Case c : {Case{1e-45f, 1e-3f}, Case{1e-45f, 0.0f}, Case{1e-30f, 1e10f}, Case{2e-39f, 1.0f}}) {
    for (bool explicit_unscale : {false, true}) {
      SCOPED_TRACE("scale " + std::to_string(c.scale) + " grad " + std::to_string(c.grad) +
                   (explicit_unscale ? " unscale_" : " step"));
      ASSERT_FALSE(std::isfinite(c.grad * static_cast<float>(1.0 / c.scale)));  // the case is one
      // Scales no option takes (their float32 inverse is inf), but a run's backoffs can reach, set
      // through update(tensor), which copies as PyTorch's does.
      GradScaler s;
      Rig r;
      s.scale(scalar_tensor(1.0));
      s.update(full({1}, c.scale));
      s.scale(scalar_tensor(1.0));
      r.p.set_grad(full({4}, c.grad));
      if (explicit_unscale) s.unscale_(r.opt);
      s.step(r.opt);
      EXPECT_TRUE(s.found_inf(r.opt));
      for (double v : r.p.to_vector()) EXPECT_EQ(v, 0.0) << "the step was taken";
      s.update();
    }
  }
  // A finite unscaled value at the edge of the range is taken (the check is not stricter than that).
  GradScaler s(GradScalerOptions{.init_scale = 0.5f});
  Rig r;
  s.scale(scalar_tensor(1.0));
  r.p.set_grad(full({4}, 1e38));
  s.step(r.opt);
  EXPECT_FALSE(s.found_inf(r.opt));
  for (double v : r.p.to_vector()) EXPECT_TRUE(std::isfinite(v) && v != 0.0);
}

TEST(GradScaler, HysteresisToleratesConsecutiveOverflows) {
  GradScaler s(GradScalerOptions{.init_scale = 64.0f, .growth_interval = 1000, .hysteresis = 2});
  Rig r;
  r.iterate(s, true);
  EXPECT_EQ(s.get_scale(), 64.0f);  // first overflow tolerated
  r.iterate(s, false);              // a clean step resets the counter
  r.iterate(s, true);
  EXPECT_EQ(s.get_scale(), 64.0f);
  r.iterate(s, true);               // second consecutive overflow backs off
  EXPECT_EQ(s.get_scale(), 32.0f);
  r.iterate(s, true);               // and keeps backing off while overflows continue
  EXPECT_EQ(s.get_scale(), 16.0f);
}

// With hysteresis the state_dict carries the overflows still tolerated (an extension of PyTorch's
// keys), so a scaler loaded from it backs off where the one it came from would.
TEST(GradScaler, StateDictCarriesTheHysteresisCount) {
  const GradScalerOptions o{.init_scale = 64.0f, .growth_interval = 1000, .hysteresis = 3};
  GradScaler a(o);
  Rig r;
  r.iterate(a, true);  // one of three tolerated overflows used
  const auto sd = a.state_dict();
  ASSERT_TRUE(sd.count("_hysteresis_left"));
  EXPECT_EQ(sd.at("_hysteresis_left"), 2.0);
  EXPECT_FALSE(GradScaler().state_dict().count("_hysteresis_left"));  // PyTorch's keys without hysteresis
  for (bool loaded_before_first_scale : {true, false}) {
    GradScaler b(o);
    Rig rb;
    if (!loaded_before_first_scale) rb.iterate(b, false);
    b.load_state_dict(sd);
    rb.iterate(b, true);
    EXPECT_EQ(b.get_scale(), 64.0f);  // the second overflow is still tolerated
    rb.iterate(b, true);
    EXPECT_EQ(b.get_scale(), 32.0f) << "the third consecutive overflow backs off, as in the scaler saved";
  }
}

TEST(GradScaler, MinAndMaxScaleClamp) {
  GradScaler s(GradScalerOptions{.init_scale = 4.0f, .growth_interval = 1, .min_scale = 2.0f, .max_scale = 8.0f});
  Rig r;
  r.iterate(s, false);
  EXPECT_EQ(s.get_scale(), 8.0f);
  r.iterate(s, false);
  EXPECT_EQ(s.get_scale(), 8.0f);  // capped
  r.iterate(s, true);
  r.iterate(s, true);
  r.iterate(s, true);
  EXPECT_EQ(s.get_scale(), 2.0f);  // floored
}

TEST(GradScaler, ErrorAtMinScaleNamesTheScale) {
  GradScaler s(GradScalerOptions{.init_scale = 2.0f, .min_scale = 1.0f, .error_at_min_scale = true});
  Rig r;
  r.iterate(s, true);  // 2 -> 1
  EXPECT_EQ(s.get_scale(), 1.0f);
  try {
    r.iterate(s, true);
    ADD_FAILURE() << "no error at the minimum scale";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("minimum (1.0"), std::string::npos) << e.what();
  }
  // With hysteresis, as DeepSpeed's DynamicLossScaler: an overflow that hysteresis tolerates keeps the
  // scale and is no error (it threw at the first overflow at the minimum); the one that would back
  // off is.
  GradScaler h(GradScalerOptions{.init_scale = 1.0f, .hysteresis = 2, .min_scale = 1.0f, .error_at_min_scale = true});
  Rig rh;
  EXPECT_NO_THROW(rh.iterate(h, true));
  EXPECT_EQ(h.get_scale(), 1.0f);
  EXPECT_THROW(rh.iterate(h, true), std::runtime_error);
  // The scaler can be used again after the error (it was left stepped: scale() then refused).
  EXPECT_NO_THROW(rh.iterate(h, false));
}

TEST(GradScaler, ConstantScaleSkipsButNeverChanges) {
  GradScaler s(GradScalerOptions{.init_scale = 128.0f, .growth_interval = 1, .dynamic = false});
  Rig r;
  r.iterate(s, false);
  r.iterate(s, true);
  EXPECT_EQ(s.get_scale(), 128.0f);
  // Only the clean step moved it, by lr * (1 / 128) since the rig's gradient is unscaled by 128.
  EXPECT_NEAR(r.p.to_vector()[0], -0.1 / 128.0, 1e-9);
}

TEST(Overflow, AttributionNamesTheLayer) {
  Generator gen(0);
  nn::Sequential m;
  m.push_back(std::make_shared<nn::Linear>(4, 4, gen)).push_back(std::make_shared<nn::Linear>(4, 4, gen));
  for (Tensor p : m.parameters()) p.set_grad(zeros(p.shape()));
  Tensor g = m.named_parameters()[2].second.grad();  // 1.weight
  g.data<float>()[5] = NAN;
  EXPECT_EQ(nonfinite_gradients(m.named_parameters()), (std::vector<std::string>{"1.weight"}));
}

// Misuse from C++ is an exception naming it (a stranger's probe of the API): an optimizer step read
// any found_inf or grad_scale as one float32 (a float64 1 did not skip the step, a float16 scale
// gave garbage, an empty found_inf read null); an undefined tensor anywhere dereferenced null; a
// dynamic scale outside [min_scale, max_scale] was taken as it was.
TEST(ApiMisuse, IsAnExceptionNamingIt) {
  Tensor p = zeros({2}).set_requires_grad(true);
  p.set_grad(from_vector({3.0, 4.0}, {2}));
  optim::SGD opt({p}, optim::SgdOptions{1.0});
  auto says = [](const std::function<void()>& f, const std::string& text) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected: " << text;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  says([&] { opt.step(from_vector({1.0}, {1}, DType::f64)); }, "optimizer step: found_inf: expected one float32 on cpu");
  says([&] { opt.step(zeros({0})); }, "found_inf: expected one float32");
  says([&] { opt.step(zeros({2})); }, "found_inf: expected one float32");
  says([&] { opt.step(Tensor(), full({1}, 2.0, DType::f16)); }, "optimizer step: grad_scale: expected one float32");
  EXPECT_EQ(p.to_vector(), (std::vector<double>{0.0, 0.0})) << "no refused step moved the parameter";
  opt.step(zeros({1}));
  EXPECT_EQ(p.to_vector(), (std::vector<double>{-3.0, -4.0})) << "a float32 found_inf of 0 steps";

  const std::string undefined = "an undefined tensor";
  says([&] { GradScaler().scale(Tensor()); }, undefined);
  says([&] { optim::SGD bad({Tensor()}, optim::SgdOptions{0.1}); }, undefined);
  says([&] { clip_grad_norm_({p, Tensor()}, 1.0); }, undefined);
  says([&] { add(Tensor(), p); }, undefined);
  says([&] { Tensor().backward(); }, undefined);
  says([&] { (void)Tensor().shape(); }, undefined);
  says([&] { optim::SGD twice({p, p}, optim::SgdOptions{0.1}); }, "a parameter appears twice in the parameter list");

  GradScalerOptions o;
  o.init_scale = 100.0;
  o.max_scale = 8.0f;
  says([&] { GradScaler s(o); }, "init_scale must lie in [min_scale, max_scale]");
}

}  // namespace
}  // namespace amp
