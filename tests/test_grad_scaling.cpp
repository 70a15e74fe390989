// PyTorch's own GradScaler tests (test_torch.py's test_grad_scaling_*), re-expressed against the C++
// API from their descriptions, on the CPU and (when one is usable, as on the emulated GPU) on CUDA.
// The pattern of most: a control model trained in fp32 without scaling, which simply skips the
// poisoned iteration, against a model trained through the scaler with an inf injected where PyTorch
// injects it; grads, optimizer state and parameters must agree to PyTorch's tolerances (rtol 1e-5,
// atol 1e-7 unless the PyTorch test says otherwise), and the scale must have grown and backed off
// exactly as often as PyTorch's test expects.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "amp/grad_scaler.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

constexpr Device kGPU{DeviceType::cuda, 0};
using MakeOpt = std::function<std::unique_ptr<optim::Optimizer>(const std::vector<Tensor>&)>;
using Data = std::vector<std::pair<Tensor, Tensor>>;

// The device under test: the CPU, or CUDA when a device is usable (else the test skips).
class GradScaling : public ::testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceType::cuda) {
      std::string reason;
      if (!cuda_usable(&reason)) GTEST_SKIP() << "no usable CUDA device: " << reason;
      cuda_init(0);
    }
  }
  Device dev() const { return GetParam() == DeviceType::cuda ? kGPU : kCPU; }
};

std::shared_ptr<nn::Sequential> make_model(Generator& gen, Device d) {
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(8, 8, gen, true, d)).push_back(std::make_shared<nn::Linear>(8, 8, gen, true, d));
  return m;
}

// _create_scaling_models_optimizers: two identical models, an optimizer on each (lr 1 by default).
struct Rig {
  std::shared_ptr<nn::Sequential> control, scaling;
  std::unique_ptr<optim::Optimizer> opt_control, opt_scaling;
  Data data;
  static constexpr int kSkipIter = 2;
};

MakeOpt sgd(double lr = 1.0, double momentum = 0.0) {
  return [=](const std::vector<Tensor>& p) {
    optim::SgdOptions o;
    o.lr = lr;
    o.momentum = momentum;
    return std::make_unique<optim::SGD>(p, o);
  };
}

Rig make_rig(Device d, const MakeOpt& make, uint64_t seed = 7) {
  Rig r;
  Generator gen(seed);
  r.control = make_model(gen, d);
  r.scaling = make_model(gen, d);
  const auto pc = r.control->parameters(), ps = r.scaling->parameters();
  for (size_t i = 0; i < pc.size(); ++i) {
    Tensor s = ps[i];
    copy_(s, pc[i].detach());
  }
  r.opt_control = make(pc);
  r.opt_scaling = make(ps);
  Generator g(seed + 4);
  for (int i = 0; i < 4; ++i) r.data.emplace_back(randn({8, 8}, g, DType::f32, d), randn({8, 8}, g, DType::f32, d));
  return r;
}

// model[1].weight.grad.fill_(inf)
void poison(nn::Sequential& m) {
  Tensor g = m.named_parameters()[2].second.grad();
  fill_(g, INFINITY);
}

// Grads, every optimizer state tensor and parameters, control against scaled.
::testing::AssertionResult same_training(Rig& r, double atol) {
  const auto pc = r.control->named_parameters(), ps = r.scaling->named_parameters();
  const optim::OptimizerStateDict sc = r.opt_control->state_dict(), ss = r.opt_scaling->state_dict();
  for (size_t i = 0; i < pc.size(); ++i) {
    const std::string& n = pc[i].first;
    const Tensor gc = pc[i].second.grad(), gs = ps[i].second.grad();
    if (gc.defined() != gs.defined()) return ::testing::AssertionFailure() << n << ": one grad is undefined";
    if (gc.defined()) {
      auto ok = test::all_close(gs.to(kCPU), gc.to(kCPU), 1e-5, atol);
      if (!ok) return ok << " (grad of " << n << ")";
    }
    auto ok = test::all_close(ps[i].second.to(kCPU), pc[i].second.to(kCPU), 1e-5, atol);
    if (!ok) return ok << " (parameter " << n << ")";
  }
  if (sc.state.size() != ss.state.size()) return ::testing::AssertionFailure() << "optimizer states differ in size";
  for (const auto& [id, st] : sc.state)
    for (const auto& [k, t] : st) {
      auto ok = test::all_close(ss.state.at(id).at(k).to(kCPU), t.to(kCPU), 1e-5, atol);
      if (!ok) return ok << " (optimizer state " << k << " of parameter " << id << ")";
    }
  return ::testing::AssertionSuccess();
}

