#include "net/transport/inproc_endpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>

#include "net/base/error.h"

namespace qring::net {

namespace {
bool matches(uint64_t posted_tag, uint64_t ignore, uint64_t tag) {
  return ((posted_tag ^ tag) & ~ignore) == 0;
}
}  // namespace

struct InprocFabric::Mailbox {
  struct Posted {
    RequestPtr req;
    void* buf;
    uint64_t ignore;
    uint64_t tag;  // as on the wire (with the generation)
  };
  struct Message {
    int src;
    uint64_t tag;
    std::vector<char> data;
    uint64_t imm;  // immediate data
  };
  struct Done {
    RequestPtr req;
    int src;
    size_t bytes;
    uint64_t tag;
    std::string error;
    uint64_t imm;
  };
  std::mutex mu;
  std::list<Posted> posted;       // in post order
  std::list<Message> unexpected;  // in arrival order
  std::vector<Done> completed;    // filled by senders, drained by the owner's progress()
};

namespace {

class InprocEndpoint final : public Endpoint {
 public:
  InprocEndpoint(int rank, std::vector<InprocFabric::Mailbox*> boxes, uint32_t incarnation,
                 bool join)
      : rank_(rank),
        boxes_(std::move(boxes)),
        incarnation_(incarnation),
        gens_(boxes_.size(), 0),
        connected_(boxes_.size(), join ? 0 : 1) {
    connected_[size_t(rank)] = 1;
  }

  ~InprocEndpoint() override { close(); }

  // The mailbox outlives the endpoint: the receives still posted are withdrawn, or later
  // senders would write into buffers that are gone (senders copy into posted buffers
  // themselves, under the mailbox lock). Receives that matched already are reported.
  void close() override {
    if (closed_) return;
    auto& box = *boxes_[static_cast<size_t>(rank_)];
    std::vector<InprocFabric::Mailbox::Done> done;
    {
      std::lock_guard<std::mutex> lock(box.mu);
      for (auto& p : box.posted) p.req->state = RequestState::kCancelled;
      box.posted.clear();
      done.swap(box.completed);
      closed_ = true;
    }
    apply(done);
  }
  bool closed() const override { return closed_; }

  uint32_t incarnation() const override { return incarnation_; }
  std::string published_address() const override { return "inproc\n"; }
  bool connected(int peer) const override {
    return peer >= 0 && peer < world_size() && connected_[size_t(peer)];
  }
  void reset_peer(int peer, const std::string& published, uint32_t incarnation) override {
    check_peer(peer, "reset_peer");
    if (peer == rank_) throw UsageError("reset_peer: a rank cannot reconnect itself");
    if (published != "inproc\n")
      throw ProtocolError(fmt::format("rank {}: malformed address of rank {}", rank_, peer));
    {
      auto& box = *boxes_[static_cast<size_t>(rank_)];
      std::lock_guard<std::mutex> lock(box.mu);
      for (auto it = box.posted.begin(); it != box.posted.end();) {
        if (it->req->peer == peer) {
          it->req->state = RequestState::kCancelled;
          it = box.posted.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& w : waiting_)
      if (w.req->peer == peer && !w.req->done()) w.req->state = RequestState::kCancelled;
    std::erase_if(waiting_, [&](const Waiting& w) { return w.req->peer == peer; });
    gens_[size_t(peer)] = (incarnation_ + incarnation) & 0xFu;
    connected_[size_t(peer)] = 1;
    std::erase(suspects_, peer);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(boxes_.size()); }
  std::string provider() const override { return "inproc"; }
  size_t max_message_size() const override { return SIZE_MAX; }

  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len,
                   uint64_t data = 0) override {
    check_open();
    check_peer(peer, "isend");
    auto req = std::make_shared<Request>();
    req->is_send = true;
    req->peer = peer;
    req->tag = tag;
    req->len = len;
    req->bytes = len;
    if (!connected_[size_t(peer)]) {
      waiting_.push_back({req});  // until reset_peer connects the peer (and ends it)
      return req;
    }
    send_now(req, peer, with_generation(tag, gens_[size_t(peer)]), buf, len, data);
    return req;
  }

  void send_now(const RequestPtr& req, int peer, uint64_t tag, const void* buf, size_t len,
                uint64_t data) {
    auto& box = *boxes_[static_cast<size_t>(peer)];
    {
      std::lock_guard<std::mutex> lock(box.mu);
      for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
        Request& r = *it->req;
        if ((r.peer == kAnyPeer || r.peer == rank_) && matches(it->tag, it->ignore, tag)) {
          if (len > r.len) {
            box.completed.push_back(
                {it->req, rank_, len, tag, truncated(rank_, len, r.len), data});
          } else {
            if (len) std::memcpy(it->buf, buf, len);
            box.completed.push_back({it->req, rank_, len, tag, {}, data});
          }
          box.posted.erase(it);
          req->state = RequestState::kDone;
          return;
        }
      }
      const char* p = static_cast<const char*>(buf);
      box.unexpected.push_back({rank_, tag, std::vector<char>(p, p + len), data});
    }
    req->state = RequestState::kDone;  // eager: the data is buffered
  }

  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore = 0) override {
    check_open();
    if (peer != kAnyPeer) check_peer(peer, "irecv");
    auto req = std::make_shared<Request>();
    req->peer = peer;
    req->tag = tag;
    req->len = len;
    if (peer == kAnyPeer) {
      ignore |= kGenMask;  // an any-peer receive cannot know its sender's generation
    } else if (!connected_[size_t(peer)]) {
      waiting_.push_back({req});
      return req;
    }
    recv_now(req, peer, peer == kAnyPeer ? tag : with_generation(tag, gens_[size_t(peer)]), buf,
             len, ignore);
    return req;
  }

