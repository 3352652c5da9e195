// Quorum all-reduce protocol (see quorum.h and docs/design.md).
//
//   contribute(t) ──READY(t, r)──▶ coordinator (rank 0's engine, even while rank 0 computes)
//                                   decides S(t): all W arrived, or Q arrived and the grace
//                                   passed; fewer than Q by first READY + H → FAIL
//   every rank ◀──DECIDE(t, S, offsets)──
//   ranks in S(t): ring all-reduce among themselves, in place in the contributed buffers
//   rank x ∉ S(t): receives the result from member S[x mod |S|] into an internal buffer
#include "collectives/quorum.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>

#include "collectives/engine.h"
#include "collectives/reduce.h"
#include "collectives/ring.h"

namespace qring::collectives {

LatePolicy parse_late_policy(std::string_view s) {
  if (s == "drop") return LatePolicy::kDrop;
  if (s == "carry") return LatePolicy::kCarry;
  throw ConfigError(fmt::format("unknown late policy '{}' (expected drop or carry)", s));
}
std::string_view to_string(LatePolicy p) {
  return p == LatePolicy::kDrop ? "drop" : "carry";
}

int resolve_quorum(std::string_view spec, int world) {
  std::string s(spec);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    throw ConfigError(fmt::format("quorum '{}' is not a number", spec));
  int q;
  if (s.find('.') != std::string::npos) {
    if (v <= 0 || v > 1)
      throw ConfigError(fmt::format("quorum fraction {} must be in (0, 1]", spec));
    q = static_cast<int>(std::ceil(v * world - 1e-9));
  } else {
    q = static_cast<int>(v);
  }
  if (q < 1 || q > world)
    throw ConfigError(
        fmt::format("quorum {} out of range [1, {}] for {} ranks", spec, world, world));
  return q;
}

namespace {

constexpr uint32_t kReadyMagic = 0x59445251;   // "QRDY"
constexpr uint32_t kDecideMagic = 0x43454451;  // "QDEC"
constexpr uint16_t kWireVersion = 1;
constexpr size_t kKeepDecided = 4096;  // decided steps the coordinator remembers

struct ReadyMsg {
  uint32_t magic;
  uint16_t version;
  uint16_t pad;
  uint32_t rank;
  uint32_t world;
  uint64_t step;
  uint64_t count;
};
static_assert(sizeof(ReadyMsg) == 32);

enum class DecideStatus : uint8_t { kOk = 0, kTimeout = 1, kMismatch = 2 };

struct DecideHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t status;
  uint8_t pad;
  uint32_t world;
  uint32_t ncontrib;
  uint64_t step;
  int64_t decide_us;
  uint32_t bad_rank;
  uint32_t pad2;
  uint64_t bad_count;
};
static_assert(sizeof(DecideHeader) == 48);

size_t bitmap_bytes(int world) {
  return (size_t(world) + 7) / 8;
}
size_t decide_size(int world) {
  return sizeof(DecideHeader) + (bitmap_bytes(world) + 7) / 8 * 8 + 8 * size_t(world);
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

struct StepLocal {
  void* buf = nullptr;
  bool contributed = false;
  Clock::time_point contrib_time{};
  bool decided = false;
  bool ring_finished = false;  // speculative ring (quorum = world) done, DECIDE pending
  bool excluded = false;
  bool done = false;
  std::exception_ptr error;
  QuorumResult result;
  std::vector<char> late_result;
};

struct QuorumAllreduce::Shared {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, StepLocal> steps;
  std::deque<uint64_t> ready_events;  // contributed steps whose READY is not sent yet
  std::exception_ptr poison;
  bool shutdown = false;
  std::function<void(uint64_t)> on_excluded;
  std::map<uint64_t, std::vector<double>> arrivals;  // coordinator only

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!poison) poison = e;
    for (auto& [t, s] : steps)
      if (!s.done && !s.error) s.error = e;
    cv.notify_all();
  }
};

namespace {

class QuorumService final : public EngineOp {
 public:
  QuorumService(Engine& engine, const CommOptions& copts, size_t count, const QuorumOptions& o,
                std::shared_ptr<QuorumAllreduce::Shared> sh, uint32_t instance)
      : engine_(engine),
        copts_(copts),
        count_(count),
        o_(o),
        sh_(std::move(sh)),
        rank_(engine.rank()),
        world_(engine.size()),
        esz_(dtype_size(o.type)),
        instance_(instance & 0xFF) {
    seq = 0;
    deadline = Clock::time_point::max();
  }

