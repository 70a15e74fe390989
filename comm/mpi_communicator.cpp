#include "comm/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "comm/ordered_sum.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

namespace {

// Each rank's staging slot in the shared window: larger tensors go through it in chunks.
constexpr size_t kShmSlotBytes = size_t{16} << 20;

MPI_Datatype mpi_type(DType t, const char* op) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i64: return MPI_INT64_T;
    default:
      throw std::invalid_argument(std::string(op) + ": MPI cannot reduce " + dtype_name(t) +
                                  " tensors; reduce gradients in float32");
  }
}

void check_cpu(const Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string(op) + ": the MPI communicator takes CPU tensors, got " + t.device().str());
}

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw CommError(std::string(what) + " failed: " + std::string(msg, static_cast<size_t>(len)));
}

class MpiWork final : public Work {
 public:
  // then: what completes the operation once MPI's part has arrived (an average's division, an
  // ordered sum's additions).
  MpiWork(MpiCommunicator* c, Tensor t, std::function<void()> then, std::string what)
      : comm_(c), tensor_(std::move(t)), then_(std::move(then)), what_(std::move(what)) {}
  MPI_Request* request() { return &req_; }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    mpi_check(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE), what_.c_str());
    if (flag) finish();
    return done_;
  }
  void wait() override {
    if (done_) return;
    comm_->wait_bounded(&req_, what_);
    finish();
  }

 private:
  void finish() {
    done_ = true;
    if (then_) then_();
  }
  MpiCommunicator* comm_;
  Tensor tensor_;  // keeps the buffer alive while MPI owns it
  std::function<void()> then_;
  std::string what_;
  MPI_Request req_ = MPI_REQUEST_NULL;
  bool done_ = false;
};

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  // Errors come back as codes so that they can be reported with context, not as an abort in MPI.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  mpi_check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_comm_), "MPI_Comm_split_type");
  MPI_Comm_rank(local_comm_, &local_rank_);
  MPI_Comm_size(local_comm_, &local_size_);
  const char* use_shm = std::getenv("AMP_COMM_SHM");
  int all_local = local_size_ == size_ ? 1 : 0, agreed = 0;
  MPI_Allreduce(&all_local, &agreed, 1, MPI_INT, MPI_MIN, comm_);  // every rank takes the same path
  if (size_ > 1 && agreed && !(use_shm && std::string(use_shm) == "0"))
    shm_ = std::make_unique<ShmAllReduce>(comm_, kShmSlotBytes);
}

MpiCommunicator::~MpiCommunicator() {
  buffers_.clear();
  shm_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && local_comm_ != MPI_COMM_NULL) MPI_Comm_free(&local_comm_);
}

void MpiCommunicator::wait_bounded(MPI_Request* req, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  int spins = 0;
  for (;;) {
    int flag = 0;
    mpi_check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), what.c_str());
    if (flag) return;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s_)
      throw CommError(timeout_message(rank_, what, timeout_s_, context_));
    // Spin briefly for latency, then back off so that a waiting rank does not steal a core.
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(spins > 100000 ? 1000 : 50));
  }
}

std::unique_ptr<Work> MpiCommunicator::all_reduce_async(Tensor& t, ReduceOp op) {
  check_cpu(t, "all_reduce");
  const MPI_Datatype type = mpi_type(t.dtype(), "all_reduce");
  const std::string what = std::string("all_reduce(") + reduce_op_name(op) + ", " + std::to_string(t.numel()) +
                           " x " + dtype_name(t.dtype()) + ")";
  if (shm_ && (t.dtype() == DType::f32 || t.dtype() == DType::f64)) {
    // Synchronous: on one node the reduction is done by the ranks' own cores either way. Every
    // float all-reduce takes this path, so each element is summed in the same (rank) order.
    const double scale = op == ReduceOp::avg ? 1.0 / size_ : 1.0;
    const auto barrier = bounded_barrier(what);
    bool registered = false;
    for (auto& b : buffers_) {
      if (!b->owns(t)) continue;
      b->reduce_in_place(t.numel(), t.dtype(), op == ReduceOp::max, scale, barrier);
      registered = true;
      break;
    }
    if (!registered) shm_->run(t, op == ReduceOp::max, scale, barrier);
    return std::make_unique<CompletedWork>();
  }
  if (t.numel() > std::numeric_limits<int>::max())
    throw std::invalid_argument(what + ": more elements than one MPI call can carry; use smaller buckets");
  std::function<void()> then;
  if (op == ReduceOp::avg) then = [t, n = size_]() mutable { mul_(t, 1.0 / n); };
  auto work = std::make_unique<MpiWork>(this, t, std::move(then), what);
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), type,
                           op == ReduceOp::max ? MPI_MAX : MPI_SUM, comm_, work->request()),
            what.c_str());
  return work;
}

