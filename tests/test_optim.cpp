// Optimizers: closed-form updates worked out by hand for 2-3 steps, PyTorch's numbers on the MLP,
// and the found_inf skip that leaves everything untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "amp/clip_grad.h"
#include "models/mlp.h"
#include "runtime/ops/autograd.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/lr_scheduler.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

// Runs `steps` steps with the constant gradient g = [0.5, -1.0] on p0 = [1.0, -2.0].
template <class Opt, class Options>
std::vector<double> run_constant_grad(Options o, int steps) {
  Tensor p = from_vector({1.0, -2.0}, {2}).set_requires_grad(true);
  Opt opt({p}, o);
  for (int i = 0; i < steps; ++i) {
    p.set_grad(from_vector({0.5, -1.0}, {2}));
    opt.step();
  }
  return p.to_vector();
}

void expect_near_vec(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << i;
}

TEST(Sgd, ClosedFormMomentumDampeningNesterov) {
  const double g[2] = {0.5, -1.0}, p0[2] = {1.0, -2.0};
  // Plain: p - 2 lr g.
  expect_near_vec(run_constant_grad<optim::SGD>(optim::SgdOptions{0.1, 0, 0, 0, false, false}, 2),
                  {p0[0] - 0.2 * g[0], p0[1] - 0.2 * g[1]});
  // Momentum 0.9: buf1 = g, buf2 = 1.9 g -> p0 - 0.1 g - 0.19 g.
  expect_near_vec(run_constant_grad<optim::SGD>(optim::SgdOptions{0.1, 0.9, 0, 0, false, false}, 2),
                  {p0[0] - 0.29 * g[0], p0[1] - 0.29 * g[1]});
  // Dampening 0.5: buf = g, 1.4 g, 1.76 g -> p0 - 0.416 g.
  expect_near_vec(run_constant_grad<optim::SGD>(optim::SgdOptions{0.1, 0.9, 0.5, 0, false, false}, 3),
                  {p0[0] - 0.416 * g[0], p0[1] - 0.416 * g[1]});
  // Nesterov: d1 = 1.9 g, d2 = g + 0.9 * 1.9 g = 2.71 g -> p0 - 0.461 g.
  expect_near_vec(run_constant_grad<optim::SGD>(optim::SgdOptions{0.1, 0.9, 0, 0, true, false}, 2),
                  {p0[0] - 0.461 * g[0], p0[1] - 0.461 * g[1]});
  // Weight decay 0.1 without momentum: p <- p - lr (g + wd p) = 0.99 p - 0.1 g, twice.
  std::vector<double> want(2);
  for (int i = 0; i < 2; ++i) want[static_cast<size_t>(i)] = 0.99 * (0.99 * p0[i] - 0.1 * g[i]) - 0.1 * g[i];
  expect_near_vec(run_constant_grad<optim::SGD>(optim::SgdOptions{0.1, 0, 0, 0.1, false, false}, 2), want);
}

TEST(Adam, ClosedFormWithConstantGradient) {
  // With a constant gradient the bias-corrected moments are exactly g and g^2, so every step moves
  // by lr * g / (|g| + eps).
  const double g[2] = {0.5, -1.0}, p0[2] = {1.0, -2.0}, lr = 0.01, eps = 1e-8;
  std::vector<double> want(2);
  for (int i = 0; i < 2; ++i) want[static_cast<size_t>(i)] = p0[i] - 3 * lr * g[i] / (std::fabs(g[i]) + eps);
  expect_near_vec(run_constant_grad<optim::Adam>(optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0, false, false}, 3), want);
  expect_near_vec(run_constant_grad<optim::Adam>(optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0, true, false}, 3), want);
  // AdamW: p <- p (1 - lr wd) - lr g / (|g| + eps), three times.
  const double c = 1 - lr * 0.1;
  for (int i = 0; i < 2; ++i) {
    const double u = lr * g[i] / (std::fabs(g[i]) + eps);
    want[static_cast<size_t>(i)] = ((p0[i] * c - u) * c - u) * c - u;
  }
  expect_near_vec(run_constant_grad<optim::AdamW>(optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.1, false, false}, 3), want);
}

