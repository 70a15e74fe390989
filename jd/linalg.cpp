#include "jd/linalg.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace amp::jd {

void symmetric_eigen(const std::vector<double>& A_in, int m, std::vector<double>* values, std::vector<double>* vectors) {
  std::vector<double> A = A_in, V(static_cast<size_t>(m * m), 0.0);
  auto a = [&](int i, int j) -> double& { return A[static_cast<size_t>(i * m + j)]; };
  auto v = [&](int i, int j) -> double& { return V[static_cast<size_t>(i * m + j)]; };
  for (int i = 0; i < m; ++i) v(i, i) = 1.0;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0;
    for (int i = 0; i < m; ++i)
      for (int j = i + 1; j < m; ++j) off += a(i, j) * a(i, j);
    if (off == 0.0) break;
    for (int p = 0; p < m; ++p)
      for (int q = p + 1; q < m; ++q) {
        if (a(p, q) == 0.0) continue;
        // The rotation that zeroes a(p, q) (Golub and Van Loan, the symmetric Schur decomposition).
        const double theta = (a(q, q) - a(p, p)) / (2.0 * a(p, q));
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int k = 0; k < m; ++k) {  // A <- A J
          const double akp = a(k, p), akq = a(k, q);
          a(k, p) = c * akp - s * akq;
          a(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < m; ++k) {  // A <- Jᵀ A
          const double apk = a(p, k), aqk = a(q, k);
          a(p, k) = c * apk - s * aqk;
          a(q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < m; ++k) {  // V <- V J
          const double vkp = v(k, p), vkq = v(k, q);
          v(k, p) = c * vkp - s * vkq;
          v(k, q) = s * vkp + c * vkq;
        }
      }
  }
  std::vector<int> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return a(x, x) < a(y, y); });
  values->assign(static_cast<size_t>(m), 0.0);
  vectors->assign(static_cast<size_t>(m * m), 0.0);
  for (int j = 0; j < m; ++j) {
    (*values)[static_cast<size_t>(j)] = a(order[static_cast<size_t>(j)], order[static_cast<size_t>(j)]);
    for (int i = 0; i < m; ++i) (*vectors)[static_cast<size_t>(i * m + j)] = v(i, order[static_cast<size_t>(j)]);
  }
}

std::vector<double> pinv_symmetric(const std::vector<double>& A, int m, double rtol) {
  std::vector<double> lam, V;
  symmetric_eigen(A, m, &lam, &V);
  double largest = 0.0;
  for (double l : lam) largest = std::max(largest, std::fabs(l));
  std::vector<double> out(static_cast<size_t>(m * m), 0.0);
  for (int k = 0; k < m; ++k) {
    const double l = lam[static_cast<size_t>(k)];
    if (!(std::fabs(l) > rtol * largest)) continue;
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < m; ++j)
        out[static_cast<size_t>(i * m + j)] += V[static_cast<size_t>(i * m + k)] * V[static_cast<size_t>(j * m + k)] / l;
  }
  return out;
}

std::vector<double> matvec(const std::vector<double>& A, int m, const std::vector<double>& x) {
  std::vector<double> y(static_cast<size_t>(m), 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) y[static_cast<size_t>(i)] += A[static_cast<size_t>(i * m + j)] * x[static_cast<size_t>(j)];
  return y;
}

}  // namespace amp::jd
