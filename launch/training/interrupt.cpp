#include "launch/training/interrupt.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

namespace amp::launch {

namespace {
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP};  // and SIGPIPE: see g_watched_fds

// The first signal and when it came (CLOCK_MONOTONIC, milliseconds). Atomics, lock-free: the handler
// may run in any thread (OpenMP's, MPI's), two at once for two copies of one signal; the first to
// exchange g_signal from 0 is the request, and publishes its time before its number.
std::atomic<int> g_signal{0};
std::atomic<long long> g_first_ms{0};
std::atomic<bool> g_announce{false}, g_announced{false};
// The phase and whether a request came in it, one atomic so that they never disagree: bit 0 set once
// training begins, bit 1 once a request is taken (a request in the set-up: 2; in training: 3).
std::atomic<int> g_state{0};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<long long>::is_always_lock_free,
              "signal handlers need lock-free atomics");

long long monotonic_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<long long>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

// Standard output and error, where they are a pipe or a terminal: descriptions of their own, which
// the first stop request makes non-blocking. mpirun stops reading its ranks' output when it is
// signalled and kills them a second or two later; a rank whose write to a full pipe blocked would
// wait there, never saving. Its own description (reopened through /proc, so the shell's stays as it
// was) lets the blocked write return at the signal, and every later line is dropped, not waited on,
// where nobody reads. A regular file never blocks and is left alone (a reopening would lose its offset).
int g_private_fds[2] = {-1, -1};

void make_private(int fd, int slot) {
  struct stat st {};
  if (g_private_fds[slot] >= 0 || ::fstat(fd, &st) != 0 || !(S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode))) return;
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  // O_NONBLOCK: a pipe whose reader is gone fails (ENXIO) rather than waits; cleared once open.
  const int mine = ::open(self.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
  if (mine < 0) return;  // a socket, no /proc: left as it is
  const int flags = ::fcntl(mine, F_GETFL);
  if (flags < 0 || ::fcntl(mine, F_SETFL, flags & ~O_NONBLOCK) != 0 || ::dup2(mine, fd) < 0) {
    ::close(mine);
    return;
  }
  ::close(mine);
  g_private_fds[slot] = fd;
}

void stop_blocking_on_output() {  // async-signal-safe: fcntl only
  for (const int fd : g_private_fds)
    if (fd >= 0) {
      const int flags = ::fcntl(fd, F_GETFL);
      if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    }
}

// Standard output and error where they are pipes: watched for a reader that is gone (| head, a tee
// that died), which a pipe polls as POLLERR. SIGPIPE's disposition is left as it is (Open MPI's threads
// raise it on their own sockets, where its default is what they expect). A pipe found without its
// reader is replaced by /dev/null, so that no later write raises SIGPIPE, and is a stop request
// labelled SIGPIPE.
std::atomic<int> g_watched_fds[2] = {-1, -1};
std::atomic<bool> g_output_gone{false};

// Async-signal-safe: poll, open, dup2, close.
bool drop_output_without_reader() {
  pollfd fds[2] = {{g_watched_fds[0].load(), POLLOUT, 0}, {g_watched_fds[1].load(), POLLOUT, 0}};  // -1: not polled
  if (fds[0].fd < 0 && fds[1].fd < 0) return false;
  if (::poll(fds, 2, 0) <= 0) return false;
  bool gone = false;
  for (int i = 0; i < 2; ++i)
    if (fds[i].revents & POLLERR) {
      const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
      if (null >= 0) {
        (void)::dup2(null, fds[i].fd);
        ::close(null);
      }
      g_watched_fds[i].store(-1);
      gone = true;
    }
  if (gone) g_output_gone.store(true);
  return gone;
}

void say(const char* text) {  // write(2): the only output a handler may make
  // Never waited on: the one thread that takes the stop signals runs this (a second Ctrl-C must still
  // reach it), and standard error may be a socket or a pipe that nobody reads.
  pollfd out = {STDERR_FILENO, POLLOUT, 0};
  if (::poll(&out, 1, 0) != 1 || !(out.revents & POLLOUT)) return;
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

// The first request: kept, output made non-blocking, acknowledged (rank 0). Async-signal-safe.
bool take_request(int signum) {
  const long long now = monotonic_ms();
  long long first = 0;
  if (!g_first_ms.compare_exchange_strong(first, now)) return false;  // another came first
  g_signal.store(signum);
  const bool training = (g_state.fetch_or(2) & 1) != 0;  // the phase the request came in
  stop_blocking_on_output();
  // Now, not when the step in flight ends (a user who saw nothing would press Ctrl-C again); not into
  // a pipe without its reader (SIGPIPE), which would end the process.
  if (g_announce.load() && !drop_output_without_reader()) {
    say("amp_train: interrupted (");
    say(signal_label(signum));
    static_assert(kDuplicateWindowSeconds == 2.0, "the message says 2 s");
    say(signum == SIGPIPE ? ", standard output's reader is gone): stopping " : "): stopping ");
    say(training ? "after the step in flight" : "before the first step, once this stage of the set-up ends");
    say(signum == SIGPIPE ? "\n" : signum == SIGINT ? "; Ctrl-C again (after 2 s) stops at once\n" : " (SIGKILL stops at once)\n");
    g_announced.store(true);
  }
  return true;
}

// The thread to wake after a request (route_stop_signals_to_their_own_thread's caller), if any.
std::atomic<bool> g_wake_main{false};
pthread_t g_main_thread;

extern "C" void on_wake(int) {}  // its delivery is the point: a blocking call in the main thread returns

extern "C" void on_interrupt(int signum) {
  const int saved_errno = errno;  // the code this handler interrupted may be about to read it
  const long long now = monotonic_ms();
  const bool first = take_request(signum);
  if (first && g_wake_main.load()) (void)::pthread_kill(g_main_thread, SIGURG);  // async-signal-safe
  if (!first && signum != SIGHUP) {  // SIGHUP again: the terminal is gone, nobody to tell
    const bool copy = static_cast<double>(now - g_first_ms.load()) < kDuplicateWindowSeconds * 1000.0;
    // Ctrl-C again: now, as the default would. In the set-up (nothing to save yet) any stop signal
    // again: a stage that hangs (a wedged device, a read that never returns) still ends.
    const bool setup = (g_state.load() & 1) == 0;
    if (!copy && ((signum == SIGINT && g_signal.load() == SIGINT) || setup)) {
      std::signal(signum, SIG_DFL);
      ::raise(signum);
    } else if (!copy && !drop_output_without_reader()) {
      say("amp_train: ");
      say(signal_label(signum));
      say(": already stopping after the step in flight (asked by ");
      say(signal_label(g_signal.load()));
      say(signum == SIGINT ? "; Ctrl-C twice stops at once, SIGKILL too)\n" : "; SIGKILL stops at once)\n");
    }
  }
  errno = saved_errno;
}
}  // namespace

