// Every op's gradient against central finite differences in fp64, and second derivatives for the
// ops that support double backward.
#include <gtest/gtest.h>

#include "amp/autocast.h"
#include "runtime/core/device_memory.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

using test::gradcheck;
using V = std::vector<Tensor>;

Tensor rnd(const Shape& s, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator g(seed);
  return rand_uniform(s, lo, hi, g, DType::f64);
}
// Values bounded away from zero, so relu's kink is never straddled by the finite difference.
Tensor away_from_zero(const Shape& s, uint64_t seed) {
  Tensor t = rnd(s, seed, 0.1, 1.0);
  Tensor signs = rnd(s, seed + 1);
  for (int64_t i = 0; i < t.numel(); ++i)
    if (signs.data<double>()[i] < 0) t.data<double>()[i] = -t.data<double>()[i];
  return t;
}

TEST(Gradcheck, Linear) {
  EXPECT_TRUE(gradcheck([](const V& v) { return linear(v[0], v[1], v[2]); },
                        {rnd({4, 5}, 1), rnd({3, 5}, 2), rnd({3}, 3)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return linear(v[0], v[1], Tensor()); }, {rnd({4, 5}, 1), rnd({3, 5}, 2)}));
}

TEST(Gradcheck, MatmulAndTransposedMm) {
  EXPECT_TRUE(gradcheck([](const V& v) { return matmul(v[0], v[1]); }, {rnd({3, 4}, 1), rnd({4, 2}, 2)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return dot(v[0], v[1]); }, {rnd({5}, 1), rnd({5}, 2)}, true));
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = ta ? rnd({4, 3}, 5) : rnd({3, 4}, 5);
      const Tensor b = tb ? rnd({2, 4}, 6) : rnd({4, 2}, 6);
      EXPECT_TRUE(gradcheck([ta, tb](const V& v) { return mm(v[0], v[1], ta, tb); }, {a, b}, true))
          << "ta=" << ta << " tb=" << tb;
    }
}

TEST(Gradcheck, AddSubMulDivWithBroadcasts) {
  // Same shape, a bias-like row, a column and a scalar tensor.
  const std::vector<Shape> others = {{3, 4}, {4}, {3, 1}, {}};
  for (const Shape& s : others) {
    const Tensor a = rnd({3, 4}, 11), b = rnd(s, 12, 0.5, 1.5);
    EXPECT_TRUE(gradcheck([](const V& v) { return add(v[0], v[1]); }, {a, b}, true)) << shape_str(s);
    EXPECT_TRUE(gradcheck([](const V& v) { return sub(v[1], v[0]); }, {a, b}, true)) << shape_str(s);
    EXPECT_TRUE(gradcheck([](const V& v) { return mul(v[0], v[1]); }, {a, b}, true)) << shape_str(s);
    EXPECT_TRUE(gradcheck([](const V& v) { return div(v[0], v[1]); }, {a, b}, true)) << shape_str(s);
  }
}

TEST(Gradcheck, ScalarOperands) {
  EXPECT_TRUE(gradcheck([](const V& v) { return add(mul(v[0], 2.5), 3.0); }, {rnd({3, 4}, 1)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return sub(div(v[0], 4.0), 1.0); }, {rnd({3, 4}, 1)}, true));
}

TEST(Gradcheck, UnaryOps) {
  EXPECT_TRUE(gradcheck([](const V& v) { return neg(v[0]); }, {rnd({3, 4}, 1)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return exp(v[0]); }, {rnd({3, 4}, 2)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return log(v[0]); }, {rnd({3, 4}, 3, 0.5, 2.0)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return sqrt(v[0]); }, {rnd({3, 4}, 4, 0.5, 2.0)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return pow(v[0], 3.0); }, {rnd({3, 4}, 5)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return pow(v[0], 2.0); }, {rnd({3, 4}, 6)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return pow(v[0], 0.5); }, {rnd({3, 4}, 7, 0.5, 2.0)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return relu(v[0]); }, {away_from_zero({3, 4}, 8)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return gelu(v[0]); }, {rnd({3, 4}, 9, -3, 3)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return gelu(v[0], true); }, {rnd({3, 4}, 10, -3, 3)}));
}

