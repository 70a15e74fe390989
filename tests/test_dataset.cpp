// The text stream (--model gpt) follows the layout that the README states ("A GPT on real text", Data)
// to the byte; and the synthetic data stream: a pool of samples that repeats, each sample a function of its index
// alone (never of the batch, the chunk it was generated in, or the device), as a file would be.
#include <gtest/gtest.h>

#include <cmath>

#include "models/data/dataset.h"
#include "models/data/text_dataset.h"
#include "runtime/ops/ops.h"
#include "test_util.h"

namespace amp {
namespace {

std::vector<double> row_of(const Tensor& t, int64_t r) {
  const std::vector<double> all = t.to_vector();
  const int64_t w = t.shape()[1];
  return {all.begin() + r * w, all.begin() + (r + 1) * w};
}

// Bytes are tokens; the first floor(9N/10) bytes train, the rest validate; sample s of a split of
// n bytes starts at byte (s T) mod (n - T - 1), its targets shifted by one. Written out here from
// that rule, against the dataset's rows (far into the stream too, where s T would overflow int64).
TEST(TextData, RowsFollowTheLayoutToTheByte) {
  const int64_t N = 1001, T = 8;
  std::string bytes(static_cast<size_t>(N), '\0');
  for (int64_t i = 0; i < N; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((i * 7 + i / 256) % 256);
  auto data = models::make_text_dataset(bytes, T, kCPU, "generated");
  EXPECT_EQ(data->train_bytes(), 900);  // 9 * 1001 / 10, rounded down
  EXPECT_EQ(data->validation_bytes(), 101);
  auto check = [&](const models::Batch& b, int64_t base, int64_t n, int64_t first, int64_t count) {
    ASSERT_EQ(b.x.shape(), (Shape{count, T}));
    const auto x = b.x.to_vector(), y = b.targets.at(0).to_vector();
    const int64_t span = n - T - 1;
    for (int64_t j = 0; j < count; ++j) {
      int64_t start = 0;  // (first + j) T mod span, as T additions mod span (no product to overflow)
      for (int64_t k = 0; k < T; ++k) start = (start + (first + j) % span) % span;
      for (int64_t t = 0; t < T; ++t) {
        const auto at = [&](int64_t k) { return static_cast<double>(static_cast<unsigned char>(bytes[static_cast<size_t>(base + k)])); };
        ASSERT_EQ(x[static_cast<size_t>(j * T + t)], at(start + t)) << "sample " << first + j << " byte " << t;
        ASSERT_EQ(y[static_cast<size_t>(j * T + t)], at(start + t + 1)) << "sample " << first + j << " byte " << t;
      }
    }
  };
  for (const int64_t first : {int64_t{0}, int64_t{100}, int64_t{1} << 61}) {
    check(data->rows(first, 12), 0, 900, first, 12);
    check(data->validation_rows(first, 5), 900, 101, first, 5);
  }
}

TEST(SyntheticData, ASampleDependsOnItsIndexAloneAndThePoolRepeats) {
  const int64_t width = 16, pool = models::pool_samples(2 * width);
  EXPECT_EQ(pool % 256, 0);
  EXPECT_GE(pool, 256);
  auto data = models::make_synthetic(width, 7, kCPU);
  // A batch that crosses a chunk boundary (256) row by row equals single-sample requests, asked
  // in another order from a fresh stream (so the chunks are generated in another order too).
  auto fresh = models::make_synthetic(width, 7, kCPU);
  const models::Batch b_x = data->rows(250, 12);
  const Tensor x = b_x.x, y = b_x.targets.at(0);
  for (int64_t k = 11; k >= 0; --k) {
    const models::Batch b_x1 = fresh->rows(250 + k, 1);
    const Tensor x1 = b_x1.x, y1 = b_x1.targets.at(0);
    EXPECT_EQ(row_of(x, k), row_of(x1, 0)) << k;
    EXPECT_EQ(row_of(y, k), row_of(y1, 0)) << k;
  }
  // The pool wraps: sample pool + j is sample j, also across the wrap inside one request.
  const models::Batch b_xw = data->rows(pool - 2, 4);
  const Tensor xw = b_xw.x, yw = b_xw.targets.at(0);
  const models::Batch b_x0 = data->rows(0, 2);
  const Tensor x0 = b_x0.x, y0 = b_x0.targets.at(0);
  EXPECT_EQ(row_of(xw, 2), row_of(x0, 0));
  EXPECT_EQ(row_of(yw, 3), row_of(y0, 1));
  EXPECT_NE(row_of(xw, 1), row_of(x0, 1));
  // Another seed, other samples; x is standard normal and y is not degenerate.
  auto other = models::make_synthetic(width, 8, kCPU);
  EXPECT_NE(row_of(other->rows(0, 1).x, 0), row_of(x0, 0));
  const models::Batch b_xs = data->rows(0, 256);
  const Tensor xs = b_xs.x, ys = b_xs.targets.at(0);
  const double m = mean(xs).item(), var = mean(mul(xs, xs)).item() - m * m;
  EXPECT_NEAR(m, 0.0, 0.05);
  EXPECT_NEAR(var, 1.0, 0.1);
  EXPECT_GT(mean(mul(ys, ys)).item(), 0.1);
}

// The multi-task stream: one [N, 1] target per task, each from its own teacher, x shared.
TEST(SyntheticData, MultiTaskTargetsComeFromATeacherEach) {
  auto data = models::make_synthetic_tasks(10, 5, 3, 7, kCPU);
  const models::Batch b = data->rows(100, 300);
  ASSERT_EQ(b.targets.size(), 3u);
  EXPECT_EQ(b.x.shape(), (Shape{300, 10}));
  for (const Tensor& t : b.targets) {
    EXPECT_EQ(t.shape(), (Shape{300, 1}));
    EXPECT_GT(mean(mul(t, t)).item(), 0.01);
  }
  EXPECT_NE(b.targets[0].to_vector(), b.targets[1].to_vector());
  auto again = models::make_synthetic_tasks(10, 5, 3, 7, kCPU);
  EXPECT_EQ(again->rows(100, 300).targets[2].to_vector(), b.targets[2].to_vector());
}

}  // namespace
}  // namespace amp
