// qring-bench: nccl-tests style benchmark of qring's collectives and of the raw endpoint.
//
//   qring-launch -n 4 -- qring-bench --op allreduce -b 4K -e 64M -f 4 --json out.json
//   qring-launch -n 2 --provider tcp -- qring-bench --op sendrecv -b 1M -e 16M -f 16
//   qring-launch -n 4 -- qring-bench --op idle --seconds 10
//   qring-launch -n 4 --tolerate-failures 1 -- qring-bench --op quorum --quorum 3 -b 1M -e 1M
//       -n 200 --evict-ms 1000 --fault kill:2:80 --json out.json
//
// Collectives run through a Communicator; sendrecv and idle use the endpoint alone. The sweep,
// data pattern, check, table and JSON are shared with qring-mpi-bench (bench_common.h).
//
// --op quorum --fault kill:RANK:STEP[:PHASE] | stop:RANK:STEP:MS[:PHASE] (comma list;
// collectives/fault_inject.h) kills or stops a rank at timed step STEP of the first size. The
// loop goes on until the fault played out, the statistics are reduced among the live members
// only and the coordinator at the end prints recovery_s, p50/p99 before the fault and after
// the recovery and the slowest step in between. A killed rank dies; a stopped rank evicted
// meanwhile exits 75 (qring-launch --tolerate-failures K then exits 100 + lost ranks).
#include <fmt/ranges.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "collectives/bench/bench_common.h"
#include "collectives/communicator.h"
#include "collectives/engine.h"
#include "collectives/fault_inject.h"
#include "collectives/quorum.h"
#include "collectives/straggler.h"
#include "net/bootstrap.h"
#include "net/endpoint.h"
#include "net/fabric_endpoint.h"

namespace qring::bench {
namespace {

constexpr int kExitEvicted = 75;  // as qring-train: this rank was evicted while alive

using net::Clock;
using net::Deadline;
using net::Endpoint;
using net::RequestPtr;

// ------------------------------------------------------------------ collectives

class QringBackend {
 public:
  QringBackend(collectives::Communicator& comm, const Options& o) : comm_(comm), o_(o) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  std::string provider() const { return comm_.provider(); }
  void barrier() { comm_.barrier(); }
  double max_over_ranks(double v) {
    double out = 0;
    comm_.allreduce(&v, &out, 1, DataType::kFloat64, RedOp::kMax);
    return out;
  }
  int64_t sum_over_ranks(int64_t v) {
    int64_t out = 0;
    comm_.allreduce(&v, &out, 1, DataType::kInt64, RedOp::kSum);
    return out;
  }
  // In place the reduce-scatter reads the whole recv buffer and writes its block at
  // recv + rank * count (the nccl convention).
  size_t reduce_scatter_in_place_offset(size_t count) const { return size_t(rank()) * count; }
  void register_buffer(const void* p, size_t bytes) { comm_.register_buffer(p, bytes); }

  void run(BenchOp op, const void* send, void* recv, size_t count, bool in_place) {
    const size_t ts = dtype_bytes(o_.dtype);
    auto* r = static_cast<unsigned char*>(recv);
    switch (op) {
      case BenchOp::kAllreduce:
        comm_.allreduce(in_place ? recv : send, recv, count, o_.dtype, o_.redop);
        break;
      case BenchOp::kBroadcast:
        comm_.broadcast(recv, count, o_.dtype, o_.root);
        break;
      case BenchOp::kAllgather:
        comm_.allgather(in_place ? r + size_t(rank()) * count * ts : send, recv, count, o_.dtype);
        break;
      case BenchOp::kReduceScatter:
        if (in_place)
          comm_.reduce_scatter(recv, r + size_t(rank()) * count * ts, count, o_.dtype, o_.redop);
        else
          comm_.reduce_scatter(send, recv, count, o_.dtype, o_.redop);
        break;
      case BenchOp::kBarrier:
        comm_.barrier();
        break;
      default:
        throw ConfigError(fmt::format("--op {} is not a collective", op_name(op)));
    }
  }

 private:
  collectives::Communicator& comm_;
  const Options& o_;
};

// ------------------------------------------------------------------ endpoint-only helpers

// Tag of the ping-pong message number `seq` (mod 2^24).
uint64_t data_tag(uint64_t seq) {
  return net::make_tag(net::Op::kSendRecv, seq, 0);
}
// Tags of the small messages that gather results at rank 0 and release the ranks.
uint64_t report_tag(uint64_t row) {
  return net::make_tag(net::Op::kSendRecv, row, 1);
}
uint64_t release_tag(uint64_t row) {
  return net::make_tag(net::Op::kSendRecv, row, 2);
}
uint64_t idle_tag() {
  return net::make_tag(net::Op::kSendRecv, net::kSeqMask, 3);
}

struct Report {
  double value = 0;  // time (us) or CPU seconds
  int64_t wrong = 0;
};

// Every rank sends its report to rank 0, which returns all of them (others get only their own);
// then rank 0 releases everyone, so this is also a barrier.
std::vector<Report> gather_reports(Endpoint& ep, uint64_t row, Report mine, Deadline deadline) {
  const int n = ep.world_size();
  std::vector<Report> all(static_cast<size_t>(n));
  all[0] = mine;
  if (ep.rank() == 0) {
    std::vector<RequestPtr> reqs;
    for (int p = 1; p < n; ++p)
      reqs.push_back(ep.irecv(p, report_tag(row), &all[size_t(p)], sizeof(Report)));
    ep.wait_all(reqs, deadline, "gathering results");
    char go = 1;
    std::vector<RequestPtr> sends;
    for (int p = 1; p < n; ++p) sends.push_back(ep.isend(p, release_tag(row), &go, 1));
    ep.wait_all(sends, deadline, "releasing ranks");
  } else {
    char go = 0;
    auto rel = ep.irecv(0, release_tag(row), &go, 1);
    auto s = ep.isend(0, report_tag(row), &mine, sizeof(Report));
    ep.wait(s, deadline, "sending results");
    ep.wait(rel, deadline, "waiting for rank 0");
    all.assign(1, mine);
  }
  return all;
}

Deadline op_deadline(const Options& o) {
  return net::deadline_in(std::chrono::milliseconds(o.timeout_ms));
}

// ------------------------------------------------------------------ sendrecv (ping-pong)

class PingPong {
 public:
  PingPong(Endpoint& ep, const Options& o) : ep_(ep), o_(o) {}

