// The progress engine: one thread per communicator that owns the endpoint and advances every
// active operation (EngineOp) until it completes, fails, or passes its deadline. Idle, it
// blocks on a condition variable; waiting for peers, it spins briefly, then yields, then
// sleeps with backoff (net::Backoff), so oversubscribed nodes stay usable. It is the one
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
#include "collectives/options.h"
#include "collectives/work.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

class EngineOp {
 public:
  virtual ~EngineOp() = default;
  // Engine thread only. Posts what can be posted, consumes completions. Returns true if
  // anything moved. Throws on protocol or transport errors.
  virtual bool advance(net::Endpoint& ep) = 0;
  virtual bool finished() const = 0;
  // Cancels posted receives so that user buffers are free (engine thread, after failure).
  // A cancellation the transport does not confirm throws; then, or when holds_buffers() is
  // true afterwards, the engine closes the endpoint before anyone learns of the failure, so
  // that no buffer stays posted into memory whose owner may free it.
  virtual void abort(net::Endpoint& ep) = 0;
  // Gives the op up while its peers may still be working on it (an op that fails alone,
  // below, or one its submitter cancels: Engine::abandon): abort(), and the messages the op
  // still expected are discarded (net::Endpoint::discard) until `until`, so that a peer that
  // sent one before giving up too is not held back by it. Default: abort() only.
  virtual void abandon(net::Endpoint& ep, Deadline /*until*/) { abort(ep); }
  // After abort(): whether a request of this op that uses its caller's memory is still
  // pending (a send that has not completed: sends cannot be cancelled).
  virtual bool holds_buffers() const { return false; }
  // "receive from rank 3 (stage 2, segment 0)": what the op is blocked on right now.
  virtual std::string waiting_on() const = 0;
  virtual std::string name() const = 0;
  // The op's descriptor (shape.h; 0: none): answers to liveness probes carry the one of the
  // op last started, so a timeout can name a rank that called another operation.
  virtual uint64_t shape() const { return 0; }
  // Called once when the op starts (engine thread), before the first advance().
  virtual void start(net::Endpoint& /*ep*/) {}
  // True while the op has nothing in flight and only waits for peers' messages that may be
  // noticed a little late (a long-lived service between its bursts). When every active op is
  // passive, the engine thread polls with short sleeps instead of spinning and yielding, so
  // it leaves the cores to the ranks' own threads.
  virtual bool passive() const { return false; }

