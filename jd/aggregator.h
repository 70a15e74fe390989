// Aggregators of Jacobian descent, with TorchJD's names, defaults and numbers: each turns a Jacobian
// J [m, n] (one row per loss) into one update direction [n].
//
// The Gramian-weighted ones (UPGrad, Mean, Sum, Constant, Random, DualProj, MGDA, IMTLG, AlignedMTL,
// PCGrad) compute weights w [m] from the Gramian G = J Jᵀ alone and return w @ J; the Gramian is
// computed once per call, on J's device and in J's dtype, and read on the host (m × m numbers).
// Steps TorchJD takes in J's dtype are rounded to it here too; its quadratic programs run in float64.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp::jd {

class Aggregator {
 public:
  virtual ~Aggregator() = default;
  // J: [m, n], floating. Returns [n] in J's dtype, on J's device.
  virtual Tensor operator()(const Tensor& J) = 0;
  virtual std::string name() const = 0;
  // The count of rows (tasks) it takes, as numbers: a caller can refuse another count in its own terms
  // before aggregating anything (operator() refuses it with TorchJD's words).
  virtual int64_t min_rows() const { return 1; }
  virtual int64_t max_rows() const { return std::numeric_limits<int64_t>::max(); }
  // The weights of the last call, for aggregators that have them (empty otherwise).
  const std::vector<double>& last_weights() const { return last_weights_; }
  // The calls made so far. A seeded aggregator's draws (Random, PCGrad, GradDrop) are counter n of
  // its stream at call n, so a resumed run restores this to draw what the uninterrupted run would.
  uint64_t calls() const { return calls_; }
  void set_calls(uint64_t calls) { calls_ = calls; }

 protected:
  std::vector<double> last_weights_;
  uint64_t calls_ = 0;  // counted by the aggregators that draw
};

// Weights from the Gramian: G is m × m row-major, with the values of J's dtype; the weights are
// returned as values of that dtype.
class GramianWeightedAggregator : public Aggregator {
 public:
  Tensor operator()(const Tensor& J) override;
  virtual std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) = 0;

 protected:
  int64_t columns_ = 0;  // n of the J being aggregated
};

class Mean final : public GramianWeightedAggregator {
 public:
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "Mean"; }
};

class Sum final : public GramianWeightedAggregator {
 public:
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "Sum"; }
};

class Constant final : public GramianWeightedAggregator {
 public:
  explicit Constant(std::vector<double> weights);
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "Constant"; }
  int64_t min_rows() const override { return static_cast<int64_t>(w_.size()); }  // one weight a row
  int64_t max_rows() const override { return static_cast<int64_t>(w_.size()); }

 private:
  std::vector<double> w_;
};

// UPGrad: each row projected onto the dual cone of the rows, the projections summed (weights from
// one QP per row on the normalized, regularized Gramian). pref_vector empty: 1/m each.
class UPGrad final : public GramianWeightedAggregator {
 public:
  explicit UPGrad(std::vector<double> pref_vector = {}, double norm_eps = 1e-4, double reg_eps = 1e-4);
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "UPGrad"; }

 private:
  std::vector<double> pref_;
  double norm_eps_, reg_eps_;
};

// DualProj: the preferred combination pᵀJ projected onto the dual cone of the rows (one QP).
class DualProj final : public GramianWeightedAggregator {
 public:
  explicit DualProj(std::vector<double> pref_vector = {}, double norm_eps = 1e-4, double reg_eps = 1e-4);
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "DualProj"; }

 private:
  std::vector<double> pref_;
  double norm_eps_, reg_eps_;
};

// Random: softmax of standard normal weights, drawn afresh at every call (from this runtime's
// counter-based generator, seeded: reproducible, but not PyTorch's stream).
class Random final : public GramianWeightedAggregator {
 public:
  explicit Random(uint64_t seed = 0) : seed_(seed) {}
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "Random"; }

 private:
  uint64_t seed_;
};

