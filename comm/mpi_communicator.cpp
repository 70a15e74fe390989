#include "comm/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_bytes.h"
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

// A collective of one or more MPI requests issued in turn: each stage's start() issues its request
// once the previous stage's request has completed and its then() has run (an ordered sum's
// all-to-all, its additions, its all-gather). A timeout names the stage that did not complete.
//
// Only the first stage is issued when the collective is; the later ones are issued by wait(), never
// by test(). MPI matches a communicator's collectives by the order in which each rank issues them, so
// every rank must issue them in the same order: a stage started by whichever test() first saw its
// predecessor complete would go out between other buckets' first stages at a moment that differs
// from rank to rank, and be matched with another collective.
class MpiWork final : public Work {
 public:
  using Stage = MpiStage;
  // keep: the buffers MPI owns until the last stage completes.
  MpiWork(MpiCommunicator* c, std::vector<Tensor> keep, std::vector<Stage> stages)
      : comm_(c), keep_(std::move(keep)), stages_(std::move(stages)) {
    start();
  }
  bool test() override {
    if (!done() && started_) {
      int flag = 0;
      mpi_check(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE), stages_[next_].what.c_str());
      if (flag) complete();
    }
    return done();
  }
  void wait() override {
    while (!done()) {
      if (!started_) start();
      comm_->wait_bounded(&req_, stages_[next_].what);
      complete();
    }
  }

 private:
  bool done() const { return next_ == stages_.size(); }
  void start() {
    stages_[next_].start(&req_);
    started_ = true;
  }
  void complete() {  // the stage in flight has completed
    if (stages_[next_].then) stages_[next_].then();
    ++next_;
    started_ = false;
  }
  MpiCommunicator* comm_;
  std::vector<Tensor> keep_;
  std::vector<Stage> stages_;
  size_t next_ = 0;       // the stage in flight, or the next one to start
  bool started_ = false;  // stages_[next_] has been issued
  MPI_Request req_ = MPI_REQUEST_NULL;
};

int mpi_count(size_t bytes, const std::string& what) {
  if (bytes > static_cast<size_t>(std::numeric_limits<int>::max()))
    throw std::invalid_argument(what + ": more bytes than one MPI call can carry; use smaller buckets");
  return static_cast<int>(bytes);
}

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
  count_sent(sent_bytes::all_reduce(t.nbytes(), size_));
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
  MpiWork::Stage stage{what,
                       [this, t, type, op, what](MPI_Request* req) mutable {
                         mpi_check(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), type,
                                                  op == ReduceOp::max ? MPI_MAX : MPI_SUM, comm_, req),
                                   what.c_str());
                       },
                       std::move(then)};
  return std::make_unique<MpiWork>(this, std::vector<Tensor>{t}, std::vector<MpiWork::Stage>{std::move(stage)});
}

std::unique_ptr<Work> MpiCommunicator::ordered_sum_async(Tensor& t) {
  check_cpu(t, "ordered_sum");
  if (size_ == 1) return std::make_unique<CompletedWork>();
  // On one node the shared-memory sum adds in the tree's order already.
  if (shm_ && (t.dtype() == DType::f32 || t.dtype() == DType::f64)) return all_reduce_async(t, ReduceOp::sum);
  // Elsewhere MPI's all-reduce may add in any order (it differs with the algorithm, the message size
  // and the number of ranks): move the rows without blocking, and add them in the tree's order once
  // they have arrived.
  const std::string counts = "(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
  const std::string what = "ordered_sum" + counts;
  if (!splits_into_shards(t.numel(), size_)) {
    // Every rank's whole buffer, summed on every rank.
    const int bytes = mpi_count(t.nbytes(), what);
    Shape s = t.shape();
    s.insert(s.begin(), size_);
    Tensor rows = empty(s, t.dtype(), kCPU);
    count_sent(sent_bytes::all_gather(t.nbytes(), size_));
    MpiWork::Stage gather{"ordered_sum/all_gather" + counts,
                          [this, t, rows, bytes, what](MPI_Request* req) {
                            mpi_check(MPI_Iallgather(t.data_ptr(), bytes, MPI_BYTE, rows.data_ptr(), bytes, MPI_BYTE,
                                                     comm_, req),
                                      what.c_str());
                          },
                          [rows, t]() mutable { sum_rows_in_tree_order(rows, t); }};
    return std::make_unique<MpiWork>(this, std::vector<Tensor>{t, rows}, std::vector<MpiWork::Stage>{std::move(gather)});
  }
  // A ring's bytes: rank j receives every rank's shard j, sums it, and the shards are all-gathered.
  std::vector<MpiWork::Stage> stages = {reduce_scatter_stage(t, "ordered_sum"), all_gather_stage(t, "ordered_sum")};
  return std::make_unique<MpiWork>(this, std::vector<Tensor>{t}, std::move(stages));
}

