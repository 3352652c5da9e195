// Preemption (docs/training.md, "Preemption and requeue"): SIGTERM and SIGUSR1 -- what Slurm
// sends ahead of a time limit or a preemption (sbatch --signal), and what qring-launch
// forwards -- ask qring-train to stop cleanly. The first signal only sets a flag; the trainer
// passes it on with its next contribution, every rank stops after the first step whose
// decision counted a rank that had it (so all stop after the same step), writes the
// checkpoint of that step and exits with kExitPreempted. A second signal ends the process at
// once (the signal's default action).
#pragma once

#include <atomic>

namespace qring::train {

// qring-train's exit status after a clean stop: checkpointed, resume with --resume.
constexpr int kExitPreempted = 76;

// Installs the handlers of SIGTERM and SIGUSR1 (SA_RESTART). Returns the flag they set.
const std::atomic<bool>& install_stop_signals();
// The signal that set the flag (0: none yet).
int stop_signal();

}  // namespace qring::train