// MGDA: the min-norm point of the rows' convex hull, by Frank-Wolfe on the Gramian.
class MGDA final : public GramianWeightedAggregator {
 public:
  explicit MGDA(double epsilon = 1e-3, int max_iters = 100);
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "MGDA"; }

 private:
  double epsilon_;
  int max_iters_;
};

// PCGrad: each row, projected in a random order off the rows it conflicts with; the results summed.
class PCGrad final : public GramianWeightedAggregator {
 public:
  explicit PCGrad(uint64_t seed = 0) : seed_(seed) {}
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "PCGrad"; }

 private:
  uint64_t seed_;
};

// IMTL-G: equal projections of the aggregate onto every row (pinv(G) times the row norms, normalized).
class IMTLG final : public GramianWeightedAggregator {
 public:
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "IMTLG"; }
};

// Aligned-MTL: the rows' singular values aligned (scale_mode min, median or rmse), then the
// preference weights.
class AlignedMTL final : public GramianWeightedAggregator {
 public:
  explicit AlignedMTL(std::vector<double> pref_vector = {}, std::string scale_mode = "min");
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "AlignedMTL"; }

 private:
  std::vector<double> pref_;
  std::string scale_mode_;
};

// ConFIG: the direction with equal cosines to every row (pinv of the unit rows times the
// preference, all ones by default), scaled by the sum of the rows' projections on it. Works on J
// itself (on the host, float64, the pseudo-inverse from a one-sided Jacobi SVD of the unit rows).
class ConFIG final : public Aggregator {
 public:
  explicit ConFIG(std::vector<double> pref_vector = {}) : pref_(std::move(pref_vector)) {}
  Tensor operator()(const Tensor& J) override;
  std::string name() const override { return "ConFIG"; }

 private:
  std::vector<double> pref_;
};

// Krum: the n_selected rows whose n - n_byzantine - 2 nearest rows are closest, averaged.
class Krum final : public GramianWeightedAggregator {
 public:
  explicit Krum(int n_byzantine, int n_selected = 1);
  std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) override;
  std::string name() const override { return "Krum"; }
  int64_t min_rows() const override { return std::max(f_ + 3, k_); }  // weights()' two checks

 private:
  int64_t f_, k_;  // 64 bits: f_ + 3 wrapped in an int (krum:2147483647:1 passed every check)
};

// GradDrop: per coordinate, keeps the rows whose sign wins a draw weighted by the sign purity.
// Works on J itself (on the host), with one uniform draw per column from the seeded generator.
class GradDrop final : public Aggregator {
 public:
  explicit GradDrop(std::vector<double> leak = {}, uint64_t seed = 0) : leak_(std::move(leak)), seed_(seed) {}
  Tensor operator()(const Tensor& J) override;
  std::string name() const override { return "GradDrop"; }

 private:
  std::vector<double> leak_;
  uint64_t seed_;
};

// TrimmedMean: per coordinate, the mean without the trim_number smallest and largest values.
class TrimmedMean final : public Aggregator {
 public:
  explicit TrimmedMean(int trim_number);
  Tensor operator()(const Tensor& J) override;
  std::string name() const override { return "TrimmedMean"; }
  int64_t min_rows() const override { return 2 * static_cast<int64_t>(trim_) + 1; }

 private:
  int trim_;
};

// By name, with TorchJD's defaults (for the CLI): upgrad, mean, sum, random, dualproj, mgda, pcgrad,
// imtlg, alignedmtl, config, graddrop; trimmedmean:T, krum:F[:K] and constant:W1,W2,... take their
// arguments after colons (trimmedmean and krum default to 1). Throws std::invalid_argument naming
// the valid choices.
std::unique_ptr<Aggregator> make_aggregator(const std::string& name, uint64_t seed = 0);
std::vector<std::string> aggregator_names();

}  // namespace amp::jd
