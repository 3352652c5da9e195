// The coordinator's host: messages in, Coordinator::handle, messages out. It holds the pure
// state machine (coordinator.h) on the rank that coordinates, batches the messages one pass
// of the control streams found (so that a decision counts every contribution already in),
// ticks it, and hands every message it returns to `send` (the member service sends it to the
// view's members and applies it on this rank). When the caller is done with the all-reduce,
// it keeps serving the members while a step it recovers is not decided again, or its own rank
// still runs one, so that a step whose result a lost rank was forwarding (a takeover in the
// last step) reaches every member before the goodbye (serving). Engine thread only.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "collectives/clock.h"
#include "collectives/quorum/coordinator.h"

namespace qring::collectives {

class CoordinatorHost {
 public:
  using Send = std::function<void(const qproto::Down&)>;
  // `arrival`: every READY's arrival (step, rank, ms after the step's first), late ones too.
  CoordinatorHost(std::unique_ptr<qproto::Coordinator> state, Send send,
                  std::function<void(uint64_t, int, double)> arrival);
  // A message for the coordinator: from a member, or this rank's own.
  void take(qproto::Up m) { inbox_.push_back(std::move(m)); }
  // Feeds what was taken as one batch (handle's `more` on all but the last), and what that
  // sends to this rank; with `tick`, ticks the state machine every 200 us at most. Returns
  // whether it fed anything.
  bool feed(Clock::time_point now, bool tick = true);
  // The caller is done: whether the members still need this coordinator, because a recovery
  // it asked for is unresolved or `busy` (this rank still runs a step's reduction). At most
  // `limit` after the first call, then never again (the goodbye follows).
  bool serving(Clock::time_point now, bool busy, Clock::duration limit);
  // What this process's last look found (liveness.h): it was stopped (silence measured across
  // the pause says nothing, every clock starts over), or it waited `stall` for a CPU (not
  // counted as the members' silence).
  void observe(Clock::time_point now, bool paused, Clock::duration stall) {
    if (paused) {
      state_->resync(now);
    } else if (stall.count() > 0) {
      state_->excuse(stall);
    }
  }
  const qproto::Coordinator& state() const { return *state_; }

 private:
  std::unique_ptr<qproto::Coordinator> state_;
  Send send_;
  std::vector<qproto::Up> inbox_;
  Clock::time_point last_tick_{};
  Clock::time_point serve_until_{};  // set at the first call of serving()
};

}  // namespace qring::collectives
