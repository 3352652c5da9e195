#include "collectives/quorum/step_runner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "collectives/algorithms.h"
#include "net/transport/tags.h"

namespace qring::collectives {

namespace {

// A step's reduction as the engine runs it: the collective op, and the caller's phase callback
// the first time it moves (QuorumOptions::on_phase: fault tests act mid-reduction there).
class ObservedOp final : public EngineOp {
 public:
  ObservedOp(std::unique_ptr<EngineOp> op, uint64_t step,
             std::function<void(uint64_t, const char*)> on_phase)
      : op_(std::move(op)), step_(step), on_phase_(std::move(on_phase)) {}
  bool advance(net::Endpoint& ep) override {
    const bool moved = op_->advance(ep);
    if (moved && on_phase_) {
      auto cb = std::move(on_phase_);
      on_phase_ = nullptr;
      cb(step_, "ring");
    }
    return moved;
  }
  bool finished() const override { return op_->finished(); }
  void abort(net::Endpoint& ep) override { op_->abort(ep); }
  void abandon(net::Endpoint& ep, Deadline until) override { op_->abandon(ep, until); }
  bool holds_buffers() const override { return op_->holds_buffers(); }
  std::string waiting_on() const override { return op_->waiting_on(); }
  std::string name() const override { return op_->name(); }
  uint64_t shape() const override { return op_->shape(); }
  void start(net::Endpoint& ep) override { op_->start(ep); }

 private:
  std::unique_ptr<EngineOp> op_;
  uint64_t step_;
  std::function<void(uint64_t, const char*)> on_phase_;
};

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

bool is_timeout(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveTimeout&) {
    return true;
  } catch (...) {
    return false;
  }
}

// The step's QuorumResult as the DECIDE gives it (reduce_ms and wait_ms come later).
QuorumResult result_of(const qproto::Decision& d, int rank, int world) {
  QuorumResult res;
  res.step = d.step;
  res.epoch = d.epoch;
  res.attempt = d.attempt;
  res.contributors.assign((size_t(world) + 7) / 8, 0);
  for (int r : d.contributors) res.contributors[size_t(r) / 8] |= uint8_t(1u << (r % 8));
  for (int r = 0; r < world; ++r) {
    if (!res.contains(r)) res.dropped.push_back(r);
    int64_t off = size_t(r) < d.offsets_us.size() ? d.offsets_us[size_t(r)] : -1;
    res.ready_offsets_ms.push_back(off < 0 ? -1.0 : double(off) / 1000.0);
  }
  res.count = int(d.contributors.size());
  res.quorum = d.quorum;
  res.self_counted = res.contains(rank);
  res.ready_ms = res.ready_offsets_ms[size_t(rank)];
  res.decide_ms = double(d.decide_us) / 1000.0;
  return res;
}

}  // namespace

StepRunner::StepRunner(Engine& engine, const CommOptions& copts, const QuorumOptions& o,
                       size_t count, uint32_t instance, bool tolerant, StepTable& steps,
                       Outbox& out)
    : engine_(engine),
      copts_(copts),
      o_(o),
      count_(count),
      esz_(dtype_size(o.type)),
      rank_(engine.rank()),
      world_(engine.size()),
      instance_(instance),
      tolerant_(tolerant),
      steps_(steps),
      out_(out),
      join_step_of_(size_t(engine.size()), 0) {}

void StepRunner::contributed(uint64_t t, const std::vector<int>& members) {
  if (!speculate_) return;
  // With quorum = world (no rank may be lost), S(t) can only be every rank, so once one step
  // has been decided OK (which proves every rank set this all-reduce up with the same count)
  // the reduction starts at contribute time, in parallel with READY/DECIDE, instead of a round
  // trip through the coordinator later. The step completes when both the reduction and the
  // DECIDE are in; a DECIDE that reports a timeout ends the all-reduce, its reduction with it.
  void* buf;
  {
    std::lock_guard<std::mutex> lock(steps_.mu);
    buf = steps_.steps[t].buf;
  }
  start_ring(t, 0, buf, nullptr, members, /*speculative=*/true);
}