// PyTorch creates a parameter's state the first time it has a gradient: a parameter that joins late
// starts from step 0 (its momentum buffer is its first gradient; Adam's bias corrections use t = 1).
TEST(Optimizers, ParametersThatJoinLateStartFromStepZero) {
  const double g = 0.5;
  {
    Tensor a = from_vector({1.0}, {1}).set_requires_grad(true), b = from_vector({1.0}, {1}).set_requires_grad(true);
    optim::SGD opt({a, b}, optim::SgdOptions{0.1, 0.9, 0.5});
    a.set_grad(full({1}, g));
    opt.step();  // only a
    a.set_grad(full({1}, g));
    b.set_grad(full({1}, g));
    opt.step();  // a: buf = 0.9 g + 0.5 g; b: buf = g (its first step)
    EXPECT_NEAR(a.item(), 1.0 - 0.1 * g - 0.1 * 1.4 * g, 1e-7);
    EXPECT_NEAR(b.item(), 1.0 - 0.1 * g, 1e-7);
    EXPECT_EQ(opt.step_count(0), 2);
    EXPECT_EQ(opt.step_count(1), 1);
  }
  {
    Tensor a = from_vector({1.0}, {1}).set_requires_grad(true), b = from_vector({1.0}, {1}).set_requires_grad(true);
    optim::Adam opt({a, b}, optim::AdamOptions{0.01});
    for (int s = 0; s < 3; ++s) {
      a.set_grad(full({1}, g));
      b.set_grad(s == 2 ? full({1}, g) : Tensor());
      opt.step();
    }
    // Bias-corrected, a constant gradient moves a parameter by lr * g / (|g| + eps) per step.
    EXPECT_NEAR(a.item(), 1.0 - 3 * 0.01 * g / (g + 1e-8), 1e-6);
    EXPECT_NEAR(b.item(), 1.0 - 0.01 * g / (g + 1e-8), 1e-6);
    // A skipped step leaves the late joiner's count alone too.
    b.set_grad(full({1}, g));
    opt.step(full({1}, 1.0));
    EXPECT_EQ(opt.step_count(1), 1);
    // The state dict carries each parameter's count, and loading restores them.
    auto sd = opt.state_dict();
    optim::Adam other({from_vector({1.0}, {1}).set_requires_grad(true), from_vector({1.0}, {1}).set_requires_grad(true)},
                      optim::AdamOptions{0.01});
    other.load_state_dict(sd);
    EXPECT_EQ(other.step_count(0), 3);
    EXPECT_EQ(other.step_count(1), 1);
  }
}

// The PyTorch 2.x fixture (the same initial MLP and batch as 1.13's): `steps` times
// zero_grad/forward/MSE/backward/step.
template <class MakeOpt>
void check_against_pytorch(const std::string& prefix, int steps, MakeOpt make) {
  const std::string f = "mlp_pytorch2.safetensors";
  auto mlp = test::fixture_mlp();
  auto opt = make(mlp->parameters());
  const Tensor x = test::fixture_tensor(f, "x"), y = test::fixture_tensor(f, "y");
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    mse_loss((*mlp)(x), y).backward();
    opt->step();
  }
  for (auto& [name, p] : mlp->named_parameters())
    EXPECT_TRUE(test::all_close(p, test::fixture_tensor(f, prefix + name), 1e-6, 1e-7)) << prefix << name;
}

TEST(Optimizers, MatchPyTorchOnTheMlp) {
  using P = std::vector<Tensor>;
  check_against_pytorch("sgd_m0.9_wd0.01.after2.", 2, [](P p) {
    return std::make_unique<optim::SGD>(p, optim::SgdOptions{0.1, 0.9, 0, 0.01, false, false});
  });
  check_against_pytorch("sgd_nesterov.after2.", 2, [](P p) {
    return std::make_unique<optim::SGD>(p, optim::SgdOptions{0.1, 0.9, 0, 0, true, false});
  });
  check_against_pytorch("sgd_damp0.5.after3.", 3, [](P p) {
    return std::make_unique<optim::SGD>(p, optim::SgdOptions{0.1, 0.9, 0.5, 0, false, false});
  });
  check_against_pytorch("adam_wd0.01.after3.", 3, [](P p) {
    return std::make_unique<optim::Adam>(p, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01, false, false});
  });
  check_against_pytorch("adamw_wd0.01.after3.", 3, [](P p) {
    return std::make_unique<optim::AdamW>(p, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01, false, false});
  });
  check_against_pytorch("adamw_amsgrad.after3.", 3, [](P p) {
    return std::make_unique<optim::AdamW>(p, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01, true, false});
  });
}

