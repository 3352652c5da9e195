// qring-bench --op quorum: the quorum all-reduce timed step by step under an injected straggler
// model, optionally beside full sync (--compare-full) and the plain all-reduce
// (--compare-allreduce), with faults (--fault) played at named steps. See quorum_bench.h.
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
#include "collectives/quorum/quorum.h"
#include "collectives/straggler.h"
#include "net/rendezvous/bootstrap.h"
#include "net/transport/endpoint.h"
#include "net/transport/fabric_endpoint.h"
#include "collectives/bench/quorum_bench.h"

namespace qring::bench {
namespace {

using net::Clock;

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
              const std::vector<collectives::FaultSpec>& faults, const FaultFirer& firer)
      : comm(comm),
        o(o),
        count(count),
        model(model),
        qa(qa),
        qo(qo),
        paired(paired),
        faults(faults),
        buf(count * ts),
        buf2(paired ? count * ts : 0),
        first_timed(firer.first_timed),
        maybe_fault(firer) {
    comm.register_buffer(buf.data(), buf.size);
    if (paired) comm.register_buffer(buf2.data(), buf2.size);
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
    barrier_of_every_rank();
    bool more = false;
    for (int s = 0; s < o.warmup + o.iters || more; ++s, ++step) {
      if (s == o.warmup) barrier_of_every_rank();  // before any fault: every rank is there
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
    st.printer = qa.membership().coordinator() == rank;
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

  // A barrier of every rank that ends with the view change: with --fault a rank may be
  // evicted before any fault fired (silent for evict on a loaded node), and a barrier that
  // waited for it would end only at the communicator's timeout. The run stops instead, within
  // the evict time, naming the rank: its faults would not be the only ranks lost.
  void barrier_of_every_rank() {
    if (!faulty) return comm.barrier();
    collectives::WorkPtr w = comm.barrier_async();
    while (!w->done()) {
      for (const auto& v : qa.membership().view_changes())
        for (const auto& l : v.left)
          throw collectives::QuorumLost(
              fmt::format("rank {}: --fault: rank {} left the view before the timed steps, "
                          "before any fault fired ({}: last heard {:.0f} ms before); the run "
                          "measures the faults it was given, so it stops",
                          rank, l.rank, l.why, l.silent_ms),
              {l.rank});
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    w->wait();  // its error, if it failed
  }

  // When rank r fell silent, on this rank's clock, if it left the view: `silent_ms` before
  // this rank applied the view change (the coordinator's silence, exact whatever the phase).
  std::optional<Clock::time_point> fell_silent(int r) const {
    for (const auto& v : qa.membership().view_changes())
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
    const auto members = qa.membership().members();
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
    const auto members = members_at(qa.membership().view_changes(), r.epoch, n);
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
    const auto views = qa.membership().view_changes();
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
    for (const auto& v : qa.membership().view_changes()) {
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
  std::shared_ptr<std::atomic<uint64_t>> first_timed;
  const FaultFirer maybe_fault;
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
  // ends. `settle` is 2 s at least: a stopped rank resumes late on a loaded node (its waker is
  // a process like any other; at a load of 22 on 2 cores one came back ~1 s after its pause,
  // when the others had ended, and found no coordinator to tell it it was evicted).
  const std::chrono::milliseconds evict = qo.evict;
  const std::chrono::milliseconds settle =
      std::max<std::chrono::milliseconds>(std::chrono::milliseconds(2000), evict);
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
  collectives::QuorumOptions qo = bench_quorum_options(o, q);
  const FaultFirer firer{faults, std::make_shared<std::atomic<uint64_t>>(UINT64_MAX), comm.rank(),
                         std::make_shared<std::vector<std::atomic<bool>>>(faults.size()),
                         &comm.engine()};
  // Faults of phase "ring" fire on the engine, at the reduction's first move.
  if (std::any_of(faults.begin(), faults.end(), [](const auto& f) { return f.phase == "ring"; }))
    qo.on_phase = firer;
  collectives::QuorumAllreduce qa(comm, count, qo);
  if (!faults.empty() && !qa.membership().survives_loss())
    throw ConfigError(fmt::format(
        "--fault: quorum {} of {} ranks leaves no room to lose a rank (use --quorum {} or less)",
        q, n, n - 1));
  QuorumSteps steps(comm, o, count, model, qa, qo, paired, faults, firer);
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

}  // namespace

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


namespace {

// The lines above the rows of --op quorum (rank 0).
void print_quorum_header(collectives::Communicator& comm, const Options& o, int q,
                         const collectives::StragglerModel& model,
                         const std::vector<collectives::FaultSpec>& faults) {
  const int n = comm.size();
  std::printf(
      "# quorum all-reduce: %d ranks, provider %s, quorum %s, grace %ld ms, deadline "
      "%ld ms, straggler %s (seed %llu), dtype %s, redop %s, %d steps + %d warm-up, wait "
      "%s\n",
      n, comm.provider().c_str(), q > 0 ? std::to_string(q).c_str() : "auto", o.grace_ms,
      o.deadline_ms, model.spec().c_str(),
      static_cast<unsigned long long>(o.seed), std::string(dtype_name(o.dtype)).c_str(),
      o.redop == RedOp::kAvg ? "avg" : "sum", o.iters, o.warmup,
      o.block ? "block" : "poll");
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
                   {"iters", s.steps},
                   {"step_us", s.lat_us}};  // per timed step, in order: where the tail lies
  return j;
}

}  // namespace

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

}  // namespace qring::bench