using TrainRun = std::function<void(Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool try_scaling_api)>;

// _run_scaling_case: enabled and disabled; the scaler (init 128, growth 2 every step) is shared by
// the control run, which only asks it is_enabled(), and the scaled run. expect_same = false keeps
// PyTorch's expectation that the comparison fails (Adam under autocast).
void run_scaling_case(Device d, const TrainRun& run, int unskipped, int skipped, double atol = 1e-7,
                      const MakeOpt& make = sgd(), bool expect_same = true) {
  bool all_same = true;
  for (bool enabled : {true, false}) {
    Rig r = make_rig(d, make);
    GradScaler scaler(GradScalerOptions{.init_scale = 128.0, .growth_factor = 2.0, .growth_interval = 1, .enabled = enabled});
    run(r, *r.control, *r.opt_control, scaler, false);
    run(r, *r.scaling, *r.opt_scaling, scaler, true);
    if (enabled) {
      EXPECT_EQ(scaler.get_scale(), 128.0 * std::pow(2.0, unskipped) * std::pow(0.5, skipped));
    } else {
      EXPECT_EQ(scaler.get_scale(), 1.0);
    }
    const auto same = same_training(r, atol);
    if (expect_same) {
      EXPECT_TRUE(same) << (enabled ? "scaler enabled" : "scaler disabled");
    }
    all_same = all_same && same;
  }
  if (!expect_same) {
    EXPECT_FALSE(all_same) << "PyTorch expects this comparison to fail";
  }
}

// The control run: backward, then step unless this is the poisoned iteration of an enabled scaler.
void control_step(const Tensor& loss, optim::Optimizer& opt, const GradScaler& scaler, int i) {
  loss.backward();
  if (!scaler.is_enabled() || i != Rig::kSkipIter) opt.step();
}

// test_grad_scaling_autocast: fp32 control against fp16 autocast with scaling, atol 1e-3 ("pure
// fp32 arithmetic vs a mixture of fp16 and fp32"). PyTorch expects Adam and AdamW to fail it.
TrainRun autocast_run(DeviceType type) {
  return [type](Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool scaling) {
    for (int i = 0; i < static_cast<int>(r.data.size()); ++i) {
      opt.zero_grad();
      Tensor loss;
      {
        autocast ac(type, DType::f16, /*enabled=*/scaling);
        loss = mse_loss(model(r.data[i].first), r.data[i].second);
      }
      if (!scaling) {
        control_step(loss, opt, scaler, i);
        continue;
      }
      scaler.scale(loss).backward();
      if (i == Rig::kSkipIter && scaler.is_enabled()) poison(model);
      scaler.step(opt);
      scaler.update();
    }
  };
}

TEST_P(GradScaling, Autocast) {
  const TrainRun run = autocast_run(GetParam());
  run_scaling_case(dev(), run, 3, 1, 1e-3, sgd());
  run_scaling_case(dev(), run, 3, 1, 1e-3, sgd(1.0, 0.9));
  for (bool decoupled : {false, true}) {
    for (bool amsgrad : {false, true}) {
      const MakeOpt adam = [=](const std::vector<Tensor>& p) -> std::unique_ptr<optim::Optimizer> {
        optim::AdamOptions o;
        o.lr = 1.0;
        o.amsgrad = amsgrad;
        if (decoupled) return std::make_unique<optim::AdamW>(p, o);
        return std::make_unique<optim::Adam>(p, o);
      };
      run_scaling_case(dev(), run, 3, 1, 1e-3, adam, /*expect_same=*/false);
    }
  }
}

// test_grad_scaling_clipping: clip the scaled gradients by max_norm * scale, inject the inf after
// clipping (as PyTorch does), atol 1e-5.
TEST_P(GradScaling, Clipping) {
  const double max_norm = 0.2;
  run_scaling_case(dev(), [&](Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool scaling) {
    for (int i = 0; i < static_cast<int>(r.data.size()); ++i) {
      opt.zero_grad();
      const Tensor loss = mse_loss(model(r.data[i].first), r.data[i].second);
      if (!scaling) {
        loss.backward();
        clip_grad_norm_(model.parameters(), max_norm);
        if (!scaler.is_enabled() || i != Rig::kSkipIter) opt.step();
        continue;
      }
      scaler.scale(loss).backward();
      clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale());
      if (i == Rig::kSkipIter && scaler.is_enabled()) poison(model);
      scaler.step(opt);
      scaler.update();
    }
  }, 3, 1, 1e-5);
}

