// The costs that launch sites declare for the emulated GPU's launch log (declare_launch_cost, read
// by launch/bench/cost_model.py), checked on small odd shapes against what each kernel touches:
// - bytes written: the outputs are filled with 0xff bytes first (in-place ops: compared with their
//   inputs), and every element the kernel changed counts;
// - bytes read: every input element is set, one at a time, to NaN (an index to -1) and the kernel
//   run again: the elements that change some output are the ones it reads.
// Each must equal the declaration of the kernel's last launch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "emu.h"
#include "runtime/kernels/backend.h"
#include "runtime/kernels/optim_math.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/core/tensor.h"

namespace amp {
namespace {

constexpr Device kGPU{DeviceType::cuda, 0};
using Bytes = std::vector<unsigned char>;

class LaunchCost : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    ASSERT_TRUE(cuda_usable(&reason)) << reason;
    cuda_init(0);
  }
  Backend& gpu() { return backend_for(kGPU); }
};

Tensor random_gpu(const Shape& shape, DType dt, uint64_t seed) {
  Tensor t = empty(shape, dt);
  backend_for(kCPU).fill_uniform(t, seed, 0, 0.5, 2.0);
  return t.to(kGPU);
}

Tensor poisoned(const Shape& shape, DType dt) {
  Tensor t = empty(shape, dt, kGPU);
  EXPECT_EQ(cudaMemset(t.data_ptr(), 0xff, t.nbytes()), cudaSuccess);
  return t;
}

Bytes bytes_of(const Tensor& t) {
  emu::drain_for_testing();
  const Tensor h = t.to(kCPU);
  const auto* p = static_cast<const unsigned char*>(h.data_ptr());
  return Bytes(p, p + h.nbytes());
}

void upload(Tensor& t, const Bytes& b) { memory_for(kGPU).copy_from_host(t.data_ptr(), b.data(), b.size()); }

// Bytes of the elements of `after` that differ from `before`, element by element.
int64_t changed(const Bytes& before, const Bytes& after, size_t elem) {
  int64_t n = 0;
  for (size_t i = 0; i + elem <= after.size(); i += elem)
    n += std::memcmp(&before[i], &after[i], elem) != 0 ? static_cast<int64_t>(elem) : 0;
  return n;
}

// Element i of b (element size elem, dtype dt) set to NaN, or -1 for an index.
void poison_element(Bytes& b, size_t i, DType dt) {
  unsigned char* p = &b[i * dtype_size(dt)];
  switch (dt) {
    case DType::i64: { const int64_t v = -1; std::memcpy(p, &v, 8); return; }
    case DType::f64: { const double v = std::numeric_limits<double>::quiet_NaN(); std::memcpy(p, &v, 8); return; }
    case DType::f32: { const float v = std::numeric_limits<float>::quiet_NaN(); std::memcpy(p, &v, 4); return; }
    case DType::f16: p[0] = 0x00; p[1] = 0x7e; return;
    case DType::bf16: p[0] = 0xc0; p[1] = 0x7f; return;
  }
}

struct Touched {
  int64_t read = 0, written = 0;
};

// What run() reads of `inputs` and writes of `outputs` (an output may also be an input: in place).
Touched touched(const std::function<void()>& run, std::vector<Tensor> inputs, std::vector<Tensor> outputs) {
  std::vector<Bytes> original;
  for (const Tensor& t : inputs) original.push_back(bytes_of(t));
  const auto restore = [&] {
    for (size_t k = 0; k < inputs.size(); ++k) upload(inputs[k], original[k]);
  };
  std::vector<Bytes> before;
  for (const Tensor& t : outputs) before.push_back(bytes_of(t));
  run();
  Touched r;
  std::vector<Bytes> baseline;
  for (size_t k = 0; k < outputs.size(); ++k) {
    baseline.push_back(bytes_of(outputs[k]));
    r.written += changed(before[k], baseline[k], dtype_size(outputs[k].dtype()));
  }
  for (size_t k = 0; k < inputs.size(); ++k) {
    for (size_t i = 0; i < static_cast<size_t>(inputs[k].numel()); ++i) {
      restore();
      Bytes b = original[k];
      poison_element(b, i, inputs[k].dtype());
      upload(inputs[k], b);
      run();
      bool matters = false;
      for (size_t o = 0; o < outputs.size() && !matters; ++o) matters = bytes_of(outputs[o]) != baseline[o];
      r.read += matters ? static_cast<int64_t>(dtype_size(inputs[k].dtype())) : 0;
    }
  }
  restore();
  return r;
}

