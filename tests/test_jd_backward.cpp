// mtl_backward and jac_to_grad against float64 finite differences, and against ordinary backward
// where Jacobian descent reduces to it (Mean of the rows is the gradient of the mean loss).
#include <gtest/gtest.h>

#include <cmath>

#include "jd/jac.h"
#include "jd/mtl_backward.h"
#include "jd/packed_jacobians.h"
#include "jd/aggregator.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

// TorchJD's example network in float64: shared Linear(10,5) ReLU Linear(5,3) ReLU; two Linear(3,1) heads.
struct Net {
  std::vector<Tensor> shared, head1, head2;
  Tensor x, y1, y2;
  explicit Net(uint64_t seed) {
    Generator g(seed);
    auto p = [&](const Shape& s) { return mul(randn(s, g, DType::f64), 0.5).detach().set_requires_grad(true); };
    shared = {p({5, 10}), p({5}), p({3, 5}), p({3})};
    head1 = {p({1, 3}), p({1})};
    head2 = {p({1, 3}), p({1})};
    x = randn({4, 10}, g, DType::f64);
    y1 = randn({4, 1}, g, DType::f64);
    y2 = randn({4, 1}, g, DType::f64);
  }
  Tensor features() const { return relu(linear(relu(linear(x, shared[0], shared[1])), shared[2], shared[3])); }
  std::vector<Tensor> losses(const Tensor& f) const {
    return {mse_loss(linear(f, head1[0], head1[1]), y1), mse_loss(linear(f, head2[0], head2[1]), y2)};
  }
  std::vector<double> loss_values() {
    NoGradGuard ng;
    const auto l = losses(features());
    return {l[0].item(), l[1].item()};
  }
};

// d loss_k / d p[e] by central differences.
double finite_difference(Net& net, Tensor p, int64_t e, int k) {
  const double eps = 1e-6;
  double* d = p.data<double>();
  const double orig = d[e];
  d[e] = orig + eps;
  const double plus = net.loss_values()[static_cast<size_t>(k)];
  d[e] = orig - eps;
  const double minus = net.loss_values()[static_cast<size_t>(k)];
  d[e] = orig;
  return (plus - minus) / (2 * eps);
}

TEST(MtlBackward, JacobianAndHeadGradientsMatchFiniteDifferences) {
  Net net(3);
  const Tensor f = net.features();
  jd::mtl_backward(net.losses(f), f);
  for (size_t j = 0; j < net.shared.size(); ++j) {
    const Tensor& p = net.shared[j];
    ASSERT_TRUE(jd::jac(p).defined()) << "shared " << j;
    ASSERT_EQ(jd::jac(p).shape()[0], 2);
    EXPECT_FALSE(p.grad().defined()) << "mtl_backward leaves the shared .grad alone";
    const std::vector<double> jac = jd::jac(p).to_vector();
    for (int k = 0; k < 2; ++k)
      for (int64_t e = 0; e < p.numel(); ++e)
        EXPECT_NEAR(jac[static_cast<size_t>(k * p.numel() + e)], finite_difference(net, p, e, k), 1e-7)
            << "shared " << j << " row " << k << " element " << e;
  }
  for (int k = 0; k < 2; ++k) {
    const auto& head = k == 0 ? net.head1 : net.head2;
    for (const Tensor& p : head) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_FALSE(jd::jac(p).defined());
      const std::vector<double> g = p.grad().to_vector();
      for (int64_t e = 0; e < p.numel(); ++e) EXPECT_NEAR(g[static_cast<size_t>(e)], finite_difference(net, p, e, k), 1e-7);
    }
  }
}

