// The process's MPI lifetime: MPI_Init_thread on construction, MPI_Finalize on destruction, and
// abort() for fatal errors so that mpirun tears the whole job down instead of leaving peers hanging.
#pragma once

namespace amp::comm {

class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  [[noreturn]] static void abort(int code);

 private:
  int rank_ = 0, size_ = 1;
};

// Threads per rank so that the ranks of one node share its cores without oversubscribing.
int default_threads_per_rank(int local_ranks);

}  // namespace amp::comm
