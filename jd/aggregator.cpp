#include "jd/aggregator.h"

#include <cmath>
#include <stdexcept>

#include "jd/gramian_math.h"
#include "jd/quadprog.h"
#include "runtime/ops.h"

namespace amp::jd {

std::vector<double> regularized_gramian(const std::vector<double>& G, int m, DType dtype, double norm_eps, double reg_eps) {
  double t = 0.0;
  for (int i = 0; i < m; ++i) t = round_to(t + G[static_cast<size_t>(i * m + i)], dtype);
  const bool zero = t < norm_eps;
  std::vector<double> out(static_cast<size_t>(m * m));
  const double reg = round_to(reg_eps, dtype);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      // quadprog reads [min(i,j), max(i,j)]: the upper triangle, mirrored.
      const double g = G[static_cast<size_t>(std::min(i, j) * m + std::max(i, j))];
      const double normalized = zero ? 0.0 : round_to(g / t, dtype);
      out[static_cast<size_t>(i * m + j)] = i == j ? round_to(normalized + reg, dtype) : normalized;
    }
  return out;
}

bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

std::vector<double> preference(const std::vector<double>& p, int m, DType dtype) {
  if (p.empty()) return std::vector<double>(static_cast<size_t>(m), round_to(1.0 / m, dtype));
  if (static_cast<int>(p.size()) != m)
    throw std::invalid_argument("Parameter `pref_vector` should be a vector of length " + std::to_string(m) +
                                " (the number of rows of the matrix), got length " + std::to_string(p.size()));
  std::vector<double> out;
  for (double x : p) out.push_back(round_to(x, dtype));
  return out;
}

Tensor GramianWeightedAggregator::operator()(const Tensor& J) {
  if (J.dim() != 2 || !is_floating(J.dtype()) || J.dtype() == DType::f16 || J.dtype() == DType::bf16)
    throw std::invalid_argument(name() + ": expected a float32 or float64 matrix [m, n], got " + shape_str(J.shape()) +
                                " " + dtype_name(J.dtype()));
  const int m = static_cast<int>(J.shape()[0]);
  if (m == 0) throw std::invalid_argument(name() + ": the matrix has no rows");
  const std::vector<double> G = mm(J.detach(), J.detach(), false, true).to_vector();
  last_weights_ = weights(G, m, J.dtype());
  // w @ J as a sum of scaled rows, each product rounded before it is added (no FMA): rows that
  // cancel (g and -g with equal weights) give exactly 0, as TorchJD's do.
  const int64_t n = J.shape()[1];
  const Tensor rows = J.detach();
  Tensor out = mul(rows.view(0, {n}), last_weights_[0]);
  for (int i = 1; i < m; ++i) out = add(out, mul(rows.view(i * n, {n}), last_weights_[static_cast<size_t>(i)]));
  return out;
}

std::vector<double> Mean::weights(const std::vector<double>&, int m, DType dtype) {
  return std::vector<double>(static_cast<size_t>(m), round_to(1.0 / m, dtype));
}

std::vector<double> Sum::weights(const std::vector<double>&, int m, DType) {
  return std::vector<double>(static_cast<size_t>(m), 1.0);
}

Constant::Constant(std::vector<double> weights) : w_(std::move(weights)) {
  if (w_.empty()) throw std::invalid_argument("Constant: weights must be non-empty");
}

std::vector<double> Constant::weights(const std::vector<double>&, int m, DType dtype) {
  if (static_cast<int>(w_.size()) != m)
    throw std::invalid_argument("Parameter `matrix` should have " + std::to_string(w_.size()) +
                                " rows (the number of weights). Found `matrix` with " + std::to_string(m) + " rows.");
  std::vector<double> out;
  for (double x : w_) out.push_back(round_to(x, dtype));
  return out;
}

UPGrad::UPGrad(std::vector<double> pref_vector, double norm_eps, double reg_eps)
    : pref_(std::move(pref_vector)), norm_eps_(norm_eps), reg_eps_(reg_eps) {}

std::vector<double> UPGrad::weights(const std::vector<double>& G, int m, DType dtype) {
  const std::vector<double> p = preference(pref_, m, dtype);
  const std::vector<double> Gt = regularized_gramian(G, m, dtype, norm_eps_, reg_eps_);
  if (!all_finite(Gt)) return std::vector<double>(static_cast<size_t>(m), NAN);  // TorchJD: NaN, no error
  // One QP per row (u = p_i e_i); the solutions, cast to dtype, summed over rows in dtype.
  std::vector<double> w(static_cast<size_t>(m), 0.0);
  for (int i = 0; i < m; ++i) {
    std::vector<double> u(static_cast<size_t>(m), 0.0);
    u[static_cast<size_t>(i)] = p[static_cast<size_t>(i)];
    const std::vector<double> v = solve_bounded_qp(Gt, m, u);
    for (int j = 0; j < m; ++j)
      w[static_cast<size_t>(j)] = round_to(w[static_cast<size_t>(j)] + round_to(v[static_cast<size_t>(j)], dtype), dtype);
  }
  return w;
}

DualProj::DualProj(std::vector<double> pref_vector, double norm_eps, double reg_eps)
    : pref_(std::move(pref_vector)), norm_eps_(norm_eps), reg_eps_(reg_eps) {}

std::vector<double> DualProj::weights(const std::vector<double>& G, int m, DType dtype) {
  const std::vector<double> Gt = regularized_gramian(G, m, dtype, norm_eps_, reg_eps_);
  if (!all_finite(Gt)) return std::vector<double>(static_cast<size_t>(m), NAN);
  const std::vector<double> v = solve_bounded_qp(Gt, m, preference(pref_, m, dtype));
  std::vector<double> w;
  for (double x : v) w.push_back(round_to(x, dtype));
  return w;
}

}  // namespace amp::jd
