// The device communicator of CUDA builds: NCCL.
#include "comm/nccl_communicator.h"
#include "launch/training/device_comm.h"

namespace amp::launch {

std::unique_ptr<comm::Communicator> make_device_communicator(MPI_Comm comm, int local_rank) {
  return comm::make_nccl_communicator(comm, local_rank);
}

}  // namespace amp::launch
