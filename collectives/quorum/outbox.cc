#include "collectives/quorum/outbox.h"

namespace qring::collectives {

void Outbox::send(net::Endpoint& ep, int peer, uint64_t tag, std::shared_ptr<const void> keep,
                  const void* data, size_t len) {
  auto req = ep.isend(peer, tag, data, len);
  sends_.push_back({req, std::move(keep), peer, false, generation_[size_t(peer)]});
}

void Outbox::send_result(net::Endpoint& ep, int to, uint64_t tag,
                         std::shared_ptr<const void> keep, const void* data, size_t len) {
  results_[size_t(to)].queued.push_back({tag, std::move(keep), data, len});
  flush(ep, to);
}

void Outbox::flush(net::Endpoint& ep, int to) {
  Results& q = results_[size_t(to)];
  while (q.in_flight < 2 && !q.queued.empty()) {
    Queued r = std::move(q.queued.front());
    q.queued.pop_front();
    auto req = ep.isend(to, r.tag, r.data, r.len);
    ++q.in_flight;
    sends_.push_back({req, std::move(r.keep), to, true, generation_[size_t(to)]});
  }
}

void Outbox::reset(int peer) {
  results_[size_t(peer)] = Results{};
  ++generation_[size_t(peer)];
}

void Outbox::retain(net::Endpoint& ep) {
  for (auto& s : sends_)
    if (!s.req->done() && s.keep) ep.retain_until_closed(s.keep);
  sends_.clear();
}

}  // namespace qring::collectives
