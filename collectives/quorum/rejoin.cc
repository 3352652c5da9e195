#include "collectives/quorum/rejoin.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "collectives/quorum/steps.h"
#include "net/transport/tags.h"

namespace qring::collectives {

using UpKind = qproto::Up::Kind;

Rejoin::Rejoin(Engine& engine, const CommOptions& copts, const QuorumOptions& o,
               uint32_t instance, MembershipBox& membership, ControlStreams& streams, Outbox& out,
               std::shared_ptr<JoinAgentIo> agent)
    : engine_(engine),
      copts_(copts),
      o_(o),
      rank_(engine.rank()),
      world_(engine.size()),
      instance_(instance),
      membership_(membership),
      streams_(streams),
      out_(out),
      agent_(std::move(agent)),
      created_(engine.now()),
      inc_(size_t(engine.size()), 0),
      joining_(o.join),
      admitted_(!o.join) {}

void Rejoin::start(net::Endpoint& ep) {
  my_inc_ = ep.incarnation();
  inc_[size_t(rank_)] = my_inc_;
  if (joining_) {
    std::lock_guard<std::mutex> lock(agent_->mu);
    agent_->searching = true;
    agent_->watch_end = true;
  }
}

// Streams with `p` start over on its new incarnation.
void Rejoin::connect(net::Endpoint& ep, int p, const std::string& address, uint32_t inc) {
  engine_.reset_peer(p, address, inc);
  inc_[size_t(p)] = inc;
  streams_.reset(ep, p);
  out_.reset(p);
}

// What a joiner must share with every member: the communicator's settings and the caller's.
std::string Rejoin::settings(net::Endpoint& ep) const {
  return Communicator::settings_text(ep, copts_) + o_.agreed;
}

std::string Rejoin::own_value(net::Endpoint& ep) const {
  JoinValue v;
  v.incarnation = my_inc_;
  v.coordinator = membership_.coordinator();
  const auto views = membership_.view_changes();
  if (!views.empty()) {
    v.epoch = views.back().epoch;
    v.members = views.back().members;
  }
  v.settings = settings(ep);
  v.address = ep.published_address();
  return encode_join_value(v);
}

void Rejoin::joining(int r, uint32_t inc) {
  if (r == rank_ || inc <= inc_[size_t(r)]) return;
  MemberJoin j;
  j.incarnation = inc;
  j.key = join_key(instance_, r, inc, rank_);
  j.started = engine_.now();
  member_joins_[r] = j;
  spdlog::info("rank {}: quorum: rank {} comes back (incarnation {}); reconnecting", rank_, r,
               inc);
  std::lock_guard<std::mutex> lock(agent_->mu);
  agent_->fetch.push_back({r, inc, join_key(instance_, r, inc, r), engine_.now() + o_.deadline});
  agent_->cv.notify_all();
}

void Rejoin::left(int r) {
  // What reconnecting to it needs is made now, beside the view change, not later while the
  // others step (connect).
  if (o_.store) engine_.prepare_reset_peer(r);
}

bool Rejoin::poll(net::Endpoint& ep, const qproto::Coordinator* coordinator, int64_t completed,
                  std::vector<qproto::Up>& to_coordinator, int* coordinator_found) {
  *coordinator_found = -1;
  Found got;
  exchange(coordinator, got);
  bool moved = false;
  for (auto& [r, inc] : got.incarnations) {
    if (!coordinator) continue;
    qproto::Up m;
    m.kind = UpKind::kJoin;
    m.from = r;
    m.count = inc;
    to_coordinator.push_back(m);
    moved = true;
  }
  moved |= reconnect_to_joiners(ep, got);
  forget_abandoned();
  moved |= accept_published(got, to_coordinator);
  moved |= connect_to_members(ep, got, completed);
  report_stage();
  moved |= say_hello(ep, completed, coordinator_found);
  return moved;
}

// Tells the agent what the coordinator watches and takes what it found.
void Rejoin::exchange(const qproto::Coordinator* coordinator, Found& got) {
  bool over;
  std::string lost;
  {
    std::lock_guard<std::mutex> lock(agent_->mu);
    JoinAgentIo& a = *agent_;
    a.coordinating = coordinator != nullptr && !coordinator->stopped();
    if (a.coordinating) {
      a.incarnations.resize(size_t(world_));
      a.outside.assign(size_t(world_), 1);
      for (int r = 0; r < world_; ++r) a.incarnations[size_t(r)] = coordinator->incarnation(r);
      for (int r : coordinator->view().members) a.outside[size_t(r)] = 0;
    }
    got.published.swap(a.published);
    got.fetched.swap(a.fetched);
    got.incarnations.swap(a.found);
    got.values.swap(a.values);
    over = a.finished;
    lost = a.lost;
  }
  if (joining_ && !admitted_ && !lost.empty()) refuse_join_to_ended_job({false, lost}, rank_);
  if (!over) return;
  membership_.job_over();
  if (joining_ && !admitted_) refuse_join_to_ended_job({true, ""}, rank_);
  if (watching_end_)
    throw JobOver(fmt::format("rank {}: the job finished without this rank (the store records "
                              "its end; this rank had not heard its coordinator for over "
                              "quorum.evict_ms)",
                              rank_));
}

void Rejoin::watch_for_end(bool on) {
  if (joining_ && !state_arrived_) return;  // a joiner watches until its state came (start)
  if (on == watching_end_) return;
  watching_end_ = on;
  std::lock_guard<std::mutex> lock(agent_->mu);
  agent_->watch_end = on;
}

// A member: the joiners' addresses it fetched; it reconnects and publishes its own.
bool Rejoin::reconnect_to_joiners(net::Endpoint& ep, const Found& got) {
  bool moved = false;
  for (auto& [r, inc, value] : got.fetched) {
    auto it = member_joins_.find(r);
    if (it == member_joins_.end() || it->second.incarnation != inc || it->second.connected)
      continue;
    try {
      const JoinValue v = decode_join_value(value, world_, join_key(instance_, r, inc, r));
      if (v.incarnation != inc)
        throw ProtocolError(fmt::format("rank {}'s record names incarnation {}, not {}", r,
                                        v.incarnation, inc));
      // A joiner of another build or settings is not accepted (it finds out itself from
      // this rank's record, which it still gets).
      const std::string why = Communicator::settings_difference(settings(ep), rank_, v.settings, r);
      if (!why.empty()) {
        spdlog::error("rank {}: quorum: rank {} (incarnation {}) cannot rejoin: {}", rank_, r,
                      inc, why);
        it->second.refused = true;
      }
      connect(ep, r, v.address, inc);
    } catch (const std::exception& e) {
      spdlog::warn("rank {}: quorum: cannot reconnect to rank {} (incarnation {}): {}", rank_,
                   r, inc, e.what());
      member_joins_.erase(it);
      continue;
    }
    it->second.connected = true;
    std::lock_guard<std::mutex> lock(agent_->mu);
    agent_->publish.emplace_back(it->second.key, own_value(ep));
    agent_->cv.notify_all();
    moved = true;
  }
  return moved;
}

// A join the coordinator gave up on (the joiner never published, or left) is forgotten here
// too, after twice the time the coordinator waits for it.
void Rejoin::forget_abandoned() {
  const auto now = engine_.now();
  for (auto it = member_joins_.begin(); it != member_joins_.end();) {
    if (now - it->second.started > 2 * o_.deadline)
      it = member_joins_.erase(it);
    else
      ++it;
  }
}

// A member: its record for a joiner is published; it ACCEPTs the joiner (unless refused).
bool Rejoin::accept_published(const Found& got, std::vector<qproto::Up>& to_coordinator) {
  bool moved = false;
  for (auto& key : got.published) {
    for (auto it = member_joins_.begin(); it != member_joins_.end(); ++it) {
      if (it->second.key != key) continue;
      if (!it->second.refused) {
        qproto::Up m;
        m.kind = UpKind::kAccept;
        m.suspect = it->first;
        m.count = it->second.incarnation;
        to_coordinator.push_back(m);
      }
      member_joins_.erase(it);
      moved = true;
      break;
    }
  }
  return moved;
}

// The joiner: member p's address for this incarnation.
bool Rejoin::connect_to_members(net::Endpoint& ep, const Found& got, int64_t completed) {
  bool moved = false;
  for (auto& [p, value] : got.values) {
    JoinValue v;
    std::string why;
    try {
      v = decode_join_value(value, world_, join_key(instance_, rank_, my_inc_, p));
      why = Communicator::settings_difference(settings(ep), rank_, v.settings, p);
      if (why.empty()) {
        connect(ep, p, v.address, v.incarnation);
        // Providers that connect on first use (ofi_rxm over tcp: a handshake that needs both
        // sides' progress) do it now, while the members step without this rank, and not in
        // the first ring step that counts it.
        qproto::Up warm;
        warm.kind = UpKind::kWarm;
        warm.from = rank_;
        warm.completed = completed;
        streams_.send_up(ep, p, warm);
      }
    } catch (const std::exception& e) {
      throw ConfigError(
          fmt::format("rank {}: rejoin: cannot connect to rank {}: {}", rank_, p, e.what()));
    }
    if (!why.empty())
      throw ConfigError(fmt::format("rank {}: cannot rejoin the job: settings differ: {}; "
                                    "every rank must run the same build, configuration and "
                                    "settings",
                                    rank_, why));
    joiner_connected_.insert(p);
    if (v.epoch >= joiner_epoch_ && v.coordinator >= 0) {
      joiner_epoch_ = v.epoch;
      joiner_coord_ = v.coordinator;
      joiner_members_ = v.members;
    }
    moved = true;
  }
  return moved;
}

// The joiner: what it waits for (join()'s error when it times out).
void Rejoin::report_stage() {
  if (!joining_ || admitted_ || hello_sent_ || joiner_coord_ < 0) return;
  std::vector<int> missing;
  for (int m : joiner_members_)
    if (m != rank_ && !joiner_connected_.count(m)) missing.push_back(m);
  if (missing.empty() && joiner_connected_.count(joiner_coord_)) {
    membership_.set_join_stage(fmt::format(
        "connected to the members {}; waiting for the coordinator (rank {}) to admit it",
        joiner_members_, joiner_coord_));
  } else {
    membership_.set_join_stage(fmt::format(
        "waiting for members {} of {} to reconnect to this incarnation", missing,
        joiner_members_));
  }
}

// The joiner, connected to the coordinator and every member: HELLO to the coordinator.
bool Rejoin::say_hello(net::Endpoint& ep, int64_t completed, int* coordinator_found) {
  if (!joining_ || admitted_ || hello_sent_ || joiner_coord_ < 0 ||
      !joiner_connected_.count(joiner_coord_) ||
      !std::all_of(joiner_members_.begin(), joiner_members_.end(),
                   [&](int m) { return m == rank_ || joiner_connected_.count(m) != 0; }))
    return false;
  hello_sent_ = true;
  *coordinator_found = joiner_coord_;
  qproto::Up m;
  m.kind = UpKind::kHello;
  m.from = rank_;
  m.completed = completed;
  m.count = my_inc_;
  streams_.send_up(ep, joiner_coord_, m);
  return true;
}

void Rejoin::admit(const qproto::Joined& j, const qproto::View& view, int coordinator) {
  admitted_ = true;
  {
    // Until now it looked for the members' addresses: a member admitted while it waited (the
    // view it read grew) reconnects to it too, and it must find that member's address.
    std::lock_guard<std::mutex> lock(agent_->mu);
    agent_->searching = false;
  }
  join_step_ = j.step;
  donor_ = j.donor;
  JoinInfo info;
  info.step = j.step;
  info.donor = j.donor;
  info.epoch = view.epoch;
  info.members = view.members;
  info.join_ms = ms_between(created_, engine_.now());
  membership_.admitted(info, view.members, coordinator);
}

bool Rejoin::poll_state(net::Endpoint& ep, const qproto::View& view) {
  bool moved = false;
  for (auto& st : membership_.take_state_out()) {
    if (o_.on_phase) o_.on_phase(st.step, "donate");  // fault tests: the joiner waits for it
    out_.send(ep, st.to,
              net::make_tag(net::Op::kQuorumState, st.step, quorum_chunk(rank_, instance_)),
              st.buf, st.buf->data(), st.buf->size());
    moved = true;
  }
  const size_t want = !state_req_ ? membership_.state_wanted() : 0;
  if (want > 0 && admitted_ && joining_) {
    state_buf_ = std::make_shared<Bytes>(want);
    state_req_ = ep.irecv(
        donor_, net::make_tag(net::Op::kQuorumState, join_step_, quorum_chunk(donor_, instance_)),
        state_buf_->data(), want);
    moved = true;
  }
  if (state_req_ && (state_req_->done() || !view.has(donor_))) {
    // A state that will not come ends the service (member.h, leave): the caller's
    // receive_state() hears that, not a transfer error of its own.
    if (!state_req_->done()) {
      ep.cancel(state_req_);
      state_lost_ = fmt::format("the donor, rank {}, left the view before its state came", donor_);
    } else if (!state_req_->ok()) {
      state_lost_ = fmt::format("the state from rank {} failed: {}", donor_, state_req_->error);
    } else {
      state_arrived_ = true;
      membership_.state_arrived(state_buf_, state_req_->bytes);
    }
    {
      std::lock_guard<std::mutex> lock(agent_->mu);
      agent_->watch_end = false;
    }
    state_req_.reset();
    moved = true;
  }
  return moved;
}

void Rejoin::cancel(net::Endpoint& ep) {
  if (state_req_ && !state_req_->done()) ep.cancel(state_req_);
}

}  // namespace qring::collectives
