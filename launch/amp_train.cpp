// amp_train: `mpirun -np N amp_train --flags...` trains one replica per rank. Also runs without
// mpirun, as a single process. Exit codes: 0 success, 1 runtime failure, 2 bad usage or input.
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <stdexcept>

#include "comm/local_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "launch/cli.h"
#include "launch/device_comm.h"
#include "launch/trainer.h"
#include "runtime/cuda_support.h"
#include "runtime/safetensors.h"
#include "runtime/threads.h"

using namespace amp;

namespace {

Device pick_device(launch::DeviceKind kind, int local_rank, bool announce) {
  if (kind == launch::DeviceKind::cpu) return kCPU;
  std::string reason;
  if (kind == launch::DeviceKind::cuda || cuda_usable(&reason)) {
    cuda_init(local_rank);  // throws a clear error when CUDA is not usable
    return Device{DeviceType::cuda, 0};
  }
  if (announce && cuda_built()) std::printf("notice: no usable CUDA device (%s); training on the CPU\n", reason.c_str());
  return kCPU;
}

// Every rank reports whether its setup worked, so that a bad file on one rank stops all of them.
int agree(comm::Communicator& c, int code) {
  if (c.size() == 1) return code;
  Tensor t = full({1}, code, DType::f64);
  c.all_reduce(t, comm::ReduceOp::max);
  return static_cast<int>(t.item());
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession mpi(&argc, &argv);
  const bool rank0 = mpi.rank() == 0;
  const launch::CliResult cli = launch::parse_cli(argc, argv, mpi.size());
  if (!cli.config) {
    if (rank0) std::fprintf(cli.exit_code == 0 ? stdout : stderr, "%s\n", cli.message.c_str());
    return cli.exit_code;
  }
  const launch::TrainConfig& cfg = *cli.config;

  std::unique_ptr<comm::Communicator> host_comm;
  if (mpi.size() > 1) host_comm = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD);
  else host_comm = std::make_unique<comm::LocalCommunicator>();
  host_comm->set_timeout(cfg.comm_timeout);
  set_num_threads(cfg.threads > 0 ? cfg.threads : comm::default_threads_per_rank(host_comm->local_size()));

  std::unique_ptr<comm::Communicator> device_comm;
  std::unique_ptr<launch::Trainer> trainer;
  int code = 0;
  std::string error;
  try {
    const Device device = pick_device(cfg.device, host_comm->local_rank(), rank0);
    comm::Communicator* c = host_comm.get();
    if (device.is_cuda() && mpi.active() && mpi.size() > 1) {
      device_comm = launch::make_device_communicator(MPI_COMM_WORLD, host_comm->local_rank());
      device_comm->set_timeout(cfg.comm_timeout);
      c = device_comm.get();
    }
    trainer = std::make_unique<launch::Trainer>(cfg, *c, device);
    if (rank0)
      std::printf("amp_train: %d rank(s), %s, mlp %lldx%lld, batch %lld x %lld micro-batches x %d ranks, amp %s, loss scaling %s\n",
                  mpi.size(), device.str().c_str(), static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width),
                  static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.micro_batches), mpi.size(),
                  cfg.amp == launch::AmpMode::off ? "off" : cfg.amp == launch::AmpMode::fp16 ? "fp16" : "bf16",
                  trainer->scaling() ? "on" : "off");
  } catch (const std::invalid_argument& e) {  // bad input: files, shapes
    code = 2;
    error = e.what();
  } catch (const std::exception& e) {
    code = 1;
    error = e.what();
  }
  if (!error.empty()) std::fprintf(stderr, "amp_train: rank %d: error: %s\n", mpi.rank(), error.c_str());
  code = agree(*host_comm, code);
  if (code != 0) return code;

  try {
    trainer->run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_train: rank %d: error: %s\n", mpi.rank(), e.what());
    std::fflush(stderr);
    comm::MpiSession::abort(1);  // peers may be inside a collective: tear the job down
  }
  return 0;
}