// test_grad_scaling_clipping_separate_unscale: inject, unscale_, clip (error_if_nonfinite=false).
TEST_P(GradScaling, ClippingSeparateUnscale) {
  const double max_norm = 0.2;
  run_scaling_case(dev(), [&](Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool scaling) {
    for (int i = 0; i < static_cast<int>(r.data.size()); ++i) {
      opt.zero_grad();
      const Tensor loss = mse_loss(model(r.data[i].first), r.data[i].second);
      if (!scaling) {
        loss.backward();
        clip_grad_norm_(model.parameters(), max_norm);
        if (!scaler.is_enabled() || i != Rig::kSkipIter) opt.step();
        continue;
      }
      scaler.scale(loss).backward();
      if (i == Rig::kSkipIter && scaler.is_enabled()) poison(model);
      scaler.unscale_(opt);
      clip_grad_norm_(model.parameters(), max_norm, 2.0, /*error_if_nonfinite=*/false);
      scaler.step(opt);
      scaler.update();
    }
  }, 3, 1);
}

// test_grad_scaling_penalty: the gradient penalty through autograd.grad of the scaled loss.
TEST_P(GradScaling, Penalty) {
  run_scaling_case(dev(), [&](Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool scaling) {
    for (int i = 0; i < static_cast<int>(r.data.size()); ++i) {
      opt.zero_grad();
      Tensor loss = mse_loss(model(r.data[i].first), r.data[i].second);
      std::vector<Tensor> grads;
      if (scaling) {
        grads = grad({scaler.scale(loss)}, model.parameters(), {}, true, true);
        const double inv_scale = 1.0 / scaler.get_scale();
        for (Tensor& g : grads) g = mul(g, inv_scale);
      } else {
        grads = grad({loss}, model.parameters(), {}, true, true);
      }
      Tensor norm = zeros({}, DType::f32, r.data[0].first.device());
      for (const Tensor& g : grads) norm = add(norm, sum(pow(g, 2.0)));
      loss = add(loss, sqrt(norm));
      if (!scaling) {
        control_step(loss, opt, scaler, i);
        continue;
      }
      scaler.scale(loss).backward();
      if (i == Rig::kSkipIter && scaler.is_enabled()) poison(model);
      scaler.step(opt);
      scaler.update();
    }
  }, 3, 1);
}

// test_grad_scaling_accumulation: two micro-batches per step, loss / 2, no skip.
TEST_P(GradScaling, Accumulation) {
  run_scaling_case(dev(), [&](Rig& r, nn::Sequential& model, optim::Optimizer& opt, GradScaler& scaler, bool scaling) {
    const int iters_to_accumulate = 2;
    for (int i = 0; i < static_cast<int>(r.data.size()); ++i) {
      const Tensor loss = div(mse_loss(model(r.data[i].first), r.data[i].second), iters_to_accumulate);
      if (scaling) scaler.scale(loss).backward();
      else loss.backward();
      if ((i + 1) % iters_to_accumulate == 0) {
        if (scaling) {
          scaler.step(opt);
          scaler.update();
        } else {
          opt.step();
        }
        opt.zero_grad();
      }
    }
  }, 2, 0);
}

