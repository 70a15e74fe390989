// The transformer's ops (embedding, layer norm, permute, select, bmm, dropout, causal attention
// built from them): gradients against fp64 finite differences, forwards against hand computations,
// and their autocast categories.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <limits>
#include <tuple>
#include <vector>

#include "amp/autocast.h"
#include "models/gpt.h"
#include "runtime/kernels/activation_math.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

using test::gradcheck;
using V = std::vector<Tensor>;

Tensor rnd(const Shape& s, uint64_t seed, double lo = -1.0, double hi = 1.0, DType dt = DType::f64) {
  Generator g(seed);
  return rand_uniform(s, lo, hi, g, dt);
}

// The attention the fused op replaces, composed of the ops it fuses: permute and select the heads,
// causal_softmax of q k^T, dropout, times v, heads merged.
Tensor composed_attention(const Tensor& qkv, int64_t heads, double p = 0.0, uint64_t seed = 0, uint64_t offset = 0) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / heads;
  const Tensor split = permute(qkv.reshape({B, T, 3, heads, D}), {2, 0, 3, 1, 4});
  const Tensor q = select(split, 0).reshape({B * heads, T, D});
  const Tensor k = select(split, 1).reshape({B * heads, T, D});
  const Tensor v = select(split, 2).reshape({B * heads, T, D});
  Tensor att = causal_softmax(bmm(q, k, false, true), 1.0 / std::sqrt(static_cast<double>(D)));
  if (p > 0.0) att = dropout(att, p, seed, offset);
  return permute(bmm(att, v).reshape({B, heads, T, D}), {0, 2, 1, 3}).reshape({B, T, C});
}

// softmax(scale x + mask), mask -inf above the diagonal: the composite that causal_softmax fuses.
Tensor masked_softmax(const Tensor& x, double scale) {
  const int64_t T = x.size(-1);
  std::vector<double> m(static_cast<size_t>(T * T), 0.0);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = i + 1; j < T; ++j) m[static_cast<size_t>(i * T + j)] = -INFINITY;
  return softmax(add(mul(x, scale), from_vector(m, {T, T}, x.dtype())));
}

TEST(TransformerOps, GradientsAgainstFiniteDifferences) {
  const Tensor idx = from_int64({3, 0, 3, 1, 4, 3}, {2, 3});
  EXPECT_TRUE(gradcheck([idx](const V& v) { return embedding(v[0], idx); }, {rnd({5, 4}, 1)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return layer_norm(v[0], v[1], v[2]); },
                        {rnd({2, 3, 6}, 2, -2, 3), rnd({6}, 3), rnd({6}, 4)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return permute(v[0], {2, 0, 1}); }, {rnd({2, 3, 4}, 5)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return transpose(v[0], 0, -1); }, {rnd({2, 3, 4}, 6)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return mul(select(v[0], 1), select(v[0], 2)); }, {rnd({3, 2, 4}, 7)}));
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = ta ? rnd({3, 4, 2}, 8) : rnd({3, 2, 4}, 8);
      const Tensor b = tb ? rnd({3, 5, 4}, 9) : rnd({3, 4, 5}, 9);
      EXPECT_TRUE(gradcheck([ta, tb](const V& v) { return bmm(v[0], v[1], ta, tb); }, {a, b})) << ta << tb;
    }
  EXPECT_TRUE(gradcheck([](const V& v) { return dropout(v[0], 0.4, 11, 100); }, {rnd({4, 5}, 10)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return causal_attention(v[0], 2); }, {rnd({2, 5, 12}, 12, -2, 2)}));
  EXPECT_TRUE(gradcheck([](const V& v) { return causal_attention(v[0], 3, {.dropout_p = 0.3, .dropout = {7, 11, {}, 0}}); },
                        {rnd({2, 4, 18}, 13, -2, 2)}));
}

// The fused attention gives the composed ops' numbers, forward and backward, with and without
// dropout, in float32 and under fp16 and bf16 autocast (the products in 16 bits, the softmax in 32).
TEST(TransformerOps, FusedAttentionIsTheComposedOps) {
  for (int mode = 0; mode < 3; ++mode) {
    for (double p : {0.0, 0.25}) {
      const Tensor qkv = rnd({3, 7, 24}, 61, -2, 2, DType::f32).set_requires_grad(true);
      const Tensor w = rnd({3, 7, 8}, 62, -1, 1, DType::f32);
      Tensor fused, composed;
      {
        autocast ac(DeviceType::cpu, mode == 2 ? DType::bf16 : DType::f16, mode > 0, true, CastLists::cuda);
        fused = causal_attention(qkv, 4, {.dropout_p = p, .dropout = {5, 1000, {}, 0}});
        composed = composed_attention(qkv, 4, p, 5, 1000);
      }
      EXPECT_EQ(fused.dtype(), composed.dtype());
      EXPECT_TRUE(test::all_close(fused, composed, 0, 1e-30)) << "mode " << mode << " p " << p;
      const Tensor gf = grad({sum(mul(fused.to(DType::f32), w))}, {qkv})[0];
      const Tensor gc = grad({sum(mul(composed.to(DType::f32), w))}, {qkv})[0];
      EXPECT_TRUE(test::all_close(gf, gc, 0, 1e-30)) << "mode " << mode << " p " << p;
    }
  }
  EXPECT_THROW(causal_attention(rnd({2, 3, 10}, 1), 4), std::invalid_argument);
}