  std::string name() const override { return "quorum service"; }
  // Chunk field of control tags: the sender's rank and this all-reduce's instance number, so
  // a late message of an earlier instance on the same communicator never matches.
  uint64_t chunk(int r) const { return uint64_t(r) | (uint64_t(instance_) << 16); }
  bool sequenced() const override { return false; }
  bool finished() const override { return finished_; }
  std::string waiting_on() const override { return "contributions"; }
  // Between steps: nothing of this rank in flight, only the standing READY/DECIDE receives.
  bool passive() const override {
    return rings_.empty() && result_recvs_.empty() && sends_.empty() && coord_.empty() &&
           awaiting_decide_.empty() && !finished_;
  }

  void start(net::Endpoint& ep) override {
    if (rank_ == 0) {
      ready_in_.resize(size_t(world_));
      for (int p = 1; p < world_; ++p) post_ready_recv(ep, p);
    } else {
      post_decide_recv(ep);
    }
  }

  void abort(net::Endpoint& ep) override {
    cancel_all(ep);
    sh_->fail(std::make_exception_ptr(
        IoError(fmt::format("rank {}: the communicator under the quorum all-reduce failed: {}",
                            rank_, engine_.broken_reason()))));
  }

  bool advance(net::Endpoint& ep) override {
    if (finished_) return false;
    bool moved = false;
    try {
      moved |= take_events(ep);
      if (rank_ == 0) {
        moved |= poll_ready(ep);
        moved |= coordinate(ep);
      } else {
        moved |= poll_decide(ep);
      }
      moved |= advance_rings(ep);
      moved |= poll_results();
      moved |= reap_sends();
      check_deadlines();
    } catch (...) {
      sh_->fail(std::current_exception());
      dead_ = true;
    }
    bool stop;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      stop = sh_->shutdown;
    }
    if ((stop || dead_) && !finished_) {
      cancel_all(ep);
      if (sends_.empty() || Clock::now() > drain_deadline()) {
        for (auto& s : sends_) {
          if (s.req->done()) continue;
          // The provider may still read these buffers: leak them rather than free them.
          (void)s.buf.release();
          if (s.shared) (void)new std::shared_ptr<std::vector<char>>(s.shared);
        }
        sends_.clear();
        finished_ = true;
      }
    }
    return moved;
  }

 private:
  struct CoordStep {
    Clock::time_point first{};
    std::vector<std::optional<Clock::time_point>> arrived;
    int n = 0;
    Clock::time_point quorum_time{};
    uint32_t bad_rank = 0;
    uint64_t bad_count = 0;
    bool mismatch = false;
  };
  struct Send {
    net::RequestPtr req;
    std::unique_ptr<std::vector<char>> buf;  // shared buffers are held by the first send
    std::shared_ptr<std::vector<char>> shared;
  };
  struct Ring {
    std::unique_ptr<EngineOp> op;
    Clock::time_point started;
    std::vector<int> members;
    bool speculative = false;
  };
  struct ResultRecv {
    net::RequestPtr req;
    int from;
    Clock::time_point started;
  };

  Clock::time_point drain_deadline() {
    if (drain_deadline_ == Clock::time_point{})
      drain_deadline_ = Clock::now() + std::chrono::seconds(2);
    return drain_deadline_;
  }

  void cancel_all(net::Endpoint& ep) {
    for (auto& in : ready_in_)
      if (in.req && !in.req->done()) ep.cancel(in.req);
    if (decide_req_ && !decide_req_->done()) ep.cancel(decide_req_);
    for (auto& [t, rr] : result_recvs_)
      if (!rr.req->done()) ep.cancel(rr.req);
    result_recvs_.clear();
    for (auto& [t, ring] : rings_) ring.op->abort(ep);
    rings_.clear();
  }

  // Control messages use exact tags numbered per (sender, receiver) stream, never ignore
  // masks: libfabric 1.17's shm provider loses unexpected messages matched through an
  // ignore mask. READY n of rank p carries tag (kQuorumReady, n, p); DECIDE n carries
  // (kQuorumDecide, n, 0); the step travels in the message body.
  void post_ready_recv(net::Endpoint& ep, int p) {
    ReadyIn& in = ready_in_[size_t(p)];
    in.req = ep.irecv(p, net::make_tag(net::Op::kQuorumReady, in.next, chunk(p)), &in.msg,
                      sizeof(in.msg));
  }
  void post_decide_recv(net::Endpoint& ep) {
    decide_buf_.assign(decide_size(world_), 0);
    decide_req_ = ep.irecv(0, net::make_tag(net::Op::kQuorumDecide, decide_in_next_, chunk(0)),
                           decide_buf_.data(), decide_buf_.size());
  }