// test_grad_scaling_multiple: two models, two optimizers, two losses; one optimizer unscaled
// separately; the inf in the second model skips only the second optimizer.
TEST_P(GradScaling, Multiple) {
  for (bool enabled : {true, false}) {
    Rig r0 = make_rig(dev(), sgd(), 7), r1 = make_rig(dev(), sgd(), 9);
    GradScaler scaler(GradScalerOptions{.init_scale = 128.0, .growth_factor = 2.0, .growth_interval = 1, .enabled = enabled});
    auto run = [&](nn::Sequential& m0, nn::Sequential& m1, optim::Optimizer& o0, optim::Optimizer& o1, bool scaling) {
      for (int i = 0; i < static_cast<int>(r0.data.size()); ++i) {
        o0.zero_grad();
        o1.zero_grad();
        const auto& [input, target] = r0.data[static_cast<size_t>(i)];
        const Tensor out0 = m0(input), out1 = m1(input);
        const Tensor loss0 = mse_loss(add(mul(out0, 0.3), mul(out1, 0.7)), target);
        const Tensor loss1 = mse_loss(sub(mul(out0, 0.6), mul(out1, 0.4)), target);
        if (scaling) {
          scaler.scale(loss0).backward(Tensor(), /*retain_graph=*/true);
          scaler.scale(loss1).backward();
          if (i == Rig::kSkipIter && scaler.is_enabled()) poison(m1);
          scaler.unscale_(o0);
          scaler.step(o0);
          scaler.step(o1);
          scaler.update();
        } else {
          loss0.backward(Tensor(), true);
          loss1.backward();
          o0.step();
          if (!scaler.is_enabled() || i != Rig::kSkipIter) o1.step();
        }
      }
    };
    run(*r0.control, *r1.control, *r0.opt_control, *r1.opt_control, false);
    run(*r0.scaling, *r1.scaling, *r0.opt_scaling, *r1.opt_scaling, true);
    EXPECT_EQ(scaler.get_scale(), enabled ? 128.0 * 8.0 * 0.5 : 1.0);
    for (Rig* r : {&r0, &r1}) {
      const auto pc = r->control->parameters(), ps = r->scaling->parameters();
      for (size_t k = 0; k < pc.size(); ++k) EXPECT_TRUE(test::all_close(ps[k].to(kCPU), pc[k].to(kCPU), 1e-5, 1e-7));
    }
  }
}

// test_grad_scaling_will_not_overflow: a scale of 1e38 growing by 16 stays finite.
TEST_P(GradScaling, WillNotOverflow) {
  Generator gen(3);
  nn::Linear model(5, 1, gen, true, dev());
  optim::Adam opt(model.parameters(), optim::AdamOptions{});
  GradScaler scaler(GradScalerOptions{.init_scale = 1e38, .growth_factor = 16.0, .growth_interval = 1});
  opt.zero_grad();
  const Tensor x = randn({1, 5}, gen, DType::f32, dev());
  const Tensor y = mul(randn({1, 1}, gen, DType::f32, dev()), 1e-30);
  const Tensor d = sub(model(x), y);
  const Tensor l = mean(mul(d, d));
  scaler.scale(l).backward();
  scaler.step(opt);
  scaler.update();
  EXPECT_TRUE(std::isfinite(scaler.get_scale())) << scaler.get_scale();
}

// test_params_invalidated_with_grads_invalidated_between_unscale_and_step: once unscale_ found the
// gradients finite, breaking them afterwards does not skip the step: every parameter goes non-finite.
TEST_P(GradScaling, ParamsInvalidatedWithGradsInvalidatedBetweenUnscaleAndStep) {
  const std::vector<MakeOpt> makers = {
      sgd(0.1), sgd(0.1, 0.9),
      [](const std::vector<Tensor>& p) { return std::make_unique<optim::Adam>(p, optim::AdamOptions{}); },
      [](const std::vector<Tensor>& p) { return std::make_unique<optim::AdamW>(p); }};
  for (const MakeOpt& make : makers) {
    Rig r = make_rig(dev(), make);
    GradScaler scaler(GradScalerOptions{.init_scale = 128.0});
    for (const auto& [input, target] : r.data) {
      r.opt_control->zero_grad();
      Tensor loss;
      {
        autocast ac(GetParam(), DType::f16);
        loss = mse_loss((*r.control)(input), target);
      }
      scaler.scale(loss).backward();
      scaler.unscale_(*r.opt_control);
      size_t j = 0;
      for (const Tensor& p : r.control->parameters()) {
        Tensor g = p.grad();
        fill_(g, j++ % 2 ? INFINITY : NAN);
      }
      scaler.step(*r.opt_control);
      scaler.update();
    }
    for (const Tensor& p : r.control->parameters()) {
      bool nonfinite = false;
      for (double v : p.to_vector()) nonfinite = nonfinite || !std::isfinite(v);
      EXPECT_TRUE(nonfinite);
    }
  }
}

// test_grad_scaling_pass_itself: an optimizer that does its own AMP scaling (here every optimizer:
// the fused step) gets the scaler's scale and found_inf, instead of gradients the scaler unscaled.
class RecordingSgd : public optim::SGD {
 public:
  using optim::SGD::SGD;
  Tensor seen_found_inf, seen_grad_scale;

 protected:
  void step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                  const Tensor& grad_scale, const NormClip& clip) override {
    seen_found_inf = found_inf;
    seen_grad_scale = grad_scale;
    optim::SGD::step_group(group, index, steps, found_inf, grad_scale, clip);
  }
};

