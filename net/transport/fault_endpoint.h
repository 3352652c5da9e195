// Fault injection for tests: wraps any Endpoint and delays or drops the messages it sends
// that match a rule. Installing the same plan on every rank covers "messages to rank X"
// (dst = X) and "messages from rank X" (src = X).
//
// cut(X) removes rank X from this endpoint's network at runtime: from then on every message
// it sends to X is dropped (held ones too) and no receive from X completes (receives posted
// earlier included; one that the inner endpoint matched meanwhile is ignored, its buffer
// contents undefined). Nothing is reported: the ranks see silence, as from a partitioned or
// frozen peer; cancel() still withdraws such a receive. Cutting X on every rank, and every
// rank on X, takes X out entirely. Any-peer receives are not filtered (the source of their
// message is unknown). Delayed messages are held per peer: one peer's never hold another's.
//
// refuse(X) is cut(X) where the sender is told: every later send to X fails at once (kError,
// "Connection refused", X among suspect_peers()), as tcp's sends to a host that is gone.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "net/transport/endpoint.h"
#include "net/transport/tags.h"

namespace qring::net {

struct FaultRule {
  int src = kAnyPeer;    // sender rank, or any
  int dst = kAnyPeer;    // receiver rank, or any
  std::optional<Op> op;  // only messages of this protocol, or all
  std::chrono::milliseconds delay{0};
  bool drop = false;
  // Apply to matching messages after this many have passed untouched.
  int skip_first = 0;
};

class FaultEndpoint final : public Endpoint {
 public:
  FaultEndpoint(std::unique_ptr<Endpoint> inner, std::vector<FaultRule> rules);

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  // The inner transport's: the wrapper changes no setting a peer must share.
  std::string provider() const override { return inner_->provider(); }
  TransportTraits traits() const override { return inner_->traits(); }
  size_t max_message_size() const override { return inner_->max_message_size(); }
  size_t data_bytes() const override { return inner_->data_bytes(); }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len,
                   uint64_t data = 0) override;
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore = 0) override;
  size_t progress() override;
  bool cancel(const RequestPtr& req) override;
  void discard(int peer, uint64_t tag, size_t len, Deadline until) override {
    inner_->discard(peer, tag, len, until);
  }
  // Held messages are dropped (their proxies cancelled), then the inner endpoint is closed.
  void close() override;
  bool closed() const override { return inner_->closed(); }
  void register_memory(const void* p, size_t n) override { inner_->register_memory(p, n); }
  void deregister_memory(const void* p) override { inner_->deregister_memory(p); }
  std::vector<int> suspect_peers() const override;
  void expect_departure(int peer) override { inner_->expect_departure(peer); }
  std::string published_address() const override { return inner_->published_address(); }
  uint32_t incarnation() const override { return inner_->incarnation(); }
  bool connected(int peer) const override { return inner_->connected(peer); }
  // Held messages to `peer` and receives from it end cancelled; the rules stay.
  void reset_peer(int peer, const std::string& published, uint32_t incarnation) override;
  void prepare_reset_peer(int peer) override { inner_->prepare_reset_peer(peer); }

  // Cuts `peer` off (see above); permanent. Thread-safe: any thread may call it while the
  // owner drives the endpoint, which applies it from its next isend/irecv/progress.
  void cut(int peer);
  bool is_cut(int peer) const;
  // cut(peer), and later sends to it fail (see above); permanent. Thread-safe as cut().
  void refuse(int peer);

  // From now on cancel() of a directed receive does nothing and throws TimeoutError, as a
  // provider that never confirms a cancellation: the receive stays posted (its buffer in use)
  // until it completes or the endpoint is closed. Thread-safe.
  void fail_cancels() { fail_cancels_.store(true, std::memory_order_release); }

  // Messages dropped by rules or by a cut; messages delayed by rules.
  size_t dropped() const { return dropped_; }
  size_t delayed() const { return delayed_; }

 private:
  struct Held {
    Clock::time_point release;
    RequestPtr proxy;
    int peer;
    uint64_t tag;
    const void* buf;
    size_t len;
    uint64_t data;
  };
  struct Forwarded {
    RequestPtr proxy;
    RequestPtr inner;  // receives from a cut peer: null once withdrawn
  };
  const FaultRule* match(int peer, uint64_t tag);
  void drop_cut_receives();

  std::unique_ptr<Endpoint> inner_;
  std::vector<FaultRule> rules_;
  std::vector<int> seen_;  // per rule: matching messages seen
  std::deque<Held> held_;
  std::vector<Forwarded> forwarded_;
  // Directed receives: proxies over the inner requests, so that a cut can hold them back.
  std::vector<Forwarded> recvs_;
  std::vector<Forwarded> cut_recvs_;    // receives from cut peers: never complete
  std::vector<std::atomic<bool>> cut_;  // per rank
  std::vector<std::atomic<bool>> refused_;  // per rank (cut too)
  std::vector<int> refused_sends_;          // owner: ranks a send was refused to, sorted
  std::atomic<uint64_t> cuts_{0};       // cut() calls so far
  uint64_t cuts_applied_ = 0;           // owner: cuts applied to recvs_
  bool recvs_dirty_ = false;            // an inner cancel may have completed receives
  size_t dropped_ = 0;
  size_t delayed_ = 0;
  std::atomic<bool> fail_cancels_{false};
};

}  // namespace qring::net