// The MLP with the tanh GELU as one op (mlp_gelu_tanh): its five gradients against finite differences.
TEST(Gradcheck, MlpWithTanhGelu) {
  EXPECT_TRUE(gradcheck([](const V& v) { return mlp_gelu_tanh(v[0], v[1], v[2], v[3], v[4]); },
                        {rnd({2, 3, 4}, 11, -2, 2), rnd({8, 4}, 12), rnd({8}, 13), rnd({5, 8}, 14), rnd({5}, 15)}));
}

TEST(Gradcheck, Reductions) {
  EXPECT_TRUE(gradcheck([](const V& v) { return sum(v[0]); }, {rnd({3, 4}, 1)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return mean(v[0]); }, {rnd({3, 4}, 2)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return sum(v[0], 0); }, {rnd({3, 4}, 3)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return sum(v[0], -1, true); }, {rnd({3, 4}, 4)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return mean(v[0], 1); }, {rnd({3, 4}, 5)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return mul(sum(v[0]), v[0]); }, {rnd({3, 4}, 6)}, true));
}

TEST(Gradcheck, SoftmaxAndLosses) {
  EXPECT_TRUE(gradcheck([](const V& v) { return softmax(v[0]); }, {rnd({3, 5}, 1, -2, 2)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return log_softmax(v[0]); }, {rnd({3, 5}, 2, -2, 2)}, true));
  EXPECT_TRUE(gradcheck([](const V& v) { return mse_loss(v[0], v[1]); }, {rnd({3, 5}, 3), rnd({3, 5}, 4)}, true));
  const Tensor target = from_int64({0, 4, 2}, {3});
  EXPECT_TRUE(gradcheck([target](const V& v) { return cross_entropy(v[0], target); }, {rnd({3, 5}, 5, -2, 2)}, true));
}

TEST(Gradcheck, MlpDoubleBackward) {
  // The gradient-penalty graph: linear -> relu -> linear -> mse, differentiated twice.
  auto f = [](const V& v) { return mse_loss(linear(relu(linear(v[0], v[1], v[2])), v[3], v[4]), v[5]); };
  EXPECT_TRUE(gradcheck(f, {rnd({4, 3}, 1), away_from_zero({5, 3}, 2), rnd({5}, 3), rnd({2, 5}, 4), rnd({2}, 5),
                            rnd({4, 2}, 6)},
                        true));
}

TEST(Autograd, CastGradientHasTheInputDtype) {
  Tensor x = from_vector({1.0, -2.0, 3.0}, {3}).set_requires_grad(true);
  const Tensor h = cast(x, DType::f16);
  EXPECT_EQ(h.dtype(), DType::f16);
  sum(mul(h, from_vector({0.5, 2.0, -1.0}, {3}, DType::f16))).backward();
  EXPECT_EQ(x.grad().dtype(), DType::f32);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0.5, 2.0, -1.0}));
}

// A graph a million nodes deep (an MLP of 100000 layers has one) is freed in a loop: it was freed by
// nested destructors, a few stack frames a node, and overflowed the stack (SIGSEGV). Dropped twice:
// unused, and after a backward through it (which frees the saved tensors as it goes).
TEST(Autograd, AGraphAMillionNodesDeepIsFreedWithoutOverflowingTheStack) {
  constexpr int kDepth = 1000000;
  Tensor x = from_vector({1.0}, {1}).set_requires_grad(true);
  {
    Tensor y = x;
    const Tensor one = from_vector({1.0}, {1});
    for (int i = 0; i < kDepth; ++i) y = mul(y, one);  // each node's closure saves y: a chain through closures
  }  // freed here
  Tensor y = x;
  for (int i = 0; i < kDepth; ++i) y = add(y, 1.0);
  sum(y).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1.0}));
  EXPECT_EQ(y.to_vector(), (std::vector<double>{1.0 + kDepth}));
}