TEST_P(GradScaling, PassItself) {
  Generator gen(5);
  nn::Linear m(4, 1, gen, true, dev());
  const Tensor x = randn({4, 4}, gen, DType::f32, dev());
  RecordingSgd o1(m.parameters(), optim::SgdOptions{}), o2(m.parameters(), optim::SgdOptions{});
  GradScaler scaler(GradScalerOptions{.init_scale = 2.0});
  Tensor loss;
  {
    autocast ac(GetParam(), DType::f16);
    loss = mean(m(x));
  }
  scaler.scale(loss).backward();
  scaler.step(o1);  // no unscale_: the optimizer gets the scale and unscales in its own pass
  ASSERT_TRUE(o1.seen_grad_scale.defined());
  EXPECT_EQ(o1.seen_grad_scale.item(), 2.0);
  ASSERT_TRUE(o1.seen_found_inf.defined());
  EXPECT_EQ(o1.seen_found_inf.item(), 0.0);
  scaler.unscale_(o2);  // unscaled first: only found_inf travels
  scaler.step(o2);
  EXPECT_FALSE(o2.seen_grad_scale.defined());
  EXPECT_TRUE(o2.seen_found_inf.defined());
  scaler.update();
}

// test_grad_scaling_update_scale: _amp_update_scale_ directly (the backend's kernel).
TEST_P(GradScaling, UpdateScale) {
  Tensor scale = full({1}, 4.0, DType::f32, dev());
  Tensor tracker = from_vector({0.0, 1.0}, {2}, DType::i64, dev());
  Tensor found_inf = zeros({1}, DType::f32, dev());
  const ScaleUpdateHyper h{2.0, 0.25, 2, 1, 0.0f, INFINITY};
  Backend& b = backend_for(dev());
  b.update_scale(scale, tracker, found_inf, h);
  EXPECT_EQ(tracker.to_vector()[0], 1.0);
  EXPECT_EQ(scale.item(), 4.0);
  b.update_scale(scale, tracker, found_inf, h);
  EXPECT_EQ(tracker.to_vector()[0], 0.0);
  EXPECT_EQ(scale.item(), 8.0);
  fill_(found_inf, 1.0);
  b.update_scale(scale, tracker, found_inf, h);
  EXPECT_EQ(tracker.to_vector()[0], 0.0);
  EXPECT_EQ(scale.item(), 2.0);
}

// Factors are doubles: (float)((double)scale * factor). The expected values were computed in Python
// (float64 products rounded to float32 by struct.pack('f')); float factors end at 1078.10986.
TEST_P(GradScaling, FactorsAreDoubles) {
  GradScaler s(GradScalerOptions{.init_scale = 1000.0, .growth_factor = 1.1, .backoff_factor = 0.9, .growth_interval = 1});
  Tensor p = zeros({1}, DType::f32, dev()).set_requires_grad(true);
  optim::SGD opt({p}, optim::SgdOptions{});
  const double want[] = {1100.0, 990.0, 891.0, 980.0999755859375, 1078.1099853515625};
  int k = 0;
  for (bool inf : {false, true, true, false, false}) {
    s.scale(zeros({}, DType::f32, dev()));
    p.set_grad(full({1}, inf ? INFINITY : 1.0, DType::f32, dev()));
    s.step(opt);
    s.update();
    EXPECT_EQ(s.get_scale(), want[k++]);
  }
  EXPECT_EQ(s.state_dict().at("backoff_factor"), 0.9) << "not 0.89999997615814209";
  EXPECT_EQ(s.state_dict().at("growth_factor"), 1.1);
}

// The growth tracker is an integer: a float one would stop counting at 2^24.
TEST_P(GradScaling, GrowthTrackerIsAnInteger) {
  GradScaler s(GradScalerOptions{.growth_interval = (1 << 24) + 10});
  s.load_state_dict({{"scale", 8.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5},
                     {"growth_interval", (1 << 24) + 10}, {"_growth_tracker", (1 << 24) + 8}});
  Tensor p = zeros({1}, DType::f32, dev()).set_requires_grad(true);
  optim::SGD opt({p}, optim::SgdOptions{});
  for (int i = 0; i < 2; ++i) {
    s.scale(zeros({}, DType::f32, dev()));
    p.set_grad(full({1}, 1.0, DType::f32, dev()));
    s.step(opt);
    s.update();
  }
  EXPECT_EQ(s.get_growth_tracker(), 0) << "the tracker reached the interval";
  EXPECT_EQ(s.get_scale(), 16.0);
}

