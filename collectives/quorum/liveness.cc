#include "collectives/quorum/liveness.h"

#include <fmt/format.h>

#include <algorithm>

namespace qring::collectives {

Clock::duration silence_limit(bool heard_once, const LivenessTimes& t) {
  // Until the coordinator has spoken once (start-up) the deadline applies.
  return (heard_once ? t.evict : std::max(t.evict, t.deadline)) + t.heartbeat;
}

std::vector<int> successors(const qproto::View& view, int coordinator, const Deaths& dead) {
  std::vector<int> c;
  for (int r : view.members)
    if (r != coordinator && !witnessed(dead, r)) c.push_back(r);
  return c;
}

Clock::time_point takeover_turn(const qproto::View& view, int coordinator, int self,
                                Clock::time_point last_heard, bool heard_once,
                                const LivenessTimes& t, const Deaths& dead,
                                const std::vector<int>& last) {
  auto cands = successors(view, coordinator, dead);
  std::stable_partition(cands.begin(), cands.end(), [&](int r) {
    return std::find(last.begin(), last.end(), r) == last.end();
  });
  const auto k = std::find(cands.begin(), cands.end(), self) - cands.begin();
  const Clock::duration first =
      witnessed(dead, coordinator) ? Clock::duration(0) : silence_limit(heard_once, t);
  return last_heard + first + k * (t.evict + t.heartbeat);
}

Liveness::Liveness(LivenessTimes t, Clock::time_point now)
    : t_(t), last_pass_(now), last_down_(now), last_beat_(now), last_heard_(now) {}

bool Liveness::paused(Clock::time_point now) {
  const auto gap = now - last_pass_;
  last_pass_ = now;
  if (gap > t_.evict / 2) {
    last_down_ = now;
    return true;
  }
  if (gap > t_.look) {  // this process waited for a CPU: the excess is nobody's silence
    const auto excess = gap - t_.look;
    last_down_ = std::min(now, last_down_ + excess);
    stall_ += excess;
  }
  return false;
}

bool Liveness::beat_due(Clock::time_point now, int64_t completed, bool outside) {
  const bool news = completed != beat_completed_;
  if (now - last_beat_ < t_.heartbeat && !news) return false;
  // Outside S(t): at most every heartbeat / 64 (10 ms at E = 5 s), so that a rank excluded from
  // steps of 0.4 ms sends a beat per 25 steps, not per step, and holds `settled` back that long.
  const bool soon = news && outside && now - last_beat_ >= t_.heartbeat / 64;
  if (now - last_beat_ < t_.heartbeat / 4 && !soon) return false;
  last_beat_ = now;
  beat_completed_ = completed;
  return true;
}

Liveness::Silence Liveness::coordinator_silence(Clock::time_point now, const qproto::View& view,
                                                int coordinator, int self, bool tolerant,
                                                const Deaths& dead,
                                                const std::vector<int>& last) const {
  if (coordinator_done_) return Silence::kNone;
  if (!witnessed(dead, coordinator) && now - last_down_ <= silence_limit(heard_, t_))
    return Silence::kNone;
  if (!tolerant) return Silence::kLost;
  return now > takeover_turn(view, coordinator, self, last_down_, heard_, t_, dead, last)
             ? Silence::kTakeOver
             : Silence::kNone;
}

bool Liveness::coordinator_lost(Clock::time_point now, int coordinator, const Deaths& dead) const {
  if (coordinator_done_) return false;  // it said goodbye: nothing to take over
  return witnessed(dead, coordinator) || now - last_down_ > t_.evict / 2;
}

std::string Liveness::lost_reason(Clock::time_point now, int self, int coordinator) const {
  return fmt::format("rank {}: quorum: the coordinator (rank {}) has been silent for {:.0f} ms "
                     "(quorum.evict_ms = {}); it stopped or died, and a job that cannot lose a "
                     "rank stops",
                     self, coordinator, silent_ms(now), t_.evict.count());
}

double Liveness::silent_ms(Clock::time_point now) const {
  return std::chrono::duration<double, std::milli>(now - last_down_).count();
}

}  // namespace qring::collectives