TEST(Autograd, AccumulatesAcrossBackwardsAndRetainGraph) {
  Tensor x = from_vector({1.0, 2.0}, {2}).set_requires_grad(true);
  Tensor y = sum(mul(x, x));  // dy/dx = 2x
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{4.0, 8.0}));
  EXPECT_THROW(y.backward(), std::runtime_error);  // the graph was freed
  // Two losses into the same leaf.
  x.set_grad(Tensor());
  backward({sum(x), sum(mul(x, 3.0))});
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{4.0, 4.0}));
}

// Each node's saved tensors are freed once its backward has run (without retain_graph), as PyTorch
// frees them: a chain of 8 products by 1 MiB weights saves its 8 activations; as the backward goes,
// each weight's gradient comes and an activation goes, so the backward adds about three tensors to the
// memory at its peak, not the 8 gradients on top of the 8 activations. With retain_graph they stay.
TEST(Autograd, SavedTensorsAreFreedAsTheBackwardGoes) {
  const int64_t n = 1 << 18;  // 1 MiB of float32
  const size_t tensor = static_cast<size_t>(n) * 4;
  for (const bool retain : {false, true}) {
    SCOPED_TRACE(retain ? "retain_graph" : "released as it goes");
    std::vector<Tensor> w;
    for (int i = 0; i < 8; ++i) w.push_back(full({n}, 1.0 + i / 64.0).set_requires_grad(true));
    Tensor y = full({n}, 0.5);
    for (const Tensor& wi : w) y = mul(y, wi);  // saves y_i and w_i
    Tensor loss = sum(y);
    y = Tensor();
    DeviceMemory& m = host_memory();
    const size_t before = m.current_bytes();
    m.reset_peak_bytes();
    loss.backward(Tensor(), retain);
    const size_t added = m.peak_bytes() - before;
    for (const Tensor& wi : w) ASSERT_TRUE(wi.grad().defined());
    if (!retain) EXPECT_LE(added, 4 * tensor) << "the backward's peak over what the forward left";
    else EXPECT_GE(added, 8 * tensor) << "the control: the 8 gradients beside every saved activation";
  }
}

TEST(Autograd, GradDoesNotTouchDotGradAndHooksFireOncePerLeaf) {
  Tensor a = from_vector({1.0, 2.0}, {2}).set_requires_grad(true);
  Tensor b = from_vector({3.0, 4.0}, {2}).set_requires_grad(true);
  const auto g = grad({sum(mul(a, b))}, {a});
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{3.0, 4.0}));
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  std::vector<std::string> order;
  a.register_post_accumulate_grad_hook([&](const Tensor& t) { order.push_back("a" + std::to_string(t.grad().to_vector()[0])); });
  b.register_post_accumulate_grad_hook([&](const Tensor&) { order.push_back("b"); });
  // a is used twice; its hook must run once, with the final (summed) gradient.
  sum(add(mul(a, b), mul(a, 2.0))).backward();
  ASSERT_EQ(order.size(), 2u);
  EXPECT_TRUE(order[0] == "a5.000000" || order[1] == "a5.000000");
}

