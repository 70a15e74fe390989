// amp_train: `mpirun -np N amp_train --flags...` trains one replica per rank. Also runs without
// mpirun, as a single process. Exit codes: 0 success, 1 runtime failure, 2 bad usage or input.
//
// Setup is ordered so that no rank can be left inside a collective: every step that can fail on
// one rank alone (device, files) runs first, the ranks agree on the outcome, and only then do the
// collectives start (the NCCL communicator, the weight broadcast, the reducer's buffers).
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <stdexcept>

#include "comm/local_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "launch/cli.h"
#include "launch/output_path.h"
#include "launch/device_comm.h"
#include "launch/trainer.h"
#include "runtime/cuda_support.h"
#include "runtime/threads.h"

using namespace amp;

namespace {

// The worst of every rank's value (a MAX all-reduce; ranks report 0 for success).
int worst_over_ranks(comm::Communicator& c, int value) {
  if (c.size() == 1) return value;
  Tensor t = full({1}, value, DType::f64);
  c.all_reduce(t, comm::ReduceOp::max);
  return static_cast<int>(t.item());
}

// Every rank trains on the same kind of device. auto: CUDA only when every rank has a usable one.
Device pick_device(launch::DeviceKind kind, comm::Communicator& c, bool announce) {
  if (kind == launch::DeviceKind::cpu) return kCPU;
  if (kind == launch::DeviceKind::cuda) return Device{DeviceType::cuda, 0};  // cuda_init() reports problems
  std::string reason;
  const bool here = cuda_usable(&reason);
  const bool everywhere = worst_over_ranks(c, here ? 0 : 1) == 0;
  if (everywhere) return Device{DeviceType::cuda, 0};
  if (announce && cuda_built())
    std::printf("notice: %s; training on the CPU\n",
                here ? "not every rank has a usable CUDA device" : ("no usable CUDA device (" + reason + ")").c_str());
  return kCPU;
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
  if (mpi.active() && mpi.size() > 1) host_comm = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD);
  else host_comm = std::make_unique<comm::LocalCommunicator>();
  host_comm->set_timeout(cfg.comm_timeout);
  set_num_threads(cfg.threads > 0 ? cfg.threads : comm::default_threads_per_rank(host_comm->local_size()));

  // 1. What can fail on one rank alone: the device, then the model, weights and data files.
  std::unique_ptr<comm::Communicator> device_comm;
  std::unique_ptr<launch::Trainer> trainer;
  int code = 0;
  Device device = kCPU;
  auto attempt = [&](const auto& step) {
    if (code != 0) return;
    try {
      step();
    } catch (const std::invalid_argument& e) {  // bad input: files, shapes
      code = 2;
      std::fprintf(stderr, "amp_train: rank %d: error: %s\n", mpi.rank(), e.what());
    } catch (const std::exception& e) {
      code = 1;
      std::fprintf(stderr, "amp_train: rank %d: error: %s\n", mpi.rank(), e.what());
    }
  };
  attempt([&] {  // rank 0 writes the outputs: check them before anything runs
    if (!rank0) return;
    launch::check_output_path("--save-weights", cfg.save_weights);
    launch::check_output_path("--metrics", cfg.metrics);
  });
  attempt([&] {
    device = pick_device(cfg.device, *host_comm, rank0);
    if (device.is_cuda()) cuda_init(host_comm->local_rank());
  });
  // 2. Agree, then the collective setup.
  if ((code = worst_over_ranks(*host_comm, code)) != 0) return code;
  comm::Communicator* c = host_comm.get();
  attempt([&] {
    if (device.is_cuda() && host_comm->size() > 1) {
      device_comm = launch::make_device_communicator(MPI_COMM_WORLD, host_comm->local_rank());
      device_comm->set_timeout(cfg.comm_timeout);
      c = device_comm.get();
    }
  });
  if ((code = worst_over_ranks(*host_comm, code)) != 0) return code;
  attempt([&] { trainer = std::make_unique<launch::Trainer>(cfg, *c, device); });
  if ((code = worst_over_ranks(*host_comm, code)) != 0) return code;
  if (rank0)
    std::printf("amp_train: %d rank(s), %s, mlp %lldx%lld, batch %lld x %lld micro-batches x %d ranks, amp %s, loss scaling %s\n",
                mpi.size(), device.str().c_str(), static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width),
                static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.micro_batches), mpi.size(),
                cfg.amp == launch::AmpMode::off ? "off" : cfg.amp == launch::AmpMode::fp16 ? "fp16" : "bf16",
                trainer->scaling() ? "on" : "off");

  // 3. Training: a failure here may leave peers inside a collective, so it tears the job down.
  try {
    trainer->run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_train: rank %d: error: %s\n", mpi.rank(), e.what());
    std::fflush(stderr);
    comm::MpiSession::abort(1);
  }
  return 0;
}
