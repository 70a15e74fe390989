#include "launch/training/interrupt.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>

namespace amp::launch {

namespace {
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

void say(const char* text) {  // write(2): the only output a handler may make
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

extern "C" void on_interrupt(int signum) {
  const long long now = monotonic_ms();
  long long first = g_first_ms.load();
  if (first == 0 && g_first_ms.compare_exchange_strong(first, now)) {  // the first: the request
    g_signal.store(signum);
    return;
  }
  first = g_first_ms.load();
  if (static_cast<double>(now - first) < kDuplicateWindowSeconds * 1000.0) return;  // a copy of the first
  if (signum == SIGINT) {  // Ctrl-C again: stop now, as the default would
    std::signal(SIGINT, SIG_DFL);
    ::raise(SIGINT);
    return;
  }
  say("amp_train: SIGTERM again: already stopping after the step in flight (SIGKILL stops at once)\n");
}
}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa = {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);  // one handler at a time: the first-signal bookkeeping is not raced
  sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART;  // a blocking read or collective goes on
  g_signal.store(0);
  g_first_ms.store(0);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int interrupt_signal() { return g_signal.load(); }

const char* signal_label(int signum) {
  if (signum == SIGINT) return "SIGINT";
  if (signum == SIGTERM) return "SIGTERM";
  static char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signum);
  return buf;
}

}  // namespace amp::launch
