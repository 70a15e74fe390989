// cudnn_sdpa.h in a build without cudnn-frontend's headers (launch/setup.sh fetches them into
// .deps/; CMake said so when it configured): cuDNN's attention is never available, and says why.
#include "runtime/kernels/cuda/cudnn_sdpa.h"

#include <stdexcept>

namespace amp::cudnn_sdpa {
namespace {
const char* const kWhy =
    "this build has no cuDNN attention (cudnn-frontend's headers were not found when it was configured: "
    "run launch/setup.sh, then build again)";
}  // namespace

std::string unavailable(DType, int64_t) { return kWhy; }
std::string describe() { return std::string("no cuDNN: ") + kWhy; }
size_t forward_workspace(const Shape&, cudaStream_t) { throw std::logic_error(kWhy); }
size_t backward_workspace(const Shape&, cudaStream_t) { throw std::logic_error(kWhy); }
void forward(const Shape&, cudaStream_t, const void*, void*, float*, void*) { throw std::logic_error(kWhy); }
void backward(const Shape&, cudaStream_t, const void*, const void*, const void*, const float*, void*, void*) {
  throw std::logic_error(kWhy);
}

}  // namespace amp::cudnn_sdpa
