#include "collectives/quorum/step_recovery.h"

#include <algorithm>

namespace qring::collectives::qproto {

namespace {
Down recover(uint64_t t, uint32_t attempt) {
  Down a(Down::Kind::kRecover);
  a.step = t;
  a.attempt = attempt;
  return a;
}
}  // namespace

uint64_t StepRecovery::rebuild(const std::vector<Known>& known, const Roster& roster,
                               std::vector<Down>& out, Time now) {
  uint64_t next = 0;
  for (const auto& k : known) {
    next = std::max(next, k.step + 1);
    auto& u = unsettled_[k.step];
    u.decided_at = now;
    if (k.attempt >= u.attempt) {
      u.attempt = k.attempt;
      u.contributors = k.contributors;
      u.skipped = k.skipped;
    }
  }
  // The members' ACKs carry the last few decisions only (qwire::kMaxKnown): a member that lags
  // further still awaits results of steps nobody told this coordinator of. Those are recovered
  // too, S(t) unknown here: a member that holds the result forwards it (the needers keep the
  // S(t) they were told), or nobody live has it and the step is skipped everywhere.
  const auto& members = roster.view().members;
  int64_t lo = int64_t(next);
  for (int r : members) lo = std::min(lo, roster.completed(r) + 1);
  for (uint64_t t = uint64_t(std::max<int64_t>(lo, 0)); t < next; ++t)
    if (!unsettled_.count(t)) unsettled_[t].decided_at = now;
  // A member that joined after a known step reports itself absent from its recovery.
  for (auto it = unsettled_.begin(); it != unsettled_.end();) {
    auto& [t, u] = *it;
    const int64_t step = int64_t(t);  // (clang 14 cannot capture a structured binding)
    bool all = std::all_of(members.begin(), members.end(),
                           [&](int r) { return roster.completed(r) >= step; });
    if (all || u.skipped) {
      it = unsettled_.erase(it);
      continue;
    }
    // The old coordinator may have been part of it, or may have decided it again where not
    // every member saw: ask everyone, as after any loss.
    u.recovering = true;
    ++u.attempt;
    out.push_back(recover(t, u.attempt));
    ++it;
  }
  return next;
}

std::vector<int> StepRecovery::behind(const Roster& roster, Time now,
                                      Clock::duration limit) const {
  std::vector<int> lagging;
  // Decisions come in step order, so no member lags more than the oldest unsettled step: in
  // the common case (nobody behind) one look, not one per member.
  if (unsettled_.empty() || now - unsettled_.begin()->second.decided_at <= limit) return lagging;
  for (int r : roster.view().members) {
    if (r == roster.self() || !roster.lag_counts(r)) continue;
    const uint64_t first_missing = uint64_t(roster.completed(r) + 1);
    auto u = unsettled_.find(first_missing);
    if (u == unsettled_.end() || u->second.decided_at == Time{}) continue;  // not decided yet
    const Time from = std::max(u->second.decided_at, roster.lag_from(r));
    if (now - from - roster.excused(r) > limit) lagging.push_back(r);
  }
  return lagging;
}

void StepRecovery::late(uint64_t t, int from) {
  auto u = unsettled_.find(t);
  if (u != unsettled_.end() &&
      std::find(u->second.late.begin(), u->second.late.end(), from) == u->second.late.end())
    u->second.late.push_back(from);
}

void StepRecovery::report(int from, const Event& e) {
  auto it = unsettled_.find(e.step);
  if (it != unsettled_.end() && it->second.recovering && it->second.attempt == e.attempt)
    it->second.reports[from] = e.absent ? kAbsent : e.have ? kHave : kNeed;
}

bool StepRecovery::recovering() const {
  return std::any_of(unsettled_.begin(), unsettled_.end(),
                     [](const auto& u) { return u.second.recovering; });
}

void StepRecovery::lost(const std::vector<Departure>& left, std::vector<Down>& out) {
  for (auto& [t, u] : unsettled_) {
    if (u.recovering || u.skipped) continue;  // a recovery waits for the remaining members
    bool hit = false;
    for (auto& d : left)
      hit |= d.rank == u.source ||
             std::binary_search(u.contributors.begin(), u.contributors.end(), d.rank);
    if (!hit) continue;
    u.recovering = true;
    ++u.attempt;
    u.reports.clear();
    out.push_back(recover(t, u.attempt));
  }
}

void StepRecovery::resolve(const Roster& roster, int world, std::vector<Down>& out,
                           std::vector<uint64_t>& redecided) {
  const View& view = roster.view();
  for (auto& [t, u] : unsettled_) {
    if (!u.recovering) continue;
    // Members that joined after step t take no part in it (they report absent, or the
    // coordinator knows).
    const auto& reports = u.reports;  // (clang 14 cannot capture a structured binding)
    const uint64_t step = t;
    bool all = std::all_of(view.members.begin(), view.members.end(), [&](int r) {
      return !roster.in_step(r, step) || reports.count(r) != 0;
    });
    if (!all) continue;
    Decision d;
    d.step = t;
    d.attempt = u.attempt;
    d.epoch = view.epoch;
    d.quorum = roster.quorum();
    d.offsets_us.assign(size_t(world), -1);
    d.settled = settled_;
    std::vector<int> haves, needers;
    for (int r : view.members) {
      if (!roster.in_step(r, t) || u.reports[r] == kAbsent) continue;
      (u.reports[r] == kHave ? haves : needers).push_back(r);
    }
    if (!haves.empty()) {
      // Someone completed the step: its result (with the departed member's contribution)
      // is the step's result everywhere.
      d.contributors = u.contributors;
      d.source = haves.front();
      d.needers = needers;
      u.source = d.source;
    } else {
      redecide(u, roster, d);
      redecided.push_back(t);
    }
    u.recovering = false;
    Down a(Down::Kind::kDecide);
    a.decide = std::move(d);
    out.push_back(std::move(a));
  }
}

// Nobody holds the step's result: a new reduction among its surviving contributors, or the step
// skipped everywhere when fewer than the quorum are left.
void StepRecovery::redecide(Unsettled& u, const Roster& roster, Decision& d) {
  std::vector<int> survivors;
  for (int r : u.contributors)
    if (roster.view().has(r)) survivors.push_back(r);
  for (int r : u.late)
    if (roster.view().has(r)) survivors.push_back(r);
  // A rank may be both (after a takeover it sends its READY again): count it once.
  std::sort(survivors.begin(), survivors.end());
  survivors.erase(std::unique(survivors.begin(), survivors.end()), survivors.end());
  if (int(survivors.size()) >= d.quorum && !survivors.empty()) {
    d.contributors = survivors;
    u.contributors = survivors;
    u.source = -1;
  } else {
    d.status = Status::kSkipped;
    u.contributors.clear();
    u.skipped = true;
  }
}

void StepRecovery::settle(const Roster& roster) {
  const auto& members = roster.view().members;
  while (!unsettled_.empty()) {
    auto it = unsettled_.begin();
    if (it->second.recovering) return;
    const int64_t t = int64_t(it->first);
    bool all = std::all_of(members.begin(), members.end(), [&](int r) {
      return roster.completed(r) >= t || !roster.in_step(r, uint64_t(t));
    });
    if (!all) return;
    settled_ = std::max(settled_, t);
    unsettled_.erase(it);
  }
}

}  // namespace qring::collectives::qproto
