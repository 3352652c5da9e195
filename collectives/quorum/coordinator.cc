#include "collectives/quorum/coordinator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "collectives/quorum/decide_rule.h"
#include "collectives/quorum/liveness.h"

namespace qring::collectives::qproto {

namespace {
constexpr size_t kKeepDecided = 4096;  // decided steps remembered for late arrivals

double ms_between(Time a, Time b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
int64_t us_between(Time a, Time b) {
  return std::chrono::duration_cast<std::chrono::microseconds>(b - a).count();
}
}  // namespace

int quorum_for(const Config& c, int view_size) {
  if (c.fraction > 0)
    return std::max(1, int(std::ceil(c.fraction * double(view_size) - 1e-9)));
  return c.quorum;
}

int floor_for(const Config& c, int view_size) {
  return std::max(quorum_for(c, view_size), c.min_world);
}

bool View::has(int r) const {
  return std::binary_search(members.begin(), members.end(), r);
}

const char* to_string(Why w) {
  switch (w) {
    case Why::kSilent: return "silent";
    case Why::kMissedSteps: return "missed steps";
    case Why::kUnreachable: return "unreachable";
    case Why::kRestarted: return "restarted";
  }
  return "?";
}

Coordinator::Coordinator(Config cfg, Time now) : cfg_(std::move(cfg)) {
  view_.epoch = 0;
  for (int r = 0; r < cfg_.world; ++r) view_.members.push_back(r);
  last_heard_.assign(size_t(cfg_.world), now);
  completed_.assign(size_t(cfg_.world), -1);
  missed_.assign(size_t(cfg_.world), 0);
  suspect_.assign(size_t(cfg_.world), false);
  finished_.assign(size_t(cfg_.world), false);
  heard_.assign(size_t(cfg_.world), false);
  incarnation_.assign(size_t(cfg_.world), 0);
  joined_at_.assign(size_t(cfg_.world), 0);
  catching_up_.assign(size_t(cfg_.world), false);
}

Coordinator::Coordinator(Config cfg, Time now, View view, const std::vector<int64_t>& completed,
                         const std::vector<Known>& known, std::vector<Down>& out,
                         const std::vector<uint32_t>& incarnations)
    : Coordinator(std::move(cfg), now) {
  view_ = std::move(view);
  for (size_t r = 0; r < incarnations.size() && r < incarnation_.size(); ++r)
    incarnation_[r] = incarnations[r];
  for (int r : view_.members) {
    heard_[size_t(r)] = true;
    if (size_t(r) < completed.size()) completed_[size_t(r)] = completed[size_t(r)];
  }
  Down v(Down::Kind::kView);
  v.view = view_;
  for (int r = 0; r < cfg_.world; ++r)
    if (!view_.has(r)) v.left.push_back({r, Why::kSilent, double(cfg_.evict.count())});
  out.push_back(v);
  uint64_t next = 0;
  for (const auto& k : known) {
    next = std::max(next, k.step + 1);
    auto& u = unsettled_[k.step];
    if (k.attempt >= u.attempt) {
      u.attempt = k.attempt;
      u.contributors = k.contributors;
      u.skipped = k.skipped;
    }
  }
  low_water_ = next;  // every step below was decided by the old coordinator
  next_step_ = next;
  // A member that joined after a known step reports itself absent from its recovery.
  for (auto it = unsettled_.begin(); it != unsettled_.end();) {
    auto& [t, u] = *it;
    const int64_t step = int64_t(t);  // (clang 14 cannot capture a structured binding)
    bool all = std::all_of(view_.members.begin(), view_.members.end(),
                           [&](int r) { return completed_[size_t(r)] >= step; });
    if (all || u.skipped) {
      it = unsettled_.erase(it);
      continue;
    }
    // The old coordinator may have been part of it, or may have decided it again where not
    // every member saw: ask everyone, as after any loss.
    u.recovering = true;
    ++u.attempt;
    Down a(Down::Kind::kRecover);
    a.step = t;
    a.attempt = u.attempt;
    out.push_back(a);
    ++it;
  }
}

int Coordinator::contributing() const {
  int n = 0;
  for (int r : view_.members) n += catching_up_[size_t(r)] ? 0 : 1;
  return n;
}

bool Coordinator::waiting() const {
  if (!open_.empty()) return true;
  return std::any_of(unsettled_.begin(), unsettled_.end(),
                     [](const auto& u) { return u.second.recovering; });
}

void Coordinator::resync(Time now) {
  for (int r : view_.members) last_heard_[size_t(r)] = now;
}

std::vector<Down> Coordinator::handle(const Event& e, Time now, bool more) {
  std::vector<Down> out;
  if (stopped_) return out;
  if (e.kind == Event::Kind::kJoin || e.kind == Event::Kind::kHello) {
    // About a rank that is not a member (yet): found in the store, or connected.
    const int r = e.from;
    if (r < 0 || r >= cfg_.world || r == cfg_.self) return out;
    if (e.kind == Event::Kind::kJoin) {
      on_join(r, uint32_t(e.count), now, out);
    } else if (auto j = joins_.find(r); j != joins_.end() && j->second.incarnation == e.count) {
      j->second.hello = true;
    }
    if (!stopped_) tick(now, out);
    return out;
  }
  if (e.kind != Event::Kind::kTick) {
    const int r = e.from;
    if (r < 0 || r >= cfg_.world) return out;
    if (!view_.has(r)) {
      // An evicted rank that is alive: it learns at its first contact.
      Down a(Down::Kind::kEvicted);
      a.to = r;
      out.push_back(std::move(a));
      return out;
    }
    last_heard_[size_t(r)] = now;
    heard_[size_t(r)] = true;
    if (e.kind != Event::Kind::kSuspect) suspect_[size_t(r)] = false;  // it spoke: reachable
    completed_[size_t(r)] = std::max(completed_[size_t(r)], e.completed);
    switch (e.kind) {
      case Event::Kind::kReady:
        if (e.digest) {
          check_digest(r, e.step, *e.digest, out);
          if (stopped_) return out;
        }
        // The result norm of step - 1 first: step's quorum, chosen as it opens, values the
        // step with the estimate through step - 1 (as qring-sim does).
        if (cfg_.auto_estimate) take_result_norm(e);
        on_ready(r, e.step, e.count, e.layout, now);
        if (cfg_.auto_estimate) take_grad_norm(r, e);
        break;
      case Event::Kind::kReport: {
        auto it = unsettled_.find(e.step);
        if (it != unsettled_.end() && it->second.recovering && it->second.attempt == e.attempt)
          it->second.reports[r] = e.absent ? kAbsent : e.have ? kHave : kNeed;
        break;
      }
      case Event::Kind::kAccept: {
        auto j = joins_.find(e.suspect);
        if (j != joins_.end() && j->second.incarnation == e.count &&
            std::find(j->second.accepted.begin(), j->second.accepted.end(), r) ==
                j->second.accepted.end())
          j->second.accepted.push_back(r);
        break;
      }
      case Event::Kind::kSuspect:
        if (e.suspect >= 0 && e.suspect < cfg_.world) suspect_[size_t(e.suspect)] = true;
        break;
      case Event::Kind::kBye:
        finished_[size_t(r)] = true;
        break;
      default:
        break;
    }
  }
  if (!more) tick(now, out);
  return out;
}

void Coordinator::check_digest(int from, uint64_t step, uint64_t digest,
                               std::vector<Down>& out) {
  auto [it, fresh] = digests_.try_emplace(step, from, digest);
  if (fresh) {
    while (digests_.size() > 64) digests_.erase(digests_.begin());
    return;
  }
  const auto [first, want] = it->second;
  if (want == digest) return;
  Down f(Down::Kind::kFatal);
  f.reason = fmt::format(
      "replicas drifted: before step {} rank {} has parameter checksum {:016x}, rank {} has "
      "{:016x}",
      step, first, want, from, digest);
  out.push_back(std::move(f));
  stopped_ = true;
}

void Coordinator::on_ready(int from, uint64_t step, uint64_t count, uint32_t layout, Time now) {
  catching_up_[size_t(from)] = false;  // a rank that rejoined computes again
  const bool late = step < low_water_ || first_of_decided_.count(step);
  if (late) {
    auto u = unsettled_.find(step);
    if (u != unsettled_.end() && view_.has(from) &&
        std::find(u->second.late.begin(), u->second.late.end(), from) == u->second.late.end())
      u->second.late.push_back(from);
    auto f = first_of_decided_.find(step);
    if (f != first_of_decided_.end()) {
      if (on_arrival_) on_arrival_(step, from, ms_between(f->second, now));
      if (cfg_.adaptive) window_.late(step, from, ms_between(f->second, now));
    }
    return;  // decided without it: the rank learns from DECIDE
  }
  auto [it, fresh] = open_.try_emplace(step);
  Open& o = it->second;
  if (fresh) {
    o.first = now;
    o.arrived.assign(size_t(cfg_.world), std::nullopt);
    if (cfg_.adaptive) {
      if (auto p = first_of_decided_.find(step - 1); step > 0 && p != first_of_decided_.end())
        window_.opened(step, ms_between(p->second, now));
      std::vector<int> computing;  // a rank that rejoined and is catching up contributes nothing
      for (int r : view_.members)
        if (!catching_up_[size_t(r)]) computing.push_back(r);
      o.quorum =
          choose_quorum(window_.samples(), computing, cfg_.quorum, cfg_.auto_max, kappa()).quorum;
    }
  }
  if (o.arrived[size_t(from)]) return;  // duplicate READY
  o.arrived[size_t(from)] = now;
  if (on_arrival_) on_arrival_(step, from, ms_between(o.first, now));
  if ((count != cfg_.count || layout != cfg_.layout) && !o.mismatch) {
    o.mismatch = true;
    o.bad_rank = from;
    o.bad_count = count;
    o.bad_layout = layout;
  }
  recount(o, now);
}

int Coordinator::quorum_of(const Open& o) const {
  const int q = quorum();
  const int n = contributing();
  return o.quorum > 0 ? std::clamp(o.quorum, std::min(q, n), n) : q;
}

void Coordinator::recount(Open& o, Time now) const {
  o.n = 0;
  for (int r : view_.members)
    if (o.arrived[size_t(r)]) ++o.n;
  if (o.n >= quorum_of(o)) {
    if (!o.quorum_time) o.quorum_time = now;
  } else {
    o.quorum_time.reset();
  }
}

void Coordinator::tick(Time now, std::vector<Down>& out) {
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
    if (r == cfg_.self || finished_[size_t(r)]) continue;
    double silent = ms_between(last_heard_[size_t(r)], now);
    // Evict + a heartbeat period (liveness.h: a pause shorter than evict never evicts); until a
    // rank has spoken once (start-up: loading data, connecting) the deadline instead of evict.
    const double limit =
        std::chrono::duration<double, std::milli>(silence_limit(heard_[size_t(r)], times)).count();
    if (silent > limit)
      add({r, Why::kSilent, silent});
    else if (suspect_[size_t(r)] && silent > double(cfg_.evict.count()) / 4)
      add({r, Why::kUnreachable, silent});  // a transport error and a missed heartbeat
  }
  if (!left.empty()) {
    std::sort(left.begin(), left.end(),
              [](const Departure& a, const Departure& b) { return a.rank < b.rank; });
    change_view(std::move(left), now, out);
    if (stopped_) return;
  }
  admit_joiners(now, out);
  resolve_recoveries(out);
  decide_open(now, out);
  settle();
}

void Coordinator::on_join(int r, uint32_t inc, Time now, std::vector<Down>& out) {
  if (inc <= incarnation_[size_t(r)]) return;  // known already
  incarnation_[size_t(r)] = inc;
  if (view_.has(r)) {
    // The old incarnation is gone (a restarted process), or will learn it was replaced.
    change_view({{r, Why::kRestarted, ms_between(last_heard_[size_t(r)], now)}}, now, out);
    if (stopped_) return;
  }
  Join& j = joins_[r];
  j = Join{};
  j.incarnation = inc;
  j.started = now;
  Down a(Down::Kind::kJoining);
  a.joiner = r;
  a.incarnation = inc;
  out.push_back(std::move(a));
}

void Coordinator::admit_joiners(Time now, std::vector<Down>& out) {
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
      ready.push_back({it->first, j.incarnation, next_step_, cfg_.self});
      it = joins_.erase(it);
    } else {
      ++it;
    }
  }
  if (ready.empty()) return;
  View next;
  next.epoch = view_.epoch + 1;
  next.members = view_.members;
  for (const Joined& j : ready) {
    const size_t r = size_t(j.rank);
    next.members.push_back(j.rank);
    joined_at_[r] = j.step;
    completed_[r] = int64_t(j.step) - 1;
    last_heard_[r] = now;
    heard_[r] = true;
    missed_[r] = 0;
    suspect_[r] = false;
    finished_[r] = false;
    catching_up_[r] = true;
  }
  std::sort(next.members.begin(), next.members.end());
  view_ = next;
  Down v(Down::Kind::kView);
  v.view = view_;
  v.joined = std::move(ready);
  out.push_back(std::move(v));
  for (auto& [t, o] : open_) recount(o, now);
}

