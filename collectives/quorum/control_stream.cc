#include "collectives/quorum/control_stream.h"

#include <spdlog/spdlog.h>

#include "collectives/quorum/steps.h"
#include "collectives/quorum/wire.h"
#include "net/transport/tags.h"

namespace qring::collectives {

namespace {
// Messages taken from one stream per poll: a rank back from a pause finds a DECIDE for every
// step it missed; applied all in one pass they would hold back its heartbeat (member.h) and
// everything else the pass does. The rest wait for the next pass, which follows at once.
constexpr int kPerPoll = 16;
}  // namespace

ControlStreams::ControlStreams(int rank, int world, uint32_t instance, Outbox& out)
    : rank_(rank),
      world_(world),
      instance_(instance),
      out_(out),
      up_in_(size_t(world)),
      down_in_(size_t(world)),
      up_next_(size_t(world), 0),
      down_next_(size_t(world), 0) {}

void ControlStreams::start(net::Endpoint& ep) {
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    post_up(ep, p);
    post_down(ep, p);
  }
}

void ControlStreams::reset(net::Endpoint& ep, int p) {
  for (In* in : {&up_in_[size_t(p)], &down_in_[size_t(p)]}) {
    if (in->req && !in->req->done()) ep.cancel(in->req);
    in->req.reset();
    in->next = 0;
  }
  post_up(ep, p);
  post_down(ep, p);
  up_next_[size_t(p)] = 0;
  down_next_[size_t(p)] = 0;
}

// Up: (kQuorumReady, n, sender). Down: (kQuorumDecide, n, coordinator).
void ControlStreams::post_up(net::Endpoint& ep, int p) {
  In& in = up_in_[size_t(p)];
  in.msg.resize(qwire::up_capacity(world_));
  in.req = ep.irecv(p, net::make_tag(net::Op::kQuorumReady, in.next, quorum_chunk(p, instance_)),
                    in.msg.data(), in.msg.size());
}

void ControlStreams::post_down(net::Endpoint& ep, int p) {
  In& in = down_in_[size_t(p)];
  in.msg.resize(qwire::down_capacity(world_));
  in.req = ep.irecv(p, net::make_tag(net::Op::kQuorumDecide, in.next, quorum_chunk(p, instance_)),
                    in.msg.data(), in.msg.size());
}

void ControlStreams::send_up(net::Endpoint& ep, int to, const qproto::Up& m) {
  auto buf = std::make_shared<std::vector<char>>(qwire::encode_up(world_, m));
  out_.send(ep, to,
            net::make_tag(net::Op::kQuorumReady, up_next_[size_t(to)]++,
                          quorum_chunk(rank_, instance_)),
            buf, buf->data(), buf->size());
}

void ControlStreams::send_down(net::Endpoint& ep, const std::vector<int>& to,
                               const qproto::Down& m) {
  auto buf = std::make_shared<std::vector<char>>(qwire::encode_down(world_, m));
  for (int r : to) {
    if (r == rank_) continue;
    out_.send(ep, r,
              net::make_tag(net::Op::kQuorumDecide, down_next_[size_t(r)]++,
                            quorum_chunk(rank_, instance_)),
              buf, buf->data(), buf->size());
  }
}

bool ControlStreams::arrived(In& in, int from) {
  if (!in.req || !in.req->done()) return false;
  if (in.req->ok()) return true;
  if (in.req->state != net::RequestState::kCancelled)
    spdlog::warn("rank {}: quorum: receive from rank {} failed: {}", rank_, from, in.req->error);
  in.req.reset();
  return false;
}

bool ControlStreams::poll_up(net::Endpoint& ep, const std::function<void(qproto::Up&&)>& take) {
  bool moved = false;
  for (int from = 0; from < world_; ++from) {
    if (from == rank_) continue;
    In& in = up_in_[size_t(from)];
    // The next message of this peer may be waiting already.
    for (int n = 0; n < kPerPoll && arrived(in, from); ++n) {
      moved = true;
      qproto::Up m = qwire::decode_up(in.msg.data(), in.req->bytes, world_, from);
      ++in.next;
      post_up(ep, from);
      if (m.kind == qproto::Up::Kind::kBye) ep.expect_departure(from);
      take(std::move(m));
    }
  }
  return moved;
}

bool ControlStreams::poll_down(net::Endpoint& ep,
                               const std::function<void(int, qproto::Down&&)>& take) {
  bool moved = false;
  for (int from = 0; from < world_; ++from) {
    if (from == rank_) continue;
    In& in = down_in_[size_t(from)];
    for (int n = 0; n < kPerPoll && arrived(in, from); ++n) {
      moved = true;
      qproto::Down m = qwire::decode_down(in.msg.data(), in.req->bytes, world_, from);
      ++in.next;
      post_down(ep, from);
      if (m.kind == qproto::Down::Kind::kBye) ep.expect_departure(from);
      take(from, std::move(m));
    }
  }
  return moved;
}

void ControlStreams::cancel(net::Endpoint& ep) {
  for (auto* v : {&up_in_, &down_in_})
    for (auto& in : *v)
      if (in.req && !in.req->done()) ep.cancel(in.req);
}

}  // namespace qring::collectives