// Parameter groups: weights and biases of the fixture MLP in two groups with their own
// hyperparameters, against PyTorch (tests/data/optim_pytorch.safetensors).
template <class Opt, class Options>
void check_groups_against_pytorch(const std::string& name, const Options& weights, const Options& biases) {
  auto mlp = test::fixture_mlp();
  std::vector<Tensor> ws, bs;
  for (auto& [n, p] : mlp->named_parameters()) (n.find("weight") != std::string::npos ? ws : bs).push_back(p);
  Opt opt(std::vector<optim::ParamGroup<Options>>{{ws, weights}, {bs, biases}});
  const std::string f = "mlp_pytorch.safetensors";
  const Tensor x = test::fixture_tensor(f, "x"), y = test::fixture_tensor(f, "y");
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    mse_loss((*mlp)(x), y).backward();
    opt.step();
  }
  for (auto& [n, p] : mlp->named_parameters())
    EXPECT_TRUE(test::all_close(p, test::fixture_tensor("optim_pytorch.safetensors", "groups." + name + "." + n), 1e-5, 1e-7))
        << name << " " << n;
}

TEST(Optimizers, ParameterGroupsMatchPyTorch) {
  optim::AdamWOptions w, b;
  w.lr = 0.01;
  w.weight_decay = 0.1;
  b.lr = 0.02;
  b.weight_decay = 0.0;
  check_groups_against_pytorch<optim::AdamW, optim::AdamWOptions>("adamw", w, b);
  optim::SgdOptions sw, sb;
  sw.lr = 0.1;
  sw.momentum = 0.9;
  sb.lr = 0.05;
  sb.maximize = true;
  check_groups_against_pytorch<optim::SGD, optim::SgdOptions>("sgd", sw, sb);
  optim::AdamOptions aw, ab;
  aw.lr = ab.lr = 0.01;
  aw.maximize = ab.maximize = true;
  ab.amsgrad = true;
  check_groups_against_pytorch<optim::Adam, optim::AdamOptions>("adam_maximize", aw, ab);
}

TEST(Optimizers, DefaultsArePyTorch2s) {
  EXPECT_EQ(optim::SgdOptions{}.lr, 1e-3);
  EXPECT_EQ(optim::SgdOptions{}.momentum, 0.0);
  EXPECT_EQ(optim::AdamOptions{}.weight_decay, 0.0);
  EXPECT_EQ(optim::AdamWOptions{}.weight_decay, 1e-2);
  Tensor p = zeros({2}).set_requires_grad(true);
  optim::AdamW opt({p});
  EXPECT_EQ(opt.options().weight_decay, 1e-2);
  // Designated initializers build AdamWOptions: they built an AdamOptions (weight decay 0).
  optim::AdamW designated({p}, {.lr = 5e-3});
  EXPECT_EQ(designated.options().weight_decay, 1e-2);
  EXPECT_EQ(designated.options().lr, 5e-3);
  optim::AdamW from_adam({p}, optim::AdamOptions{.lr = 5e-3});  // that struct's own default, as documented
  EXPECT_EQ(from_adam.options().weight_decay, 0.0);
  // A param group given no options takes AdamW's defaults, as torch.optim.AdamW's param_groups do
  // (it took AdamOptions' weight decay of 0). One step from p = 1 with g = 1 (the loss is p's sum):
  // p <- p (1 - lr wd) - lr g / (|g| + eps).
  Tensor q = ones({2}).set_requires_grad(true), r = ones({2}).set_requires_grad(true);
  optim::AdamW grouped({{{q}, {}}, {{r}, {.lr = 1e-2}}});
  EXPECT_EQ(grouped.options(0).weight_decay, 1e-2);
  EXPECT_EQ(grouped.options(1).weight_decay, 1e-2);
  (sum(q) + sum(r)).backward();
  grouped.step();
  const double want_q = 1.0 * (1.0 - 1e-3 * 1e-2) - 1e-3 / (1.0 + 1e-8);
  const double want_r = 1.0 * (1.0 - 1e-2 * 1e-2) - 1e-2 / (1.0 + 1e-8);
  EXPECT_FLOAT_EQ(q.to_vector()[0], static_cast<float>(want_q));
  EXPECT_FLOAT_EQ(r.to_vector()[1], static_cast<float>(want_r));
}