  // `iters` round trips of `bytes` with `peer`. The even rank of the pair starts.
  void run(int peer, bool initiator, unsigned char* sbuf, unsigned char* rbuf, size_t bytes,
           int iters) {
    if (iters <= 0) return;
    if (initiator) {
      for (int i = 0; i < iters; ++i) {
        uint64_t tag = data_tag(seq_++);
        auto rr = ep_.irecv(peer, tag, rbuf, bytes);
        auto sr = ep_.isend(peer, tag, sbuf, bytes);
        Deadline dl = op_deadline(o_);
        wait(sr, dl, "sendrecv ping");
        wait(rr, dl, "sendrecv pong");
        check_len(*rr, bytes);
      }
    } else {
      auto rr = ep_.irecv(peer, data_tag(seq_), rbuf, bytes);
      for (int i = 0; i < iters; ++i) {
        Deadline dl = op_deadline(o_);
        wait(rr, dl, "sendrecv ping");
        check_len(*rr, bytes);
        uint64_t tag = data_tag(seq_++);
        auto sr = ep_.isend(peer, tag, sbuf, bytes);
        if (i + 1 < iters) rr = ep_.irecv(peer, data_tag(seq_), rbuf, bytes);
        wait(sr, dl, "sendrecv pong");
      }
    }
  }

  // One exchange in both directions (for the check).
  void exchange(int peer, unsigned char* sbuf, unsigned char* rbuf, size_t bytes) {
    uint64_t tag = data_tag(seq_++);
    auto rr = ep_.irecv(peer, tag, rbuf, bytes);
    auto sr = ep_.isend(peer, tag, sbuf, bytes);
    Deadline dl = op_deadline(o_);
    ep_.wait(sr, dl, "sendrecv check");
    ep_.wait(rr, dl, "sendrecv check");
    check_len(*rr, bytes);
  }

 private:
  // --spin: poll without ever yielding or sleeping, as fi_pingpong does; otherwise the
  // endpoint's own wait (spin, then yield, then sleep with backoff).
  void wait(const RequestPtr& req, Deadline dl, const char* what) {
    if (!o_.spin) return ep_.wait(req, dl, what);
    uint32_t polls = 0;
    while (!req->done()) {
      ep_.progress();
      if ((++polls & 1023) == 0 && net::Clock::now() >= dl)
        throw TimeoutError(fmt::format("rank {}: timed out in {}", ep_.rank(), what));
    }
    net::throw_if_failed(*req, what);
  }
  static void check_len(const net::Request& r, size_t bytes) {
    if (r.bytes != bytes)
      throw ProtocolError(
          fmt::format("sendrecv: rank {} sent {} bytes, expected {}", r.peer, r.bytes, bytes));
  }
  Endpoint& ep_;
  const Options& o_;
  uint64_t seq_ = 0;
};

int64_t run_sendrecv(Endpoint& ep, const Options& o, std::vector<nlohmann::json>& rows) {
  const int n = ep.world_size();
  const int rank = ep.rank();
  if (n < 2) throw ConfigError("--op sendrecv needs at least 2 ranks");
  const int peer = (rank ^ 1) < n ? (rank ^ 1) : -1;  // the last rank of an odd world idles
  const bool initiator = rank % 2 == 0;
  const size_t ts = dtype_bytes(o.dtype);
  if (rank == 0) {
    std::fputs(table_header(BenchOp::kSendRecv, o, n, ep.provider()).c_str(), stdout);
    if (n % 2) std::printf("# rank %d has no partner and only takes part in the reports\n", n - 1);
  }
  AlignedBuffer sbuf(o.max_bytes), rbuf(o.max_bytes);
  ep.register_memory(sbuf.data(), sbuf.size);
  ep.register_memory(rbuf.data(), rbuf.size);
  JsonContext ctx{"sendrecv", std::string(dtype_name(o.dtype)), "none", n, ep.provider(), o.iters,
                  o.warmup};
  PingPong pp(ep, o);
  int64_t total_wrong = 0;
  uint64_t row = 0;
  for (size_t bytes : sweep_sizes(o)) {
    RowKey k;
    k.count = k.count_per_rank = bytes / ts;
    k.bytes = k.count * ts;
    if (k.count == 0) {
      if (rank == 0) std::printf("# %zu bytes: less than one element, skipped\n", bytes);
      continue;
    }
    Report mine;
    if (peer >= 0) {
      fill_pattern(sbuf.data(), o.dtype, k.count, 0, rank);
      pp.run(peer, initiator, sbuf.data(), rbuf.data(), k.bytes, o.warmup);
      auto t0 = std::chrono::steady_clock::now();
      pp.run(peer, initiator, sbuf.data(), rbuf.data(), k.bytes, o.iters);
      auto t1 = std::chrono::steady_clock::now();
      mine.value = std::chrono::duration<double, std::micro>(t1 - t0).count() / o.iters / 2.0;
      if (o.check) {
        fill_garbage(rbuf.data(), k.bytes);
        pp.exchange(peer, sbuf.data(), rbuf.data(), k.bytes);
        mine.wrong = count_wrong_pattern(rbuf.data(), o.dtype, k.count, 0, peer);
      }
    }
    auto all = gather_reports(ep, row++, mine, op_deadline(o));
    if (rank != 0) continue;
    Measurement m;
    m.in_place = false;
    m.wrong = o.check ? 0 : -1;
    m.iters = o.iters;
    for (const Report& r : all) {
      m.time_us = std::max(m.time_us, r.value);
      if (o.check) m.wrong += r.wrong;
    }
    m.algbw = m.time_us > 0 ? double(k.bytes) / (m.time_us * 1e-6) / 1e9 : 0.0;
    m.busbw = m.algbw;
    total_wrong += std::max<int64_t>(0, m.wrong);
    std::fputs(format_row(k, dtype_name(o.dtype), "none", m, std::nullopt).c_str(), stdout);
    std::fflush(stdout);
    auto j = json_row(ctx, k, m);
    j["method"] = "pingpong_half_round_trip";
    rows.push_back(std::move(j));
  }
  return total_wrong;
}

// ------------------------------------------------------------------ idle

double cpu_seconds_self() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

// Rank 0 prints the per-rank CPU seconds of the idle window and returns the JSON row.
void report_idle(const std::vector<double>& cpu, double wall, const std::string& provider,
                 const char* via, std::vector<nlohmann::json>& rows) {
  const int n = static_cast<int>(cpu.size());
  double total = 0;
  nlohmann::json per_rank = nlohmann::json::array();
  std::printf(
      "# idle: %d ranks blocked in a receive that never matches for %.2f s "
      "(waiting in the %s; provider %s)\n",
      n, wall, via, provider.c_str());
  std::printf("# %6s %12s %10s\n", "rank", "cpu (s)", "% core");
  for (int r = 0; r < n; ++r) {
    double c = cpu[size_t(r)];
    total += c;
    per_rank.push_back(c);
    std::printf("  %6d %12.4f %10.3f\n", r, c, 100.0 * c / wall);
  }
  std::printf("  %6s %12.4f %10.3f\n", "total", total, 100.0 * total / wall);
  nlohmann::json j;
  j["op"] = "idle";
  j["via"] = via;
  j["ranks"] = n;
  j["provider"] = provider;
  j["seconds"] = wall;
  j["cpu_s_per_rank"] = per_rank;
  j["cpu_s_total"] = total;
  j["core_percent_total"] = 100.0 * total / wall;
  rows.push_back(std::move(j));
}

std::chrono::nanoseconds idle_duration(const Options& o) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(o.seconds));
}