TEST(MtlBackward, ParameterSetsFromTheGraph) {
  Net net(4);
  const Tensor f = net.features();
  const auto l = net.losses(f);
  const std::vector<Tensor> shared = jd::leaves_behind(f);
  ASSERT_EQ(shared.size(), 4u);
  const std::vector<Tensor> task = jd::leaves_behind(l[1], f);
  ASSERT_EQ(task.size(), 2u);
  for (const Tensor& t : task) EXPECT_TRUE(t.same(net.head2[0]) || t.same(net.head2[1]));
  jd::MtlBackwardOptions o;
  o.tasks_params = {{net.head1[0], net.shared[0]}, {net.head2[0]}};
  EXPECT_THROW(jd::mtl_backward(l, f, o), std::invalid_argument) << "overlapping parameter sets";
  EXPECT_THROW(jd::mtl_backward({}, f), std::invalid_argument);
}

// Jacobians accumulate over calls (micro-batches), and jac_to_grad with Mean gives the gradient of
// the mean loss; the heads keep the gradients of their own losses.
TEST(JacToGrad, MeanIsTheGradientOfTheMeanLoss) {
  Net a(5), b(5);
  for (int micro = 0; micro < 2; ++micro) {
    const Tensor f = a.features();
    jd::mtl_backward(a.losses(f), f);
    const auto l = b.losses(b.features());
    mul(add(l[0], l[1]), 0.5).backward();
  }
  jd::Mean mean;
  const std::vector<double> w = jd::jac_to_grad(a.shared, mean);
  EXPECT_EQ(w, (std::vector<double>{0.5, 0.5}));
  for (size_t j = 0; j < a.shared.size(); ++j) {
    EXPECT_FALSE(jd::jac(a.shared[j]).defined()) << ".jac is cleared";
    EXPECT_TRUE(test::all_close(a.shared[j].grad(), b.shared[j].grad(), 1e-12, 1e-14)) << "shared " << j;
  }
  // Heads: undivided gradients of their own loss, summed over the two micro-batches.
  EXPECT_TRUE(test::all_close(a.head1[0].grad(), mul(b.head1[0].grad(), 2.0), 1e-12, 1e-14));
}

// The trainer's layout (jd/packed_jacobians.h): each micro-batch's J and heads' gradients packed,
// the packs summed, then unpacked and aggregated, give what accumulating the micro-batches' .jac and
// .grad then jac_to_grad gives (within the pack's float32); a pack clears what it took.
TEST(PackedJacobians, ASumOfPacksIsTheAccumulatedBackward) {
  Net a(7), b(7);
  jd::Packed sum;
  for (int micro = 0; micro < 2; ++micro) {
    const Tensor f = a.features();
    jd::mtl_backward(a.losses(f), f);
    jd::Packed one = jd::pack(a.shared, {a.head1, a.head2});
    EXPECT_EQ(one.rows, 2);
    for (const Tensor& p : a.shared) EXPECT_FALSE(jd::jac(p).defined()) << "the pack takes the .jac";
    EXPECT_FALSE(a.head1[0].grad().defined()) << "the pack takes the heads' .grad";
    if (micro == 0) sum = one;
    else add_(sum.flat, one.flat);
    const Tensor g = b.features();
    jd::mtl_backward(b.losses(g), g);
  }
  jd::UPGrad upgrad_a, upgrad_b;
  const std::vector<double> wa = jd::unpack_and_aggregate(sum, a.shared, {a.head1, a.head2}, upgrad_a);
  const std::vector<double> wb = jd::jac_to_grad(b.shared, upgrad_b);
  ASSERT_EQ(wa.size(), wb.size());
  for (size_t i = 0; i < wa.size(); ++i) EXPECT_NEAR(wa[i], wb[i], 1e-5 * std::fabs(wb[i]) + 1e-7);
  for (size_t j = 0; j < a.shared.size(); ++j)
    EXPECT_TRUE(test::all_close(a.shared[j].grad().to(DType::f64), b.shared[j].grad(), 1e-5, 1e-6)) << "shared " << j;
  for (size_t j = 0; j < a.head1.size(); ++j) {
    EXPECT_TRUE(test::all_close(a.head1[j].grad().to(DType::f64), b.head1[j].grad(), 1e-5, 1e-6)) << "head1 " << j;
    EXPECT_TRUE(test::all_close(a.head2[j].grad().to(DType::f64), b.head2[j].grad(), 1e-5, 1e-6)) << "head2 " << j;
  }
}

