// bench_comm (run under mpirun): what data parallelism costs on this machine.
//  1. The reference MLP's step (bench_mlp's) per rank: rank 0 alone without communication, then every rank with the
//     bucketed all-reduce, overlap on and off. The gap is what communication adds.
//  2. All-reduce bandwidth for one large buffer against a plain memcpy of the same size.
//  3. The rank-invariant (ordered) sum of the same buffer over MPI's own transport, as between nodes
//     (AMP_COMM_SHM=0's path): the all-to-all and all-gather (a ring all-reduce's bytes) against the
//     gather of every rank's buffer that it replaced, and MPI's own all-reduce; bytes sent per rank
//     from the communicator's counter (comm/comm_bytes.h).
#include <mpi.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <sstream>
#include <vector>

#include "launch/bench/bench_timing.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "comm/reducer.h"
#include "models/mlp.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/sgd.h"
#include "runtime/ops/random.h"
#include "runtime/kernels/cpu/threads.h"

using namespace amp;
namespace po = boost::program_options;
using Clock = launch::BenchClock;
using launch::median;
using launch::ms_since;

namespace {

// Median step time in ms. comm == nullptr: no reducer at all.
double time_steps(int64_t width, int64_t layers, int64_t batch, int warmup, int steps, comm::Communicator* comm,
                  bool overlap, double bucket_mb) {
  Generator gen(1);
  auto model = models::make_mlp({width, width, width, layers}, gen);
  const Tensor x = randn({batch, width}, gen), y = randn({batch, width}, gen);
  optim::SGD opt(model->parameters(), optim::SgdOptions{1e-4});
  std::unique_ptr<comm::GradientReducer> reducer;
  if (comm) {
    comm::ReducerOptions ro;
    ro.overlap = overlap;
    ro.ordered_sum = true;  // as amp_train reduces
    ro.bucket_bytes = static_cast<size_t>(bucket_mb * (1 << 20));
    reducer = std::make_unique<comm::GradientReducer>(model->parameters(), *comm, ro);
  }
  std::vector<double> t;
  for (int s = 0; s < warmup + steps; ++s) {
    if (comm) comm->barrier();
    const auto t0 = Clock::now();
    opt.zero_grad();
    if (reducer) reducer->prepare_for_backward(true);
    mse_loss((*model)(x), y).backward();
    if (reducer) reducer->finish();
    opt.step();
    if (s >= warmup) t.push_back(ms_since(t0));
  }
  return median(t);
}

}  // namespace

static int run(int64_t width, int64_t layers, int64_t batch, int warmup, int steps, int threads, double bucket_mb,
               double buffer_mb);

int main(int argc, char** argv) {
  comm::MpiSession mpi(&argc, &argv);
  int64_t width = 4096, layers = 3, batch = 512;
  int warmup = 1, steps = 3, threads = 1;
  double bucket_mb = 25.0, buffer_mb = 64.0;
  po::options_description opts("bench_comm: data-parallel overheads (run with mpirun -np N)");
  opts.add_options()("help,h", "print this help")
      ("width", po::value(&width)->default_value(width), "hidden width")
      ("layers", po::value(&layers)->default_value(layers), "Linear layers")
      ("batch", po::value(&batch)->default_value(batch), "batch size per rank")
      ("warmup", po::value(&warmup)->default_value(warmup), "untimed steps")
      ("steps", po::value(&steps)->default_value(steps), "timed steps (median)")
      ("threads", po::value(&threads)->default_value(threads), "threads per rank")
      ("bucket-mb", po::value(&bucket_mb)->default_value(bucket_mb), "gradient bucket size")
      ("buffer-mb", po::value(&buffer_mb)->default_value(buffer_mb), "all-reduce bandwidth buffer size");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    po::notify(vm);
    if (width < 1 || layers < 1 || batch < 1 || steps < 1 || threads < 1 || !(bucket_mb > 0) || !(buffer_mb > 0))
      throw po::error("sizes, --steps and --threads must be positive");
    if (width > (1 << 20) || batch > (1 << 24) || layers > (1 << 16) || buffer_mb > (1 << 20) || bucket_mb > (1 << 20))
      throw po::error("--width is at most 2^20, --batch 2^24, --layers 2^16, --buffer-mb and --bucket-mb 2^20");
  } catch (const po::error& e) {
    if (mpi.rank() == 0) std::fprintf(stderr, "bench_comm: error: %s\n", e.what());
    return 2;
  }
  if (vm.count("help")) {
    if (mpi.rank() == 0) {
      std::ostringstream os;
      os << opts;
      std::printf("%s", os.str().c_str());
    }
    return 0;
  }
  if (!mpi.active() || mpi.size() < 2) {
    std::fprintf(stderr, "bench_comm: run it with mpirun -np 2 (or more)\n");
    return 2;
  }
  set_num_threads(threads);
  // A rank that cannot allocate (a --buffer-mb beyond its memory) ends every rank, saying so: it
  // aborted alone with std::bad_alloc's terminate.
  try {
    return run(width, layers, batch, warmup, steps, threads, bucket_mb, buffer_mb);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm: error: rank %d: %s%s\n", mpi.rank(), e.what(),
                 dynamic_cast<const std::bad_alloc*>(&e) ? " (out of memory: give a smaller --buffer-mb, --width or --batch)" : "");
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