// A parameter or gradient the fused steps cannot update is refused before any parameter steps: the
// kernel refused it in its loop, after the parameters before it had stepped (and their step count
// had not moved).
TEST(Optimizers, AStepRefusedLeavesEveryParameterAsItWas) {
  Tensor first = ones({2}).set_requires_grad(true), half = zeros({2}, DType::bf16).set_requires_grad(true);
  optim::AdamW mixed({first, half});
  first.set_grad(ones({2}));
  half.set_grad(ones({2}, DType::bf16));
  EXPECT_THROW(mixed.step(), std::invalid_argument);
  EXPECT_EQ(first.to_vector(), std::vector<double>(2, 1.0)) << "a float32 parameter stepped before the bfloat16 one was refused";
  Tensor a = ones({2}).set_requires_grad(true), b = ones({2}).set_requires_grad(true);
  optim::AdamW opt({a, b});
  a.set_grad(ones({2}));
  b.set_grad(ones({2}, DType::bf16));
  EXPECT_THROW(opt.step(), std::invalid_argument);
  EXPECT_EQ(a.to_vector(), std::vector<double>(2, 1.0)) << "a stepped before b's gradient was refused";
  EXPECT_EQ(opt.step_count(0), 0);
  b.set_grad(ones({2}));
  opt.step();
  EXPECT_EQ(opt.step_count(0), 1);
  EXPECT_EQ(a.to_vector(), b.to_vector());
}

