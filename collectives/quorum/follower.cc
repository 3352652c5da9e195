#include "collectives/quorum/follower.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <mutex>

#include "collectives/quorum/errors.h"

namespace qring::collectives {

using UpKind = qproto::Up::Kind;
using DownKind = qproto::Down::Kind;

Follower::Follower(Engine& engine, std::chrono::milliseconds evict, bool joiner, Rooms rooms)
    : engine_(engine),
      rank_(engine.rank()),
      world_(engine.size()),
      evict_(evict),
      runner_(rooms.runner),
      rejoin_(rooms.rejoin),
      liveness_(rooms.liveness),
      ledger_(rooms.ledger),
      succession_(rooms.succession),
      steps_(rooms.steps),
      membership_(rooms.membership) {
  if (!joiner)
    for (int r = 0; r < world_; ++r) view_.members.push_back(r);
}

std::optional<qproto::Up> Follower::apply(net::Endpoint& ep, const qproto::Down& m) {
  switch (m.kind) {
    case DownKind::kHeartbeat:
    case DownKind::kTakeover:  // answered by the member service (failover.h)
      return std::nullopt;
    case DownKind::kBye:
      liveness_.coordinator_finished();  // its silence from now on is no failure
      membership_.coordinator_finished();
      return std::nullopt;
    case DownKind::kEvicted:
      if (m.why == qproto::Why::kBehind)
        throw Behind(fmt::format(
            "rank {}: out of the job, behind the others: the oldest result it lacked was "
            "decided more than quorum.max_lag ago (stopped or descheduled again and again, it "
            "did not catch up); it catches up by rejoining with a live member's state",
            rank_));
      throw Evicted(fmt::format(
          "rank {}: evicted from the job: the other ranks stopped waiting for this one (silent "
          "for more than quorum.evict_ms = {} ms, or unreachable); it must leave (exit)",
          rank_, evict_.count()));
    case DownKind::kFatal: {
      std::vector<int> gone;
      for (int r = 0; r < world_; ++r)
        if (!view_.has(r)) gone.push_back(r);
      throw QuorumLost(fmt::format("rank {}: the job stops: {}", rank_, m.reason), gone);
    }
    case DownKind::kView:
      apply_view(m);
      return std::nullopt;
    case DownKind::kRecover:
      return report(ep, m.step, m.attempt);
    case DownKind::kDecide:
      apply_decide(ep, m.decide);
      return std::nullopt;
    case DownKind::kJoining:
      rejoin_.joining(m.joiner, m.incarnation);
      return std::nullopt;
  }
  return std::nullopt;
}

const std::vector<int>& Follower::admitted_by_coordinator() const {
  static const std::vector<int> none;
  return admitted_by_ == succession_.coordinator() ? admitted_ : none;
}

void Follower::apply_view(const qproto::Down& m) {
  if (m.view.epoch <= view_.epoch)
    throw ProtocolError(
        fmt::format("rank {}: quorum: view {} after view {}", rank_, m.view.epoch, view_.epoch));
  view_ = m.view;
  const auto now = engine_.now();
  ViewChange v;
  v.epoch = view_.epoch;
  v.members = view_.members;
  for (auto& d : m.left) v.left.push_back({d.rank, qproto::to_string(d.why), d.silent_ms});
  if (admitted_by_ != succession_.coordinator()) admitted_.clear();
  admitted_by_ = succession_.coordinator();
  for (auto& j : m.joined) {
    v.joined.push_back({j.rank, j.incarnation, j.step, j.donor});
    if (std::find(admitted_.begin(), admitted_.end(), j.rank) == admitted_.end())
      admitted_.push_back(j.rank);
    runner_.joined(j.rank, j.step);
    if (j.rank == rank_ && rejoin_.joining() && !rejoin_.admitted() &&
        j.incarnation == rejoin_.incarnations()[size_t(rank_)]) {
      rejoin_.admit(j, view_, succession_.coordinator());
      runner_.start_at(j.step);
      liveness_.heard_coordinator(now);
    } else if (j.rank != rank_) {
      // Every member learns it with step j.step's result (QuorumResult::joined).
      std::lock_guard<std::mutex> lock(steps_.mu);
      steps_.steps[j.step].joined.push_back({j.rank, j.incarnation, j.step, j.donor});
    }
  }
  v.seen = now;
  if (rank_ == succession_.coordinator()) {
    std::string who;
    for (auto& d : v.left)
      who += fmt::format("{}rank {} ({}, last heard {:.0f} ms before)", who.empty() ? "" : ", ",
                         d.rank, d.why, d.silent_ms);
    spdlog::warn("quorum: view {}: members {}; left: {}", v.epoch, v.members, who);
  }
  membership_.view_applied(std::move(v));  // gather_reports stops waiting for the lost
  if (!view_.has(rank_))
    throw Evicted(fmt::format("rank {}: evicted from the job in view {} (members {}): the "
                              "other ranks stopped waiting for this one; it must leave (exit)",
                              rank_, view_.epoch, view_.members));
  for (auto& d : m.left) {
    runner_.left(d.rank);  // results owed to ranks that left are no longer sent
    rejoin_.left(d.rank);
  }
}

void Follower::apply_decide(net::Endpoint& ep, const qproto::Decision& d) {
  const uint64_t t = d.step;
  if (rejoin_.joining() && t < rejoin_.join_step()) return;  // before this rank (re)joined
  if (d.epoch != view_.epoch)
    throw ProtocolError(fmt::format("rank {}: quorum step {} decided in view {}, this rank is "
                                    "in view {}",
                                    rank_, t, d.epoch, view_.epoch));
  // Forget the steps every live rank holds (d.settled); keep the decision of a step with a
  // result (a takeover's ACK carries them).
  if (d.settled >= 0) runner_.settled(d.settled);
  ledger_.decision(d);
  membership_.set_members(view_.members);
  runner_.decided(ep, d, succession_.coordinator());
  if (d.attempt == 0) ledger_.answered(t);
}

// A member was lost while step t may be unfinished: say whether this rank holds the result;
// if not, stop working on it and wait for the step to be decided again.
qproto::Up Follower::report(net::Endpoint& ep, uint64_t t, uint32_t attempt) {
  qproto::Up r{UpKind::kReport};
  r.step = t;
  r.attempt = attempt;
  if (rejoin_.joining() && t < rejoin_.join_step())
    r.absent = true;  // before this rank (re)joined: it takes no part in that step
  else
    r.have = runner_.recover(ep, t);
  return r;
}

}  // namespace qring::collectives