// A LayerNorm feeding a linear layer writes its output in the linear's autocast dtype: the same
// numbers as layer_norm then autocast's cast, forward and backward (every gradient bit for bit), with
// no cast between them in the graph; outside autocast it is layer_norm.
TEST(TransformerOps, LayerNormIntoLinearIsLayerNormThenTheCast) {
  for (int mode = 0; mode < 3; ++mode) {
    const Tensor x = rnd({3, 5, 24}, 81, -3, 3, DType::f32).set_requires_grad(true);
    const Tensor w = rnd({24}, 82, 0.5, 1.5, DType::f32).set_requires_grad(true);
    const Tensor b = rnd({24}, 83, -1, 1, DType::f32).set_requires_grad(true);
    const Tensor lw = rnd({16, 24}, 84, -0.3, 0.3, DType::f32).set_requires_grad(true);
    const Tensor lb = rnd({16}, 85, -0.3, 0.3, DType::f32).set_requires_grad(true);
    const Tensor probe = rnd({3, 5, 16}, 86, -1, 1, DType::f32);
    Tensor fused, composite, normed;
    {
      autocast ac(DeviceType::cpu, mode == 2 ? DType::bf16 : DType::f16, mode > 0, true, CastLists::cuda);
      normed = layer_norm_into_linear(x, w, b, 1e-5, lw);
      fused = linear(normed, lw, lb);
      composite = linear(layer_norm(x, w, b, 1e-5), lw, lb);
    }
    EXPECT_EQ(normed.dtype(), mode == 0 ? DType::f32 : mode == 1 ? DType::f16 : DType::bf16);
    EXPECT_TRUE(test::bitwise_equal(fused, composite)) << "mode " << mode;
    const std::vector<Tensor> gf = grad({sum(mul(fused.to(DType::f32), probe))}, {x, w, b, lw, lb});
    const std::vector<Tensor> gc = grad({sum(mul(composite.to(DType::f32), probe))}, {x, w, b, lw, lb});
    for (size_t i = 0; i < gf.size(); ++i) EXPECT_TRUE(test::bitwise_equal(gf[i], gc[i])) << "mode " << mode << " input " << i;
  }
}

// A block's residual stream x feeds its LayerNorm and the residual add: LayerNorm's backward adds its
// input gradient into the one the add has given x (one pass, no add of two fp32 tensors). Every
// gradient bit for bit the control's, where LayerNorm reads x through an identity of its own (x * 1:
// the engine adds the two gradients as before), under bf16 and fp16 autocast and in fp32 and fp64. And
// where the add's gradient is the very tensor LayerNorm's backward reads (x + layer_norm(x)), nothing
// is added in place: the same numbers again.
TEST(TransformerOps, LayerNormAddsIntoTheResidualStreamsGradient) {
  for (int mode = 0; mode < 4; ++mode) {
    const DType dt = mode == 3 ? DType::f64 : DType::f32;
    const Tensor x = rnd({3, 5, 24}, 91, -3, 3, dt).set_requires_grad(true);
    const Tensor w = rnd({24}, 92, 0.5, 1.5, dt).set_requires_grad(true);
    const Tensor b = rnd({24}, 93, -1, 1, dt).set_requires_grad(true);
    const Tensor lw = rnd({24, 24}, 94, -0.3, 0.3, dt).set_requires_grad(true);
    const Tensor lb = rnd({24}, 95, -0.3, 0.3, dt).set_requires_grad(true);
    const Tensor probe = rnd({3, 5, 24}, 96, -1, 1, dt);
    for (bool shared : {false, true}) {
      auto block = [&](const Tensor& ln_input) {
        autocast ac(DeviceType::cpu, mode == 1 ? DType::f16 : DType::bf16, mode < 2, true, CastLists::cuda);
        if (shared) return add(x, layer_norm(ln_input, w, b, 1e-5));
        return add(x, linear(layer_norm_into_linear(ln_input, w, b, 1e-5, lw), lw, lb));
      };
      const Tensor fused = block(x), control = block(mul(x, 1.0));
      const std::vector<Tensor> params = shared ? V{x, w, b} : V{x, w, b, lw, lb};
      const V gf = grad({sum(mul(fused.to(dt), probe))}, params);
      const V gc = grad({sum(mul(control.to(dt), probe))}, params);
      for (size_t i = 0; i < gf.size(); ++i)
        EXPECT_TRUE(test::bitwise_equal(gf[i], gc[i])) << "mode " << mode << " shared " << shared << " input " << i;
    }
  }
  // The backend's accumulate: d/dx added to gx as add() adds, every float dtype.
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = rnd({7, 40}, 97, -3, 3, dt), w = rnd({40}, 98, 0.5, 1.5, dt), g = rnd({7, 40}, 99, -1, 1, dt);
    const Tensor so_far = rnd({7, 40}, 100, -1, 1, dt);
    const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
    Tensor y = empty({7, 40}, dt), mean = empty({7}, st), rstd = empty({7}, st);
    Backend& cpu = backend_for(x.device());
    cpu.layer_norm(x, w, w, 1e-5, y, mean, rstd);
    Tensor gx = empty({7, 40}, dt), gw = empty({40}, dt), gb = empty({40}, dt);
    cpu.layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb, false);
    Tensor acc = so_far.clone();
    cpu.layer_norm_backward(g, x, w, mean, rstd, acc, gw, gb, true);
    EXPECT_TRUE(test::bitwise_equal(acc, add(so_far, gx))) << dtype_name(dt);
  }
}

