// SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGPIPE during training: the first one asks the job
// to stop after the current step (the trainer then saves what it would save at the end, and amp_train
// exits 128 + the signal's number); during the set-up, to stop it before the first step. SIGUSR1 and SIGUSR2 are the signals other tools ask Slurm to send
// before a time limit (--signal=USR1@120); SIGHUP a terminal that went away (ssh dropped); SIGPIPE
// standard output's or error's reader gone (| head, a tee that died, an mpirun that exited). The
// default action of each would end the ranks with nothing saved. SIGPIPE itself is left as it is (Open
// MPI's sockets raise it): a pipe whose reader is gone is found by polling it (interrupt_signal()), and
// replaced by /dev/null, so that no later write raises it. A SIGHUP that nohup ignores stays ignored. Copies of that request are the same request: `timeout`, Slurm and a terminal signal a
// whole process group, and `mpirun` forwards what it gets, so one stop often arrives two or three
// times within milliseconds. Only a second SIGINT more than kDuplicateWindowSeconds after the first (a
// user pressing Ctrl-C again) stops the process at once, as the signal's default would; SIGTERM never
// does (SIGKILL is the way to stop at once, and what Slurm sends after its grace period).
#pragma once

#include <functional>

namespace amp::launch {

// Repeats of a stop signal within this many seconds of the first are copies of it.
inline constexpr double kDuplicateWindowSeconds = 2.0;

// Call first in main, before any other thread exists. The stop signals are blocked in this thread,
// and so in every thread started from it (MPI's, OpenMP's, CUDA's), and taken by one thread of their
// own that does nothing else. A handler that runs on a compute thread has its frame written below
// that thread's stack pointer, and oneDNN's JIT GEMM kernels (2.x: Debian 12's) point it into the
// heap while they run (oneDNN issue 4845): a SIGTERM during a CPU GEMM corrupted the heap, and the run
// aborted with nothing saved (1 stop in 4 while the synthetic pool was made). The thread that called
// this is woken after a request by a signal run on an alternate stack (SIGURG, a no-op), so a
// write blocked on output that nobody reads returns (see install_interrupt_handlers).
void route_stop_signals_to_their_own_thread();
// Installs the handlers for those signals (idempotent), and forgets any earlier request. Where
// standard output or error is a pipe or a terminal, it gets a description of its own, which the
// first request makes non-blocking: a stop is never held up by output that nobody reads (mpirun,
// signalled, stops reading its ranks' output), and lines it would wait for are dropped.
// With `announce` (rank 0), the first request is acknowledged on standard error as it arrives, not
// when the step in flight ends: a user who saw nothing would press Ctrl-C again.
void install_interrupt_handlers(bool announce);
// The number of the first signal received since install_interrupt_handlers(), or 0; SIGPIPE where it
// finds standard output's or error's reader gone (a poll(2) of each that is a pipe). Called before
// output is written, so that the window in which a reader that goes raises SIGPIPE is small.
int interrupt_signal();
// Whether standard output or error lost its reader (and now writes to /dev/null).
bool standard_output_gone();
// Runs `print` (writes to standard output or error) with SIGPIPE held off in this thread: a reader
// that goes during the write fails it (EPIPE) rather than ending the process; then looks for a reader
// gone (interrupt_signal()).
void print_guarded(const std::function<void()>& print);
// Whether this process has acknowledged that request.
bool interrupt_announced();
// Training begins: a request from here stops after the step in flight (before it, during the set-up,
// it stops the set-up before the first step, and the acknowledgement says so; a second stop signal
// more than kDuplicateWindowSeconds later then stops at once, as its default would). False when a
// request came during the set-up (it stays one: the set-up must still stop). Forgets nothing.
bool interrupt_training_begins();
// Whether the request (if any) came during the set-up.
bool interrupted_during_setup();
// "SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGPIPE", or "signal N".
const char* signal_label(int signum);

}  // namespace amp::launch
