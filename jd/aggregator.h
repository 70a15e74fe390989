// Aggregators of Jacobian descent, with TorchJD's names, defaults and numbers: each turns a Jacobian
// J [m, n] (one row per loss) into one update direction [n].
//
// The Gramian-weighted ones (UPGrad, Mean, Sum, Constant, Random, DualProj, MGDA, IMTLG, AlignedMTL,
// PCGrad) compute weights w [m] from the Gramian G = J Jᵀ alone and return w @ J; the Gramian is
// computed once per call, on J's device and in J's dtype, and read on the host (m × m numbers).
// Steps TorchJD takes in J's dtype are rounded to it here too; its quadratic programs run in float64.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace amp::jd {

class Aggregator {
 public:
  virtual ~Aggregator() = default;
  // J: [m, n], floating. Returns [n] in J's dtype, on J's device.
  virtual Tensor operator()(const Tensor& J) = 0;
  virtual std::string name() const = 0;
  // The weights of the last call, for aggregators that have them (empty otherwise).
  const std::vector<double>& last_weights() const { return last_weights_; }

 protected:
  std::vector<double> last_weights_;
};

// Weights from the Gramian: G is m × m row-major, with the values of J's dtype; the weights are
// returned as values of that dtype.
class GramianWeightedAggregator : public Aggregator {
 public:
  Tensor operator()(const Tensor& J) override;
  virtual std::vector<double> weights(const std::vector<double>& G, int m, DType dtype) = 0;
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

// By name, with TorchJD's defaults (for the CLI): upgrad, mean, sum, dualproj, ... Throws
// std::invalid_argument naming the valid choices.
std::unique_ptr<Aggregator> make_aggregator(const std::string& name, uint64_t seed = 0);
std::vector<std::string> aggregator_names();

}  // namespace amp::jd