// A residual add and the LayerNorm after it, one op: the sum and the norm's output bit for bit add()
// then layer_norm_into_linear, and every gradient too, under bf16 and fp16 autocast (the branch a
// linear's 16-bit output), in fp32 and in fp64; and where one pass cannot be (a broadcast branch, a
// branch wider than the stream), the two ops' numbers still.
TEST(TransformerOps, AddThenLayerNormIsTheAddThenTheLayerNorm) {
  for (int mode = 0; mode < 6; ++mode) {
    const DType dt = mode == 3 ? DType::f64 : mode == 5 ? DType::bf16 : DType::f32;
    const Tensor x = rnd({3, 5, 24}, 101, -3, 3, dt).set_requires_grad(true);
    const Tensor w = rnd({24}, 102, 0.5, 1.5, dt).set_requires_grad(true);
    const Tensor b = rnd({24}, 103, -1, 1, dt).set_requires_grad(true);
    const Tensor bw = rnd({24, 24}, 104, -0.3, 0.3, dt).set_requires_grad(true);
    const Tensor lw = rnd({16, 24}, 105, -0.3, 0.3, dt).set_requires_grad(true);
    const Tensor probe = rnd({3, 5, 24}, 106, -1, 1, DType::f32), probe_h = rnd({3, 5, 24}, 107, -1, 1, DType::f32);
    // mode 4: a broadcast branch [24]; mode 5: a bf16 stream and an fp32 branch (wider).
    const auto branch_of = [&](const Tensor& y) {
      if (mode == 4) return sum(sum(linear(y, bw, Tensor()), 0), 0);
      if (mode == 5) return linear(y, bw, Tensor()).to(DType::f32);
      return linear(y, bw, Tensor());
    };
    Tensor fh, fy, ch, cy;
    {
      autocast ac(DeviceType::cpu, mode == 1 ? DType::f16 : DType::bf16, mode == 1 || mode == 2, true, CastLists::cuda);
      const Tensor br = branch_of(x);
      std::tie(fh, fy) = add_layer_norm_into_linear(x, br, w, b, 1e-5, lw);
      ch = add(x, br);
      cy = layer_norm_into_linear(ch, w, b, 1e-5, lw);
    }
    EXPECT_TRUE(test::bitwise_equal(fh, ch)) << "mode " << mode;
    EXPECT_TRUE(test::bitwise_equal(fy, cy)) << "mode " << mode;
    const auto loss = [&](const Tensor& h, const Tensor& y) {
      return add(sum(mul(h.to(DType::f32), probe_h)), sum(mul(y.to(DType::f32), probe)));
    };
    const V gf = grad({loss(fh, fy)}, {x, w, b, bw}, {}, true);  // the branch's graph is shared
    const V gc = grad({loss(ch, cy)}, {x, w, b, bw});
    for (size_t i = 0; i < gf.size(); ++i) EXPECT_TRUE(test::bitwise_equal(gf[i], gc[i])) << "mode " << mode << " input " << i;
  }
}