std::unique_ptr<Work> MpiCommunicator::ordered_sum_async(Tensor& t) {
  check_cpu(t, "ordered_sum");
  if (size_ == 1) return std::make_unique<CompletedWork>();
  // On one node the shared-memory sum adds in the tree's order already.
  if (shm_ && (t.dtype() == DType::f32 || t.dtype() == DType::f64)) return all_reduce_async(t, ReduceOp::sum);
  // Elsewhere MPI's all-reduce may add in any order (it differs with the algorithm, the message size
  // and the number of ranks): gather every rank's buffer without blocking, and add the rows in the
  // tree's order once they have arrived.
  const std::string what = "ordered_sum(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
  if (t.nbytes() > static_cast<size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument(what + ": more bytes than one MPI call can carry; use smaller buckets");
  Shape s = t.shape();
  s.insert(s.begin(), size_);
  Tensor rows = empty(s, t.dtype(), kCPU);
  auto work = std::make_unique<MpiWork>(
      this, rows, [rows, t]() mutable { sum_rows_in_tree_order(rows, t); }, what);
  mpi_check(MPI_Iallgather(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, rows.data_ptr(),
                           static_cast<int>(t.nbytes()), MPI_BYTE, comm_, work->request()),
            what.c_str());
  return work;
}

void MpiCommunicator::broadcast(Tensor& t, int root) {
  check_cpu(t, "broadcast");
  // MPI counts are ints: large tensors (a layer of 2 GiB) go in pieces.
  constexpr size_t kPiece = size_t{1} << 30;
  char* data = static_cast<char*>(t.data_ptr());
  for (size_t done = 0; done < t.nbytes(); done += kPiece) {
    const size_t n = std::min(kPiece, t.nbytes() - done);
    MPI_Request req;
    mpi_check(MPI_Ibcast(data + done, static_cast<int>(n), MPI_BYTE, root, comm_, &req), "broadcast");
    wait_bounded(&req, "broadcast from rank " + std::to_string(root));
  }
}

Tensor MpiCommunicator::all_gather(const Tensor& t) {
  check_cpu(t, "all_gather");
  if (t.nbytes() > static_cast<size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument("all_gather: tensors over 2 GiB are not supported");
  Shape s = t.shape();
  s.insert(s.begin(), size_);
  Tensor out = empty(s, t.dtype(), kCPU);
  MPI_Request req;
  mpi_check(MPI_Iallgather(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, out.data_ptr(),
                           static_cast<int>(t.nbytes()), MPI_BYTE, comm_, &req),
            "all_gather");
  wait_bounded(&req, "all_gather");
  return out;
}

std::function<void()> MpiCommunicator::bounded_barrier(const std::string& what) {
  return [this, what] {
    MPI_Request req;
    mpi_check(MPI_Ibarrier(comm_, &req), what.c_str());
    wait_bounded(&req, what);
  };
}

Tensor MpiCommunicator::make_buffer(int64_t numel, DType dtype, Device device) {
  if (!shm_ || !device.is_cpu() || (dtype != DType::f32 && dtype != DType::f64)) return zeros({numel}, dtype, device);
  buffers_.push_back(std::make_unique<ShmAllReduce>(comm_, static_cast<size_t>(numel) * dtype_size(dtype)));
  return buffers_.back()->buffer(numel, dtype);
}

void MpiCommunicator::barrier() {
  MPI_Request req;
  mpi_check(MPI_Ibarrier(comm_, &req), "barrier");
  wait_bounded(&req, "barrier");
}

}  // namespace amp::comm
