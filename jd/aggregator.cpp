#include "jd/aggregator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "jd/gramian_math.h"
#include "jd/linalg.h"
#include "jd/quadprog.h"
#include "runtime/core/parse_number.h"
#include "runtime/ops/random.h"
#include "runtime/ops/ops.h"

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
  columns_ = J.shape()[1];
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

namespace {
double eps_of(DType dtype) {
  return dtype == DType::f32 ? static_cast<double>(std::numeric_limits<float>::epsilon()) : std::numeric_limits<double>::epsilon();
}
double g_at(const std::vector<double>& G, int m, int i, int j) { return G[static_cast<size_t>(i * m + j)]; }
}  // namespace

std::vector<double> Random::weights(const std::vector<double>&, int m, DType dtype) {
  Generator gen(seed_ + 0x9e3779b97f4a7c15ULL * ++calls_);
  const std::vector<double> r = randn({m}, gen, DType::f64).to_vector();
  const double top = *std::max_element(r.begin(), r.end());
  double total = 0.0;
  std::vector<double> w(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) total += w[static_cast<size_t>(i)] = std::exp(r[static_cast<size_t>(i)] - top);
  for (double& x : w) x = round_to(x / total, dtype);
  return w;
}

MGDA::MGDA(double epsilon, int max_iters) : epsilon_(epsilon), max_iters_(max_iters) {
  if (!(epsilon > 0.0)) throw std::invalid_argument("epsilon must be positive, but got " + std::to_string(epsilon) + ".");
  if (max_iters <= 0) throw std::invalid_argument("max_iters must be a positive integer, but got " + std::to_string(max_iters) + ".");
}

std::vector<double> MGDA::weights(const std::vector<double>& G, int m, DType dtype) {
  auto r = [dtype](double x) { return round_to(x, dtype); };
  std::vector<double> alpha(static_cast<size_t>(m), r(1.0 / m));
  for (int iter = 0; iter < max_iters_; ++iter) {
    std::vector<double> Ga = matvec(G, m, alpha);
    for (double& x : Ga) x = r(x);
    const int t = static_cast<int>(std::min_element(Ga.begin(), Ga.end()) - Ga.begin());  // first on ties
    double a = 0.0, b = 0.0;
    for (int i = 0; i < m; ++i) {
      a += alpha[static_cast<size_t>(i)] * g_at(G, m, i, t);
      b += alpha[static_cast<size_t>(i)] * Ga[static_cast<size_t>(i)];
    }
    a = r(a);
    b = r(b);
    const double c = g_at(G, m, t, t);
    const double gamma = c <= a ? 1.0 : b <= a ? 0.0 : r(r(b - a) / r(r(b + c) - r(2.0 * a)));
    for (int i = 0; i < m; ++i)
      alpha[static_cast<size_t>(i)] = r(r((1.0 - gamma) * alpha[static_cast<size_t>(i)]) + (i == t ? gamma : 0.0));
    if (gamma < epsilon_) break;
  }
  return alpha;
}

std::vector<double> PCGrad::weights(const std::vector<double>& G, int m, DType dtype) {
  Generator gen(seed_ + 0x9e3779b97f4a7c15ULL * ++calls_);
  std::vector<double> w(static_cast<size_t>(m), 0.0);
  for (int i = 0; i < m; ++i) {
    // A random order (Fisher-Yates over uniform draws).
    const std::vector<double> u = rand_uniform({m}, 0.0, 1.0, gen, DType::f64).to_vector();
    std::vector<int> perm(static_cast<size_t>(m));
    std::iota(perm.begin(), perm.end(), 0);
    for (int k = m - 1; k > 0; --k) {
      const int j = std::min(k, static_cast<int>(u[static_cast<size_t>(k)] * (k + 1)));
      std::swap(perm[static_cast<size_t>(k)], perm[static_cast<size_t>(j)]);
    }
    std::vector<double> cw(static_cast<size_t>(m), 0.0);
    cw[static_cast<size_t>(i)] = 1.0;
    for (int j : perm) {
      if (j == i) continue;
      double ip = 0.0;
      for (int k = 0; k < m; ++k) ip += g_at(G, m, j, k) * cw[static_cast<size_t>(k)];
      ip = round_to(ip, dtype);
      if (ip < 0.0) cw[static_cast<size_t>(j)] = round_to(cw[static_cast<size_t>(j)] - round_to(ip / g_at(G, m, j, j), dtype), dtype);
    }
    for (int k = 0; k < m; ++k) w[static_cast<size_t>(k)] = round_to(w[static_cast<size_t>(k)] + cw[static_cast<size_t>(k)], dtype);
  }
  return w;
}

