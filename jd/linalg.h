// Small dense float64 linear algebra for the Gramian-based aggregators (m × m, m = tasks).
#pragma once
#include <vector>

namespace amp::jd {

// Eigenvalues (ascending) and eigenvectors (column j of the row-major V pairs with value j) of the
// symmetric A (row-major m × m), by cyclic Jacobi rotations to full float64 accuracy.
void symmetric_eigen(const std::vector<double>& A, int m, std::vector<double>* values, std::vector<double>* vectors);

// The pseudo-inverse of the symmetric positive semi-definite A, as torch.linalg.pinv computes it
// from the singular values (here |eigenvalues|): those at or below rtol · the largest are dropped.
std::vector<double> pinv_symmetric(const std::vector<double>& A, int m, double rtol);

// y = A x for row-major m × m A.
std::vector<double> matvec(const std::vector<double>& A, int m, const std::vector<double>& x);

}  // namespace amp::jd
