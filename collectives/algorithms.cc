#include "collectives/algorithms.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/reduce.h"
#include "collectives/shape.h"
#include "net/base/error.h"

namespace qring::collectives {

namespace {

// A CPU of this host copies every byte (shm, tcp: net::TransportTraits).
bool host_copies(const Engine& engine) {
  return engine.traits().host_copies;
}

// The ring's ranks in order (all of them unless args.members names a subset) and this rank's
// index among them.
std::pair<std::vector<int>, int> ring_and_index(const Engine& engine, const CollArgs& a) {
  std::vector<int> ring = a.members;
  if (ring.empty())
    for (int r = 0; r < engine.size(); ++r) ring.push_back(r);
  auto it = std::find(ring.begin(), ring.end(), engine.rank());
  if (it == ring.end())
    throw UsageError(fmt::format("rank {} is not a member of the ring", engine.rank()));
  const int me = static_cast<int>(it - ring.begin());
  return {std::move(ring), me};
}

// Segments in flight per link (lanes); 0 = by the transport. Where a CPU of this host copies
// every byte (TransportTraits::host_copies), the rank that reduces a segment is the one that
// copies the next, so lanes buy no overlap, only more messages in flight: one lane. RDMA
// providers move data while the CPU reduces: 4 lanes. Measurements: docs/benchmarks.md, "The
// numbers behind the defaults".
int segments_in_flight_for(const CommOptions& opts, const Engine& engine) {
  if (opts.segments_in_flight > 0) return opts.segments_in_flight;
  return host_copies(engine) ? 1 : 4;
}

// Segment size; 0 = by the transport. Where the host copies, a lane walks its segment
// through every stage before it takes the next one (one lane, above), so each segment costs
// 2(n-1) steps that each wait for a neighbour, and on an oversubscribed node for it to be
// scheduled: fewer, larger segments (2 MiB). RDMA providers pipeline several lanes: 1 MiB.
// Segmenting never changes which values are added in which order, so the bits do not depend
// on it. Measurements: docs/benchmarks.md, "The numbers behind the defaults".
size_t segment_bytes_for(const CommOptions& opts, const Engine& engine) {
  return segment_bytes(opts, engine.traits());
}

// Ring sends outstanding per link; 0 = by the transport and placement. On an oversubscribed
// node (more ranks than cores) where the host copies, a send posted while the neighbour
// still copies the previous one only costs cycles: over shm the sender spins on the lock of
// the receiver's region, which the receiver holds while it copies (CMA), and when the
// receiver is preempted that spin lasts until it runs again: one send at a time. With a
// core per rank the receiver is running and the spin is short, while more sends in flight
// keep it copying: no limit, as for RDMA providers, which pipeline sends in the NIC.
// Measurements: docs/benchmarks.md, "The numbers behind the defaults".
size_t sends_for(const CommOptions& opts, const Engine& engine) {
  if (opts.sends_in_flight > 0) return size_t(opts.sends_in_flight);
  if (engine.oversubscribed() && host_copies(engine)) return 1;
  return std::numeric_limits<size_t>::max();
}

// The descriptor of a ring-family op (shape.h): every rank of the ring computes the same one
// from the same call.
uint64_t coll_shape(const CollArgs& a, Algo algo) {
  Shape s;
  s.kind = a.tag_op;
  s.algo = algo;
  s.type = a.type;
  s.op = a.kind == CollKind::kAllgather ? RedOp::kSum : a.op;
  s.count = a.count;
  s.extra = members_hash(a.members);
  return encode_shape(s);
}

// Drops the completed sends at the front (rethrowing a failure); true if any was dropped.
bool drain_sends(std::deque<net::RequestPtr>& sends, const std::string& what) {
  bool any = false;
  while (!sends.empty() && sends.front()->done()) {
    net::throw_if_failed(*sends.front(), what);
    sends.pop_front();
    any = true;
  }
  return any;
}

void cancel_pending(net::Endpoint& ep, const std::vector<net::RequestPtr>& recvs) {
  for (const auto& rv : recvs)
    if (rv && !rv->done()) ep.cancel(rv);
}

// An abandoned op discards at most this many messages it still expected: the earliest ones,
// which are those a peer can have sent (each of its sends waits for the one before it to be
// received, up to a few in flight).
constexpr size_t kMaxDiscards = 256;

// A receive an abandoned op still expected: not posted, or cancelled by abort().
bool unreceived(const net::RequestPtr& rv) {
  return !rv || rv->state == net::RequestState::kCancelled;
}

template <typename Container>
bool pending(const Container& reqs) {
  for (const auto& r : reqs)
    if (r && !r->done()) return true;
  return false;
}

struct Stage {
  int send_chunk;
  int recv_chunk;
  bool reduce;
  bool send_from_input;  // stage 0 of a reduce-scatter sends the caller's input
  bool final_reduce;     // this stage completes a chunk: apply avg scaling
};

class RingOp final : public EngineOp {
 public:
  RingOp(Engine& engine, const CommOptions& opts, const CollArgs& a) : engine_(engine), args_(a) {
    elem_ = dtype_size(a.type);
    auto [ring, me] = ring_and_index(engine, a);
    n_ = static_cast<int>(ring.size());
    r_ = me;
    left_ = ring[size_t(ring_index(r_ - 1, n_))];
    right_ = ring[size_t(ring_index(r_ + 1, n_))];
    seg_elems_ = std::max<size_t>(1, segment_bytes_for(opts, engine) / elem_);
    segments_in_flight_ = segments_in_flight_for(opts, engine);
    max_sends_ = sends_for(opts, engine);
    threads_ = engine.reduce_threads();
    total_ = a.kind == CollKind::kAllreduce ? a.count : a.count * size_t(n_);
    shape_ = coll_shape(a, Algo::kRing);
    build_stages();
  }