std::vector<double> IMTLG::weights(const std::vector<double>& G, int m, DType dtype) {
  std::vector<double> d(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) d[static_cast<size_t>(i)] = round_to(std::sqrt(g_at(G, m, i, i)), dtype);
  std::vector<double> v = matvec(pinv_symmetric(G, m, m * eps_of(dtype)), m, d);
  double s = 0.0;
  for (double& x : v) s += x = round_to(x, dtype);
  s = round_to(s, dtype);
  std::vector<double> w(static_cast<size_t>(m), 0.0);
  if (std::fabs(s) >= 1e-12)
    for (int i = 0; i < m; ++i) w[static_cast<size_t>(i)] = round_to(v[static_cast<size_t>(i)] / s, dtype);
  return w;
}

AlignedMTL::AlignedMTL(std::vector<double> pref_vector, std::string scale_mode)
    : pref_(std::move(pref_vector)), scale_mode_(std::move(scale_mode)) {
  if (scale_mode_ != "min" && scale_mode_ != "median" && scale_mode_ != "rmse")
    throw std::invalid_argument("Invalid scale_mode='" + scale_mode_ + "'. Expected 'min', 'median', or 'rmse'.");
}

std::vector<double> AlignedMTL::weights(const std::vector<double>& G, int m, DType dtype) {
  const std::vector<double> w = preference(pref_, m, dtype);
  std::vector<double> upper(static_cast<size_t>(m * m));  // eigh(UPLO="U")
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) upper[static_cast<size_t>(i * m + j)] = g_at(G, m, std::min(i, j), std::max(i, j));
  std::vector<double> lam, V;
  symmetric_eigen(upper, m, &lam, &V);
  // Eigenvalues at or below max · m · eps(dtype) count as zero (TorchJD's fixtures say G's dtype).
  const double tol = *std::max_element(lam.begin(), lam.end()) * m * eps_of(dtype);
  std::vector<int> kept;  // descending eigenvalues above tol
  for (int k = m - 1; k >= 0; --k)
    if (lam[static_cast<size_t>(k)] > tol) kept.push_back(k);
  if (kept.empty()) return w;  // B = I
  std::vector<double> vals;
  for (int k : kept) vals.push_back(lam[static_cast<size_t>(k)]);
  double scale = vals.back();
  if (scale_mode_ == "median") {
    std::vector<double> sorted = vals;
    std::sort(sorted.begin(), sorted.end());
    scale = sorted[(sorted.size() - 1) / 2];  // torch.median: the lower middle value
  } else if (scale_mode_ == "rmse") {
    scale = std::accumulate(vals.begin(), vals.end(), 0.0) / static_cast<double>(vals.size());
  }
  // alpha = B w with B = sqrt(scale) V diag(1 / sqrt(lam)) Vᵀ over the kept eigenpairs.
  std::vector<double> alpha(static_cast<size_t>(m), 0.0);
  for (int k : kept) {
    double proj = 0.0;
    for (int j = 0; j < m; ++j) proj += V[static_cast<size_t>(j * m + k)] * w[static_cast<size_t>(j)];
    const double f = std::sqrt(scale) / std::sqrt(lam[static_cast<size_t>(k)]) * proj;
    for (int i = 0; i < m; ++i) alpha[static_cast<size_t>(i)] += f * V[static_cast<size_t>(i * m + k)];
  }
  for (double& x : alpha) x = round_to(x, dtype);
  return alpha;
}

