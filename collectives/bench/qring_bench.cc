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
// --op quorum (quorum_bench.h) --fault kill:RANK:STEP[:PHASE] | stop:RANK:STEP:MS[:PHASE] (comma list;
// collectives/fault_inject.h) kills or stops a rank at timed step STEP of the first size. The
// loop goes on until the fault played out, the statistics are reduced among the live members
// only and the coordinator at the end prints recovery_s, p50/p99 before the fault and after
// the recovery and the slowest step in between. A killed rank dies; a stopped rank evicted
// meanwhile exits 75 (qring-launch --tolerate-failures K then exits 100 + lost ranks).
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/bench/bench_common.h"
#include "collectives/bench/quorum_bench.h"
#include "collectives/communicator.h"
#include "collectives/engine.h"
#include "collectives/fault_inject.h"
#include "collectives/quorum/quorum.h"
#include "collectives/session.h"
#include "collectives/straggler.h"
#include "net/rendezvous/bootstrap.h"
#include "net/transport/endpoint.h"

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
  QringBackend(collectives::Communicator& comm, const Options& o, std::vector<RankInfo> ranks)
      : comm_(comm), o_(o), ranks_(std::move(ranks)) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  std::string provider() const { return comm_.provider(); }
  void barrier() { comm_.barrier(); }
  double reduce_over_ranks(double v, RedOp op) {
    double out = 0;
    comm_.allreduce(&v, &out, 1, DataType::kFloat64, op);
    return out;
  }
  std::vector<RankInfo> rank_infos() const { return ranks_; }
  std::string algorithm(BenchOp op, size_t bytes) const {
    switch (op) {
      case BenchOp::kAllreduce:
        return collectives::allreduce_algorithm(comm_.options(), bytes, size_t(size()));
      case BenchOp::kBroadcast:
        return "chain";  // pipelined from the root along the ring
      case BenchOp::kBarrier:
        return "dissem";
      default:
        return "ring";
    }
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
  std::vector<RankInfo> ranks_;
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

int64_t run_sendrecv(Endpoint& ep, const Options& o, const std::vector<RankInfo>& ranks,
                     std::vector<nlohmann::json>& rows) {
  const int n = ep.world_size();
  const int rank = ep.rank();
  if (n < 2) throw ConfigError("--op sendrecv needs at least 2 ranks");
  const int peer = (rank ^ 1) < n ? (rank ^ 1) : -1;  // the last rank of an odd world idles
  const bool initiator = rank % 2 == 0;
  const size_t ts = dtype_bytes(o.dtype);
  if (rank == 0) {
    std::fputs(rank_block("qring-bench", ranks).c_str(), stdout);
    std::fputs(table_header(BenchOp::kSendRecv, o, n, ep.provider()).c_str(), stdout);
    if (n % 2) std::printf("# rank %d has no partner and only takes part in the reports\n", n - 1);
  }
  AlignedBuffer sbuf(o.max_bytes), rbuf(o.max_bytes);
  ep.register_memory(sbuf.data(), sbuf.size);
  ep.register_memory(rbuf.data(), rbuf.size);
  JsonContext ctx{"sendrecv", std::string(dtype_name(o.dtype)), "none", n, ep.provider(), o.iters,
                  o.warmup, average_key(o.average)};
  PingPong pp(ep, o);
  int64_t total_wrong = 0;
  double bw_sum = 0;
  int bw_rows = 0;
  uint64_t row = 0;
  for (size_t bytes : sweep_sizes(o)) {
    RowKey k;
    k.count = k.count_per_rank = bytes / ts;
    k.bytes = k.count * ts;
    k.algo = "pingpong";
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
    std::vector<double> times;  // of the ranks with a partner
    for (size_t r = 0; r < all.size(); ++r) {
      if ((int(r) ^ 1) < n) times.push_back(all[r].value);
      if (o.check) m.wrong += all[r].wrong;
    }
    m.time_us = combine_times(times, o.average);
    m.algbw = m.time_us > 0 ? double(k.bytes) / (m.time_us * 1e-6) / 1e9 : 0.0;
    m.busbw = m.algbw;
    bw_sum += m.busbw;
    ++bw_rows;
    total_wrong += std::max<int64_t>(0, m.wrong);
    std::fputs(format_row(k, dtype_name(o.dtype), "none", m, std::nullopt).c_str(), stdout);
    std::fflush(stdout);
    auto j = json_row(ctx, k, m);
    j["method"] = "pingpong_half_round_trip";
    rows.push_back(std::move(j));
  }
  if (rank == 0) std::fputs(table_footer(total_wrong, bw_sum, bw_rows).c_str(), stdout);
  std::fflush(stdout);
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

// ------------------------------------------------------------------ main

// The settings that decide what every rank computes and how long it waits (issue 44): ranks
// that disagree on them -- a --quorum or --deadline-ms given to one node only -- would
// measure something other than asked, or fail at a deadline. The provider is compared when
// the endpoints connect, the communicator's own settings when it forms; --json, --timeout-ms
// and the pacing of a rank's own traffic may differ.
std::vector<std::pair<std::string, std::string>> agreed_settings(const Options& o) {
  return {{"--op", std::string(op_name(o.op))},
          {"--minbytes", std::to_string(o.min_bytes)},
          {"--maxbytes", std::to_string(o.max_bytes)},
          {"--stepfactor", std::to_string(o.factor)},
          {"--iters", std::to_string(o.iters)},
          {"--warmup_iters", std::to_string(o.warmup)},
          {"--auto-iters", fmt::format("{}", o.auto_seconds)},
          {"--check", o.check ? "1" : "0"},
          {"--dtype", std::string(dtype_name(o.dtype))},
          {"--redop", std::string(redop_name(o.redop))},
          {"--root", std::to_string(o.root)},
          {"--seconds", fmt::format("{}", o.seconds)},
          {"--quorum", o.quorum.empty() ? "(the world)" : o.quorum},
          {"--grace-ms", std::to_string(o.grace_ms)},
          {"--deadline-ms", std::to_string(o.deadline_ms)},
          {"--evict-ms", std::to_string(o.evict_ms)},
          {"--straggler", o.straggler},
          {"--seed", std::to_string(o.seed)},
          {"--compare-full", o.compare_full ? "1" : "0"},
          {"--compare-allreduce", o.compare_allreduce ? "1" : "0"},
          {"--fault", o.fault.empty() ? "(none)" : o.fault}};
}

// Every rank's agreed_settings(), gathered; a ConfigError on every rank naming each setting
// that differs from rank 0's, with both values.
void check_settings_agree(collectives::Communicator& comm, const Options& o) {
  std::string text;
  for (const auto& [k, v] : agreed_settings(o)) text += k + "=" + v + "\n";
  const int world = comm.size();
  const int64_t mine = int64_t(text.size());
  std::vector<int64_t> sizes(static_cast<size_t>(world));
  comm.allgather(&mine, sizes.data(), 1, DataType::kInt64);
  const size_t words = size_t(*std::max_element(sizes.begin(), sizes.end()) + 7) / 8;
  std::vector<int64_t> packed(words, 0), all(words * size_t(world));
  std::memcpy(packed.data(), text.data(), text.size());
  comm.allgather(packed.data(), all.data(), words, DataType::kInt64);
  auto text_of = [&](int r) {
    const char* p = reinterpret_cast<const char*>(all.data() + size_t(r) * words);
    return std::string(p, size_t(sizes[size_t(r)]));
  };
  auto lines = [](const std::string& t) {
    std::vector<std::string> out;
    for (size_t at = 0, nl; (nl = t.find('\n', at)) != std::string::npos; at = nl + 1)
      out.push_back(t.substr(at, nl - at));
    return out;
  };
  const auto ref = lines(text_of(0));
  std::vector<std::string> diffs;
  for (int r = 1; r < world; ++r) {
    const auto theirs = lines(text_of(r));
    for (size_t i = 0; i < std::min(ref.size(), theirs.size()); ++i) {
      if (ref[i] == theirs[i]) continue;
      const size_t eq = ref[i].find('=');
      diffs.push_back(fmt::format("{} is '{}' on rank {} and '{}' on rank 0", ref[i].substr(0, eq),
                                  theirs[i].substr(eq + 1), r, ref[i].substr(eq + 1)));
    }
  }
  if (!diffs.empty())
    throw ConfigError(fmt::format("rank {}: the ranks' settings differ: {} (every rank needs the "
                                  "same qring-bench arguments)",
                                  comm.rank(), fmt::join(diffs, "; ")));
}

// Every rank's pid and host, at rank 0 (empty elsewhere): each rank publishes its pid in the
// rendezvous store; the hosts are the rendezvous'.
std::vector<RankInfo> gather_rank_infos(net::Rendezvous& rdv, const net::BootstrapInfo& info,
                                        net::Deadline deadline) {
  rdv.store().set(fmt::format("bench/pid/{}", info.rank), std::to_string(getpid()));
  std::vector<RankInfo> ranks;
  if (info.rank != 0) return ranks;
  for (int r = 0; r < info.world_size; ++r) {
    RankInfo ri;
    ri.rank = r;
    ri.pid = std::stol(rdv.store().get(fmt::format("bench/pid/{}", r), deadline));
    ri.host = rdv.hostnames()[size_t(r)];
    ranks.push_back(std::move(ri));
  }
  return ranks;
}

int bench_main(const Options& o) {
  const net::BootstrapInfo launch = net::detect_bootstrap();
  // The rank that writes --json checks it can before anything runs (with --fault the
  // coordinator at the end writes, which may be any rank).
  if (!o.json_path.empty() && (launch.rank == 0 || !o.fault.empty()))
    cli::check_output_path("--json", o.json_path);
  // One call from the environment to the endpoint and communicator (collectives/session.h);
  // sendrecv and idle-through-the-endpoint drive the endpoint alone.
  collectives::SessionOptions so;
  so.provider = o.provider.empty() ? "auto" : o.provider;
  so.setup_timeout = std::chrono::seconds(30);
  so.communicator =
      !(o.op == BenchOp::kSendRecv || (o.op == BenchOp::kIdle && o.idle_via_endpoint));
  so.comm.timeout = std::chrono::milliseconds(o.timeout_ms);
  if (o.segment_bytes) so.comm.segment_bytes = o.segment_bytes;
  if (o.inflight) so.comm.segments_in_flight = o.inflight;
  if (o.sends_inflight) so.comm.sends_in_flight = o.sends_inflight;
  if (o.small_bytes) so.comm.small_allreduce_bytes = *o.small_bytes;
  if (o.hd_bytes) so.comm.halving_doubling_bytes = *o.hd_bytes;
  so.doorbells = o.block;
  collectives::Session session(launch, so);
  const net::BootstrapInfo& info = session.info();
  const std::vector<RankInfo> ranks = gather_rank_infos(
      session.rendezvous(), info, net::deadline_in(std::chrono::seconds(30)));
  const bool print = info.rank == 0;
  std::vector<nlohmann::json> rows;
  int64_t wrong = 0;
  std::vector<RankInfo> all_hosts;  // every rank's host, for the JSON rows
  for (int r = 0; r < info.world_size; ++r)
    all_hosts.push_back({r, 0, session.rendezvous().hostnames()[size_t(r)]});
  auto stamp_and_write = [&](bool writer) {
    if (!writer || o.json_path.empty()) return;
    add_provenance(rows, all_hosts);
    write_json(o.json_path, rows);
  };
  auto write = [&] { stamp_and_write(print); };
  if (print && (o.op == BenchOp::kIdle || o.op == BenchOp::kQuorum))
    std::fputs(rank_block("qring-bench", ranks).c_str(), stdout);
  try {
    if (o.op == BenchOp::kSendRecv) {
      wrong = run_sendrecv(*session.take_endpoint(), o, ranks, rows);
    } else if (o.op == BenchOp::kIdle && o.idle_via_endpoint) {
      run_idle_endpoint(*session.take_endpoint(), o, rows);
    } else {
      collectives::Communicator& comm = session.comm();
      check_settings_agree(comm, o);
      if (o.op == BenchOp::kIdle) {
        run_idle_engine(comm, o, rows);
        write();
        return 0;
      }
      if (o.op == BenchOp::kQuorum) {
        // With --fault the rows come from the coordinator at the end (rank 0 may be lost),
        // and the final barrier of the rendezvous does not wait for the lost ranks.
        QuorumOutcome out = run_quorum(comm, o, rows);
        session.lost(out.lost);
        stamp_and_write(out.writer);
        if (out.wrong > 0 && out.writer)
          std::fprintf(stderr, "qring-bench: %lld wrong elements\n",
                       static_cast<long long>(out.wrong));
        return out.wrong > 0 ? 1 : 0;
      }
      QringBackend be(comm, o, ranks);
      Sweep<QringBackend> sweep(be, o);
      try {
        wrong = sweep.run("qring-bench");
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