  // Contributions made by the caller: READY to the coordinator (or recorded directly on it).
  bool take_events(net::Endpoint& ep) {
    std::deque<uint64_t> ev;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      ev.swap(sh_->ready_events);
    }
    for (uint64_t t : ev) {
      awaiting_decide_.insert(t);
      if (speculate_) start_speculative_ring(ep, t);
      if (rank_ == 0) {
        record_arrival(t, 0, count_);
      } else {
        auto buf = std::make_unique<std::vector<char>>(sizeof(ReadyMsg));
        ReadyMsg m{kReadyMagic, kWireVersion, 0, uint32_t(rank_), uint32_t(world_), t, count_};
        std::memcpy(buf->data(), &m, sizeof(m));
        auto req =
            ep.isend(0, net::make_tag(net::Op::kQuorumReady, ready_out_next_++, chunk(rank_)),
                     buf->data(), buf->size());
        sends_.push_back({req, std::move(buf), nullptr});
      }
    }
    return !ev.empty();
  }

  // With quorum = world, S(t) can only be every rank (anything less is a timeout), so once one
  // step has been decided OK (which proves every rank set this all-reduce up with the same
  // count) the ring starts at contribute time, in parallel with READY/DECIDE, instead of a
  // round trip through the coordinator later. The step completes when both the ring and the
  // DECIDE are in; a DECIDE that reports a timeout aborts the ring.
  void start_speculative_ring(net::Endpoint& ep, uint64_t t) {
    void* buf;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      buf = sh_->steps[t].buf;
    }
    std::vector<int> members(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) members[size_t(r)] = r;
    start_ring(ep, t, buf, std::move(members), /*speculative=*/true);
  }

  void start_ring(net::Endpoint& ep, uint64_t t, void* buf, std::vector<int> members,
                  bool speculative) {
    RingArgs a;
    a.kind = RingKind::kAllreduce;
    a.send = buf;
    a.recv = buf;
    a.count = count_;
    a.type = o_.type;
    a.op = o_.mean ? RedOp::kAvg : RedOp::kSum;
    a.tag_op = net::Op::kQuorumData;
    a.members = members;
    auto op = make_ring_op(engine_, copts_, a);
    op->seq = uint32_t(t);
    op->start(ep);
    rings_[t] = Ring{std::move(op), Clock::now(), std::move(members), speculative};
  }

  bool poll_ready(net::Endpoint& ep) {
    bool moved = false;
    for (int from = 1; from < world_; ++from) {
      ReadyIn& in = ready_in_[size_t(from)];
      if (!in.req || !in.req->done()) continue;
      net::throw_if_failed(*in.req, "quorum READY receive");
      ReadyMsg m = in.msg;
      if (in.req->bytes != sizeof(ReadyMsg) || m.magic != kReadyMagic)
        throw ProtocolError(fmt::format("rank 0: malformed quorum READY from rank {}", from));
      if (m.version != kWireVersion)
        throw ProtocolError(
            fmt::format("rank 0: rank {} speaks quorum protocol version {}, this "
                        "rank {}",
                        from, m.version, kWireVersion));
      if (int(m.world) != world_ || int(m.rank) != from)
        throw ProtocolError(
            fmt::format("rank 0: quorum READY from rank {} claims rank {} of {} "
                        "ranks; this world has {}",
                        from, m.rank, m.world, world_));
      record_arrival(m.step, from, m.count);
      ++in.next;
      post_ready_recv(ep, from);
      --from;  // the next READY of this peer may be waiting already
      moved = true;
    }
    return moved;
  }

  void record_arrival(uint64_t t, int from, uint64_t count) {
    auto now = Clock::now();
    bool late = t < low_water_ || decided_.count(t);
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      auto& log = sh_->arrivals[t];
      if (log.empty()) log.assign(size_t(world_), -1.0);
      auto it = coord_.find(t);
      Clock::time_point first = it != coord_.end() ? it->second.first : now;
      if (late) {
        auto f = first_times_.find(t);
        if (f != first_times_.end()) first = f->second;
      }
      log[size_t(from)] = ms_between(first, now);
    }
    if (late) return;  // decided without it: the rank learns from DECIDE
    auto [it, fresh] = coord_.try_emplace(t);
    CoordStep& cs = it->second;
    if (fresh) {
      cs.first = now;
      cs.arrived.assign(size_t(world_), std::nullopt);
    }
    if (cs.arrived[size_t(from)]) return;  // duplicate READY: ignore
    cs.arrived[size_t(from)] = now;
    if (count != count_ && !cs.mismatch) {
      cs.mismatch = true;
      cs.bad_rank = uint32_t(from);
      cs.bad_count = count;
    }
    if (++cs.n == o_.quorum) cs.quorum_time = now;
  }

  bool coordinate(net::Endpoint& ep) {
    bool moved = false;
    auto now = Clock::now();
    for (auto it = coord_.begin(); it != coord_.end();) {
      CoordStep& cs = it->second;
      DecideStatus st;
      bool decide = false;
      if (cs.mismatch) {
        st = DecideStatus::kMismatch;
        decide = true;
      } else if (cs.n == world_ || (cs.n >= o_.quorum && now >= cs.quorum_time + o_.grace)) {
        st = DecideStatus::kOk;
        decide = true;
      } else if (now >= cs.first + o_.deadline) {
        st = DecideStatus::kTimeout;
        decide = true;
      }
      if (!decide) {
        ++it;
        continue;
      }
      uint64_t t = it->first;
      std::vector<char> msg = encode_decide(t, cs, st, now);
      auto shared = std::make_shared<std::vector<char>>(msg);
      for (int r = 1; r < world_; ++r) {
        auto req = ep.isend(r, net::make_tag(net::Op::kQuorumDecide, decide_out_next_, chunk(0)),
                            shared->data(), shared->size());
        sends_.push_back({req, nullptr, shared});
      }
      ++decide_out_next_;
      first_times_[t] = cs.first;
      decided_.insert(t);
      while (decided_.size() > kKeepDecided) {
        low_water_ = std::max(low_water_, *decided_.begin() + 1);
        first_times_.erase(*decided_.begin());
        decided_.erase(decided_.begin());
      }
      it = coord_.erase(it);
      apply_decide(ep, msg);
      moved = true;
    }
    return moved;
  }

  std::vector<char> encode_decide(uint64_t t, const CoordStep& cs, DecideStatus st,
                                  Clock::time_point now) {
    std::vector<char> msg(decide_size(world_), 0);
    DecideHeader h{};
    h.magic = kDecideMagic;
    h.version = kWireVersion;
    h.status = uint8_t(st);
    h.world = uint32_t(world_);
    h.ncontrib = uint32_t(cs.n);
    h.step = t;
    h.decide_us = std::chrono::duration_cast<std::chrono::microseconds>(now - cs.first).count();
    h.bad_rank = cs.bad_rank;
    h.bad_count = cs.bad_count;
    std::memcpy(msg.data(), &h, sizeof(h));
    auto* bitmap = reinterpret_cast<uint8_t*>(msg.data() + sizeof(h));
    auto* offs =
        reinterpret_cast<int64_t*>(msg.data() + sizeof(h) + (bitmap_bytes(world_) + 7) / 8 * 8);
    for (int r = 0; r < world_; ++r) {
      if (cs.arrived[size_t(r)]) {
        bitmap[r / 8] |= uint8_t(1u << (r % 8));
        offs[r] =
            std::chrono::duration_cast<std::chrono::microseconds>(*cs.arrived[size_t(r)] - cs.first)
                .count();
      } else {
        offs[r] = -1;
      }
    }
    return msg;
  }

  bool poll_decide(net::Endpoint& ep) {
    bool moved = false;
    while (decide_req_ && decide_req_->done()) {
      net::throw_if_failed(*decide_req_, "quorum DECIDE receive");
      if (decide_req_->bytes != decide_size(world_))
        throw ProtocolError(
            fmt::format("rank {}: malformed quorum DECIDE from rank 0 ({} bytes, "
                        "expected {})",
                        rank_, decide_req_->bytes, decide_size(world_)));
      std::vector<char> msg = decide_buf_;
      ++decide_in_next_;
      post_decide_recv(ep);
      apply_decide(ep, msg);
      moved = true;
    }
    return moved;
  }

  void apply_decide(net::Endpoint& ep, const std::vector<char>& msg) {
    DecideHeader h;
    std::memcpy(&h, msg.data(), sizeof(h));
    if (h.magic != kDecideMagic || h.version != kWireVersion || int(h.world) != world_)
      throw ProtocolError(
          fmt::format("rank {}: malformed quorum DECIDE (magic {:#x}, version {}, "
                      "world {})",
                      rank_, h.magic, h.version, h.world));
    const uint64_t t = h.step;
    awaiting_decide_.erase(t);
    const auto* bitmap = reinterpret_cast<const uint8_t*>(msg.data() + sizeof(h));
    const auto* offs = reinterpret_cast<const int64_t*>(msg.data() + sizeof(h) +
                                                        (bitmap_bytes(world_) + 7) / 8 * 8);
    QuorumResult res;
    res.step = t;
    res.contributors.assign(bitmap, bitmap + bitmap_bytes(world_));
    std::vector<int> members;
    for (int r = 0; r < world_; ++r) {
      if ((bitmap[r / 8] >> (r % 8)) & 1)
        members.push_back(r);
      else
        res.dropped.push_back(r);
      res.ready_offsets_ms.push_back(offs[r] < 0 ? -1.0 : double(offs[r]) / 1000.0);
    }
    res.count = int(members.size());
    res.self_counted = res.contains(rank_);
    res.ready_ms = res.ready_offsets_ms[size_t(rank_)];
    res.decide_ms = double(h.decide_us) / 1000.0;

    if (h.status == uint8_t(DecideStatus::kTimeout)) {
      throw QuorumTimeout(
          fmt::format("rank {}: quorum step {} failed: only {} of {} ranks contributed within "
                      "the hard deadline of {} ms (quorum {}); ranks that never contributed: {}",
                      rank_, t, res.count, world_, o_.deadline.count(), o_.quorum, res.dropped),
          res.dropped);
    }
    if (h.status == uint8_t(DecideStatus::kMismatch)) {
      throw UsageError(
          fmt::format("rank {}: quorum step {}: rank {} contributed {} elements, "
                      "the others {}",
                      rank_, t, h.bad_rank, h.bad_count, count_));
    }
    if (h.status != uint8_t(DecideStatus::kOk) || res.count == 0)
      throw ProtocolError(fmt::format("rank {}: quorum DECIDE with status {}, {} contributors",
                                      rank_, h.status, res.count));

    void* buf = nullptr;
    std::function<void(uint64_t)> cb;
    bool spec = false, finished = false;
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      StepLocal& s = sh_->steps[t];
      spec = s.ring_finished || rings_.count(t);
      if (spec && res.count != world_)
        throw ProtocolError(fmt::format(
            "rank {}: quorum step {} decided {} of {} contributors with quorum = world", rank_, t,
            res.count, world_));
      s.decided = true;
      double reduce_ms = s.result.reduce_ms;
      s.result = res;
      if (s.ring_finished) {
        s.result.reduce_ms = reduce_ms;
        s.done = finished = true;
      }
      if (res.self_counted) {
        if (!s.contributed)
          throw ProtocolError(
              fmt::format("rank {}: counted in step {} without contributing", rank_, t));
        buf = s.buf;
      } else {
        s.excluded = true;
        s.late_result.assign(count_ * esz_, 0);
        buf = s.late_result.data();
        cb = sh_->on_excluded;
      }
    }
    // Every rank applies every DECIDE in step order, so all switch to speculation together.
    if (o_.quorum == world_) speculate_ = true;
    if (finished) sh_->cv.notify_all();
    if (cb) cb(t);
    if (spec) return;
    if (res.self_counted) {
      start_ring(ep, t, buf, members, /*speculative=*/false);
    } else {
      int from = members[size_t(rank_) % members.size()];
      auto req =
          ep.irecv(from, net::make_tag(net::Op::kQuorumResult, t, chunk(0)), buf, count_ * esz_);
      result_recvs_[t] = ResultRecv{req, from, Clock::now()};
    }
  }

  bool advance_rings(net::Endpoint& ep) {
    bool moved = false;
    for (auto it = rings_.begin(); it != rings_.end();) {
      Ring& ring = it->second;
      moved |= ring.op->advance(ep);
      if (!ring.op->finished()) {
        ++it;
        continue;
      }
      const uint64_t t = it->first;
      double reduce_ms = ms_between(ring.started, Clock::now());
      // Serve the ranks outside S(t) assigned to this member, from a staging copy so the
      // caller gets its buffer back now even if a late rank is slow to take the result.
      std::vector<int> targets;
      size_t k = ring.members.size();
      for (int x = 0; x < world_; ++x) {
        if (std::find(ring.members.begin(), ring.members.end(), x) != ring.members.end()) continue;
        if (ring.members[size_t(x) % k] == rank_) targets.push_back(x);
      }
      {
        std::lock_guard<std::mutex> lock(sh_->mu);
        StepLocal& s = sh_->steps[t];
        if (!targets.empty()) {
          auto staged = std::make_shared<std::vector<char>>(
              static_cast<char*>(s.buf), static_cast<char*>(s.buf) + count_ * esz_);
          for (int x : targets) {
            auto req = ep.isend(x, net::make_tag(net::Op::kQuorumResult, t, chunk(0)),
                                staged->data(), staged->size());
            sends_.push_back({req, nullptr, staged});
          }
        }
        s.result.reduce_ms = reduce_ms;
        if (s.decided)
          s.done = true;
        else
          s.ring_finished = true;  // speculative: the DECIDE completes the step
      }
      sh_->cv.notify_all();
      it = rings_.erase(it);
      moved = true;
    }
    return moved;
  }

  bool poll_results() {
    bool moved = false;
    for (auto it = result_recvs_.begin(); it != result_recvs_.end();) {
      if (!it->second.req->done()) {
        ++it;
        continue;
      }
      net::throw_if_failed(*it->second.req, "quorum result receive");
      {
        std::lock_guard<std::mutex> lock(sh_->mu);
        sh_->steps[it->first].done = true;
      }
      sh_->cv.notify_all();
      it = result_recvs_.erase(it);
      moved = true;
    }
    return moved;
  }

  bool reap_sends() {
    size_t before = sends_.size();
    while (!sends_.empty() && sends_.front().req->done()) {
      net::throw_if_failed(*sends_.front().req, "quorum send");
      sends_.pop_front();
    }
    // Sends to a slow peer may hold the queue head; sweep the rest too.
    for (auto it = sends_.begin(); it != sends_.end();) {
      if (it->req->done() && it->req->ok())
        it = sends_.erase(it);
      else
        ++it;
    }
    return sends_.size() != before;
  }

  void check_deadlines() {
    auto now = Clock::now();
    if (rank_ != 0) {
      // The coordinator decides by (first contribution + H); ours came after the first.
      std::lock_guard<std::mutex> lock(sh_->mu);
      for (auto& [t, s] : sh_->steps) {
        if (s.contributed && !s.decided &&
            now > s.contrib_time + o_.deadline + std::chrono::seconds(2))
          throw QuorumTimeout(fmt::format("rank {}: quorum step {}: no decision from the "
                                          "coordinator (rank 0) within {} ms of contributing",
                                          rank_, t, o_.deadline.count() + 2000),
                              {0});
      }
    }
    for (auto& [t, ring] : rings_) {
      // A speculative ring starts before the coordinator's clock (first READY + H) does:
      // leave the coordinator time to report a QuorumTimeout first.
      auto limit = o_.deadline + (ring.speculative ? std::chrono::milliseconds(2000)
                                                   : std::chrono::milliseconds(0));
      if (now > ring.started + limit)
        throw CollectiveTimeout(fmt::format(
            "rank {}: quorum step {}: the ring reduction among {} timed out after {} ms waiting "
            "for {}",
            rank_, t, ring.members, limit.count(), ring.op->waiting_on()));
    }
    for (auto& [t, rr] : result_recvs_) {
      if (now > rr.started + o_.deadline)
        throw QuorumTimeout(fmt::format("rank {}: quorum step {}: the result from rank {} did not "
                                        "arrive within {} ms",
                                        rank_, t, rr.from, o_.deadline.count()),
                            {rr.from});
    }
  }

  Engine& engine_;
  CommOptions copts_;
  size_t count_;
  QuorumOptions o_;
  std::shared_ptr<QuorumAllreduce::Shared> sh_;
  int rank_, world_;
  size_t esz_;
  uint32_t instance_;
  bool finished_ = false, dead_ = false;
  Clock::time_point drain_deadline_{};
  // Coordinator.
  struct ReadyIn {
    ReadyMsg msg{};
    net::RequestPtr req;
    uint64_t next = 0;  // number of the next READY expected from this peer
  };
  std::vector<ReadyIn> ready_in_;
  uint64_t decide_out_next_ = 0;
  std::map<uint64_t, CoordStep> coord_;
  std::set<uint64_t> decided_;
  std::map<uint64_t, Clock::time_point> first_times_;
  uint64_t low_water_ = 0;
  // Everyone.
  std::vector<char> decide_buf_;
  net::RequestPtr decide_req_;
  uint64_t decide_in_next_ = 0;
  uint64_t ready_out_next_ = 0;
  bool speculate_ = false;  // quorum = world and a step was decided OK: start rings early
  std::set<uint64_t> awaiting_decide_;  // steps this rank contributed to, not decided yet
  std::deque<Send> sends_;
  std::map<uint64_t, Ring> rings_;
  std::map<uint64_t, ResultRecv> result_recvs_;
};

}  // namespace

