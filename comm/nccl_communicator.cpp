// NcclCommunicator: see nccl_communicator.h for the ordering and fault model.
#include "comm/nccl_communicator.h"

#include "comm/comm_bytes.h"
#include "comm/ordered_sum.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cuda_support.h"

namespace amp::comm {

namespace {

using Clock = std::chrono::steady_clock;

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;  // divides inside the collective: no extra kernel
    case ReduceOp::max: return ncclMax;
  }
  throw std::invalid_argument("unknown reduce op");
}

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
    case DType::i64: return ncclInt64;
  }
  throw std::invalid_argument("NCCL: unsupported dtype");
}

std::string describe(const char* what, const Tensor& t) {
  return std::string(what) + "(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
}

}  // namespace

// A collective whose completion the watchdog watches.
struct InFlight {
  std::shared_ptr<cuda::Event> done;
  Clock::time_point start;
  double timeout_s;
  std::string op, context;
};

struct NcclCommunicator::State {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1, local_rank = 0, local_size = 1, device = 0;
  ncclComm_t nccl = nullptr;  // null once aborted
  std::unique_ptr<cuda::Stream> stream;

  std::mutex mutex;  // guards nccl, in_flight, error
  std::condition_variable wake;
  std::deque<InFlight> in_flight;
  std::string error;       // set once, by whoever detects the fault first
  bool collected = false;  // the program has been handed the error as a CommError
  bool stop = false;
  std::thread watchdog;

  // --- fault handling (all with mutex held)

  std::string where(const std::string& op, const std::string& context) const {
    return "rank " + std::to_string(rank) + ": NCCL " + op + (context.empty() ? "" : " (" + context + ")");
  }

  void fail_locked(const std::string& message) {
    if (!error.empty()) return;
    error = message;
    std::fprintf(stderr, "%s; aborting the NCCL communicator\n", message.c_str());
    std::fflush(stderr);
    if (nccl != nullptr) {
      (void)ncclCommAbort(nccl);  // lets the stuck kernels exit; the comm is unusable afterwards
      nccl = nullptr;
    }
  }

  [[noreturn]] void raise_locked() {
    collected = true;
    throw CommError(error);
  }

  void throw_if_failed_locked() {
    if (!error.empty()) raise_locked();
  }

  // Checks a call's result; with a non-blocking comm, ncclInProgress means "queued, poll for it".
  void check_locked(ncclResult_t r, const char* expr, const std::string& op, const std::string& context,
                    double timeout_s) {
    if (r != ncclSuccess && r != ncclInProgress) {
      const char* last = nccl ? ncclGetLastError(nccl) : "";
      fail_locked(where(op, context) + ": " + expr + " failed: " + ncclGetErrorString(r) +
                  (last && *last ? std::string(" (") + last + ")" : ""));
      raise_locked();
    }
    // Polls until the comm has left the in-progress state, bounded by the timeout.
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(nccl, &state);
      if (q != ncclSuccess) state = q;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        fail_locked(where(op, context) + ": " + expr + " failed asynchronously: " + ncclGetErrorString(state));
        raise_locked();
      }
      if (Clock::now() > deadline) {
        fail_locked(timeout_message(rank, "NCCL " + op + " (" + expr + ")", timeout_s, context));
        raise_locked();
      }
      // No sleep: a nonblocking call is usually done within microseconds, and a 50 us sleep per
      // poll, several calls a step, adds up. Yield the core instead.
      std::this_thread::yield();
    }
  }

  // --- the watchdog

  void watch() {
    // Event queries need this thread bound to the communicator's device.
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
    // The relaxed capture mode for this thread: a CUDA graph captured on the compute stream (global
    // mode: the trainer's step) forbids other threads' event queries, even of events recorded before
    // the capture, and a poll would invalidate the capture (pytorch/pytorch#104487). This thread
    // queries only events recorded outside captures, which is safe.
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    if (cudaThreadExchangeStreamCaptureMode(&relaxed) != cudaSuccess) (void)cudaGetLastError();
    std::unique_lock<std::mutex> lock(mutex);
    Clock::time_point reported{};
    while (!stop) {
      wake.wait_for(lock, std::chrono::milliseconds(100));
      if (stop) break;
      if (!error.empty()) {
        // The program has not called in to collect the error: end it, so that mpirun tears the
        // job down instead of leaving peers waiting.
        if (collected) continue;
        if (reported == Clock::time_point{}) reported = Clock::now();
        if (Clock::now() - reported > std::chrono::seconds(60)) {
          std::fprintf(stderr, "%s; exiting\n", error.c_str());
          std::fflush(stderr);
          std::_Exit(EXIT_FAILURE);
        }
        continue;
      }
      if (nccl != nullptr) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(nccl, &async) != ncclSuccess) async = ncclInternalError;
        if (async != ncclSuccess && async != ncclInProgress) {
          const InFlight* oldest = in_flight.empty() ? nullptr : &in_flight.front();
          fail_locked(where(oldest ? oldest->op : "communicator", oldest ? oldest->context : "") +
                      ": asynchronous error: " + ncclGetErrorString(async));
          continue;
        }
      }
      while (!in_flight.empty()) {
        InFlight& f = in_flight.front();
        bool finished = false;
        try {
          finished = f.done->query();
        } catch (const std::exception& e) {
          fail_locked(where(f.op, f.context) + ": " + e.what());
          break;
        }
        if (finished) {
          in_flight.pop_front();
          continue;
        }
        const double age = std::chrono::duration<double>(Clock::now() - f.start).count();
        if (age > f.timeout_s) fail_locked(timeout_message(rank, "NCCL " + f.op, f.timeout_s, f.context));
        break;  // collectives complete in order: the oldest unfinished one decides
      }
    }
  }
};

