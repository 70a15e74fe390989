// Row-major GEMM expressed as cuBLAS's column-major one. A row-major matrix is the column-major
// matrix of its transpose, so C = op(A) op(B) (row-major, m x n) is computed as the column-major
// C^T = op(B)^T op(A)^T: B goes first, A second, and the leading dimensions are the row-major ones.
// Plain C++: the host tests check it against a reference column-major GEMM without a GPU.
#pragma once
#include <cstdint>

namespace amp::cuda {

struct ColumnMajorGemm {
  bool trans_first, trans_second;  // cuBLAS transa, transb
  int64_t m, n, k;                 // cuBLAS m, n, k (of the column-major C^T: n x m)
  int64_t ld_first, ld_second, ldc;
  bool first_is_b;                 // always true: the operands swap places
};

inline ColumnMajorGemm column_major_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  ColumnMajorGemm g{};
  g.trans_first = trans_b;
  g.trans_second = trans_a;
  g.m = n;
  g.n = m;
  g.k = k;
  g.ld_first = trans_b ? k : n;   // B is k x n, or n x k when transposed, row-major
  g.ld_second = trans_a ? m : k;  // A is m x k, or k x m when transposed, row-major
  g.ldc = n;
  g.first_is_b = true;
  return g;
}

}  // namespace amp::cuda