void StepRunner::decided(net::Endpoint& ep, const qproto::Decision& d, int coordinator) {
  const uint64_t t = d.step;
  // Steps are decided in order: the first one this rank hears of is where its run starts (a
  // job resumed from a checkpoint does not start at 0).
  if (!started_) start_at(t);
  QuorumResult res = result_of(d, rank_, world_);
  throw_if_failed(d, res, coordinator);
  if (d.attempt > 0 && d.source >= 0 && !forward_held_result(ep, d)) return;
  if (d.attempt > 0 && done_.count(t))
    throw ProtocolError(
        fmt::format("rank {}: quorum step {} decided again after it completed here", rank_, t));
  Placed p;
  if (!settle(d, res, p)) return;  // skipped
  // Every rank applies every DECIDE in step order, so all switch to speculation together.
  if (!tolerant_ && o_.quorum == world_) speculate_ = true;
  if (p.finished) {
    steps_.cv.notify_all();
    mark_done(t, nullptr);
  }
  if (p.spec) return;
  if (d.attempt > 0 && d.source >= 0) {
    post_result_recv(ep, t, d.attempt, d.source, p.out);
  } else if (res.self_counted) {
    start_ring(t, d.attempt, p.buf, tolerant_ ? p.out->data() : nullptr, d.contributors,
               /*speculative=*/false);
  } else {
    post_result_recv(ep, t, d.attempt, d.contributors[size_t(rank_) % d.contributors.size()],
                     p.out);
  }
}

// A step that failed (timeout, or ranks that disagree on the all-reduce) throws here.
void StepRunner::throw_if_failed(const qproto::Decision& d, const QuorumResult& res,
                                 int coordinator) const {
  const uint64_t t = d.step;
  if (d.status == qproto::Status::kTimeout) {
    throw QuorumTimeout(
        fmt::format("rank {}: quorum step {} failed: only {} of {} ranks contributed within "
                    "the hard deadline of {} ms (quorum {}); ranks that never contributed: {}",
                    rank_, t, res.count, world_, o_.deadline.count(), d.quorum, res.dropped),
        res.dropped);
  }
  if (d.status != qproto::Status::kMismatch) return;
  auto layout = [](uint64_t count, uint32_t l) {
    const auto type = DataType(l >> 8);
    return fmt::format("{} elements of {} ({})", count,
                       uint8_t(type) <= uint8_t(DataType::kBFloat16)
                           ? std::string(to_string(type))
                           : fmt::format("type {}", l >> 8),
                       (l & 1) ? "mean" : "sum");
  };
  const uint32_t mine = qproto::layout_of(uint8_t(o_.type), o_.mean);
  if (d.bad_rank == rank_)
    throw UsageError(fmt::format(
        "rank {}: quorum step {}: ranks disagree on the all-reduce: rank {} contributes {} "
        "(this rank), which is not what the coordinator (rank {}) contributes",
        rank_, t, rank_, layout(count_, mine), coordinator));
  throw UsageError(fmt::format(
      "rank {}: quorum step {}: ranks disagree on the all-reduce: rank {} contributes {}, "
      "rank {} {}",
      rank_, t, d.bad_rank, layout(d.bad_count, d.bad_layout), rank_, layout(count_, mine)));
}

// A step decided again (d.attempt > 0) with a holder of its result (d.source): the holder
// sends it to those that do not have it. Returns whether this rank needs it.
bool StepRunner::forward_held_result(net::Endpoint& ep, const qproto::Decision& d) {
  const uint64_t t = d.step;
  if (d.source == rank_) {
    auto it = kept_.find(t);
    if (it == kept_.end())
      throw ProtocolError(fmt::format(
          "rank {}: quorum step {}: asked to forward a result it does not hold", rank_, t));
    for (int x : d.needers)
      out_.send_result(ep, x,
                       net::make_tag(net::Op::kQuorumResult, attempt_seq(t, d.attempt),
                                     quorum_chunk(0, instance_)),
                       it->second, it->second->data(), it->second->size());
  }
  return std::binary_search(d.needers.begin(), d.needers.end(), rank_);
}