// --idle-via endpoint: every rank posts a receive that never matches, waits for it with the
// endpoint's own wait (spin, yield, sleep with backoff) until --seconds pass, cancels it, and
// reports the CPU time the whole process used meanwhile.
void run_idle_endpoint(Endpoint& ep, const Options& o, std::vector<nlohmann::json>& rows) {
  uint64_t sink = 0;
  // Start together, so that the windows overlap.
  gather_reports(ep, 0, Report{}, op_deadline(o));
  auto req = ep.irecv(net::kAnyPeer, idle_tag(), &sink, sizeof(sink));
  const double cpu0 = cpu_seconds_self();
  const auto t0 = std::chrono::steady_clock::now();
  bool timed_out = false;
  try {
    ep.wait(req, net::deadline_in(idle_duration(o)), "idle receive");
  } catch (const TimeoutError&) {
    timed_out = true;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = cpu_seconds_self() - cpu0;
  if (!timed_out) throw ProtocolError("idle: the receive that should never match did match");
  if (!ep.cancel(req)) throw ProtocolError("idle: the pending receive could not be cancelled");
  auto all = gather_reports(ep, 1, Report{cpu, 0}, op_deadline(o));
  if (ep.rank() != 0) return;
  std::vector<double> cpus;
  for (const Report& r : all) cpus.push_back(r.value);
  report_idle(cpus, wall, ep.provider(), "endpoint", rows);
}

// An engine operation that posts a receive nobody sends to and finishes (cancelling it) once
// its time is up: the progress engine keeps polling for it meanwhile, exactly as it does while
// a collective waits for a slow peer.
class IdleRecvOp final : public collectives::EngineOp {
 public:
  explicit IdleRecvOp(net::Clock::time_point end) : end_(end) {}
  std::string name() const override { return "idle receive"; }
  void start(Endpoint& ep) override {
    req_ = ep.irecv(net::kAnyPeer, idle_tag(), &sink_, sizeof(sink_));
  }
  bool advance(Endpoint& ep) override {
    if (done_) return false;
    if (req_->done()) throw ProtocolError("idle: the receive that should never match did match");
    if (net::Clock::now() < end_) return false;
    if (!ep.cancel(req_)) throw ProtocolError("idle: the pending receive could not be cancelled");
    done_ = true;
    return true;
  }
  bool finished() const override { return done_; }
  void abort(Endpoint& ep) override {
    if (req_ && !req_->done()) ep.cancel(req_);
  }
  std::string waiting_on() const override { return "an idle receive (never matched)"; }

 private:
  net::Clock::time_point end_;
  RequestPtr req_;
  uint64_t sink_ = 0;
  bool done_ = false;
};

// --idle-via engine (default): the same, with the receive pending inside the communicator's
// progress engine while the caller blocks in Work::wait.
void run_idle_engine(collectives::Communicator& comm, const Options& o,
                     std::vector<nlohmann::json>& rows) {
  comm.barrier();
  const double cpu0 = cpu_seconds_self();
  const auto t0 = std::chrono::steady_clock::now();
  auto op = std::make_unique<IdleRecvOp>(net::Clock::now() + idle_duration(o));
  op->deadline = net::Clock::now() + idle_duration(o) + std::chrono::milliseconds(o.timeout_ms);
  comm.submit(std::move(op))->wait();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = cpu_seconds_self() - cpu0;
  std::vector<double> all(size_t(comm.size()));
  comm.allgather(&cpu, all.data(), 1, DataType::kFloat64);
  if (comm.rank() == 0) report_idle(all, wall, comm.provider(), "engine", rows);
}

// ------------------------------------------------------------------ quorum

// --fault: what this rank saw of one timed step.
struct StepSeen {
  uint64_t epoch = 0;    // the view that decided it
  bool skipped = false;  // no result (a member was lost mid-step, too few survived)
  bool settled = false;  // decided once every fault had played out (played_out)
  Clock::time_point done{};
};

// --fault: the fault's effect on the step loop, computed by the rank that prints.
struct FaultReport {
  std::string spec;
  long evict_ms = 0;
  std::vector<int> lost;     // ranks that left the view
  std::vector<int> members;  // the live members at the end
  int coordinator = 0;
  std::optional<double> recovery_s;  // worst over view changes
  double detection_ms = 0;           // the lost rank's silence when it was evicted (max)
  int64_t before = 0, between = 0, after = 0, skipped = 0;
  std::optional<double> p50_before, p99_before, p50_after, p99_after, between_p50, between_max;
  nlohmann::json views = nlohmann::json::array();
};

struct QuorumStats {
  std::vector<double> lat_us;  // per timed step: the slowest rank's step latency
  double mean_us = 0;          // the slowest rank's mean step latency
  double contributors_mean = 0;
  int64_t dropped = 0;
  int64_t wrong = 0;
  int steps = 0;  // timed steps run (-n, more with --fault)
  // --fault: whether this rank prints the row (the coordinator at the end), and the report.
  bool printer = true;
  std::vector<int> lost;
  std::optional<FaultReport> fault;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = size_t(std::ceil(p / 100.0 * double(v.size())));
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

std::chrono::milliseconds evict_time(const Options& o) {
  return std::chrono::milliseconds(o.evict_ms > 0 ? o.evict_ms : o.fault.empty() ? 5000 : 1000);
}

// The members of view `epoch` as this rank applied it.
std::vector<int> members_at(const std::vector<collectives::ViewChange>& views, uint64_t epoch,
                            int world) {
  std::vector<int> m;
  for (const auto& v : views)
    if (v.epoch <= epoch) m = v.members;
  if (m.empty())
    for (int r = 0; r < world; ++r) m.push_back(r);
  return m;
}

std::string fault_specs(const std::vector<collectives::FaultSpec>& faults) {
  std::vector<std::string> v;
  for (const auto& f : faults) v.push_back(f.spec());
  return fmt::format("{}", fmt::join(v, ","));
}

bool has(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The latest timed step a fault fires at (0 without faults).
uint64_t last_step(const std::vector<collectives::FaultSpec>& faults) {
  uint64_t last_fault_step = 0;
  for (const auto& f : faults) last_fault_step = std::max(last_fault_step, f.step);
  return last_fault_step;
}

// --fault: fires each fault once, at its timed step and phase, from the bench's thread
// (phases step, ready) or the engine thread (ring). It owns what it uses, as the engine may
// call it until the quorum all-reduce is gone. It fires between two engine passes
// (FaultSpec::inject: from the bench's thread holding the engine's progress lock; ring inside
// the engine's own pass).
struct FaultFirer {
  std::vector<collectives::FaultSpec> faults;
  std::shared_ptr<std::atomic<uint64_t>> first_timed;  // QuorumSteps::first_timed
  int rank;
  std::shared_ptr<std::vector<std::atomic<bool>>> fired;
  collectives::Engine* engine;

  void operator()(uint64_t t, const char* phase) const {
    const uint64_t t0 = first_timed->load();
    if (t0 == UINT64_MAX || t < t0) return;
    for (size_t i = 0; i < faults.size(); ++i) {
      if (faults[i].matches(rank, t - t0, phase) && !(*fired)[i].exchange(true)) {
        std::fprintf(stderr, "qring-bench: rank %d: injecting fault %s at timed step %llu\n", rank,
                     faults[i].spec().c_str(), static_cast<unsigned long long>(t - t0));
        std::fflush(stdout);
        std::fflush(stderr);
        faults[i].inject(std::string_view(phase) == "ring" ? nullptr : engine);
      }
    }
  }
};

collectives::QuorumOptions bench_quorum_options(const Options& o, int q) {
  collectives::QuorumOptions qo;
  qo.quorum = q > 0 ? q : 1;
  qo.adaptive = q == 0;
  qo.grace = std::chrono::milliseconds(o.grace_ms);
  qo.deadline = std::chrono::milliseconds(o.deadline_ms);
  qo.type = o.dtype;
  qo.mean = o.redop == RedOp::kAvg;
  qo.evict = evict_time(o);
  return qo;
}

// The steps of one row (quorum_steps, below) over the quorum all-reduce `qa`.
class QuorumSteps {
 public:
  QuorumSteps(collectives::Communicator& comm, const Options& o, size_t count,
              const collectives::StragglerModel& model, collectives::QuorumAllreduce& qa,
              const collectives::QuorumOptions& qo, QuorumStats* paired,
              const std::vector<collectives::FaultSpec>& faults)
      : comm(comm),
        o(o),
        count(count),
        model(model),
        qa(qa),
        qo(qo),
        paired(paired),
        faults(faults),
        buf(count * ts),
        buf2(paired ? count * ts : 0) {
    comm.register_buffer(buf.data(), buf.size);
    if (paired) comm.register_buffer(buf2.data(), buf2.size);
    if (std::any_of(faults.begin(), faults.end(), [](const auto& f) { return f.phase == "ring"; }))
      qa.on_phase(maybe_fault);
  }

  // With -c, up to 10 untimed steps whose results are checked against the reduction of
  // exactly S(t) of the pattern.
  void checked_steps() {
    const int checked = std::min(o.iters, 10);
    for (int s = 0; s < checked; ++s, ++step) {
      fill_pattern(buf.data(), o.dtype, count, step, rank);
      collectives::QuorumResult r = run_step(step);
      // Expected: the sum (or mean) over exactly S(step) of pattern(j + step, r).
      std::vector<int> contributors;
      for (int p = 0; p < n; ++p)
        if (r.contains(p)) contributors.push_back(p);
      st.wrong += count_wrong_reduced(buf.data(), o.dtype, count, step, contributors,
                                      qo.mean ? RedOp::kAvg : RedOp::kSum);
    }
  }

  // -w warm-up and -n timed steps (more with --fault: below).
  void timed_steps() {
    first_timed->store(step + uint64_t(o.warmup));
    const bool refill = o.redop != RedOp::kAvg;  // sums grow step after step
    fill_pattern(buf.data(), o.dtype, count, step, rank);
    if (paired) fill_pattern(buf2.data(), o.dtype, count, step, rank);
    comm.barrier();
    bool more = false;
    for (int s = 0; s < o.warmup + o.iters || more; ++s, ++step) {
      if (s == o.warmup) comm.barrier();  // before any fault: every rank is there
      const int idx = s - o.warmup;       // timed step (< 0: warm-up)
      if (faulty && idx >= 0) {
        start_due_faults(idx);
        maybe_fault(step, "step");
      }
      if (refill) fill_pattern(buf.data(), o.dtype, count, step, rank);
      const bool voting = faulty && idx >= o.iters - 1;
      if (voting) store_value(buf.data(), o.dtype, 0, want_more(Clock::now()) ? double(n) : 0.0);
      // The timed steps read the result in place: in a job that can lose ranks it lies in the
      // all-reduce's kept buffer, and a copy into buf would add a pass over the whole buffer
      // that a caller reading it in place does not pay.
      const auto t0 = std::chrono::steady_clock::now();
      collectives::QuorumResult r = run_step(step, &result);
      const auto t1 = std::chrono::steady_clock::now();
      if (idx >= 0) {
        lat.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        contributors += r.count;
        st.dropped += n - r.count;
      }
      if (faulty && idx >= 0) record_seen(r, t1);
      // A skipped step leaves the buffer as it was (every rank skips alike): one more step.
      if (voting) more = r.skipped || load_value(result.data, o.dtype, 0) > 0;
      if (paired) {
        if (refill) fill_pattern(buf2.data(), o.dtype, count, step, rank);
        const auto p0 = std::chrono::steady_clock::now();
        collectives::sleep_unless(model.delay(o.seed, rank, step), nullptr);
        comm.allreduce(buf2.data(), buf2.data(), count, o.dtype, o.redop);
        const auto p1 = std::chrono::steady_clock::now();
        if (s >= o.warmup)
          lat2.push_back(std::chrono::duration<double, std::micro>(p1 - p0).count());
      }
    }
    st.steps = int(lat.size());
  }

  // The statistics, reduced among the ranks that ran the steps; with --fault the report of
  // the rank that prints.
  QuorumStats statistics() {
    // The ranks the statistics are reduced among: every rank, or with --fault the members of
    // the view that decided the last step (the same list on each of them).
    std::vector<int> members;
    if (faulty) members = last_members();
    const std::vector<int> among = int(members.size()) == n ? std::vector<int>{} : members;
    const std::vector<double> early = steps_before_failure(among);
    reduce_lat(lat, st, among);
    if (paired) {
      *paired = QuorumStats{};
      reduce_lat(lat2, *paired, among);
      paired->contributors_mean = n;
      paired->steps = int(lat2.size());
    }
    int64_t w = st.wrong;
    comm.allreduce(&w, &st.wrong, 1, DataType::kInt64, RedOp::kSum, among);
    st.contributors_mean = st.steps ? contributors / st.steps : 0;
    if (!faulty) {
      comm.barrier();
      st.printer = rank == 0;
      return std::move(st);
    }

    // --fault: the coordinator of the last view prints.
    st.printer = qa.coordinator() == rank;
    if (!st.printer) return std::move(st);
    st.fault = fault_report(members, early);
    return std::move(st);
  }

 private:
  // One step; returns its contributor set (everyone for the plain all-reduce). The result is
  // copied into buf, or with `view` read where it lies (no copy, as qring-train reads it).
  collectives::QuorumResult run_step(uint64_t t,
                                     collectives::QuorumAllreduce::View* view = nullptr) {
    bool gave_up =
        collectives::sleep_unless(model.delay(o.seed, rank, t), [&] { return qa.excluded(t); });
    if (!gave_up) {
      qa.contribute(t, buf.data(), count);
      if (faulty) maybe_fault(t, "ready");
    }
    return view ? qa.wait(t, view) : qa.wait(t, buf.data());
  }

  // When rank r fell silent, on this rank's clock, if it left the view: `silent_ms` before
  // this rank applied the view change (the coordinator's silence, exact whatever the phase).
  std::optional<Clock::time_point> fell_silent(int r) const {
    for (const auto& v : qa.view_changes())
      for (const auto& l : v.left)
        if (l.rank == r) return v.seen - std::chrono::microseconds(int64_t(l.silent_ms * 1000));
    return std::nullopt;
  }

  // Whether fault i has played out: a killed rank left the view; a stopped one was evicted
  // or runs again. `extra` > 0 (the vote): a stopped rank has run again for that long.
  bool played_out(size_t i, const std::vector<int>& members, Clock::time_point now,
                  std::chrono::milliseconds extra) const {
    const auto& f = faults[i];
    if (!fault_time[i]) return false;
    if (f.kills()) return !has(members, f.rank);
    const auto pause = std::chrono::milliseconds(f.stop_ms);
    if (has(members, f.rank)) return now >= *fault_time[i] + pause + extra;
    if (extra.count() == 0) return true;
    // Evicted: it runs again `pause` after it fell silent.
    const auto silent = fell_silent(f.rank);
    return !silent || now >= *silent + pause + extra;
  }

  bool want_more(Clock::time_point now) const {
    if (cap && now > *cap) return false;
    const auto members = qa.members();
    for (size_t i = 0; i < faults.size(); ++i)
      if (!played_out(i, members, now, settle)) return true;
    return settled_steps < after_min + 1;  // the first completes the recovery
  }

  // Timed step idx starts: the faults due at it start their clock.
  void start_due_faults(int idx) {
    const auto now = Clock::now();
    for (size_t i = 0; i < faults.size(); ++i) {
      if (!fault_time[i] && uint64_t(idx) >= faults[i].step) {
        fault_time[i] = now;
        // Bounded: a kill evicts after E (a lost coordinator: the takeover, after up to
        // max(E, deadline) and E per candidate); a stop plays out after its pause.
        auto c = now + std::chrono::milliseconds(faults[i].stop_ms) + settle + 3 * evict +
                 std::chrono::milliseconds(o.deadline_ms) + std::chrono::seconds(10);
        cap = cap ? std::max(*cap, c) : c;
      }
    }
  }

  // --fault: what this rank saw of timed step `r`, which completed at t1.
  void record_seen(const collectives::QuorumResult& r, Clock::time_point t1) {
    StepSeen v;
    v.epoch = r.epoch;
    v.skipped = r.skipped;
    v.done = t1;
    const auto members = members_at(qa.view_changes(), r.epoch, n);
    v.settled = true;
    for (size_t i = 0; i < faults.size(); ++i)
      v.settled = v.settled && played_out(i, members, t1, std::chrono::milliseconds(0));
    settled_steps += v.settled;
    seen.push_back(v);
  }

  // --fault: the members of the latest view that decided a step (steps can come in an older
  // view than the step before: collectives::views_learned); the ranks lost go to st.lost.
  std::vector<int> last_members() {
    // Views applied after the last step are left out: not every rank need have them yet.
    uint64_t last_epoch = 0;
    for (const auto& v : seen) last_epoch = std::max(last_epoch, v.epoch);
    const auto views = qa.view_changes();
    std::vector<int> members = members_at(views, last_epoch, n);
    for (const auto& v : views)
      for (const auto& l : v.left)
        if (v.epoch <= last_epoch)
          if (!has(st.lost, l.rank)) st.lost.push_back(l.rank);
    std::sort(st.lost.begin(), st.lost.end());
    for (const auto& f : faults)
      if (f.kills() && has(members, f.rank))
        throw TimeoutError(fmt::format(
            "rank {}: --fault {}: rank {} is still a member of the view {} steps after it was due "
            "to be killed (evict time {} ms; a fault at phase ring fires only in a step the "
            "rank reduces); the statistics cannot be gathered without it",
            rank, f.spec(), f.rank, st.steps - int64_t(f.step), evict.count()));
    return members;
  }

  // --fault: the steps before the failure: before the first fault's STEP, and completed on
  // every live rank before the first victim struck (this rank's start of STEP, or when the
  // victim fell silent if that was earlier): a step the dying rank still took part in (its
  // ring, a result it was to forward) is held up by the failure and counts as in between.
  std::vector<double> steps_before_failure(const std::vector<int>& among) {
    uint64_t first_fault_step = UINT64_MAX;
    for (const auto& f : faults) first_fault_step = std::min(first_fault_step, f.step);
    std::vector<double> early(seen.size(), 0.0);
    if (faulty) {
      std::optional<Clock::time_point> struck;
      for (size_t i = 0; i < faults.size(); ++i) {
        auto t = fault_time[i];
        if (auto silent = fell_silent(faults[i].rank); silent && (!t || *silent < *t)) t = silent;
        if (t && (!struck || *t < *struck)) struck = t;
      }
      for (size_t i = 0; i < seen.size(); ++i)
        early[i] = i < first_fault_step && (!struck || seen[i].done < *struck) ? 1.0 : 0.0;
      if (!early.empty())
        comm.allreduce(early.data(), early.data(), early.size(), DataType::kFloat64, RedOp::kMin,
                       among);
    }
    return early;
  }

  // The step latency is the slowest rank's; contributor counts agree on every rank. Every
  // rank among `among` ran the same steps, so the vectors have the same length.
  void reduce_lat(const std::vector<double>& l, QuorumStats& out, const std::vector<int>& among) {
    double mine = 0;
    for (double x : l) mine += x;
    mine = l.empty() ? 0 : mine / double(l.size());
    comm.allreduce(&mine, &out.mean_us, 1, DataType::kFloat64, RedOp::kMax, among);
    out.lat_us.assign(l.size(), 0);
    if (!l.empty())
      comm.allreduce(l.data(), out.lat_us.data(), l.size(), DataType::kFloat64, RedOp::kMax,
                     among);
  }

  // --fault: the report of the rank that prints (report_fault).
  FaultReport fault_report(const std::vector<int>& members, const std::vector<double>& early) {
    FaultReport fr;
    fr.spec = fault_specs(faults);
    fr.evict_ms = long(evict.count());
    fr.lost = st.lost;
    fr.members = members;
    fr.coordinator = rank;
    // Before: `early` (steps_before_failure). After the recovery: the steps that began once the first step
    // decided after every fault played out had completed (that step, which the failure held
    // up, counts as in between).
    std::vector<double> before, between, after;
    bool recovered = false;
    for (size_t i = 0; i < seen.size(); ++i) {
      const double l = st.lat_us[i];
      fr.skipped += seen[i].skipped;
      if (early[i] > 0) {
        before.push_back(l);
      } else if (seen[i].settled && recovered) {
        after.push_back(l);
      } else {
        recovered = recovered || seen[i].settled;
        between.push_back(l);
      }
    }
    fr.between = int64_t(between.size());
    if (!between.empty()) {
      fr.between_p50 = percentile(between, 50);
      fr.between_max = percentile(between, 100);
    }
    fr.before = int64_t(before.size());
    fr.after = int64_t(after.size());
    if (!before.empty()) {
      fr.p50_before = percentile(before, 50);
      fr.p99_before = percentile(before, 99);
    }
    if (!after.empty()) {
      fr.p50_after = percentile(after, 50);
      fr.p99_after = percentile(after, 99);
    }
    // Recovery per view change: from the lost rank's last sign of life (its silence when the
    // coordinator evicted it, before this rank applied the view) to the first step that
    // completed with a result in the new view.
    for (const auto& v : qa.view_changes()) {
      if (v.epoch == 0) continue;
      double silent_ms = 0;
      nlohmann::json left = nlohmann::json::array();
      for (const auto& l : v.left) {
        silent_ms = std::max(silent_ms, l.silent_ms);
        left.push_back({{"rank", l.rank}, {"why", l.why}, {"silent_ms", l.silent_ms}});
      }
      fr.detection_ms = std::max(fr.detection_ms, silent_ms);
      std::optional<double> rec;
      for (size_t i = 0; i < seen.size(); ++i) {
        if (seen[i].epoch >= v.epoch && !seen[i].skipped) {
          rec = silent_ms / 1000.0 + std::chrono::duration<double>(seen[i].done - v.seen).count();
          break;
        }
      }
      if (rec) fr.recovery_s = std::max(fr.recovery_s.value_or(0.0), *rec);
      fr.views.push_back({{"epoch", v.epoch},
                          {"members", v.members},
                          {"left", left},
                          {"recovery_s", rec ? nlohmann::json(*rec) : nlohmann::json()}});
    }
    return fr;
  }

  collectives::Communicator& comm;
  const Options& o;
  const size_t count;
  const collectives::StragglerModel& model;
  collectives::QuorumAllreduce& qa;
  const collectives::QuorumOptions& qo;
  QuorumStats* const paired;
  const std::vector<collectives::FaultSpec>& faults;
  const int n = comm.size(), rank = comm.rank();
  const size_t ts = dtype_bytes(o.dtype);
  const bool faulty = !faults.empty();
  AlignedBuffer buf, buf2;
  QuorumStats st;
  uint64_t step = 0;
  // Set once the checked steps are done: quorum step number of timed step 0.
  std::shared_ptr<std::atomic<uint64_t>> first_timed =
      std::make_shared<std::atomic<uint64_t>>(UINT64_MAX);
  const FaultFirer maybe_fault{faults, first_timed, rank,
                               std::make_shared<std::vector<std::atomic<bool>>>(faults.size()),
                               &comm.engine()};
  std::vector<double> lat, lat2;
  std::vector<StepSeen> seen;
  double contributors = 0;
  collectives::QuorumAllreduce::View result;  // the last timed step's result

  // --fault: the loop runs -n timed steps and then on while some rank still wants more: a
  // fault has not played out yet (a killed rank is still in the view; a stopped one has not
  // been running again for `settle`, so that an evicted one learns it while the job still
  // runs), or fewer than `after_min` steps were decided after that. A stopped rank's pause is
  // timed from the start of its STEP here (a ready or ring phase comes later), or once it was
  // evicted from when it fell silent. The ranks agree on
  // the loop's end through the steps themselves: from timed step -n - 1 on, element 0 of each
  // contribution is a vote (n = more, 0 = enough), and the step's result -- the same bits on
  // every rank -- says whether another step follows. Votes stop at a hard cap, so the loop
  // ends.
  const std::chrono::milliseconds evict = qo.evict;
  const std::chrono::milliseconds settle =
      std::max<std::chrono::milliseconds>(std::chrono::milliseconds(500), evict);
  const int after_min = std::max(10, o.iters - int(last_step(faults)));
  std::vector<std::optional<Clock::time_point>> fault_time =
      std::vector<std::optional<Clock::time_point>>(faults.size());
  std::optional<Clock::time_point> cap;
  int64_t settled_steps = 0;
};

// Runs the steps of one row: with -c, up to 10 untimed steps whose results are checked
// against the reduction of exactly S(t) of the pattern; then -w warm-up and -n timed steps
// back to back (no per-step fill or check: with sum the buffer is refilled before each
// step, outside the timing). `q` = 0: the adaptive quorum (--quorum auto, bounds 1..world).
// With `paired`, every step is followed by the same step of the plain in-place all-reduce
// (--compare-allreduce), so both are measured the same way.
//
// `faults` (--fault, first size only): fired at their timed step. Ranks may then die or be
// evicted, so the loop avoids every collective over the world after the warm-up: the loop's
// end is agreed through the steps themselves (above), the statistics are reduced among the
// live members of the last view, and the coordinator of that view prints.
QuorumStats quorum_steps(collectives::Communicator& comm, const Options& o, size_t count, int q,
                         const collectives::StragglerModel& model,
                         QuorumStats* paired = nullptr,
                         const std::vector<collectives::FaultSpec>& faults = {}) {
  const int n = comm.size();
  const collectives::QuorumOptions qo = bench_quorum_options(o, q);
  collectives::QuorumAllreduce qa(comm, count, qo);
  if (!faults.empty() && !qa.survives_loss())
    throw ConfigError(fmt::format(
        "--fault: quorum {} of {} ranks leaves no room to lose a rank (use --quorum {} or less)",
        q, n, n - 1));
  QuorumSteps steps(comm, o, count, model, qa, qo, paired, faults);
  if (o.check) steps.checked_steps();
  steps.timed_steps();
  return steps.statistics();
}

std::string join_ranks(const std::vector<int>& v) {
  return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ","));
}

// --fault: the readable block under the row, and the JSON keys of the row.
void report_fault(const FaultReport& f, nlohmann::json& j) {
  auto us = [](const std::optional<double>& v) {
    return v ? fmt::format("{:.1f} us", *v) : std::string("-");
  };
  std::printf("# fault %s (evict %ld ms): lost rank(s) %s; live members %s, coordinator %d\n",
              f.spec.c_str(), f.evict_ms, join_ranks(f.lost).c_str(),
              join_ranks(f.members).c_str(), f.coordinator);
  if (f.recovery_s)
    std::printf(
        "#   recovery %.3f s from the lost rank's last sign of life (silent %.0f ms when "
        "evicted) to the first step completed in the new view\n",
        *f.recovery_s, f.detection_ms);
  else
    std::printf("#   no view change (nobody was evicted)\n");
  std::printf("#   before the fault: %lld steps, p50 %s, p99 %s\n",
              static_cast<long long>(f.before), us(f.p50_before).c_str(),
              us(f.p99_before).c_str());
  std::printf("#   in between:       %lld steps, p50 %s, slowest %s\n",
              static_cast<long long>(f.between), us(f.between_p50).c_str(),
              us(f.between_max).c_str());
  std::printf("#   after recovery:   %lld steps, p50 %s, p99 %s; %lld step(s) skipped\n",
              static_cast<long long>(f.after), us(f.p50_after).c_str(),
              us(f.p99_after).c_str(), static_cast<long long>(f.skipped));
  auto opt = [](const std::optional<double>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json();
  };
  j["fault"] = f.spec;
  j["evict_ms"] = f.evict_ms;
  j["lost_ranks"] = f.lost;
  j["members"] = f.members;
  j["coordinator"] = f.coordinator;
  j["recovery_s"] = opt(f.recovery_s);
  j["detection_ms"] = f.detection_ms;
  j["steps_before"] = f.before;
  j["steps_between"] = f.between;
  j["steps_after"] = f.after;
  j["p50_before_us"] = opt(f.p50_before);
  j["p99_before_us"] = opt(f.p99_before);
  j["between_p50_us"] = opt(f.between_p50);
  j["between_max_us"] = opt(f.between_max);
  j["p50_after_us"] = opt(f.p50_after);
  j["p99_after_us"] = opt(f.p99_after);
  j["skipped_steps"] = f.skipped;
  j["views"] = f.views;
}

// The faults of --fault, checked against this run (n = 0: world size not known yet).
std::vector<collectives::FaultSpec> bench_faults(const Options& o, int n) {
  auto faults = collectives::FaultSpec::parse_list(o.fault);
  for (const auto& f : faults) {
    if (f.phase != "step" && f.phase != "ready" && f.phase != "ring")
      throw ConfigError(fmt::format(
          "--fault {}: phase '{}' does not occur in qring-bench (step, ready or ring)", f.spec(),
          f.phase));
    if (n > 0 && f.rank >= n)
      throw ConfigError(
          fmt::format("--fault {}: rank {} out of range for {} ranks", f.spec(), f.rank, n));
    if (f.step >= uint64_t(o.iters))
      throw ConfigError(fmt::format(
          "--fault {}: step {} is not among the -n {} timed steps", f.spec(), f.step, o.iters));
  }
  return faults;
}

struct QuorumOutcome {
  int64_t wrong = 0;
  bool writer = false;    // printed the rows: writes --json
  std::vector<int> lost;  // ranks lost (--fault)
};

// The lines above the rows of --op quorum (rank 0).
void print_quorum_header(collectives::Communicator& comm, const Options& o, int q,
                         const collectives::StragglerModel& model,
                         const std::vector<collectives::FaultSpec>& faults) {
  const int n = comm.size();
  std::printf(
      "# quorum all-reduce: %d ranks, provider %s, quorum %s, grace %ld ms, deadline "
      "%ld ms, straggler %s (seed %llu), dtype %s, redop %s, %d steps + %d warm-up\n",
      n, comm.provider().c_str(), q > 0 ? std::to_string(q).c_str() : "auto", o.grace_ms,
      o.deadline_ms, model.spec().c_str(),
      static_cast<unsigned long long>(o.seed), std::string(dtype_name(o.dtype)).c_str(),
      o.redop == RedOp::kAvg ? "avg" : "sum", o.iters, o.warmup);
  if (!faults.empty()) {
    const std::string spec = fault_specs(faults);
    std::printf(
        "# fault %s in the first size, evict %lld ms: the loop runs until it played out "
        "and the coordinator at the end prints\n",
        spec.c_str(), static_cast<long long>(evict_time(o).count()));
  }
  std::printf(
      "# step latency = the slowest rank's time from the start of its step (before "
      "its straggler delay) to the end of its wait; busbw from p50\n#\n");
  std::printf("# %10s %12s %10s %10s %10s %8s %8s %8s %6s", "size", "count", "p50(us)", "p99(us)",
              "max(us)", "busbw", "contrib", "dropped", "#wrong");
  if (o.compare_full)
    std::printf(" | %10s %10s %8s %8s", "full p50", "full p99", "p50 x", "p99 x");
  if (o.compare_allreduce)
    std::printf(" | %10s %10s %10s %8s %8s", "mean(us)", "ar p50", "ar mean", "p50 x",
                "mean x");
  std::printf("\n");
  std::fflush(stdout);  // rank 0 may be a fault's victim
}

// The JSON row of one size of --op quorum (`quorum` 0: auto).
nlohmann::json quorum_row(collectives::Communicator& comm, const Options& o, size_t count,
                          const QuorumStats& s, int quorum,
                          const collectives::StragglerModel& model) {
  const int n = comm.size();
  const size_t ts = dtype_bytes(o.dtype);
  double p50 = percentile(s.lat_us, 50), p99 = percentile(s.lat_us, 99),
         mx = percentile(s.lat_us, 100);
  double algbw = p50 > 0 ? double(count * ts) / (p50 * 1e-6) / 1e9 : 0;
  nlohmann::json j{{"op", "quorum"},
                   {"dtype", std::string(dtype_name(o.dtype))},
                   {"redop", o.redop == RedOp::kAvg ? "avg" : "sum"},
                   {"bytes", count * ts},
                   {"count", count},
                   {"ranks", n},
                   {"provider", comm.provider()},
                   {"in_place", true},
                   {"quorum", quorum > 0 ? nlohmann::json(quorum) : nlohmann::json("auto")},
                   {"grace_ms", o.grace_ms},
                   {"straggler", model.spec()},
                   {"time_us", p50},
                   {"algbw_gbps", algbw},
                   {"busbw_gbps", algbw * bus_factor(BenchOp::kAllreduce, n)},
                   {"p50_us", p50},
                   {"p99_us", p99},
                   {"mean_us", s.mean_us},
                   {"max_us", mx},
                   {"contributors_mean", s.contributors_mean},
                   {"dropped", s.dropped},
                   {"wrong", s.wrong},
                   {"iters", s.steps}};
  return j;
}

QuorumOutcome run_quorum(collectives::Communicator& comm, const Options& o,
                         std::vector<nlohmann::json>& rows) {
  const int n = comm.size();
  // 0: the adaptive quorum (auto_quorum.h), within 1..n.
  const int q = o.quorum.empty() ? n
                : o.quorum == "auto" ? 0
                                     : collectives::resolve_quorum(o.quorum, n);
  if (o.redop != RedOp::kSum && o.redop != RedOp::kAvg)
    throw ConfigError("--op quorum: --redop must be sum or avg");
  const auto model = collectives::StragglerModel::parse(o.straggler);
  const auto faults = bench_faults(o, n);
  const size_t ts = dtype_bytes(o.dtype);
  QuorumOutcome out;
  out.writer = comm.rank() == 0;
  if (comm.rank() == 0) print_quorum_header(comm, o, q, model, faults);
  bool first = true;
  for (size_t bytes : sweep_sizes(o)) {
    const size_t count = bytes / ts;
    if (count == 0) continue;
    if (!out.lost.empty()) {
      // A fresh quorum all-reduce over the world would have to lose the dead ranks again.
      if (out.writer)
        std::printf("# %zu bytes and larger: not run, rank(s) %s were lost in the first size\n",
                    bytes, join_ranks(out.lost).c_str());
      break;
    }
    std::optional<QuorumStats> plain;
    if (o.compare_allreduce) plain.emplace();
    QuorumStats st = quorum_steps(comm, o, count, q, model, plain ? &*plain : nullptr,
                                  first ? faults : std::vector<collectives::FaultSpec>{});
    first = false;
    out.lost = st.lost;
    std::optional<QuorumStats> full;
    if (o.compare_full) full = quorum_steps(comm, o, count, n, model);
    out.wrong += st.wrong + (full ? full->wrong : 0) + (plain ? plain->wrong : 0);
    out.writer = st.printer;
    if (!st.printer) continue;
    auto j = quorum_row(comm, o, count, st, q, model);
    std::printf("  %10zu %12zu %10.1f %10.1f %10.1f %8.3f %8.2f %8lld %6lld", count * ts, count,
                double(j["p50_us"]), double(j["p99_us"]), double(j["max_us"]),
                double(j["busbw_gbps"]), st.contributors_mean, static_cast<long long>(st.dropped),
                static_cast<long long>(st.wrong));
    if (full) {
      auto f = quorum_row(comm, o, count, *full, n, model);
      f["compare_full"] = true;
      double r50 = double(j["p50_us"]) / std::max(1e-9, double(f["p50_us"]));
      double r99 = double(j["p99_us"]) / std::max(1e-9, double(f["p99_us"]));
      j["full_p50_us"] = f["p50_us"];
      j["full_p99_us"] = f["p99_us"];
      j["p50_ratio_vs_full"] = r50;
      j["p99_ratio_vs_full"] = r99;
      std::printf(" | %10.1f %10.1f %8.3f %8.3f", double(f["p50_us"]), double(f["p99_us"]), r50,
                  r99);
      rows.push_back(f);
    }
    if (plain) {
      auto a = quorum_row(comm, o, count, *plain, n, model);
      a["op"] = "allreduce";
      a["compare_allreduce"] = true;
      double r50 = double(j["p50_us"]) / std::max(1e-9, double(a["p50_us"]));
      double rmean = st.mean_us / std::max(1e-9, plain->mean_us);
      j["allreduce_p50_us"] = a["p50_us"];
      j["allreduce_mean_us"] = a["mean_us"];
      j["p50_ratio_vs_allreduce"] = r50;
      j["mean_ratio_vs_allreduce"] = rmean;
      std::printf(" | %10.1f %10.1f %10.1f %8.3f %8.3f", st.mean_us, double(a["p50_us"]),
                  plain->mean_us, r50, rmean);
      rows.push_back(a);
    }
    std::printf("\n");
    if (st.fault) report_fault(*st.fault, j);
    rows.insert(rows.end() - (full ? 1 : 0) - (plain ? 1 : 0), j);
    std::fflush(stdout);
  }
  return out;
}

// ------------------------------------------------------------------ main

std::string provider_setting(const Options& o) {
  if (!o.provider.empty()) return o.provider;
  if (auto v = net::process_env("QRING_PROVIDER"); v && !v->empty()) return *v;
  return "auto";
}

int bench_main(const Options& o) {
  auto info = net::detect_bootstrap();
  const auto setup = std::chrono::seconds(30);
  net::Rendezvous rdv(info, net::deadline_in(setup));
  net::FabricOptions fo;
  fo.provider = provider_setting(o);
  auto ep = net::make_fabric_endpoint(fo, info.rank, info.world_size, rdv.store(),
                                      rdv.single_host(), net::deadline_in(setup));
  const bool print = info.rank == 0;
  std::vector<nlohmann::json> rows;
  int64_t wrong = 0;
  auto write = [&] {
    if (print && !o.json_path.empty()) write_json(o.json_path, rows);
  };
  try {
    if (o.op == BenchOp::kSendRecv) {
      wrong = run_sendrecv(*ep, o, rows);
    } else if (o.op == BenchOp::kIdle && o.idle_via_endpoint) {
      run_idle_endpoint(*ep, o, rows);
    } else {
      collectives::CommOptions co;
      co.local_size = info.local_size;
      co.timeout = std::chrono::milliseconds(o.timeout_ms);
      if (o.segment_bytes) co.segment_bytes = o.segment_bytes;
      if (o.inflight) co.segments_in_flight = o.inflight;
      if (o.sends_inflight) co.sends_in_flight = o.sends_inflight;
      if (o.small_bytes) co.small_allreduce_bytes = *o.small_bytes;
      if (o.hd_bytes) co.halving_doubling_bytes = *o.hd_bytes;
      collectives::Communicator comm(std::move(ep), co);
      if (o.op == BenchOp::kIdle) {
        run_idle_engine(comm, o, rows);
        write();
        return 0;
      }
      if (o.op == BenchOp::kQuorum) {
        // With --fault the rows come from the coordinator at the end (rank 0 may be lost),
        // and the final barrier of the rendezvous does not wait for the lost ranks.
        QuorumOutcome out = run_quorum(comm, o, rows);
        rdv.lost(out.lost);
        if (out.writer && !o.json_path.empty()) write_json(o.json_path, rows);
        if (out.wrong > 0 && out.writer)
          std::fprintf(stderr, "qring-bench: %lld wrong elements\n",
                       static_cast<long long>(out.wrong));
        return out.wrong > 0 ? 1 : 0;
      }
      QringBackend be(comm, o);
      Sweep<QringBackend> sweep(be, o);
      try {
        wrong = sweep.run();
      } catch (...) {
        rows = sweep.rows();
        throw;
      }
      rows = sweep.rows();
    }
  } catch (const collectives::Evicted&) {
    throw;  // the others went on without this rank: their coordinator writes the rows
  } catch (...) {
    write();
    throw;
  }
  write();
  if (wrong > 0) {
    if (print)
      std::fprintf(stderr, "qring-bench: %lld wrong elements\n", static_cast<long long>(wrong));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace qring::bench

int main(int argc, char** argv) {
  using namespace qring::bench;
  Options o;
  if (auto rc = parse_args(argc, argv, /*mpi=*/false, o)) return *rc;
  try {
    // The fault spec's syntax, before the rendezvous.
    if (!o.fault.empty()) bench_faults(o, 0);
  } catch (const qring::ConfigError& e) {
    std::fprintf(stderr, "qring-bench: %s\n", e.what());
    return 2;
  }
  try {
    return bench_main(o);
  } catch (const qring::ConfigError& e) {
    std::fprintf(stderr, "qring-bench: %s\n", e.what());
    return 2;
  } catch (const qring::collectives::Evicted& e) {
    // Stopped (--fault stop) past the evict time: the others went on without this rank. The
    // status qring-launch --tolerate-failures counts as a lost rank.
    std::fprintf(stderr, "qring-bench: %s\n", e.what());
    return kExitEvicted;
  } catch (const std::exception& e) {
    const char* rank = nullptr;
    for (const char* v : {"QRING_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"})
      if (!rank) rank = std::getenv(v);
    std::fprintf(stderr, "qring-bench: rank %s: error: %s\n", rank ? rank : "?", e.what());
    return 3;
  }
}
