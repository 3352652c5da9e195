#include "collectives/quorum/roster.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "collectives/quorum/liveness.h"

namespace qring::collectives::qproto {

Roster::Roster(const Config& cfg, Time now) : cfg_(cfg) {
  view_.epoch = 0;
  for (int r = 0; r < cfg_.world; ++r) view_.members.push_back(r);
  last_heard_.assign(size_t(cfg_.world), now);
  excused_.assign(size_t(cfg_.world), Clock::duration(0));
  completed_.assign(size_t(cfg_.world), -1);
  missed_.assign(size_t(cfg_.world), 0);
  left_why_.assign(size_t(cfg_.world), Why::kSilent);
  suspect_.assign(size_t(cfg_.world), false);
  finished_.assign(size_t(cfg_.world), false);
  died_.assign(size_t(cfg_.world), false);
  heard_.assign(size_t(cfg_.world), false);
  incarnation_.assign(size_t(cfg_.world), 0);
  joined_at_.assign(size_t(cfg_.world), 0);
  catching_up_.assign(size_t(cfg_.world), false);
  awaiting_state_.assign(size_t(cfg_.world), false);
  lag_from_.assign(size_t(cfg_.world), now);
}

void Roster::restore(View view, const std::vector<int64_t>& completed,
                     const std::vector<uint32_t>& incarnations) {
  view_ = std::move(view);
  for (size_t r = 0; r < incarnations.size() && r < incarnation_.size(); ++r)
    incarnation_[r] = incarnations[r];
  for (int r : view_.members) {
    heard_[size_t(r)] = true;
    if (size_t(r) < completed.size()) completed_[size_t(r)] = completed[size_t(r)];
  }
}

void Roster::heard(const Event& e, Time now) {
  const size_t r = size_t(e.from);
  last_heard_[r] = now;
  excused_[r] = Clock::duration(0);
  heard_[r] = true;
  if (e.kind != Event::Kind::kSuspect) suspect_[r] = false;  // it spoke: reachable
  completed_[r] = std::max(completed_[r], e.completed);
  if (awaiting_state_[r] && completed_[r] >= int64_t(joined_at_[r])) {
    awaiting_state_[r] = false;  // its state arrived: it catches up from here
    lag_from_[r] = std::max(lag_from_[r], now);
  }
}

int Roster::contributing() const {
  int n = 0;
  for (int r : view_.members) n += catching_up_[size_t(r)] ? 0 : 1;
  return n;
}

int Roster::heard_within(Time now, double ms) const {
  int n = 0;
  for (int r : view_.members)
    if (r == cfg_.self || ms_between(last_heard_[size_t(r)], now) <= ms) ++n;
  return n;
}

std::vector<int> Roster::quiet(Time now, double ms) const {
  std::vector<int> q;
  for (int r : view_.members)
    if (r != cfg_.self && !finished_[size_t(r)] &&
        (suspect_[size_t(r)] || ms_between(last_heard_[size_t(r)], now) > ms))
      q.push_back(r);
  return q;
}

void Roster::resync(Time now) {
  for (int r : view_.members) {
    last_heard_[size_t(r)] = now;
    excused_[size_t(r)] = Clock::duration(0);
    lag_from_[size_t(r)] = std::max(lag_from_[size_t(r)], now);
  }
}

void Roster::excuse(Clock::duration d) {
  for (int r : view_.members) excused_[size_t(r)] += d;
}

double Roster::counted_silent_ms(int r, Time now) const {
  const auto silent = now - last_heard_[size_t(r)];
  return std::chrono::duration<double, std::milli>(silent - std::min(silent, excused_[size_t(r)]))
      .count();
}

void Roster::count_misses(const std::vector<int>& contributors, Time now) {
  for (int r : view_.members) {
    if (std::binary_search(contributors.begin(), contributors.end(), r)) {
      missed_[size_t(r)] = 0;
    } else if (catching_up_[size_t(r)]) {
      // A rank that rejoined applies the results it missed before it contributes.
    } else if (++missed_[size_t(r)] >= cfg_.evict_steps && cfg_.evict_steps > 0) {
      pending_.push_back({r, Why::kMissedSteps, ms_between(last_heard_[size_t(r)], now)});
    }
  }
}

std::vector<Departure> Roster::departures(Time now) {
  std::vector<Departure> left;
  auto add = [&](const Departure& d) {
    if (d.rank == cfg_.self || !view_.has(d.rank)) return;
    for (auto& l : left)
      if (l.rank == d.rank) return;
    left.push_back(d);
  };
  for (auto& d : pending_) add(d);
  pending_.clear();
  const LivenessTimes times = LivenessTimes::of(cfg_.evict, cfg_.deadline);
  for (int r : view_.members) {
    if (r == cfg_.self) continue;
    const double silent = silent_ms(r, now);
    const double counted = counted_silent_ms(r, now);
    if (died_[size_t(r)]) {
      add({r, Why::kDied, silent});
      continue;
    }
    if (finished_[size_t(r)]) continue;
    // Evict + a heartbeat period (liveness.h: a pause shorter than evict never evicts); until a
    // rank has spoken once (start-up: loading data, connecting) the deadline instead of evict.
    const double limit =
        std::chrono::duration<double, std::milli>(silence_limit(heard_[size_t(r)], times)).count();
    if (counted > limit)
      add({r, Why::kSilent, silent});
    else if (suspect_[size_t(r)] && counted > double(cfg_.evict.count()) / 4)
      add({r, Why::kUnreachable, silent});  // a transport error and a missed heartbeat
  }
  std::sort(left.begin(), left.end(),
            [](const Departure& a, const Departure& b) { return a.rank < b.rank; });
  return left;
}

int Roster::remove(const std::vector<Departure>& left) {
  const int prev_size = view_.size();
  View next;
  next.epoch = view_.epoch + 1;
  for (int r : view_.members) {
    auto gone = std::find_if(left.begin(), left.end(), [&](const Departure& d) { return d.rank == r; });
    if (gone == left.end())
      next.members.push_back(r);
    else
      left_why_[size_t(r)] = gone->why;
  }
  view_ = next;
  return prev_size;
}

std::optional<std::string> Roster::stop_reason(const std::vector<Departure>& left,
                                               int prev_size) const {
  const int floor = floor_for(cfg_, view_.size());
  // A view must keep a majority of the one before: a side cut off from the rest never goes
  // on alone (the other side, with the majority, elects a new coordinator). A rank whose
  // death the store witnessed is on no side: it leaves the denominator.
  const int died = int(std::count_if(left.begin(), left.end(),
                                     [](const Departure& d) { return d.why == Why::kDied; }));
  const bool majority = 2 * view_.size() > prev_size - died;
  if (view_.size() >= floor && majority) return std::nullopt;
  std::string who;
  for (auto& d : left)
    who += fmt::format("{}rank {} ({}, last heard {:.0f} ms ago)", who.empty() ? "" : ", ",
                       d.rank, to_string(d.why), d.silent_ms);
  return majority
             ? fmt::format("only {} of {} ranks are left (members {}), fewer than the {} the job "
                           "needs (quorum {}, min_world {}); left in view {}: {}",
                           view_.size(), cfg_.world, view_.members, floor,
                           quorum_for(cfg_, view_.size()), cfg_.min_world, view_.epoch, who)
             : fmt::format("lost a majority of the last view ({} of {} ranks left: {}; {} of the "
                           "lost witnessed dead): the others may be alive on the other side of "
                           "a partition, so this side stops (a job goes on only with a majority "
                           "of the last view less the ranks whose death the store witnessed); "
                           "left in view {}: {}",
                           view_.size(), prev_size, view_.members, died, view_.epoch, who);
}

bool Roster::new_incarnation(int r, uint32_t inc) {
  if (inc <= incarnation_[size_t(r)]) return false;  // known already
  incarnation_[size_t(r)] = inc;
  return true;
}

namespace {
Down joining_message(int r, uint32_t inc) {
  Down a(Down::Kind::kJoining);
  a.joiner = r;
  a.incarnation = inc;
  return a;
}
}  // namespace

Down Roster::start_join(int r, uint32_t inc, Time now) {
  Join& j = joins_[r];
  j = Join{};
  j.incarnation = inc;
  j.started = now;
  return joining_message(r, inc);
}

std::vector<Down> Roster::joins_again() const {
  std::vector<Down> out;
  for (const auto& [r, j] : joins_) out.push_back(joining_message(r, j.incarnation));
  return out;
}

void Roster::hello(int r, uint64_t inc) {
  if (auto j = joins_.find(r); j != joins_.end() && j->second.incarnation == inc)
    j->second.hello = true;
}

void Roster::accepted(int joiner, uint64_t inc, int from) {
  auto j = joins_.find(joiner);
  if (j != joins_.end() && j->second.incarnation == inc &&
      std::find(j->second.accepted.begin(), j->second.accepted.end(), from) ==
          j->second.accepted.end())
    j->second.accepted.push_back(from);
}

std::optional<Down> Roster::admit(Time now, uint64_t step) {
  std::vector<Joined> ready;
  for (auto it = joins_.begin(); it != joins_.end();) {
    const Join& j = it->second;
    if (now - j.started > cfg_.join_timeout) {
      it = joins_.erase(it);  // the joiner gives up by its own deadline
      continue;
    }
    const bool all = std::all_of(view_.members.begin(), view_.members.end(), [&](int m) {
      return std::find(j.accepted.begin(), j.accepted.end(), m) != j.accepted.end();
    });
    if (j.hello && all && !view_.has(it->first)) {
      ready.push_back({it->first, j.incarnation, step, cfg_.self});
      it = joins_.erase(it);
    } else {
      ++it;
    }
  }
  if (ready.empty()) return std::nullopt;
  View next;
  next.epoch = view_.epoch + 1;
  next.members = view_.members;
  for (const Joined& j : ready) {
    const size_t r = size_t(j.rank);
    next.members.push_back(j.rank);
    joined_at_[r] = j.step;
    completed_[r] = int64_t(j.step) - 1;
    last_heard_[r] = now;
    excused_[r] = Clock::duration(0);
    // A new incarnation starts in the view: it speaks only once the VIEW reached it (a
    // connection it may still have to complete, a pass of its engine), which the coordinator
    // cannot see; until then the start-up limit applies, as to every rank before it spoke.
    heard_[r] = false;
    missed_[r] = 0;
    suspect_[r] = false;
    finished_[r] = false;
    died_[r] = false;
    catching_up_[r] = true;
    awaiting_state_[r] = true;
  }
  std::sort(next.members.begin(), next.members.end());
  view_ = next;
  Down v(Down::Kind::kView);
  v.view = view_;
  v.joined = std::move(ready);
  return v;
}

}  // namespace qring::collectives::qproto