Krum::Krum(int n_byzantine, int n_selected) : f_(n_byzantine), k_(n_selected) {
  if (n_byzantine < 0) throw std::invalid_argument("n_byzantine must be non-negative, but got " + std::to_string(n_byzantine) + ".");
  if (n_selected < 1) throw std::invalid_argument("n_selected must be a positive integer, but got " + std::to_string(n_selected) + ".");
}

std::vector<double> Krum::weights(const std::vector<double>& G, int m, DType dtype) {
  if (m < f_ + 3)
    throw std::invalid_argument("Parameter `gramian` should have at least " + std::to_string(f_ + 3) +
                                " rows (n_byzantine + 3). Found `gramian` with " + std::to_string(m) + " rows.");
  if (m < k_)
    throw std::invalid_argument("Parameter `gramian` should have at least " + std::to_string(k_) +
                                " rows (n_selected). Found `gramian` with " + std::to_string(m) + " rows.");
  const int nc = static_cast<int>(m - f_ - 2);  // m >= f_ + 3
  std::vector<double> scores(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) {
    std::vector<double> d(static_cast<size_t>(m));
    for (int j = 0; j < m; ++j)
      d[static_cast<size_t>(j)] = round_to(std::sqrt(round_to(round_to(g_at(G, m, j, j) + g_at(G, m, i, i), dtype) - round_to(2.0 * g_at(G, m, i, j), dtype), dtype)), dtype);
    std::sort(d.begin(), d.end());
    double s = 0.0;
    for (int k = 1; k <= nc; ++k) s = round_to(s + d[static_cast<size_t>(k)], dtype);  // the smallest (itself) dropped
    scores[static_cast<size_t>(i)] = s;
  }
  std::vector<int> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return scores[static_cast<size_t>(a)] < scores[static_cast<size_t>(b)]; });
  std::vector<double> w(static_cast<size_t>(m), 0.0);
  for (int k = 0; k < k_; ++k) w[static_cast<size_t>(order[static_cast<size_t>(k)])] = round_to(1.0 / k_, dtype);
  return w;
}

namespace {
void check_matrix(const Tensor& J, const std::string& who) {
  if (J.dim() != 2 || !is_floating(J.dtype()))
    throw std::invalid_argument(who + ": Parameter `matrix` should be a tensor of dimension 2. Found `matrix.shape = " +
                                shape_str(J.shape()) + "`.");
}
}  // namespace

Tensor GradDrop::operator()(const Tensor& J) {
  check_matrix(J, name());
  const int64_t m = J.shape()[0], n = J.shape()[1];
  const DType dt = J.dtype();
  std::vector<double> leak = leak_.empty() ? std::vector<double>(static_cast<size_t>(m), 0.0) : leak_;
  if (static_cast<int64_t>(leak.size()) != m)
    throw std::invalid_argument("Parameter `matrix` should be a matrix of exactly " + std::to_string(leak.size()) +
                                " rows (i.e. the number of leak scalars). Found `matrix` of shape `" + shape_str(J.shape()) + "`.");
  last_weights_.clear();
  if (m == 0 || n == 0) return zeros({n}, dt, J.device());
  const std::vector<double> v = J.to_vector();
  Generator gen(seed_ + 0x9e3779b97f4a7c15ULL * ++calls_);
  const std::vector<double> U = rand_uniform({n}, 0.0, 1.0, gen, DType::f64).to_vector();
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  for (int64_t k = 0; k < n; ++k) {
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      sum = round_to(sum + v[static_cast<size_t>(i * n + k)], dt);
      abs_sum = round_to(abs_sum + std::fabs(v[static_cast<size_t>(i * n + k)]), dt);
    }
    const double P = round_to(0.5 * round_to(1.0 + round_to(sum / abs_sum, dt), dt), dt);  // NaN for an all-zero column
    const double u = round_to(U[static_cast<size_t>(k)], dt);
    for (int64_t i = 0; i < m; ++i) {
      const double x = v[static_cast<size_t>(i * n + k)];
      const bool keep = (P > u && x > 0.0) || (P < u && x < 0.0);
      const double l = round_to(leak[static_cast<size_t>(i)], dt);
      const double factor = round_to(l + round_to((1.0 - l) * (keep ? 1.0 : 0.0), dt), dt);
      out[static_cast<size_t>(k)] = round_to(out[static_cast<size_t>(k)] + round_to(factor * x, dt), dt);
    }
  }
  return from_vector(out, {n}, dt, J.device());
}

