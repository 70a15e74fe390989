// Learning-rate schedulers against PyTorch's own sequences (tests/data/optim_pytorch.safetensors,
// written by tests/scripts/make_optim_fixture.py): every lr of every group, after construction and
// after each step, to the last bit where PyTorch's formula is followed exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "runtime/optim/lr_scheduler.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

using optim::LRScheduler;
using Make = std::function<std::unique_ptr<LRScheduler>(optim::Optimizer&)>;

// An SGD with one single-element parameter per group, lrs as given.
std::unique_ptr<optim::SGD> make_opt(const std::vector<double>& lrs, std::vector<Tensor>* keep) {
  std::vector<optim::ParamGroup<optim::SgdOptions>> groups;
  for (double lr : lrs) {
    keep->push_back(zeros({1}).set_requires_grad(true));
    optim::SgdOptions o;
    o.lr = lr;
    groups.push_back({{keep->back()}, o});
  }
  return std::make_unique<optim::SGD>(groups);
}

void expect_sequence(const std::string& name, const std::vector<double>& lrs, const Make& make) {
  const Tensor want = test::fixture_tensor("optim_pytorch.safetensors", "sched." + name);  // [steps + 1, groups]
  const int64_t rows = want.shape()[0];
  ASSERT_EQ(want.shape()[1], static_cast<int64_t>(lrs.size()));
  const std::vector<double> w = want.to_vector();
  std::vector<Tensor> keep;
  auto opt = make_opt(lrs, &keep);
  auto sched = make(*opt);
  for (int64_t r = 0; r < rows; ++r) {
    if (r > 0) {
      opt->step();
      sched->step();
    }
    for (size_t g = 0; g < lrs.size(); ++g) {
      const double expected = w[static_cast<size_t>(r) * lrs.size() + g];
      EXPECT_EQ(sched->get_last_lr()[g], expected) << name << " epoch " << r << " group " << g;
      EXPECT_EQ(opt->lr(g), expected) << name << " epoch " << r << " group " << g;
    }
  }
}

TEST(LRScheduler, LambdaLR) {
  expect_sequence("lambda", {0.1, 0.01}, [](optim::Optimizer& o) {
    return std::make_unique<optim::LambdaLR>(o, [](int64_t e) { return std::pow(0.95, static_cast<double>(e)); });
  });
}

// A scheduler refused (a start factor above 1) set the groups' initial_lr first: the next scheduler
// took the lr of before set_lr as its base. PyTorch checks before it sets.
TEST(LRScheduler, ARefusedSchedulerLeavesTheOptimizersInitialLr) {
  std::vector<Tensor> keep;
  auto opt = make_opt({1.0}, &keep);
  EXPECT_THROW(optim::LinearLR(*opt, 2.0), std::invalid_argument);
  EXPECT_FALSE(opt->initial_lr(0).has_value());
  opt->set_lr(0.5);
  optim::StepLR s(*opt, 1, 0.5);
  EXPECT_EQ(s.base_lrs()[0], 0.5);
}

TEST(LRScheduler, StepLR) {
  expect_sequence("step", {0.1}, [](optim::Optimizer& o) { return std::make_unique<optim::StepLR>(o, 3, 0.5); });
}

TEST(LRScheduler, LinearLR) {
  expect_sequence("linear", {0.1}, [](optim::Optimizer& o) { return std::make_unique<optim::LinearLR>(o, 0.25, 1.0, 6); });
}

TEST(LRScheduler, CosineAnnealingLRPastTMax) {
  expect_sequence("cosine", {0.1}, [](optim::Optimizer& o) {
    return std::make_unique<optim::CosineAnnealingLR>(o, 10, 0.001);
  });
}

TEST(LRScheduler, SequentialWarmupThenCosine) {
  expect_sequence("warmup_cosine", {0.1, 0.05}, [](optim::Optimizer& o) {
    std::vector<std::unique_ptr<LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(o, 0.2, 1.0, 4));
    parts.push_back(std::make_unique<optim::CosineAnnealingLR>(o, 16, 1e-4));
    return std::make_unique<optim::SequentialLR>(o, std::move(parts), std::vector<int64_t>{4});
  });
}

TEST(LRScheduler, SequentialWarmupCosineThenFloor) {
  expect_sequence("warmup_cosine_floor", {0.1}, [](optim::Optimizer& o) {
    std::vector<std::unique_ptr<LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(o, 0.25, 1.0, 3));
    parts.push_back(std::make_unique<optim::CosineAnnealingLR>(o, 7, 1e-3));
    parts.push_back(std::make_unique<optim::LambdaLR>(o, [](int64_t) { return 1e-3 / 0.1; }));
    return std::make_unique<optim::SequentialLR>(o, std::move(parts), std::vector<int64_t>{3, 10});
  });
}

