// The member service: the quorum all-reduce on one rank, a long-lived engine op (one per
// QuorumAllreduce) that composes the rooms of the protocol and carries each message to the one
// that handles it:
//   control_stream.h    the up and down streams with every peer
//   coordinator_host.h  the coordinator's state machine, on the rank that coordinates
//   step_runner.h       the data plane of each decided step
//   rejoin.h            ranks that come back, and the state transfer to them
//   liveness.h          heartbeats, the coordinator's silence and when to act on it, deadlines
//   failover.h          who coordinates: takeover, its acknowledgment, deposition
//   witness.h           the deaths the rendezvous store witnessed, looked for when needed
//   follower.h          what the coordinator sends (VIEW, DECIDE, RECOVER ...) applied here
//   step_ledger.h       this rank's contributions, their READYs, the decisions it saw
// and the hand-offs with the callers' threads, one per concern: the steps (steps.h), the
// membership (membership_box.h), the reports (report_box.h), the join agent (join_agent.h).
// Its failure (an eviction, a lost job, a protocol error) ends every operation of the
// communicator, so that nothing waits for its deadline among members that are gone.
#pragma once

#include <memory>
#include <optional>

#include "collectives/engine.h"
#include "collectives/quorum/control_stream.h"
#include "collectives/quorum/coordinator_host.h"
#include "collectives/quorum/failover.h"
#include "collectives/quorum/follower.h"
#include "collectives/quorum/liveness.h"
#include "collectives/quorum/membership_box.h"
#include "collectives/quorum/outbox.h"
#include "collectives/quorum/rejoin.h"
#include "collectives/quorum/report_box.h"
#include "collectives/quorum/step_ledger.h"
#include "collectives/quorum/step_runner.h"
#include "collectives/quorum/steps.h"
#include "collectives/quorum/witness.h"

namespace qring::collectives {

struct MemberBoxes {
  std::shared_ptr<StepTable> steps;
  std::shared_ptr<MembershipBox> membership;
  std::shared_ptr<ReportBox> reports;
  std::shared_ptr<JoinAgentIo> agent;
  std::shared_ptr<std::atomic<bool>> shutdown;  // the all-reduce is being destroyed
};

// How long a coordinator whose caller is done may still serve the members (coordinator_host.h,
// serving): a silent member's eviction, then the new decision of the step it was part of.
inline std::chrono::milliseconds end_grace(const QuorumOptions& o) {
  return 2 * o.evict + std::chrono::milliseconds(1000);
}

class QuorumMember final : public EngineOp {
 public:
  QuorumMember(Engine& engine, const CommOptions& copts, size_t count, const QuorumOptions& o,
               MemberBoxes boxes, uint32_t instance);

  std::string name() const override { return "quorum service"; }
  bool finished() const override { return finished_; }
  std::string waiting_on() const override { return "contributions"; }
  // Between steps: nothing of this rank in flight, only the standing receives.
  bool passive() const override;
  void start(net::Endpoint& ep) override;
  // Withdraws everything (the engine fails the callers afterwards).
  void abort(net::Endpoint& ep) override;
  bool advance(net::Endpoint& ep) override;

 private:
  const qproto::View& view() const { return follower_.view(); }  // the view this rank is in
  bool pass(net::Endpoint& ep);
  void say_goodbye(net::Endpoint& ep);
  void finish(net::Endpoint& ep);
  void fail_callers(std::exception_ptr e);
  void coordinate(std::unique_ptr<qproto::Coordinator> state);
  // ---- messages
  void send_up(net::Endpoint& ep, qproto::Up m);
  void take_up(qproto::Up&& m);
  void take_down(net::Endpoint& ep, int from, qproto::Down&& m);
  void act(net::Endpoint& ep, const qproto::Down& m);
  void apply(net::Endpoint& ep, const qproto::Down& m);
  bool feed_coordinator(net::Endpoint& ep);
  bool take_contributions(net::Endpoint& ep);
  bool poll_rejoin(net::Endpoint& ep);
  [[noreturn]] void leave(net::Endpoint& ep);
  void report_suspects(net::Endpoint& ep, const std::vector<std::pair<int, std::string>>& s);
  // ---- failover
  void start_takeover(net::Endpoint& ep);
  void answer_takeover(net::Endpoint& ep, int from, const qproto::View& v);
  bool gather_takeover(net::Endpoint& ep);
  void watch_deaths();
  // ---- liveness
  bool resync(net::Endpoint& ep);
  bool look(Clock::time_point now);
  void heartbeat(net::Endpoint& ep);
  void check_deadlines(net::Endpoint& ep);

  Engine& engine_;
  net::Endpoint* ep_ = nullptr;  // the engine's (start())
  const CommOptions copts_;
  const QuorumOptions o_;
  MemberBoxes boxes_;
  const int rank_, world_;
  const uint32_t instance_;
  qproto::Config cfg_;
  bool tolerant_ = false;  // the job survives a lost rank
  Outbox out_;
  ControlStreams streams_;
  StepRunner runner_;
  Rejoin rejoin_;
  Liveness liveness_;
  std::unique_ptr<CoordinatorHost> host_;  // while this rank coordinates
  Succession succession_;  // the coordinator followed (lowest live rank), takeovers
  Witness witness_;
  Clock::time_point last_watch_{};  // watch_deaths()
  StepLedger ledger_;
  Follower follower_;
  std::vector<bool> reported_suspect_;
  std::vector<uint32_t> known_inc_;  // per peer: the incarnation of what was told about it
  bool finished_ = false, dead_ = false, bye_sent_ = false, told_ = false;
  std::exception_ptr error_;  // why the service died (told to the callers once: told_)
  Clock::time_point drain_until_{};
};

}  // namespace qring::collectives
