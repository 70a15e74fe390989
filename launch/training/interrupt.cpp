#include "launch/training/interrupt.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

namespace amp::launch {

namespace {
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

// The first signal and when it came (CLOCK_MONOTONIC, milliseconds). Atomics, lock-free: the handler
// may run in any thread (OpenMP's, MPI's), two at once for two copies of one signal; the first to
// exchange g_signal from 0 is the request, and publishes its time before its number.
std::atomic<int> g_signal{0};
std::atomic<long long> g_first_ms{0};
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

void say(const char* text) {  // write(2): the only output a handler may make
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

extern "C" void on_interrupt(int signum) {
  const long long now = monotonic_ms();
  long long first = g_first_ms.load();
  if (first == 0 && g_first_ms.compare_exchange_strong(first, now)) {  // the first: the request
    g_signal.store(signum);
    stop_blocking_on_output();
    return;
  }
  first = g_first_ms.load();
  if (static_cast<double>(now - first) < kDuplicateWindowSeconds * 1000.0) return;  // a copy of the first
  if (signum == SIGINT) {  // Ctrl-C again: stop now, as the default would
    std::signal(SIGINT, SIG_DFL);
    ::raise(SIGINT);
    return;
  }
  say(signum == SIGTERM   ? "amp_train: SIGTERM again: already stopping after the step in flight (SIGKILL stops at once)\n"
      : signum == SIGUSR1 ? "amp_train: SIGUSR1 again: already stopping after the step in flight (SIGKILL stops at once)\n"
                          : "amp_train: SIGUSR2 again: already stopping after the step in flight (SIGKILL stops at once)\n");
}
}  // namespace

void install_interrupt_handlers() {
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
  for (const int s : kStopSignals) sigaction(s, &sa, nullptr);
}

int interrupt_signal() { return g_signal.load(); }

const char* signal_label(int signum) {
  if (signum == SIGINT) return "SIGINT";
  if (signum == SIGTERM) return "SIGTERM";
  if (signum == SIGUSR1) return "SIGUSR1";
  if (signum == SIGUSR2) return "SIGUSR2";
  static char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signum);
  return buf;
}

}  // namespace amp::launch