Tensor ConFIG::operator()(const Tensor& J) {
  check_matrix(J, name());
  const int m = static_cast<int>(J.shape()[0]);
  if (m == 0) throw std::invalid_argument(name() + ": the matrix has no rows");  // TorchJD's stack of no rows raises
  const int64_t n = J.shape()[1];
  const DType dt = J.dtype();
  last_weights_.clear();
  const std::vector<double> w = pref_.empty() ? std::vector<double>(static_cast<size_t>(m), 1.0) : preference(pref_, m, dt);
  const std::vector<double> rows = J.to_vector();
  // Columns of A = Uᵀ: the unit rows (a zero row stays zero, as nan_to_num makes it).
  std::vector<std::vector<double>> a(static_cast<size_t>(m), std::vector<double>(static_cast<size_t>(n)));
  for (int i = 0; i < m; ++i) {
    double sq = 0.0;
    for (int64_t k = 0; k < n; ++k) sq += rows[static_cast<size_t>(i * n + k)] * rows[static_cast<size_t>(i * n + k)];
    const double norm = std::sqrt(sq);
    for (int64_t k = 0; k < n; ++k) a[static_cast<size_t>(i)][static_cast<size_t>(k)] = norm > 0.0 ? rows[static_cast<size_t>(i * n + k)] / norm : 0.0;
  }
  // One-sided Jacobi: rotate pairs of columns until all are orthogonal; A V = W Σ.
  std::vector<double> V(static_cast<size_t>(m * m), 0.0);
  for (int i = 0; i < m; ++i) V[static_cast<size_t>(i * m + i)] = 1.0;
  auto dot = [n](const std::vector<double>& x, const std::vector<double>& y) {
    double s = 0.0;
    for (int64_t k = 0; k < n; ++k) s += x[static_cast<size_t>(k)] * y[static_cast<size_t>(k)];
    return s;
  };
  for (int sweep = 0; sweep < 60; ++sweep) {
    bool rotated = false;
    for (int p = 0; p < m; ++p)
      for (int q = p + 1; q < m; ++q) {
        const double alpha = dot(a[static_cast<size_t>(p)], a[static_cast<size_t>(p)]);
        const double beta = dot(a[static_cast<size_t>(q)], a[static_cast<size_t>(q)]);
        const double gamma = dot(a[static_cast<size_t>(p)], a[static_cast<size_t>(q)]);
        if (std::fabs(gamma) <= std::numeric_limits<double>::epsilon() * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const double zeta = (beta - alpha) / (2.0 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::fabs(zeta) + std::sqrt(1.0 + zeta * zeta));
        const double c = 1.0 / std::sqrt(1.0 + t * t), s = c * t;
        for (int64_t k = 0; k < n; ++k) {
          const double x = a[static_cast<size_t>(p)][static_cast<size_t>(k)], y = a[static_cast<size_t>(q)][static_cast<size_t>(k)];
          a[static_cast<size_t>(p)][static_cast<size_t>(k)] = c * x - s * y;
          a[static_cast<size_t>(q)][static_cast<size_t>(k)] = s * x + c * y;
        }
        for (int k = 0; k < m; ++k) {
          const double x = V[static_cast<size_t>(k * m + p)], y = V[static_cast<size_t>(k * m + q)];
          V[static_cast<size_t>(k * m + p)] = c * x - s * y;
          V[static_cast<size_t>(k * m + q)] = s * x + c * y;
        }
      }
    if (!rotated) break;
  }
  std::vector<double> sigma(static_cast<size_t>(m));
  for (int j = 0; j < m; ++j) sigma[static_cast<size_t>(j)] = std::sqrt(dot(a[static_cast<size_t>(j)], a[static_cast<size_t>(j)]));
  const double largest = *std::max_element(sigma.begin(), sigma.end());
  const double cutoff = static_cast<double>(std::max<int64_t>(m, n)) * eps_of(dt) * largest;  // torch.linalg.pinv's rtol
  // best = pinv(U) w = Σ_j (A V)_j (Vᵀ w)_j / σ_j² over the kept singular values.
  std::vector<double> best(static_cast<size_t>(n), 0.0);
  for (int j = 0; j < m; ++j) {
    const double s = sigma[static_cast<size_t>(j)];
    if (!(s > cutoff)) continue;
    double vw = 0.0;
    for (int i = 0; i < m; ++i) vw += V[static_cast<size_t>(i * m + j)] * w[static_cast<size_t>(i)];
    for (int64_t k = 0; k < n; ++k) best[static_cast<size_t>(k)] += a[static_cast<size_t>(j)][static_cast<size_t>(k)] * vw / (s * s);
  }
  const double nb = std::max(std::sqrt(dot(best, best)), 1e-12);  // F.normalize
  double length = 0.0;                                              // sum(J @ u)
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < n; ++k) length += rows[static_cast<size_t>(i * n + k)] * best[static_cast<size_t>(k)] / nb;
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) out[static_cast<size_t>(k)] = round_to(length * best[static_cast<size_t>(k)] / nb, dt);
  return from_vector(out, {n}, dt, J.device());
}