QuorumAllreduce::QuorumAllreduce(Communicator& comm, size_t count, QuorumOptions opts)
    : comm_(comm), count_(count), opts_(opts), shared_(std::make_shared<Shared>()) {
  const int w = comm.size();
  if (opts_.quorum == 0) opts_.quorum = w;
  if (opts_.quorum < 1 || opts_.quorum > w)
    throw ConfigError(fmt::format("quorum {} out of range [1, {}]", opts_.quorum, w));
  if (opts_.grace.count() < 0) throw ConfigError("quorum grace must be >= 0");
  if (opts_.deadline.count() <= 0) throw ConfigError("quorum hard deadline must be > 0");
  if (opts_.deadline <= opts_.grace)
    throw ConfigError(fmt::format("quorum hard deadline ({} ms) must exceed the grace ({} ms)",
                                  opts_.deadline.count(), opts_.grace.count()));
  if (opts_.late == LatePolicy::kCarry) carry_.assign(count * dtype_size(opts_.type), 0);
  if (w > (1 << 16))
    throw ConfigError(fmt::format("the quorum all-reduce supports up to 65536 ranks, not {}", w));
  auto op = std::make_unique<QuorumService>(comm.engine(), comm.options(), count, opts_, shared_,
                                            comm.next_seq());
  op->deadline = Clock::time_point::max();
  service_ = comm.submit(std::move(op));
}

