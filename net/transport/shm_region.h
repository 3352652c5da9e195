// The shared-memory regions of libfabric 1.17's shm provider, as far as a dead rank's peers
// need them. Each endpoint's region is a file /dev/shm/<pid>:<n>:<m> named after the process
// that opened it, and starts with `struct smr_region` (ofi_shm.h): the version (u8, 4) at
// byte 0, the owner's pid (i32) at byte 4 and the region lock (a process-shared
// pthread_spinlock_t) at byte 24. The owner takes that lock while it processes a command;
// every sender takes it to post one (docs/design.md, Membership, "Limits"). A process killed
// while it held it leaves it held for good, and every rank that sends to it afterwards spins
// inside fi_tsend forever: whoever reaps the dead process releases it (qring-launch), and
// every rank's shm endpoint looks for such locks when it opens and every 200 ms after. A
// sender killed while it posted to a live rank leaves that rank's own region locked: released
// too, once confirmed (release_locks_held_by_the_dead).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
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

// After a death: the regions in `dir` of live processes whose lock a dead process held. A
// sender takes the receiver's lock to post a command (microseconds); one killed there leaves
// a live rank's region locked for good, and that rank spins inside the provider waiting for
// its own lock (its engine thread never comes back: it falls silent, is evicted, and never
// learns it). Nobody records who holds a pthread spinlock, so a region counts as such when
// its lock is held at every look for `confirm` while every process that maps it (by
// /proc/PID/maps: the owner and its senders) runs: a live holder gives it back within
// milliseconds, unless it is stopped (SIGSTOP), and then the region is left alone. Releases
// those locks (one releaser at a time, as release_dead_shm_lock) and returns the regions'
// names. `give_up`, when given, ends the looks early without a release (a watch stopping).
// The confirm time qring-launch and the ranks' lock watches use: a live owner holds its own
// lock while it copies what it receives, milliseconds even when descheduled on an
// oversubscribed host.
inline constexpr std::chrono::milliseconds kLiveLockConfirm{1000};
std::vector<std::string> release_locks_held_by_the_dead(std::chrono::milliseconds confirm,
                                                        const std::string& dir = kShmDir,
                                                        const std::function<bool()>& give_up = {});

// A thread that does what release_locks_of_dead_processes(confirm) does every `period` while
// it lives, looking at each dead process's region file once, and calls `released` with each
// region whose lock it released (on that thread). The regions of processes dead before it
// started are looked at once, by the constructor, on the caller's thread: a node keeps the
// files of every rank that died without a reaper, and a first look from the thread, a period
// into the job, made every rank of it map them all at once mid-step (a 15-20 ms step at
// 1 MiB with 100 such files, 4 ranks on 2 CPUs). A rank's shm
// endpoint keeps one: where no qring-launch reaps a peer that died holding its lock (a rank
// under srun, or started by hand, that nobody restarts), the survivors' engines spin inside
// the provider to send to it, and only such a thread of theirs can free them. Several
// releasers at once are safe: release_dead_shm_lock lets one act at a time (an flock on the
// region file). When it finds a process newly dead (since it started), it also does what
// release_locks_held_by_the_dead(live_confirm) does: a death from before it started was the
// concern of the ranks alive then. Stopping waits for a release under way (at most `confirm`).
class DeadShmLockWatch {
 public:
  DeadShmLockWatch(std::chrono::milliseconds period, std::chrono::milliseconds confirm,
                   std::chrono::milliseconds live_confirm,
                   std::function<void(const std::string&)> released, std::string dir = kShmDir);
  ~DeadShmLockWatch();
  DeadShmLockWatch(const DeadShmLockWatch&) = delete;
  DeadShmLockWatch& operator=(const DeadShmLockWatch&) = delete;

 private:
  void run();
  const std::chrono::milliseconds period_, confirm_, live_confirm_;
  const std::function<void(const std::string&)> released_;
  const std::string dir_;
  std::unordered_map<std::string, ino_t> seen_;  // dead processes' regions already looked at
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

class ShmHeader;

// A peer's region lock as its sender sees it. libfabric 1.17's shm sender takes the receiver's
// lock to post (`smr_generic_sendmsg`, a spinning pthread_spin_lock), so a receiver stopped
// (SIGSTOP, a debugger) while it holds its own lock, copying what it received, would keep
// every sender inside fi_tsend for the whole pause: the coordinator among them falls silent
// and is taken over, and without a majority the job stops. The endpoint looks before it posts
// a send: while the lock is held the send waits in its queue (as a send the provider refused
// for now), and the engine goes on. A lock taken between the look and the post is waited for
// inside the provider as before; that window is the post's own length.
class PeerRegionLock {
 public:
  // Region `name` of `dir` (the part of the peer's shm address after "://"): no lock to look
  // at (held() false) when it is not a libfabric 1.17 region of the process it is named after.
  explicit PeerRegionLock(const std::string& name, const std::string& dir = kShmDir);
  ~PeerRegionLock();
  PeerRegionLock(const PeerRegionLock&) = delete;
  PeerRegionLock& operator=(const PeerRegionLock&) = delete;
  // Someone holds the lock now (a trylock, given back at once when it succeeds).
  bool held() const;
  // Whether the region was found (a lock to look at).
  bool mapped() const { return header_ != nullptr; }

 private:
  std::unique_ptr<ShmHeader> header_;
};

// The fault injector (collectives/fault_inject.h, kill-locked): takes the lock of every region
// of this process, as a process interrupted inside the provider's receive path holds one.
// Nothing of this process may be inside the provider meanwhile. Returns how many it took.
int take_own_shm_locks();
// stop-locked, once continued: gives back the locks take_own_shm_locks took.
void give_back_own_shm_locks();
// The fault injector (kill-posting): takes the lock of the region of one live peer that this
// process maps (the first by name), as a sender killed inside its post holds it. Nothing of
// this process may be inside the provider meanwhile. Returns the region's name ("" if none).
std::string take_a_peer_shm_lock();

}  // namespace qring::net
