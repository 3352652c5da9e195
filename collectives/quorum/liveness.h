// Liveness of the quorum all-reduce on a member: heartbeats, the pause of its own process,
// the coordinator's silence and who takes over from it, and the deadlines of a step. Pure
// functions of the view and of the time given (the engine's TimeSource: virtual time in the
// tests, tests/test_coll_liveness.cc), and the little state they read; the member service
// (member.h) does the sending. What it decides (docs/design.md, "Membership"):
//  - every rank heartbeats every evict / 8 on the engine (so long computation is not silence),
//    and at once when it completed a step, at most four times per heartbeat period;
//  - a pass more than evict / 2 after the one before means this process was stopped: silence
//    measured across the pause says nothing about the others, so every silence clock starts
//    over;
//  - a rank (member or coordinator) is silent once nothing came from it for evict (the
//    deadline until it has spoken once) + one heartbeat period (silence_limit): its last
//    message may be up to a heartbeat period older than a pause, so a pause shorter than
//    evict never evicts, and one over 1.125 evict always does (issue 42, case 11);
//  - the coordinator silent: in a job that can lose a rank the other members of the last view
//    propose themselves in rank order, each one evict + one heartbeat period after the one
//    before; a proposal wins with the acknowledgment of a majority of the last view, once
//    every candidate answered or evict passed; without it by 2 evict + deadline the job is
//    lost. In a job that cannot lose a rank the silence stops it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "collectives/clock.h"
#include "collectives/quorum/messages.h"

namespace qring::collectives {

struct LivenessTimes {
  std::chrono::milliseconds evict{5000};
  std::chrono::milliseconds deadline{30000};
  std::chrono::milliseconds heartbeat{625};  // evict / 8, at least 1 ms
  static LivenessTimes of(std::chrono::milliseconds evict, std::chrono::milliseconds deadline) {
    return {evict, deadline, std::max(std::chrono::milliseconds(1), evict / 8)};
  }
};

// How long a rank may be silent before it is lost: the coordinator for its members, a member
// for the coordinator (`heard_once`: it has spoken since it started).
Clock::duration silence_limit(bool heard_once, const LivenessTimes& t);
// The members of `view` that may succeed `coordinator`, in the order they propose themselves.
std::vector<int> successors(const qproto::View& view, int coordinator);
// When `self` proposes itself: the silence limit after the coordinator was last heard, plus
// one evict + heartbeat period for every successor before it.
Clock::time_point takeover_turn(const qproto::View& view, int coordinator, int self,
                                Clock::time_point last_heard, bool heard_once,
                                const LivenessTimes& t);

// A proposal of this rank to coordinate `epoch` after the coordinator fell silent.
struct Takeover {
  uint64_t epoch = 0;
  std::vector<int> candidates;  // the last view without the silent coordinator
  Clock::time_point started{};
  std::map<int, qproto::Up> acks;  // the members that accepted, with what they know
  std::vector<qproto::Up> early;   // messages of members that switched already (READYs ...)
};
enum class TakeoverOutcome : uint8_t { kGathering, kWon, kLost };
// A majority of the last view (`view_size`, this rank included) accepted, and every candidate
// did or evict passed: won. No majority by 2 evict + deadline: lost.
TakeoverOutcome takeover_outcome(const Takeover& t, int view_size, Clock::time_point now,
                                 const LivenessTimes& times);
// Whether a member accepts `from`'s proposal of `proposed` (epoch, members): not while it
// coordinates, nor a stale epoch, nor one it is not part of, nor one after it accepted
// another for that epoch; a rank that proposes itself yields to a lower candidate.
bool accepts_takeover(const qproto::View& proposed, int from, int self,
                      const qproto::View& current, uint64_t acked_epoch, bool coordinating,
                      const std::optional<Takeover>& own);

// The clocks a member keeps.
class Liveness {
 public:
  Liveness(LivenessTimes t, Clock::time_point now);
  const LivenessTimes& times() const { return t_; }
  // Called at every pass: true when the one before was over evict / 2 ago (this process was
  // stopped); then the coordinator's silence starts over too.
  bool paused(Clock::time_point now);
  void heard_coordinator(Clock::time_point now) {
    last_down_ = now;
    heard_ = true;
  }
  void coordinator_finished() { coordinator_done_ = true; }
  // A heartbeat is due (`completed`: the highest step this rank has completed); records it.
  bool beat_due(Clock::time_point now, int64_t completed);
  enum class Silence : uint8_t { kNone, kTakeOver, kLost };
  // What the coordinator's silence calls for on member `self` (not the coordinator): nothing
  // yet, its turn to propose itself (`tolerant`: the job can lose a rank), or stopping.
  Silence coordinator_silence(Clock::time_point now, const qproto::View& view, int coordinator,
                              int self, bool tolerant) const;
  double silent_ms(Clock::time_point now) const;

 private:
  LivenessTimes t_;
  Clock::time_point last_pass_, last_down_, last_beat_;
  int64_t beat_completed_ = -1;
  bool heard_ = false;
  bool coordinator_done_ = false;
};

}  // namespace qring::collectives
