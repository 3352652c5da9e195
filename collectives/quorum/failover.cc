#include "collectives/quorum/failover.h"

#include <fmt/format.h>

#include <algorithm>

#include "collectives/quorum/errors.h"

namespace qring::collectives {

namespace qproto {

bool holds_lease(const Roster& roster, Time now, const Config& cfg) {
  const int fresh = roster.heard_within(now, double(cfg.evict.count()) / 2);
  return 2 * fresh > roster.view().size();
}

Down takeover_view(const View& view, const Config& cfg) {
  Down v(Down::Kind::kView);
  v.view = view;
  for (int r = 0; r < cfg.world; ++r)
    if (!view.has(r)) v.left.push_back({r, Why::kSilent, double(cfg.evict.count())});
  return v;
}

}  // namespace qproto

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

Succession::Succession(int self, int world, int coordinator)
    : self_(self), world_(world), coord_(coordinator), told_deposed_(size_t(world), false) {}

qproto::Down Succession::propose(const qproto::View& view, Clock::time_point now) {
  takeover_ = Takeover{};
  takeover_->epoch = std::max(view.epoch, acked_epoch_) + 1;
  takeover_->candidates = successors(view, coord_);
  takeover_->started = now;
  acked_epoch_ = takeover_->epoch;
  qproto::Down m(qproto::Down::Kind::kTakeover);
  m.view.epoch = takeover_->epoch;
  m.view.members = takeover_->candidates;
  return m;
}

bool Succession::accept(int from, const qproto::View& proposed, const qproto::View& current,
                        bool coordinating) {
  if (!accepts_takeover(proposed, from, self_, current, acked_epoch_, coordinating, takeover_))
    return false;
  takeover_.reset();
  acked_epoch_ = proposed.epoch;
  coord_ = from;
  return true;
}

void Succession::take(qproto::Up m) {
  if (m.kind == qproto::Up::Kind::kAck && m.epoch == takeover_->epoch)
    takeover_->acks[m.from] = std::move(m);
  else
    takeover_->early.push_back(std::move(m));
}

TakeoverOutcome Succession::outcome(int view_size, Clock::time_point now,
                                    const LivenessTimes& t) const {
  return takeover_outcome(*takeover_, view_size, now, t);
}

std::string Succession::lost_reason(int view_size) const {
  return fmt::format(
      "rank {}: quorum: the coordinator (rank {}) fell silent and only {} of the {} ranks of the "
      "last view accepted this rank as its successor, not a majority",
      self_, coord_, takeover_->acks.size() + 1, view_size);
}

Succession::Won Succession::won(int64_t completed, std::vector<qproto::Known> known) {
  Won w;
  w.view.epoch = takeover_->epoch;
  w.view.members.push_back(self_);
  w.completed.assign(size_t(world_), -1);
  w.completed[size_t(self_)] = completed;
  w.known = std::move(known);
  for (auto& [r, m] : takeover_->acks) {
    w.view.members.push_back(r);
    w.completed[size_t(r)] = m.completed;
    w.known.insert(w.known.end(), m.known.begin(), m.known.end());
  }
  std::sort(w.view.members.begin(), w.view.members.end());
  w.early = std::move(takeover_->early);
  takeover_.reset();
  return w;
}

bool Succession::tell_deposed(int from) {
  if (told_deposed_[size_t(from)]) return false;
  told_deposed_[size_t(from)] = true;
  return true;
}

void Succession::deposed(int by) const {
  throw Evicted(fmt::format(
      "rank {}: evicted from the job: while this rank (the coordinator) was unreachable, "
      "another rank took over from it (rank {} says so); it must leave (exit)",
      self_, by));
}

}  // namespace qring::collectives