// The MLP with GPT-2's GELU as one op: its output and every gradient bit for bit linear, gelu(tanh)
// and linear on the CPU (whose backend runs the same GEMMs and passes), in fp32, fp64 and under bf16
// and fp16 autocast (fp32 parameters cast in the op as linear casts them), for a 3-D input; a
// parameter that needs no gradient gets none; a bias that does not fit is linear's message; no
// double backward (the three ops have none with respect to the GELU's input either).
TEST(TransformerOps, MlpWithTanhGeluIsItsThreeOps) {
  for (int mode = 0; mode < 4; ++mode) {
    const DType dt = mode == 1 ? DType::f64 : DType::f32;
    const Tensor x = rnd({2, 3, 16}, 111, -2, 2, dt).set_requires_grad(true);
    const Tensor w1 = rnd({24, 16}, 112, -0.4, 0.4, dt).set_requires_grad(true);
    const Tensor b1 = rnd({24}, 113, -0.5, 0.5, dt).set_requires_grad(true);
    const Tensor w2 = rnd({8, 24}, 114, -0.4, 0.4, dt).set_requires_grad(true);
    const Tensor b2 = rnd({8}, 115, -0.5, 0.5, dt).set_requires_grad(mode != 3);
    const Tensor probe = rnd({2, 3, 8}, 116, -1, 1, DType::f32);
    Tensor fused, composite;
    {
      autocast ac(DeviceType::cpu, mode == 2 ? DType::f16 : DType::bf16, mode >= 2, true, CastLists::cuda);
      fused = mlp_gelu_tanh(x, w1, b1, w2, b2);
      composite = linear(gelu(linear(x, w1, b1), true), w2, b2);
    }
    ASSERT_EQ(fused.shape(), (Shape{2, 3, 8}));
    EXPECT_TRUE(test::bitwise_equal(fused, composite)) << "mode " << mode;
    const auto loss = [&](const Tensor& y) { return sum(mul(y.to(DType::f32), probe)); };
    const V inputs = mode == 3 ? V{x, w1, b1, w2} : V{x, w1, b1, w2, b2};
    const V gf = grad({loss(fused)}, inputs), gc = grad({loss(composite)}, inputs);
    for (size_t i = 0; i < gf.size(); ++i) EXPECT_TRUE(test::bitwise_equal(gf[i], gc[i])) << "mode " << mode << " input " << i;
  }
  const Tensor x = rnd({4, 16}, 117).set_requires_grad(true), w1 = rnd({24, 16}, 118), b1 = rnd({24}, 119);
  const Tensor w2 = rnd({8, 24}, 120), b2 = rnd({8}, 121);
  try {
    (void)mlp_gelu_tanh(x, w1, b1, w2, rnd({9}, 122));
    ADD_FAILURE() << "a bias of 9 for 8 outputs was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("linear: bias"), std::string::npos) << e.what();
  }
  const Tensor y = mlp_gelu_tanh(x, w1, b1, w2, b2);
  EXPECT_THROW((void)grad({sum(y)}, {x}, {}, false, true), std::runtime_error);
}

TEST(TransformerOps, CausalSoftmaxIsTheMaskedSoftmaxFused) {
  const Tensor x = rnd({2, 3, 5, 5}, 51, -3, 3).set_requires_grad(true);
  const Tensor w = rnd({2, 3, 5, 5}, 52);
  const Tensor fused = causal_softmax(x, 0.7), composite = masked_softmax(x, 0.7);
  EXPECT_TRUE(test::all_close(fused, composite, 1e-14, 1e-15));
  const Tensor gf = grad({sum(mul(fused, w))}, {x})[0], gc = grad({sum(mul(composite, w))}, {x})[0];
  EXPECT_TRUE(test::all_close(gf, gc, 1e-12, 1e-14));
  EXPECT_TRUE(gradcheck([](const V& v) { return causal_softmax(v[0], 1.3); }, {rnd({2, 4, 4}, 53, -2, 2)}));
  // softmax and log_softmax: the fused first-order backward against their composite double-backward
  // form (create_graph builds the composite).
  for (bool log : {false, true}) {
    const Tensor s = log ? log_softmax(x) : softmax(x);
    const Tensor g1 = grad({sum(mul(s, w))}, {x})[0];
    const Tensor g2 = grad({sum(mul(log ? log_softmax(x) : softmax(x), w))}, {x}, {}, false, true)[0];
    EXPECT_TRUE(test::all_close(g1, g2, 1e-12, 1e-14)) << "log " << log;
  }
  EXPECT_THROW(causal_softmax(rnd({2, 3, 4}, 1)), std::invalid_argument);
}

// GELU in fp32 (math::gelu(float), arithmetic only so that it vectorises) against fp64's erfc and
// exp: within 8 ulps of the exact value from x = -12.5 (GELU -5e-35; below, erfc's intermediate products
// leave float's normal range) up, the negative tail included (the formula
// 0.5 x (1 + erf(x / sqrt 2)) in fp32, which this replaced, is thousands of ulps off below x = -3,
// and all of them at x = -6: 1 + erf cancels); its slope within 6 units of 2^-24 of Phi(x) + |x| phi(x)
// (the slope crosses 0 near x = -0.75, where ulps of the result mean nothing). Then the special values.
TEST(TransformerOps, GeluInFp32IsWithinAFewUlpsOfTheExactValue) {
  double worst = 0, worst_slope = 0, worst_old = 0;
  for (double xd = -12.5; xd <= 16.0; xd += 1.0 / 2048) {
    const float x = static_cast<float>(xd);
    const double X = x, cdf = 0.5 * std::erfc(-X / std::sqrt(2.0)), pdf = std::exp(-0.5 * X * X) / std::sqrt(2 * M_PI);
    const double ref = X * cdf, ref_slope = cdf + X * pdf;
    if (std::fabs(ref) >= std::numeric_limits<float>::min()) {
      const double ulp = std::ldexp(1.0, std::ilogb(std::fabs(ref)) - 23);
      worst = std::max(worst, std::fabs(math::gelu(x) - ref) / ulp);
      const float old = 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752440f));
      worst_old = std::max(worst_old, std::fabs(old - ref) / ulp);
    }
    const double scale = cdf + std::fabs(X) * pdf;
    worst_slope = std::max(worst_slope, std::fabs(math::gelu_slope(x) - ref_slope) / (scale * std::ldexp(1.0, -24)));
  }
  std::printf("GELU fp32: worst %.2f ulps (0.5 x (1 + erf) in fp32: %.0f), slope worst %.2f units of 2^-24\n", worst,
              worst_old, worst_slope);
  EXPECT_LE(worst, 8.0);
  EXPECT_LE(worst_slope, 6.0);
  EXPECT_GT(worst_old, 1000.0);  // the comparison can see a bad formula
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(math::gelu(0.0f), 0.0f);
  EXPECT_TRUE(std::signbit(math::gelu(-0.0f)));
  EXPECT_EQ(math::gelu_slope(0.0f), 0.5f);
  EXPECT_EQ(math::gelu(inf), inf);
  EXPECT_TRUE(std::isnan(math::gelu(-inf)));  // -inf * Phi(-inf) = -inf * 0, as the formula with erf
  EXPECT_TRUE(std::isnan(math::gelu(nan)));
  EXPECT_TRUE(std::isnan(math::gelu_slope(nan)));
  EXPECT_TRUE(std::isnan(math::gelu_slope(inf)));  // 1 + inf * 0
  EXPECT_EQ(math::gelu(-20.0f), -0.0f);
  EXPECT_EQ(math::gelu(1e-30f), 5e-31f);
}