// The last launch of a kernel whose name contains `name`.
emu::LaunchRecord last(const std::string& name) {
  const auto all = emu::recent_launches();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (it->kernel.find(name) != std::string::npos) return *it;
  ADD_FAILURE() << "no launch of " << name;
  return {};
}

// The declaration of the kernel's last launch against what touched() measured.
void expect_declared(const std::string& kernel, const Touched& t) {
  const emu::LaunchRecord l = last(kernel);
  EXPECT_EQ(l.bytes_read, t.read) << kernel << ": bytes read";
  EXPECT_EQ(l.bytes_written, t.written) << kernel << ": bytes written";
}

TEST_F(LaunchCost, TheChecksSeeWhatIsTouched) {
  const Tensor x = random_gpu({7, 13}, DType::f32, 1), unused = random_gpu({5}, DType::f32, 2);
  Tensor y = poisoned({7, 13}, DType::f32), spare = poisoned({3}, DType::f32);
  const Touched t = touched([&] { gpu().unary(UnaryOp::exp, x, y, 1.0); }, {x, unused}, {y, spare});
  EXPECT_EQ(t.read, 7 * 13 * 4);  // not `unused`
  EXPECT_EQ(t.written, 7 * 13 * 4);  // not `spare`
}

TEST_F(LaunchCost, ElementWiseCastAndPermute) {
  const int64_t n = 7 * 13;
  const Tensor x = random_gpu({7, 13}, DType::f32, 1);
  Tensor y = poisoned({7, 13}, DType::f32);
  expect_declared("unary_packed_kernel", touched([&] { gpu().unary(UnaryOp::exp, x, y, 1.0); }, {x}, {y}));
  // A view one element in is not aligned to a pack: the element-by-element kernel.
  const Tensor x1 = random_gpu({n + 1}, DType::f32, 21);
  Tensor y1 = poisoned({n}, DType::f32);
  expect_declared("unary_kernel", touched([&] { gpu().unary(UnaryOp::exp, x1.view(1, {n}), y1, 1.0); }, {x1}, {y1}));

  const Tensor a = random_gpu({7, 13}, DType::bf16, 2), b = random_gpu({13}, DType::bf16, 3);
  Tensor s = poisoned({7, 13}, DType::bf16);
  const Touched add = touched([&] { gpu().binary(BinaryOp::add, a, b, s); }, {a, b}, {s});
  EXPECT_EQ(add.read, (n + 13) * 2);  // b is read once, not once per row
  expect_declared("binary_kernel", add);

  Tensor c = poisoned({7, 13}, DType::bf16);
  expect_declared("cast_packed_kernel", touched([&] { gpu().cast(x, c); }, {x}, {c}));
  const Tensor a2 = random_gpu({7, 13}, DType::bf16, 22);
  Tensor s2 = poisoned({7, 13}, DType::bf16);
  expect_declared("binary_packed_kernel", touched([&] { gpu().binary(BinaryOp::mul, a, a2, s2); }, {a, a2}, {s2}));

  Tensor p = poisoned({13, 7}, DType::f32);
  expect_declared("permute_kernel", touched([&] { gpu().permute(x, {1, 0}, p); }, {x}, {p}));

  Tensor wide = poisoned({7, 13}, DType::bf16);
  expect_declared("gather_kernel", touched([&] { gpu().broadcast_to(b, wide); }, {b}, {wide}));
  const Tensor one = random_gpu({1}, DType::bf16, 12);
  wide = poisoned({7, 13}, DType::bf16);
  expect_declared("fill_from_device_kernel", touched([&] { gpu().broadcast_to(one, wide); }, {one}, {wide}));

  // In place; the total norm (a scalar the call reads) is not among the declared bytes.
  std::vector<Tensor> xs = {random_gpu({200}, DType::f32, 13)};
  const Tensor norm = full({1}, 0.5, DType::f32, kGPU);
  expect_declared("multi_tensor_kernel", touched([&] { gpu().clip_by_norm(xs, norm, 0.25); }, {xs[0]}, {xs[0]}));
}