// state_dict() is laid out as PyTorch's: "state" by parameter id across groups (only parameters
// that have stepped), "param_groups" with PyTorch's keys and each group's ids; loading restores the
// hyperparameters, the buffers and the step counts, and refuses a mismatched layout.
TEST(Optimizers, StateDictHasPyTorchsLayout) {
  Tensor a = from_vector({1.0, 2.0}, {2}).set_requires_grad(true);
  Tensor b = from_vector({3.0}, {1}).set_requires_grad(true);
  Tensor c = from_vector({4.0}, {1}).set_requires_grad(true);
  optim::AdamOptions o1, o2;
  o1.lr = 0.1;
  o2.lr = 0.2;
  o2.beta1 = 0.8;
  o2.amsgrad = true;
  optim::Adam opt(std::vector<optim::ParamGroup<optim::AdamOptions>>{{{a, b}, o1}, {{c}, o2}});
  a.set_grad(from_vector({0.5, -0.5}, {2}));
  c.set_grad(from_vector({1.0}, {1}));
  opt.step();  // b has no gradient: no state for id 1
  const optim::OptimizerStateDict sd = opt.state_dict();
  ASSERT_EQ(sd.state.size(), 2u);
  EXPECT_EQ(sd.state.count(1), 0u);
  EXPECT_EQ(sd.state.at(0).size(), 3u) << "step, exp_avg, exp_avg_sq";
  EXPECT_EQ(sd.state.at(2).size(), 4u) << "and max_exp_avg_sq with amsgrad";
  EXPECT_EQ(sd.state.at(2).at("step").dim(), 0) << "a 0-dim float32 step, as PyTorch's";
  EXPECT_EQ(sd.state.at(2).at("step").item(), 1.0);
  EXPECT_EQ(sd.param_groups.size(), 2u);
  EXPECT_EQ(sd.param_groups[0]["params"], nlohmann::json::parse("[0, 1]"));
  EXPECT_EQ(sd.param_groups[1]["params"], nlohmann::json::parse("[2]"));
  EXPECT_EQ(sd.param_groups[1]["lr"], 0.2);
  EXPECT_EQ(sd.param_groups[1]["betas"], nlohmann::json::parse("[0.8, 0.999]"));
  EXPECT_EQ(sd.param_groups[1]["amsgrad"], true);
  for (const char* key : {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params"})
    EXPECT_TRUE(sd.param_groups[0].contains(key)) << key;

  // Into a fresh optimizer with other hyperparameters: the saved ones win, and both step alike.
  Tensor a2 = from_vector({1.0, 2.0}, {2}).set_requires_grad(true);
  Tensor b2 = from_vector({3.0}, {1}).set_requires_grad(true);
  Tensor c2 = from_vector({4.0}, {1}).set_requires_grad(true);
  optim::AdamOptions amsgrad_on;
  amsgrad_on.amsgrad = true;
  optim::Adam other(std::vector<optim::ParamGroup<optim::AdamOptions>>{{{a2, b2}, {}}, {{c2}, amsgrad_on}});
  // Parameters are not part of the state dict: copy them as a model's state dict would.
  for (auto [dst, src] : {std::pair{a2, a}, {b2, b}, {c2, c}}) copy_(dst, src.detach());
  other.load_state_dict(sd);
  EXPECT_EQ(other.lr(1), 0.2);
  EXPECT_EQ(other.options(1).beta1, 0.8);
  EXPECT_EQ(other.step_count(2), 1);
  EXPECT_EQ(other.step_count(1), 0);
  for (Tensor* t : {&a, &b, &c, &a2, &b2, &c2}) t->set_grad(full(t->shape(), 0.25));
  opt.step();
  other.step();
  EXPECT_TRUE(test::bitwise_equal(a, a2));
  EXPECT_TRUE(test::bitwise_equal(b, b2));
  EXPECT_TRUE(test::bitwise_equal(c, c2));

  // Mismatched layouts are refused with PyTorch's messages.
  optim::Adam one_group({from_vector({1.0, 2.0}, {2}).set_requires_grad(true)}, optim::AdamOptions{});
  EXPECT_THROW(one_group.load_state_dict(sd), std::invalid_argument);
  optim::OptimizerStateDict broken = sd;
  broken.state.at(0).erase("exp_avg");
  EXPECT_THROW(other.load_state_dict(broken), std::invalid_argument);
  broken = sd;
  broken.param_groups[1]["params"] = nlohmann::json::parse("[2, 3]");
  EXPECT_THROW(other.load_state_dict(broken), std::invalid_argument);
  // Another optimizer's state dict: the key it lacks and the keys it has (it said "[json.exception
  // .out_of_range.403] key 'momentum' not found").
  optim::SGD sgd(std::vector<optim::ParamGroup<optim::SgdOptions>>{{{a2, b2}, {}}, {{c2}, {}}});
  try {
    sgd.load_state_dict(sd);
    ADD_FAILURE() << "Adam's state dict loaded into SGD";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("SGD state_dict, parameter group 0: no 'momentum' (its keys: 'amsgrad', "
                                         "'betas', 'eps', 'lr', 'maximize', 'weight_decay'): another optimizer's"),
              std::string::npos)
        << e.what();
  }
}

// A state dict refused leaves the optimizer as it was: group 0's lr was taken before group 1's was
// refused. A non-numeric initial_lr and a negative step count are refused too (the first escaped as
// a JSON type_error, the second gave NaN parameters at the next step).
TEST(Optimizers, ARefusedStateDictChangesNothing) {
  Tensor a = from_vector({1.0}, {1}).set_requires_grad(true), b = from_vector({2.0}, {1}).set_requires_grad(true);
  optim::SgdOptions ga, gb;
  ga.lr = 0.1;
  gb.lr = 0.2;
  optim::SGD sgd(std::vector<optim::ParamGroup<optim::SgdOptions>>{{{a}, ga}, {{b}, gb}});
  optim::OptimizerStateDict sd = sgd.state_dict();
  sd.param_groups[0]["lr"] = 5.0;
  sd.param_groups[1]["lr"] = -1.0;
  EXPECT_THROW(sgd.load_state_dict(sd), std::invalid_argument);
  EXPECT_EQ(sgd.lr(0), 0.1);
  EXPECT_EQ(sgd.lr(1), 0.2);
  sd = sgd.state_dict();
  sd.param_groups[1]["initial_lr"] = "0.1";
  EXPECT_THROW(sgd.load_state_dict(sd), std::invalid_argument);

  optim::Adam adam({a}, optim::AdamOptions{.lr = 0.1});
  a.set_grad(full({1}, 0.5));
  adam.step();
  const std::vector<double> after = a.to_vector();
  sd = adam.state_dict();
  sd.state.at(0)["step"] = scalar_tensor(-3.0);
  EXPECT_THROW(adam.load_state_dict(sd), std::invalid_argument);
  adam.step();
  EXPECT_TRUE(std::isfinite(a.to_vector()[0]) && a.to_vector()[0] != after[0]);
}

// docs/API.md's example, as written there (groups, warmup then cosine), runs and moves the lr.
TEST(Optimizers, ReadmeExampleBuildsAndSteps) {
  Tensor w = from_vector({1.0, 2.0, 3.0, 4.0}, {2, 2}).set_requires_grad(true);
  Tensor b = from_vector({0.5, -0.5}, {2}).set_requires_grad(true);
  const std::vector<Tensor> matrices = {w}, biases = {b};
  amp::optim::AdamWOptions decay, no_decay;
  decay.lr = no_decay.lr = 6e-4;
  decay.weight_decay = 0.1;
  no_decay.weight_decay = 0.0;
  amp::optim::AdamW opt({{matrices, decay}, {biases, no_decay}});
  std::vector<std::unique_ptr<amp::optim::LRScheduler>> parts;
  parts.push_back(std::make_unique<amp::optim::LinearLR>(opt, 0.01, 1.0, 100));
  parts.push_back(std::make_unique<amp::optim::CosineAnnealingLR>(opt, 900, 6e-5));
  amp::optim::SequentialLR sched(opt, std::move(parts), {100});
  EXPECT_DOUBLE_EQ(opt.lr(0), 6e-6);
  for (int i = 0; i < 100; ++i) {
    w.set_grad(ones({2, 2}));
    b.set_grad(ones({2}));
    opt.step();
    sched.step();
  }
  EXPECT_EQ(opt.lr(0), 6e-4) << "the cosine starts from the base lr at the milestone";
  EXPECT_EQ(opt.lr(1), 6e-4);
  EXPECT_EQ(opt.options(0).weight_decay, 0.1);
  EXPECT_EQ(opt.options(1).weight_decay, 0.0);
}

TEST(Optimizers, GroupsRejectDuplicatesAndEmptyGroups) {
  Tensor p = zeros({2}).set_requires_grad(true), q = zeros({2}).set_requires_grad(true);
  using G = std::vector<optim::ParamGroup<optim::SgdOptions>>;
  EXPECT_THROW(optim::SGD(G{{{p}, {}}, {{p}, {}}}), std::invalid_argument);
  EXPECT_THROW(optim::SGD(G{{{p}, {}}, {{}, {}}}), std::invalid_argument);
  optim::SGD ok(G{{{p}, {}}, {{q}, {}}});
  EXPECT_EQ(ok.num_param_groups(), 2u);
}

// Optimizer::keep_low_precision_copies: after every step each copy is cast(parameter) to the bit,
// also when a parameter sits a step out (its own cohort then), for SGD and Adam, fp16 and bf16; a
// skipped step writes none.
TEST(Optimizers, LowPrecisionCopiesAreTheCastParametersAfterEveryStep) {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (int kind = 0; kind < 3; ++kind) {
      Generator gen(7);
      std::vector<Tensor> params = {randn({3000}, gen).set_requires_grad(true), randn({7, 5}, gen).set_requires_grad(true),
                                    randn({1}, gen).set_requires_grad(true)};
      std::unique_ptr<optim::Optimizer> opt;
      if (kind == 0) opt = std::make_unique<optim::SGD>(params, optim::SgdOptions{0.1, 0.9, 0.0, 1e-2, true, false});
      if (kind == 1) opt = std::make_unique<optim::SGD>(params, optim::SgdOptions{0.3, 0.0, 0.0, 0.0, false, false});
      if (kind == 2) {
        optim::AdamOptions o;
        o.lr = 0.05;
        o.amsgrad = true;
        opt = std::make_unique<optim::AdamW>(params, o);
      }
      const std::string what = std::string(dtype_name(dt)) + " optimizer " + std::to_string(kind);
      opt->keep_low_precision_copies(dt);
      ASSERT_EQ(opt->low_precision_copies().size(), params.size());
      auto expect_cast = [&](const std::string& when) {
        for (size_t i = 0; i < params.size(); ++i)
          EXPECT_TRUE(test::bitwise_equal(opt->low_precision_copies()[i], cast(params[i].detach(), dt)))
              << what << ", " << when << ", parameter " << i;
      };
      expect_cast("at the start");
      for (int step = 0; step < 4; ++step) {
        for (size_t i = 0; i < params.size(); ++i)
          params[i].set_grad(step == 1 && i == 1 ? Tensor() : randn(params[i].shape(), gen));
        opt->step();
        expect_cast("after step " + std::to_string(step));
      }
      // A skipped step writes nothing: a copy set to zeros stays zeros.
      Tensor c0 = opt->low_precision_copies()[0];
      fill_(c0, 0.0);
      for (Tensor& p : params) p.set_grad(randn(p.shape(), gen));
      opt->step(from_vector({1.0}, {1}));
      EXPECT_EQ(sum(c0.to(DType::f32)).item(), 0.0) << what;
      opt->step();
      expect_cast("after a skipped step and a taken one");
    }
  }
  // Values at the rounding's edges, in a parameter long enough for the vectorised (streaming) store:
  // a zero step leaves them as they are, and each copy must be cast()'s rounding of them.
  {
    std::vector<uint32_t> bits = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                  0x3f808000u, 0x3f818000u, 0x3f808001u, 0x00000001u, 0x80000000u, 0x0000ffffu,
                                  0x7fc0ffffu, 0xffffffffu};
    std::vector<float> values(4096);
    Generator g0(9);
    const std::vector<double> noise = randn({4096}, g0).to_vector();
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t b = i < bits.size() ? bits[i] : 0u;
      float f;
      if (i < bits.size()) std::memcpy(&f, &b, sizeof f);
      else f = static_cast<float>(noise[i]);
      values[i] = f;
    }
    Tensor edge = empty({4096});
    std::memcpy(edge.data_ptr(), values.data(), values.size() * sizeof(float));
    edge.set_requires_grad(true);
    optim::SGD zero_step({edge}, optim::SgdOptions{0.0, 0.0, 0.0, 0.0, false, false});
    zero_step.keep_low_precision_copies(DType::bf16);
    edge.set_grad(zeros({4096}));
    zero_step.step();
    EXPECT_TRUE(test::bitwise_equal(zero_step.low_precision_copies()[0], cast(edge.detach(), DType::bf16)));
  }
  Tensor p = zeros({2}).set_requires_grad(true);
  optim::SGD sgd({p}, optim::SgdOptions{0.1, 0.0, 0.0, 0.0, false, false});
  EXPECT_THROW(sgd.keep_low_precision_copies(DType::f64), std::invalid_argument);
  sgd.keep_low_precision_copies(DType::bf16);
  sgd.keep_low_precision_copies(DType::f32);
  EXPECT_TRUE(sgd.low_precision_copies().empty()) << "float32: no copies";
}