// test_grad_scaling_unscale: the unscale kernel on dense gradient lists with an inf or NaN in either,
// then the "perfect storm" of mixed dtypes through GradScaler::unscale_, which groups them. Our
// tensors are always dense, so PyTorch's transposed and sliced variants are plain [20, 5] copies.
TEST_P(GradScaling, Unscale) {
  const Tensor inv_scale_of = full({1}, 4.0, DType::f32, dev());  // scale 4: inv_scale 0.25
  Tensor g = full({20, 20}, 4.0, DType::f32, dev());
  auto with = [&](double v, const Shape& shape) {
    const Tensor t = full(shape, 4.0, DType::f32, dev());
    std::vector<double> host = t.to_vector();
    host[2 * static_cast<size_t>(shape[1]) + 2] = v;  // element [2, 2]
    return from_vector(host, shape, DType::f32, dev());
  };
  const Shape full_shape{20, 20}, slice{20, 5};
  struct Case {
    std::vector<Tensor> grads;
    bool has_inf;
  };
  const std::vector<Case> cases = {
      {{g.clone(), g.clone()}, false},
      {{g.clone(), with(4.0, slice)}, false},
      {{with(4.0, slice), with(4.0, slice)}, false},
      {{g.clone(), with(INFINITY, full_shape)}, true},
      {{g.clone(), with(NAN, full_shape)}, true},
      {{g.clone(), with(INFINITY, slice)}, true},
      {{g.clone(), with(NAN, slice)}, true},
      {{with(INFINITY, full_shape), with(4.0, slice)}, true},
  };
  for (const Case& c : cases) {
    Tensor found_inf = zeros({1}, DType::f32, dev());
    backend_for(dev()).unscale_and_check(c.grads, inv_scale_of, found_inf);
    EXPECT_EQ(found_inf.item(), c.has_inf ? 1.0 : 0.0);
    if (!c.has_inf) {
      for (const Tensor& t : c.grads) EXPECT_TRUE(test::all_close(t.to(kCPU), ones(t.shape()), 1e-5, 1e-7));
    }
  }
  // An fp16 list unscales in its own kernel call (the scaler groups lists by dtype).
  std::vector<Tensor> halves = {g.to(DType::f16), with(4.0, slice).to(DType::f16)};
  Tensor found_inf = zeros({1}, DType::f32, dev());
  backend_for(dev()).unscale_and_check(halves, inv_scale_of, found_inf);
  for (const Tensor& t : halves) EXPECT_TRUE(test::all_close(t.to(kCPU).to(DType::f32), ones(t.shape()), 1e-5, 1e-7));

  // The perfect storm through the public API: float32 and float64 gradients of several shapes, an
  // inf injected into each in turn (fp16 gradients are refused by unscale_, as in PyTorch).
  auto storm = [&](int inject) {
    std::vector<Tensor> grads = {g.clone(), with(4.0, slice), g.to(DType::f64), with(4.0, slice).to(DType::f64)};
    if (inject >= 0) {
      std::vector<double> host = grads[static_cast<size_t>(inject)].to_vector();
      host[2] = INFINITY;
      grads[static_cast<size_t>(inject)] = from_vector(host, grads[static_cast<size_t>(inject)].shape(),
                                                       grads[static_cast<size_t>(inject)].dtype(), dev());
    }
    return grads;
  };
  std::vector<Tensor> params;
  for (const Tensor& t : storm(-1)) params.push_back(zeros(t.shape(), t.dtype(), dev()).set_requires_grad(true));
  for (int inject = -1; inject < static_cast<int>(params.size()); ++inject) {
    optim::SGD opt(params, optim::SgdOptions{});
    GradScaler scaler(GradScalerOptions{.init_scale = 4.0});
    scaler.scale(zeros({}, DType::f32, dev()));
    const std::vector<Tensor> grads = storm(inject);
    for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(grads[i]);
    scaler.unscale_(opt);
    EXPECT_EQ(scaler.found_inf(opt), inject >= 0) << "inject " << inject;
    if (inject < 0) {
      for (const Tensor& t : grads) EXPECT_TRUE(test::all_close(t.to(kCPU).to(DType::f32), ones(t.shape()), 1e-5, 1e-7));
    }
  }
}