TEST_F(LaunchCost, RowKernels) {
  const int64_t rows = 5, cols = 33;
  const Tensor x = random_gpu({rows, cols}, DType::f32, 4);
  const Tensor w = random_gpu({cols}, DType::f32, 5), b = random_gpu({cols}, DType::f32, 6);
  Tensor y = poisoned({rows, cols}, DType::f32), mean = poisoned({rows}, DType::f32), rstd = poisoned({rows}, DType::f32);
  expect_declared("layer_norm_kernel",
                  touched([&] { gpu().layer_norm(x, w, b, 1e-5, y, mean, rstd); }, {x, w, b}, {y, mean, rstd}));

  {  // the residual add and LayerNorm in one pass: the stream fp32, the branch and the output bf16
    const Tensor branch = random_gpu({rows, cols}, DType::bf16, 8);
    Tensor h = poisoned({rows, cols}, DType::f32), yb = poisoned({rows, cols}, DType::bf16);
    expect_declared("add_layer_norm_kernel",
                    touched([&] { gpu().add_layer_norm_cast(x, branch, w, b, 1e-5, h, yb, mean, rstd); },
                            {x, branch, w, b}, {h, yb, mean, rstd}));
  }

  Tensor sm = poisoned({rows, cols}, DType::f32);
  expect_declared("softmax_kernel", touched([&] { gpu().softmax_lastdim(x, sm, false); }, {x}, {sm}));

  gpu().layer_norm(x, w, b, 1e-5, y, mean, rstd);  // touched() left the last poisoned run's statistics
  const Tensor g = random_gpu({rows, cols}, DType::f32, 7);
  Tensor gx = poisoned({rows, cols}, DType::f32), gw = poisoned({cols}, DType::f32), gb = poisoned({cols}, DType::f32);
  // LayerNorm's backward in one pass over g and x (rows up to 2048 wide): the input's gradient, and
  // each block's partial sums of the parameters' gradients into a workspace, which the second pass
  // reads to write them; adding into a residual stream's gradient reads gx as well.
  for (bool accumulate : {false, true}) {
    const auto backward = [&] { gpu().layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb, accumulate); };
    if (accumulate) gx = zeros({rows, cols}, DType::f32, kGPU);
    const Touched input = accumulate ? touched(backward, {g, x, w, mean, rstd, gx}, {gx})
                                     : touched(backward, {g, x, w, mean, rstd}, {gx});
    for (Tensor* t : {&gw, &gb}) *t = poisoned({cols}, DType::f32);
    const Touched params = touched(backward, {g, x, w, mean, rstd}, {gw, gb});
    const emu::LaunchRecord first = last("layer_norm_backward_rows_kernel"), second = last("layer_norm_param_sums_kernel");
    EXPECT_EQ(first.bytes_read, input.read) << "accumulate " << accumulate;
    EXPECT_EQ(first.bytes_written, input.written + second.bytes_read) << "accumulate " << accumulate;
    EXPECT_EQ(second.bytes_written, params.written);
    EXPECT_GT(second.bytes_read, 0);
  }
  // Wider rows (one row: touched() runs the op once per input element): the input's gradient a row
  // a block, then the parameters' in column tiles.
  {
    const int64_t wide = 2049;
    const Tensor wx = random_gpu({1, wide}, DType::f32, 15), wg = random_gpu({1, wide}, DType::f32, 16);
    const Tensor ww = random_gpu({wide}, DType::f32, 17), wb = random_gpu({wide}, DType::f32, 18);
    Tensor wy = poisoned({1, wide}, DType::f32), wgx = poisoned({1, wide}, DType::f32);
    Tensor wgw = poisoned({wide}, DType::f32), wgb = poisoned({wide}, DType::f32);
    Tensor wmean = poisoned({1}, DType::f32), wrstd = poisoned({1}, DType::f32);
    gpu().layer_norm(wx, ww, wb, 1e-5, wy, wmean, wrstd);
    const auto backward = [&] { gpu().layer_norm_backward(wg, wx, ww, wmean, wrstd, wgx, wgw, wgb, false); };
    expect_declared("layer_norm_backward_input_kernel", touched(backward, {wg, wx, ww, wmean, wrstd}, {wgx}));
    for (Tensor* t : {&wgw, &wgb}) *t = poisoned({wide}, DType::f32);
    expect_declared("layer_norm_param_partials_kernel", touched(backward, {wg, wx, wmean, wrstd}, {wgw, wgb}));
  }

  gpu().softmax_lastdim(x, sm, false);  // touched() left the last poisoned run's row of NaN
  const Tensor gy = random_gpu({rows, cols}, DType::f32, 14);
  Tensor gs = poisoned({rows, cols}, DType::f32);
  expect_declared("softmax_backward_kernel",
                  touched([&] { gpu().softmax_backward(sm, gy, gs, false, 1.0); }, {sm, gy}, {gs}));

  // Attention's softmax with autocast's casts in its pass: 16-bit scores up to each query read,
  // fp32 and 16-bit rows written; its backward reads the fp32 output and the 16-bit gradient.
  {
    const int64_t t = 13;
    const Tensor scores = random_gpu({2, t, t}, DType::bf16, 19);
    Tensor att = poisoned({2, t, t}, DType::f32), low = poisoned({2, t, t}, DType::bf16);
    const Touched f = touched([&] { gpu().causal_softmax_cast(scores, att, low, 0.5); }, {scores}, {att, low});
    EXPECT_EQ(f.read, 2 * (t * (t + 1) / 2) * 2);  // the lower triangles
    expect_declared("softmax_kernel", f);
    gpu().causal_softmax_cast(scores, att, low, 0.5);
    const Tensor dlow = random_gpu({2, t, t}, DType::bf16, 20);
    Tensor dscores = poisoned({2, t, t}, DType::bf16);
    expect_declared("softmax_backward_kernel",
                    touched([&] { gpu().softmax_backward_cast(att, dlow, dscores, 0.5); }, {att, dlow}, {dscores}));
  }

  const Tensor tall = random_gpu({9, 40}, DType::f32, 8);  // few rows: one pass, no partial sums
  Tensor col = poisoned({40}, DType::f32);
  expect_declared("sum_columns_kernel", touched([&] { gpu().sum_to(tall, col); }, {tall}, {col}));
}