void Coordinator::change_view(std::vector<Departure> left, Time now, std::vector<Down>& out) {
  const int prev_size = view_.size();
  View next;
  next.epoch = view_.epoch + 1;
  for (int r : view_.members) {
    bool gone = std::any_of(left.begin(), left.end(), [&](const Departure& d) { return d.rank == r; });
    if (!gone) next.members.push_back(r);
  }
  view_ = next;
  Down v(Down::Kind::kView);
  v.view = view_;
  v.left = left;
  out.push_back(v);

  const int floor = floor_for(cfg_, view_.size());
  // A view must keep a majority of the one before: a side cut off from the rest never goes
  // on alone (the other side, with the majority, elects a new coordinator).
  const bool majority = 2 * view_.size() > prev_size;
  if (view_.size() < floor || !majority) {
    std::string who;
    for (auto& d : left)
      who += fmt::format("{}rank {} ({}, last heard {:.0f} ms ago)", who.empty() ? "" : ", ",
                         d.rank, to_string(d.why), d.silent_ms);
    Down f(Down::Kind::kFatal);
    f.reason =
        majority
            ? fmt::format("only {} of {} ranks are left (members {}), fewer than the {} the job "
                          "needs (quorum {}, min_world {}); left in view {}: {}",
                          view_.size(), cfg_.world, view_.members, floor,
                          quorum_for(cfg_, view_.size()), cfg_.min_world, view_.epoch, who)
            : fmt::format("lost a majority of the last view ({} of {} ranks left: {}): this "
                          "side may be cut off from the others and stops; left in view {}: {}",
                          view_.size(), prev_size, view_.members, view_.epoch, who);
    out.push_back(f);
    stopped_ = true;
    return;
  }
  for (auto& [t, o] : open_) recount(o, now);
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
    Down a(Down::Kind::kRecover);
    a.step = t;
    a.attempt = u.attempt;
    out.push_back(a);
  }
}