QuorumAllreduce::~QuorumAllreduce() {
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->shutdown = true;
  }
  comm_.engine().kick();
  try {
    // The service drains its sends for at most 2 s; never throw from a destructor.
    auto until = Clock::now() + std::chrono::seconds(5);
    while (!service_->done() && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!service_->done())
      spdlog::warn("rank {}: quorum service did not stop in 5 s", comm_.rank());
  } catch (...) {
  }
}

void QuorumAllreduce::on_excluded(std::function<void(uint64_t)> cb) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->on_excluded = std::move(cb);
}

bool QuorumAllreduce::excluded(uint64_t step) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  auto it = shared_->steps.find(step);
  return it != shared_->steps.end() && it->second.excluded;
}

std::map<uint64_t, std::vector<double>> QuorumAllreduce::arrival_log() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->arrivals;
}

// While this rank waits anyway, it drives the engine itself for a bounded time (the decision
// and the ring then progress without engine wake-ups), then leaves the rest to the engine
// thread: a long wait for stragglers costs no CPU.
void QuorumAllreduce::help_progress(uint64_t step) {
  Engine& engine = comm_.engine();
  auto finished = [&] {
    std::lock_guard<std::mutex> lock(shared_->mu);
    auto it = shared_->steps.find(step);
    return shared_->poison || (it != shared_->steps.end() && (it->second.done || it->second.error));
  };
  // Drive while anything moves (a ring in flight keeps this thread busy, without hand-offs);
  // after 2 ms without progress (waiting for a peer still computing) leave the step to the
  // engine thread and sleep, so a rank that waits does not take turns on the core with the
  // ranks that compute. Pure spinning only with a core per rank.
  engine.begin_help();
  const int spin = engine.oversubscribed_ ? 0 : 100;
  auto last = Clock::now();
  for (int i = 0;; ++i) {
    if (engine.try_progress()) {
      if (finished()) break;
      i = 0;
      last = Clock::now();
      continue;
    }
    if ((i & 15) == 15) {
      if (finished()) break;
      if (Clock::now() - last > std::chrono::milliseconds(2)) break;
    }
    if (i >= spin) sched_yield();
  }
  // Hand an unfinished step to the engine thread; a finished one needs no kick (the engine
  // reaps what is left on its next pass), only the wake-up end_help gives the last helper's
  // exit so that the engine looks after the quorum service again.
  engine.end_help(!finished());
}

