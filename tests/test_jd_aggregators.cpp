// TorchJD's aggregators against TorchJD's own results (tests/data/jd_aggregators.safetensors: 30
// float64 Jacobians of 2-6 rows, generic and hard cases), and the special cases of
// docs/JACOBIAN_DESCENT.md. float64 throughout, so the tolerances are tight: 1e-9 relative for
// the closed-form and QP-based aggregators (what two exact float64 solvers can differ by on a
// Gramian whose condition number reaches 1e4), looser where TorchJD iterates (MGDA's Frank-Wolfe) or
// takes an eigendecomposition.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <numeric>

#include "jd/aggregator.h"
#include "jd/quadprog.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "test_util.h"

namespace amp {
namespace {

const std::string kFile = "jd_aggregators.safetensors";

Tensor J_of(int k) { return test::fixture_tensor(kFile, "J" + std::to_string(k)); }

void expect_matches_torchjd(const std::string& key, jd::Aggregator& agg, bool has_weights, double rtol, double atol) {
  for (int k = 0; k < 30; ++k) {
    const Tensor J = J_of(k);
    const Tensor got = agg(J);
    EXPECT_TRUE(test::all_close(got, test::fixture_tensor(kFile, key + "_" + std::to_string(k)), rtol, atol))
        << key << " on J" << k << " " << shape_str(J.shape());
    if (has_weights) {
      const Tensor w = from_vector(agg.last_weights(), {J.shape()[0]}, DType::f64);
      EXPECT_TRUE(test::all_close(w, test::fixture_tensor(kFile, key + "_w" + std::to_string(k)), rtol, atol))
          << key << " weights on J" << k;
    }
  }
}

TEST(Aggregators, MeanAndSum) {
  jd::Mean mean;
  expect_matches_torchjd("mean", mean, true, 1e-12, 1e-15);
  jd::Sum sum;
  expect_matches_torchjd("sum", sum, true, 1e-12, 1e-15);
}

TEST(Aggregators, UPGrad) {
  jd::UPGrad a;
  expect_matches_torchjd("upgrad", a, true, 1e-9, 1e-12);
}

TEST(Aggregators, DualProj) {
  jd::DualProj a;
  expect_matches_torchjd("dualproj", a, true, 1e-9, 1e-12);
}

TEST(Aggregators, MGDA) {
  jd::MGDA a;
  expect_matches_torchjd("mgda", a, true, 1e-9, 1e-12);
}

TEST(Aggregators, IMTLG) {
  jd::IMTLG a;
  expect_matches_torchjd("imtlg", a, true, 1e-7, 1e-10);
}

TEST(Aggregators, AlignedMTL) {
  jd::AlignedMTL a;
  expect_matches_torchjd("alignedmtl", a, true, 1e-7, 1e-10);
}

// atol 1e-7: on J29 the unit rows sum to zero, the exact result is 0, and what is left of rounding
// after ConFIG's normalization is 2e-8 here (TorchJD's SVD happens to give exactly 0).
TEST(Aggregators, ConFIG) {
  jd::ConFIG a;
  expect_matches_torchjd("config", a, false, 1e-7, 1e-7);
}

// The aggregators without fixtures, against their definitions on hand-worked cases.
TEST(Aggregators, ConstantTrimmedMeanKrumGradDropPCGradRandom) {
  const Tensor J = from_vector({1, 2, 3, -4, -5, 6, 7, 8, -9, 10, 11, 12, 0, 1, 0}, {5, 3}, DType::f64);
  jd::Constant c({0.5, 0.25, 0, 0, 1});
  EXPECT_EQ(c(J).to_vector(), (std::vector<double>{0.5 - 1, 1 - 1.25 + 1, 1.5 + 1.5}));
  EXPECT_THROW(jd::Constant({1, 2})(J), std::invalid_argument);
  // Trimmed mean of columns {1,-4,7,10,0}, {2,-5,8,11,1}, {3,6,-9,12,0} without the extremes.
  jd::TrimmedMean t(1);
  const std::vector<double> tm = t(J).to_vector();
  EXPECT_DOUBLE_EQ(tm[0], (0 + 1 + 7) / 3.0);
  EXPECT_DOUBLE_EQ(tm[1], (1 + 2 + 8) / 3.0);
  EXPECT_DOUBLE_EQ(tm[2], (0 + 3 + 6) / 3.0);
  EXPECT_THROW(jd::TrimmedMean(3)(J), std::invalid_argument);
  EXPECT_THROW(jd::TrimmedMean(-1), std::invalid_argument);
  // Krum with 3 identical rows and 2 outliers: one of the identical rows, alone.
  const Tensor K = from_vector({1, 1, 1, 1, 1, 1, 50, -50, 1, 1, -80, 90}, {6, 2}, DType::f64);
  jd::Krum k(1);
  EXPECT_EQ(k(K).to_vector(), (std::vector<double>{1, 1}));
  const std::vector<double> kw = k.last_weights();
  EXPECT_EQ(kw[2] + kw[4] + kw[5], 0.0) << "no outlier selected";
  EXPECT_THROW(jd::Krum(4)(K), std::invalid_argument) << "m < n_byzantine + 3";
  // GradDrop with rows of one sign per column keeps them all (purity 1 or 0 decides for sure).
  const Tensor S = from_vector({1, -2, 3, 4, -5, 6}, {2, 3}, DType::f64);
  jd::GradDrop g;
  EXPECT_EQ(g(S).to_vector(), (std::vector<double>{5, -7, 9}));
  EXPECT_THROW(jd::GradDrop({0.1})(S), std::invalid_argument) << "one leak per row";
  // PCGrad without conflict is the sum; with two opposite rows each is projected to zero.
  jd::PCGrad pc(3);
  EXPECT_EQ(pc(S).to_vector(), (std::vector<double>{5, -7, 9}));
  for (double v : pc(from_vector({1, 2, -1, -2}, {2, 2}, DType::f64)).to_vector()) EXPECT_EQ(v, 0.0);
  // Random: weights on the simplex, different per call, reproducible per seed.
  jd::Random r1(7), r2(7);
  r1(J);
  const std::vector<double> w1 = r1.last_weights();
  r2(J);
  EXPECT_EQ(w1, r2.last_weights());
  EXPECT_NEAR(std::accumulate(w1.begin(), w1.end(), 0.0), 1.0, 1e-15);
  r1(J);
  EXPECT_NE(w1, r1.last_weights());
}

// min_rows()/max_rows() (what amp_train checks --tasks against before step 1) are the counts that
// operator() takes: every count of rows from 1 to 9 refused exactly where they say.
TEST(Aggregators, RowBoundsAreTheRowsTaken) {
  std::vector<std::unique_ptr<jd::Aggregator>> all;
  all.push_back(std::make_unique<jd::Krum>(1, 5));
  all.push_back(std::make_unique<jd::Krum>(3, 2));
  all.push_back(std::make_unique<jd::TrimmedMean>(2));
  all.push_back(std::make_unique<jd::Constant>(std::vector<double>{1, 2, 3}));
  all.push_back(std::make_unique<jd::UPGrad>());
  for (auto& agg : all)
    for (int64_t m = 1; m <= 9; ++m) {
      SCOPED_TRACE(agg->name() + " on " + std::to_string(m) + " rows");
      Generator g(static_cast<uint64_t>(m));
      const Tensor J = randn({m, 4}, g, DType::f64);
      if (m >= agg->min_rows() && m <= agg->max_rows())
        EXPECT_NO_THROW((*agg)(J));
      else
        EXPECT_THROW((*agg)(J), std::invalid_argument);
    }
}

TEST(Aggregators, ByName) {
  for (const char* n : {"upgrad", "mean", "sum", "random", "dualproj", "mgda", "pcgrad", "imtlg", "alignedmtl", "config",
                        "graddrop", "trimmedmean", "trimmedmean:2", "krum", "krum:1:2", "constant:0.5,0.5"})
    EXPECT_NO_THROW(jd::make_aggregator(n)) << n;
  for (const char* n : {"upgrade", "mean:1", "krum:x", "constant", "constant:1,nan", "trimmedmean:1:2"})
    EXPECT_THROW(jd::make_aggregator(n), std::invalid_argument) << n;
  // Finite in double, inf in the float32 the weights scale J's rows in: refused (it trained a NaN step).
  EXPECT_NO_THROW(jd::make_aggregator("constant:3e38,1"));
  EXPECT_THROW(jd::make_aggregator("constant:1e308,1"), std::invalid_argument);
  EXPECT_THROW(jd::make_aggregator("constant:1,-4e38"), std::invalid_argument);
}

// A Jacobian of no rows (no task): each aggregator refuses it, as TorchJD's raise, but GradDrop, which
// returns zeros as TorchJD's does; ConFIG died of SIGSEGV.
TEST(Aggregators, AMatrixWithoutRowsIsRefusedOrGivesZeros) {
  for (const char* n : {"upgrad", "mean", "sum", "random", "dualproj", "mgda", "pcgrad", "imtlg", "alignedmtl", "config",
                        "graddrop", "trimmedmean", "krum", "constant:1"}) {
    const auto a = jd::make_aggregator(n);
    for (const Shape& shape : {Shape{0, 3}, Shape{0, 0}}) {
      if (std::string(n) != "graddrop") {
        EXPECT_THROW((*a)(zeros(shape, DType::f64)), std::invalid_argument) << n;
        continue;
      }
      const Tensor out = (*a)(zeros(shape, DType::f64));
      EXPECT_EQ(out.shape(), (Shape{shape[1]})) << n;
      for (double x : out.to_vector()) EXPECT_EQ(x, 0.0) << n;
    }
  }
}

// TrimmedMean sorts each column as torch.sort does, NaN after every number: [NaN, 3, 5] keeps 5, as
// TorchJD's does (it kept 3: std::sort's < is no order with a NaN).
TEST(Aggregators, TrimmedMeanSortsNaNLastAsTorchDoes) {
  jd::TrimmedMean a(1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> out =
      a(from_vector({nan, 1.0, nan, 3.0, 2.0, nan, 5.0, nan, 1.0}, {3, 3}, DType::f64)).to_vector();
  EXPECT_EQ(out[0], 5.0);          // [NaN, 3, 5] -> [3, 5, NaN]
  EXPECT_EQ(out[1], 2.0);          // [1, 2, NaN] -> [1, 2, NaN]
  EXPECT_TRUE(std::isnan(out[2])); // [NaN, NaN, 1] -> [1, NaN, NaN]
}

// --- the special cases of the spec

std::vector<double> upgrad_weights(const std::vector<double>& rows, int m, int n) {
  jd::UPGrad a;
  a(from_vector(rows, {m, n}, DType::f64));
  return a.last_weights();
}

TEST(UPGradCases, OneRowIsReturnedAsItIs) {
  for (double scale : {1.0, 1e-3}) {  // above and below the trace threshold
    const Tensor J = from_vector({3.0 * scale, -1.0 * scale, 2.0 * scale}, {1, 3}, DType::f64);
    jd::UPGrad a;
    EXPECT_TRUE(test::bitwise_equal(a(J), J.reshape({3})));
    EXPECT_EQ(a.last_weights(), std::vector<double>{1.0});
  }
}

TEST(UPGradCases, DocstringExample) {
  const Tensor J = from_vector({-4, 1, 1, 6, 1, 1}, {2, 3}, DType::f64);
  jd::UPGrad a;
  const std::vector<double> out = a(J).to_vector();
  EXPECT_NEAR(a.last_weights()[0], 1.1109, 1e-4);
  EXPECT_NEAR(a.last_weights()[1], 0.7894, 1e-4);
  EXPECT_NEAR(out[0], 0.2929, 1e-4);
  EXPECT_NEAR(out[1], 1.9004, 1e-4);
  EXPECT_NEAR(out[2], 1.9004, 1e-4);
}

TEST(UPGradCases, ZeroRowOppositeRowsAndAllZero) {
  const auto w = upgrad_weights({1, 2, 0, 0, 0, 0, -2, -1, 1}, 3, 3);
  EXPECT_NEAR(w[0], 0.5999, 1e-4);
  EXPECT_NEAR(w[1], 1.0 / 3.0, 1e-12) << "a zero row keeps its own preference";
  EXPECT_NEAR(w[2], 0.5555, 1e-4);
  jd::UPGrad a;
  const Tensor opposite = a(from_vector({1, -2, 3, -1, 2, -3}, {2, 3}, DType::f64));
  EXPECT_NEAR(a.last_weights()[0], 0.9999, 1e-4);
  for (double v : opposite.to_vector()) EXPECT_EQ(v, 0.0) << "g and -g cancel exactly";
  const Tensor zero = a(zeros({3, 4}, DType::f64));
  for (double v : zero.to_vector()) EXPECT_EQ(v, 0.0);
  for (double w0 : a.last_weights()) EXPECT_EQ(w0, 1.0 / 3.0);
}

TEST(UPGradCases, TraceBelowThresholdFallsBackToTheMean) {
  const std::vector<double> rows = {1e-3, 2e-3, 0, -2e-3, -1e-3, 1e-3};
  jd::UPGrad a;
  const std::vector<double> small = a(from_vector(rows, {2, 3}, DType::f64)).to_vector();
  EXPECT_NEAR(small[0], -5e-4, 1e-15);
  EXPECT_NEAR(small[1], 5e-4, 1e-15);
  EXPECT_NEAR(small[2], 5e-4, 1e-15);
  std::vector<double> big = rows;
  for (double& v : big) v *= 65536.0;
  const std::vector<double> scaled = a(from_vector(big, {2, 3}, DType::f64)).to_vector();
  EXPECT_NEAR(scaled[0] / 65536.0, -7.67e-4, 1e-6);
  EXPECT_NEAR(scaled[1] / 65536.0, 9.67e-4, 1e-6);
  EXPECT_NEAR(scaled[2] / 65536.0, 8.33e-4, 1e-6);
}

// Positive homogeneity, bitwise for powers of two in float32 (GradScaler's scales).
TEST(UPGradCases, PowersOfTwoScaleTheResultBitwise) {
  Generator gen(1);
  for (int trial = 0; trial < 20; ++trial) {
    const Tensor J = randn({4, 37}, gen);
    jd::UPGrad a;
    const Tensor base = a(J);
    for (double c : {65536.0, 32768.0, 1.0 / 256.0}) {
      const Tensor scaled = a(mul(J, c));
      EXPECT_TRUE(test::bitwise_equal(scaled, mul(base, c))) << "c = " << c << " trial " << trial;
    }
  }
}

TEST(UPGradCases, NonFiniteJacobianGivesNaNWithoutThrowing) {
  jd::UPGrad a;
  const Tensor out = a(from_vector({1, 2, INFINITY, -1, 0, 1}, {2, 3}));
  for (double v : out.to_vector()) EXPECT_TRUE(std::isnan(v));
}

// The QP solver on its own: KKT conditions at the solution for random problems.
TEST(QuadProg, SolutionsSatisfyKkt) {
  Generator gen(2);
  for (int trial = 0; trial < 200; ++trial) {
    const int m = 2 + trial % 6;
    const std::vector<double> a = randn({m, m + 1}, gen, DType::f64).to_vector();
    std::vector<double> G(static_cast<size_t>(m * m), 0.0);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < m; ++j)
        for (int k = 0; k <= m; ++k) G[static_cast<size_t>(i * m + j)] += a[static_cast<size_t>(i * (m + 1) + k)] * a[static_cast<size_t>(j * (m + 1) + k)];
    for (int i = 0; i < m; ++i) G[static_cast<size_t>(i * m + i)] += 1e-4;
    const std::vector<double> u = randn({m}, gen, DType::f64).to_vector();
    const std::vector<double> v = jd::solve_bounded_qp(G, m, u);
    for (int i = 0; i < m; ++i) {
      double lambda = 0.0;
      for (int k = 0; k < m; ++k) lambda += G[static_cast<size_t>(i * m + k)] * v[static_cast<size_t>(k)];
      EXPECT_GE(v[static_cast<size_t>(i)] - u[static_cast<size_t>(i)], -1e-12) << "feasible";
      EXPECT_GE(lambda, -1e-10) << "dual feasible";
      EXPECT_LE(std::fabs(lambda * (v[static_cast<size_t>(i)] - u[static_cast<size_t>(i)])), 1e-10) << "complementary";
    }
  }
}

}  // namespace
}  // namespace amp
