// The member service's sends (control messages, results for ranks outside a step, state
// transfers): each keeps its buffer alive until the transport is done with it. Results to
// one rank are paced, at most two in flight, so that a rank that stops reading holds no more
// than that in the transport (it leaves the view when it falls silent). Engine thread only.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "net/transport/endpoint.h"

namespace qring::collectives {

class Outbox {
 public:
  explicit Outbox(int world) : results_(size_t(world)), generation_(size_t(world), 0) {}

  // Sends `len` bytes at `data` (kept alive by `keep`) to `peer` with `tag`.
  void send(net::Endpoint& ep, int peer, uint64_t tag, std::shared_ptr<const void> keep,
            const void* data, size_t len);
  // A result (`len` bytes at `data`, kept alive by `keep`) for `to`, sent once fewer than two
  // of its results are in flight.
  void send_result(net::Endpoint& ep, int to, uint64_t tag, std::shared_ptr<const void> keep,
                   const void* data, size_t len);
  // `to` left: the results queued for it are not sent.
  void forget_results(int to) { results_[size_t(to)].queued.clear(); }
  // `peer` is a new incarnation: what was in flight to the old one no longer paces it.
  void reset(int peer);
  // Completed sends are let go. Returns whether any completed; `failed` gets the peers of
  // those that failed (not cancelled), with the error; `may_flush(peer)` says whether queued
  // results to `peer` may go now.
  template <class MayFlush>
  bool reap(net::Endpoint& ep, std::vector<std::pair<int, std::string>>& failed,
            MayFlush may_flush);
  // True when every send is done or goes to a rank `lost(peer)` says is gone.
  template <class Lost>
  bool only_to(Lost lost) const {
    for (const auto& s : sends_)
      if (!s.req->done() && !lost(s.peer)) return false;
    return true;
  }
  bool empty() const { return sends_.empty(); }
  // The end: buffers of sends still pending stay alive until the endpoint is closed (the
  // provider may still read those of sends to a rank that left).
  void retain(net::Endpoint& ep);

 private:
  struct Send {
    net::RequestPtr req;
    std::shared_ptr<const void> keep;
    int peer = -1;
    bool result = false;
    uint32_t generation = 0;  // of the peer when it was sent
  };
  struct Queued {
    uint64_t tag;
    std::shared_ptr<const void> keep;
    const void* data;
    size_t len;
  };
  struct Results {
    int in_flight = 0;
    std::deque<Queued> queued;
  };
  void flush(net::Endpoint& ep, int to);

  std::deque<Send> sends_;
  std::vector<Results> results_;
  std::vector<uint32_t> generation_;
};

template <class MayFlush>
bool Outbox::reap(net::Endpoint& ep, std::vector<std::pair<int, std::string>>& failed,
                  MayFlush may_flush) {
  bool moved = false;
  // What completed sends call for is done after the sweep: it posts new sends, and a deque's
  // iterators do not survive a push_back.
  std::vector<int> flushes;
  for (auto it = sends_.begin(); it != sends_.end();) {
    if (!it->req->done()) {
      ++it;
      continue;
    }
    if (!it->req->ok() && it->req->state != net::RequestState::kCancelled)
      failed.emplace_back(it->peer, it->req->error);
    if (it->result && it->generation == generation_[size_t(it->peer)]) {
      --results_[size_t(it->peer)].in_flight;
      flushes.push_back(it->peer);
    }
    it = sends_.erase(it);
    moved = true;
  }
  for (int peer : flushes)
    if (may_flush(peer)) flush(ep, peer);
  return moved;
}

}  // namespace qring::collectives