TrimmedMean::TrimmedMean(int trim_number) : trim_(trim_number) {
  if (trim_number < 0)
    throw std::invalid_argument("Parameter `trim_number` should be a non-negative integer. Found `trim_number` = `" +
                                std::to_string(trim_number) + "`.");
}

Tensor TrimmedMean::operator()(const Tensor& J) {
  check_matrix(J, name());
  const int64_t m = J.shape()[0], n = J.shape()[1];
  if (m < 2 * trim_ + 1)
    throw std::invalid_argument("Parameter `matrix` should be a matrix of at least " + std::to_string(2 * trim_ + 1) +
                                " rows (i.e. `2 * trim_number + 1`). Found `matrix` of shape `" + shape_str(J.shape()) + "`.");
  last_weights_.clear();
  const std::vector<double> v = J.to_vector();
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<double> col(static_cast<size_t>(m));
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t i = 0; i < m; ++i) col[static_cast<size_t>(i)] = v[static_cast<size_t>(i * n + k)];
    // torch.sort's order: NaN after every number (std::sort's < on a NaN is no order at all).
    std::sort(col.begin(), col.end(), [](double a, double b) { return std::isnan(b) ? !std::isnan(a) : a < b; });
    double s = 0.0;
    for (int64_t i = trim_; i < m - trim_; ++i) s = round_to(s + col[static_cast<size_t>(i)], J.dtype());
    out[static_cast<size_t>(k)] = round_to(s / static_cast<double>(m - 2 * trim_), J.dtype());
  }
  return from_vector(out, {n}, J.dtype(), J.device());
}

std::vector<std::string> aggregator_names() {
  return {"upgrad", "mean", "sum", "random", "dualproj", "mgda", "pcgrad", "imtlg", "alignedmtl", "config", "graddrop",
          "trimmedmean[:T]", "krum[:F[:K]]", "constant:W1,W2,..."};
}