// A leaf's gradient destination (the reducer's bucket slice): the first gradient of a backward is
// computed straight into it, with the same values; later ones accumulate into it as usual.
TEST(Autograd, GradDestinationReceivesTheGradientInPlace) {
  Generator gen(9);
  const Tensor x = randn({6, 5}, gen);
  Tensor w = randn({4, 5}, gen).set_requires_grad(true), b = randn({4}, gen).set_requires_grad(true);
  sum(mul(linear(x, w, b), 3.0)).backward();
  const auto gw_ref = w.grad().to_vector(), gb_ref = b.grad().to_vector();
  w.set_grad(Tensor());
  b.set_grad(Tensor());
  Tensor dw = full({4, 5}, 7.0), db = full({4}, 7.0);
  w.set_grad_destination(dw);
  b.set_grad_destination(db);
  sum(mul(linear(x, w, b), 3.0)).backward();
  EXPECT_EQ(w.grad().data_ptr(), dw.data_ptr());
  EXPECT_EQ(b.grad().data_ptr(), db.data_ptr());
  EXPECT_EQ(dw.to_vector(), gw_ref);
  EXPECT_EQ(db.to_vector(), gb_ref);
  sum(mul(linear(x, w, b), 3.0)).backward();  // accumulates into the same memory
  for (size_t i = 0; i < gw_ref.size(); ++i) EXPECT_FLOAT_EQ(static_cast<float>(dw.to_vector()[i]), static_cast<float>(2 * gw_ref[i]));
  // grad(), with or without create_graph, never writes there.
  w.set_grad(Tensor());
  fill_(dw, 7.0);
  for (bool create_graph : {false, true}) {
    const auto g = grad({sum(mul(linear(x, w, b), 3.0))}, {w}, {}, create_graph, create_graph);
    EXPECT_NE(g[0].data_ptr(), dw.data_ptr());
    EXPECT_EQ(dw.to_vector(), std::vector<double>(20, 7.0));
  }
  EXPECT_THROW(w.set_grad_destination(zeros({5, 4})), std::invalid_argument);
}

// A weight used by two layers: only the first gradient to arrive may take the destination; the
// second is computed before the leaf's accumulator has run and must not write over the first.
TEST(Autograd, GradDestinationIsTakenOncePerBackward) {
  Generator gen(10);
  const Tensor x1 = randn({6, 5}, gen), x2 = randn({3, 5}, gen);
  Tensor w = randn({4, 5}, gen).set_requires_grad(true);
  auto loss = [&] { return add(sum(mul(linear(x1, w, Tensor()), 3.0)), sum(linear(x2, w, Tensor()))); };
  loss().backward();
  const auto reference = w.grad().to_vector();
  w.set_grad(Tensor());
  Tensor dw = full({4, 5}, 7.0);
  w.set_grad_destination(dw);
  loss().backward();
  const auto got = w.grad().to_vector();
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_NEAR(got[i], reference[i], 1e-5 * (1 + std::abs(reference[i]))) << i;
}

// An op may add its input's gradient into the one the engine has gathered from that input's other
// consumers (a residual stream's, in the GPT): offered only when nothing else holds it (here the add
// hands one tensor to both its inputs, and the probe's own incoming gradient is that tensor), never
// under create_graph, and the engine takes what the op returns as the sum (no second add).
TEST(Autograd, AnOpAddsIntoTheGradientSoFarOnlyWhenNothingElseHoldsIt) {
  // probe(x) = x; its backward gives 3 g, added into the gradient so far when offered.
  int offered = 0;
  auto probe = [&](const Tensor& x) {
    return record("Probe", mul(x.detach(), 1.0), {x}, [x, &offered](const Tensor& g) {
      Tensor so_far = take_gradient_so_far(0, x);
      if (!so_far.defined()) return std::vector<Tensor>{mul(g, 3.0)};
      ++offered;
      EXPECT_FALSE(take_gradient_so_far(0, x).defined());  // one taker
      for (int k = 0; k < 3; ++k) add_(so_far, g);  // wrong where so_far is g
      return std::vector<Tensor>{so_far};
    });
  };
  for (bool create_graph : {false, true}) {
    for (bool shared : {false, true}) {
      offered = 0;
      const Tensor p = rnd({4, 3}, 31).set_requires_grad(true);
      const Tensor x = mul(p, 2.0);
      const Tensor a = probe(x);
      // Another consumer of x, created later (so its gradient reaches x first): mul's own tensor,
      // or (shared) the add's, which the probe is reading too.
      const Tensor out = shared ? add(x, a) : add(a, mul(x, 5.0));
      const Tensor gp = grad({sum(out)}, {p}, {}, create_graph, create_graph)[0];
      const double expected = shared ? 2.0 * (1.0 + 3.0) : 2.0 * (3.0 + 5.0);
      EXPECT_EQ(gp.to_vector(), std::vector<double>(12, expected)) << "shared " << shared << " create_graph " << create_graph;
      EXPECT_EQ(offered, !shared && !create_graph ? 1 : 0) << "shared " << shared << " create_graph " << create_graph;
    }
  }
}