// The perfect storm of test_grad_scaling_unscale as PyTorch runs it: scaler._unscale_grads_(opt,
// inv_scale, found_inf, allow_fp16=True) over float32 and float16 gradients of several shapes, grouped
// by dtype, an inf injected into each in turn. Without allow_fp16 a float16 gradient is refused.
TEST_P(GradScaling, UnscaleGradsOfMixedDtypesWithAllowFp16) {
  const Tensor scale = full({1}, 4.0, DType::f32, dev());
  auto storm = [&](int inject) {
    std::vector<Tensor> grads = {full({20, 20}, 4.0, DType::f32, dev()), full({20, 5}, 4.0, DType::f16, dev()),
                                 full({20, 20}, 4.0, DType::f16, dev()), full({20, 5}, 4.0, DType::f32, dev())};
    if (inject >= 0) {
      Tensor& g = grads[static_cast<size_t>(inject)];
      std::vector<double> host = g.to_vector();
      host[2 * static_cast<size_t>(g.shape()[1]) + 2] = INFINITY;
      g = from_vector(host, g.shape(), g.dtype(), dev());
    }
    return grads;
  };
  std::vector<Tensor> params;
  for (const Tensor& t : storm(-1)) params.push_back(zeros(t.shape(), t.dtype(), dev()).set_requires_grad(true));
  for (int inject = -1; inject < static_cast<int>(params.size()); ++inject) {
    optim::SGD opt(params, optim::SgdOptions{});
    const std::vector<Tensor> grads = storm(inject);
    for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(grads[i]);
    Tensor found_inf = zeros({1}, DType::f32, dev());
    EXPECT_THROW(GradScaler::unscale_grads_(opt, scale, found_inf, /*allow_fp16=*/false), std::invalid_argument);
    GradScaler::unscale_grads_(opt, scale, found_inf, /*allow_fp16=*/true);
    EXPECT_EQ(found_inf.item(), inject >= 0 ? 1.0 : 0.0) << "inject " << inject;
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_EQ(grads[i].dtype(), params[i].dtype()) << "unscaled in its own dtype";
      if (static_cast<int>(i) == inject) continue;
      EXPECT_TRUE(test::all_close(grads[i].to(kCPU).to(DType::f32), ones(grads[i].shape()), 1e-5, 1e-7))
          << "inject " << inject << " grad " << i;
    }
  }
}

// check_inf_ then step: the read-only check records found_inf (a tensor a caller may sum over ranks
// before the step), and the optimizer's pass unscales; the same update as unscale_ then step.
TEST_P(GradScaling, CheckInfThenStepEqualsUnscaleThenStep) {
  auto run = [&](bool check_first, double g1) {
    Tensor p = full({3}, 1.0, DType::f32, dev()).set_requires_grad(true);
    optim::SGD opt({p}, optim::SgdOptions{.lr = 0.5});
    GradScaler scaler(GradScalerOptions{.init_scale = 8.0});
    scaler.scale(zeros({}, DType::f32, dev()));
    p.set_grad(from_vector({8.0, g1, -4.0}, {3}, DType::f32, dev()));
    if (check_first) {
      const Tensor found = scaler.check_inf_(opt);
      EXPECT_TRUE(found.defined());
      EXPECT_EQ(found.data_ptr(), scaler.found_inf_tensor(opt).data_ptr()) << "the tensor step() reads";
      EXPECT_EQ(found.item(), std::isfinite(g1) ? 0.0 : 1.0);
      EXPECT_THROW(scaler.check_inf_(opt), std::runtime_error) << "once an iteration";
    } else {
      scaler.unscale_(opt);
    }
    scaler.step(opt);
    scaler.update();
    return std::make_pair(p.to_vector(), scaler.get_scale());
  };
  for (double g1 : {16.0, double(INFINITY)}) {
    const auto a = run(true, g1), b = run(false, g1);
    EXPECT_EQ(a.first, b.first) << "g1 " << g1;
    EXPECT_EQ(a.second, b.second) << "g1 " << g1;
  }
  EXPECT_EQ(run(true, 16.0).first, (std::vector<double>{0.5, 0.0, 1.25}));
}