// Records the decision in the caller's view of the step. A skipped step is complete here
// (returns false); otherwise `p` says where its data is.
bool StepRunner::settle(const qproto::Decision& d, QuorumResult& res, Placed& p) {
  const uint64_t t = d.step;
  std::lock_guard<std::mutex> lock(steps_.mu);
  StepLocal& s = steps_.steps[t];
  if (d.status == qproto::Status::kSkipped) {
    res.skipped = true;
    res.self_counted = false;
    s.decided = true;
    s.result = res;
    s.done = true;
    steps_.cv.notify_all();
    mark_done(t, nullptr);
    return false;
  }
  p.spec = s.ring_finished || rings_.count(t);
  if (p.spec && res.count != world_)
    throw ProtocolError(fmt::format(
        "rank {}: quorum step {} decided {} of {} contributors with quorum = world", rank_, t,
        res.count, world_));
  if (d.source >= 0 && d.contributors.empty()) {
    // Recovered by a coordinator that knew no decision of it (StepRecovery::rebuild): S(t) is
    // the one this rank was told when the step was decided.
    if (!s.decided || s.result.count == 0)
      throw ProtocolError(fmt::format("rank {}: quorum step {}: its result is forwarded with no "
                                      "contributors and this rank never saw its decision",
                                      rank_, t));
    res = s.result;
    res.attempt = d.attempt;
    res.epoch = d.epoch;
  }
  s.decided = true;
  double reduce_ms = s.result.reduce_ms;
  s.result = res;
  if (s.ring_finished) {
    s.result.reduce_ms = reduce_ms;
    s.done = p.finished = true;
  }
  if (res.self_counted) {
    if (!s.contributed)
      throw ProtocolError(fmt::format("rank {}: counted in step {} without contributing", rank_, t));
    p.buf = s.buf;
    s.excluded = false;  // a late contribution counted when the step was decided again
  } else {
    s.excluded = true;
  }
  if (!p.spec && (tolerant_ || !res.self_counted)) {
    if (!s.out) s.out = result_buffer();
    p.out = s.out;
  }
  return true;
}

// In place (out == nullptr) or from the kept contribution into `out`: an engine op over the
// members, numbered in the quorum's own space (step, attempt).
void StepRunner::start_ring(uint64_t t, uint32_t attempt, void* buf, void* out,
                            std::vector<int> members, bool speculative) {
  CollArgs a;
  a.kind = CollKind::kAllreduce;
  a.send = buf;
  a.recv = out ? out : buf;
  a.count = count_;
  a.type = o_.type;
  a.op = o_.mean ? RedOp::kAvg : RedOp::kSum;
  a.tag_op = net::Op::kQuorumData;
  a.members = members;
  std::unique_ptr<EngineOp> op = make_collective_op(engine_, copts_, a);
  op->seq = uint32_t(attempt_seq(t, attempt));
  if (o_.on_phase) op = std::make_unique<ObservedOp>(std::move(op), t, o_.on_phase);
  op->seq = uint32_t(attempt_seq(t, attempt));
  op->sequenced = false;
  // Its failure is the step's, not the communicator's: the runner decides what it means.
  op->on_failure = EngineOp::OnFailure::kFailsOp;
  // A speculative reduction starts before the coordinator's clock (first READY + H) does:
  // the coordinator has time to report a QuorumTimeout first.
  const auto now = engine_.now();
  op->deadline = now + o_.deadline + (speculative ? std::chrono::milliseconds(2000)
                                                  : std::chrono::milliseconds(0));
  WorkPtr w = engine_.submit(std::move(op), /*wake=*/false);
  rings_[t] = Ring{std::move(w), now, std::move(members), attempt, speculative};
}

void StepRunner::post_result_recv(net::Endpoint& ep, uint64_t t, uint32_t attempt, int from,
                                  const std::shared_ptr<Bytes>& out) {
  auto req = ep.irecv(
      from,
      net::make_tag(net::Op::kQuorumResult, attempt_seq(t, attempt), quorum_chunk(0, instance_)),
      out->data(), count_ * esz_);
  result_recvs_[t] = ResultRecv{req, from, engine_.now()};
}

bool StepRunner::recover(net::Endpoint& ep, uint64_t t) {
  if (done_.count(t)) return true;
  // The other members may have sent this step's messages already, or still send them until
  // they hear of the recovery too: what is left is discarded (EngineOp::abandon), not left to
  // hold back their later sends to this rank.
  const Deadline until = engine_.now() + o_.deadline;
  auto r = rings_.find(t);
  if (r != rings_.end()) {
    engine_.abandon(r->second.work, until,
                    fmt::format("rank {}: quorum step {} is decided again", rank_, t));
    rings_.erase(r);
  }
  auto rr = result_recvs_.find(t);
  if (rr != result_recvs_.end()) {
    const ResultRecv& x = rr->second;
    if (!x.req->done() && ep.cancel(x.req)) ep.discard(x.from, x.req->tag, x.req->len, until);
    result_recvs_.erase(rr);
  }
  return false;
}

