// One block per row (layer norm, softmax and their backward): its size, and the grid of rows.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace amp::cuda {

// Narrow rows get a smaller block, so that most threads have work.
inline int row_threads(int64_t cols) { return cols >= 256 ? 256 : (cols >= 64 ? 64 : 32); }
inline unsigned rows_grid(int64_t rows, const char* op) {
  if (rows > 0x7fffffff) throw std::invalid_argument(std::string(op) + ": more than 2^31-1 rows");
  return static_cast<unsigned>(rows);
}

}  // namespace amp::cuda