std::vector<char> QuorumAllreduce::pending_carry() const {
  return carry_pending_ ? carry_ : std::vector<char>{};
}

void QuorumAllreduce::restore_carry(const std::vector<char>& bytes) {
  if (bytes.empty()) {
    carry_pending_ = false;
    return;
  }
  if (opts_.late != LatePolicy::kCarry || bytes.size() != carry_.size())
    throw UsageError(fmt::format("restore_carry: {} bytes for a carry buffer of {} (policy {})",
                                 bytes.size(), carry_.size(), to_string(opts_.late)));
  carry_ = bytes;
  carry_pending_ = true;
}

void QuorumAllreduce::contribute(uint64_t step, void* buf, size_t count) {
  if (count != count_)
    throw UsageError(
        fmt::format("rank {}: quorum step {}: contribution of {} elements, this "
                    "all-reduce was set up for {}",
                    comm_.rank(), step, count, count_));
  if (!buf && count) throw UsageError("quorum contribute: null buffer");
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: contribution for step {}, but step {} is next",
                                 comm_.rank(), step, next_step_));
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (shared_->poison) std::rethrow_exception(shared_->poison);
    if (service_->done()) throw UsageError("quorum all-reduce: the service has stopped");
    StepLocal& s = shared_->steps[step];
    if (s.contributed)
      throw UsageError(fmt::format("rank {}: step {} contributed twice", comm_.rank(), step));
  }
  if (carry_pending_) {
    reduce(buf, buf, carry_.data(), count_, opts_.type, RedOp::kSum);
    carry_pending_ = false;
  }
  have_next_ = true;
  next_step_ = step;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    StepLocal& s = shared_->steps[step];
    s.buf = buf;
    s.contributed = true;
    s.contrib_time = Clock::now();
    shared_->ready_events.push_back(step);
  }
  // Send READY (and start a speculative ring) from this thread when the engine is free;
  // wake the engine thread only when it is busy elsewhere and might not look soon.
  if (!comm_.engine().try_progress()) comm_.engine().kick();
}

