// The shared-memory regions of libfabric 1.17's shm provider, as far as a dead rank's peers
// need them. Each endpoint's region is a file /dev/shm/<pid>:<n>:<m> named after the process
// that opened it, and starts with `struct smr_region` (ofi_shm.h): the version (u8, 4) at
// byte 0, the owner's pid (i32) at byte 4 and the region lock (a process-shared
// pthread_spinlock_t) at byte 24. The owner takes that lock while it processes a command;
// every sender takes it to post one (docs/design.md, Membership, "Limits"). A process killed
// while it held it leaves it held for good, and every rank that sends to it afterwards spins
// inside fi_tsend forever: whoever reaps the dead process releases it (qring-launch).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace qring::net {

// The names (in /dev/shm) of the region files of process `pid` that this user owns.
std::vector<std::string> shm_regions_of(pid_t pid);

// Region `name` of the dead process `pid`: when it is a libfabric 1.17 region of that process
// whose lock is held, and stays held for `confirm` (a live sender holds it for microseconds),
// releases the lock and returns true.
bool release_dead_shm_lock(const std::string& name, pid_t pid, std::chrono::milliseconds confirm);

// Every region in /dev/shm (of this user) whose process no longer exists, not even as a
// zombie awaiting its reaper: releases its lock where held, as release_dead_shm_lock. A rank
// does this when it opens its shm endpoint: a restarted incarnation (scripts/slurm/retry.sh,
// or by hand) frees the senders of the one that died, where no qring-launch reaps it.
// Returns the names of the regions whose lock it released.
std::vector<std::string> release_locks_of_dead_processes(std::chrono::milliseconds confirm);

// The fault injector (collectives/fault_inject.h, kill-locked): takes the lock of every region
// of this process, as a process interrupted inside the provider's receive path holds one.
// Nothing of this process may be inside the provider meanwhile. Returns how many it took.
int take_own_shm_locks();

}  // namespace qring::net
