#include <stdexcept>

#include "launch/training/device_comm.h"

namespace amp::launch {

std::unique_ptr<comm::Communicator> make_device_communicator(MPI_Comm, int) {
  throw std::runtime_error("this build has no NCCL communicator (configure with -DAMP_WITH_CUDA=ON)");
}

}  // namespace amp::launch