void Coordinator::resolve_recoveries(std::vector<Down>& out) {
  for (auto& [t, u] : unsettled_) {
    if (!u.recovering) continue;
    // Members that joined after step t take no part in it (they report absent, or the
    // coordinator knows).
    const auto& reports = u.reports;  // (clang 14 cannot capture a structured binding)
    const uint64_t step = t;
    bool all = std::all_of(view_.members.begin(), view_.members.end(), [&](int r) {
      return !in_step(r, step) || reports.count(r) != 0;
    });
    if (!all) continue;
    Decision d;
    d.step = t;
    d.attempt = u.attempt;
    d.epoch = view_.epoch;
    d.quorum = quorum();
    d.offsets_us.assign(size_t(cfg_.world), -1);
    d.settled = settled_;
    std::vector<int> haves, needers;
    for (int r : view_.members) {
      if (!in_step(r, t) || u.reports[r] == kAbsent) continue;
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
      std::vector<int> survivors;
      for (int r : u.contributors)
        if (view_.has(r)) survivors.push_back(r);
      for (int r : u.late)
        if (view_.has(r)) survivors.push_back(r);
      // A rank may be both (after a takeover it sends its READY again): count it once.
      std::sort(survivors.begin(), survivors.end());
      survivors.erase(std::unique(survivors.begin(), survivors.end()), survivors.end());
      step_norms_.erase(t);  // decided again: its first contributors' norms do not apply
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
    u.recovering = false;
    Down a(Down::Kind::kDecide);
    a.decide = std::move(d);
    out.push_back(std::move(a));
  }
}

void Coordinator::decide_open(Time now, std::vector<Down>& out) {
  const int q = quorum();
  const int eligible = contributing();
  // A lease: decide only while a majority of the view has been heard from within half the
  // evict time. A coordinator cut off from the others stops deciding before any member,
  // which waits the whole evict time, can start to take over from it.
  int fresh = 0;
  for (int r : view_.members)
    if (r == cfg_.self || ms_between(last_heard_[size_t(r)], now) <= double(cfg_.evict.count()) / 2)
      ++fresh;
  if (2 * fresh <= view_.size()) return;
  for (auto it = open_.begin(); it != open_.end();) {
    Open& o = it->second;
    Status st;
    if (o.mismatch)
      st = Status::kMismatch;
    else if (step_due(o.n, eligible,
                      o.quorum_time ? std::optional<RuleMs>(now - *o.quorum_time) : std::nullopt,
                      cfg_.grace))
      st = Status::kOk;
    else if (now >= o.first + cfg_.deadline)
      st = Status::kTimeout;
    else {
      ++it;
      continue;
    }
    const uint64_t t = it->first;
    Decision d;
    d.step = t;
    d.epoch = view_.epoch;
    d.status = st;
    d.quorum = o.quorum > 0 ? quorum_of(o) : q;
    d.decide_us = us_between(o.first, now);
    d.bad_rank = o.bad_rank;
    d.bad_count = o.bad_count;
    d.bad_layout = o.bad_layout;
    d.settled = settled_;
    d.offsets_us.assign(size_t(cfg_.world), -1);
    for (int r = 0; r < cfg_.world; ++r)
      if (o.arrived[size_t(r)]) d.offsets_us[size_t(r)] = us_between(o.first, *o.arrived[size_t(r)]);
    for (int r : view_.members)
      if (o.arrived[size_t(r)]) d.contributors.push_back(r);
    if (st == Status::kOk) {
      for (int r : view_.members) {
        if (o.arrived[size_t(r)]) {
          missed_[size_t(r)] = 0;
        } else if (catching_up_[size_t(r)]) {
          // A rank that rejoined applies the results it missed before it contributes.
        } else if (++missed_[size_t(r)] >= cfg_.evict_steps && cfg_.evict_steps > 0) {
          pending_.push_back({r, Why::kMissedSteps, ms_between(last_heard_[size_t(r)], now)});
        }
      }
      unsettled_[t].contributors = d.contributors;
      if (cfg_.adaptive) {
        StepArrivals a;
        a.offset_ms.assign(size_t(cfg_.world), StepArrivals::kNotMember);
        for (int r : view_.members)
          a.offset_ms[size_t(r)] = o.arrived[size_t(r)] ? ms_between(o.first, *o.arrived[size_t(r)])
                                                        : StepArrivals::kNotArrived;
        a.decided_ms = ms_between(o.first, now);
        window_.decided(t, std::move(a));
        if (cfg_.auto_estimate) keep_norms(t, o, d.contributors);
      }
    } else {
      stopped_ = true;  // every rank fails the step: the job ends
    }
    first_of_decided_[t] = o.first;
    next_step_ = std::max(next_step_, t + 1);
    while (first_of_decided_.size() > kKeepDecided) {
      low_water_ = std::max(low_water_, first_of_decided_.begin()->first + 1);
      first_of_decided_.erase(first_of_decided_.begin());
    }
    it = open_.erase(it);
    Down a(Down::Kind::kDecide);
    a.decide = std::move(d);
    out.push_back(std::move(a));
    if (stopped_) return;
  }
}

double Coordinator::kappa() const {
  if (!cfg_.auto_estimate) return cfg_.auto_kappa;
  return noise_.value().value_or(cfg_.auto_kappa);
}

void Coordinator::take_result_norm(const Event& e) {
  // The result of step - 1 (every rank has the same): with its contributors' norms, kept at
  // its decision, one step of the estimate.
  if (!e.prev_mean_sq || e.step == 0) return;
  auto it = step_norms_.find(e.step - 1);
  if (it == step_norms_.end()) return;
  noise_.add(it->second.first, it->second.second, *e.prev_mean_sq);
  step_norms_.erase(it);
}

void Coordinator::take_grad_norm(int from, const Event& e) {
  auto o = open_.find(e.step);
  if (o == open_.end() || !e.grad_sq) return;
  if (o->second.grad_sq.empty()) o->second.grad_sq.assign(size_t(cfg_.world), -1.0);
  o->second.grad_sq[size_t(from)] = *e.grad_sq;
}

void Coordinator::keep_norms(uint64_t t, const Open& o, const std::vector<int>& contributors) {
  double sum = 0;
  for (int r : contributors) {
    if (o.grad_sq.empty() || o.grad_sq[size_t(r)] < 0) return;  // a contributor sent none
    sum += o.grad_sq[size_t(r)];
  }
  if (contributors.size() < 2) return;
  step_norms_[t] = {int(contributors.size()), sum / double(contributors.size())};
  while (step_norms_.size() > 8) step_norms_.erase(step_norms_.begin());
}

void Coordinator::settle() {
  while (!unsettled_.empty()) {
    auto it = unsettled_.begin();
    if (it->second.recovering) return;
    const int64_t t = int64_t(it->first);
    bool all = std::all_of(view_.members.begin(), view_.members.end(), [&](int r) {
      return completed_[size_t(r)] >= t || !in_step(r, uint64_t(t));
    });
    if (!all) return;
    settled_ = std::max(settled_, t);
    unsettled_.erase(it);
  }
}

}  // namespace qring::collectives::qproto
