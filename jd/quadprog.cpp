#include "jd/quadprog.h"

#include <cmath>
#include <stdexcept>

namespace amp::jd {

namespace {

[[noreturn]] void fail() { throw std::runtime_error("Failed to solve the quadratic programming problem."); }

// Solves A x = b for the symmetric positive definite A (n × n, row-major) by Cholesky.
std::vector<double> cholesky_solve(std::vector<double> A, int n, std::vector<double> b) {
  for (int j = 0; j < n; ++j) {
    double d = A[static_cast<size_t>(j * n + j)];
    for (int k = 0; k < j; ++k) d -= A[static_cast<size_t>(j * n + k)] * A[static_cast<size_t>(j * n + k)];
    if (!(d > 0.0)) fail();
    const double l = std::sqrt(d);
    A[static_cast<size_t>(j * n + j)] = l;
    for (int i = j + 1; i < n; ++i) {
      double s = A[static_cast<size_t>(i * n + j)];
      for (int k = 0; k < j; ++k) s -= A[static_cast<size_t>(i * n + k)] * A[static_cast<size_t>(j * n + k)];
      A[static_cast<size_t>(i * n + j)] = s / l;
    }
  }
  for (int i = 0; i < n; ++i) {  // L y = b
    for (int k = 0; k < i; ++k) b[static_cast<size_t>(i)] -= A[static_cast<size_t>(i * n + k)] * b[static_cast<size_t>(k)];
    b[static_cast<size_t>(i)] /= A[static_cast<size_t>(i * n + i)];
  }
  for (int i = n - 1; i >= 0; --i) {  // Lᵀ x = y
    for (int k = i + 1; k < n; ++k) b[static_cast<size_t>(i)] -= A[static_cast<size_t>(k * n + i)] * b[static_cast<size_t>(k)];
    b[static_cast<size_t>(i)] /= A[static_cast<size_t>(i * n + i)];
  }
  return b;
}

}  // namespace

std::vector<double> solve_bounded_qp(const std::vector<double>& G, int m, const std::vector<double>& u) {
  auto g = [&](int i, int j) { return G[static_cast<size_t>(i * m + j)]; };
  std::vector<double> v = u;
  std::vector<bool> active(static_cast<size_t>(m), true);
  // Bounds released and met again at once (a multiplier that was negative only by rounding): not
  // released again until the iterate moves, which rules out cycling.
  std::vector<bool> bounced(static_cast<size_t>(m), false);
  int released = -1;
  bool at_face_minimum = true;  // every bound active: the face is the single point u
  for (int iter = 0; iter < 50 * m + 50; ++iter) {
    if (at_face_minimum) {
      // The multiplier of an active bound is its gradient component (G v)_j; optimal when none is < 0.
      int release = -1;
      double most_negative = 0.0;
      for (int j = 0; j < m; ++j) {
        if (!active[static_cast<size_t>(j)] || bounced[static_cast<size_t>(j)]) continue;
        double lambda = 0.0;
        for (int k = 0; k < m; ++k) lambda += g(j, k) * v[static_cast<size_t>(k)];
        if (lambda < most_negative) {
          most_negative = lambda;
          release = j;
        }
      }
      if (release < 0) return v;
      active[static_cast<size_t>(release)] = false;
      released = release;
      at_face_minimum = false;
      continue;
    }
    // The face's minimizer: G_FF x_F = -G_FA u_A.
    std::vector<int> free;
    for (int j = 0; j < m; ++j)
      if (!active[static_cast<size_t>(j)]) free.push_back(j);
    const int nf = static_cast<int>(free.size());
    std::vector<double> A(static_cast<size_t>(nf * nf)), b(static_cast<size_t>(nf), 0.0);
    for (int a = 0; a < nf; ++a) {
      for (int c = 0; c < nf; ++c) A[static_cast<size_t>(a * nf + c)] = g(free[static_cast<size_t>(a)], free[static_cast<size_t>(c)]);
      for (int j = 0; j < m; ++j)
        if (active[static_cast<size_t>(j)]) b[static_cast<size_t>(a)] -= g(free[static_cast<size_t>(a)], j) * u[static_cast<size_t>(j)];
    }
    const std::vector<double> target = cholesky_solve(A, nf, b);
    // Step towards it, stopping at the first bound in the way.
    double alpha = 1.0;
    int blocking = -1;
    for (int a = 0; a < nf; ++a) {
      const int j = free[static_cast<size_t>(a)];
      const double p = target[static_cast<size_t>(a)] - v[static_cast<size_t>(j)];
      if (p < 0.0) {
        const double t = (u[static_cast<size_t>(j)] - v[static_cast<size_t>(j)]) / p;
        if (t < alpha) {
          alpha = t;
          blocking = j;
        }
      }
    }
    for (int a = 0; a < nf; ++a) {
      const int j = free[static_cast<size_t>(a)];
      v[static_cast<size_t>(j)] = blocking < 0 ? target[static_cast<size_t>(a)]
                                               : v[static_cast<size_t>(j)] + alpha * (target[static_cast<size_t>(a)] - v[static_cast<size_t>(j)]);
    }
    if (blocking >= 0 && alpha <= 0.0 && blocking == released) {
      active[static_cast<size_t>(blocking)] = true;  // no progress: keep that bound, look at the others
      bounced[static_cast<size_t>(blocking)] = true;
      at_face_minimum = true;
      continue;
    }
    if (alpha > 0.0) bounced.assign(static_cast<size_t>(m), false);
    released = -1;
    if (blocking >= 0) {
      active[static_cast<size_t>(blocking)] = true;
      v[static_cast<size_t>(blocking)] = u[static_cast<size_t>(blocking)];
    } else {
      at_face_minimum = true;
    }
  }
  fail();
}

}  // namespace amp::jd
