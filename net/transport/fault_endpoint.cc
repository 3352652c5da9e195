#include "net/transport/fault_endpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "net/base/error.h"

namespace qring::net {

namespace {
void copy_outcome(const Request& from, Request& to) {
  to.bytes = from.bytes;
  to.matched_tag = from.matched_tag;
  to.data = from.data;
  to.truncated = from.truncated;
  to.error = from.error;
  to.state = from.state;
}
}  // namespace

FaultEndpoint::FaultEndpoint(std::unique_ptr<Endpoint> inner, std::vector<FaultRule> rules)
    : inner_(std::move(inner)),
      rules_(std::move(rules)),
      seen_(rules_.size(), 0),
      cut_(static_cast<size_t>(inner_->world_size())),
      refused_(static_cast<size_t>(inner_->world_size())) {}

void FaultEndpoint::cut(int peer) {
  if (peer < 0 || peer >= static_cast<int>(cut_.size()))
    throw UsageError(
        fmt::format("FaultEndpoint::cut: peer {} out of range [0, {})", peer, cut_.size()));
  if (!cut_[static_cast<size_t>(peer)].exchange(true, std::memory_order_acq_rel))
    cuts_.fetch_add(1, std::memory_order_release);
}

void FaultEndpoint::refuse(int peer) {
  cut(peer);  // checks the range
  refused_[static_cast<size_t>(peer)].store(true, std::memory_order_release);
}

std::vector<int> FaultEndpoint::suspect_peers() const {
  std::vector<int> s = inner_->suspect_peers(), out;
  std::set_union(s.begin(), s.end(), refused_sends_.begin(), refused_sends_.end(),
                 std::back_inserter(out));
  return out;
}

bool FaultEndpoint::is_cut(int peer) const {
  return peer >= 0 && peer < static_cast<int>(cut_.size()) &&
         cut_[static_cast<size_t>(peer)].load(std::memory_order_acquire);
}

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

RequestPtr FaultEndpoint::isend(int peer, uint64_t tag, const void* buf, size_t len,
                                uint64_t data) {
  if (closed()) return inner_->isend(peer, tag, buf, len, data);  // throws
  const bool cut = is_cut(peer);
  const FaultRule* rule = cut ? nullptr : match(peer, tag);
  bool queued_behind =
      std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.peer == peer; });
  if (!cut && !rule && !queued_behind) return inner_->isend(peer, tag, buf, len, data);
  auto proxy = std::make_shared<Request>();
  proxy->is_send = true;
  proxy->peer = peer;
  proxy->tag = tag;
  proxy->len = len;
  proxy->bytes = len;
  if (cut && refused_[static_cast<size_t>(peer)].load(std::memory_order_acquire)) {
    proxy->state = RequestState::kError;
    proxy->bytes = 0;
    proxy->error = fmt::format("to rank {}: Connection refused", peer);
    auto at = std::lower_bound(refused_sends_.begin(), refused_sends_.end(), peer);
    if (at == refused_sends_.end() || *at != peer) refused_sends_.insert(at, peer);
    return proxy;
  }
  if (cut || (rule && rule->drop)) {
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
  held_.push_back({release, proxy, peer, tag, buf, len, data});
  return proxy;
}

RequestPtr FaultEndpoint::irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore) {
  if (peer == kAnyPeer || closed()) return inner_->irecv(peer, tag, buf, len, ignore);
  auto proxy = std::make_shared<Request>();
  proxy->peer = peer;
  proxy->tag = tag;
  proxy->len = len;
  if (is_cut(peer)) {
    cut_recvs_.push_back({proxy, nullptr});
    return proxy;
  }
  RequestPtr in = inner_->irecv(peer, tag, buf, len, ignore);
  if (in->done())
    copy_outcome(*in, *proxy);
  else
    recvs_.push_back({proxy, std::move(in)});
  return proxy;
}