  void recv_now(const RequestPtr& req, int peer, uint64_t tag, void* buf, size_t len,
                uint64_t ignore) {
    auto& box = *boxes_[static_cast<size_t>(rank_)];
    std::lock_guard<std::mutex> lock(box.mu);
    for (auto it = box.unexpected.begin(); it != box.unexpected.end(); ++it) {
      if ((peer == kAnyPeer || it->src == peer) && matches(tag, ignore, it->tag)) {
        req->matched_tag = it->tag & ~kGenMask;
        req->bytes = it->data.size();
        req->data = it->imm;
        if (it->data.size() > len) {
          req->state = RequestState::kError;
          req->truncated = true;
          req->error = truncated(it->src, it->data.size(), len);
          mark_suspect(it->src);
        } else {
          if (!it->data.empty()) std::memcpy(buf, it->data.data(), it->data.size());
          req->state = RequestState::kDone;
        }
        box.unexpected.erase(it);
        return;
      }
    }
    box.posted.push_back({req, buf, ignore, tag});
  }

  size_t progress() override {
    if (closed_) return 0;
    auto& box = *boxes_[static_cast<size_t>(rank_)];
    std::vector<InprocFabric::Mailbox::Done> done;
    {
      std::lock_guard<std::mutex> lock(box.mu);
      if (box.completed.empty()) return 0;
      done.swap(box.completed);
    }
    apply(done);
    return done.size();
  }

  void apply(std::vector<InprocFabric::Mailbox::Done>& done) {
    for (auto& d : done) {
      d.req->bytes = d.bytes;
      d.req->matched_tag = d.tag & ~kGenMask;
      d.req->data = d.imm;
      if (d.error.empty()) {
        d.req->state = RequestState::kDone;
      } else {
        d.req->state = RequestState::kError;
        d.req->truncated = true;  // the only error of this transport
        d.req->error = d.error;
        mark_suspect(d.src);
      }
    }
  }

  bool cancel(const RequestPtr& req) override {
    if (req->done() || req->is_send) return false;
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if (it->req == req) {
        waiting_.erase(it);
        req->state = RequestState::kCancelled;
        return true;
      }
    }
    auto& box = *boxes_[static_cast<size_t>(rank_)];
    std::lock_guard<std::mutex> lock(box.mu);
    for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
      if (it->req == req) {
        box.posted.erase(it);
        req->state = RequestState::kCancelled;
        return true;
      }
    }
    return false;  // already matched; progress() will complete it
  }

  // Each rank's mailbox has its own lists and sends are eager copies: nothing one peer does
  // (or fails to do) can hold back traffic with another. The only per-peer error here is a
  // truncated message; it marks its sender (known even for any-peer receives).
  std::vector<int> suspect_peers() const override { return suspects_; }

 private:
  static std::string truncated(int src, size_t got, size_t room) {
    return fmt::format("from rank {}: message truncated: {} bytes arrived for a {}-byte buffer",
                       src, got, room);
  }

  void mark_suspect(int peer) {
    auto it = std::lower_bound(suspects_.begin(), suspects_.end(), peer);
    if (it == suspects_.end() || *it != peer) suspects_.insert(it, peer);
  }

  void check_open() const {
    if (closed_) throw IoError(fmt::format("rank {}: the endpoint is closed", rank_));
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= world_size())
      throw UsageError(fmt::format("{}: peer {} out of range [0, {})", what, peer, world_size()));
  }

  int rank_;
  std::vector<InprocFabric::Mailbox*> boxes_;
  uint32_t incarnation_;
  std::vector<uint32_t> gens_;   // per peer: the pair's generation (net/transport/tags.h)
  std::vector<char> connected_;  // per peer
  // Posts to or from peers not connected yet (a joining endpoint): they end cancelled when
  // reset_peer connects the peer, as the fabric endpoint's queued posts do.
  struct Waiting {
    RequestPtr req;
  };
  std::vector<Waiting> waiting_;
  std::vector<int> suspects_;  // sorted
  bool closed_ = false;
};

}  // namespace

InprocFabric::InprocFabric(int world_size) {
  if (world_size < 1) throw UsageError("InprocFabric: world size must be >= 1");
  for (int i = 0; i < world_size; ++i) boxes_.push_back(std::make_unique<Mailbox>());
}
InprocFabric::~InprocFabric() = default;
int InprocFabric::world_size() const {
  return static_cast<int>(boxes_.size());
}

std::unique_ptr<Endpoint> InprocFabric::endpoint(int rank, uint32_t incarnation, bool join) {
  if (rank < 0 || rank >= world_size())
    throw UsageError(fmt::format("InprocFabric: rank {} out of range", rank));
  std::vector<Mailbox*> boxes;
  for (auto& b : boxes_) boxes.push_back(b.get());
  return std::make_unique<InprocEndpoint>(rank, std::move(boxes), incarnation, join);
}

}  // namespace qring::net
