// Liveness of the quorum all-reduce on a member: heartbeats, the pause of its own process,
// the coordinator's silence and when to act on it, and the deadlines of a step. Pure
// functions of the view and of the time given (the engine's TimeSource: virtual time in the
// tests, tests/test_coll_liveness.cc), and the little state they read; the member service
// (member.h) does the sending. What it decides (docs/design.md, "Membership"):
//  - every rank heartbeats every evict / 8 on the engine (so long computation is not silence),
//    and at once when it completed a step, at most four times per heartbeat period; a step it
//    was outside of (it got the result from a member) within heartbeat / 64: it sends no
//    READY that would carry the completion, and every member keeps the step's result until the
//    coordinator knows it (StepRecovery::settle), so a lag here grows each member's result pool
//    by a buffer per step;
//  - a pass more than evict / 2 after the one before means this process was stopped: silence
//    measured across the pause says nothing about the others, so every silence clock starts
//    over;
//  - silence is measured only while the observer looks: a healthy engine passes at least every
//    `look` (heartbeat / 2, at least 50 ms; it sleeps 20 ms at most), so a longer gap between two
//    of its passes (shorter than a pause) means this process waited for a CPU (a loaded host) and
//    read nothing meanwhile; the excess over `look` is not counted as anyone's silence (take_stall
//    hands it to the coordinator's roster, roster.h). On a host that runs the observer the
//    limits below hold to the millisecond; on one that starves it, eviction and takeover come
//    later by as much as the observer itself waited, never sooner. (The coordinator's lease,
//    failover.h, stays on wall time: a stalled coordinator still stops deciding in time.);
//  - a rank (member or coordinator) is silent once nothing came from it for evict (the
//    deadline until it has spoken once) + one heartbeat period (silence_limit): its last
//    message may be up to a heartbeat period older than a pause, so a pause shorter than
//    evict never evicts, and one over 1.125 evict always does (issue 42, case 11);
//  - the coordinator silent: in a job that can lose a rank the other members of the last view
//    propose themselves in rank order (the members it admitted last), each one evict + one
//    heartbeat period after the one before (the proposal, its acceptance and its outcome:
//    failover.h). In a job that cannot lose a rank the silence stops it. A death the store
//    witnessed (witness.h) is silence already, and a successor witnessed dead has no turn.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "collectives/clock.h"
#include "collectives/quorum/messages.h"

namespace qring::collectives {

struct LivenessTimes {
  std::chrono::milliseconds evict{5000};
  std::chrono::milliseconds deadline{30000};
  std::chrono::milliseconds heartbeat{625};  // evict / 8, at least 1 ms
  // heartbeat / 2, at least 50 ms: longer than any gap between two passes of a running engine
  std::chrono::milliseconds look{312};
  static LivenessTimes of(std::chrono::milliseconds evict, std::chrono::milliseconds deadline) {
    const auto beat = std::max(std::chrono::milliseconds(1), evict / 8);
    return {evict, deadline, beat, std::max(std::chrono::milliseconds(50), beat / 2)};
  }
};

// How long a rank may be silent before it is lost: the coordinator for its members, a member
// for the coordinator (`heard_once`: it has spoken since it started).
Clock::duration silence_limit(bool heard_once, const LivenessTimes& t);
// Per rank, nonzero where the store witnessed its death (witness.h); empty: none known.
using Deaths = std::vector<char>;
inline bool witnessed(const Deaths& d, int r) { return r >= 0 && size_t(r) < d.size() && d[size_t(r)]; }
// How the coordinator `r` went, for the logs: "died (the store witnessed it)" or "fell silent".
inline const char* gone(const Deaths& d, int r) {
  return witnessed(d, r) ? "died (the store witnessed it)" : "fell silent";
}
// The members of `view` that may succeed `coordinator`, in the order they propose themselves
// (those witnessed dead are skipped).
std::vector<int> successors(const qproto::View& view, int coordinator, const Deaths& dead = {});
// When `self` proposes itself: the silence limit after the coordinator was last heard (none
// when its death was witnessed), plus one evict + heartbeat period for every live successor
// before it. The successors in `last` (members the coordinator admitted: one may still wait for
// its state from it, and such a joiner lets the next one propose) come after the others, so
// that a joiner first in line does not hold the takeover back by a whole period.
Clock::time_point takeover_turn(const qproto::View& view, int coordinator, int self,
                                Clock::time_point last_heard, bool heard_once,
                                const LivenessTimes& t, const Deaths& dead = {},
                                const std::vector<int>& last = {});

// The clocks a member keeps.
class Liveness {
 public:
  Liveness(LivenessTimes t, Clock::time_point now);
  const LivenessTimes& times() const { return t_; }
  // Called at every pass: true when the one before was over evict / 2 ago (this process was
  // stopped); then the coordinator's silence starts over too. A gap over `look` but no pause:
  // the excess is not counted as the coordinator's silence, and is kept for take_stall.
  bool paused(Clock::time_point now);
  // The time excused since the last call (the gaps' excess over `look`), for the roster of a
  // coordinator on this rank (Roster::excuse).
  Clock::duration take_stall() { return std::exchange(stall_, Clock::duration(0)); }
  void heard_coordinator(Clock::time_point now) {
    last_down_ = now;
    last_heard_ = now;
    heard_ = true;
  }
  // Nothing came from the coordinator for over evict, pauses of this process included (the
  // silence clocks above start over after a pause; this one does not): a rank stopped again
  // and again (a frozen straggler) never finds its coordinator silent, yet may be one the job
  // finished without. Never once the coordinator said goodbye.
  bool unheard_long(Clock::time_point now) const {
    return !coordinator_done_ && now - last_heard_ > t_.evict;
  }
  void coordinator_finished() { coordinator_done_ = true; }
  // A heartbeat is due (`completed`: the highest step this rank has completed; `outside`: it
  // got that step's result from a member, outside its contributors); records it.
  bool beat_due(Clock::time_point now, int64_t completed, bool outside = false);
  enum class Silence : uint8_t { kNone, kTakeOver, kLost };
  // What the coordinator's silence calls for on member `self` (not the coordinator): nothing
  // yet, its turn to propose itself (`tolerant`: the job can lose a rank), or stopping.
  Silence coordinator_silence(Clock::time_point now, const qproto::View& view, int coordinator,
                              int self, bool tolerant, const Deaths& dead = {},
                              const std::vector<int>& last = {}) const;
  double silent_ms(Clock::time_point now) const;
  // Why member `self` stops a job that cannot lose a rank when its coordinator is silent.
  std::string lost_reason(Clock::time_point now, int self, int coordinator) const;
  // Whether this member takes the coordinator for lost (it accepts a takeover only then):
  // silent here for over evict / 2, or witnessed dead; never once it said goodbye.
  bool coordinator_lost(Clock::time_point now, int coordinator, const Deaths& dead) const;
  // The coordinator said goodbye, or this rank did: no takeover from now on.
  bool coordinator_done() const { return coordinator_done_; }

 private:
  LivenessTimes t_;
  Clock::time_point last_pass_, last_down_, last_beat_, last_heard_;
  Clock::duration stall_{0};
  int64_t beat_completed_ = -1;
  bool heard_ = false;
  bool coordinator_done_ = false;
};

}  // namespace qring::collectives