  uint64_t shape() const override { return shape_; }

  std::string name() const override {
    switch (args_.kind) {
      case CollKind::kAllreduce:
        return "allreduce";
      case CollKind::kReduceScatter:
        return "reduce_scatter";
      case CollKind::kAllgather:
        return "allgather";
    }
    return "ring";
  }

  void start(net::Endpoint& ep) override {
    const char* in = static_cast<const char*>(args_.send);
    switch (args_.kind) {
      case CollKind::kAllreduce:
        out_ = static_cast<char*>(args_.recv);
        break;
      case CollKind::kReduceScatter:
        // Work in a full-size scratch buffer; the own block is copied out at the end.
        work_ = engine_.scratch(total_ * elem_);
        out_ = work_.data();
        break;
      case CollKind::kAllgather:
        out_ = static_cast<char*>(args_.recv);
        if (args_.count && out_ + off(r_) * elem_ != in)
          std::memmove(out_ + off(r_) * elem_, in, args_.count * elem_);
        break;
    }
    in_ = args_.kind == CollKind::kAllgather ? out_ : in;
    in_place_ = args_.kind == CollKind::kAllreduce && args_.send == args_.recv;
    if (n_ == 1 || total_ == 0) {
      if (args_.kind == CollKind::kAllreduce && !in_place_ && total_)
        std::memcpy(out_, in_, total_ * elem_);
      if (args_.kind == CollKind::kReduceScatter && total_)
        std::memcpy(args_.recv, args_.send, total_ * elem_);
      done_ = true;
      return;
    }
    size_t max_chunk = chunk_length(total_, n_, 0);
    nseg_ = (max_chunk + seg_elems_ - 1) / seg_elems_;
    if (nseg_ > net::kChunkMask / (stages_.size() + 1))
      throw UsageError(
          fmt::format("{}: {} segments per chunk is too many; raise segment_bytes", name(), nseg_));
    lanes_.resize(std::min<size_t>(size_t(segments_in_flight_), nseg_));
    depth_ = std::min(kPrepost, stages_.size());
    if (in_place_) {
      tmp_lease_ = engine_.scratch(lanes_.size() * depth_ * seg_elems_ * elem_);
      tmp_ = tmp_lease_.data();
    }
    for (size_t i = 0; i < lanes_.size(); ++i) {
      lanes_[i].seg = next_seg_++;
      lanes_[i].slot = i;
      lanes_[i].recvs.resize(stages_.size());
      lanes_[i].recv_ptrs.resize(stages_.size());
      begin_segment(ep, lanes_[i]);
    }
  }

  bool advance(net::Endpoint& ep) override {
    if (done_) return false;
    bool moved = false;
    for (auto& lane : lanes_) {
      // A lane moves on once its receive is in; its send may still be completing (kept in
      // sends_ until done). Nothing overwrites a sent segment before the neighbour got it:
      // the data that does causally depends on that neighbour having received it.
      while (lane.active && (!lane.recv() || lane.recv()->done())) {
        if (lane.recv())
          check_message(*lane.recv(), shape_, ep.data_bytes(), engine_.rank(), name(), seq, left_);
        finish_stage(lane);
        lane.recvs[lane.stage].reset();
        moved = true;
        if (++lane.stage < stages_.size()) {
          post_recv(ep, lane, lane.stage + depth_ - 1);
          post_send(ep, lane);
        } else if (next_seg_ < nseg_) {
          lane.seg = next_seg_++;
          begin_segment(ep, lane);
        } else {
          lane.active = false;
          ++lanes_done_;
        }
      }
    }
    if (flush_sends(ep)) moved = true;
    if (lanes_done_ == lanes_.size() && sends_.empty() && unsent_.empty()) {
      if (args_.kind == CollKind::kReduceScatter)
        std::memcpy(args_.recv, out_ + off(r_) * elem_, args_.count * elem_);
      done_ = true;
    }
    return moved;
  }

  bool finished() const override { return done_; }

  void abort(net::Endpoint& ep) override {
    for (const auto& lane : lanes_) cancel_pending(ep, lane.recvs);
    unsent_.clear();
  }
  // The left neighbour's messages still expected: each active lane's remaining stages, then
  // the segments no lane has started.
  void abandon(net::Endpoint& ep, Deadline until) override {
    abort(ep);
    if (done_) return;
    size_t n = 0;
    auto expect = [&](size_t seg_index, size_t stage, const net::RequestPtr& rv) {
      auto [rb, rn] = seg(stages_[stage].recv_chunk, seg_index);
      if (!rn || !unreceived(rv) || n >= kMaxDiscards) return;
      ep.discard(left_, net::make_tag(args_.tag_op, seq, stage * nseg_ + seg_index), rn * elem_,
                 until);
      ++n;
    };
    for (const auto& lane : lanes_)
      if (lane.active)
        for (size_t st = lane.stage; st < stages_.size(); ++st) expect(lane.seg, st, lane.recvs[st]);
    for (size_t j = next_seg_; j < nseg_; ++j)
      for (size_t st = 0; st < stages_.size(); ++st) expect(j, st, nullptr);
  }
  bool holds_buffers() const override { return pending(sends_); }

