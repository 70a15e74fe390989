// amp_train: `mpirun -np N amp_train --flags...` trains one replica per rank. Also runs without
// mpirun, as a single process. Exit codes: 0 success, 1 runtime failure, 2 bad usage or input.
//
// Setup is ordered so that no rank can be left inside a collective: every step that can fail on
// one rank alone (device, files) runs first, the ranks agree on the outcome, and only then do the
// collectives start (the NCCL communicator, the weight broadcast, the reducer's buffers).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/local_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "launch/training/checkpoint.h"
#include "launch/cli.h"
#include "launch/progress.h"
#include "launch/training/interrupt.h"
#include "launch/training/output_lock.h"
#include "launch/training/output_overlap.h"
#include "launch/training/output_path.h"
#include "launch/training/device_comm.h"
#include "launch/training/trainer.h"
#include "models/data/token_dataset.h"
#include "runtime/core/fnv1a.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/cpu/threads.h"

using namespace amp;

namespace {

// The worst of every rank's value (a MAX all-reduce; ranks report 0 for success).
int worst_over_ranks(comm::Communicator& c, int value) {
  if (c.size() == 1) return value;
  Tensor t = full({1}, value, DType::f64);
  c.all_reduce(t, comm::ReduceOp::max);
  return static_cast<int>(t.item());
}

// Every rank trains on the same kind of device. auto: CUDA only when every rank has a usable one;
// a rank whose GPUs are there but fail (busy, not ready, a driver in error) fails (exit 1, after the
// ranks' agreement: the others choose the CPU, and the set-up's agreement stops them) rather than
// train a GPU node's job on its CPU.
Device pick_device(launch::DeviceKind kind, comm::Communicator& c, bool announce) {
  if (kind == launch::DeviceKind::cpu) return kCPU;
  if (kind == launch::DeviceKind::cuda) return Device{DeviceType::cuda, 0};  // cuda_init() reports problems
  std::string reason;
  bool failing = false;
  const bool here = cuda_usable(&reason, &failing);
  const int worst = worst_over_ranks(c, here ? 0 : failing ? 2 : 1);
  if (failing)
    throw std::runtime_error("--device auto: this node has GPUs but none is usable now: " + reason +
                             "; not falling back to the CPU (--device cpu trains there)");
  if (worst == 2) return kCPU;  // a failing rank's error ends the set-up: no notice of a CPU run
  if (worst == 0) return Device{DeviceType::cuda, 0};
  if (announce && cuda_built())
    std::printf("notice: %s; training on the CPU\n",
                here ? "not every rank has a usable CUDA device" : ("no usable CUDA device (" + reason + ")").c_str());
  return kCPU;
}

// A setup stage's outcome, agreed: every rank learns the worst exit code, and rank 0 prints each
// distinct error once, naming the ranks it came from (not N copies of one message).
// A stop signal's exit (128 + N) is a stop, not an error, on every rank count.
const char* outcome_word(int code) { return code >= 128 ? "stopped" : "error"; }

int agree(comm::Communicator& c, int code, const std::string& message) {
  if (c.size() == 1) {
    if (code != 0) std::fprintf(stderr, "amp_train: %s: %s\n", outcome_word(code), message.c_str());
    return code;
  }
  constexpr size_t kChars = 4096;  // a longer message is cut, and says so
  const std::string text = message.size() <= kChars ? message : message.substr(0, kChars - 16) + " [... cut short]";
  Tensor mine = zeros({1 + static_cast<int64_t>(kChars)}, DType::f64);
  double* m = static_cast<double*>(mine.data_ptr());
  m[0] = code;
  for (size_t i = 0; i < text.size(); ++i) m[1 + i] = static_cast<unsigned char>(text[i]);
  const Tensor all = c.all_gather(mine);
  const double* a = static_cast<const double*>(all.data_ptr());
  // An error (1, 2) beats a stop (128 + signal) met by another rank: a usage error must not read as
  // a stop that a requeue script retries.
  int worst = 0, worst_error = 0;
  std::vector<std::tuple<std::string, std::vector<int>, int>> errors;  // message, the ranks that met it, code
  for (int r = 0; r < c.size(); ++r) {
    const double* row = a + r * (1 + kChars);
    worst = std::max(worst, static_cast<int>(row[0]));
    if (row[0] < 128) worst_error = std::max(worst_error, static_cast<int>(row[0]));
    if (row[0] == 0) continue;
    std::string msg;
    for (size_t i = 0; i < kChars && row[1 + i] != 0; ++i) msg.push_back(static_cast<char>(row[1 + i]));
    auto it = std::find_if(errors.begin(), errors.end(), [&](const auto& e) { return std::get<0>(e) == msg; });
    if (it == errors.end()) errors.push_back({msg, {r}, static_cast<int>(row[0])});
    else std::get<1>(*it).push_back(r);
  }
  if (c.rank() == 0)
    for (const auto& [msg, ranks, met] : errors) {
      std::string who = ranks.size() == 1 ? "rank " : "ranks ";
      for (size_t i = 0; i < ranks.size(); ++i) who += (i ? ", " : "") + std::to_string(ranks[i]);
      std::fprintf(stderr, "amp_train: %s (%s): %s\n", outcome_word(met), who.c_str(), msg.c_str());
    }
  return worst_error > 0 ? worst_error : worst;
}

// Ranks that were given the same physical GPU (per-rank CUDA_VISIBLE_DEVICES naming one GPU twice, a
// Slurm binding that shares one): found by the GPUs' UUIDs, over every rank, and named. "" when none.
std::string ranks_sharing_a_gpu(comm::Communicator& c, const std::string& uuid) {
  if (c.size() == 1) return "";
  constexpr int64_t kChars = 48 + 1 + 64;  // the UUID, '@', the host's name
  char host[65] = {};
  ::gethostname(host, sizeof host - 1);
  // A GPU that could not be named is this rank's own, shared with nobody.
  const std::string mine_gpu = uuid.empty() ? "an unnamed GPU of rank " + std::to_string(c.rank()) : uuid;
  const std::string mine_text = (mine_gpu + "@" + host).substr(0, static_cast<size_t>(kChars));
  Tensor mine = zeros({kChars}, DType::f64);
  double* m = static_cast<double*>(mine.data_ptr());
  for (size_t i = 0; i < mine_text.size(); ++i) m[i] = static_cast<unsigned char>(mine_text[i]);
  const Tensor all = c.all_gather(mine);
  const double* a = static_cast<const double*>(all.data_ptr());
  std::vector<std::pair<std::string, std::vector<int>>> gpus;  // "uuid@host", its ranks
  for (int r = 0; r < c.size(); ++r) {
    std::string text;
    for (int64_t i = 0; i < kChars && a[r * kChars + i] != 0; ++i) text.push_back(static_cast<char>(a[r * kChars + i]));
    auto it = std::find_if(gpus.begin(), gpus.end(), [&](const auto& g) { return g.first == text; });
    if (it == gpus.end()) gpus.push_back({text, {r}});
    else it->second.push_back(r);
  }
  std::string clash;
  for (const auto& [gpu, ranks] : gpus) {
    if (ranks.size() < 2) continue;
    std::string who;
    for (size_t i = 0; i < ranks.size(); ++i) who += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
    clash += (clash.empty() ? "" : "; ") + std::string("ranks ") + who + " were given the same GPU, " +
             gpu.substr(0, gpu.find('@')) + " (on " + gpu.substr(gpu.find('@') + 1) + ")";
  }
  return clash.empty() ? "" : clash + ": each rank needs a GPU of its own; start at most as many ranks on a node as it "
                                      "has GPUs, and give each rank its own CUDA_VISIBLE_DEVICES (Slurm: --gpus-per-task=1) "
                                      "or let every rank see all of them";
}

// A message that already names its rank ("rank 1: NCCL ... did not complete") is not prefixed twice.
void report_fatal(int rank, const std::string& what) {
  const std::string own = "rank " + std::to_string(rank) + ": ";
  std::fprintf(stderr, "amp_train: rank %d: error: %s\n", rank, what.rfind(own, 0) == 0 ? what.c_str() + own.size() : what.c_str());
  std::fflush(stderr);
}

// Test hook for the fault tests, read once here: AMP_DEBUG_STALL=RANK:STEP makes that rank stop
// answering, before the first collective of the set-up (STEP 0) or at the start of step STEP (the
// trainer's before-step hook); RANK:STEP:gather, in step STEP just before ZeRO-1's all-gather of the
// parameters (its peers are then inside it); RANK:STEP:checkpoint, as the checkpoint of step STEP
// begins, until a stop is asked for (then it goes on: a stop that arrives during a checkpoint);
// RANK:0:setup, in the set-up once its outputs are checked, likewise until a stop.
struct DebugStall {
  int rank = -1;
  long long step = -1;
  bool in_gather = false;
  bool in_checkpoint = false;
  bool in_setup = false;
  static DebugStall from_environment() {
    DebugStall d;
    const char* s = std::getenv("AMP_DEBUG_STALL");
    char where[16] = {0};
    const int n = s == nullptr ? 0 : std::sscanf(s, "%d:%lld:%15s", &d.rank, &d.step, where);
    if (n < 2) return {};
    d.in_gather = n == 3 && std::string(where) == "gather";
    d.in_checkpoint = n == 3 && std::string(where) == "checkpoint";
    d.in_setup = n == 3 && std::string(where) == "setup" && d.step == 0;
    return d;
  }
  void at(int rank_here, long long step_here) const {
    if (rank != rank_here || step != step_here) return;
    if (in_checkpoint || in_setup) {
      std::fprintf(stderr, "amp_train: rank %d: pausing in %s until a stop (AMP_DEBUG_STALL)\n", rank_here,
                   in_setup ? "the set-up" : ("the checkpoint of step " + std::to_string(step_here)).c_str());
      for (int i = 0; i < 6000 && launch::interrupt_signal() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    std::fprintf(stderr, "amp_train: rank %d: stalling %s%s (AMP_DEBUG_STALL)\n", rank_here,
                 step_here == 0 ? "in the set-up" : ("at step " + std::to_string(step_here)).c_str(),
                 in_gather ? ", before the parameters' all-gather" : "");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
};

// Every file the run reads and writes, for check_outputs_apart (launch/training/output_overlap.h).
std::vector<launch::NamedFile> files_of(const launch::TrainConfig& cfg) {
  using Role = launch::NamedFile::Role;
  std::vector<launch::NamedFile> files;
  // Data given as a glob (token shards): each of its files, so that no output overwrites one. A
  // pattern that matches nothing is the data loader's to refuse.
  const auto data = [&](const std::string& flag, const std::string& pattern) {
    std::vector<std::string> paths{pattern};
    try {
      paths = models::expand_data_pattern(pattern, flag);
    } catch (const std::invalid_argument&) {
    }
    for (const std::string& p : paths) files.push_back({flag, p, Role::input});
  };
  if (cfg.data != "synthetic") data("--data", cfg.data);
  for (const char* flag : {"val-data", "vocab-file"})
    if (const auto it = cfg.model_flags.find(flag); it != cfg.model_flags.end() && !it->second.empty())
      data(std::string("--") + flag, it->second);
  std::vector<launch::NamedFile> named = {
      {"--init-weights", cfg.init_weights, Role::input},
      {"--config", cfg.config_file, Role::input},
      {"--resume-from", cfg.resume_from, Role::input_directory},
      {"--checkpoint-dir", cfg.checkpoint_dir, Role::output_directory},
      {"--metrics", cfg.metrics, Role::output},
      {"--save-weights", cfg.save_weights, Role::output},
  };
  files.insert(files.end(), named.begin(), named.end());
  for (const auto& [flag, path] : {std::pair{"--metrics", cfg.metrics}, std::pair{"--save-weights", cfg.save_weights}})
    if (!path.empty()) files.push_back({std::string("the lock file of ") + flag, launch::lock_path_of(path), Role::output});
  return files;
}

// Whether each rank's `text` is rank 0's, by a 64-bit hash gathered over the ranks (collective).
std::vector<bool> same_as_rank0(comm::Communicator& c, const std::string& text) {
  const uint64_t h = fnv1a(text.data(), text.size());
  Tensor mine = zeros({2}, DType::f64);  // two exact halves of the 64 bits
  static_cast<double*>(mine.data_ptr())[0] = static_cast<double>(h >> 32);
  static_cast<double*>(mine.data_ptr())[1] = static_cast<double>(h & 0xffffffffu);
  const Tensor all = c.all_gather(mine);
  const double* a = static_cast<const double*>(all.data_ptr());
  std::vector<bool> same(static_cast<size_t>(c.size()));
  for (int r = 0; r < c.size(); ++r) same[static_cast<size_t>(r)] = a[2 * r] == a[0] && a[2 * r + 1] == a[1];
  return same;
}

// Whether this rank was given rank 0's flags ("" when it was). A job whose ranks run other flags (an
// MPMD launch, a --config file that differs from node to node) trains wrong in silence (another
// seed: another teacher's data), or fails later in a collective whose sizes do not match, with MPI's
// words. Where a rank's node may differ: --threads (its cores), --data and --val-data (compared by
// content: other_data_than_rank0), --config (its keys are among the flags).
std::string flags_unlike_rank0(comm::Communicator& c, const std::vector<std::string>& given) {
  if (c.size() == 1) return "";
  std::string text;
  for (const std::string& f : given) {
    const std::string name = f.substr(0, f.find(' '));
    if (name != "threads" && name != "data" && name != "val-data" && name != "config") text += f + "\n";
  }
  const std::vector<bool> same = same_as_rank0(c, text);
  if (std::all_of(same.begin(), same.end(), [](bool b) { return b; })) return "";
  // Some rank differs (every rank sees it): rank 0's flags go to every rank, which names its differences.
  constexpr int64_t kChars = 65536;
  Tensor theirs = zeros({kChars}, DType::f64);
  double* t = static_cast<double*>(theirs.data_ptr());
  if (c.rank() == 0)
    for (size_t i = 0; i < text.size() && i < static_cast<size_t>(kChars); ++i) t[i] = static_cast<unsigned char>(text[i]);
  c.broadcast(theirs, 0);
  if (same[static_cast<size_t>(c.rank())]) return "";
  auto parse = [](const std::string& lines) {
    std::map<std::string, std::string> m;
    size_t at = 0;
    for (size_t end; (end = lines.find('\n', at)) != std::string::npos; at = end + 1) {
      const std::string line = lines.substr(at, end - at);
      const size_t space = line.find(' ');
      m[line.substr(0, space)] = space == std::string::npos ? "" : line.substr(space + 1);
    }
    return m;
  };
  std::string rank0_text;
  for (int64_t i = 0; i < kChars && t[i] != 0; ++i) rank0_text.push_back(static_cast<char>(t[i]));
  const auto ours = parse(text), rank0 = parse(rank0_text);
  auto shown = [](const std::string& k, const std::string& v) { return "--" + k + (v.empty() ? "" : " " + v); };
  std::string diff;
  auto add = [&diff](const std::string& d) { diff += (diff.empty() ? "" : "; ") + d; };
  for (const auto& [k, v] : ours) {
    const auto it = rank0.find(k);
    if (it == rank0.end()) add(shown(k, v) + " (rank 0: not given)");
    else if (it->second != v) add(shown(k, v) + " (rank 0: " + shown(k, it->second) + ")");
  }
  for (const auto& [k, v] : rank0)
    if (!ours.count(k)) add("no --" + k + " (rank 0: " + shown(k, v) + ")");
  return "this rank's flags are not rank 0's: " + (diff.empty() ? std::string("they differ") : diff) +
         ". Every rank of a job runs the same flags (an MPMD launch or a --config that differs between nodes "
         "would train each rank otherwise); only --threads, --data and --val-data (compared by content) may differ";
}

// Whether this rank reads the data rank 0 reads: the same files (names, sizes, every byte's
// checksum: models/data/dataset.h), compared over every rank. A node whose own copy of the data
// differs would otherwise train its ranks on other samples, silently. "" when it does.
std::string other_data_than_rank0(comm::Communicator& c, const models::Dataset& data, const std::string& flag_value) {
  if (c.size() == 1) return "";
  if (same_as_rank0(c, data.resume_identity().dump() + data.content_checksums().dump() +
                          data.validation_identity().dump())[static_cast<size_t>(c.rank())])
    return "";
  return "--data " + flag_value + " (or --val-data) is not what rank 0 reads: another list of files, or the same names with other "
         "sizes or bytes (" + data.describe() + "): each node must hold the same files";
}

int train_on_every_rank(comm::MpiSession& mpi, const launch::TrainConfig& cfg, const std::string& gpu_chosen_from,
                        std::unique_ptr<comm::Communicator>& host_comm,
                        std::unique_ptr<comm::Communicator>& device_comm, std::unique_ptr<launch::Trainer>& trainer) {
  const bool rank0 = mpi.rank() == 0;
  if (mpi.active() && mpi.size() > 1) host_comm = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD);
  else host_comm = std::make_unique<comm::LocalCommunicator>();
  host_comm->set_timeout(cfg.comm_timeout);
  std::string fewer_threads;  // why the default is less than the node's share, for rank 0's notice
  set_num_threads(cfg.threads > 0 ? cfg.threads : comm::default_threads_per_rank(host_comm->local_size(), &fewer_threads));

  // Each stage runs on every rank; a rank whose stage fails reports it in the agreement that
  // follows. A collective that fails (a timeout) is rethrown: its peers may still be inside it.
  int code = 0;
  std::string message;
  auto attempt = [&](const auto& stage) {
    if (code != 0) return;
    try {
      stage();
    } catch (const comm::CommError&) {
      throw;
    } catch (const std::invalid_argument& e) {  // bad input: files, shapes, sizes
      code = 2;
      message = e.what();
    } catch (const std::bad_alloc&) {
      code = 1;
      message = "out of memory while setting up (" + models::configure_model(cfg.model, cfg.model_flags)->size_flags() +
                " too large for this machine?)";
    } catch (const std::exception& e) {
      code = 1;
      message = e.what();
    }
  };
  auto agreed = [&](const char* context) {
    host_comm->set_context(std::string("the set-up (") + context + ")");
    if (code == 0 && launch::interrupted_during_setup()) {
      const int sig = launch::interrupt_signal();
      code = 128 + sig;
      message = std::string("interrupted (") + launch::signal_label(sig) + ") during the set-up (" + context +
                "), before the first step: nothing was trained or written";
    }
    return (code = agree(*host_comm, code, message)) == 0;
  };

  // 1. What can fail on one rank alone: the outputs, the device, then the model, weights and data.
  const DebugStall stall = DebugStall::from_environment();
  if (!stall.in_setup) stall.at(mpi.rank(), 0);
  // A stop asked for during the set-up (a requeue's SIGTERM while a large checkpoint loads) ends it
  // after the stage in flight, every rank together, before the first step: nothing trained, nothing
  // written, exit 128 + the signal (it ended the process with no word, its lock file left behind).
  launch::install_interrupt_handlers(rank0);
  attempt([&] {
    host_comm->set_context("the set-up (comparing the ranks' flags)");
    const std::string unlike = flags_unlike_rank0(*host_comm, cfg.given_flags);
    if (!unlike.empty()) throw std::invalid_argument(unlike);
  });
  if (!agreed("comparing the ranks' flags")) return code;
  Device device = kCPU;
  // A --checkpoint-dir this run made is removed again, if still empty, when the set-up fails (exit 2
  // writes nothing). Declared before the locks: removed after their lock file is.
  struct MadeDirectories {
    std::string leaf, top;  // --checkpoint-dir, and the topmost directory its check made
    ~MadeDirectories() {
      if (top.empty()) return;
      std::error_code ec;
      // Up from the leaf, each while empty (remove fails, harmlessly, on one that is not).
      for (std::filesystem::path p = launch::normal_directory(leaf); !p.empty(); p = p.parent_path())
        if (!std::filesystem::remove(p, ec) || p == std::filesystem::path(top)) break;
    }
  } made_checkpoint_dir;
  launch::OutputLocks locks;  // held until training ends: another live run cannot write our outputs
  attempt([&] {  // rank 0 writes the outputs: check and lock them before anything runs
    if (!rank0) return;
    // The checkpoint directory first (it is made when missing): the metrics may be written in it.
    if (!cfg.checkpoint_dir.empty()) {
      made_checkpoint_dir.leaf = cfg.checkpoint_dir;
      launch::check_checkpoint_dir(cfg.checkpoint_dir, &made_checkpoint_dir.top);
    }
    launch::check_output_path("--save-weights", cfg.save_weights);
    launch::check_output_path("--metrics", cfg.metrics);
    launch::check_outputs_apart(files_of(cfg));
    using Lock = launch::OutputLocks::Kind;
    locks.acquire("--checkpoint-dir", cfg.checkpoint_dir, Lock::directory);
    locks.acquire("--metrics", cfg.metrics, Lock::file_written_in_place);
    locks.acquire("--save-weights", cfg.save_weights, Lock::replaced_file);
    for (const std::string& t : launch::remove_stale_temporaries(cfg.save_weights))
      std::printf("notice: removed '%s', a temporary file left by a run that was killed while saving\n", t.c_str());
  });
  // Every rank learns at once that rank 0's outputs were refused (a run holding them, say): the
  // others must not go on into the device's collective while rank 0 waits in this one.
  if (!agreed("checking the outputs")) return code;
  if (stall.in_setup) stall.at(mpi.rank(), 0);  // its outputs checked and locked, its directory made
  host_comm->set_context("the set-up (choosing the device)");
  attempt([&] {
    device = pick_device(cfg.device, *host_comm, rank0);
    if (device.is_cuda()) {
      cuda_init(host_comm->local_rank(), host_comm->local_size());
      cuda_set_allow_tf32(cfg.allow_tf32);
    }
  });
  if (!agreed("agreeing on the device")) return code;
  if (device.is_cuda()) {
    attempt([&] {
      std::string uuid;  // "" when it cannot be read: this rank still joins the gather below
      try {
        uuid = cuda_device_uuid();
      } catch (const std::exception&) {
      }
      const std::string clash = ranks_sharing_a_gpu(*host_comm, uuid);
      if (!clash.empty()) throw std::invalid_argument(clash);
    });
    if (!agreed("checking that each rank has a GPU of its own")) return code;
  }
  // 2. The collective set-up.
  comm::Communicator* c = host_comm.get();
  attempt([&] {
    if (device.is_cuda() && host_comm->size() > 1) {
      device_comm = launch::make_device_communicator(MPI_COMM_WORLD, host_comm->local_rank());
      device_comm->set_timeout(cfg.comm_timeout);
      c = device_comm.get();
    }
  });
  if (!agreed("creating the device communicator")) return code;
  attempt([&] { trainer = std::make_unique<launch::Trainer>(cfg, *c, device); });
  if (!agreed("building the model and loading the data")) return code;
  attempt([&] {
    const std::string other = other_data_than_rank0(*host_comm, trainer->data(), cfg.data);
    if (!other.empty()) throw std::invalid_argument(other);
  });
  if (!agreed("checking that every rank reads the same data")) return code;
  if (rank0) {
    // Flags for the GPU only are not silently dropped on the CPU.
    if (!device.is_cuda() && cfg.allow_tf32) std::printf("notice: --allow-tf32 has no effect on the CPU\n");
    if (!device.is_cuda() && cfg.profile_step > 0) std::printf("notice: --profile-step has no effect on the CPU\n");
    const std::string model = trainer->spec().describe(cfg.data);
    const std::string threads = device.is_cuda() ? "" : " (" + std::to_string(get_num_threads()) + " thread(s) a rank)";
    const std::string gpus = !device.is_cuda() || mpi.size() == 1 ? threads
                             : gpu_chosen_from.empty() ? " (each rank's GPU: its node-local rank's, after MPI_Init)"
                                                       : " (each rank's GPU: " + gpu_chosen_from + "'s, before MPI_Init)";
    std::printf("amp_train: %d rank(s), %s%s, %s, batch %lld x %lld micro-batches x %d ranks, amp %s, loss scaling %s%s\n",
                mpi.size(), device.str().c_str(), gpus.c_str(), model.c_str(),
                static_cast<long long>(cfg.batch_size), static_cast<long long>(cfg.micro_batches), mpi.size(),
                cfg.amp == launch::AmpMode::off ? "off" : cfg.amp == launch::AmpMode::fp16 ? "fp16" : "bf16",
                trainer->scaling() ? "on" : "off", cfg.allow_tf32 && device.is_cuda() ? ", fp32 products in TF32" : "");
    if (cfg.data != "synthetic") std::printf("amp_train: data: %s\n", trainer->data().describe().c_str());
    if (const std::string note = trainer->spec().start_note(); !note.empty()) std::printf("amp_train: note: %s\n", note.c_str());
    if (!device.is_cuda() && !fewer_threads.empty())
      std::printf("amp_train: notice: %d thread(s) a rank: %s\n", get_num_threads(), fewer_threads.c_str());
  }
  std::fflush(stdout);
  // The set-up's last look at a stop request, on every rank together: one that came before this
  // still stops the set-up (its acknowledgement said so); from here, one stops after a step.
  launch::interrupt_training_begins();
  if (!agreed("starting training")) return code;

  made_checkpoint_dir.top.clear();  // the run's from here, whatever becomes of it
  // 3. Training. From here SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGPIPE stop the job after a step, and
  // save (launch/training/interrupt.h; during the set-up they stopped it before the first step).
  trainer->set_progress(launch::progress_printer(cfg, trainer->spec(), trainer->start_step(),
                                                 trainer->samples_per_step()));
  if (stall.rank >= 0 && stall.step > 0) {
    auto hook = [stall, &mpi](int64_t step) { stall.at(mpi.rank(), step); };
    if (stall.in_gather) trainer->set_before_gather(hook);
    else if (stall.in_checkpoint) trainer->set_before_checkpoint(hook);
    else trainer->set_before_step(hook);
  }
  const launch::TrainResult result = trainer->run();
  if (rank0 && result.interrupted_by == 0 && result.errors.empty() && (std::fflush(stdout) != 0 || std::ferror(stdout)))
    std::fprintf(stderr, "amp_train: warning: a write to standard output failed: progress lines were lost\n");
  if (!result.errors.empty()) {  // trained, but an output was not saved: named, and exit 1 (no abort)
    if (rank0)
      for (const std::string& e : result.errors) std::fprintf(stderr, "amp_train: error: %s\n", e.c_str());
    return 1;
  }
  if (result.interrupted_by != 0) {
    if (rank0)
      std::fprintf(stderr, "amp_train: interrupted by %s after step %lld of %lld%s\n",
                   launch::signal_label(result.interrupted_by), static_cast<long long>(result.steps_done),
                   static_cast<long long>(cfg.steps),
                   cfg.save_weights.empty() ? "" : ("; weights saved to " + cfg.save_weights).c_str());
    return 128 + result.interrupted_by;
  }
  return 0;
}

// Before MPI_Init and any other CUDA call, a rank that will train on a GPU makes current the GPU of its
// node-local rank, as the launcher's environment gives it: an MPI library that touches CUDA in MPI_Init
// (a CUDA-aware Open MPI) then creates each rank's context on its own GPU instead of all on GPU 0.
// cuda_init checks after MPI_Init that MPI places the rank at the same node-local rank. The flags are
// parsed here only to learn --device; they are parsed again after MPI_Init, which reports any error.
// Returns the variable the GPU was chosen from, or "" when none was chosen here.
std::string select_gpu_before_mpi(int argc, char** argv) {
  if (!cuda_built()) return "";
  const launch::CliResult early = launch::parse_cli(argc, argv, std::numeric_limits<int>::max());
  if (!early.config || early.config->device == launch::DeviceKind::cpu) return "";
  std::optional<comm::NodePlace> place;
  try {
    place = comm::node_place_from_launcher();
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "amp_train: warning: %s: the GPU is chosen after MPI_Init\n", e.what());
    return "";
  }
  try {
    if (place && cuda_select_device_before_mpi(place->local_rank, place->local_size)) return place->source;
  } catch (const std::exception& e) {  // the device exists but cannot be made current: the job cannot run
    std::fprintf(stderr, "amp_train: error: selecting GPU %d before MPI_Init: %s\n", place->local_rank, e.what());
    std::exit(1);
  }
  return "";
}

// The communicators and the trainer outlive the handler: a rank that fails alone must not run their
// destructors (some are collective: freeing a shared window waits for peers that may never come).
int train(comm::MpiSession& mpi, const launch::TrainConfig& cfg, const std::string& gpu_chosen_from) {
  std::unique_ptr<comm::Communicator> host_comm, device_comm;
  std::unique_ptr<launch::Trainer> trainer;
  try {
    return train_on_every_rank(mpi, cfg, gpu_chosen_from, host_comm, device_comm, trainer);
  } catch (const launch::JobError&) {
    throw;  // every rank is here: the collective destructors meet
  } catch (const std::exception& e) {
    // This rank alone, perhaps with peers inside a collective: the whole job is torn down.
    report_fatal(mpi.rank(), e.what());
    comm::MpiSession::abort(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread starts: no stop signal is ever run on a thread that computes.
  launch::route_stop_signals_to_their_own_thread();
  // Past a file-size limit (ulimit -f) a write fails with EFBIG, which each output reports naming
  // its file, instead of SIGXFSZ killing the process (and the outputs not yet written).
  std::signal(SIGXFSZ, SIG_IGN);
  const std::string gpu_chosen_from = select_gpu_before_mpi(argc, argv);
  comm::MpiSession mpi(&argc, &argv);
  const launch::CliResult cli = launch::parse_cli(argc, argv, mpi.size());
  const bool help = !cli.config && cli.exit_code == 0;  // --help: printed however the process was started
  if (const std::string alone = comm::srun_tasks_without_world(mpi.size()); !alone.empty() && !help) {
    std::fprintf(stderr, "amp_train: error: %s\n", alone.c_str());
    return 2;
  }
  if (!cli.config) {
    if (mpi.rank() == 0) std::fprintf(cli.exit_code == 0 ? stdout : stderr, "%s\n", cli.message.c_str());
    return cli.exit_code;
  }
  if (mpi.rank() == 0)
    for (const std::string& n : cli.notices) std::printf("%s\n", n.c_str());
  try {
    return train(mpi, *cli.config, gpu_chosen_from);
  } catch (const launch::JobError& e) {  // met by every rank at the same point: reported once, a clean end
    if (mpi.rank() == 0) std::fprintf(stderr, "amp_train: error: %s\n", e.what());
    return 1;
  }
}