// A resume as PyTorch's: stopped after `at` steps, the optimizer's and the scheduler's state dicts
// saved (through their JSON text), a new optimizer and scheduler built, both loaded; the rest of the
// sequence is still PyTorch's, bit for bit. Without the scheduler's state the new one starts again
// at epoch 0 from the loaded lrs (the lrs went over the base for a warmup).
void expect_resumed_sequence(const std::string& name, const std::vector<double>& lrs, const Make& make, int64_t at) {
  const Tensor want = test::fixture_tensor("optim_pytorch.safetensors", "sched." + name);
  const int64_t rows = want.shape()[0];
  const std::vector<double> w = want.to_vector();
  std::vector<Tensor> keep;
  auto opt = make_opt(lrs, &keep);
  auto sched = make(*opt);
  for (int64_t r = 1; r <= at; ++r) opt->step(), sched->step();
  const optim::OptimizerStateDict opt_state = opt->state_dict();
  const nlohmann::json sched_state = nlohmann::json::parse(sched->state_dict().dump());
  std::vector<Tensor> keep2;
  auto opt2 = make_opt(lrs, &keep2);
  auto sched2 = make(*opt2);
  opt2->load_state_dict(opt_state);
  sched2->load_state_dict(sched_state);
  EXPECT_EQ(sched2->last_epoch(), at) << name;
  for (int64_t r = at + 1; r < rows; ++r) {
    opt2->step();
    sched2->step();
    for (size_t g = 0; g < lrs.size(); ++g)
      EXPECT_EQ(opt2->lr(g), w[static_cast<size_t>(r) * lrs.size() + g]) << name << " resumed at " << at << ", epoch " << r;
  }
}

TEST(LRScheduler, AStateDictResumesTheSequence) {
  auto seq = [](optim::Optimizer& o) -> std::unique_ptr<LRScheduler> {
    std::vector<std::unique_ptr<LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(o, 0.25, 1.0, 3));
    parts.push_back(std::make_unique<optim::CosineAnnealingLR>(o, 7, 1e-3));
    parts.push_back(std::make_unique<optim::LambdaLR>(o, [](int64_t) { return 1e-3 / 0.1; }));
    return std::make_unique<optim::SequentialLR>(o, std::move(parts), std::vector<int64_t>{3, 10});
  };
  for (int64_t at : {1, 2, 3, 5, 10, 12}) expect_resumed_sequence("warmup_cosine_floor", {0.1}, seq, at);
  for (int64_t at : {1, 4, 11})
    expect_resumed_sequence("cosine", {0.1}, [](optim::Optimizer& o) { return std::make_unique<optim::CosineAnnealingLR>(o, 10, 0.001); }, at);
  expect_resumed_sequence("step", {0.1}, [](optim::Optimizer& o) { return std::make_unique<optim::StepLR>(o, 3, 0.5); }, 4);
  expect_resumed_sequence("linear", {0.1}, [](optim::Optimizer& o) { return std::make_unique<optim::LinearLR>(o, 0.25, 1.0, 6); }, 2);

  // PyTorch's keys, and a state dict that does not fit refused naming the key, with nothing taken.
  std::vector<Tensor> keep;
  auto opt = make_opt({0.1}, &keep);
  auto sched = seq(*opt);
  const nlohmann::json state = sched->state_dict();
  for (const char* key : {"last_epoch", "_step_count", "base_lrs", "_last_lr", "_milestones", "_schedulers"})
    EXPECT_TRUE(state.contains(key)) << key;
  EXPECT_EQ(state["_schedulers"][0]["start_factor"], 0.25);
  EXPECT_EQ(state["_schedulers"][1]["T_max"], 7);
  for (auto [path, value, needle] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"/last_epoch", -2, "'last_epoch' must be an integer >= -1"},
           {"/base_lrs", {0.1, 0.2}, "'base_lrs' must be 1 learning rate(s)"},
           {"/_schedulers/1/T_max", 0, "'T_max' must be an integer >= 1"},
           {"/_schedulers/0/start_factor", 1.5, "'start_factor' must be a number in [0.0, 1.0]"},
           {"/_milestones", {10, 3}, "'_milestones' must be 2 increasing integers"}}) {
    nlohmann::json bad = state;
    bad["last_epoch"] = 7;  // taken only if everything else is
    bad[nlohmann::json::json_pointer(path)] = value;
    try {
      sched->load_state_dict(bad);
      ADD_FAILURE() << path << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(sched->last_epoch(), 0) << path << ": a refused state dict was taken in part";
  }
}

TEST(LRScheduler, RejectsWhatPyTorchRejects) {
  std::vector<Tensor> keep;
  auto opt = make_opt({0.1}, &keep);
  EXPECT_THROW(optim::LinearLR(*opt, 0.0), std::invalid_argument);
  EXPECT_THROW(optim::LinearLR(*opt, 0.5, 1.5), std::invalid_argument);
  EXPECT_THROW(optim::CosineAnnealingLR(*opt, 0), std::invalid_argument);
  EXPECT_THROW(optim::StepLR(*opt, 0), std::invalid_argument);
  std::vector<std::unique_ptr<LRScheduler>> parts;
  parts.push_back(std::make_unique<optim::StepLR>(*opt, 2));
  EXPECT_THROW(optim::SequentialLR(*opt, std::move(parts), {3}), std::invalid_argument);
}

}  // namespace
}  // namespace amp