QuorumResult QuorumAllreduce::wait(uint64_t step, void* out) {
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: wait for step {}, but step {} is next", comm_.rank(),
                                 step, next_step_));
  if (!out && count_) throw UsageError("quorum wait: null output buffer");
  auto t0 = Clock::now();
  help_progress(step);
  std::unique_lock<std::mutex> lock(shared_->mu);
  StepLocal& s = shared_->steps[step];
  // Last-resort guard; the engine enforces the finer deadlines and reports them first.
  auto guard = (s.contributed ? s.contrib_time : t0) + 2 * opts_.deadline + std::chrono::seconds(5);
  while (!s.done && !s.error && !shared_->poison) {
    if (shared_->cv.wait_until(lock, guard) == std::cv_status::timeout && !s.done) {
      auto e = std::make_exception_ptr(QuorumTimeout(
          fmt::format("rank {}: quorum step {}: no result within {} ms", comm_.rank(), step,
                      std::chrono::duration_cast<std::chrono::milliseconds>(guard - t0).count()),
          {0}));
      lock.unlock();
      shared_->fail(e);
      std::rethrow_exception(e);
    }
  }
  if (s.error) std::rethrow_exception(s.error);
  if (!s.done && shared_->poison) std::rethrow_exception(shared_->poison);
  QuorumResult res = std::move(s.result);
  const size_t bytes = count_ * dtype_size(opts_.type);
  if (s.excluded) {
    if (s.contributed && opts_.late == LatePolicy::kCarry) {
      // The late gradient (with anything carried into it) counts in the next contribution.
      std::memcpy(carry_.data(), s.buf, bytes);
      carry_pending_ = true;
    }
    if (bytes) std::memcpy(out, s.late_result.data(), bytes);
  } else if (out != s.buf && bytes) {
    std::memcpy(out, s.buf, bytes);
  }
  shared_->steps.erase(step);
  lock.unlock();
  res.wait_ms = ms_between(t0, Clock::now());
  have_next_ = true;
  next_step_ = step + 1;
  return res;
}

}  // namespace qring::collectives
