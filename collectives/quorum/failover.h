// Who coordinates (docs/design.md, "Membership"): every takeover and deposition rule of the
// quorum all-reduce, on both sides, in one place. Pure: functions of the views, the epochs,
// the deaths the store witnessed (witness.h) and the time given; the member service
// (member.h) and the coordinator (coordinator.h) do the sending. When the coordinator falls
// silent or its death is witnessed (liveness.h says when it is this rank's turn):
//  - a member proposes itself for the next epoch (TAKEOVER) to the other members of the last
//    view; a member accepts one proposal per epoch, not while it coordinates, never a stale
//    epoch nor one it is not part of, and only once it takes the coordinator for lost itself
//    (silent here for evict / 2, or witnessed dead: until then the proposal waits), so a live
//    coordinator that the majority hears is never replaced; a rank that proposed itself
//    yields to a lower one;
//  - the proposal wins with the acknowledgment (ACK, with the decisions each saw) of a
//    majority of the last view (itself included) less the ranks witnessed dead, once every
//    live candidate answered or evict passed; without such a majority by 2 evict + a
//    heartbeat period (a loaded machine may take an evict period to answer) the job is lost: the candidate tells those that acknowledged it (FATAL) and stops,
//    naming the ranks that did not answer and the rule -- unless nobody accepted it: the
//    others still hear the coordinator, and this rank, cut off from it, leaves (Evicted). A
//    candidate that hears the old coordinator again gives its proposal up;
//  - the winner coordinates from the view of those that acknowledged (everyone else left,
//    silent): the coordinator's state is rebuilt from their ACKs (Coordinator's takeover
//    constructor; step_recovery.h recovers the steps not every member completed);
//  - a coordinator decides only while it holds a lease, a majority of its view heard from
//    within evict / 2, so one cut off stops deciding before any member can take over; and a
//    view must keep a majority of the one before, less the ranks witnessed dead (roster.h,
//    stop_reason);
//  - a member that accepted a candidate which has not won yet (nothing came from it but the
//    TAKEOVER) goes back to the old coordinator when that one speaks again, and to the
//    candidate when its VIEW of the accepted epoch comes (it won after all);
//  - a coordinator that was replaced -- a takeover WON, not one member's acceptance -- is told
//    so (DEPOSED) once per incarnation by each member that hears it, and leaves the job
//    (Evicted).
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
// The VIEW a coordinator that took over announces: `view`, every other rank left (silent, or
// died where `dead` says the store witnessed it: liveness.h's Deaths).
Down takeover_view(const View& view, const Config& cfg, const std::vector<char>& dead = {});
}  // namespace qproto

// A proposal of this rank to coordinate `epoch` after the coordinator fell silent.
struct Takeover {
  uint64_t epoch = 0;
  int coordinator = -1;         // the one that fell silent
  std::vector<int> candidates;  // the last view without the silent coordinator
  Clock::time_point started{};
  std::map<int, qproto::Up> acks;  // the members that accepted, with what they know
  std::vector<qproto::Up> early;   // messages of members that switched already (READYs ...)
};
enum class TakeoverOutcome : uint8_t { kGathering, kWon, kLost };
// A majority of the last view (`view_size`, this rank included) less the ranks of it witnessed
// dead accepted, and every live candidate did or evict passed: won. No such majority by
// 2 evict + a heartbeat period: lost.
TakeoverOutcome takeover_outcome(const Takeover& t, int view_size, Clock::time_point now,
                                 const LivenessTimes& times, const Deaths& dead = {});
enum class TakeoverAnswer : uint8_t { kAccept, kLater, kRefuse };
// How a member answers `from`'s proposal of `proposed` (epoch, members): refused while it
// coordinates, for a stale epoch, one it is not part of, or after it accepted another for
// that epoch; a rank that proposes itself yields to a lower candidate; later while it does
// not take the coordinator for lost itself (`coordinator_lost`, liveness.h).
TakeoverAnswer answer_takeover(const qproto::View& proposed, int from, int self,
                               const qproto::View& current, uint64_t acked_epoch,
                               bool coordinating, const std::optional<Takeover>& own,
                               bool coordinator_lost);
// What a member does with a message (not a TAKEOVER) from rank `from` acting as coordinator.
enum class Heed : uint8_t {
  kApply,   // from the coordinator it follows
  kReturn,  // from the coordinator before a candidate that has not won: follows it again
  kSwitch,  // the VIEW of the candidate it accepted, which won: follows it
  kDepose,  // from a coordinator that was replaced: tell it (DEPOSED), once
  kIgnore,
};

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
  // of the epoch is to be sent). A proposal answered "later" is kept (pending()).
  bool accept(int from, const qproto::View& proposed, const qproto::View& current,
              bool coordinating, bool coordinator_lost);
  // The proposal that waits for this member to take the coordinator for lost (-1: none).
  int pending_from() const { return pending_from_; }
  const qproto::View& pending() const { return pending_; }
  // A message from `from` acting as coordinator (`kind`, `epoch`: of a VIEW), on a rank that
  // follows one or (`coordinating`) coordinates itself.
  Heed heed(int from, qproto::Down::Kind kind, uint64_t epoch, bool coordinating);
  // While gathering: a message to this would-be coordinator (an ACK counted, the rest kept).
  void take(qproto::Up m);
  TakeoverOutcome outcome(int view_size, Clock::time_point now, const LivenessTimes& t,
                          const Deaths& dead) const;
  // Why a takeover was lost, naming the candidates that did not answer and the rule.
  std::string lost_reason(int view_size, const Deaths& dead) const;
  // Why a takeover nobody accepted ends this rank's part in the job (Evicted): the others
  // still hear the coordinator; this rank is cut off from it.
  std::string cut_off_reason() const;
  // The ranks that acknowledged the proposal under way.
  std::vector<int> ackers() const;
  // The coordinator spoke again while this rank gathered: the proposal is given up.
  void abandon() { takeover_.reset(); }
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
  int prev_ = -1;                     // the coordinator followed before the last acceptance
  int candidate_ = -1;                // the candidate accepted last
  bool confirmed_ = true;             // the coordinator followed has spoken since
  int pending_from_ = -1;             // a proposal waiting for the coordinator to be lost here
  qproto::View pending_;
  std::vector<bool> told_deposed_;    // per peer: told it that another rank took over
};

}  // namespace qring::collectives
