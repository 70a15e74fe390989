// The process's MPI lifetime: MPI_Init_thread on construction, MPI_Finalize on destruction, and
// abort() for fatal errors so that mpirun tears the whole job down instead of leaving peers hanging.
// A process not started by a launcher (mpirun, srun) skips MPI altogether: it is a single rank.
#pragma once

#include <optional>
#include <string>

namespace amp::comm {

class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool active() const { return active_; }  // MPI was initialised
  [[noreturn]] static void abort(int code);

 private:
  int rank_ = 0, size_ = 1;
  bool active_ = false;
};

// Whether a launcher started this process (Open MPI, MPICH/Hydra, PMIx or Slurm variables are set).
bool launched_by_mpi();

// Where the launcher placed this process on its node, from its environment, before MPI_Init: Open
// MPI's OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_SIZE, or MPICH's (Hydra) MPI_LOCALRANKID
// and MPI_LOCALNRANKS, or Slurm's srun: SLURM_LOCALID, and the node's count from
// SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID. nullopt when the process was not launched by MPI or no
// launcher's variables are set; a value that is not a count (or a rank outside [0, size)) throws
// std::invalid_argument naming the variable.
struct NodePlace {
  int local_rank = 0, local_size = 1;
  std::string source;  // the rank's variable, to name in messages
};
std::optional<NodePlace> node_place_from_launcher();

// srun started this process as one of several tasks (SLURM_STEP_NUM_TASKS > 1) but MPI's world has
// one rank (world_size), and no launcher asked for a world of one: srun without an MPI plugin this
// MPI speaks, where each task would train alone. The message to refuse it with, or "".
std::string srun_tasks_without_world(int world_size);

// Threads per rank so that the ranks of one node share its cores without oversubscribing: the node's
// CPUs over its ranks, or fewer where this process may run on fewer (its affinity: Slurm's
// --cpus-per-task, taskset, a cgroup's cpuset).
// Where that is fewer than the node's CPUs over its ranks, *fewer_because (if given) says why (the
// affinity, and who sets it), for a notice; it is left as it is otherwise.
int default_threads_per_rank(int local_ranks, std::string* fewer_because = nullptr);

}  // namespace amp::comm