// A float64 gradient is unscaled and checked in float64: 1e300 is finite, and 3 * 2^-1074 * 4 keeps
// its last bits (float32 would call the first inf and flush the second to zero).
TEST_P(GradScaling, Float64GradientsStayFloat64) {
  Tensor p = zeros({2}, DType::f64, dev()).set_requires_grad(true);
  optim::SGD opt({p}, optim::SgdOptions{});
  GradScaler scaler(GradScalerOptions{.init_scale = 0.25});
  scaler.scale(zeros({}, DType::f32, dev()));
  const double tiny = 3.0 * std::ldexp(1.0, -1074);
  p.set_grad(from_vector({1e300, tiny}, {2}, DType::f64, dev()));
  scaler.unscale_(opt);
  EXPECT_FALSE(scaler.found_inf(opt));
  const std::vector<double> v = p.grad().to_vector();
  EXPECT_EQ(v[0], 4e300);
  EXPECT_EQ(v[1], 4.0 * tiny);
}

// test_grad_scaling_scale: nested lists keep their structure, and the state lives on the device of
// the first output scaled; a 0-dim float32 scale does not widen a dimensioned fp16 output.
TEST_P(GradScaling, ScaleNestedAndPromotion) {
  GradScaler scaler(GradScalerOptions{.init_scale = 2.0});
  const Tensor t = full({1}, 4.0, DType::f32, dev());
  const std::vector<std::vector<Tensor>> outputs = {{t.clone()}, {t.clone(), t.clone()}, {}};
  const auto scaled = scaler.scale(outputs);
  ASSERT_EQ(scaled.size(), 3u);
  EXPECT_EQ(scaled[0].size(), 1u);
  EXPECT_EQ(scaled[1].size(), 2u);
  EXPECT_TRUE(scaled[2].empty());
  for (const auto& inner : scaled)
    for (const Tensor& s : inner) EXPECT_EQ(s.item(), 8.0);
  EXPECT_EQ(scaler.scale_snapshot(kCPU).device(), dev()) << "state on the first output's device";
  const Tensor half = full({3}, 1.5, DType::f16, dev());
  EXPECT_EQ(scaler.scale(half).dtype(), DType::f16) << "f16[3] * f32[] is f16";
  EXPECT_EQ(scaler.scale(full({}, 1.5, DType::f16, dev())).dtype(), DType::f32) << "f16[] * f32[] is f32";
}

// test_grad_scaling_state_dict, with and without the lazily created state.
TEST_P(GradScaling, StateDict) {
  for (bool lazy_init_scale : {true, false}) {
    GradScaler s0(GradScalerOptions{.init_scale = 3.0, .growth_factor = 4.0, .backoff_factor = 0.5, .growth_interval = 2});
    GradScaler s1(GradScalerOptions{.init_scale = 6.0, .growth_factor = 7.0, .backoff_factor = 0.8, .growth_interval = 1});
    // PyTorch's test sets s1._init_growth_tracker = 7 "for load_state_dict to overwrite": a tracker
    // past the interval (1) that PyTorch's load_state_dict takes, as ours does.
    s1.load_state_dict({{"scale", 6.0}, {"growth_factor", 7.0}, {"backoff_factor", 0.8}, {"growth_interval", 1},
                        {"_growth_tracker", 7}});
    EXPECT_EQ(s1.get_growth_tracker(), 7);
    if (lazy_init_scale) s1.scale(full({1}, 4.0, DType::f32, dev()));
    s1.load_state_dict(s0.state_dict());
    EXPECT_EQ(s1.get_scale(), 3.0);
    EXPECT_EQ(s1.get_growth_factor(), 4.0);
    EXPECT_EQ(s1.get_backoff_factor(), 0.5);
    EXPECT_EQ(s1.get_growth_interval(), 2);
    EXPECT_EQ(s1.get_growth_tracker(), 0);
  }
  GradScaler disabled(GradScalerOptions{.growth_factor = 0.5, .enabled = false});  // not validated when disabled
  EXPECT_TRUE(disabled.state_dict().empty());
}

// update(new_scale) with a 1-element tensor, and PyTorch's refusal of anything else.
TEST_P(GradScaling, UpdateWithATensor) {
  GradScaler s;
  s.scale(zeros({}, DType::f32, dev()));
  s.update(full({1}, 512.0, DType::f32, dev()));
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_THROW(s.update(full({2}, 512.0, DType::f32, dev())), std::invalid_argument);
  EXPECT_THROW(s.update(full({1}, 512.0, DType::f32, dev()).set_requires_grad(true)), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Devices, GradScaling, ::testing::Values(DeviceType::cpu, DeviceType::cuda),
                         [](const auto& param_info) { return param_info.param == DeviceType::cpu ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace amp