// Rank j receives every rank's shard j of t (an all-to-all) and adds them in the tree's order into
// its own; the rows live as long as the stage's functions.
MpiStage MpiCommunicator::reduce_scatter_stage(const Tensor& t, const std::string& op) {
  const std::string what = op + "/all_to_all(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
  const int64_t shard = t.numel() / size_;
  const int bytes = mpi_count(static_cast<size_t>(shard) * dtype_size(t.dtype()), what);
  Tensor rows = empty({size_, shard}, t.dtype(), kCPU);
  Tensor mine = t.view(0, {t.numel()}).view(rank_ * shard, {shard});
  count_sent(sent_bytes::all_to_all(t.nbytes(), size_));
  return {what,
          [this, t, rows, bytes, what](MPI_Request* req) {
            mpi_check(MPI_Ialltoall(t.data_ptr(), bytes, MPI_BYTE, rows.data_ptr(), bytes, MPI_BYTE, comm_, req),
                      what.c_str());
          },
          [rows, mine]() mutable { sum_rows_in_tree_order(rows, mine); }};
}

// Every rank's shard of t into its place, in place.
MpiStage MpiCommunicator::all_gather_stage(const Tensor& t, const std::string& op) {
  const std::string what = op + "/all_gather(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
  const size_t shard_bytes = t.nbytes() / static_cast<size_t>(size_);
  const int bytes = mpi_count(shard_bytes, what);
  count_sent(sent_bytes::all_gather(shard_bytes, size_));
  return {what,
          [this, t, bytes, what](MPI_Request* req) {
            mpi_check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, t.data_ptr(), bytes, MPI_BYTE, comm_, req),
                      what.c_str());
          },
          nullptr};
}

std::unique_ptr<Work> MpiCommunicator::ordered_reduce_scatter_async(Tensor& t) {
  check_cpu(t, "ordered_reduce_scatter");
  if (size_ == 1) return ordered_sum_async(t);
  if (!splits_into_shards(t.numel(), size_)) return Communicator::ordered_reduce_scatter_async(t);  // names the sizes
  if (shm_ && (t.dtype() == DType::f32 || t.dtype() == DType::f64)) {
    // One node: a buffer in the shared window (the gradient buckets) sums its own shard alone;
    // another tensor goes through the window whole, the all-reduce it is counted as.
    for (auto& b : buffers_) {
      if (!b->owns(t)) continue;
      const std::string what = "ordered_reduce_scatter(" + std::to_string(t.numel()) + " x " + dtype_name(t.dtype()) + ")";
      count_sent(sent_bytes::all_to_all(t.nbytes(), size_));
      b->reduce_scatter_in_place(t.numel(), t.dtype(), bounded_barrier(what));
      return std::make_unique<CompletedWork>();
    }
    return ordered_sum_async(t);
  }
  std::vector<MpiWork::Stage> stages = {reduce_scatter_stage(t, "ordered_reduce_scatter")};
  return std::make_unique<MpiWork>(this, std::vector<Tensor>{t}, std::move(stages));
}

std::unique_ptr<Work> MpiCommunicator::all_gather_shards_async(Tensor& t) {
  check_cpu(t, "all_gather_shards");
  if (size_ == 1 || !splits_into_shards(t.numel(), size_)) return Communicator::all_gather_shards_async(t);
  std::vector<MpiWork::Stage> stages = {all_gather_stage(t, "all_gather_shards")};
  return std::make_unique<MpiWork>(this, std::vector<Tensor>{t}, std::move(stages));
}

void MpiCommunicator::broadcast(Tensor& t, int root) {
  check_cpu(t, "broadcast");
  // MPI counts are ints: large tensors (a layer of 2 GiB) go in pieces.
  constexpr size_t kPiece = size_t{1} << 30;
  count_sent(sent_bytes::broadcast(t.nbytes(), size_, rank_ == root));
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
  const int bytes = mpi_count(t.nbytes(), "all_gather");
  Shape s = t.shape();
  s.insert(s.begin(), size_);
  Tensor out = empty(s, t.dtype(), kCPU);
  count_sent(sent_bytes::all_gather(t.nbytes(), size_));
  MPI_Request req;
  mpi_check(MPI_Iallgather(t.data_ptr(), bytes, MPI_BYTE, out.data_ptr(), bytes, MPI_BYTE, comm_, &req), "all_gather");
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