static int run(int64_t width, int64_t layers, int64_t batch, int warmup, int steps, int threads, double bucket_mb,
               double buffer_mb) {
  comm::MpiCommunicator world(MPI_COMM_WORLD);
  const bool rank0 = world.rank() == 0;

  // 1. Step time: rank 0 alone first (the others wait in a sleeping barrier), then all ranks.
  double alone = 0.0;
  if (rank0) alone = time_steps(width, layers, batch, warmup, steps, nullptr, false, bucket_mb);
  world.barrier();
  // Every rank computing at once, still without communication: what sharing the node's cores and
  // memory costs, apart from communication.
  const double together = time_steps(width, layers, batch, warmup, steps, nullptr, false, bucket_mb);
  world.barrier();
  const double on = time_steps(width, layers, batch, warmup, steps, &world, true, bucket_mb);
  const double off = time_steps(width, layers, batch, warmup, steps, &world, false, bucket_mb);
  if (rank0) {
    std::printf("MLP %lld x %lld, batch %lld per rank, %d thread(s) per rank, %d ranks, buckets %.0f MiB\n",
                static_cast<long long>(layers), static_cast<long long>(width), static_cast<long long>(batch), threads,
                world.size(), bucket_mb);
    std::printf("  1 rank alone, no communication       %9.1f ms/step\n", alone);
    std::printf("  %d ranks at once, no communication    %9.1f ms/step  (%+.1f%% over 1 rank alone)\n", world.size(),
                together, 100.0 * (together / alone - 1));
    std::printf("  %d ranks, all-reduce, overlap on      %9.1f ms/step  (%+.1f%% over 1 rank alone, %+.1f%% over no communication)\n",
                world.size(), on, 100.0 * (on / alone - 1), 100.0 * (on / together - 1));
    std::printf("  %d ranks, all-reduce, overlap off     %9.1f ms/step  (%+.1f%% over 1 rank alone, %+.1f%% over no communication)\n",
                world.size(), off, 100.0 * (off / alone - 1), 100.0 * (off / together - 1));
  }

  // 2. All-reduce bandwidth against memcpy.
  const int64_t n = static_cast<int64_t>(buffer_mb * (1 << 20) / 4);
  Tensor buf = full({n}, 1.0), dst = empty({n});
  std::vector<double> ar, cp;
  for (int i = 0; i < 5; ++i) {
    world.barrier();
    auto t0 = Clock::now();
    world.all_reduce(buf, comm::ReduceOp::sum);
    ar.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    t0 = Clock::now();
    std::memcpy(dst.data_ptr(), buf.data_ptr(), buf.nbytes());
    cp.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (rank0) {
    const double bytes = static_cast<double>(buf.nbytes()), p = world.size();
    const double t = median(ar);
    std::printf("all-reduce of %.0f MiB: %.1f ms, algorithm bandwidth %.2f GB/s, bus bandwidth %.2f GB/s\n",
                buffer_mb, t * 1e3, bytes / t / 1e9, 2 * (p - 1) / p * bytes / t / 1e9);
    std::printf("memcpy of the same:   %.1f ms, %.2f GB/s\n", median(cp) * 1e3, bytes / median(cp) / 1e9);
  }

  // 3. The ordered sum between nodes: a second communicator without the shared-memory path.
  setenv("AMP_COMM_SHM", "0", 1);
  comm::MpiCommunicator plain(MPI_COMM_WORLD);
  unsetenv("AMP_COMM_SHM");
  const int64_t m = n / (4 * world.size()) * (4 * world.size());  // splits into one shard per rank
  Tensor sum_buf = full({m}, 1.0);
  const auto timed = [&](auto&& run) {  // median seconds and bytes sent per call
    std::vector<double> t;
    const uint64_t before = plain.bytes_sent();
    for (int i = 0; i < 5; ++i) {
      fill_(sum_buf, 1.0);
      world.barrier();
      const auto t0 = Clock::now();
      run();
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return std::pair{median(t), static_cast<double>(plain.bytes_sent() - before) / 5};
  };
  const auto [ring_s, ring_b] = timed([&] { plain.ordered_sum(sum_buf); });
  const auto [gather_s, gather_b] = timed([&] { plain.comm::Communicator::ordered_sum_async(sum_buf)->wait(); });
  const auto [mpi_s, mpi_b] = timed([&] { plain.all_reduce(sum_buf, comm::ReduceOp::sum); });
  if (rank0) {
    std::printf("ordered sum of %.0f MiB over MPI's transport (AMP_COMM_SHM=0), %d ranks, bytes sent per rank:\n",
                static_cast<double>(sum_buf.nbytes()) / (1 << 20), world.size());
    std::printf("  all-to-all + all-gather  %8.1f ms  %7.1f MiB  (%.3f x the gather's time)\n", ring_s * 1e3,
                ring_b / (1 << 20), ring_s / gather_s);
    std::printf("  gather every buffer      %8.1f ms  %7.1f MiB\n", gather_s * 1e3, gather_b / (1 << 20));
    std::printf("  MPI's all-reduce (any order) %4.1f ms  %7.1f MiB\n", mpi_s * 1e3, mpi_b / (1 << 20));
  }
  return 0;
}