// The CPU backend computes GELU in fp16 and bf16 from a table of all 65536 inputs (and its backward
// from a table of slopes): bit for bit the per-element formula, for every input.
TEST(TransformerOps, GeluIn16BitDtypesIsThePerElementFormula) {
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor x = empty({65536}, dt);
    for (uint32_t b = 0; b < 65536; ++b) static_cast<uint16_t*>(x.data_ptr())[b] = static_cast<uint16_t>(b);
    Generator gen(3);
    const Tensor g = rand_uniform({65536}, -3, 3, gen, dt);
    for (bool tanh : {false, true}) {
      const std::vector<double> y = gelu(x, tanh).to_vector(), gx = gelu_backward(g, x, tanh).to_vector();
      const std::vector<double> xs = x.to_vector(), gs = g.to_vector();
      for (size_t i = 0; i < xs.size(); ++i) {
        const float v = static_cast<float>(xs[i]);
        const float want = tanh ? math::gelu_tanh(v) : math::gelu(v);
        const float dwant = tanh ? math::gelu_tanh_backward(static_cast<float>(gs[i]), v)
                                 : math::gelu_backward(static_cast<float>(gs[i]), v);
        const Tensor w = from_vector({want, dwant}, {2}, dt);  // rounded as the backend stores
        const std::vector<double> wv = w.to_vector();
        if (std::isnan(wv[0])) {
          ASSERT_TRUE(std::isnan(y[i])) << dtype_name(dt) << " bits " << i;
        } else {
          ASSERT_EQ(y[i], wv[0]) << dtype_name(dt) << " bits " << i << " tanh " << tanh;
        }
        if (std::isnan(wv[1])) {
          ASSERT_TRUE(std::isnan(gx[i])) << dtype_name(dt) << " bits " << i;
        } else {
          ASSERT_EQ(gx[i], wv[1]) << dtype_name(dt) << " bits " << i << " tanh " << tanh;
        }
      }
    }
  }
}

TEST(TransformerOps, LayerNormMatchesItsDefinition) {
  const Tensor x = rnd({3, 7}, 21, -4, 6), w = rnd({7}, 22), b = rnd({7}, 23);
  const std::vector<double> y = layer_norm(x, w, b, 1e-5).to_vector();
  const std::vector<double> xv = x.to_vector(), wv = w.to_vector(), bv = b.to_vector();
  for (int r = 0; r < 3; ++r) {
    double m = 0, var = 0;
    for (int c = 0; c < 7; ++c) m += xv[r * 7 + c] / 7;
    for (int c = 0; c < 7; ++c) var += (xv[r * 7 + c] - m) * (xv[r * 7 + c] - m) / 7;  // biased, as PyTorch's
    for (int c = 0; c < 7; ++c)
      EXPECT_NEAR(y[r * 7 + c], (xv[r * 7 + c] - m) / std::sqrt(var + 1e-5) * wv[c] + bv[c], 1e-12);
  }
}

TEST(TransformerOps, EmbeddingPicksRowsAndRefusesBadIndices) {
  const Tensor w = rnd({4, 3}, 31);
  const std::vector<double> y = embedding(w, from_int64({2, 2, 0}, {3})).to_vector(), wv = w.to_vector();
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(y[c], wv[6 + c]);
    EXPECT_EQ(y[3 + c], wv[6 + c]);
    EXPECT_EQ(y[6 + c], wv[c]);
  }
  EXPECT_THROW(embedding(w, from_int64({4}, {1})), std::out_of_range);
  EXPECT_THROW(embedding(w, from_int64({-1}, {1})), std::out_of_range);
  EXPECT_THROW(embedding(w, rnd({2}, 1)), std::invalid_argument);
}

