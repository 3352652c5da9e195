#include "collectives/quorum/coordinator.h"

#include <algorithm>

#include "collectives/quorum/failover.h"

namespace qring::collectives::qproto {

bool View::has(int r) const {
  return std::binary_search(members.begin(), members.end(), r);
}

const char* to_string(Why w) {
  switch (w) {
    case Why::kSilent: return "silent";
    case Why::kMissedSteps: return "missed steps";
    case Why::kUnreachable: return "unreachable";
    case Why::kRestarted: return "restarted";
    case Why::kLeft: return "left";
    case Why::kDied: return "died, witnessed";
    case Why::kBehind: return "behind";
  }
  return "?";
}

Coordinator::Coordinator(Config cfg, Time now)
    : cfg_(std::move(cfg)), roster_(cfg_, now), steps_(cfg_) {}

Coordinator::Coordinator(Config cfg, Time now, View view, const std::vector<int64_t>& completed,
                         const std::vector<Known>& known, std::vector<Down>& out,
                         const std::vector<uint32_t>& incarnations,
                         const std::vector<char>& dead)
    : Coordinator(std::move(cfg), now) {
  roster_.restore(std::move(view), completed, incarnations);
  out.push_back(takeover_view(roster_.view(), cfg_, dead));
  // A majority took over (failover.h), but the ranks left may be fewer than the job needs.
  if (auto why = roster_.stop_reason(out.back().left, roster_.view().size())) {
    fatal(*why, out);
    return;
  }
  // Every step below the highest known one was decided by the old coordinator.
  steps_.start_at(recovery_.rebuild(known, roster_, out, now));
}

void Coordinator::fatal(std::string reason, std::vector<Down>& out) {
  Down f(Down::Kind::kFatal);
  f.reason = std::move(reason);
  out.push_back(std::move(f));
  stopped_ = true;
}

std::vector<Down> Coordinator::handle(const Event& e, Time now, bool more) {
  std::vector<Down> out;
  if (stopped_) return out;
  if (e.kind == Event::Kind::kJoin || e.kind == Event::Kind::kHello ||
      e.kind == Event::Kind::kDied) {
    // About a rank that is not a member (yet): found in the store, or connected; or a death
    // the store witnessed.
    const int r = e.from;
    if (r < 0 || r >= cfg_.world || r == cfg_.self) return out;
    if (e.kind == Event::Kind::kJoin)
      on_join(r, uint32_t(e.count), now, out);
    else if (e.kind == Event::Kind::kDied)
      roster_.died(r, uint32_t(e.count));
    else
      roster_.hello(r, e.count);
    if (!stopped_) tick(now, out);
    return out;
  }
  if (e.kind != Event::Kind::kTick) {
    const int r = e.from;
    if (r < 0 || r >= cfg_.world) return out;
    if (!roster_.view().has(r)) {
      // An evicted rank that is alive: it learns at its first contact.
      Down a(Down::Kind::kEvicted);
      a.to = r;
      a.why = roster_.left_why(r);
      out.push_back(std::move(a));
      return out;
    }
    roster_.heard(e, now);
    take(e, now, out);
    if (stopped_) return out;
  }
  if (!more) tick(now, out);
  return out;
}

// A message of member e.from.
void Coordinator::take(const Event& e, Time now, std::vector<Down>& out) {
  const int r = e.from;
  switch (e.kind) {
    case Event::Kind::kReady:
      if (e.digest) {
        if (auto drift = steps_.check_digest(r, e.step, *e.digest)) return fatal(*drift, out);
      }
      roster_.contributes(r);  // a rank that rejoined computes again
      if (!steps_.arrive(r, e, roster_, now) && roster_.view().has(r))
        recovery_.late(e.step, r);  // decided without it: its contribution is intact
      break;
    case Event::Kind::kReport:
      recovery_.report(r, e);
      break;
    case Event::Kind::kAccept:
      roster_.accepted(e.suspect, e.count, r);
      break;
    case Event::Kind::kSuspect:
      if (e.suspect >= 0 && e.suspect < cfg_.world) roster_.suspect(e.suspect);
      break;
    case Event::Kind::kBye:
      roster_.finished(r);
      break;
    case Event::Kind::kLeave:
      roster_.leave(r, now);
      break;
    default:
      break;
  }
}

void Coordinator::tick(Time now, std::vector<Down>& out) {
  auto left = roster_.departures(now);
  if (left.empty()) left = laggards(now);
  if (!left.empty()) {
    change_view(std::move(left), now, out);
    if (stopped_) return;
  }
  if (auto v = roster_.admit(now, steps_.next_step())) {
    out.push_back(std::move(*v));
    // A join still under way now needs the members just admitted too (its ACCEPT from each).
    for (auto& j : roster_.joins_again()) out.push_back(std::move(j));
    steps_.recount(roster_, now);
  }
  std::vector<uint64_t> redecided;
  recovery_.resolve(roster_, cfg_.world, out, redecided);
  for (uint64_t t : redecided) steps_.forget_norms(t);
  decide(now, out);
  recovery_.settle(roster_);
}

// A member too far behind to catch up by the results it missed leaves ("behind"; under a
// launcher that keeps the store it rejoins at once with a live member's state), so that no
// member keeps a result per step for it for the rest of the job. Judged only while it runs
// (heard within a quarter of evict): a pause shorter than evict never makes a rank leave, and
// one that resumes is behind only if it still lags by max_lag. Only as many as the job can
// lose (its floor, a majority of the view), in a tick where nobody else leaves: a job that
// cannot lose a rank keeps its laggards.
std::vector<Departure> Coordinator::laggards(Time now) const {
  std::vector<Departure> left;
  if (cfg_.max_lag.count() <= 0) return left;
  const int prev = roster_.view().size();
  const double running_ms = double(cfg_.evict.count()) / 4;
  for (int r : recovery_.behind(roster_, now, cfg_.max_lag)) {
    if (roster_.counted_silent_ms(r, now) > running_ms) continue;  // paused: not judged now
    const int size = prev - int(left.size()) - 1;
    if (size < floor_for(cfg_, size) || 2 * size <= prev) break;
    left.push_back({r, Why::kBehind, roster_.silent_ms(r, now)});
  }
  return left;
}

void Coordinator::on_join(int r, uint32_t inc, Time now, std::vector<Down>& out) {
  if (!roster_.new_incarnation(r, inc)) return;
  if (roster_.view().has(r)) {
    // The old incarnation is gone (a restarted process), or will learn it was replaced.
    change_view({{r, Why::kRestarted, roster_.silent_ms(r, now)}}, now, out);
    if (stopped_) return;
  }
  out.push_back(roster_.start_join(r, inc, now));
}

void Coordinator::change_view(std::vector<Departure> left, Time now, std::vector<Down>& out) {
  const int prev_size = roster_.remove(left);
  Down v(Down::Kind::kView);
  v.view = roster_.view();
  v.left = left;
  out.push_back(v);
  if (auto why = roster_.stop_reason(left, prev_size)) return fatal(*why, out);
  steps_.recount(roster_, now);
  recovery_.lost(left, out);
}

void Coordinator::decide(Time now, std::vector<Down>& out) {
  if (!holds_lease(roster_, now, cfg_)) return;
  const size_t first = out.size();
  steps_.decide(roster_, now, recovery_.settled(), out);
  for (size_t i = first; i < out.size(); ++i) {
    const Decision& d = out[i].decide;
    if (d.status == Status::kOk) {
      roster_.count_misses(d.contributors, now);
      recovery_.decided(d.step, d.contributors, now);
    } else {
      stopped_ = true;  // every rank fails the step: the job ends
    }
  }
}

}  // namespace qring::collectives::qproto
