#include "collectives/quorum/member.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>

namespace qring::collectives {

using UpKind = qproto::Up::Kind;
using DownKind = qproto::Down::Kind;

namespace {

qproto::Config config_of(const QuorumOptions& o, int world, size_t count) {
  qproto::Config c;
  c.world = world;
  c.self = 0;
  c.quorum = o.fraction > 0 ? 0 : o.quorum;
  c.fraction = o.fraction;
  c.grace = o.grace;
  c.deadline = o.deadline;
  c.evict = o.evict;
  c.evict_steps = o.evict_steps;
  c.max_lag = o.max_lag.count() < 0    ? qproto::Ms(0)
              : o.max_lag.count() == 0 ? 3 * o.evict
                                       : o.max_lag;
  c.min_world = o.min_world;
  c.count = count;
  c.adaptive = o.adaptive;
  c.auto_max = o.auto_max;
  c.auto_kappa = o.auto_kappa;
  c.auto_estimate = o.auto_estimate;
  c.layout = qproto::layout_of(uint8_t(o.type), o.mean);
  return c;
}

}  // namespace

QuorumMember::QuorumMember(Engine& engine, const CommOptions& copts, size_t count,
                           const QuorumOptions& o, MemberBoxes boxes, uint32_t instance)
    : engine_(engine),
      copts_(copts),
      o_(o),
      boxes_(std::move(boxes)),
      rank_(engine.rank()),
      world_(engine.size()),
      instance_(instance & 0xFF),
      cfg_(config_of(o, engine.size(), count)),
      // A job that can lose a rank keeps every contribution intact until its step completes
      // (reductions out of place) and every result until every live rank has it (recovery).
      tolerant_(qproto::floor_for(cfg_, world_ - 1) <= world_ - 1),
      out_(engine.size()),
      streams_(rank_, world_, instance_, out_),
      runner_(engine, copts_, o_, count, instance_, tolerant_, *boxes_.steps, out_),
      rejoin_(engine, copts_, o_, instance_, *boxes_.membership, streams_, out_, boxes_.agent),
      liveness_(LivenessTimes::of(o.evict, o.deadline), engine.now()),
      // A joiner learns its coordinator when it is admitted.
      succession_(rank_, world_, o.join ? -1 : 0),
      witness_(world_),
      ledger_(count, cfg_.layout),
      follower_(engine, o.evict, o.join,
                {runner_, rejoin_, liveness_, ledger_, succession_, *boxes_.steps,
                 *boxes_.membership}),
      reported_suspect_(size_t(world_), false),
      known_inc_(size_t(world_), 0) {
  seq = 0;
  sequenced = false;
  deadline = Clock::time_point::max();
}

bool QuorumMember::passive() const {
  return runner_.idle() && out_.empty() && ledger_.awaiting().empty() &&
         (!host_ || !host_->state().waiting()) && !finished_ && rejoin_.idle();
}

void QuorumMember::start(net::Endpoint& ep) {
  ep_ = &ep;
  streams_.start(ep);
  rejoin_.start(ep);
  known_inc_ = rejoin_.incarnations();
  for (int p = 0; p < world_ && size_t(p) < known_inc_.size(); ++p)
    witness_.incarnation(p, known_inc_[size_t(p)]);
  if (rank_ == succession_.coordinator() && !o_.join)
    coordinate(std::make_unique<qproto::Coordinator>(cfg_, engine_.now()));
}

void QuorumMember::coordinate(std::unique_ptr<qproto::Coordinator> state) {
  auto reports = boxes_.reports;
  host_ = std::make_unique<CoordinatorHost>(
      std::move(state), [this](const qproto::Down& m) { act(*ep_, m); },
      [reports](uint64_t t, int r, double ms) { reports->log_arrival(t, r, ms); });
  succession_.follow(rank_);
  boxes_.membership->set_coordinator(rank_);
}

void QuorumMember::abort(net::Endpoint& ep) {
  runner_.cancel(ep);
  streams_.cancel(ep);
  rejoin_.cancel(ep);
  out_.retain(ep);
}

void QuorumMember::fail_callers(std::exception_ptr e) {
  boxes_.steps->fail(e);
  boxes_.membership->fail(e);
  boxes_.reports->fail(e);
}

bool QuorumMember::advance(net::Endpoint& ep) {
  if (finished_) return false;
  bool moved = false;
  bool fatal = false;
  try {
    moved = pass(ep);
  } catch (const Evicted&) {
    fatal = true;
    error_ = std::current_exception();
  } catch (const JobOver&) {
    fatal = true;
    error_ = std::current_exception();
    fail_callers(error_);
    told_ = true;
  } catch (const QuorumLost&) {
    fatal = true;
    error_ = std::current_exception();
  } catch (...) {
    error_ = std::current_exception();
  }
  dead_ = dead_ || error_ != nullptr;
  if (error_) {
    std::lock_guard<std::mutex> lock(boxes_.steps->mu);
    if (!boxes_.steps->service_error) boxes_.steps->service_error = error_;
  }
  // A coordinator serves the recovery of the last steps before its goodbye (coordinator_host.h).
  const bool stop = boxes_.shutdown->load(std::memory_order_acquire) &&
                    !(host_ && host_->serving(engine_.now(), !runner_.idle(), end_grace(o_)));
  if (stop && !dead_ && !bye_sent_) say_goodbye(ep);
  if ((stop || dead_) && !finished_) finish(ep);
  // Eviction and a job below its quorum end every operation of this communicator, so that
  // no collective among the old members waits for its deadline.
  if (fatal) std::rethrow_exception(error_);
  return moved;
}

bool QuorumMember::pass(net::Endpoint& ep) {
  bool moved = false;
  // Back from a pause, this rank speaks first: what piled up meanwhile (a DECIDE for every
  // step it missed) may take a while to apply, and the others count its silence from its
  // last message before the pause.
  if (resync(ep)) heartbeat(ep);
  moved |= take_contributions(ep);
  moved |= poll_rejoin(ep);
  moved |= rejoin_.poll_state(ep, view());
  if (!rejoin_.state_lost().empty()) leave(ep);
  moved |= streams_.poll_down(ep, [&](int from, qproto::Down&& m) { take_down(ep, from, std::move(m)); });
  moved |= streams_.poll_up(ep, [&](qproto::Up&& m) { take_up(std::move(m)); });
  watch_deaths();
  if (host_) moved |= feed_coordinator(ep);
  moved |= gather_takeover(ep);
  moved |= runner_.advance(ep, view());
  report_suspects(ep, runner_.take_suspects());
  std::vector<std::pair<int, std::string>> failed;
  moved |= out_.reap(ep, failed, [&](int peer) { return view().has(peer); });
  report_suspects(ep, failed);
  heartbeat(ep);
  // The process may have been stopped during this pass too (SIGSTOP lands anywhere).
  if (!resync(ep)) check_deadlines(ep);
  return moved;
}

// Finished: nobody may take this rank's silence from now on for a failure.
void QuorumMember::say_goodbye(net::Endpoint& ep) {
  bye_sent_ = true;
  // The peers finish too: a send that finds one gone is no news (logged at debug level).
  ep.expect_departure(net::kAnyPeer);
  try {
    if (host_)
      streams_.send_down(ep, host_->state().view().members, qproto::Down(DownKind::kBye));
    else
      send_up(ep, qproto::Up{UpKind::kBye});
  } catch (const std::exception& e) {
    spdlog::debug("rank {}: quorum: goodbye not sent: {}", rank_, e.what());
  }
}

// The end (the all-reduce is destroyed) or a failure: receives into the callers' buffers are
// withdrawn before the callers hear of an error (a cancellation that is not confirmed throws:
// the engine then closes the endpoint), and the sends drain for at most 2 s.
void QuorumMember::finish(net::Endpoint& ep) {
  runner_.cancel(ep);
  streams_.cancel(ep);
  rejoin_.cancel(ep);
  // A reduction given up with sends still reading a caller's buffer: the engine fails the
  // communicator and closes the endpoint before the callers are told.
  if (dead_ && engine_.holds_failed_buffers()) std::rethrow_exception(error_);
  if (error_ && !told_) {
    told_ = true;
    fail_callers(error_);
  }
  const auto now = engine_.now();
  if (drain_until_ == Clock::time_point{}) drain_until_ = now + std::chrono::seconds(2);
  // Sends to ranks that left may never complete: they are not waited for.
  if (out_.empty() || out_.only_to([&](int p) { return !view().has(p); }) || now > drain_until_) {
    if (engine_.holds_failed_buffers())
      throw IoError(fmt::format(
          "rank {}: quorum: ring sends from the callers' buffers did not complete by the end",
          rank_));
    out_.retain(ep);
    finished_ = true;
  }
}

// ---- messages

void QuorumMember::send_up(net::Endpoint& ep, qproto::Up m) {
  m.from = rank_;
  m.completed = runner_.completed();
  if (host_) {
    host_->take(std::move(m));  // the coordinator's own messages go straight to its host
    return;
  }
  if (succession_.gathering()) return;  // collecting acks: this rank is about to coordinate
  const int coord = succession_.coordinator();
  if (coord < 0) return;  // a joiner that has not reached the coordinator yet
  streams_.send_up(ep, coord, m);
}

// A message to a coordinator: to this rank's host when it coordinates, kept while it gathers
// the acks of a takeover, dropped otherwise (stale).
void QuorumMember::take_up(qproto::Up&& m) {
  if (m.kind == UpKind::kWarm) return;  // it has done its work: the connection is open
  if (m.kind == UpKind::kDeposed) {
    if (host_) succession_.deposed(m.from);
    return;
  }
  if (m.kind == UpKind::kShard) {
    // A part of a report: kept for gather_reports (when this rank coordinates, or is about
    // to), and a sign of life like a heartbeat.
    if (host_ || succession_.gathering())
      boxes_.reports->keep(m.step, m.attempt, uint32_t(m.count), std::move(m.values));
    m.values.clear();
  }
  if (succession_.gathering()) {
    succession_.take(std::move(m));
  } else if (host_) {
    host_->take(std::move(m));
  }
}

// The coordinators' messages, each stream in the order it was sent: the one this rank
// follows is applied, a takeover answered, a replaced one told (failover.h, Succession::heed).
void QuorumMember::take_down(net::Endpoint& ep, int from, qproto::Down&& m) {
  if (m.kind == DownKind::kTakeover) return answer_takeover(ep, from, m.view);
  if (succession_.gathering() && from == succession_.coordinator()) {
    // The coordinator this rank was taking over from speaks again: it lives (issue 42, case 1).
    spdlog::warn("rank {}: quorum: rank {} speaks again; giving up the takeover", rank_, from);
    succession_.abandon();
    for (uint64_t t : ledger_.awaiting()) send_up(ep, ledger_.ready(t));
  }
  const Heed h = succession_.heed(from, m.kind, m.view.epoch, host_ != nullptr);
  if (h == Heed::kDepose) {
    qproto::Up d{UpKind::kDeposed};
    d.from = rank_;
    d.completed = runner_.completed();
    streams_.send_up(ep, from, d);
  } else if (h != Heed::kIgnore) {
    liveness_.heard_coordinator(engine_.now());
    if (h != Heed::kApply) {  // back to the old coordinator, or on to the winner
      spdlog::warn("rank {}: quorum: following rank {} as the coordinator", rank_, from);
      boxes_.membership->set_coordinator(from);
      for (uint64_t t : ledger_.awaiting()) send_up(ep, ledger_.ready(t));
    }
    apply(ep, m);
  }
}

// What the coordinator's host sends: to the members of the view in force (for a VIEW, the
// new one), and applied here.
void QuorumMember::act(net::Endpoint& ep, const qproto::Down& m) {
  if (m.kind == DownKind::kEvicted) {
    streams_.send_down(ep, {m.to}, m);
    return;
  }
  streams_.send_down(ep, host_->state().view().members, m);
  liveness_.heard_coordinator(engine_.now());
  apply(ep, m);
}

// This process may have been stopped since the last look (SIGSTOP lands anywhere, also inside
// this pass): the others' silence across the pause is no evidence.
bool QuorumMember::feed_coordinator(net::Endpoint&) {
  const auto now = engine_.now();
  look(now);
  return host_->feed(now, !bye_sent_);
}

// What the coordinator sends (and, on its rank, what its host sends), applied to the rooms.
void QuorumMember::apply(net::Endpoint& ep, const qproto::Down& m) {
  if (auto reply = follower_.apply(ep, m)) send_up(ep, std::move(*reply));
}

// Contributions made by the caller: READY to the coordinator; and its reports.
bool QuorumMember::take_contributions(net::Endpoint& ep) {
  const std::vector<uint64_t> steps = ledger_.take(*boxes_.steps);
  for (uint64_t t : steps) {
    runner_.contributed(t, view().members);
    send_up(ep, ledger_.ready(t));
  }
  auto reports = boxes_.reports->take_outgoing();
  for (auto& p : reports) {
    if (host_) {
      boxes_.reports->keep(p.key, p.part, p.parts, std::move(p.values));
      continue;
    }
    qproto::Up m{UpKind::kShard};
    m.step = p.key;
    m.attempt = p.part;
    m.count = p.parts;
    m.values = std::move(p.values);
    send_up(ep, m);
  }
  return !steps.empty() || !reports.empty();
}

bool QuorumMember::poll_rejoin(net::Endpoint& ep) {
  std::vector<qproto::Up> up;
  int found = -1;
  const bool moved = rejoin_.poll(ep, host_ ? &host_->state() : nullptr, runner_.completed(), up,
                                  &found);
  if (found >= 0) {
    succession_.follow(found);  // the joiner said HELLO to it
    liveness_.heard_coordinator(engine_.now());
  }
  for (auto& m : up) {
    if (m.kind == UpKind::kJoin) {
      if (host_) host_->take(std::move(m));
    } else {
      send_up(ep, std::move(m));
    }
  }
  // A peer that came back as a new incarnation starts afresh.
  const auto& inc = rejoin_.incarnations();
  for (int p = 0; p < world_; ++p) {
    if (inc[size_t(p)] == known_inc_[size_t(p)]) continue;
    known_inc_[size_t(p)] = inc[size_t(p)];
    witness_.incarnation(p, inc[size_t(p)]);
    succession_.new_incarnation(p);
    reported_suspect_[size_t(p)] = false;
  }
  return moved;
}

// A joiner whose state will not come (its donor left the view first, or the transfer failed)
// says it leaves, so that the view drops it now, not evict later (a member that never
// contributes nor accepts would block every later admission), and ends as evicted: a caller
// that can (qring-train) comes back as a new incarnation, which a live member gives its state.
void QuorumMember::leave(net::Endpoint& ep) {
  send_up(ep, qproto::Up{UpKind::kLeave});
  throw Evicted(fmt::format("rank {}: rejoining: {}; this incarnation leaves the view (a new one "
                            "rejoins with the state of a live member)",
                            rank_, rejoin_.state_lost()));
}

// A transport error with `peer`: the coordinator evicts it if it also misses a heartbeat.
void QuorumMember::report_suspects(net::Endpoint& ep,
                                   const std::vector<std::pair<int, std::string>>& suspects) {
  if (dead_) return;
  for (auto& [peer, what] : suspects) {
    if (peer < 0 || peer >= world_ || peer == rank_ || reported_suspect_[size_t(peer)]) continue;
    reported_suspect_[size_t(peer)] = true;
    spdlog::warn("rank {}: quorum: rank {} is unreachable ({}); telling the coordinator", rank_,
                 peer, what);
    qproto::Up m{UpKind::kSuspect};
    m.suspect = peer;
    send_up(ep, m);
  }
}

// ---- failover (failover.h). The coordinator fell silent: this rank proposes itself for the
// next epoch to the other members of the last view and coordinates once a majority of that
// view (itself included) accepted.

void QuorumMember::start_takeover(net::Endpoint& ep) {
  spdlog::warn("rank {}: quorum: the coordinator (rank {}) {}; taking over", rank_,
               succession_.coordinator(), gone(witness_.deaths(), succession_.coordinator()));
  const qproto::Down m = succession_.propose(view(), engine_.now());
  streams_.send_down(ep, m.view.members, m);
}

void QuorumMember::answer_takeover(net::Endpoint& ep, int from, const qproto::View& v) {
  const int silent = succession_.coordinator();
  const bool lost = liveness_.coordinator_lost(engine_.now(), silent, witness_.deaths());
  if (!succession_.accept(from, v, view(), host_ != nullptr, lost)) return;
  spdlog::warn("rank {}: quorum: rank {} takes over from the silent coordinator (rank {})",
               rank_, from, silent);
  liveness_.heard_coordinator(engine_.now());
  boxes_.membership->set_coordinator(from);
  qproto::Up ack{UpKind::kAck};
  ack.epoch = v.epoch;
  ack.known = ledger_.known();
  send_up(ep, ack);
  // The new coordinator has not seen the contributions still waiting for a decision.
  for (uint64_t t : ledger_.awaiting()) send_up(ep, ledger_.ready(t));
}

bool QuorumMember::gather_takeover(net::Endpoint& ep) {
  if (!succession_.gathering()) return false;
  const auto now = engine_.now();
  switch (succession_.outcome(view().size(), now, liveness_.times(), witness_.deaths())) {
    case TakeoverOutcome::kGathering:
      return false;
    case TakeoverOutcome::kLost: {
      // Nobody accepted: the others still hear the coordinator, this rank is cut off from it.
      if (succession_.ackers().empty()) throw Evicted(succession_.cut_off_reason());
      // Those that acknowledged follow this rank: they stop with it, at once.
      qproto::Down f(DownKind::kFatal);
      f.reason = succession_.lost_reason(view().size(), witness_.deaths());
      streams_.send_down(ep, succession_.ackers(), f);
      throw QuorumLost(f.reason, {succession_.coordinator()});
    }
    case TakeoverOutcome::kWon:
      break;
  }
  auto won = succession_.won(runner_.completed(), ledger_.known());
  spdlog::warn("rank {}: quorum: coordinating from view {} (members {}) after rank {} {}", rank_,
               won.view.epoch, won.view.members, succession_.coordinator(),
               gone(witness_.deaths(), succession_.coordinator()));
  qproto::Config cfg = cfg_;
  cfg.self = rank_;
  std::vector<qproto::Down> out;
  auto state = std::make_unique<qproto::Coordinator>(cfg, now, won.view, won.completed,
                                                     won.known, out, rejoin_.incarnations(),
                                                     witness_.deaths());
  coordinate(std::move(state));
  for (auto& m : out) act(ep, m);
  for (auto& m : won.early) host_->take(std::move(m));
  for (uint64_t t : ledger_.awaiting()) send_up(ep, ledger_.ready(t));
  feed_coordinator(ep);
  return true;
}

// ---- liveness

// The deaths the store witnessed, looked for where a decision may need them (witness.h).
void QuorumMember::watch_deaths() {
  const auto now = engine_.now();
  if (now - last_watch_ < std::chrono::milliseconds(20)) return;
  last_watch_ = now;
  const double quiet_ms = double(o_.evict.count()) / 4;
  const int coord = succession_.coordinator();
  std::vector<int> ranks;
  if (!bye_sent_ && tolerant_ && host_)
    ranks = host_->state().quiet(now, quiet_ms);
  else if (!bye_sent_ && tolerant_ && coord >= 0 && liveness_.silent_ms(now) > quiet_ms)
    ranks = deaths_to_watch(view(), coord, rank_, succession_.gathering());
  for (auto [r, inc] : witness_.exchange(*boxes_.agent, ranks)) {
    spdlog::warn("rank {}: quorum: the rendezvous store witnessed the death of rank {} "
                 "(incarnation {})", rank_, r, inc);
    if (host_) host_->take(death_event(r, inc));
  }
}

// A pass long after the previous one: this process was stopped (SIGSTOP, a swap storm).
// Silence measured across the pause says nothing about the peers; every clock starts over.
bool QuorumMember::resync(net::Endpoint&) {
  const auto now = engine_.now();
  if (!look(now)) return false;
  if (host_) host_->feed(now);
  return true;
}

// Every pass: whether this process was stopped since the last one (then every silence starts
// over), and the time it waited for a CPU meanwhile, which is nobody's silence (liveness.h).
bool QuorumMember::look(Clock::time_point now) {
  const bool paused = liveness_.paused(now);
  const auto stall = liveness_.take_stall();
  if (host_) host_->observe(now, paused, stall);
  return paused;
}

// Every rank tells the coordinator it is alive (with the last step it completed), and the
// coordinator tells every member, so silence means a stopped or dead process, never a long
// computation: this runs on the engine.
void QuorumMember::heartbeat(net::Endpoint& ep) {
  if (bye_sent_ || (rejoin_.joining() && !rejoin_.admitted())) return;
  if (!liveness_.beat_due(engine_.now(), runner_.completed(), runner_.received_last())) return;
  send_up(ep, qproto::Up{UpKind::kHeartbeat});
  if (!host_) return;
  feed_coordinator(ep);
  streams_.send_down(ep, host_->state().view().members, qproto::Down(DownKind::kHeartbeat));
}

void QuorumMember::check_deadlines(net::Endpoint& ep) {
  const auto now = engine_.now();
  // A joiner has join()'s deadline; a rank that finished (draining its sends) accuses nobody.
  if ((rejoin_.joining() && !rejoin_.admitted()) || bye_sent_) return;
  if (!host_) {
    const int coord = succession_.coordinator();
    rejoin_.watch_for_end(liveness_.unheard_long(now));
    // A proposal that waited for this member to take the coordinator for lost.
    if (succession_.pending_from() >= 0 &&
        liveness_.coordinator_lost(now, coord, witness_.deaths()))
      answer_takeover(ep, succession_.pending_from(), succession_.pending());
    switch (liveness_.coordinator_silence(now, view(), coord, rank_, tolerant_, witness_.deaths(),
                                          follower_.admitted_by_coordinator())) {
      case Liveness::Silence::kNone:
        break;
      case Liveness::Silence::kTakeOver:
        // A joiner still waiting for its state lets the next member take over (and accepts
        // it): its donor is the silent coordinator, so it is about to leave.
        if (!succession_.gathering() && !rejoin_.awaiting_state()) start_takeover(ep);
        break;
      case Liveness::Silence::kLost:
        throw QuorumLost(liveness_.lost_reason(now, rank_, coord), {coord});
    }
    // The coordinator decides by (first contribution + H); ours came after the first.
    std::lock_guard<std::mutex> lock(boxes_.steps->mu);
    for (auto& [t, s] : boxes_.steps->steps) {
      if (s.contributed && !s.decided &&
          now > s.contrib_time + o_.deadline + std::chrono::seconds(2))
        throw QuorumTimeout(fmt::format("rank {}: quorum step {}: no decision from the "
                                        "coordinator (rank {}) within {} ms of contributing",
                                        rank_, t, coord, o_.deadline.count() + 2000),
                            {coord});
    }
  }
  runner_.check_deadlines(now);
}

}  // namespace qring::collectives