  std::string waiting_on() const override {
    for (const auto& lane : lanes_) {
      if (!lane.active) continue;
      if (lane.recv() && !lane.recv()->done())
        return fmt::format("receive from rank {} (stage {}, segment {})", left_, lane.stage,
                           lane.seg);
    }
    if (!sends_.empty()) return fmt::format("earlier sends to rank {} to complete", right_);
    return "nothing (finishing)";
  }

 private:
  // Receives are posted up to kPrepost stages ahead of the stage a lane is in, so a
  // neighbour's segment usually finds its buffer posted: over tcp;ofi_rxm an eager message
  // without a posted receive is read into a temporary buffer and copied again later.
  static constexpr size_t kPrepost = 3;

  struct Lane {
    size_t seg = 0;
    size_t slot = 0;
    size_t stage = 0;
    bool active = true;
    std::vector<net::RequestPtr> recvs;  // by stage; posted ahead
    std::vector<char*> recv_ptrs;        // by stage
    const net::RequestPtr& recv() const { return recvs[stage]; }
  };

  size_t off(int c) const {
    return args_.kind == CollKind::kAllreduce ? chunk_offset(total_, n_, c)
                                              : size_t(c) * args_.count;
  }
  size_t len(int c) const {
    return args_.kind == CollKind::kAllreduce ? chunk_length(total_, n_, c) : args_.count;
  }
  // Segment j of chunk c: [begin, begin + n) elements of the whole buffer.
  std::pair<size_t, size_t> seg(int c, size_t j) const {
    size_t l = len(c), b = j * seg_elems_;
    if (b >= l) return {off(c), 0};
    return {off(c) + b, std::min(seg_elems_, l - b)};
  }

  void build_stages() {
    const int n = n_, r = r_;
    if (args_.kind == CollKind::kAllreduce || args_.kind == CollKind::kReduceScatter) {
      int shift = args_.kind == CollKind::kReduceScatter ? 1 : 0;
      for (int s = 0; s < n - 1; ++s)
        stages_.push_back({ring_index(r - s - shift, n), ring_index(r - s - 1 - shift, n), true,
                           s == 0, s == n - 2});
    }
    if (args_.kind == CollKind::kAllreduce) {
      for (int s = 0; s < n - 1; ++s)
        stages_.push_back({ring_index(r + 1 - s, n), ring_index(r - s, n), false, false, false});
    }
    if (args_.kind == CollKind::kAllgather) {
      for (int s = 0; s < n - 1; ++s)
        stages_.push_back({ring_index(r - s, n), ring_index(r - s - 1, n), false, false, false});
    }
  }

  uint64_t tag(const Lane& lane, size_t stage) const {
    return net::make_tag(args_.tag_op, seq, stage * nseg_ + lane.seg);
  }

  // Stage 0 of the lane's segment: receives for the first depth_ stages, then the first send.
  void begin_segment(net::Endpoint& ep, Lane& lane) {
    lane.stage = 0;
    for (size_t t = 0; t < depth_; ++t) post_recv(ep, lane, t);
    post_send(ep, lane);
  }

  void post_recv(net::Endpoint& ep, Lane& lane, size_t stage) {
    if (stage >= stages_.size()) return;
    const Stage& st = stages_[stage];
    auto [rb, rn] = seg(st.recv_chunk, lane.seg);
    lane.recvs[stage].reset();
    if (!rn) return;
    char* p = (st.reduce && in_place_)
                  ? tmp_ + ((lane.slot * depth_ + stage % depth_) * seg_elems_) * elem_
                  : out_ + rb * elem_;
    lane.recv_ptrs[stage] = p;
    lane.recvs[stage] = ep.irecv(left_, tag(lane, stage), p, rn * elem_);
  }

  void post_send(net::Endpoint& ep, Lane& lane) {
    const Stage& st = stages_[lane.stage];
    auto [sb, sn] = seg(st.send_chunk, lane.seg);
    if (!sn) return;
    const char* src = (st.send_from_input ? in_ : out_) + sb * elem_;
    unsent_.push_back({src, sn * elem_, tag(lane, lane.stage)});
    flush_sends(ep);
  }

  // Drops completed sends, then posts queued ones up to max_sends_ outstanding; true if
  // either happened.
  bool flush_sends(net::Endpoint& ep) {
    bool any = false;
    while (true) {
      any |= drain_sends(sends_, name());  // a send may complete as it is posted
      if (unsent_.empty() || sends_.size() >= max_sends_) return any;
      const Unsent& u = unsent_.front();
      sends_.push_back(ep.isend(right_, u.tag, u.src, u.bytes, shape_));
      unsent_.pop_front();
      any = true;
    }
  }

