// Who coordinates (docs/design.md, "Membership"): every takeover and deposition rule of the
// quorum all-reduce, on both sides, in one place. Pure: functions of the views, the epochs and
// the time given; the member service (member.h) and the coordinator (coordinator.h) do the
// sending. When the coordinator falls silent (liveness.h says when it is this rank's turn):
//  - a member proposes itself for the next epoch (TAKEOVER) to the other members of the last
//    view; a member accepts one proposal per epoch, not while it coordinates, never a stale
//    epoch nor one it is not part of, and a rank that proposed itself yields to a lower one;
//  - the proposal wins with the acknowledgment (ACK, with the decisions each saw) of a
//    majority of the last view (itself included), once every candidate answered or evict
//    passed; without a majority by 2 evict + deadline the job is lost;
//  - the winner coordinates from the view of those that acknowledged (everyone else left,
//    silent): the coordinator's state is rebuilt from their ACKs (Coordinator's takeover
//    constructor; step_recovery.h recovers the steps not every member completed);
//  - a coordinator decides only while it holds a lease, a majority of its view heard from
//    within evict / 2, so one cut off stops deciding before any member can take over; and a
//    view must keep a majority of the one before (roster.h, stop_reason);
//  - a coordinator that was replaced while unreachable is told so (DEPOSED) once per
//    incarnation by each member that hears it, and leaves the job (Evicted).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "collectives/clock.h"
#include "collectives/quorum/coordinator_config.h"
#include "collectives/quorum/liveness.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/roster.h"

namespace qring::collectives {

namespace qproto {
// The coordinator's lease: a majority of its view heard from within evict / 2.
bool holds_lease(const Roster& roster, Time now, const Config& cfg);
// The VIEW a coordinator that took over announces: `view`, every other rank left (silent).
Down takeover_view(const View& view, const Config& cfg);
}  // namespace qproto

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

// A member's side: the coordinator it follows, its own proposal while it gathers acks, the
// epoch it accepted last, and the replaced coordinators it told.
class Succession {
 public:
  Succession(int self, int world, int coordinator);
  // The coordinator this rank follows (-1: a joiner not admitted yet).
  int coordinator() const { return coord_; }
  void follow(int coordinator) { coord_ = coordinator; }
  bool gathering() const { return takeover_.has_value(); }

  // Its turn to take over from the silent coordinator of `view`: the TAKEOVER to send to the
  // candidates (the message's view.members).
  qproto::Down propose(const qproto::View& view, Clock::time_point now);
  // `from` proposes `proposed`: whether this rank accepts (then it follows `from`, and the ACK
  // of the epoch is to be sent).
  bool accept(int from, const qproto::View& proposed, const qproto::View& current,
              bool coordinating);
  // While gathering: a message to this would-be coordinator (an ACK counted, the rest kept).
  void take(qproto::Up m);
  TakeoverOutcome outcome(int view_size, Clock::time_point now, const LivenessTimes& t) const;
  std::string lost_reason(int view_size) const;
  // Won: the view of those that acknowledged, what each completed, what they knew (this
  // rank's `completed` and `known` included), and the messages kept meanwhile.
  struct Won {
    qproto::View view;
    std::vector<int64_t> completed;
    std::vector<qproto::Known> known;
    std::vector<qproto::Up> early;
  };
  Won won(int64_t completed, std::vector<qproto::Known> known);

  // `from` acts as a coordinator but is not the one this rank follows: whether to tell it it
  // was deposed (once per incarnation).
  bool tell_deposed(int from);
  // `peer` came back as a new incarnation: it starts afresh.
  void new_incarnation(int peer) { told_deposed_[size_t(peer)] = false; }
  // A DEPOSED from `by` while this rank coordinates: it leaves the job.
  [[noreturn]] void deposed(int by) const;

 private:
  const int self_, world_;
  int coord_;
  std::optional<Takeover> takeover_;  // this rank gathers acks to take over
  uint64_t acked_epoch_ = 0;          // the last takeover epoch this rank accepted
  std::vector<bool> told_deposed_;    // per peer: told it that another rank took over
};

}  // namespace qring::collectives