// --- Work

namespace {

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator::State> state, std::shared_ptr<cuda::Event> done,
           std::vector<Tensor> keep)
      : state_(std::move(state)), done_(std::move(done)), keep_(std::move(keep)) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    AMP_CUDA_CHECK(cudaStreamIsCapturing(cuda::context().stream(), &capture));
    captured_ = capture != cudaStreamCaptureStatusNone;
  }

  // Even when nobody waits, later compute-stream work (which may reuse these tensors' memory)
  // must be ordered after the collective.
  ~NcclWork() override {
    if (joined_) return;
    try {
      AMP_CUDA_CHECK_NOTHROW(cudaStreamWaitEvent(cuda::context().stream(), done_->get(), 0));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "NcclWork teardown: %s\n", e.what());
    }
  }

  void wait() override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->throw_if_failed_locked();
    }
    done_->block(cuda::context().stream());
    joined_ = true;
  }

  bool test() override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->throw_if_failed_locked();
    }
    // A captured collective's event stands for a graph node, which CUDA forbids querying: it is
    // never known done here (a graph launch's own event is: watch_graph_launch).
    return !captured_ && done_->query();
  }

 private:
  std::shared_ptr<NcclCommunicator::State> state_;
  std::shared_ptr<cuda::Event> done_;
  std::vector<Tensor> keep_;  // the tensors stay allocated while the collective may touch them
  bool joined_ = false;
  bool captured_ = false;  // issued while the compute stream was capturing a graph
};

void require_cuda_tensor(const Tensor& t, const char* op) {
  if (!t.defined() || !t.device().is_cuda())
    throw std::invalid_argument(std::string("NcclCommunicator::") + op + ": expected a CUDA tensor, got " +
                                (t.defined() ? t.device().str() : std::string("an undefined tensor")));
}

}  // namespace

// --- setup and teardown