  void finish_stage(Lane& lane) {
    const Stage& st = stages_[lane.stage];
    if (!st.reduce || !lane.recv()) return;
    auto [rb, rn] = seg(st.recv_chunk, lane.seg);
    char* dst = out_ + rb * elem_;
    const char* mine = in_ + rb * elem_;
    if (in_place_)
      reduce(dst, dst, lane.recv_ptrs[lane.stage], rn, args_.type, args_.op, threads_);
    else
      reduce(dst, dst, mine, rn, args_.type, args_.op, threads_);
    if (st.final_reduce && args_.op == RedOp::kAvg) scale_avg(dst, rn, args_.type, n_);
  }

  Engine& engine_;
  CollArgs args_;
  int n_, r_, left_, right_;
  size_t elem_, seg_elems_, total_;
  int segments_in_flight_, threads_;
  std::vector<Stage> stages_;
  const char* in_ = nullptr;
  char* out_ = nullptr;
  char* tmp_ = nullptr;
  Engine::Lease work_, tmp_lease_;
  bool in_place_ = false;
  size_t nseg_ = 0, next_seg_ = 0, lanes_done_ = 0, depth_ = 1;
  std::vector<Lane> lanes_;
  std::deque<net::RequestPtr> sends_;  // sends of finished stages still completing
  struct Unsent {
    const char* src;
    size_t bytes;
    uint64_t tag;
  };
  std::deque<Unsent> unsent_;
  size_t max_sends_;
  uint64_t shape_ = 0;
  bool done_ = false;
};

// Recursive doubling for small all-reduces: log2(p) exchange rounds instead of the ring's
// 2(n-1) stages. With p the largest power of two <= n, each extra rank p+i first hands its
// input to rank i (which reduces it in) and gets the final result back at the end. Partners
// reduce (mine op theirs) and (theirs op mine): the same bits, as + min max are commutative,
// so every rank ends bit-identical.
class RecursiveDoublingOp final : public EngineOp {
 public:
  RecursiveDoublingOp(Engine& engine, const CollArgs& a) : engine_(engine), args_(a) {
    std::tie(ring_, me_) = ring_and_index(engine, a);
    n_ = static_cast<int>(ring_.size());
    p_ = 1;
    while (p_ * 2 <= n_) p_ *= 2;
    elem_ = dtype_size(a.type);
    bytes_ = a.count * elem_;
    threads_ = engine.reduce_threads();
    shape_ = coll_shape(a, Algo::kRecursiveDoubling);
  }
  std::string name() const override { return "allreduce"; }
  uint64_t shape() const override { return shape_; }

  void start(net::Endpoint& ep) override {
    char* out = static_cast<char*>(args_.recv);
    if (out != args_.send && bytes_) std::memcpy(out, args_.send, bytes_);
    tmp_lease_ = engine_.scratch(std::max<size_t>(bytes_, 1));
    tmp_ = tmp_lease_.data();
    if (n_ == 1 || bytes_ == 0) {
      finish_avg();
      done_ = true;
      return;
    }
    if (me_ >= p_) {  // extra rank: hand over, then wait for the result
      phase_ = Phase::kExtraWait;
      send_ = ep.isend(ring_[size_t(me_ - p_)], tag(kHandOver), out, bytes_, shape_);
      recv_ = ep.irecv(ring_[size_t(me_ - p_)], tag(kGiveBack), out, bytes_);
      peer_ = me_ - p_;
      return;
    }
    if (me_ + p_ < n_) {  // absorb the extra rank's input first
      phase_ = Phase::kAbsorb;
      peer_ = me_ + p_;
      recv_ = ep.irecv(ring_[size_t(peer_)], tag(kHandOver), tmp_, bytes_);
      return;
    }
    begin_round(ep);
  }

  bool advance(net::Endpoint& ep) override {
    if (done_) return false;
    if ((recv_ && !recv_->done()) || (send_ && !send_->done())) return false;
    if (recv_)
      check_message(*recv_, shape_, ep.data_bytes(), engine_.rank(), name(), seq,
                    ring_[size_t(peer_)]);
    if (send_) net::throw_if_failed(*send_, "allreduce");
    char* out = static_cast<char*>(args_.recv);
    switch (phase_) {
      case Phase::kExtraWait:
        done_ = true;
        break;
      case Phase::kAbsorb:
        reduce(out, out, tmp_, args_.count, args_.type, args_.op, threads_);
        recv_.reset();
        begin_round(ep);
        break;
      case Phase::kRounds:
        reduce(out, out, tmp_, args_.count, args_.type, args_.op, threads_);
        mask_ <<= 1;
        if (mask_ < p_) {
          begin_round(ep);
        } else {
          finish_avg();
          if (me_ + p_ < n_) {
            phase_ = Phase::kGiveBack;
            peer_ = me_ + p_;
            recv_.reset();
            send_ = ep.isend(ring_[size_t(peer_)], tag(kGiveBack), out, bytes_, shape_);
          } else {
            done_ = true;
          }
        }
        break;
      case Phase::kGiveBack:
        done_ = true;
        break;
    }
    return true;
  }