std::unique_ptr<Aggregator> make_aggregator(const std::string& spec, uint64_t seed) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  std::vector<std::string> args;
  if (colon != std::string::npos) {
    std::string rest = spec.substr(colon + 1);
    size_t start = 0;
    while (true) {
      const size_t next = rest.find_first_of(":,", start);
      args.push_back(rest.substr(start, next == std::string::npos ? std::string::npos : next - start));
      if (next == std::string::npos) break;
      start = next + 1;
    }
  }
  // Each argument as written (runtime/core/parse_number.h): digits (and a sign, a point, an exponent
  // for a weight), nothing else. what: the argument's meaning, for the message; lo: its least value.
  auto integer = [&](size_t i, int fallback, const char* what, int lo) {
    if (i >= args.size()) return fallback;
    const ParsedInteger p = parse_integer(args[i]);
    if (p.error == NumberError::out_of_range || (p.error == NumberError::none && p.value > INT_MAX))
      throw std::invalid_argument("aggregator '" + spec + "': '" + args[i] + "' is out of range (at most 2147483647)");
    if (p.error != NumberError::none) throw std::invalid_argument("aggregator '" + spec + "': '" + args[i] + "' is not an integer");
    const int v = p.value < INT_MIN ? INT_MIN : static_cast<int>(p.value);
    if (v < lo)
      throw std::invalid_argument("aggregator '" + spec + "': " + what + " must be " + (lo == 0 ? "0 or more" : "1 or more") +
                                  ", got " + args[i]);
    return v;
  };
  auto no_args = [&] {
    if (!args.empty()) throw std::invalid_argument("aggregator '" + name + "' takes no arguments, got '" + spec + "'");
  };
  if (name == "upgrad") { no_args(); return std::make_unique<UPGrad>(); }
  if (name == "mean") { no_args(); return std::make_unique<Mean>(); }
  if (name == "sum") { no_args(); return std::make_unique<Sum>(); }
  if (name == "random") { no_args(); return std::make_unique<Random>(seed); }
  if (name == "dualproj") { no_args(); return std::make_unique<DualProj>(); }
  if (name == "mgda") { no_args(); return std::make_unique<MGDA>(); }
  if (name == "pcgrad") { no_args(); return std::make_unique<PCGrad>(seed); }
  if (name == "imtlg") { no_args(); return std::make_unique<IMTLG>(); }
  if (name == "alignedmtl") { no_args(); return std::make_unique<AlignedMTL>(); }
  if (name == "config") { no_args(); return std::make_unique<ConFIG>(); }
  if (name == "graddrop") { no_args(); return std::make_unique<GradDrop>(std::vector<double>{}, seed); }
  if (name == "trimmedmean") {
    if (args.size() > 1) throw std::invalid_argument("aggregator 'trimmedmean:T' takes one argument, got '" + spec + "'");
    return std::make_unique<TrimmedMean>(integer(0, 1, "T (the values trimmed at each end of a column)", 0));
  }
  if (name == "krum") {
    if (args.size() > 2) throw std::invalid_argument("aggregator 'krum:F:K' takes at most two arguments, got '" + spec + "'");
    return std::make_unique<Krum>(integer(0, 1, "F (the rows taken as byzantine)", 0),
                                  integer(1, 1, "K (the rows selected)", 1));
  }
  if (name == "constant") {
    std::vector<double> w;
    for (const std::string& a : args) {
      const ParsedReal p = parse_real(a);
      const double v = p.value;
      // The weights scale J's rows in float32: one beyond its range would be inf there, and one below
      // its smallest normal number 0 or a subnormal (1e-50 was taken as 0).
      if (p.error != NumberError::none || std::fabs(v) > std::numeric_limits<float>::max() ||
          (v != 0.0 && std::fabs(v) < std::numeric_limits<float>::min()))
        throw std::invalid_argument("aggregator '" + spec + "': '" + a +
                                    "' is not a decimal number in float32's range (0, or 1.2e-38 <= |w| <= 3.4e38)");
      w.push_back(v);
    }
    if (w.empty()) throw std::invalid_argument("aggregator 'constant' needs its weights: constant:W1,W2,...");
    return std::make_unique<Constant>(w);
  }
  std::string valid;
  for (const std::string& n : aggregator_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown aggregator '" + spec + "' (valid: " + valid + ")");
}

}  // namespace amp::jd
