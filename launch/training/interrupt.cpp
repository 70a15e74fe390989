#include "launch/training/interrupt.h"

#include <csignal>
#include <cstdio>

namespace amp::launch {

namespace {
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_interrupt(int signum) {
  if (g_signal == 0) g_signal = signum;
  std::signal(signum, SIG_DFL);  // the second one is not caught
}
}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa = {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a blocking read or collective goes on
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int interrupt_signal() { return g_signal; }

const char* signal_label(int signum) {
  if (signum == SIGINT) return "SIGINT";
  if (signum == SIGTERM) return "SIGTERM";
  static char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signum);
  return buf;
}

}  // namespace amp::launch