TEST(Optimizers, FoundInfLeavesEverythingUntouched) {
  Tensor p = from_vector({1.0, -2.0}, {2}).set_requires_grad(true);
  optim::AdamW opt({p}, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01, true, false});
  p.set_grad(from_vector({0.5, -1.0}, {2}));
  opt.step();
  std::map<std::string, std::vector<double>> saved;
  const optim::OptimizerStateDict before = opt.state_dict();
  for (auto& [k, t] : before.state.at(0)) saved[k] = t.to_vector();
  const auto p_before = p.to_vector();
  opt.step(full({1}, 1.0));  // found_inf set: skip
  EXPECT_EQ(p.to_vector(), p_before);
  const optim::OptimizerStateDict after = opt.state_dict();
  for (auto& [k, t] : after.state.at(0)) EXPECT_EQ(t.to_vector(), saved[k]) << k;
  EXPECT_EQ(saved.size(), 4u) << "step, exp_avg, exp_avg_sq, max_exp_avg_sq";
  EXPECT_EQ(opt.step_count(), 1);
  opt.step(full({1}, 0.0));  // found_inf clear: step
  EXPECT_NE(p.to_vector(), p_before);
  EXPECT_EQ(opt.step_count(), 2);
}

// Clipping by the norm folded into the step (Optimizer::step's clip): parameters, state and the
// gradients written back bit for bit what clip_grads_with_norm_ then the step give, for AdamW and SGD
// with momentum, over three steps, a norm that clips and one that does not.
TEST(Optimizers, ClippingInTheStepIsClipThenStep) {
  for (bool adam : {true, false})
    for (double max_norm : {0.1, 1e3}) {
      Generator gen(31);
      std::vector<Tensor> a = {randn({5, 7}, gen), randn({7}, gen)}, b;
      for (Tensor& t : a) {
        t.set_requires_grad(true);
        b.push_back(t.detach().clone().set_requires_grad(true));
      }
      auto make = [&](const std::vector<Tensor>& ps) -> std::unique_ptr<optim::Optimizer> {
        if (adam) return std::make_unique<optim::AdamW>(ps, optim::AdamOptions{0.01, 0.9, 0.999, 1e-8, 0.01, false, false});
        return std::make_unique<optim::SGD>(ps, optim::SgdOptions{0.05, 0.9, 0.0, 1e-4, true, false});
      };
      auto apart = make(a), fused = make(b);
      for (int step = 0; step < 3; ++step) {
        std::vector<Tensor> grads;
        for (const Tensor& t : a) grads.push_back(randn(t.shape(), gen));
        for (size_t i = 0; i < a.size(); ++i) {
          a[i].set_grad(grads[i].clone());
          b[i].set_grad(grads[i].clone());
        }
        const Tensor norm = get_total_norm(grads, 2.0, false).to(DType::f32);
        clip_grads_with_norm_(a, max_norm, norm);
        apart->step();
        fused->step(Tensor(), Tensor(), NormClip{norm, max_norm});
        const std::string what = std::string(adam ? "adamw" : "sgd") + " max_norm " + std::to_string(max_norm);
        for (size_t i = 0; i < a.size(); ++i) {
          EXPECT_EQ(b[i].to_vector(), a[i].to_vector()) << what << " step " << step << " parameter " << i;
          EXPECT_EQ(b[i].grad().to_vector(), a[i].grad().to_vector()) << what << " step " << step << " gradient " << i;
        }
        const optim::OptimizerStateDict sa = apart->state_dict(), sb = fused->state_dict();
        for (auto& [index, state] : sa.state)
          for (auto& [key, t] : state) EXPECT_EQ(sb.state.at(index).at(key).to_vector(), t.to_vector()) << what << " " << key;
      }
    }
}

TEST(Optimizers, RejectBadOptions) {
  Tensor p = zeros({2}).set_requires_grad(true);
  EXPECT_THROW(optim::SGD({p}, optim::SgdOptions{-1.0}), std::invalid_argument);
  EXPECT_THROW(optim::SGD({p}, optim::SgdOptions{0.1, 0.0, 0.0, 0.0, true, false}), std::invalid_argument);
  EXPECT_THROW(optim::Adam({p}, optim::AdamOptions{0.1, 1.0}), std::invalid_argument);
  EXPECT_THROW(optim::SGD({}, optim::SgdOptions{}), std::invalid_argument);
}

}  // namespace
}  // namespace amp