void route_stop_signals_to_their_own_thread() {
  sigset_t stops;
  sigemptyset(&stops);
  for (const int s : kStopSignals) sigaddset(&stops, s);
  // The main thread's wake-up runs on a stack of its own: never below a JIT kernel's stack pointer.
  // Static storage, never freed: a signal may come while exit() runs the destructors.
  alignas(64) static char wake_stack[1 << 16];
  stack_t ss = {};
  ss.ss_sp = wake_stack;
  ss.ss_size = sizeof wake_stack;
  struct sigaction wake = {};
  wake.sa_handler = on_wake;
  sigemptyset(&wake.sa_mask);
  wake.sa_flags = SA_ONSTACK | SA_RESTART;  // a restarted write to output made non-blocking returns
  if (::sigaltstack(&ss, nullptr) == 0 && ::sigaction(SIGURG, &wake, nullptr) == 0) {
    g_main_thread = ::pthread_self();
    g_wake_main.store(true);
  }
  // The receiver: every stop signal unblocked (whatever this process inherited), waiting for them.
  try {
    std::thread([stops] {
      (void)::pthread_setname_np(::pthread_self(), "amp-signals");
      ::pthread_sigmask(SIG_UNBLOCK, &stops, nullptr);
      for (;;) ::pause();
    }).detach();
  } catch (const std::system_error&) {
    return;  // no thread to be had (a pids limit): the signals are taken by any thread, as they were
  }
  ::pthread_sigmask(SIG_BLOCK, &stops, nullptr);
}

void install_interrupt_handlers(bool announce) {
  struct sigaction sa = {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  // One handler at a time: the first-signal bookkeeping is not raced.
  for (const int s : kStopSignals) sigaddset(&sa.sa_mask, s);
  sa.sa_flags = SA_RESTART;  // a blocking read or collective goes on
  std::fflush(stdout);  // what is buffered goes out through the description it was written for
  std::fflush(stderr);
  make_private(STDOUT_FILENO, 0);
  make_private(STDERR_FILENO, 1);
  g_signal.store(0);
  g_first_ms.store(0);
  g_state.store(0);
  g_announce.store(announce);
  g_announced.store(false);
  g_output_gone.store(false);
  for (const int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat st {};
    g_watched_fds[fd - STDOUT_FILENO].store(::fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode) ? fd : -1);
  }
  for (const int s : kStopSignals) {
    struct sigaction was = {};
    // nohup's SIGHUP stays ignored: a run started under it outlives the terminal, as asked.
    if (s == SIGHUP && sigaction(s, nullptr, &was) == 0 && was.sa_handler == SIG_IGN) continue;
    sigaction(s, &sa, nullptr);
  }
}

int interrupt_signal() {
  if (g_signal.load() == 0 && drop_output_without_reader()) take_request(SIGPIPE);
  return g_signal.load();
}

bool standard_output_gone() {
  (void)interrupt_signal();  // looks once more
  return g_output_gone.load();
}

void print_guarded(const std::function<void()>& print) {
  sigset_t pipe, was;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, &was);
  print();
  const timespec now = {0, 0};
  while (sigtimedwait(&pipe, nullptr, &now) == SIGPIPE) {  // this write's: consumed, never delivered
  }
  pthread_sigmask(SIG_SETMASK, &was, nullptr);
  (void)interrupt_signal();
}

bool interrupt_announced() { return g_announced.load(); }

bool interrupt_training_begins() {
  int setup = 0;
  return g_state.compare_exchange_strong(setup, 1) || g_state.load() == 1;  // 2: a request in the set-up
}

bool interrupted_during_setup() {
  (void)interrupt_signal();  // looks for a reader gone
  return g_state.load() == 2;
}

const char* signal_label(int signum) {
  if (signum == SIGINT) return "SIGINT";
  if (signum == SIGTERM) return "SIGTERM";
  if (signum == SIGUSR1) return "SIGUSR1";
  if (signum == SIGUSR2) return "SIGUSR2";
  if (signum == SIGHUP) return "SIGHUP";
  if (signum == SIGPIPE) return "SIGPIPE";
  static char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signum);
  return buf;
}

}  // namespace amp::launch
