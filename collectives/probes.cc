#include "collectives/probes.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "collectives/engine_op.h"
#include "collectives/shape.h"
#include "net/transport/tags.h"

namespace qring::collectives {

namespace {
constexpr uint32_t kCtlMagic = 0x4C544351;  // "QCTL"
constexpr uint16_t kCtlVersion = 2;
constexpr uint8_t kProbe = 1, kAnswer = 2, kMismatch = 3;
}  // namespace

Prober::Prober(int rank, int size, std::chrono::milliseconds window)
    : rank_(rank), size_(size), window_(window) {}

void Prober::start(net::Endpoint& ep) {
  if (posted_ || size_ < 2) return;
  in_.resize(size_t(size_));
  out_next_.assign(size_t(size_), 0);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) post(ep, p);
  posted_ = true;
}

void Prober::reset_peer(net::Endpoint& ep, int peer) {
  if (!posted_) return;  // posted with the right generation when the engine starts
  in_[size_t(peer)].next = 0;
  post(ep, peer);
  out_next_[size_t(peer)] = 0;
}

void Prober::post(net::Endpoint& ep, int peer) {
  In& in = in_[size_t(peer)];
  in.req = ep.irecv(peer, net::make_tag(net::Op::kControl, in.next, size_t(peer)), &in.msg,
                    sizeof(in.msg));
}

void Prober::send(net::Endpoint& ep, int peer, const Ctl& msg) {
  auto m = std::make_unique<Ctl>(msg);
  m->magic = kCtlMagic;
  m->version = kCtlVersion;
  m->from = uint32_t(rank_);
  auto req = ep.isend(
      peer, net::make_tag(net::Op::kControl, out_next_[size_t(peer)]++, size_t(rank_)), m.get(),
      sizeof(Ctl));
  out_.emplace_back(std::move(req), std::move(m));
}

bool Prober::poll(net::Endpoint& ep, int64_t last_started, uint64_t last_shape, bool broken) {
  bool moved = false;
  for (int p = 0; p < int(in_.size()); ++p) {
    In& in = in_[size_t(p)];
    if (!in.req || !in.req->done()) continue;
    if (in.req->ok() && in.req->bytes == sizeof(Ctl) && in.msg.magic == kCtlMagic &&
        in.msg.version == kCtlVersion && int(in.msg.from) == p) {
      Ctl m = in.msg;
      if (m.type == kProbe) {
        Ctl a{};
        a.type = kAnswer;
        a.last_started = last_started;
        a.probe_id = m.probe_id;
        a.shape = last_shape;
        send(ep, int(m.from), a);
      } else if (m.type == kAnswer && diag_ && m.probe_id == probe_id_) {
        diag_->answers[m.from] = m.last_started;
        diag_->shapes[m.from] = m.shape;
      } else if (m.type == kMismatch && int(m.peer) >= 0 && int(m.peer) < size_ &&
                 m.probe_id >= 0 && m.probe_id < size_ && !broken) {
        // Another rank's collective saw a rank call it differently: this communicator fails
        // too, and passes the notice on (Engine::step), since the connection between the two
        // ranks that disagreed may be gone (tcp drops it after a truncated message).
        ++in.next;
        post(ep, p);
        const int origin = int(m.probe_id);
        throw MismatchNotice(
            fmt::format("rank {}: {} #{} failed on rank {}: ranks disagree on the operation: {}",
                        rank_, shape_kind(m.shape), m.last_started, origin,
                        mismatch_text(origin, int(m.peer), m.shape, m.other)),
            origin, uint64_t(m.last_started), int(m.peer), m.shape, m.other);
      }
    } else if (in.req->state != net::RequestState::kCancelled) {
      spdlog::warn("rank {}: ignored a malformed control message from rank {}", rank_, p);
    }
    ++in.next;
    post(ep, p);
    --p;  // the next message from this peer may be waiting already
    moved = true;
  }
  while (!out_.empty() && out_.front().first->done()) out_.pop_front();
  return moved;
}