bool StepRunner::advance(net::Endpoint& ep, const qproto::View& view) {
  bool moved = false;
  for (auto it = rings_.begin(); it != rings_.end();) {
    Ring& ring = it->second;
    if (!ring.work->done()) {
      ++it;
      continue;
    }
    moved = true;
    if (ring.work->error()) {
      if (!ring_failed(it->first, ring)) {
        ++it;
        continue;
      }
    } else {
      ring_done(ep, it->first, ring, view);
    }
    it = rings_.erase(it);
  }
  moved |= poll_results();
  // The buffer the next step will want, made off the step's path: only on a pass that moved
  // something, and only when the pool has no free one (reserve_result_buffer).
  if (moved) reserve_result_buffer();
  return moved;
}

// A reduction that failed. A timeout ends the all-reduce (as does any failure in a job that
// cannot lose a rank); another failure in a tolerant job means a peer of the reduction failed:
// the coordinator evicts it (it falls silent) and decides the step again, and the deadline
// bounds the wait if it does not. Returns true (the ring is done with).
bool StepRunner::ring_failed(uint64_t t, Ring& ring) {
  const std::exception_ptr err = ring.work->error();
  if (is_timeout(err))
    throw CollectiveTimeout(fmt::format("rank {}: quorum step {}: the ring reduction among {} "
                                        "failed: {}",
                                        rank_, t, ring.members, what_of(err)));
  if (!tolerant_) std::rethrow_exception(err);
  spdlog::warn("rank {}: quorum step {}: the reduction among {} failed: {}; waiting for the "
               "coordinator to decide the step again",
               rank_, t, ring.members, what_of(err));
  failed_[t] = engine_.now();
  return true;
}

// Serves the ranks outside S(t) assigned to this member: from the kept result, or (in place)
// from a staging copy so the caller gets its buffer back now.
void StepRunner::ring_done(net::Endpoint& ep, uint64_t t, Ring& ring, const qproto::View& view) {
  const double reduce_ms = ms_between(ring.started, engine_.now());
  std::vector<int> targets;
  const size_t k = ring.members.size();
  for (int x : view.members) {
    if (std::find(ring.members.begin(), ring.members.end(), x) != ring.members.end()) continue;
    if (join_step_of_[size_t(x)] > t) continue;  // joined after this step: not its result
    if (ring.members[size_t(x) % k] == rank_) targets.push_back(x);
  }
  std::shared_ptr<Bytes> out;
  {
    std::lock_guard<std::mutex> lock(steps_.mu);
    StepLocal& s = steps_.steps[t];
    out = s.out;
    if (!targets.empty()) {
      auto src = out ? out
                     : std::make_shared<Bytes>(static_cast<char*>(s.buf),
                                               static_cast<char*>(s.buf) + count_ * esz_);
      for (int x : targets)
        out_.send_result(ep, x,
                         net::make_tag(net::Op::kQuorumResult, attempt_seq(t, ring.attempt),
                                       quorum_chunk(0, instance_)),
                         src, src->data(), src->size());
    }
    s.result.reduce_ms = reduce_ms;
    if (s.decided)
      s.done = true;
    else
      s.ring_finished = true;  // speculative: the DECIDE completes the step
  }
  steps_.cv.notify_all();
  mark_done(t, out);
}

bool StepRunner::poll_results() {
  bool moved = false;
  for (auto it = result_recvs_.begin(); it != result_recvs_.end();) {
    if (!it->second.req->done()) {
      ++it;
      continue;
    }
    const uint64_t t = it->first;
    moved = true;
    if (!it->second.req->ok()) {
      if (!tolerant_) net::throw_if_failed(*it->second.req, "quorum result receive");
      spdlog::warn("rank {}: quorum step {}: the result from rank {} failed: {}", rank_, t,
                   it->second.from, it->second.req->error);
      suspects_.emplace_back(it->second.from, it->second.req->error);
      failed_[t] = engine_.now();
      it = result_recvs_.erase(it);
      continue;
    }
    std::shared_ptr<Bytes> out;
    {
      std::lock_guard<std::mutex> lock(steps_.mu);
      StepLocal& s = steps_.steps[t];
      s.done = true;
      out = s.out;
    }
    steps_.cv.notify_all();
    mark_done(t, out);
    received_ = std::max(received_, int64_t(t));
    it = result_recvs_.erase(it);
  }
  return moved;
}