// A table read by an embedding and by a classifier (GPT's tied wte): the embedding's backward adds its
// rows into the classifier's gradient, taken on its way to the table (at the table's accumulator, or at
// autocast's bf16 copy of the table, whose backward runs after the embedding's when the copy was made
// first, as GPT's are), instead of a zeroed table that the engine then adds to it. Bit for bit the
// two tables' gradients made apart and added, in fp32 without autocast, under bf16 autocast (the copy
// made before the embedding or by the classifier) and under fp16 autocast (the classifier's fp16
// gradient cast where it is taken); and the backend's add beside a control.
TEST(TransformerOps, ATiedEmbeddingAddsItsRowsIntoTheClassifiersGradient) {
  const int64_t rows = 11, C = 8, N = 9;
  const Tensor table = rnd({rows, C}, 111, -1, 1, DType::f32), probe = rnd({N, rows}, 112, -1, 1, DType::f32);
  const Tensor x0 = rnd({2, C}, 113, -1, 1, DType::f32), idx = from_int64({3, 0, 3, 10, 7, 3, 0, 5, 9}, {N});
  // fp32; bf16, the copy made first; bf16, the copy made by the classifier; fp16 (its gradient cast), first
  for (int mode = 0; mode < 4; ++mode) {
    auto run = [&](const Tensor& emb_w, const Tensor& cls_w) {
      autocast ac(DeviceType::cpu, mode == 3 ? DType::f16 : DType::bf16, mode > 0, true, CastLists::cuda);
      if (mode == 1 || mode == 3) (void)linear(x0, cls_w, Tensor());  // autocast's copy of cls_w, made (and cached) first
      const Tensor logits = linear(mul(embedding(emb_w, idx), 2.0), cls_w, Tensor());
      sum(mul(logits.to(DType::f32), probe)).backward();
    };
    const Tensor w = table.clone().set_requires_grad(true);
    run(w, w);
    const Tensor w1 = table.clone().set_requires_grad(true), w2 = table.clone().set_requires_grad(true);
    run(w1, w2);
    EXPECT_TRUE(test::bitwise_equal(w.grad(), add(w1.grad(), w2.grad()))) << "mode " << mode;
  }
  // With a destination (the reducer's bucket slice, where the classifier's gradient is then made) the
  // same buffer is taken, so a run's bits do not depend on the ranks: the same bits as without one,
  // the gradient left in the destination. And where taking the copy's gradient early would sum in
  // another order than the engine (a consumer of the copy still to come; a second embedding of the
  // table) it is not taken, with a destination or without: the same bits both ways.
  const Tensor idx2 = from_int64({1, 10, 10, 4}, {4});
  for (int shape = 0; shape < 3; ++shape) {  // the classifier; + the copy's first consumer in the loss; + a second embedding
    auto run = [&](const Tensor& w) {
      autocast ac(DeviceType::cpu, DType::bf16, true, true, CastLists::cuda);
      const Tensor first = linear(x0, w, Tensor());  // autocast's copy, made first
      Tensor e = mul(embedding(w, idx), 2.0);
      if (shape == 2) e = add(e, sum(mul(embedding(w, idx2), 3.0), 0, true));
      Tensor loss = sum(mul(linear(e, w, Tensor()).to(DType::f32), probe));
      if (shape == 1) loss = add(loss, sum(mul(first.to(DType::f32), 3.0)));
      loss.backward();
    };
    const Tensor plain = table.clone().set_requires_grad(true);
    run(plain);
    Tensor bucket = zeros({rows * C + 5}, DType::f32);
    const Tensor slot = bucket.view(5, {rows, C});
    Tensor w = table.clone().set_requires_grad(true);
    w.set_grad_destination(slot);
    run(w);
    EXPECT_TRUE(test::bitwise_equal(w.grad(), plain.grad())) << "shape " << shape;
    if (shape == 0) {
      EXPECT_EQ(w.grad().data_ptr(), slot.data_ptr()) << "summed in the destination";
    }
  }
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    const Tensor g = rnd({N, C}, 114, -1, 1, dt), so_far = rnd({rows, C}, 115, -1, 1, dt);
    Tensor zeroed = zeros({rows, C}, dt), acc = so_far.clone();
    backend_for(kCPU).embedding_backward(g, idx, zeroed);
    backend_for(kCPU).embedding_backward_add(g, idx, acc);
    EXPECT_TRUE(test::bitwise_equal(acc, add(so_far, zeroed))) << dtype_name(dt);
  }
}

TEST(TransformerOps, DropoutIsSeededByCounterAndKeepsTheExpectation) {
  const Tensor x = ones({100000}, DType::f32);
  const std::vector<double> a = dropout(x, 0.25, 5, 0).to_vector(), b = dropout(x, 0.25, 5, 0).to_vector();
  const std::vector<double> c = dropout(x, 0.25, 5, 100000).to_vector();
  EXPECT_EQ(a, b);  // same counters, same mask
  EXPECT_NE(a, c);
  int64_t kept = 0;
  for (double v : a) {
    ASSERT_TRUE(v == 0.0 || std::fabs(v - 1.0 / 0.75) < 1e-6) << v;
    kept += v != 0.0;
  }
  // Binomial(100000, 0.75): standard deviation 137; 6 of them either way.
  EXPECT_NEAR(static_cast<double>(kept), 75000.0, 6 * 137.0);
  // A slice's mask is the whole's, shifted by its offset: the same elements drop wherever they run.
  const std::vector<double> tail = dropout(ones({10}, DType::f32), 0.25, 5, 99990).to_vector();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(tail[static_cast<size_t>(i)], a[99990 + static_cast<size_t>(i)]);
  EXPECT_TRUE(dropout(x, 0.0, 5, 0).same(x));
  EXPECT_THROW(dropout(x, 1.0, 5, 0), std::invalid_argument);
}

