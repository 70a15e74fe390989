// The communicator for device tensors. device_comm_nccl.cpp (CUDA builds) or device_comm_stub.cpp
// implements it; CMake picks the file.
#pragma once
#include <mpi.h>

#include <memory>

#include "comm/communicator.h"

namespace amp::launch {

std::unique_ptr<comm::Communicator> make_device_communicator(MPI_Comm comm, int local_rank);

}  // namespace amp::launch
