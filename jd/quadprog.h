// The quadratic programs of Jacobian descent: minimize vᵀ G v subject to v ≥ u (componentwise), for a
// small symmetric positive definite G (m × m, m = the number of tasks), in float64.
//
// A primal active-set method on the bounds: start at v = u with every bound active, release the
// bound with the most negative multiplier, move to the minimizer of the current face or stop at the
// first bound met, and repeat. It terminates after finitely many exact steps and has no tolerance
// (TorchJD's quadprog is a dual active-set method; G being positive definite, the solution is
// unique and both find it, up to rounding).
#pragma once
#include <vector>

namespace amp::jd {

// G: row-major m × m, symmetric positive definite; u: m bounds. Throws std::runtime_error
// ("Failed to solve the quadratic programming problem.") if G is not positive definite on a face.
std::vector<double> solve_bounded_qp(const std::vector<double>& G, int m, const std::vector<double>& u);

}  // namespace amp::jd
