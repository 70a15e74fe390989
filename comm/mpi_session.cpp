#include "comm/mpi_session.h"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace amp::comm {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

namespace {

int count_from_environment(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (*value < '0' || *value > '9' || *end != '\0' || errno != 0 || v > (1 << 20))
    throw std::invalid_argument(std::string("the launcher's ") + name + "='" + value + "' is not a count");
  return static_cast<int>(v);
}

// Slurm's srun: SLURM_LOCALID, and the node's task count from SLURM_STEP_TASKS_PER_NODE at index
// SLURM_NODEID ("2(x3),1": 2 tasks on each of the step's first 3 nodes, then 1).
std::optional<NodePlace> slurm_place() {
  const char* id = std::getenv("SLURM_LOCALID");
  const char* node = std::getenv("SLURM_NODEID");
  const char* per_node = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  if (id == nullptr || node == nullptr || per_node == nullptr) return std::nullopt;
  const int local = count_from_environment("SLURM_LOCALID", id);
  const int index = count_from_environment("SLURM_NODEID", node);
  const std::string list = per_node;
  auto bad = [&] {
    return std::invalid_argument(std::string("the launcher's SLURM_STEP_TASKS_PER_NODE='") + per_node +
                                 "' does not give the tasks of node " + std::to_string(index) + " (SLURM_NODEID)");
  };
  int first = 0;  // the index of the entry's first node
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string entry = list.substr(at, comma - at);
    const size_t paren = entry.find("(x");
    if (paren != std::string::npos && entry.back() != ')') throw bad();
    const std::string tasks = entry.substr(0, paren), repeat = paren == std::string::npos ? "1" : entry.substr(paren + 2, entry.size() - paren - 3);
    int n = 0, times = 0;
    try {
      n = count_from_environment("SLURM_STEP_TASKS_PER_NODE", tasks.c_str());
      times = count_from_environment("SLURM_STEP_TASKS_PER_NODE", repeat.c_str());
    } catch (const std::invalid_argument&) {
      throw bad();
    }
    if (index < first + times) {
      if (local >= n)
        throw std::invalid_argument(std::string("the launcher's SLURM_LOCALID=") + id + " is not below node " +
                                    std::to_string(index) + "'s " + std::to_string(n) + " tasks (SLURM_STEP_TASKS_PER_NODE='" +
                                    per_node + "')");
      return NodePlace{local, n, "SLURM_LOCALID"};
    }
    first += times;
    at = comma + 1;
  }
  throw bad();
}

}  // namespace

std::optional<NodePlace> node_place_from_launcher() {
  if (!launched_by_mpi()) return std::nullopt;
  const std::pair<const char*, const char*> pairs[] = {{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                                                       {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"}};
  for (const auto& [rank_var, size_var] : pairs) {
    const char* r = std::getenv(rank_var);
    const char* n = std::getenv(size_var);
    if (r == nullptr || n == nullptr) continue;
    NodePlace p{count_from_environment(rank_var, r), count_from_environment(size_var, n), rank_var};
    if (p.local_rank >= p.local_size)
      throw std::invalid_argument(std::string("the launcher's ") + rank_var + "=" + r + " is not below " + size_var +
                                  "=" + n);
    return p;
  }
  // After the MPI launchers' own: inside a Slurm allocation, mpirun's ranks inherit the batch step's
  // SLURM_LOCALID (0 on every rank), which is not theirs.
  return slurm_place();
}

MpiSession::MpiSession(int* argc, char*** argv) {
  if (!launched_by_mpi()) return;
  active_ = true;
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiSession::~MpiSession() {
  if (!active_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void MpiSession::abort(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

std::string srun_tasks_without_world(int world_size) {
  const char* tasks = std::getenv("SLURM_STEP_NUM_TASKS");
  if (world_size != 1 || tasks == nullptr) return "";
  int n = 0;
  try {
    n = count_from_environment("SLURM_STEP_NUM_TASKS", tasks);
  } catch (const std::invalid_argument&) {
    return "";  // not srun's count: nothing to compare
  }
  if (n <= 1) return "";  // one task: a world of one is what srun started
  // mpirun -np 1 (or mpiexec -n 1) inside a step of several tasks: its rank's world of one is meant.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* size = std::getenv(v);
    if (size != nullptr && std::string(size) == "1") return "";
  }
  const char* id = std::getenv("SLURM_PROCID");
  return std::string("srun started ") + tasks + " tasks (SLURM_STEP_NUM_TASKS=" + tasks + "), but MPI made task " +
         (id ? id : "?") + " a world of its own, 1 rank: srun's MPI plugin did not start this MPI's ranks (" +
         (launched_by_mpi() ? "a plugin it does not speak" : "none: srun --mpi=none, or MpiDefault=none") +
         "), and each task would train alone, writing the same files. Launch with srun --mpi=pmix (srun --mpi=list "
         "shows the plugins), or with mpirun inside the allocation";
}

namespace {
int node_cpus() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int affinity_cpus() {  // the CPUs this process may run on: Slurm's --cpus-per-task, taskset, a cpuset
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : node_cpus();
}
}  // namespace

int default_threads_per_rank(int local_ranks, std::string* fewer_because) {
  // A rank bound to its own CPUs gets them all; ranks that share CPUs (none bound, or several bound to
  // one socket) share the node's.
  const int share = std::max(1, node_cpus() / std::max(1, local_ranks)), mine = affinity_cpus();
  if (fewer_because == nullptr || mine >= share) return std::min(mine, share);
  std::string& why = *fewer_because;
  why = "each rank may run on " + std::to_string(mine) + " of the node's " + std::to_string(node_cpus()) + " CPUs (its affinity)";
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (std::getenv("SLURM_CPUS_PER_TASK") != nullptr)
    why += ": Slurm's --cpus-per-task sets it";
  else if (world != nullptr && std::atoi(world) <= 2)
    why += ": Open MPI's mpirun binds each rank to one core where it starts 2 ranks or fewer (mpirun --bind-to none, "
           "or --map-by slot:PE=" + std::to_string(share) + ", gives it " + std::to_string(share) + ")";
  else if (world != nullptr)
    why += ": mpirun's binding (--report-bindings shows it; --bind-to none lifts it)";
  else
    why += ": taskset, a cpuset or the launcher's binding";
  why += "; --threads N overrides";
  return mine;
}

}  // namespace amp::comm
