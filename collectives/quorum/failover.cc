#include "collectives/quorum/failover.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "collectives/quorum/errors.h"

namespace qring::collectives {

namespace qproto {

bool holds_lease(const Roster& roster, Time now, const Config& cfg) {
  const int fresh = roster.heard_within(now, double(cfg.evict.count()) / 2);
  return 2 * fresh > roster.view().size();
}

Down takeover_view(const View& view, const Config& cfg, const std::vector<char>& dead) {
  Down v(Down::Kind::kView);
  v.view = view;
  for (int r = 0; r < cfg.world; ++r)
    if (!view.has(r))
      v.left.push_back({r, witnessed(dead, r) ? Why::kDied : Why::kSilent,
                        double(cfg.evict.count())});
  return v;
}

}  // namespace qproto

TakeoverOutcome takeover_outcome(const Takeover& t, int view_size, Clock::time_point now,
                                 const LivenessTimes& times, const Deaths& dead) {
  const int acked = int(t.acks.size()) + 1;
  int gone = witnessed(dead, t.coordinator) ? 1 : 0;
  int live_candidates = 0;
  for (int c : t.candidates) {
    if (witnessed(dead, c) && !t.acks.count(c)) {
      ++gone;
    } else {
      ++live_candidates;
    }
  }
  const bool majority = 2 * acked > view_size - gone;
  const bool all = acked >= live_candidates;
  const bool waited = now - t.started > times.evict;
  if (majority && (all || waited)) return TakeoverOutcome::kWon;
  if (now - t.started > 2 * times.evict + times.heartbeat) return TakeoverOutcome::kLost;
  return TakeoverOutcome::kGathering;
}

TakeoverAnswer answer_takeover(const qproto::View& proposed, int from, int self,
                               const qproto::View& current, uint64_t acked_epoch,
                               bool coordinating, const std::optional<Takeover>& own,
                               bool coordinator_lost) {
  if (coordinating || proposed.epoch <= current.epoch || proposed.epoch <= acked_epoch ||
      !proposed.has(self))
    return TakeoverAnswer::kRefuse;  // stale, or this rank coordinates, or accepted another
  if (own && from > self) return TakeoverAnswer::kRefuse;  // the lower candidate wins
  return coordinator_lost ? TakeoverAnswer::kAccept : TakeoverAnswer::kLater;
}

Succession::Succession(int self, int world, int coordinator)
    : self_(self), world_(world), coord_(coordinator), told_deposed_(size_t(world), false) {}

qproto::Down Succession::propose(const qproto::View& view, Clock::time_point now) {
  takeover_ = Takeover{};
  takeover_->epoch = std::max(view.epoch, acked_epoch_) + 1;
  takeover_->coordinator = coord_;
  takeover_->candidates = successors(view, coord_);
  takeover_->started = now;
  acked_epoch_ = takeover_->epoch;
  pending_from_ = -1;
  qproto::Down m(qproto::Down::Kind::kTakeover);
  m.view.epoch = takeover_->epoch;
  m.view.members = takeover_->candidates;
  return m;
}

bool Succession::accept(int from, const qproto::View& proposed, const qproto::View& current,
                        bool coordinating, bool coordinator_lost) {
  const TakeoverAnswer a = answer_takeover(proposed, from, self_, current, acked_epoch_,
                                           coordinating, takeover_, coordinator_lost);
  if (a == TakeoverAnswer::kLater && (pending_from_ < 0 || proposed.epoch >= pending_.epoch)) {
    pending_from_ = from;
    pending_ = proposed;
  }
  if (a == TakeoverAnswer::kRefuse && from == pending_from_ && proposed.epoch == pending_.epoch)
    pending_from_ = -1;  // it went stale meanwhile
  if (a != TakeoverAnswer::kAccept) return false;
  pending_from_ = -1;
  takeover_.reset();
  acked_epoch_ = proposed.epoch;
  if (confirmed_) prev_ = coord_;
  candidate_ = from;
  coord_ = from;
  confirmed_ = false;
  return true;
}

Heed Succession::heed(int from, qproto::Down::Kind kind, uint64_t epoch, bool coordinating) {
  using K = qproto::Down::Kind;
  if (coordinating)  // another coordinator, of an older epoch
    return kind != K::kBye && tell_deposed(from) ? Heed::kDepose : Heed::kIgnore;
  if (from == coord_) {
    confirmed_ = true;  // a candidate sends nothing but its TAKEOVER before it won
    return Heed::kApply;
  }
  if (kind == K::kView && from == candidate_ && epoch == acked_epoch_) {
    coord_ = from;  // it won after this member went back to the old coordinator
    confirmed_ = true;
    return Heed::kSwitch;
  }
  if (kind == K::kBye) return Heed::kIgnore;
  if (!confirmed_ && from == prev_) {
    coord_ = prev_;  // the candidate has not won, and the old coordinator lives
    confirmed_ = true;
    return Heed::kReturn;
  }
  return tell_deposed(from) ? Heed::kDepose : Heed::kIgnore;
}

void Succession::take(qproto::Up m) {
  if (m.kind == qproto::Up::Kind::kAck && m.epoch == takeover_->epoch)
    takeover_->acks[m.from] = std::move(m);
  else
    takeover_->early.push_back(std::move(m));
}

TakeoverOutcome Succession::outcome(int view_size, Clock::time_point now,
                                    const LivenessTimes& t, const Deaths& dead) const {
  return takeover_outcome(*takeover_, view_size, now, t, dead);
}

std::string Succession::cut_off_reason() const {
  return fmt::format(
      "rank {}: evicted from the job: it lost the coordinator (rank {}) but no other rank "
      "accepted it as the successor within 2 evict + a heartbeat period (they still hear the "
      "coordinator): this rank is cut off from them; it must leave (exit)",
      self_, coord_);
}

std::vector<int> Succession::ackers() const {
  std::vector<int> a;
  if (takeover_)
    for (auto& [r, m] : takeover_->acks) a.push_back(r);
  return a;
}

std::string Succession::lost_reason(int view_size, const Deaths& dead) const {
  std::vector<int> silent, died;
  for (int c : takeover_->candidates)
    if (c != self_ && !takeover_->acks.count(c)) (witnessed(dead, c) ? died : silent).push_back(c);
  if (witnessed(dead, coord_)) died.insert(died.begin(), coord_);
  const int live = view_size - int(died.size());
  return fmt::format(
      "rank {}: quorum: the coordinator (rank {}) was lost and only {} of the {} ranks of the "
      "last view accepted this rank as its successor within 2 evict + a heartbeat period; "
      "not answering: {}; witnessed dead: {}. A job goes on only with a majority of the last "
      "view less the ranks whose death the store witnessed (here more than {} of {}): the "
      "silent ranks may be alive on the other side of a partition, so the job stops",
      self_, coord_, takeover_->acks.size() + 1, view_size,
      silent.empty() ? "none" : fmt::format("ranks {}", fmt::join(silent, ", ")),
      died.empty() ? "none" : fmt::format("ranks {}", fmt::join(died, ", ")), live / 2, live);
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
