// SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 during training: the first one asks the job to stop after the
// current step (the trainer then saves what it would save at the end, and amp_train exits 128 + the
// signal's number). SIGUSR1 and SIGUSR2 are the signals other tools ask Slurm to send before a time
// limit (--signal=USR1@120); their default action would end the ranks with nothing saved. Copies of that request are the same request: `timeout`, Slurm and a terminal signal a
// whole process group, and `mpirun` forwards what it gets, so one stop often arrives two or three
// times within milliseconds. Only a second SIGINT more than kDuplicateWindowSeconds after the first (a
// user pressing Ctrl-C again) stops the process at once, as the signal's default would; SIGTERM never
// does (SIGKILL is the way to stop at once, and what Slurm sends after its grace period).
#pragma once

namespace amp::launch {

// Repeats of a stop signal within this many seconds of the first are copies of it.
inline constexpr double kDuplicateWindowSeconds = 2.0;

// Installs the handlers for those four signals (idempotent), and forgets any earlier request. Where
// standard output or error is a pipe or a terminal, it gets a description of its own, which the
// first request makes non-blocking: a stop is never held up by output that nobody reads (mpirun,
// signalled, stops reading its ranks' output), and lines it would wait for are dropped.
void install_interrupt_handlers();
// The number of the first signal received since install_interrupt_handlers(), or 0.
int interrupt_signal();
// "SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", or "signal N".
const char* signal_label(int signum);

}  // namespace amp::launch
