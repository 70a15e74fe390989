// The MLP against PyTorch: forward, loss, gradients, and the double-backward gradient penalty;
// and a short training run whose loss must fall.
#include <gtest/gtest.h>

#include <cmath>

#include "models/mlp.h"
#include "runtime/ops/autograd.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

const std::string kFile = "mlp_pytorch.safetensors";

using test::fixture_mlp;

TEST(Mlp, NamesFollowTorchSequential) {
  Generator gen(0);
  auto mlp = models::make_mlp({8, 32, 4, 3}, gen);
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (auto& [n, p] : mlp->named_parameters()) { names.push_back(n); shapes.push_back(p.shape()); }
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}));
  EXPECT_EQ(shapes[0], (Shape{32, 8}));
  EXPECT_EQ(shapes[5], (Shape{4}));
  // PyTorch's init bound 1/sqrt(in_features).
  for (double v : mlp->named_parameters()[0].second.to_vector()) EXPECT_LE(std::fabs(v), 1.0 / std::sqrt(8.0));
}

TEST(Mlp, ForwardLossAndGradientsMatchPyTorch) {
  auto mlp = fixture_mlp();
  const Tensor x = test::fixture_tensor(kFile, "x"), y = test::fixture_tensor(kFile, "y");
  const Tensor out = (*mlp)(x);
  EXPECT_TRUE(test::all_close(out, test::fixture_tensor(kFile, "out"), 1e-5, 1e-6));
  const Tensor loss = mse_loss(out, y);
  EXPECT_TRUE(test::all_close(loss.reshape({1}), test::fixture_tensor(kFile, "loss"), 1e-5, 1e-7));
  loss.backward();
  for (auto& [name, p] : mlp->named_parameters())
    EXPECT_TRUE(test::all_close(p.grad(), test::fixture_tensor(kFile, "grad." + name), 1e-5, 1e-7)) << name;
}

TEST(Mlp, GradientPenaltyMatchesPyTorch) {
  // loss + 0.1 * ||grad loss||_2 over all parameters, differentiated through the gradient.
  auto mlp = fixture_mlp();
  const Tensor x = test::fixture_tensor(kFile, "x"), y = test::fixture_tensor(kFile, "y");
  const Tensor loss = mse_loss((*mlp)(x), y);
  const auto grads = grad({loss}, mlp->parameters(), {}, true, true);
  Tensor sq = scalar_tensor(0.0);
  for (const Tensor& g : grads) sq = add(sq, sum(pow(g, 2.0)));
  const Tensor total = add(loss, mul(sqrt(sq), 0.1));
  EXPECT_TRUE(test::all_close(total.reshape({1}), test::fixture_tensor(kFile, "penalty.loss"), 1e-5, 1e-7));
  total.backward();
  for (auto& [name, p] : mlp->named_parameters())
    EXPECT_TRUE(test::all_close(p.grad(), test::fixture_tensor(kFile, "penalty.grad." + name), 1e-4, 1e-6)) << name;
}

TEST(Mlp, TrainingOnATeacherTaskReducesTheLoss) {
  Generator gen(1);
  auto teacher = models::make_mlp({32, 64, 8, 2}, gen);
  auto student = models::make_mlp({32, 64, 8, 3}, gen);
  optim::SGD opt(student->parameters(), optim::SgdOptions{0.05, 0.9});
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    const Tensor x = randn({64, 32}, gen);
    Tensor y;
    {
      NoGradGuard ng;
      y = (*teacher)(x);
    }
    opt.zero_grad();
    const Tensor loss = mse_loss((*student)(x), y);
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item();
    last = loss.item();
  }
  EXPECT_LT(last, 0.3 * first) << "first " << first << " last " << last;
}

}  // namespace
}  // namespace amp