NcclCommunicator::NcclCommunicator(MPI_Comm comm, int local_rank) : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.mpi = comm;
  if (MPI_Comm_rank(comm, &s.rank) != MPI_SUCCESS || MPI_Comm_size(comm, &s.size) != MPI_SUCCESS)
    throw CommError("NcclCommunicator: MPI_Comm_rank/MPI_Comm_size failed");
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, s.rank, MPI_INFO_NULL, &node) != MPI_SUCCESS)
    throw CommError("rank " + std::to_string(s.rank) + ": MPI_Comm_split_type failed");
  MPI_Comm_size(node, &s.local_size);
  MPI_Comm_free(&node);
  s.local_rank = local_rank;

  cuda_init(local_rank, s.local_size);
  s.device = cuda::context().device();
  int least = 0, greatest = 0;
  AMP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  s.stream = std::make_unique<cuda::Stream>(greatest);

  // Rank 0 always takes part in the broadcast, with a status, so that a failure there stops every
  // rank instead of leaving them in MPI_Bcast; the wait is bounded like every other one.
  struct {
    int ok;
    ncclUniqueId id;
  } msg{};
  std::string rank0_error;
  if (s.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&msg.id);
    msg.ok = r == ncclSuccess ? 1 : 0;
    if (!msg.ok) rank0_error = ncclGetErrorString(r);
  }
  MPI_Request req;
  if (MPI_Ibcast(&msg, sizeof(msg), MPI_BYTE, 0, comm, &req) != MPI_SUCCESS)
    throw CommError("rank " + std::to_string(s.rank) + ": MPI_Ibcast of the NCCL unique id failed");
  const auto start = Clock::now();
  for (int done = 0; !done;) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done && std::chrono::duration<double>(Clock::now() - start).count() > timeout())
      throw CommError(timeout_message(s.rank, "the broadcast of rank 0's NCCL unique id", timeout(), context()));
    if (!done) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (!msg.ok)
    throw CommError("rank " + std::to_string(s.rank) + ": rank 0's ncclGetUniqueId failed" +
                    (rank0_error.empty() ? "" : ": " + rank0_error) + " (no usable network interface? see NCCL_SOCKET_IFNAME)");
  const ncclUniqueId id = msg.id;

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; faults become abortable instead of hangs
  std::lock_guard<std::mutex> lock(s.mutex);
  const ncclResult_t r = ncclCommInitRankConfig(&s.nccl, s.size, id, s.rank, &config);
  s.check_locked(r, "ncclCommInitRankConfig", "init", context(), timeout());
  s.watchdog = std::thread([st = state_.get()] { st->watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stop = true;
  }
  s.wake.notify_all();
  if (s.watchdog.joinable()) s.watchdog.join();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.nccl == nullptr) return;  // aborted
  // Finalize flushes the outstanding collectives; bounded like any other wait, then destroy.
  try {
    s.check_locked(ncclCommFinalize(s.nccl), "ncclCommFinalize", "finalize", context(), timeout());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "NcclCommunicator teardown: %s\n", e.what());
  }
  if (s.nccl != nullptr) {
    const ncclResult_t r = ncclCommDestroy(s.nccl);
    if (r != ncclSuccess) std::fprintf(stderr, "ncclCommDestroy failed: %s\n", ncclGetErrorString(r));
    s.nccl = nullptr;
  }
}

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }
int NcclCommunicator::local_rank() const { return state_->local_rank; }
int NcclCommunicator::local_size() const { return state_->local_size; }
cudaStream_t NcclCommunicator::comm_stream() const { return state_->stream->get(); }

// --- collectives

namespace {

// Queues launch() on the comm stream after the compute stream's pending work, and returns the event
// that marks its end, registered with the watchdog. Call with the state's mutex held.
template <class Launch>
std::shared_ptr<cuda::Event> enqueue(NcclCommunicator::State& s, const std::string& op, const std::string& context,
                                     double timeout_s, Launch&& launch) {
  s.throw_if_failed_locked();
  const cudaStream_t compute = cuda::context().stream();
  const cudaStream_t comm = s.stream->get();
  cuda::Event ready;
  ready.record(compute);
  ready.block(comm);  // inputs produced on the compute stream are complete before NCCL reads them
  launch(comm);
  auto done = std::make_shared<cuda::Event>();
  done->record(comm);
  // Captured into a graph, the event is a node that cannot be queried: the graph's launches are
  // watched instead (watch_graph_launch).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  AMP_CUDA_CHECK(cudaStreamIsCapturing(compute, &capture));
  if (capture == cudaStreamCaptureStatusNone) s.in_flight.push_back(InFlight{done, Clock::now(), timeout_s, op, context});
  return done;
}

}  // namespace

