// The progress engine: one thread per communicator that owns the endpoint and advances every
// active operation (EngineOp) until it completes, fails, or passes its deadline. Idle, it
// blocks on a condition variable; waiting for peers, it blocks in the kernel until a peer's
// traffic wakes it where the endpoint offers that (net::Endpoint::wait_traffic: shm's
// doorbells), else spins briefly, then yields, then sleeps with backoff (net::Backoff), so
// oversubscribed nodes stay usable. It is the one
// scheduler of a communicator: the collectives, the quorum all-reduce's service and each of
// its steps' reductions are ops here. Under a clock that drives the engines
// (collectives/clock.h) it starts no thread and the clock runs its passes.
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/clock.h"
#include "collectives/engine_op.h"
#include "collectives/op_set.h"
#include "collectives/options.h"
#include "collectives/probes.h"
#include "collectives/scratch.h"
#include "collectives/work.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

// How a caller that waits drives the engine from its own thread (Engine::drive_until).
struct Help {
  // Hand over to the engine thread after this many polls in a row without progress...
  int idle_polls = INT_MAX;
  // ... or after this long without progress.
  std::chrono::microseconds idle_time = std::chrono::microseconds::max();
  // Polls between two looks at the caller's condition while nothing moves.
  int look_every = 1;
  // On leaving with the condition met: still wake the engine thread when operations that are
  // not passive remain (true), or leave them to its own pace (false: the rank computes next,
  // and a woken engine thread would take its core).
  bool wake_if_busy = true;
};
// For a waiter that may wait long (for a peer still computing): it drives while anything
// moves, hands over after 2 ms without progress, and leaves what remains once its condition
// holds to the engine thread's own pace.
inline constexpr Help kHelpBriefly{INT_MAX, std::chrono::microseconds(2000), 16, false};

class Engine {
 public:
  Engine(std::unique_ptr<net::Endpoint> ep, const CommOptions& opts);
  ~Engine();

  // wake = false: the caller waits on the work at once and drives it (Work::wait), so the
  // engine thread is not woken for it. `on_finish`: see Work.
  WorkPtr submit(std::unique_ptr<EngineOp> op, bool wake = true,
                 std::function<void(const std::exception_ptr&)> on_finish = {});
  // Engine thread only (an op's advance): gives up the op of `work` now (EngineOp::abandon,
  // its expected messages discarded until `until`); it leaves at the end of this pass and its
  // Work fails with `why`. Nothing happens when it has finished already.
  void abandon(const WorkPtr& work, Deadline until, const std::string& why) {
    ops_.abandon(work, until, why);
  }
  // Engine thread only: whether an op that failed alone or was abandoned still sends from its
  // caller's memory (its owner must not free it: failing the communicator closes the
  // endpoint first).
  bool holds_failed_buffers() { return ops_.holds_failed_buffers(); }
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  std::string broken_reason() const;
  int rank() const { return rank_; }
  int size() const { return size_; }
  int reduce_threads() const { return reduce_threads_; }
  bool oversubscribed() const { return oversubscribed_; }
  std::string provider() const { return provider_; }
  const net::TransportTraits& traits() const { return traits_; }
  // The time of everything above the endpoint (CommOptions::clock).
  TimeSource& clock() const { return *clock_; }
  Clock::time_point now() const { return clock_->now(); }
  // Wakes the engine thread if it sleeps (call after handing it new work).
  void kick();
  // The one way a waiting caller drives the engine from its own thread: passes while they
  // move, until `done()` holds, `deadline` passes, or `how` says to hand over; then the
  // engine thread takes over (it stays off the CPU while a caller drives, so an
  // oversubscribed node runs one polling thread per rank, not two). Returns done(). Blocking
  // until done() is the caller's (Work::wait, the quorum all-reduce's waits). With a clock
  // that drives the engines it returns at once: the clock runs them while the caller blocks.
  bool drive_until(const std::function<bool()>& done, Deadline deadline, const Help& how);
  // One engine pass from a caller's thread if no other thread is in one (returns whether
  // anything moved). Waiters use it so small operations complete without a thread hand-off.
  bool try_progress();
  // Keeps every thread of this process out of the endpoint while the returned lock lives (it
  // waits for a pass in progress to end). For fault injection: a process stopped or killed
  // inside the transport may hold the provider's locks (docs/design.md, Membership, "Limits").
  // Not from the engine thread's own pass (an op's advance), which holds it already.
  std::unique_lock<std::mutex> hold_progress() { return std::unique_lock<std::mutex>(progress_mu_); }
  // Runs `fn` on the engine thread (with the endpoint) and waits for it.
  void run(const std::function<void(net::Endpoint&)>& fn);
  // Engine thread only (an op's advance): connects `peer`'s new incarnation on the endpoint
  // (net::Endpoint::reset_peer) and restarts the engine's own control stream with it.
  void reset_peer(int peer, const std::string& published, uint32_t incarnation);
  // net::Endpoint::prepare_reset_peer: `peer` left and may come back.
  void prepare_reset_peer(int peer) { ep_->prepare_reset_peer(peer); }
  // Scratch memory owned by the engine and reused (and registered once) across operations
  // (scratch.h). Engine thread only; the lease returns the buffer to the pool when destroyed.
  using Lease = ScratchPool::Lease;
  Lease scratch(size_t bytes) { return scratch_.lease(*ep_, bytes); }

