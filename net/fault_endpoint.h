// Fault injection for tests: wraps any Endpoint and delays or drops the messages it sends
// that match a rule. Installing the same plan on every rank covers "messages to rank X"
// (dst = X) and "messages from rank X" (src = X).
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "net/endpoint.h"
#include "net/tags.h"

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
  std::string provider() const override { return inner_->provider() + "+faults"; }
  size_t max_message_size() const override { return inner_->max_message_size(); }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override;
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore) override {
    return inner_->irecv(peer, tag, buf, len, ignore);
  }
  size_t progress() override;
  bool cancel(const RequestPtr& req) override { return inner_->cancel(req); }
  void register_memory(const void* p, size_t n) override { inner_->register_memory(p, n); }
  void deregister_memory(const void* p) override { inner_->deregister_memory(p); }

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
  };
  struct Forwarded {
    RequestPtr proxy;
    RequestPtr inner;
  };
  const FaultRule* match(int peer, uint64_t tag);

  std::unique_ptr<Endpoint> inner_;
  std::vector<FaultRule> rules_;
  std::vector<int> seen_;  // per rule: matching messages seen
  std::deque<Held> held_;
  std::vector<Forwarded> forwarded_;
  size_t dropped_ = 0;
  size_t delayed_ = 0;
};

}  // namespace qring::net