TEST_F(LaunchCost, EmbeddingAndMultiTensor) {
  const Tensor weight = random_gpu({20, 6}, DType::f32, 9);
  std::vector<double> ix;
  for (int i = 0; i < 7; ++i) ix.push_back((i * 3) % 20);  // distinct rows
  const Tensor idx = from_vector(ix, {7}, DType::i64).to(kGPU);
  Tensor out = poisoned({7, 6}, DType::f32);
  expect_declared("embedding_kernel", touched([&] { gpu().embedding(weight, idx, out); }, {weight, idx}, {out}));

  // Its backward over the same distinct rows: the positions sorted by index (the order, n int32s, a
  // workspace), then each run of one index added to its row (read and written: in place, so
  // touched() sees the rows written, and the reads of the other inputs); nothing crosses a chunk
  // here, so the join reads only its workspace.
  const Tensor gout = random_gpu({7, 6}, DType::f32, 17);
  Tensor gweight = random_gpu({20, 6}, DType::f32, 18);
  const Touched bt = touched([&] { gpu().embedding_backward(gout, idx, gweight); }, {gout, idx}, {gweight});
  const emu::LaunchRecord order = last("embedding_order_kernel"), runs = last("embedding_runs_kernel");
  EXPECT_EQ(order.bytes_read, 7 * 8);
  EXPECT_EQ(order.bytes_written, 7 * 4);
  EXPECT_EQ(bt.written, 7 * 6 * 4);
  EXPECT_EQ(runs.bytes_read, bt.read + order.bytes_written + bt.written);
  EXPECT_EQ(runs.bytes_written, bt.written);

  // In place over two tensors: each element is read and written.
  std::vector<Tensor> grads = {random_gpu({300}, DType::f32, 10), random_gpu({123}, DType::f32, 11)};
  const Tensor scale = full({1}, 4.0, DType::f32, kGPU);
  Tensor found = full({1}, 0.0, DType::f32, kGPU);
  const Bytes g0 = bytes_of(grads[0]), g1 = bytes_of(grads[1]);
  const auto unscale = [&] { gpu().unscale_and_check(grads, scale, found); };
  Touched t = touched(unscale, {grads[0], grads[1]}, {grads[0], grads[1]});
  // touched() compared the outputs with their state before the run: the inputs themselves.
  EXPECT_EQ(bytes_of(grads[0]), g0);
  EXPECT_EQ(bytes_of(grads[1]), g1);
  expect_declared("multi_tensor_kernel", t);
}

