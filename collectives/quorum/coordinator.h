// The quorum all-reduce's coordinator as a pure state machine: (state, Up, now) -> Downs.
// No threads, no clock reads, no I/O: its host (coordinator_host.h) feeds it the messages it
// receives and periodic ticks, and sends the messages it returns (DECIDE / VIEW / RECOVER /
// EVICTED / FATAL / JOINING, messages.h) to the members. Tests drive it with a simulated clock.
//
// It composes three rooms and answers for their order within one instant:
//   roster.h         the view and what it knows of every rank: evictions, joins, admissions
//   step_decider.h   the open steps and S(t) of each (the grace rule, quorum "auto", digests)
//   step_recovery.h  decided steps until every member holds them, their recovery after a loss
// and follows the failover rules of failover.h (its lease, the state after a takeover).
//
// What it decides (docs/design.md, "Membership"):
//  - S(t), the contributors of step t: every live member arrived, or the quorum arrived and
//    the grace passed; fewer than the quorum by first arrival + deadline is a timeout.
//  - The view (epoch, live members). A member silent for `evict` + a heartbeat period
//    (liveness.h, silence_limit: every rank's engine heartbeats every evict / 8, so a pause
//    shorter than evict never evicts), one that missed `evict_steps` consecutive steps (0 =
//    never), or one that a member had a transport error with and that has missed heartbeats
//    (silent for evict / 4) leaves the next view; one whose death the store witnessed
//    (kDied, witness.h) at once, and it leaves the majority's denominator. A member whose
//    oldest missing result was decided more than `max_lag` ago leaves too ("behind",
//    step_recovery.h), judged while it runs, as many as the job can lose. A rank that said
//    goodbye (finished the job) is never evicted. The quorum follows the view when it is a
//    fraction. Fewer than max(quorum, min_world) members stops the job.
//  - Recovery of a step that a departed member was part of: every live member reports
//    whether it holds the step's final result (aborting its reduction if not). If one does,
//    it forwards the result to the others (S(t) unchanged); if none does, the step is decided
//    again among the surviving contributors (late ones included: their contributions are
//    intact), or skipped on every rank when fewer than the quorum remain.
//    Either way every member ends the step with the same S(t) and the same bits.
//  - Rejoin: a new incarnation of a rank (restarted, or evicted while alive) is found by the
//    service in the rendezvous store (kJoin). If its old incarnation is still a member it
//    leaves the view at once ("restarted"). Every member is told (JOINING) and reconnects to
//    it (kAccept); once every member did and the joiner has connected to all of them (kHello),
//    it enters the next view at the next step to be decided, with this rank as the donor of
//    its state. It takes part in no step before that one (recovery, settling).
//  - Replicas that drifted: READYs may carry a digest of the sender's replicated state before
//    the step (qring-train: a parameter checksum every train.checksum_every steps); two
//    different digests for one step stop the job on every rank (FATAL naming both ranks).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "collectives/quorum/coordinator_config.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/roster.h"
#include "collectives/quorum/step_decider.h"
#include "collectives/quorum/step_recovery.h"

namespace qring::collectives::qproto {

class Coordinator {
 public:
  Coordinator(Config cfg, Time now);
  // Failover: this rank (cfg.self, the lowest of `view`) takes over from a coordinator that
  // fell silent, after the members of `view` acknowledged it. `completed` (per rank) and
  // `known` (the union of what the members saw) rebuild the state; every known step that is
  // not completed by every member is recovered (RECOVER with a higher attempt), and steps
  // nobody saw decided are decided afresh from the READYs the members send again. `out`
  // gets the new VIEW and the RECOVERs.
  // `incarnations`: every rank's, as the new coordinator knows them (a rank that rejoined
  // before is not a new join). Fewer than max(quorum, min_world) left: FATAL at once. `dead`:
  // per rank, nonzero where the store witnessed its death (the VIEW says so).
  Coordinator(Config cfg, Time now, View view, const std::vector<int64_t>& completed,
              const std::vector<Known>& known, std::vector<Down>& out,
              const std::vector<uint32_t>& incarnations = {},
              const std::vector<char>& dead = {});

  // `more`: further events of the same instant follow (the messages one poll of the streams
  // found): this one is taken in, and the decisions wait for the last of them, so that every
  // contribution that is already in when the quorum is reached is counted (grace 0 means the
  // first Q to arrive, and those found together arrived together).
  std::vector<Down> handle(const Event& e, Time now, bool more = false);

  const View& view() const { return roster_.view(); }
  // The quorum in force: a fraction counts the members that can contribute, not those that
  // rejoined and apply the results they missed before they contribute again.
  int quorum() const { return roster_.quorum(); }
  int contributing() const { return roster_.contributing(); }
  bool stopped() const { return stopped_; }
  const Config& config() const { return cfg_; }
  // Every arrival (late ones included), as (step, rank, ms after the step's first arrival).
  void on_arrival(std::function<void(uint64_t, int, double)> cb) {
    steps_.on_arrival(std::move(cb));
  }
  // auto_estimate: the run's estimate of the gradient-noise scale so far, in contributions.
  std::optional<double> noise_scale() const { return steps_.noise_scale(); }
  // Steps decided but not yet completed by every live member.
  size_t unsettled() const { return recovery_.unsettled(); }
  // The next step to be decided (a rank admitted now is a member from it on).
  uint64_t next_step() const { return steps_.next_step(); }
  // The members (not this rank, not finished) silent for over `ms` or reported unreachable:
  // whose witnessed death (witness.h) the view may soon need.
  std::vector<int> quiet(Time now, double ms) const { return roster_.quiet(now, ms); }
  // Joins under way (found, not yet admitted or abandoned).
  size_t joining() const { return roster_.joining(); }
  uint32_t incarnation(int r) const { return roster_.incarnation(r); }
  // True while a step is open (READYs counted, no decision yet) or being recovered: the
  // caller should tick promptly (the grace and the deadline run).
  bool waiting() const { return steps_.open() || recovery_.recovering(); }
  // A step is being recovered (RECOVER sent, its new decision not yet).
  bool recovering() const { return recovery_.recovering(); }
  // The coordinator's own process was stopped for a while: silence measured across the
  // pause says nothing about the others, so every member starts a fresh evict period.
  void resync(Time now) { roster_.resync(now); }
  // It waited `d` for a CPU: not counted as the members' silence (roster.h, excuse).
  void excuse(Clock::duration d) { roster_.excuse(d); }

 private:
  void take(const Event& e, Time now, std::vector<Down>& out);
  void tick(Time now, std::vector<Down>& out);
  std::vector<Departure> laggards(Time now) const;
  void change_view(std::vector<Departure> left, Time now, std::vector<Down>& out);
  void on_join(int r, uint32_t inc, Time now, std::vector<Down>& out);
  void decide(Time now, std::vector<Down>& out);
  void fatal(std::string reason, std::vector<Down>& out);

  Config cfg_;
  bool stopped_ = false;
  Roster roster_;
  StepDecider steps_;
  StepRecovery recovery_;
};

}  // namespace qring::collectives::qproto
