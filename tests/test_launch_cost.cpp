// The costs that launch sites declare for the emulated GPU's launch log (declare_launch_cost, read
// by launch/cost_model.py), checked on small odd shapes against what the kernels do:
// - bytes written: the output is filled with 0xff bytes first, and every element the kernel changed
//   counts (in-place ops: every element that differs from before); it must equal the declaration;
// - bytes read: the operands' sizes, worked out here from the shapes (the bytes a kernel that reads
//   each input element once must move), must equal the declaration.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "emu.h"
#include "runtime/backend.h"
#include "runtime/cuda_support.h"
#include "runtime/tensor.h"

namespace amp {
namespace {

constexpr Device kGPU{DeviceType::cuda, 0};

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

std::vector<unsigned char> bytes_of(const Tensor& t) {
  emu::drain_for_testing();
  const Tensor h = t.to(kCPU);
  const auto* p = static_cast<const unsigned char*>(h.data_ptr());
  return std::vector<unsigned char>(p, p + h.nbytes());
}

// Bytes of the elements of `after` that differ from `before` (element by element).
int64_t changed(const std::vector<unsigned char>& before, const std::vector<unsigned char>& after, size_t elem) {
  int64_t n = 0;
  for (size_t i = 0; i + elem <= after.size(); i += elem)
    n += std::memcmp(&before[i], &after[i], elem) != 0 ? static_cast<int64_t>(elem) : 0;
  return n;
}
int64_t written(const Tensor& t) {
  return changed(std::vector<unsigned char>(t.nbytes(), 0xff), bytes_of(t), dtype_size(t.dtype()));
}

// The last launch of a kernel whose name contains `name`.
emu::LaunchRecord last(const std::string& name) {
  const auto all = emu::recent_launches();
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (it->kernel.find(name) != std::string::npos) return *it;
  ADD_FAILURE() << "no launch of " << name;
  return {};
}

TEST_F(LaunchCost, ElementWiseCastAndBroadcast) {
  const Tensor x = random_gpu({37, 53}, DType::f32, 1);
  const int64_t n = 37 * 53;
  Tensor y = poisoned({37, 53}, DType::f32);
  ASSERT_EQ(written(y), 0);  // the check itself: nothing has written y yet
  gpu().unary(UnaryOp::exp, x, y, 1.0);
  EXPECT_EQ(written(y), n * 4);
  emu::LaunchRecord l = last("unary_kernel");
  EXPECT_EQ(l.bytes_read, n * 4);
  EXPECT_EQ(l.bytes_written, n * 4);

  const Tensor a = random_gpu({37, 53}, DType::bf16, 2), b = random_gpu({53}, DType::bf16, 3);
  Tensor s = poisoned({37, 53}, DType::bf16);
  gpu().binary(BinaryOp::add, a, b, s);
  EXPECT_EQ(written(s), n * 2);
  l = last("binary_kernel");
  EXPECT_EQ(l.bytes_read, (n + 53) * 2);  // b is read once, not once per row
  EXPECT_EQ(l.bytes_written, n * 2);

  Tensor c = poisoned({37, 53}, DType::bf16);
  gpu().cast(x, c);
  EXPECT_EQ(written(c), n * 2);
  l = last("cast_kernel");
  EXPECT_EQ(l.bytes_read, n * 4);
  EXPECT_EQ(l.bytes_written, n * 2);

  Tensor p = poisoned({53, 37}, DType::f32);
  gpu().permute(x, {1, 0}, p);
  EXPECT_EQ(written(p), n * 4);
  l = last("permute_kernel");
  EXPECT_EQ(l.bytes_read, n * 4);
  EXPECT_EQ(l.bytes_written, n * 4);
}

TEST_F(LaunchCost, RowKernels) {
  const int64_t rows = 37, cols = 129;
  const Tensor x = random_gpu({rows, cols}, DType::f32, 4);
  const Tensor w = random_gpu({cols}, DType::f32, 5), b = random_gpu({cols}, DType::f32, 6);
  Tensor y = poisoned({rows, cols}, DType::f32), mean = poisoned({rows}, DType::f32), rstd = poisoned({rows}, DType::f32);
  gpu().layer_norm(x, w, b, 1e-5, y, mean, rstd);
  EXPECT_EQ(written(y) + written(mean) + written(rstd), (rows * cols + 2 * rows) * 4);
  emu::LaunchRecord l = last("layer_norm_kernel");
  EXPECT_EQ(l.bytes_read, (rows * cols + 2 * cols) * 4);
  EXPECT_EQ(l.bytes_written, (rows * cols + 2 * rows) * 4);

  Tensor sm = poisoned({rows, cols}, DType::f32);
  gpu().softmax_lastdim(x, sm, false);
  EXPECT_EQ(written(sm), rows * cols * 4);
  l = last("softmax_kernel");
  EXPECT_EQ(l.bytes_read, rows * cols * 4);
  EXPECT_EQ(l.bytes_written, rows * cols * 4);

  const Tensor g = random_gpu({rows, cols}, DType::f32, 7);
  Tensor gx = poisoned({rows, cols}, DType::f32), gw = poisoned({cols}, DType::f32), gb = poisoned({cols}, DType::f32);
  gpu().layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb);
  EXPECT_EQ(written(gx), rows * cols * 4);
  EXPECT_EQ(written(gw) + written(gb), 2 * cols * 4);
  l = last("layer_norm_backward_input_kernel");
  EXPECT_EQ(l.bytes_read, (2 * rows * cols + cols + 2 * rows) * 4);
  EXPECT_EQ(l.bytes_written, rows * cols * 4);
  l = last("layer_norm_backward_params_kernel");
  EXPECT_EQ(l.bytes_read, (2 * rows * cols + 2 * rows) * 4);
  EXPECT_EQ(l.bytes_written, 2 * cols * 4);

