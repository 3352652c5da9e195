// What the coordinator knows of every rank (docs/design.md, "Membership"): the view, when it
// last heard from each rank, the last step each completed, the steps it missed in a row, the
// transport errors reported against it, its goodbye, its incarnation, and the joins under way.
// From these it says who leaves the view (silent for evict + a heartbeat period, liveness.h's
// silence_limit, the deadline until a rank has spoken once, and until a rejoined incarnation
// has spoken in the view that admitted it; unreachable and silent for evict / 4; evict_steps
// missed steps; a restarted incarnation; a death the store witnessed, witness.h) and who enters
// it (a join that every member accepted and whose joiner said HELLO, at the next step to be
// decided).
// Pure: no clock reads, no I/O; the coordinator (coordinator.h) feeds it what it hears and
// turns its answers into VIEW / JOINING messages.
#pragma once

#include <map>
#include <optional>
#include <vector>

#include "collectives/quorum/coordinator_config.h"
#include "collectives/quorum/messages.h"

namespace qring::collectives::qproto {

class Roster {
 public:
  Roster(const Config& cfg, Time now);  // every rank a member of view 0
  // A takeover: the view the members acknowledged, what they completed, the incarnations.
  void restore(View view, const std::vector<int64_t>& completed,
               const std::vector<uint32_t>& incarnations);

  const View& view() const { return view_; }
  // A message of member r: it is alive, and (but for a kSuspect) reachable.
  void heard(const Event& e, Time now);
  void suspect(int r) { suspect_[size_t(r)] = true; }
  void finished(int r) { finished_[size_t(r)] = true; }
  // Member r said it leaves (LEAVE): it leaves at the next look, as if evicted.
  void leave(int r, Time now) { pending_.push_back({r, Why::kLeft, silent_ms(r, now)}); }
  // Whether r's lag counts (step_recovery.h, behind): it spoke, did not finish or die, and,
  // if it rejoined, completed a step since (its state arrived). Lag counts from lag_from(r)
  // at the earliest: then, the coordinator's start or its own stop (resync).
  bool lag_counts(int r) const {
    const size_t i = size_t(r);
    return heard_[i] && !finished_[i] && !died_[i] && !awaiting_state_[i];
  }
  Time lag_from(int r) const { return lag_from_[size_t(r)]; }
  Clock::duration excused(int r) const { return excused_[size_t(r)]; }
  int self() const { return cfg_.self; }
  // Why r left the view last (kSilent if it never did).
  Why left_why(int r) const { return left_why_[size_t(r)]; }
  // The store witnessed the death of incarnation `inc` of r (witness.h): it leaves at once.
  void died(int r, uint32_t inc) {
    if (inc == incarnation_[size_t(r)]) died_[size_t(r)] = true;
  }
  // The members (not this rank, not finished) silent for over `ms`, or reported unreachable
  // (a transport error: a dead host's connections are refused at once, and the unreachable
  // leave after evict / 4 of silence, the time after which the quiet are looked for, so the
  // store's witness is asked from the error on and has that long to answer).
  std::vector<int> quiet(Time now, double ms) const;
  // r contributed: a rank that rejoined computes again.
  void contributes(int r) { catching_up_[size_t(r)] = false; }
  bool catching_up(int r) const { return catching_up_[size_t(r)]; }
  // The members that can contribute (not those catching up after a rejoin), and the quorum.
  int contributing() const;
  int quorum() const { return quorum_for(cfg_, contributing()); }
  int64_t completed(int r) const { return completed_[size_t(r)]; }
  // Whether member r takes part in step t (it joined at or before it).
  bool in_step(int r, uint64_t t) const { return joined_at_[size_t(r)] <= t; }
  // Members heard from within `ms` (this rank counts as heard).
  int heard_within(Time now, double ms) const;
  double silent_ms(int r, Time now) const { return ms_between(last_heard_[size_t(r)], now); }
  // Silence as departures() counts it: since last heard, less this process's stalls.
  double counted_silent_ms(int r, Time now) const;

  // Step decided OK with `contributors`: the members missing from it missed one more step in a
  // row (evict_steps of them: they leave at the next look).
  void count_misses(const std::vector<int>& contributors, Time now);
  // The members that leave now, by rank: those counted out, the silent, and the suspects that
  // also missed a heartbeat.
  std::vector<Departure> departures(Time now);
  // The next view, without `left`; returns the previous view's size.
  int remove(const std::vector<Departure>& left);
  // The reason the job stops after `left` left a view of `prev_size`: fewer than the floor, or
  // no majority of the view before less those of `left` witnessed dead (docs/design.md,
  // "failover"); nothing when it goes on.
  std::optional<std::string> stop_reason(const std::vector<Departure>& left, int prev_size) const;

  // Incarnation `inc` of rank r found: whether it is new.
  bool new_incarnation(int r, uint32_t inc);
  // Starts its join (after the old incarnation left the view): the JOINING to send.
  Down start_join(int r, uint32_t inc, Time now);
  void hello(int r, uint64_t inc);
  void accepted(int joiner, uint64_t inc, int from);
  // The joins complete now (abandoned after join_timeout): the VIEW that admits them at
  // `step`, this rank their donor; nothing when none is.
  std::optional<Down> admit(Time now, uint64_t step);
  // The JOINING of every join still under way, again: for the members a VIEW just admitted,
  // which must reconnect to those joiners too (the others ignore a joiner they know).
  std::vector<Down> joins_again() const;
  size_t joining() const { return joins_.size(); }
  uint32_t incarnation(int r) const { return incarnation_[size_t(r)]; }
  // This process was stopped: every member starts a fresh evict period.
  void resync(Time now);
  // This process waited `d` for a CPU (liveness.h, take_stall): `d` is not counted as any
  // member's silence (departures), up to the silence itself. Not for the lease (failover.h):
  // heard_within stays on wall time.
  void excuse(Clock::duration d);

 private:
  struct Join {
    uint32_t incarnation = 0;
    Time started{};
    std::vector<int> accepted;  // members that reconnected to it
    bool hello = false;         // it connected to every member
  };
  Config cfg_;
  View view_;
  std::vector<Time> last_heard_;
  std::vector<Clock::duration> excused_;  // since last heard: this process's own stalls
  std::vector<int64_t> completed_;
  std::vector<int> missed_;
  std::vector<Why> left_why_;
  std::vector<Departure> pending_;  // evictions decided outside departures()
  std::vector<bool> suspect_;       // a member reported a transport error with it
  std::vector<bool> finished_;      // said goodbye
  std::vector<bool> died_;          // its death was witnessed (this incarnation)
  std::vector<bool> heard_;         // has spoken at least once (start-up takes longer)
  std::vector<uint32_t> incarnation_;  // per rank: the newest incarnation known
  std::vector<uint64_t> joined_at_;    // per rank: first step it takes part in
  std::vector<bool> catching_up_;      // per rank: joined, has not contributed since
  std::vector<bool> awaiting_state_;   // per rank: admitted, has completed no step since
  std::vector<Time> lag_from_;         // per rank: its lag counts from here at the earliest
  std::map<int, Join> joins_;
};

}  // namespace qring::collectives::qproto
