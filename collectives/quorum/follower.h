// A member as its coordinator's follower: what the coordinator sends, applied to the rooms of
// the member service (docs/design.md, "The quorum all-reduce's rooms"). A VIEW: the members in
// force, who left (the step runner stops owing them results, rejoin forgets them) and who
// joined (every member learns it with that step's result; a joiner that finds itself
// admitted starts at its step); the callers hear of it through the membership box. A DECIDE:
// the ledger keeps it, the step runner runs it. A RECOVER: the REPORT to send back. JOINING:
// reconnect to the joiner. BYE: the coordinator's silence from now on is no failure. EVICTED
// and FATAL end this rank's part in the job (Evicted, QuorumLost). Engine thread only; the
// member service (member.h) routes the coordinator's messages here, on the rank that
// coordinates too.
#pragma once

#include <chrono>
#include <optional>
#include <vector>

#include "collectives/engine.h"
#include "collectives/quorum/failover.h"
#include "collectives/quorum/liveness.h"
#include "collectives/quorum/membership_box.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/rejoin.h"
#include "collectives/quorum/step_ledger.h"
#include "collectives/quorum/step_runner.h"
#include "collectives/quorum/steps.h"

namespace qring::collectives {

class Follower {
 public:
  // The rooms it applies to (they outlive it: the member service owns them all).
  struct Rooms {
    StepRunner& runner;
    Rejoin& rejoin;
    Liveness& liveness;
    StepLedger& ledger;
    const Succession& succession;
    StepTable& steps;
    MembershipBox& membership;
  };
  // `joiner`: this rank rejoins, and has no view until it is admitted.
  Follower(Engine& engine, std::chrono::milliseconds evict, bool joiner, Rooms rooms);

  // The view this rank is in.
  const qproto::View& view() const { return view_; }
  // The ranks the coordinator admitted (rejoined) in its views: their state comes from it,
  // so if it is lost one of them may still be waiting for it. They propose themselves after
  // the other successors (takeover_turn, which looks only at the view's members). Empty once
  // another rank coordinates.
  const std::vector<int>& admitted_by_coordinator() const;
  // Applies `m`; returns the REPORT to send for a RECOVER.
  std::optional<qproto::Up> apply(net::Endpoint& ep, const qproto::Down& m);

 private:
  void apply_view(const qproto::Down& m);
  void apply_decide(net::Endpoint& ep, const qproto::Decision& d);
  qproto::Up report(net::Endpoint& ep, uint64_t t, uint32_t attempt);

  Engine& engine_;
  const int rank_, world_;
  const std::chrono::milliseconds evict_;
  StepRunner& runner_;
  Rejoin& rejoin_;
  Liveness& liveness_;
  StepLedger& ledger_;
  const Succession& succession_;
  StepTable& steps_;
  MembershipBox& membership_;
  qproto::View view_;
  std::vector<int> admitted_;  // by admitted_by_, in its views (each once)
  int admitted_by_ = -1;
};

}  // namespace qring::collectives