  const Tensor big = random_gpu({64, 1000}, DType::f32, 8);  // few rows: one pass, no partial sums
  Tensor col = poisoned({1000}, DType::f32);
  gpu().sum_to(big, col);
  EXPECT_EQ(written(col), 1000 * 4);
  l = last("sum_columns_kernel");
  EXPECT_EQ(l.bytes_read, 64 * 1000 * 4);
  EXPECT_EQ(l.bytes_written, 1000 * 4);
}

TEST_F(LaunchCost, EmbeddingAndMultiTensor) {
  const Tensor weight = random_gpu({50, 33}, DType::f32, 9);
  std::vector<double> ix;
  for (int i = 0; i < 17; ++i) ix.push_back((i * 7) % 50);
  const Tensor idx = from_vector(ix, {17}, DType::i64).to(kGPU);
  Tensor out = poisoned({17, 33}, DType::f32);
  gpu().embedding(weight, idx, out);
  EXPECT_EQ(written(out), 17 * 33 * 4);
  emu::LaunchRecord l = last("embedding_kernel");
  EXPECT_EQ(l.bytes_read, 17 * 8 + 17 * 33 * 4);
  EXPECT_EQ(l.bytes_written, 17 * 33 * 4);

  // In place over two tensors (one of them spans two chunks): every element changes.
  std::vector<Tensor> grads = {random_gpu({70001}, DType::f32, 10), random_gpu({123}, DType::f32, 11)};
  const auto before0 = bytes_of(grads[0]), before1 = bytes_of(grads[1]);
  const Tensor scale = full({1}, 4.0, DType::f32, kGPU);
  Tensor found = full({1}, 0.0, DType::f32, kGPU);
  gpu().unscale_and_check(grads, scale, found);
  const int64_t n = 70001 + 123;
  EXPECT_EQ(changed(before0, bytes_of(grads[0]), 4) + changed(before1, bytes_of(grads[1]), 4), n * 4);
  l = last("multi_tensor_kernel");
  EXPECT_EQ(l.bytes_read, n * 4);
  EXPECT_EQ(l.bytes_written, n * 4);
}

}  // namespace
}  // namespace amp
