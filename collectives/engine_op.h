// An operation of the engine (collectives/engine.h): a state machine the engine starts,
// advances on every pass until it finishes, and aborts or abandons when it fails. Below the
// engine and its op set, which both run them.
#pragma once

#include <cstdint>
#include <string>

#include "collectives/clock.h"
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

}  // namespace qring::collectives