  bool finished() const override { return done_; }
  void abort(net::Endpoint& ep) override {
    if (recv_ && !recv_->done()) ep.cancel(recv_);
  }
  // The messages still expected: the current receive if it got nothing, then the later
  // rounds' (an extra rank: only the result it waits for).
  void abandon(net::Endpoint& ep, Deadline until) override {
    abort(ep);
    if (done_ || n_ == 1 || bytes_ == 0) return;
    const bool current = recv_ && recv_->state == net::RequestState::kCancelled;
    switch (phase_) {
      case Phase::kExtraWait:
        if (current) ep.discard(ring_[size_t(me_ - p_)], tag(99), bytes_, until);
        return;
      case Phase::kGiveBack:
        return;
      case Phase::kAbsorb:
        if (current) ep.discard(ring_[size_t(peer_)], tag(0), bytes_, until);
        for (int m = mask_; m < p_; m <<= 1)
          ep.discard(ring_[size_t(me_ ^ m)], tag(round_of(m)), bytes_, until);
        return;
      case Phase::kRounds:
        for (int m = mask_; m < p_; m <<= 1)
          if (m != mask_ || current)
            ep.discard(ring_[size_t(me_ ^ m)], tag(round_of(m)), bytes_, until);
        return;
    }
  }
  bool holds_buffers() const override { return send_ && !send_->done(); }
  std::string waiting_on() const override {
    if (recv_ && !recv_->done())
      return fmt::format("receive from rank {} (recursive doubling, mask {})", ring_[size_t(peer_)],
                         mask_);
    return fmt::format("send to rank {} to complete", ring_[size_t(peer_)]);
  }

 private:
  enum class Phase { kAbsorb, kRounds, kGiveBack, kExtraWait };
  // Chunk numbers of the tags: rounds are 1 .. log2(p); an extra rank's input goes to its
  // partner as kHandOver and the result comes back as kGiveBack (above every round).
  static constexpr uint64_t kHandOver = 0;
  static constexpr uint64_t kGiveBack = 99;
  uint64_t tag(uint64_t chunk) const { return net::make_tag(args_.tag_op, seq, chunk); }
  // The tag chunk of the exchange round at distance `mask` (1, 2, 4, ... -> 1, 2, 3, ...).
  static uint64_t round_of(int mask) {
    uint64_t round = 1;
    for (int m = mask; m > 1; m >>= 1) ++round;
    return round;
  }
  void begin_round(net::Endpoint& ep) {
    phase_ = Phase::kRounds;
    peer_ = me_ ^ mask_;
    recv_ = ep.irecv(ring_[size_t(peer_)], tag(round_of(mask_)), tmp_, bytes_);
    send_ = ep.isend(ring_[size_t(peer_)], tag(round_of(mask_)), args_.recv, bytes_, shape_);
  }
  void finish_avg() {
    if (args_.op == RedOp::kAvg && n_ > 1)
      scale_avg(args_.recv, args_.count, args_.type, n_);
  }

  Engine& engine_;
  CollArgs args_;
  std::vector<int> ring_;
  int n_, me_, p_;
  size_t elem_, bytes_;
  int threads_;
  int mask_ = 1, peer_ = 0;
  Phase phase_ = Phase::kRounds;
  char* tmp_ = nullptr;
  Engine::Lease tmp_lease_;
  net::RequestPtr send_, recv_;
  uint64_t shape_ = 0;
  bool done_ = false;
};

// Rabenseifner's all-reduce for a power-of-two number of ranks p: a reduce-scatter by
// recursive halving (step k exchanges half of the range still held with the rank at distance
// p/2^(k+1), keeps and reduces one half), then an all-gather by recursive doubling (distances
// 1, 2, ..., p/2). Each rank sends 2(p-1)/p of the buffer like the ring, in 2 log2(p)
// dependent steps instead of 2(p-1). Each step's region goes as segment_bytes messages, all
// posted at once, and each received segment is reduced as it arrives; the receives of the
// next step are posted one step ahead. Block b (of p balanced blocks) ends up reduced at
// rank b alone and is copied from there, so every rank holds the same bits.
class HalvingDoublingOp final : public EngineOp {
 public:
  HalvingDoublingOp(Engine& engine, const CommOptions& opts, const CollArgs& a)
      : engine_(engine), args_(a) {
    std::tie(ring_, me_) = ring_and_index(engine, a);
    n_ = static_cast<int>(ring_.size());
    if (n_ & (n_ - 1))
      throw UsageError(fmt::format("halving-doubling all-reduce needs a power-of-two number of "
                                   "ranks, not {}",
                                   n_));
    for (int d = n_; d > 1; d >>= 1) ++log_;
    elem_ = dtype_size(a.type);
    seg_elems_ = std::max<size_t>(1, segment_bytes_for(opts, engine) / elem_);
    threads_ = engine.reduce_threads();
    shape_ = coll_shape(a, Algo::kHalvingDoubling);
  }
  std::string name() const override { return "allreduce"; }
  uint64_t shape() const override { return shape_; }