 private:
  void loop();
  void shut_down();
  bool step();
  bool start_and_advance(std::vector<std::unique_ptr<EngineOp>>& starting, bool& moved);
  void diagnose(bool* moved);
  // A caller that drives progress itself brackets that with these (drive_until): the engine
  // thread stays off the CPU in between. end_help(hand_over) kicks the engine when the caller
  // leaves work to it; otherwise the last helper to leave still wakes it if operations remain
  // (passive ones included), without marking new work, so that it resumes its own polling
  // pace instead of sleeping out its backstop.
  void begin_help() { helpers_.fetch_add(1, std::memory_order_acq_rel); }
  void end_help(bool hand_over);
  void idle_wait(net::Backoff& backoff, uint32_t token);
  template <typename Pred>
  void rest(uint32_t token, std::chrono::nanoseconds max, Pred woken);
  // Wakes the engine thread from its waits (the condition variable, and the doorbell).
  void notify_engine(bool all = false);
  // Breaks the communicator: every op fails (OpSet::fail_all), and later submissions too.
  void fail_all(const std::string& reason, std::exception_ptr err);

  std::unique_ptr<net::Endpoint> ep_;
  int rank_;
  int size_;
  std::string provider_;
  net::TransportTraits traits_;
  int reduce_threads_;
  std::mutex mu_;  // incoming_, calls_, stop_, kicked_, broken_reason_
  std::condition_variable cv_;
  std::mutex progress_mu_;  // held by whoever runs step(): the endpoint and every op
  std::atomic<size_t> active_count_{0};
  std::atomic<bool> all_passive_{false};  // every active op is passive()
  std::atomic<int> helpers_{0};  // callers between begin_help and end_help
  bool oversubscribed_ = false;  // more ranks on this host than cores
  // The endpoint wakes this process when traffic comes (net::Endpoint::wakes_on_traffic): the
  // waits block in the kernel instead of polling, yielding or sleeping blindly.
  bool bells_ = false;
  // The longest such block before a look around (deadlines, grace periods, timers).
  static constexpr std::chrono::microseconds kBellWait{500};
  std::shared_ptr<TimeSource> clock_keep_;  // CommOptions::clock
  TimeSource* clock_;
  std::atomic<std::thread::id> pass_thread_{};  // the thread in a pass (step)
  std::deque<std::unique_ptr<EngineOp>> incoming_;
  std::deque<std::function<void(net::Endpoint&)>> calls_;
  bool stop_ = false;
  bool kicked_ = false;
  std::atomic<bool> broken_{false};
  std::string broken_reason_;
  Prober prober_;  // liveness probes and mismatch notices (probes.h)
  // The scratch pool before the ops: ops hold leases, so they must die first.
  ScratchPool scratch_;
  OpSet ops_;
  std::thread thread_;
};

}  // namespace qring::collectives
