#include "net/fault_endpoint.h"

#include <algorithm>

namespace qring::net {

FaultEndpoint::FaultEndpoint(std::unique_ptr<Endpoint> inner, std::vector<FaultRule> rules)
    : inner_(std::move(inner)), rules_(std::move(rules)), seen_(rules_.size(), 0) {}

const FaultRule* FaultEndpoint::match(int peer, uint64_t tag) {
  for (size_t i = 0; i < rules_.size(); ++i) {
    const FaultRule& r = rules_[i];
    if (r.src != kAnyPeer && r.src != rank()) continue;
    if (r.dst != kAnyPeer && r.dst != peer) continue;
    if (r.op && *r.op != tag_op(tag)) continue;
    if (seen_[i]++ < r.skip_first) continue;
    return &r;
  }
  return nullptr;
}

RequestPtr FaultEndpoint::isend(int peer, uint64_t tag, const void* buf, size_t len) {
  const FaultRule* rule = match(peer, tag);
  bool queued_behind =
      std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.peer == peer; });
  if (!rule && !queued_behind) return inner_->isend(peer, tag, buf, len);
  auto proxy = std::make_shared<Request>();
  proxy->is_send = true;
  proxy->peer = peer;
  proxy->tag = tag;
  proxy->len = len;
  proxy->bytes = len;
  if (rule && rule->drop) {
    ++dropped_;
    proxy->state = RequestState::kDone;  // the sender cannot tell: the message is lost
    return proxy;
  }
  // Later messages to the same peer queue behind a held one, keeping per-peer order.
  auto release = Clock::now();
  if (rule) {
    ++delayed_;
    release += rule->delay;
  }
  for (const Held& h : held_)
    if (h.peer == peer) release = std::max(release, h.release);
  held_.push_back({release, proxy, peer, tag, buf, len});
  return proxy;
}

size_t FaultEndpoint::progress() {
  size_t n = 0;
  auto now = Clock::now();
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->release <= now) {
      forwarded_.push_back({it->proxy, inner_->isend(it->peer, it->tag, it->buf, it->len)});
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  n += inner_->progress();
  for (auto it = forwarded_.begin(); it != forwarded_.end();) {
    if (it->inner->done()) {
      it->proxy->state = it->inner->state;
      it->proxy->error = it->inner->error;
      it = forwarded_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

}  // namespace qring::net
