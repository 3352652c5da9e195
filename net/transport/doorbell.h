// net::Doorbell — wake a process of this host when there is traffic for it, without polling.
//
// A doorbell is a sequence number and a count of sleepers in a page of shared memory,
// /dev/shm/qring-bell.<pid>, one per process (every endpoint of the process shares it). A
// process that waits for messages reads the sequence (token()), looks at its completion queue
// once more, and blocks in the kernel (a futex) until the sequence moves or a timeout passes
// (wait()); a peer rings it (ring(): the sequence moves, and a futex wake-up only when someone
// sleeps) when it hands the provider a message for that process, and when it took one of the
// process's messages (so that the sender's progress completes its send). shm moves data
// without a signal of its own: without a doorbell, an idle rank can only poll or sleep
// blindly, and on a node with more ranks than cores every poll takes the core a computing
// rank needs while every blind sleep delays the ring by its length.
//
// A doorbell is a hint, never a promise: every wait has a timeout and its caller polls after
// it, so a ring that never comes (a peer without a doorbell, a message from another host)
// costs at most that timeout. The process that created the file removes it when its last
// Doorbell goes; one killed leaves it, and the next process to create its own removes those
// of processes that no longer exist.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace qring::net {

class Doorbell {
 public:
  // This process's doorbell, created on first use; every caller shares it. nullptr when
  // /dev/shm cannot hold it (the callers then sleep blindly, as without one).
  static std::shared_ptr<Doorbell> own();
  // The doorbell of process `pid` on this host; nullptr when it has none.
  static std::shared_ptr<Doorbell> of(pid_t pid);
  // The pid in a libfabric shm address ("fi_shm://<pid>:..." or "<pid>:..."); 0 if none.
  static pid_t pid_in_shm_address(const std::string& addr);

  ~Doorbell();
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;

  // Thread- and process-safe.
  void ring();
  uint32_t token() const { return word().seq.load(std::memory_order_seq_cst); }
  // Blocks until the sequence differs from `token` or `max` passes. Returns whether it moved.
  bool wait(uint32_t token, std::chrono::nanoseconds max);

 private:
  struct Word {
    std::atomic<uint32_t> seq;  // the futex word
    std::atomic<uint32_t> sleepers;
  };
  static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);
  Doorbell(void* page, std::string path_to_remove) : page_(page), remove_(std::move(path_to_remove)) {}
  Word& word() const { return *static_cast<Word*>(page_); }

  void* page_;
  std::string remove_;  // the owner's file, removed with it; empty for a peer's
};

}  // namespace qring::net
