// Preemption (docs/training.md, "Preemption and requeue"): SIGTERM and SIGUSR1 -- what Slurm
// sends ahead of a time limit (sbatch --signal=USR1@...), before a preemption or a cancel, and
// what qring-launch forwards -- ask qring-train to stop cleanly. The first signal only records
// itself; the trainer passes the request on with its next contribution, every rank stops
// after the first step whose decision counted a rank that had it (so all stop after the same
// step), writes the checkpoint of that step and exits with kExitPreempted. A second signal
// ends the process at once (the signal's default action).
#pragma once

#include <atomic>
#include <string>

namespace qring::train {

// qring-train's exit status after a clean stop: checkpointed, resume with --resume.
constexpr int kExitPreempted = 76;

// Installs the handlers of SIGTERM and SIGUSR1 (SA_RESTART). Returns what they set: 0 until
// the first of them arrives, then its number.
const std::atomic<int>& install_stop_signals();

// "SIGTERM", "SIGUSR1", ... for a signal number; "" for 0.
std::string signal_name(int sig);

}  // namespace qring::train