  void start(net::Endpoint& ep) override {
    out_ = static_cast<char*>(args_.recv);
    in_ = static_cast<const char*>(args_.send);
    in_place_ = args_.send == args_.recv;
    const size_t count = args_.count;
    if (n_ == 1 || count == 0) {
      if (!in_place_ && count) std::memcpy(out_, in_, count * elem_);
      done_ = true;
      return;
    }
    // The largest region a step receives is the first step's half (blocks [0, p/2) are the
    // largest by balanced chunking); it bounds the segments per step and the tags.
    const size_t half = block_off(n_ / 2);
    max_segs_ = (half + seg_elems_ - 1) / seg_elems_;
    if (max_segs_ * size_t(2 * log_) > net::kChunkMask)
      throw UsageError(fmt::format("allreduce: {} segments per step is too many; raise "
                                   "segment_bytes",
                                   max_segs_));
    // Reduce-scatter steps receive into scratch (double-buffered by step parity, as the next
    // step's receives are posted while this step still reduces), except the first step out
    // of place, which receives straight into the output.
    tmp_elems_ = half;
    tmp_lease_ = engine_.scratch(2 * tmp_elems_ * elem_);
    tmp_ = tmp_lease_.data();
    steps_.resize(size_t(2 * log_));
    int lo = 0, hi = n_;
    for (int k = 0; k < 2 * log_; ++k) {
      StepPlan& s = steps_[size_t(k)];
      if (k < log_) {
        int dist = n_ >> (k + 1), mid = (lo + hi) / 2;
        s.reduce = true;
        s.peer = me_ ^ dist;
        if (me_ & dist) {
          s.send_lo = lo, s.send_hi = mid, s.keep_lo = mid, s.keep_hi = hi;
        } else {
          s.send_lo = mid, s.send_hi = hi, s.keep_lo = lo, s.keep_hi = mid;
        }
        lo = s.keep_lo, hi = s.keep_hi;
      } else {
        int dist = 1 << (k - log_);
        s.reduce = false;
        s.peer = me_ ^ dist;
        s.send_lo = lo, s.send_hi = hi;
        if (me_ & dist) {
          s.keep_lo = lo - dist, s.keep_hi = lo;
          lo -= dist;
        } else {
          s.keep_lo = hi, s.keep_hi = hi + dist;
          hi += dist;
        }
      }
    }
    post_recvs(ep, 0);
    if (steps_.size() > 1) post_recvs(ep, 1);
    post_sends(ep, 0);
  }

  bool advance(net::Endpoint& ep) override {
    if (done_) return false;
    bool moved = false;
    while (step_ < steps_.size()) {
      StepPlan& s = steps_[step_];
      // Segments may complete out of order; those before first_pending are all done.
      for (size_t j = s.first_pending; j < s.recvs.size(); ++j) {
        auto& rv = s.recvs[j];
        if (!rv || !rv->done()) continue;
        check_message(*rv, shape_, ep.data_bytes(), engine_.rank(), name(), seq,
                      ring_[size_t(s.peer)]);
        if (s.reduce) reduce_segment(step_, j);
        rv.reset();
        moved = true;
      }
      while (s.first_pending < s.recvs.size() && !s.recvs[s.first_pending]) ++s.first_pending;
      if (s.first_pending < s.recvs.size()) break;
      // Step complete: the last reduce-scatter step finishes block me_ (avg scaling).
      if (step_ + 1 == size_t(log_) && args_.op == RedOp::kAvg) {
        size_t b = block_off(me_), e = block_off(me_ + 1);
        scale_avg(out_ + b * elem_, e - b, args_.type, n_);
      }
      for (auto& sd : s.sends) sends_.push_back(std::move(sd));
      s.sends.clear();
      ++step_;
      moved = true;
      if (step_ + 1 < steps_.size()) post_recvs(ep, step_ + 1);
      if (step_ < steps_.size()) post_sends(ep, step_);
    }
    if (drain_sends(sends_, name())) moved = true;
    if (step_ == steps_.size() && sends_.empty()) done_ = true;
    return moved;
  }

  bool finished() const override { return done_; }

  void abort(net::Endpoint& ep) override {
    for (const auto& s : steps_) cancel_pending(ep, s.recvs);
  }
  // The segments still expected from this and the later steps' partners.
  void abandon(net::Endpoint& ep, Deadline until) override {
    abort(ep);
    if (done_) return;
    size_t n = 0;
    for (size_t k = step_; k < steps_.size() && n < kMaxDiscards; ++k) {
      const StepPlan& s = steps_[k];
      size_t b = block_off(s.keep_lo), e = block_off(s.keep_hi);
      for (size_t j = 0, nseg = kept_segments(s); j < nseg && n < kMaxDiscards; ++j) {
        // Posted receives (this step's and the next one's) that completed were reset (null)
        // or are done; the later steps' are not posted yet.
        if (j < s.recvs.size() && !(s.recvs[j] && unreceived(s.recvs[j]))) continue;
        size_t len = std::min(seg_elems_, e - b - j * seg_elems_);
        ep.discard(ring_[size_t(s.peer)], tag(k, j), len * elem_, until);
        ++n;
      }
    }
  }
  bool holds_buffers() const override {
    for (const auto& s : steps_)
      if (pending(s.sends)) return true;
    return pending(sends_);
  }