// Names the NCCL function only: the arguments make the message unreadable.
#define AMP_NCCL_CALL(fn, ...) s.check_locked(fn(__VA_ARGS__), #fn, op, context(), timeout())

std::unique_ptr<Work> NcclCommunicator::all_reduce_async(Tensor& t, ReduceOp rop) {
  require_cuda_tensor(t, "all_reduce");
  State& s = *state_;
  const std::string op = describe((std::string("all_reduce/") + reduce_op_name(rop)).c_str(), t);
  count_sent(sent_bytes::all_reduce(t.nbytes(), size()));
  std::lock_guard<std::mutex> lock(s.mutex);
  auto done = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
    AMP_NCCL_CALL(ncclAllReduce, t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype()),
                                nccl_op(rop), s.nccl, stream);
  });
  return std::make_unique<NcclWork>(state_, std::move(done), std::vector<Tensor>{t});
}

std::unique_ptr<Work> NcclCommunicator::all_reduce_coalesced_async(std::vector<Tensor>& ts, ReduceOp rop) {
  int64_t total = 0;
  for (const Tensor& t : ts) {
    require_cuda_tensor(t, "all_reduce_coalesced");
    total += t.numel();
    count_sent(sent_bytes::all_reduce(t.nbytes(), size()));
  }
  State& s = *state_;
  const std::string op = std::string("all_reduce_coalesced/") + reduce_op_name(rop) + "(" + std::to_string(ts.size()) +
                         " tensors, " + std::to_string(total) + " elements)";
  std::lock_guard<std::mutex> lock(s.mutex);
  auto done = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
    AMP_NCCL_CALL(ncclGroupStart);
    try {
      for (Tensor& t : ts)
        AMP_NCCL_CALL(ncclAllReduce, t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                                    nccl_dtype(t.dtype()), nccl_op(rop), s.nccl, stream);
    } catch (...) {
      // A group left open defers every later NCCL call of this thread for ever: close it first.
      (void)ncclGroupEnd();
      throw;
    }
    AMP_NCCL_CALL(ncclGroupEnd);
  });
  return std::make_unique<NcclWork>(state_, std::move(done), ts);
}

void NcclCommunicator::broadcast(Tensor& t, int root) {
  require_cuda_tensor(t, "broadcast");
  State& s = *state_;
  const std::string op = describe(("broadcast/root " + std::to_string(root)).c_str(), t);
  count_sent(sent_bytes::broadcast(t.nbytes(), size(), rank() == root));
  std::lock_guard<std::mutex> lock(s.mutex);
  auto done = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
    AMP_NCCL_CALL(ncclBroadcast, t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype()),
                                root, s.nccl, stream);
  });
  done->block(cuda::context().stream());  // t is complete for every later compute-stream use
}

Tensor NcclCommunicator::all_gather(const Tensor& t) {
  require_cuda_tensor(t, "all_gather");
  Shape shape = t.shape();
  shape.insert(shape.begin(), size());
  Tensor out = empty(shape, t.dtype(), t.device());
  State& s = *state_;
  const std::string op = describe("all_gather", t);
  count_sent(sent_bytes::all_gather(t.nbytes(), size()));
  std::lock_guard<std::mutex> lock(s.mutex);
  auto done = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
    AMP_NCCL_CALL(ncclAllGather, t.data_ptr(), out.data_ptr(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype()),
                                s.nccl, stream);
  });
  done->block(cuda::context().stream());
  return out;
}

// A buffer that splits into size() equal shards: an all-to-all gives this rank every rank's shard,
// the compute stream sums them in the tree's order into its own shard, and the shards are
// all-gathered in place (ordered_sum.h). Others: the base's gather and sum. Either way a Work whose
// wait() raises what the watchdog found, as every other collective's does.
std::unique_ptr<Work> NcclCommunicator::ordered_sum_async(Tensor& t) {
  require_cuda_tensor(t, "ordered_sum");
  if (size() == 1) return Communicator::ordered_sum_async(t);
  if (!splits_into_shards(t.numel(), size())) {
    const Tensor rows = all_gather(t);
    sum_rows_in_tree_order(rows, t);
    auto done = std::make_shared<cuda::Event>();
    done->record(cuda::context().stream());
    return std::make_unique<NcclWork>(state_, std::move(done), std::vector<Tensor>{t, rows});
  }
  reduce_scatter(t, "ordered_sum");
  return all_gather_shards(t, "ordered_sum");
}