  // What a failure of this op (an error thrown by it, or its deadline) does:
  //  kBreaksCommunicator: every op of the communicator fails with it and the communicator
  //    refuses further work (the collectives: their ranks' sequence is lost).
  //  kFailsOp: this op alone is abandoned (abandon(), discarding what it expected for as long
  //    as its own deadline allowed it) and its Work fails; the rest goes on (a quorum step's
  //    reduction among its contributors: the quorum all-reduce decides the step again).
  enum class OnFailure : uint8_t { kBreaksCommunicator, kFailsOp };
  OnFailure on_failure = OnFailure::kBreaksCommunicator;
  // Part of the collective sequence (seq numbers every rank calls in the same order): the
  // liveness probes report the last one started. False for services and for operations
  // numbered in a protocol's own space (a quorum step's reduction).
  bool sequenced = true;
  uint32_t seq = 0;
  Deadline deadline{};
  Clock::time_point submitted{};
  WorkPtr work;
};

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
  void abandon(const WorkPtr& work, Deadline until, const std::string& why);
  // Engine thread only: whether an op that failed alone or was abandoned still sends from its
  // caller's memory (its owner must not free it: failing the communicator closes the
  // endpoint first).
  bool holds_failed_buffers();
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
  // Scratch memory owned by the engine and reused (and registered once) across operations.
  // Engine thread only; the lease returns the buffer to the pool when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Engine* e, std::vector<char>* b) : engine_(e), buf_(b) {}
    Lease(Lease&& o) noexcept : engine_(o.engine_), buf_(o.buf_) { o.buf_ = nullptr; }
    Lease& operator=(Lease&& o) noexcept {
      std::swap(engine_, o.engine_);
      std::swap(buf_, o.buf_);
      return *this;
    }
    ~Lease();
    char* data() const { return buf_ ? buf_->data() : nullptr; }

   private:
    Engine* engine_ = nullptr;
    std::vector<char>* buf_ = nullptr;
  };
  Lease scratch(size_t bytes);

 private:
  void loop();
  void shut_down();
  bool step();
  // A caller that drives progress itself brackets that with these (drive_until): the engine
  // thread stays off the CPU in between. end_help(hand_over) kicks the engine when the caller
  // leaves work to it; otherwise the last helper to leave still wakes it if operations remain
  // (passive ones included), without marking new work, so that it resumes its own polling
  // pace instead of sleeping out its backstop.
  void begin_help() { helpers_.fetch_add(1, std::memory_order_acq_rel); }
  void end_help(bool hand_over);
  // kFailsOp ops: fails `op` alone (abandon, then its Work), keeping it while it holds buffers.
  void fail_op(std::unique_ptr<EngineOp> op, Deadline until, std::exception_ptr err,
               bool abandoned);
  // Ops marked by abandon() and failed ops of kFailsOp, after the pass (step()).
  void retire_failed();
  bool drain_retired();
  bool retiring(const EngineOp& op) const;
  bool guarded(EngineOp& op, const std::function<bool()>& fn);
  bool start_and_advance(std::vector<std::unique_ptr<EngineOp>>& starting, bool& moved);
  bool reap_finished();
  void check_deadlines();
  void idle_wait(net::Backoff& backoff);
  // Liveness probes: a timed-out op asks every peer which operation it is in, so the error
  // can name the rank that is missing rather than only the neighbour it waited on.
  // type 1 probe; 2 answer (last_started, its shape); 3 mismatch: op #last_started failed
  // on rank `probe_id` because rank `peer` sent a message with descriptor `other` (the
  // detector's: shape).
  struct Ctl {
    uint32_t magic;
    uint16_t version;
    uint8_t type;
    uint8_t pad;
    uint32_t from;
    uint32_t peer;
    int64_t last_started;
    int64_t probe_id;
    uint64_t shape;
    uint64_t other;
  };
  // Tells every other rank that `origin` saw rank `peer` call op #seq differently (probe_id
  // carries the origin: a rank passes on a notice it got, once).
  void tell_mismatch(int origin, uint64_t seq, int peer, uint64_t mine, uint64_t theirs);
  void post_ctl_recv(int peer);
  bool poll_ctl();
  void send_ctl(int peer, const Ctl& m);
  void start_diagnosis(EngineOp& op, const std::string& reason);
  void finish_diagnosis_if_due();
  std::chrono::milliseconds probe_window_;
  // One standing receive per peer with an exact tag numbered per (sender, receiver) stream
  // (no ignore masks: libfabric 1.17's shm provider loses unexpected messages matched
  // through one).
  struct CtlIn {
    Ctl msg{};
    net::RequestPtr req;
    uint64_t next = 0;
  };
  std::vector<CtlIn> ctl_in_;
  std::vector<uint64_t> ctl_out_next_;
  bool ctl_posted_ = false;
  std::deque<std::pair<net::RequestPtr, std::unique_ptr<Ctl>>> ctl_out_;
  int64_t last_started_ = -1;
  uint64_t last_shape_ = 0;
  int64_t probe_id_ = 0;
  struct Diagnosis {
    const EngineOp* op;
    uint32_t seq;
    std::string op_name;
    std::string reason;
    Clock::time_point until;
    uint64_t shape;                // of the op that timed out
    std::vector<int64_t> answers;  // per rank: last started op, or -2 = no answer yet
    std::vector<uint64_t> shapes;  // per rank: the shape of that op
  };
  std::unique_ptr<Diagnosis> diag_;
  void fail_all(const std::string& reason, std::exception_ptr err);
  // Closes the endpoint for good (a failed op left a buffer with the transport).
  void close_endpoint(const std::string& why);
  bool ep_closed_ = false;  // engine thread (under progress_mu_)

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
  std::shared_ptr<TimeSource> clock_keep_;  // CommOptions::clock
  TimeSource* clock_;
  // Failures of kFailsOp ops in this pass, and abandon() requests: (work, until, error).
  struct Retire {
    WorkPtr work;
    Deadline until;
    std::exception_ptr err;
    EngineOp* abandoned = nullptr;  // abandon() did it already
  };
  std::vector<Retire> retire_;
  // Ops submitted from a pass (an op's advance), started at its end; the thread in a pass.
  std::vector<std::unique_ptr<EngineOp>> spawned_;
  std::atomic<std::thread::id> pass_thread_{};
  std::deque<std::unique_ptr<EngineOp>> incoming_;
  std::deque<std::function<void(net::Endpoint&)>> calls_;
  bool stop_ = false;
  bool kicked_ = false;
  std::atomic<bool> broken_{false};
  std::string broken_reason_;
  // Scratch pools before active_: ops hold leases, so they must die first.
  std::vector<std::unique_ptr<std::vector<char>>> scratch_free_;
  std::vector<std::unique_ptr<std::vector<char>>> scratch_used_;
  std::vector<std::unique_ptr<EngineOp>> active_;
  // Failed ops whose sends still read their callers' memory: kept until those complete (the
  // endpoint is closed before the communicator's end, or its failure, releases them).
  std::vector<std::unique_ptr<EngineOp>> draining_;
  std::thread thread_;
};

}  // namespace qring::collectives