// A parameter's gradient that arrives through autocast's cast (fp16's weight gradient, the bias's) is
// cast straight into the parameter's destination, and LayerNorm's weight and bias gradients are
// computed there: the values made without destinations, in the destinations' memory.
TEST(Autograd, CastAndLayerNormGradientsLandInTheirDestinations) {
  Generator gen(11);
  const Tensor x = randn({6, 8}, gen);
  std::vector<Tensor> params = {randn({4, 8}, gen), randn({4}, gen), randn({8}, gen), randn({8}, gen)};
  for (Tensor& p : params) p.set_requires_grad(true);
  const auto backward = [&] {
    autocast ac(DeviceType::cpu, DType::f16, true, true, CastLists::cuda);
    sum(linear(layer_norm(x, params[2], params[3]), params[0], params[1]).to(DType::f32)).backward();
  };
  backward();
  std::vector<std::vector<double>> reference;
  for (Tensor& p : params) {
    reference.push_back(p.grad().to_vector());
    p.set_grad(Tensor());
  }
  std::vector<Tensor> destinations;
  for (Tensor& p : params) {
    destinations.push_back(full(p.shape(), 7.0, DType::f32));
    p.set_grad_destination(destinations.back());
  }
  backward();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].grad().data_ptr(), destinations[i].data_ptr()) << "parameter " << i;
    EXPECT_EQ(destinations[i].to_vector(), reference[i]) << "parameter " << i;
  }
}

// One tensor handed to two inputs (add(x, x)'s backward gives its gradient to both, and x + (x + w)'s
// inner add passes it on unchanged) is added twice, not taken for a sum made in place.
TEST(Autograd, OneGradientGivenToTwoInputsCountsTwice) {
  const Tensor x = from_vector({1.0, -2.0, 3.0}, {3}).set_requires_grad(true);
  const Tensor w = from_vector({0.5, 0.25, 4.0}, {3}).set_requires_grad(true);
  EXPECT_EQ(grad({sum(add(x, x))}, {x})[0].to_vector(), std::vector<double>(3, 2.0));
  const V g = grad({sum(add(x, add(x, w)))}, {x, w});
  EXPECT_EQ(g[0].to_vector(), std::vector<double>(3, 2.0));
  EXPECT_EQ(g[1].to_vector(), std::vector<double>(3, 1.0));
  const Tensor p = mul(x, 3.0);  // a node's buffer, not a leaf's
  EXPECT_EQ(grad({sum(add(p, p))}, {x})[0].to_vector(), std::vector<double>(3, 6.0));
}

TEST(Autograd, ErrorsAreClear) {
  Tensor x = from_vector({1.0}, {1});
  EXPECT_THROW(sum(x).backward(), std::runtime_error);  // nothing requires grad
  Tensor y = from_vector({1.0, 2.0}, {2}).set_requires_grad(true);
  EXPECT_THROW(mul(y, 2.0).backward(), std::runtime_error);  // non-scalar without a seed
  EXPECT_THROW(add(y, from_vector({1, 2, 3}, {3})), std::invalid_argument);
}

}  // namespace
}  // namespace amp