std::vector<std::pair<int, std::string>> StepRunner::take_suspects() {
  std::vector<std::pair<int, std::string>> s;
  s.swap(suspects_);
  return s;
}

// Step t's result is complete on this rank.
void StepRunner::mark_done(uint64_t t, std::shared_ptr<Bytes> out) {
  if (int64_t(t) > completed_) ahead_.insert(t);
  advance_completed();
  if (tolerant_) {
    done_.insert(t);
    if (out) kept_[t] = std::move(out);
  }
}

void StepRunner::start_at(uint64_t step) {
  started_ = true;
  completed_ = std::max(completed_, int64_t(step) - 1);
  advance_completed();
}

void StepRunner::advance_completed() {
  while (!ahead_.empty() && int64_t(*ahead_.begin()) <= completed_ + 1) {
    completed_ = std::max(completed_, int64_t(*ahead_.begin()));
    ahead_.erase(ahead_.begin());
  }
}

void StepRunner::settled(int64_t t) {
  if (t < 0) return;
  done_.erase(done_.begin(), done_.upper_bound(uint64_t(t)));
  kept_.erase(kept_.begin(), kept_.upper_bound(uint64_t(t)));
}

std::shared_ptr<Bytes> StepRunner::free_buffer() const {
  for (auto& b : pool_)
    if (b.use_count() == 1) return b;
  return nullptr;
}

std::shared_ptr<Bytes> StepRunner::result_buffer() {
  if (auto b = free_buffer()) return b;
  const auto t0 = engine_.now();
  pool_.push_back(std::make_shared<Bytes>(count_ * esz_));
  spdlog::debug("rank {}: quorum: a result buffer made on a step's path in {:.1f} ms ({} held)",
                rank_, ms_between(t0, engine_.now()), pool_.size());
  return pool_.back();
}

// While a rank lags (stopped, descheduled), every member keeps each step's result until that
// rank has it too, so each step needs a buffer the pool does not have: a fresh one costs
// page faults (milliseconds on a loaded virtual machine, more than a step). It is made here,
// after a step completed, while the callers compute the next one, rather than between the
// DECIDE and the start of the next reduction, under the step table's lock.
bool StepRunner::reserve_result_buffer() {
  if (pool_.empty() || free_buffer()) return false;
  pool_.push_back(std::make_shared<Bytes>(count_ * esz_));
  return true;
}

void StepRunner::check_deadlines(Clock::time_point now) {
  for (auto& [t, rr] : result_recvs_) {
    if (now > rr.started + o_.deadline)
      throw QuorumTimeout(fmt::format("rank {}: quorum step {}: the result from rank {} did not "
                                      "arrive within {} ms",
                                      rank_, t, rr.from, o_.deadline.count()),
                          {rr.from});
  }
  for (auto it = failed_.begin(); it != failed_.end();) {
    if (done_.count(it->first) || rings_.count(it->first) || result_recvs_.count(it->first)) {
      it = failed_.erase(it);  // decided again and under way
      continue;
    }
    if (now > it->second + o_.deadline)
      throw QuorumTimeout(fmt::format("rank {}: quorum step {}: its reduction failed and the "
                                      "step was not decided again within {} ms",
                                      rank_, it->first, o_.deadline.count()),
                          {});
    ++it;
  }
}

void StepRunner::cancel(net::Endpoint& ep) {
  // Reductions first: they post into the callers' buffers.
  for (auto& [t, ring] : rings_)
    engine_.abandon(ring.work, engine_.now(),
                    fmt::format("rank {}: the quorum all-reduce ended before step {}", rank_, t));
  rings_.clear();
  for (auto& [t, rr] : result_recvs_)
    if (!rr.req->done()) ep.cancel(rr.req);
  result_recvs_.clear();
}

}  // namespace qring::collectives
