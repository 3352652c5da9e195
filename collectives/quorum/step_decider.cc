#include "collectives/quorum/step_decider.h"

#include <fmt/format.h>

#include <algorithm>

#include "collectives/quorum/decide_rule.h"

namespace qring::collectives::qproto {

namespace {
constexpr size_t kKeepDecided = 4096;  // decided steps remembered for late arrivals

int64_t us_between(Time a, Time b) {
  return std::chrono::duration_cast<std::chrono::microseconds>(b - a).count();
}
}  // namespace

std::optional<std::string> StepDecider::check_digest(int from, uint64_t step, uint64_t digest) {
  auto [it, fresh] = digests_.try_emplace(step, from, digest);
  if (fresh) {
    while (digests_.size() > 64) digests_.erase(digests_.begin());
    return std::nullopt;
  }
  const auto [first, want] = it->second;
  if (want == digest) return std::nullopt;
  return fmt::format(
      "replicas drifted: before step {} rank {} has parameter checksum {:016x}, rank {} has "
      "{:016x}",
      step, first, want, from, digest);
}

bool StepDecider::arrive(int from, const Event& e, const Roster& roster, Time now) {
  // The result norm of step - 1 first: step's quorum, chosen as it opens, values the step
  // with the estimate through step - 1 (as qring-sim does).
  if (cfg_.auto_estimate) take_result_norm(e);
  const bool open = on_ready(from, e.step, e.count, e.layout, roster, now);
  if (cfg_.auto_estimate) take_grad_norm(from, e);
  return open;
}

bool StepDecider::on_ready(int from, uint64_t step, uint64_t count, uint32_t layout,
                           const Roster& roster, Time now) {
  const View& view = roster.view();
  const bool late = step < low_water_ || first_of_decided_.count(step);
  if (late) {
    auto f = first_of_decided_.find(step);
    if (f != first_of_decided_.end()) {
      if (on_arrival_) on_arrival_(step, from, ms_between(f->second, now));
      if (cfg_.adaptive) window_.late(step, from, ms_between(f->second, now));
    }
    return false;
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
      for (int r : view.members)
        if (!roster.catching_up(r)) computing.push_back(r);
      o.quorum =
          choose_quorum(window_.samples(), computing, cfg_.quorum, cfg_.auto_max, kappa()).quorum;
    }
  }
  if (o.arrived[size_t(from)]) return true;  // duplicate READY
  o.arrived[size_t(from)] = now;
  if (on_arrival_) on_arrival_(step, from, ms_between(o.first, now));
  if ((count != cfg_.count || layout != cfg_.layout) && !o.mismatch) {
    o.mismatch = true;
    o.bad_rank = from;
    o.bad_count = count;
    o.bad_layout = layout;
  }
  count_arrivals(o, roster, now);
  return true;
}

int StepDecider::quorum_of(const Open& o, const Roster& roster) const {
  const int q = roster.quorum();
  const int n = roster.contributing();
  return o.quorum > 0 ? std::clamp(o.quorum, std::min(q, n), n) : q;
}

void StepDecider::count_arrivals(Open& o, const Roster& roster, Time now) const {
  o.n = 0;
  for (int r : roster.view().members)
    if (o.arrived[size_t(r)]) ++o.n;
  if (o.n >= quorum_of(o, roster)) {
    if (!o.quorum_time) o.quorum_time = now;
  } else {
    o.quorum_time.reset();
  }
}

void StepDecider::recount(const Roster& roster, Time now) {
  for (auto& [t, o] : open_) count_arrivals(o, roster, now);
}

void StepDecider::decide(const Roster& roster, Time now, int64_t settled,
                         std::vector<Down>& out) {
  const int eligible = roster.contributing();
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
    Down a(Down::Kind::kDecide);
    a.decide = decision(t, o, st, roster, now, settled);
    out.push_back(std::move(a));
    if (st == Status::kOk && cfg_.adaptive) {
      StepArrivals a;
      a.offset_ms.assign(size_t(cfg_.world), StepArrivals::kNotMember);
      for (int r : roster.view().members)
        a.offset_ms[size_t(r)] = o.arrived[size_t(r)] ? ms_between(o.first, *o.arrived[size_t(r)])
                                                      : StepArrivals::kNotArrived;
      a.decided_ms = ms_between(o.first, now);
      window_.decided(t, std::move(a));
      if (cfg_.auto_estimate) keep_norms(t, o, out.back().decide.contributors);
    }
    first_of_decided_[t] = o.first;
    next_step_ = std::max(next_step_, t + 1);
    while (first_of_decided_.size() > kKeepDecided) {
      low_water_ = std::max(low_water_, first_of_decided_.begin()->first + 1);
      first_of_decided_.erase(first_of_decided_.begin());
    }
    it = open_.erase(it);
    if (st != Status::kOk) return;  // every rank fails the step: the job ends
  }
}

Decision StepDecider::decision(uint64_t t, const Open& o, Status st, const Roster& roster,
                               Time now, int64_t settled) const {
  Decision d;
  d.step = t;
  d.epoch = roster.view().epoch;
  d.status = st;
  d.quorum = o.quorum > 0 ? quorum_of(o, roster) : roster.quorum();
  d.decide_us = us_between(o.first, now);
  d.bad_rank = o.bad_rank;
  d.bad_count = o.bad_count;
  d.bad_layout = o.bad_layout;
  d.settled = settled;
  d.offsets_us.assign(size_t(cfg_.world), -1);
  for (int r = 0; r < cfg_.world; ++r)
    if (o.arrived[size_t(r)]) d.offsets_us[size_t(r)] = us_between(o.first, *o.arrived[size_t(r)]);
  for (int r : roster.view().members)
    if (o.arrived[size_t(r)]) d.contributors.push_back(r);
  return d;
}

double StepDecider::kappa() const {
  if (!cfg_.auto_estimate) return cfg_.auto_kappa;
  return noise_.value().value_or(cfg_.auto_kappa);
}

void StepDecider::take_result_norm(const Event& e) {
  // The result of step - 1 (every rank has the same): with its contributors' norms, kept at
  // its decision, one step of the estimate.
  if (!e.prev_mean_sq || e.step == 0) return;
  auto it = step_norms_.find(e.step - 1);
  if (it == step_norms_.end()) return;
  noise_.add(it->second.first, it->second.second, *e.prev_mean_sq);
  step_norms_.erase(it);
}

void StepDecider::take_grad_norm(int from, const Event& e) {
  auto o = open_.find(e.step);
  if (o == open_.end() || !e.grad_sq) return;
  if (o->second.grad_sq.empty()) o->second.grad_sq.assign(size_t(cfg_.world), -1.0);
  o->second.grad_sq[size_t(from)] = *e.grad_sq;
}

void StepDecider::keep_norms(uint64_t t, const Open& o, const std::vector<int>& contributors) {
  double sum = 0;
  for (int r : contributors) {
    if (o.grad_sq.empty() || o.grad_sq[size_t(r)] < 0) return;  // a contributor sent none
    sum += o.grad_sq[size_t(r)];
  }
  if (contributors.size() < 2) return;
  step_norms_[t] = {int(contributors.size()), sum / double(contributors.size())};
  while (step_norms_.size() > 8) step_norms_.erase(step_norms_.begin());
}

}  // namespace qring::collectives::qproto