TEST(TransformerOps, AutocastCategories) {
  const Tensor x = rnd({4, 8}, 41, -1, 1, DType::f32), w = ones({8}, DType::f32), b = zeros({8}, DType::f32);
  const Tensor a = rnd({2, 3, 4}, 42, -1, 1, DType::f32), m = rnd({2, 4, 5}, 43, -1, 1, DType::f32);
  autocast ac(DeviceType::cpu, DType::f16, true, true, CastLists::cuda);
  EXPECT_EQ(bmm(a, m).dtype(), DType::f16);                       // lower precision
  EXPECT_EQ(layer_norm(x.to(DType::f16), w, b).dtype(), DType::f32);  // fp32 on CUDA's list
  EXPECT_EQ(embedding(x, from_int64({1}, {1})).dtype(), DType::f32);  // on no list: the weight's dtype
}

TEST(TransformerOps, ShapesAreChecked) {
  EXPECT_THROW(permute(rnd({2, 3}, 1), {0, 0}), std::invalid_argument);
  EXPECT_THROW(permute(rnd({2, 3}, 1), {0}), std::invalid_argument);
  EXPECT_THROW(select(rnd({2, 3}, 1), 2), std::invalid_argument);
  EXPECT_THROW(bmm(rnd({2, 3, 4}, 1), rnd({2, 5, 4}, 2)), std::invalid_argument);
  EXPECT_THROW(layer_norm(rnd({2, 3}, 1), rnd({4}, 2), rnd({4}, 3)), std::invalid_argument);
}

// The fused classifier loss against the loss and gradient written out in fp64 from the same stored
// logits, in every float dtype, with padded columns (classes < V) that hold the row's largest
// values: they must be in neither the softmax nor the loss, and get gradient exactly 0. Bounds: the
// loss is an fp64 sum of rows, each lse rounded once to the compute type (fp32: 2^-24 relative,
// times |lse| in the exponent); the gradient is rounded once into the logits' dtype, after an exp
// of x - lse that carries lse's rounding.
TEST(TransformerOps, FusedCrossEntropyIsTheLossAndGradientInFp64) {
  const int64_t rows = 37, cols = 300;
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    for (int64_t classes : {cols, int64_t{257}}) {
      std::vector<double> v = rnd({rows, cols}, 71, -6, 6, dt).to_vector();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = classes; c < cols; ++c) v[static_cast<size_t>(r * cols + c)] = 30.0 + static_cast<double>(c % 7);
      const Tensor x = from_vector(v, {rows, cols}, dt).set_requires_grad(true);
      v = x.to_vector();  // the stored values
      std::vector<int64_t> t(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) t[static_cast<size_t>(r)] = (r * 31 + 5) % classes;
      const Tensor target = from_int64(t, {rows});
      const double g = 0.75;
      std::vector<double> lse(static_cast<size_t>(rows));
      double want = 0.0;
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0.0;
        for (int64_t c = 0; c < classes; ++c) s += std::exp(v[static_cast<size_t>(r * cols + c)]);
        lse[static_cast<size_t>(r)] = std::log(s);
        want += lse[static_cast<size_t>(r)] - v[static_cast<size_t>(r * cols + t[static_cast<size_t>(r)])];
      }
      want /= static_cast<double>(rows);
      const Tensor loss = fused_cross_entropy(x, target, classes);
      const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
      EXPECT_EQ(loss.dtype(), acc);
      const double u = dt == DType::f64 ? 0x1p-52 : 0x1p-23;
      EXPECT_NEAR(loss.item(), want, 8.0 * u * (std::fabs(want) + 10.0)) << dtype_name(dt) << " " << classes;
      const Tensor gx = grad({loss}, {x}, {from_vector({g}, {}, acc)})[0];
      EXPECT_EQ(gx.dtype(), dt);
      const std::vector<double> got = gx.to_vector();
      const double storage = dt == DType::f64 ? 0x1p-52 : dt == DType::f32 ? 0x1p-23 : dt == DType::f16 ? 0x1p-10 : 0x1p-7;
      const double tiny = dt == DType::f16 ? 0x1p-24 : 0.0;  // fp16's smallest subnormal: tinier values round to it or 0
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const size_t i = static_cast<size_t>(r * cols + c);
          if (c >= classes) {
            ASSERT_EQ(got[i], 0.0) << dtype_name(dt) << " padded column " << c;
            continue;
          }
          const double p = std::exp(v[i] - lse[static_cast<size_t>(r)]);
          const double ref = g / static_cast<double>(rows) * (p - (c == t[static_cast<size_t>(r)] ? 1.0 : 0.0));
          const double bound = storage * std::fabs(ref) + 40.0 * u * g / static_cast<double>(rows) * p + tiny + 1e-300;
          ASSERT_NEAR(got[i], ref, bound) << dtype_name(dt) << " classes " << classes << " at " << r << ", " << c;
        }
    }
  }
}

