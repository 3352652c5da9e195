// The shared-memory regions of libfabric 1.17's shm provider, as far as a dead rank's peers
// need them. Each endpoint's region is a file /dev/shm/<pid>:<n>:<m> named after the process
// that opened it, and starts with `struct smr_region` (ofi_shm.h): the version (u8, 4) at
// byte 0, the owner's pid (i32) at byte 4 and the region lock (a process-shared
// pthread_spinlock_t) at byte 24. The owner takes that lock while it processes a command;
// every sender takes it to post one (docs/design.md, Membership, "Limits"). A process killed
// while it held it leaves it held for good, and every rank that sends to it afterwards spins
// inside fi_tsend forever: whoever reaps the dead process releases it (qring-launch), and
// every rank's shm endpoint looks for such locks when it opens and every 200 ms after.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace qring::net {

// Where the shm provider keeps its regions. Every function below takes the directory as its
// last argument (this one by default); the tests use a private one, out of the way of every
// live rank's DeadShmLockWatch.
inline constexpr const char* kShmDir = "/dev/shm";

// The names (in `dir`) of the region files of process `pid` that this user owns.
std::vector<std::string> shm_regions_of(pid_t pid, const std::string& dir = kShmDir);

// Region `name` of the dead process `pid`: when it is a libfabric 1.17 region of that process
// whose lock is held, and stays held for `confirm` (a live sender holds it for microseconds),
// releases the lock and returns true.
bool release_dead_shm_lock(const std::string& name, pid_t pid, std::chrono::milliseconds confirm,
                           const std::string& dir = kShmDir);

// Every region in `dir` (of this user) whose process no longer exists, not even as a
// zombie awaiting its reaper: releases its lock where held, as release_dead_shm_lock. A rank
// does this when it opens its shm endpoint: a restarted incarnation (scripts/slurm/retry.sh,
// or by hand) frees the senders of the one that died, where no qring-launch reaps it.
// Returns the names of the regions whose lock it released.
std::vector<std::string> release_locks_of_dead_processes(std::chrono::milliseconds confirm,
                                                         const std::string& dir = kShmDir);

// A thread that does what release_locks_of_dead_processes(confirm) does every `period` while
// it lives, looking at each dead process's region file once, and calls `released` with each
// region whose lock it released (on that thread). A rank's shm
// endpoint keeps one: where no qring-launch reaps a peer that died holding its lock (a rank
// under srun, or started by hand, that nobody restarts), the survivors' engines spin inside
// the provider to send to it, and only such a thread of theirs can free them. Several
// releasers at once are safe: release_dead_shm_lock lets one act at a time (an flock on the
// region file). Stopping waits for a release under way (at most `confirm`).
class DeadShmLockWatch {
 public:
  DeadShmLockWatch(std::chrono::milliseconds period, std::chrono::milliseconds confirm,
                   std::function<void(const std::string&)> released, std::string dir = kShmDir);
  ~DeadShmLockWatch();
  DeadShmLockWatch(const DeadShmLockWatch&) = delete;
  DeadShmLockWatch& operator=(const DeadShmLockWatch&) = delete;

 private:
  void run();
  const std::chrono::milliseconds period_, confirm_;
  const std::function<void(const std::string&)> released_;
  const std::string dir_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// The fault injector (collectives/fault_inject.h, kill-locked): takes the lock of every region
// of this process, as a process interrupted inside the provider's receive path holds one.
// Nothing of this process may be inside the provider meanwhile. Returns how many it took.
int take_own_shm_locks();

}  // namespace qring::net
