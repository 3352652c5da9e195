// The operations of one engine and what a pass does with them: starting them, advancing them,
// applying each one's failure policy (EngineOp::OnFailure), their deadlines, and keeping the
// failed ones whose sends still read their callers' memory until those complete. Engine
// thread only (whoever holds the engine's progress lock).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/clock.h"
#include "collectives/engine_op.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

class OpSet {
 public:
  OpSet(net::Endpoint& ep, TimeSource& clock, int rank) : ep_(ep), clock_(clock), rank_(rank) {}

  // Starts `ops` (their errors: each one's policy). The one sequenced last is remembered.
  void start(std::vector<std::unique_ptr<EngineOp>>& ops);
  // Advances every active op, then starts and advances those they submitted meanwhile
  // (spawn). An error of an op that breaks the communicator propagates.
  bool advance();
  // From an op's advance: an op that starts now and advances at the end of this pass.
  void spawn(std::unique_ptr<EngineOp> op);
  // Gives up the op of `work` now; it leaves at retire() and its Work fails with `why`.
  void abandon(const WorkPtr& work, Deadline until, const std::string& why);
  // Ops past their deadline: one that fails alone is retired with a CollectiveTimeout; the
  // first that breaks the communicator is returned (with the reason) for a diagnosis.
  EngineOp* check_deadlines(Clock::time_point now, std::string* reason);
  // The failed and abandoned ops leave; whether any did.
  bool retire();
  // The finished ops leave, their Works completed; whether any did.
  bool reap();
  // Fails every op with `err` (and `more`, ops not started yet): first each withdraws what it
  // posted, and when a receive is not withdrawn or a send still reads a caller's buffer, the
  // endpoint is closed before any Work fails.
  void fail_all(std::vector<std::unique_ptr<EngineOp>> more, std::exception_ptr err);
  // Whether an op that failed alone or was abandoned still sends from its caller's memory.
  bool holds_failed_buffers();
  // Closes the endpoint for good (a failed op left a buffer with the transport).
  void close_endpoint(const std::string& why);
  bool closed() const { return closed_; }

  bool empty() const { return active_.empty(); }
  size_t size() const { return active_.size(); }
  bool all_passive() const;
  bool contains(const EngineOp* op) const;
  // The sequence number and shape of the collective started last (liveness probes' answers).
  int64_t last_started() const { return last_started_; }
  uint64_t last_shape() const { return last_shape_; }

 private:
  struct Retire {
    WorkPtr work;
    Deadline until;
    std::exception_ptr err;
    EngineOp* abandoned = nullptr;  // abandon() did it already
  };
  void started(EngineOp& op);
  bool retiring(const EngineOp& op) const;
  // Runs an op's start or advance: an error of a kFailsOp op retires it alone (after the
  // pass), any other propagates.
  bool guarded(EngineOp& op, const std::function<bool()>& fn);
  void fail_op(std::unique_ptr<EngineOp> op, const Retire& r);

  net::Endpoint& ep_;
  TimeSource& clock_;
  int rank_;
  bool closed_ = false;
  int64_t last_started_ = -1;
  uint64_t last_shape_ = 0;
  std::vector<Retire> retire_;
  std::vector<std::unique_ptr<EngineOp>> spawned_;
  std::vector<std::unique_ptr<EngineOp>> active_;
  // Failed ops whose sends still read their callers' memory: kept until those complete (the
  // endpoint is closed before the communicator's end, or its failure, releases them).
  std::vector<std::unique_ptr<EngineOp>> draining_;
};

}  // namespace qring::collectives