void Prober::probe(net::Endpoint& ep, const EngineOp& op, const std::string& reason,
                   int64_t last_started, Clock::time_point now) {
  diag_ = std::make_unique<Diagnosis>();
  diag_->op = &op;
  diag_->seq = op.seq;
  diag_->op_name = op.name();
  diag_->reason = reason;
  diag_->until = now + window_;
  diag_->shape = op.shape();
  diag_->answers.assign(size_t(size_), -2);
  diag_->answers[size_t(rank_)] = last_started;
  diag_->shapes.assign(size_t(size_), 0);
  ++probe_id_;
  Ctl m{};
  m.type = kProbe;
  m.last_started = last_started;
  m.probe_id = probe_id_;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) send(ep, p, m);
}

const EngineOp* Prober::probed() const {
  return diag_ ? diag_->op : nullptr;
}

void Prober::forget() {
  diag_.reset();
}

std::optional<std::string> Prober::verdict(Clock::time_point now) {
  if (!diag_) return std::nullopt;
  bool all =
      std::none_of(diag_->answers.begin(), diag_->answers.end(), [](int64_t a) { return a == -2; });
  if (!all && now < diag_->until) return std::nullopt;
  std::vector<int> silent, behind, other;
  for (int p = 0; p < size_; ++p) {
    int64_t a = diag_->answers[size_t(p)];
    const uint64_t sh = diag_->shapes[size_t(p)];
    if (a == -2)
      silent.push_back(p);
    else if (a < int64_t(diag_->seq))
      behind.push_back(p);
    else if (a == int64_t(diag_->seq) && p != rank_ && sh && diag_->shape && sh != diag_->shape)
      other.push_back(p);
  }
  std::string reason = diag_->reason;
  if (!silent.empty())
    reason += fmt::format(
        "; no answer to a liveness probe from rank(s) {} (dead, hung, or "
        "communicator closed)",
        fmt::join(silent, ", "));
  if (!behind.empty())
    reason += fmt::format("; rank(s) {} alive but never started {} #{}", fmt::join(behind, ", "),
                          diag_->op_name, diag_->seq);
  for (int p : other)
    reason += fmt::format("; rank {} called #{} as {}, this rank as {}", p, diag_->seq,
                          describe_shape(diag_->shapes[size_t(p)]), describe_shape(diag_->shape));
  if (silent.empty() && behind.empty() && other.empty())
    reason += "; every rank is alive and in this operation (a lost message or a slow link)";
  diag_.reset();
  return reason;
}

void Prober::tell_mismatch(net::Endpoint& ep, TimeSource& clock, int origin, uint64_t seq,
                           int peer, uint64_t mine, uint64_t theirs) {
  if (size_ < 2 || !posted_) return;
  Ctl m{};
  m.type = kMismatch;
  m.peer = uint32_t(peer);
  m.probe_id = origin;
  m.last_started = int64_t(seq);
  m.shape = mine;
  m.other = theirs;
  std::vector<net::RequestPtr> sent(static_cast<size_t>(size_));
  auto send_to = [&](int p) {
    try {
      send(ep, p, m);
      sent[size_t(p)] = out_.back().first;
    } catch (const std::exception& e) {
      spdlog::debug("rank {}: could not tell rank {} of the mismatch: {}", rank_, p, e.what());
    }
  };
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && p != origin) send_to(p);
  // The caller may close this communicator as soon as it hears of the failure: the notices go
  // out first (bounded: a peer that does not take them fails by its own deadline). A notice
  // that failed is sent again: over tcp a message longer than its receive makes the provider
  // drop the connection it came on (the peer it concerns), and the next send connects anew.
  const auto until = clock.now() + std::chrono::seconds(1);
  net::Backoff backoff;
  // Bounded in passes too: on virtual time (a clock that drives the engines) no time passes here.
  for (int pass = 0; clock.now() < until && pass < 100000; ++pass) {
    bool all = true;
    for (int p = 0; p < size_; ++p) {
      const auto& r = sent[size_t(p)];
      if (!r) continue;
      if (r->state == net::RequestState::kError) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        send_to(p);
        all = false;
      } else if (!r->done()) {
        all = false;
      }
    }
    if (all) break;
    try {
      if (ep.progress() > 0) {
        backoff.reset();
        continue;
      }
    } catch (const std::exception& e) {
      spdlog::debug("rank {}: while telling the others of the mismatch: {}", rank_, e.what());
      break;
    }
    backoff.idle();
  }
}

}  // namespace qring::collectives