// The hooks a data-parallel caller overlaps its reduction with: the heads' gradients are final
// before the trunk's passes, and row k of every .jac is final when row k is announced, while the
// later rows are still to be computed.
TEST(MtlBackward, RowsAreAnnouncedAsSoonAsTheyAreFinal) {
  Net net(8);
  Tensor f = net.features();
  std::vector<std::vector<double>> rows_at_hook;
  int heads_ready = 0;
  jd::MtlBackwardOptions o;
  o.on_task_grads_ready = [&] {
    ++heads_ready;
    EXPECT_TRUE(net.head1[0].grad().defined());
    EXPECT_TRUE(net.head2[1].grad().defined());
  };
  o.on_jacobian_row_ready = [&](int64_t k) {
    EXPECT_EQ(k, static_cast<int64_t>(rows_at_hook.size()));
    const std::vector<double> j = jd::jac(net.shared[0]).to_vector();
    const int64_t n = net.shared[0].numel();
    rows_at_hook.emplace_back(j.begin() + k * n, j.begin() + (k + 1) * n);
    if (k == 0) {  // row 1 is not computed yet
      for (int64_t e = 0; e < n; ++e) EXPECT_EQ(j[static_cast<size_t>(n + e)], 0.0);
    }
  };
  jd::mtl_backward(net.losses(f), f, o);
  EXPECT_EQ(heads_ready, 1);
  ASSERT_EQ(rows_at_hook.size(), 2u);
  const std::vector<double> final_jac = jd::jac(net.shared[0]).to_vector();
  const size_t n = static_cast<size_t>(net.shared[0].numel());
  for (size_t k = 0; k < 2; ++k)
    EXPECT_EQ(rows_at_hook[k], std::vector<double>(final_jac.begin() + static_cast<long>(k * n), final_jac.begin() + static_cast<long>((k + 1) * n)));
}

TEST(JacToGrad, ConcatenatesEveryParameterIntoOneMatrix) {
  Net net(6);
  const Tensor f = net.features();
  jd::mtl_backward(net.losses(f), f);
  const Tensor J = jd::concatenated_jacobian(net.shared);
  EXPECT_EQ(J.shape(), (Shape{2, 5 * 10 + 5 + 3 * 5 + 3}));
  // Row 1, the first element of the last parameter: 2.bias[0]'s derivative of loss 2.
  EXPECT_EQ(J.to_vector()[static_cast<size_t>(73 + 70)], jd::jac(net.shared[3]).to_vector()[3]);
}

// A .jac or a Jacobian of another width than the parameters is refused naming both shapes: a [2, 3]
// .jac on a parameter of 2 values was read as its first four entries ([[1, 2], [3, 4]]), silently.
TEST(JacToGrad, AJacobianOfAnotherWidthIsRefused) {
  Tensor p = zeros({2}, DType::f64);
  p.set_requires_grad(true);
  jd::Mean mean;
  jd::set_jac(p, from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::f64));
  try {
    jd::jac_to_grad({p}, mean);
    ADD_FAILURE() << "a [2, 3] .jac on a [2] parameter was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("has a .jac of shape [2, 3], expected [rows, 2]"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(p.grad().defined());
  for (const Shape& shape : {Shape{2, 3}, Shape{2, 1}, Shape{6}}) {
    try {
      jd::aggregate_into_grads({p}, zeros(shape, DType::f64), mean);
      ADD_FAILURE() << "a Jacobian " << shape_str(shape) << " for 2 values was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("expected [rows, 2]"), std::string::npos) << e.what();
    }
  }
  // The right width still works: the columns' means.
  jd::set_jac(p, from_vector({1, 2, 3, 4}, {2, 2}, DType::f64));
  jd::jac_to_grad({p}, mean);
  EXPECT_EQ(p.grad().to_vector(), (std::vector<double>{2, 3}));
}

}  // namespace
}  // namespace amp
