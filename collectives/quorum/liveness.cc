#include "collectives/quorum/liveness.h"

#include <algorithm>

namespace qring::collectives {

Clock::duration silence_limit(bool heard_once, const LivenessTimes& t) {
  // Until the coordinator has spoken once (start-up) the deadline applies.
  return (heard_once ? t.evict : std::max(t.evict, t.deadline)) + t.heartbeat;
}

std::vector<int> successors(const qproto::View& view, int coordinator) {
  std::vector<int> c;
  for (int r : view.members)
    if (r != coordinator) c.push_back(r);
  return c;
}

Clock::time_point takeover_turn(const qproto::View& view, int coordinator, int self,
                                Clock::time_point last_heard, bool heard_once,
                                const LivenessTimes& t) {
  const auto cands = successors(view, coordinator);
  const auto k = std::find(cands.begin(), cands.end(), self) - cands.begin();
  return last_heard + silence_limit(heard_once, t) + k * (t.evict + t.heartbeat);
}

TakeoverOutcome takeover_outcome(const Takeover& t, int view_size, Clock::time_point now,
                                 const LivenessTimes& times) {
  const int acked = int(t.acks.size()) + 1;
  const bool majority = 2 * acked > view_size;
  const bool all = acked == int(t.candidates.size());
  const bool waited = now - t.started > times.evict;
  if (majority && (all || waited)) return TakeoverOutcome::kWon;
  if (now - t.started > 2 * times.evict + times.deadline) return TakeoverOutcome::kLost;
  return TakeoverOutcome::kGathering;
}

bool accepts_takeover(const qproto::View& proposed, int from, int self,
                      const qproto::View& current, uint64_t acked_epoch, bool coordinating,
                      const std::optional<Takeover>& own) {
  if (coordinating || proposed.epoch <= current.epoch || proposed.epoch <= acked_epoch ||
      !proposed.has(self))
    return false;  // stale, or this rank coordinates, or it accepted another candidate already
  return !own || from < self;  // the lower candidate wins
}

Liveness::Liveness(LivenessTimes t, Clock::time_point now)
    : t_(t), last_pass_(now), last_down_(now), last_beat_(now) {}

bool Liveness::paused(Clock::time_point now) {
  const bool paused = now - last_pass_ > t_.evict / 2;
  last_pass_ = now;
  if (paused) last_down_ = now;
  return paused;
}

bool Liveness::beat_due(Clock::time_point now, int64_t completed) {
  if (now - last_beat_ < t_.heartbeat && completed == beat_completed_) return false;
  if (now - last_beat_ < t_.heartbeat / 4) return false;
  last_beat_ = now;
  beat_completed_ = completed;
  return true;
}

Liveness::Silence Liveness::coordinator_silence(Clock::time_point now, const qproto::View& view,
                                                int coordinator, int self, bool tolerant) const {
  if (coordinator_done_ || now - last_down_ <= silence_limit(heard_, t_)) return Silence::kNone;
  if (!tolerant) return Silence::kLost;
  return now > takeover_turn(view, coordinator, self, last_down_, heard_, t_) ? Silence::kTakeOver
                                                                             : Silence::kNone;
}

double Liveness::silent_ms(Clock::time_point now) const {
  return std::chrono::duration<double, std::milli>(now - last_down_).count();
}

}  // namespace qring::collectives