// Moves the receives from peers cut since the last call to cut_recvs_, withdrawing their
// inner receives: whatever those match from now on is ignored.
void FaultEndpoint::drop_cut_receives() {
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if (!is_cut(it->proxy->peer)) {
      ++it;
      continue;
    }
    if (!it->inner->done()) {
      inner_->cancel(it->inner);
      recvs_dirty_ = true;  // the inner cancel ran the inner progress
    }
    cut_recvs_.push_back({it->proxy, nullptr});
    it = recvs_.erase(it);
  }
}

size_t FaultEndpoint::progress() {
  if (closed()) return 0;
  size_t n = 0;
  auto now = Clock::now();
  // Each held message waits for its own release time only: held messages to one peer never
  // hold back those to another.
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->release <= now) {
      if (is_cut(it->peer)) {
        ++dropped_;
        it->proxy->state = RequestState::kDone;
        ++n;
      } else {
        forwarded_.push_back(
            {it->proxy, inner_->isend(it->peer, it->tag, it->buf, it->len, it->data)});
      }
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  const size_t inner_n = inner_->progress();
  n += inner_n;
  for (auto it = forwarded_.begin(); it != forwarded_.end();) {
    if (it->inner->done()) {
      copy_outcome(*it->inner, *it->proxy);
      it = forwarded_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  const uint64_t cuts = cuts_.load(std::memory_order_acquire);
  if (cuts != cuts_applied_) {
    cuts_applied_ = cuts;
    drop_cut_receives();
  }
  // Inner receives complete only in the inner progress (or an inner cancel).
  if (inner_n > 0 || recvs_dirty_) {
    recvs_dirty_ = false;
    for (auto it = recvs_.begin(); it != recvs_.end();) {
      if (it->inner->done()) {
        copy_outcome(*it->inner, *it->proxy);
        it = recvs_.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
  }
  return n;
}

bool FaultEndpoint::cancel(const RequestPtr& req) {
  if (req->done() || req->is_send) return false;
  for (auto it = cut_recvs_.begin(); it != cut_recvs_.end(); ++it) {
    if (it->proxy == req) {
      cut_recvs_.erase(it);
      req->state = RequestState::kCancelled;
      return true;
    }
  }
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if (it->proxy == req) {
      if (fail_cancels_.load(std::memory_order_acquire))
        throw TimeoutError(fmt::format("rank {}: cancel of a receive from rank {} (tag {:#x}) "
                                       "was not confirmed (fault injection)",
                                       rank(), req->peer, req->tag));
      // The inner cancel may run the inner progress (it does not touch recvs_).
      recvs_dirty_ = true;
      if (!inner_->cancel(it->inner)) return false;  // matched already: progress() completes it
      recvs_.erase(it);
      req->state = RequestState::kCancelled;
      return true;
    }
  }
  return inner_->cancel(req);  // an any-peer receive (not wrapped)
}

void FaultEndpoint::reset_peer(int peer, const std::string& published, uint32_t incarnation) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->peer != peer) {
      ++it;
      continue;
    }
    it->proxy->state = RequestState::kCancelled;
    it = held_.erase(it);
  }
  for (auto it = cut_recvs_.begin(); it != cut_recvs_.end();) {
    if (it->proxy->peer != peer) {
      ++it;
      continue;
    }
    it->proxy->state = RequestState::kCancelled;
    it = cut_recvs_.erase(it);
  }
  inner_->reset_peer(peer, published, incarnation);
  // The inner requests of `peer` ended there: their proxies follow in the next progress().
  recvs_dirty_ = true;
}

void FaultEndpoint::close() {
  if (closed()) return;
  for (Held& h : held_) h.proxy->state = RequestState::kCancelled;  // never sent
  held_.clear();
  for (Forwarded& f : cut_recvs_) f.proxy->state = RequestState::kCancelled;
  cut_recvs_.clear();
  inner_->close();
  // The inner requests have their final state now.
  for (auto* list : {&forwarded_, &recvs_}) {
    for (Forwarded& f : *list) {
      if (f.inner->done())
        copy_outcome(*f.inner, *f.proxy);
      else
        f.proxy->state = RequestState::kCancelled;
    }
    list->clear();
  }
}

}  // namespace qring::net