  std::string waiting_on() const override {
    if (step_ < steps_.size())
      return fmt::format("receive from rank {} (halving-doubling step {} of {})",
                         ring_[size_t(steps_[step_].peer)], step_ + 1, steps_.size());
    if (!sends_.empty()) return "sends to complete (halving-doubling)";
    return "nothing (finishing)";
  }

 private:
  struct StepPlan {
    bool reduce = false;
    int peer = 0;
    int send_lo = 0, send_hi = 0, keep_lo = 0, keep_hi = 0;  // block ranges
    std::vector<net::RequestPtr> recvs, sends;
    std::vector<char*> recv_ptrs;
    size_t first_pending = 0;  // receives before this index are complete
  };

  size_t block_off(int b) const { return chunk_offset(args_.count, n_, b); }
  uint64_t tag(size_t step, size_t j) const {
    return net::make_tag(args_.tag_op, seq, step * max_segs_ + j);
  }

  // The segments step s receives: its kept region in segment_bytes pieces.
  size_t kept_segments(const StepPlan& s) const {
    return (block_off(s.keep_hi) - block_off(s.keep_lo) + seg_elems_ - 1) / seg_elems_;
  }

  void post_recvs(net::Endpoint& ep, size_t k) {
    StepPlan& s = steps_[k];
    size_t b = block_off(s.keep_lo), e = block_off(s.keep_hi);
    size_t nseg = kept_segments(s);
    s.recvs.resize(nseg);
    s.recv_ptrs.resize(nseg);
    const bool direct = !s.reduce || (k == 0 && !in_place_);
    char* base = direct ? out_ + b * elem_ : tmp_ + (k % 2) * tmp_elems_ * elem_;
    for (size_t j = 0; j < nseg; ++j) {
      size_t off = j * seg_elems_, len = std::min(seg_elems_, e - b - off);
      s.recv_ptrs[j] = base + off * elem_;
      s.recvs[j] = ep.irecv(ring_[size_t(s.peer)], tag(k, j), s.recv_ptrs[j], len * elem_);
    }
  }

  void post_sends(net::Endpoint& ep, size_t k) {
    StepPlan& s = steps_[k];
    size_t b = block_off(s.send_lo), e = block_off(s.send_hi);
    const char* src = (k == 0 ? in_ : out_) + b * elem_;
    for (size_t off = 0, j = 0; off < e - b; off += seg_elems_, ++j) {
      size_t len = std::min(seg_elems_, e - b - off);
      s.sends.push_back(
          ep.isend(ring_[size_t(s.peer)], tag(k, j), src + off * elem_, len * elem_, shape_));
    }
  }

  // dst = mine + theirs over segment j of step s's kept region; mine is the input at the
  // first step, the partial result in the output after.
  void reduce_segment(size_t k, size_t j) {
    const StepPlan& s = steps_[k];
    size_t b = block_off(s.keep_lo) + j * seg_elems_;
    size_t len = std::min(seg_elems_, block_off(s.keep_hi) - b);
    char* dst = out_ + b * elem_;
    const char* mine = (k == 0 ? in_ : out_) + b * elem_;
    reduce(dst, s.recv_ptrs[j], mine, len, args_.type, args_.op, threads_);
  }