// Rank j receives every rank's shard j (an all-to-all) and the compute stream adds them in the
// tree's order into its own shard.
void NcclCommunicator::reduce_scatter(Tensor& t, const char* name) {
  State& s = *state_;
  const int64_t shard = t.numel() / size();
  Tensor rows = empty({size(), shard}, t.dtype(), t.device());
  Tensor mine = t.view(0, {t.numel()}).view(rank() * shard, {shard});
  count_sent(sent_bytes::all_to_all(t.nbytes(), size()));
  {
    const std::string op = describe((std::string(name) + "/all_to_all").c_str(), t);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto received = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
      AMP_NCCL_CALL(ncclAlltoAll, t.data_ptr(), rows.data_ptr(), static_cast<size_t>(shard), nccl_dtype(t.dtype()),
                                  s.nccl, stream);
    });
    received->block(cuda::context().stream());
  }
  sum_rows_in_tree_order(rows, mine);  // on the compute stream, which orders rows' reuse after it
}

// Every rank's shard into its place, in place (NCCL's in-place all-gather: the send buffer is this
// rank's shard of the receive buffer).
std::unique_ptr<Work> NcclCommunicator::all_gather_shards(Tensor& t, const char* name) {
  State& s = *state_;
  const int64_t shard = t.numel() / size();
  Tensor mine = t.view(0, {t.numel()}).view(rank() * shard, {shard});
  count_sent(sent_bytes::all_gather(mine.nbytes(), size()));
  const std::string op = describe((std::string(name) + "/all_gather").c_str(), t);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto done = enqueue(s, op, context(), timeout(), [&](cudaStream_t stream) {
    AMP_NCCL_CALL(ncclAllGather, mine.data_ptr(), t.data_ptr(), static_cast<size_t>(shard), nccl_dtype(t.dtype()),
                                s.nccl, stream);
  });
  return std::make_unique<NcclWork>(state_, std::move(done), std::vector<Tensor>{t});
}

std::unique_ptr<Work> NcclCommunicator::ordered_reduce_scatter_async(Tensor& t) {
  require_cuda_tensor(t, "ordered_reduce_scatter");
  if (size() == 1 || !splits_into_shards(t.numel(), size())) return Communicator::ordered_reduce_scatter_async(t);
  reduce_scatter(t, "ordered_reduce_scatter");
  auto done = std::make_shared<cuda::Event>();
  done->record(cuda::context().stream());
  return std::make_unique<NcclWork>(state_, std::move(done), std::vector<Tensor>{t});
}

std::unique_ptr<Work> NcclCommunicator::all_gather_shards_async(Tensor& t) {
  require_cuda_tensor(t, "all_gather_shards");
  if (size() == 1 || !splits_into_shards(t.numel(), size())) return Communicator::all_gather_shards_async(t);
  return all_gather_shards(t, "all_gather_shards");
}

void NcclCommunicator::raise_if_failed() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->throw_if_failed_locked();
}

void NcclCommunicator::barrier() {
  Tensor token = zeros({1}, DType::f32, Device{DeviceType::cuda, 0});
  auto work = all_reduce_async(token, ReduceOp::sum);
  work->wait();
  // A barrier is a host-side promise: wait for the token, bounded by the timeout.
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout());
  while (!work->test()) {
    if (Clock::now() > deadline) {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->fail_locked(timeout_message(state_->rank, "NCCL barrier", timeout(), context()));
      state_->raise_locked();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

#undef AMP_NCCL_CALL

void NcclCommunicator::watch_graph_launch(const std::string& what) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.throw_if_failed_locked();
  auto done = std::make_shared<cuda::Event>();
  done->record(cuda::context().stream());
  s.in_flight.push_back(InFlight{done, Clock::now(), timeout(), what, context()});
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int local_rank) {
  return std::make_unique<NcclCommunicator>(comm, local_rank);
}

}  // namespace amp::comm