// The optimizer passes, whose declarations are the cost model's weights, gradients and state.
TEST_F(LaunchCost, OptimizerSteps) {
  const int64_t n = 300 + 77;
  std::vector<Tensor> p, g, m, v, copies;
  for (int64_t size : {300, 77}) {
    p.push_back(random_gpu({size}, DType::f32, static_cast<uint64_t>(size)));
    g.push_back(random_gpu({size}, DType::f32, static_cast<uint64_t>(size) + 1));
    m.push_back(random_gpu({size}, DType::f32, static_cast<uint64_t>(size) + 2));
    v.push_back(random_gpu({size}, DType::f32, static_cast<uint64_t>(size) + 3));
    copies.push_back(poisoned({size}, DType::bf16));
  }
  Tensor step_count = full({1}, 0.0, DType::f32, kGPU);
  const Tensor scale = full({1}, 2.0, DType::f32, kGPU);
  const AdamHyper adam{1e-3, 0.9, 0.999, 1e-8, 0.01, true, false, false};
  for (const bool scaled : {false, true}) {
    for (Tensor& c : copies) c = poisoned(c.shape(), DType::bf16);
    const auto step = [&] {
      memory_for(kGPU).fill(step_count, 3.0);  // the same step every run
      gpu().adam_step(p, g, m, v, {}, step_count, adam, Tensor(), scaled ? scale : Tensor(), copies);
    };
    std::vector<Tensor> outputs = {p[0], p[1], m[0], m[1], v[0], v[1], copies[0], copies[1]};
    if (scaled) outputs.insert(outputs.end(), {g[0], g[1]});  // the unscaled gradients are written back
    const Touched t = touched(step, {p[0], p[1], g[0], g[1], m[0], m[1], v[0], v[1]}, outputs);
    EXPECT_EQ(t.read, n * 16);
    EXPECT_EQ(t.written, n * (scaled ? 18 : 14));
    expect_declared("multi_tensor_kernel", t);
  }
  const SgdHyper sgd{0.1, 0.9, 0.0, 0.0, false, false};
  for (Tensor& c : copies) c = poisoned(c.shape(), DType::bf16);
  const auto step = [&] {
    memory_for(kGPU).fill(step_count, 1.0);  // not the first step: the momentum buffer is read
    gpu().sgd_step(p, g, m, step_count, sgd, Tensor(), Tensor(), copies);
  };
  const Touched t = touched(step, {p[0], p[1], g[0], g[1], m[0], m[1]}, {p[0], p[1], m[0], m[1], copies[0], copies[1]});
  EXPECT_EQ(t.read, n * 12);
  EXPECT_EQ(t.written, n * 10);
  expect_declared("multi_tensor_kernel", t);
}

}  // namespace
}  // namespace amp