  Engine& engine_;
  CollArgs args_;
  std::vector<int> ring_;
  int n_ = 1, me_ = 0, log_ = 0;
  size_t elem_ = 1, seg_elems_ = 1, max_segs_ = 1, tmp_elems_ = 0;
  int threads_ = 1;
  const char* in_ = nullptr;
  char* out_ = nullptr;
  char* tmp_ = nullptr;
  bool in_place_ = false;
  Engine::Lease tmp_lease_;
  std::vector<StepPlan> steps_;
  size_t step_ = 0;
  std::deque<net::RequestPtr> sends_;
  uint64_t shape_ = 0;
  bool done_ = false;
};

// Pipelined chain from the root: root → root+1 → ... → root+n-1, segment by segment.
class BroadcastOp final : public EngineOp {
 public:
  BroadcastOp(Engine& engine, const CommOptions& opts, void* buf, size_t count, DataType type,
              int root)
      : buf_(static_cast<char*>(buf)), n_(engine.size()), r_(engine.rank()), root_(root) {
    elem_ = dtype_size(type);
    bytes_ = count * elem_;
    seg_bytes_ = std::max<size_t>(elem_, segment_bytes_for(opts, engine) / elem_ * elem_);
    segments_in_flight_ = segments_in_flight_for(opts, engine);
    pos_ = ring_index(r_ - root_, n_);
    left_ = ring_index(r_ - 1, n_);
    right_ = ring_index(r_ + 1, n_);
    Shape sh;
    sh.kind = net::Op::kBroadcast;
    sh.algo = Algo::kChain;
    sh.type = type;
    sh.count = count;
    sh.extra = uint32_t(root);
    shape_ = encode_shape(sh);
  }
  std::string name() const override { return "broadcast"; }
  uint64_t shape() const override { return shape_; }
  void start(net::Endpoint& ep) override {
    nseg_ = (bytes_ + seg_bytes_ - 1) / seg_bytes_;
    if (n_ == 1 || nseg_ == 0) {
      done_ = true;
      return;
    }
    for (size_t i = 0; i < std::min<size_t>(size_t(segments_in_flight_), nseg_); ++i) start_seg(ep);
  }
  bool advance(net::Endpoint& ep) override {
    if (done_) return false;
    bool moved = false;
    for (auto& l : lanes_) {
      if (!l.active) continue;
      if (l.recv && l.recv->done() && !l.send && pos_ < n_ - 1) {
        check_message(*l.recv, shape_, ep.data_bytes(), r_, name(), seq, left_);
        auto [b, n] = range(l.seg);
        l.send = ep.isend(right_, tag(l.seg), buf_ + b, n, shape_);
        moved = true;
      }
      bool recv_ok = !l.recv || l.recv->done();
      bool send_ok = pos_ == n_ - 1 ? true : (l.send && l.send->done());
      if (recv_ok && send_ok) {
        if (l.recv) check_message(*l.recv, shape_, ep.data_bytes(), r_, name(), seq, left_);
        if (l.send) net::throw_if_failed(*l.send, "broadcast");
        l.active = false;
        ++segs_done_;
        moved = true;
      }
    }
    if (moved && next_seg_ < nseg_) {
      lanes_.erase(
          std::remove_if(lanes_.begin(), lanes_.end(), [](const L& l) { return !l.active; }),
          lanes_.end());
      while (lanes_.size() < size_t(segments_in_flight_) && next_seg_ < nseg_) start_seg(ep);
    }
    if (segs_done_ == nseg_) done_ = true;
    return moved;
  }
  bool finished() const override { return done_; }
  void abort(net::Endpoint& ep) override {
    for (auto& l : lanes_)
      if (l.recv && !l.recv->done()) ep.cancel(l.recv);
  }
  bool holds_buffers() const override {
    for (const auto& l : lanes_)
      if (l.send && !l.send->done()) return true;
    return false;
  }
  std::string waiting_on() const override {
    for (const auto& l : lanes_) {
      if (!l.active) continue;
      if (l.recv && !l.recv->done())
        return fmt::format("receive from rank {} (segment {})", left_, l.seg);
      return fmt::format("send to rank {} to complete (segment {})", right_, l.seg);
    }
    return "nothing (finishing)";
  }

 private:
  struct L {
    size_t seg = 0;
    bool active = true;
    net::RequestPtr recv, send;
  };
  uint64_t tag(size_t s) const { return net::make_tag(net::Op::kBroadcast, seq, s); }
  std::pair<size_t, size_t> range(size_t s) const {
    size_t b = s * seg_bytes_;
    return {b, std::min(seg_bytes_, bytes_ - b)};
  }
  void start_seg(net::Endpoint& ep) {
    L l;
    l.seg = next_seg_++;
    auto [b, n] = range(l.seg);
    if (pos_ == 0)
      l.send = ep.isend(right_, tag(l.seg), buf_ + b, n, shape_);
    else
      l.recv = ep.irecv(left_, tag(l.seg), buf_ + b, n);
    lanes_.push_back(std::move(l));
  }
  char* buf_;
  int n_, r_, root_, pos_, left_, right_;
  size_t elem_, bytes_, seg_bytes_;
  int segments_in_flight_;
  size_t nseg_ = 0, next_seg_ = 0, segs_done_ = 0;
  std::vector<L> lanes_;
  uint64_t shape_ = 0;
  bool done_ = false;
};

}  // namespace

size_t segment_bytes(const CommOptions& opts, const net::TransportTraits& traits) {
  if (opts.segment_bytes > 0) return opts.segment_bytes;
  return traits.host_copies ? size_t(2) << 20 : size_t(1) << 20;
}

size_t small_allreduce_bytes(const CommOptions& opts) {
  return opts.small_allreduce_bytes.value_or(kSmallAllreduceBytes);
}

size_t halving_doubling_bytes(const CommOptions& opts) {
  return opts.halving_doubling_bytes.value_or(kHalvingDoublingBytes);
}

const char* allreduce_algorithm(const CommOptions& opts, size_t bytes, size_t n) {
  if (bytes <= small_allreduce_bytes(opts)) return "rd";
  if ((n & (n - 1)) == 0 && bytes <= halving_doubling_bytes(opts)) return "hd";
  return "ring";
}

std::unique_ptr<EngineOp> make_collective_op(Engine& engine, const CommOptions& opts,
                                             const CollArgs& args) {
  if (args.kind == CollKind::kAllreduce) {
    const size_t bytes = args.count * dtype_size(args.type);
    const size_t n = args.members.empty() ? size_t(engine.size()) : args.members.size();
    const std::string_view algo = allreduce_algorithm(opts, bytes, n);
    if (algo == "rd") return std::make_unique<RecursiveDoublingOp>(engine, args);
    if (algo == "hd") return std::make_unique<HalvingDoublingOp>(engine, opts, args);
  }
  return std::make_unique<RingOp>(engine, opts, args);
}
std::unique_ptr<EngineOp> make_broadcast_op(Engine& engine, const CommOptions& opts, void* buf,
                                            size_t count, DataType type, int root) {
  return std::make_unique<BroadcastOp>(engine, opts, buf, count, type, root);
}

}  // namespace qring::collectives
