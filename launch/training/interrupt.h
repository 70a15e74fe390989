// SIGINT and SIGTERM during training: the first one asks the job to stop after the current step
// (the trainer then saves what it would save at the end, and amp_train exits 128 + the signal's
// number); a second one kills the process at once, as the signal's default would.
#pragma once

namespace amp::launch {

// Installs the handlers for SIGINT and SIGTERM (idempotent).
void install_interrupt_handlers();
// The number of the first signal received since install_interrupt_handlers(), or 0.
int interrupt_signal();
// "SIGINT", "SIGTERM", or "signal N".
const char* signal_label(int signum);

}  // namespace amp::launch