// The fused loss's backward writes the gradient over the logits when nothing else holds them and
// the graph goes with the backward (the GPT's lm_head output): the gradient of logits the test keeps
// (written apart, the logits left as they were), and a graph kept for a second backward
// (retain_graph) is read intact: both backwards give that gradient.
TEST(TransformerOps, FusedCrossEntropyWritesOverLogitsOnlyWhenNothingNeedsThem) {
  for (DType dt : {DType::bf16, DType::f32}) {
    const Tensor x = rnd({9, 40}, 111, -4, 4, dt).set_requires_grad(true);
    const Tensor target = from_int64({0, 5, 31, 2, 17, 7, 8, 19, 1}, {9});
    const Tensor held = mul(x, 1.0);
    const std::vector<double> logits = held.to_vector();
    const Tensor g_held = grad({fused_cross_entropy(held, target, 32)}, {x})[0];
    EXPECT_EQ(held.to_vector(), logits) << dtype_name(dt);
    const Tensor dropped = fused_cross_entropy(mul(x, 1.0), target, 32);  // mul's output dies here
    const Tensor g_dropped = grad({dropped}, {x})[0];
    EXPECT_TRUE(test::bitwise_equal(g_dropped, g_held)) << dtype_name(dt);
    const Tensor loss = fused_cross_entropy(mul(x, 1.0), target, 32);
    const Tensor g1 = grad({loss}, {x}, {}, true)[0];
    const Tensor g2 = grad({loss}, {x})[0];
    EXPECT_TRUE(test::bitwise_equal(g1, g_held)) << dtype_name(dt);
    EXPECT_TRUE(test::bitwise_equal(g2, g_held)) << dtype_name(dt) << ": the second backward";
  }
  // A backward that stops with an exception after the loss's node (a hook throws) leaves the graph,
  // its logits written over: a second backward is refused, not run on the gradient as logits.
  Tensor x = rnd({9, 40}, 112, -4, 4, DType::f32).set_requires_grad(true);
  bool fail = true;
  x.register_post_accumulate_grad_hook([&fail](const Tensor&) {
    if (fail) throw std::runtime_error("the hook fails");
  });
  const Tensor loss = fused_cross_entropy(mul(x, 1.0), from_int64({0, 5, 31, 2, 17, 7, 8, 19, 1}, {9}), 32);
  EXPECT_THROW(loss.backward(), std::runtime_error);
  fail = false;
  EXPECT_THROW(loss.backward(), std::runtime_error);
}

// In fp64 the fused loss is cross_entropy's (log_softmax then nll_loss) on the classes' columns, and
// so is its gradient; bad arguments are refused, and a target outside the classes throws.
TEST(TransformerOps, FusedCrossEntropyIsTheCompositeAndChecksItsArguments) {
  const Tensor x = rnd({9, 40}, 72, -4, 4).set_requires_grad(true);
  const Tensor target = from_int64({0, 5, 31, 2, 30, 7, 8, 19, 1}, {9});
  const Tensor fused = fused_cross_entropy(x, target, 32);
  std::vector<double> xv = x.to_vector(), sv;
  for (int64_t r = 0; r < 9; ++r)
    for (int64_t c = 0; c < 32; ++c) sv.push_back(xv[static_cast<size_t>(r * 40 + c)]);
  const Tensor sliced = from_vector(sv, {9, 32}, DType::f64).set_requires_grad(true);
  const Tensor composite = cross_entropy(sliced, target);
  EXPECT_NEAR(fused.item(), composite.item(), 1e-14);
  const std::vector<double> gf = grad({fused}, {x})[0].to_vector(), gc = grad({composite}, {sliced})[0].to_vector();
  for (int64_t r = 0; r < 9; ++r)
    for (int64_t c = 0; c < 40; ++c)
      EXPECT_NEAR(gf[static_cast<size_t>(r * 40 + c)], c < 32 ? gc[static_cast<size_t>(r * 32 + c)] : 0.0, 1e-15);
  EXPECT_THROW(fused_cross_entropy(x, from_int64({0, 5, 31, 2, 32, 7, 8, 19, 1}, {9}), 32), std::out_of_range);
  EXPECT_THROW(fused_cross_entropy(x, target, 41), std::invalid_argument);
  EXPECT_THROW(fused_cross_entropy(x, target, 0), std::invalid_argument);
  EXPECT_THROW(fused_cross_entropy(x, from_int64({0, 1}, {2}), 32), std::invalid_argument);
  EXPECT_THROW(fused_cross_entropy(rnd({3, 4, 5}, 1), from_int64({0, 1, 2}, {3})), std::invalid_argument);
}

}  // namespace
}  // namespace amp
