// The quorum all-reduce's caller side (quorum.h): contribute, wait, excluded. The protocol
// runs in the member service on the engine (member.h and the rooms it lists).
//
//   contribute(t) ──READY(t, r)──▶ coordinator (the coordinator's engine, even while it computes)
//                                   decides S(t): all W arrived, or Q arrived and the grace
//                                   passed; fewer than Q by first READY + H → FAIL
//   every rank ◀──DECIDE(t, S, offsets)──
//   ranks in S(t): ring all-reduce among themselves, in place in the contributed buffers
//   rank x ∉ S(t): receives the result from member S[x mod |S|] into an internal buffer
#include "collectives/quorum/quorum.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "collectives/engine.h"
#include "collectives/quorum/coordinator.h"
#include "collectives/quorum/join_agent.h"
#include "collectives/quorum/member.h"
#include "collectives/quorum/membership_box.h"
#include "collectives/quorum/report_box.h"
#include "collectives/quorum/steps.h"
#include "collectives/reduce.h"

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
    q = static_cast<int>(quorum_of_fraction(v, world));
  } else {
    q = static_cast<int>(v);
  }
  if (q < 1 || q > world)
    throw ConfigError(
        fmt::format("quorum {} out of range [1, {}] for {} ranks", spec, world, world));
  return q;
}

namespace {
bool survives_loss(const QuorumOptions& o, int w) {
  qproto::Config c;
  c.quorum = o.fraction > 0 ? 0 : o.quorum;
  c.fraction = o.fraction;
  c.min_world = o.min_world;
  return w > 1 && qproto::floor_for(c, w - 1) <= w - 1;
}
}  // namespace

QuorumAllreduce::QuorumAllreduce(Communicator& comm, size_t count, QuorumOptions opts)
    : comm_(comm), count_(count), opts_(opts) {
  const int w = comm.size();
  if (opts_.fraction < 0 || opts_.fraction > 1)
    throw ConfigError(fmt::format("quorum fraction {} must be in (0, 1]", opts_.fraction));
  if (opts_.fraction > 0) {
    qproto::Config c;
    c.fraction = opts_.fraction;
    opts_.quorum = qproto::quorum_for(c, w);
  }
  if (opts_.quorum == 0) opts_.quorum = w;
  if (opts_.evict.count() <= 0) throw ConfigError("quorum evict time must be > 0");
  if (opts_.evict_steps < 0) throw ConfigError("quorum evict_steps must be >= 0");
  if (opts_.min_world < 0 || opts_.min_world > w)
    throw ConfigError(
        fmt::format("quorum min_world {} out of range [0, {}]", opts_.min_world, w));
  if (opts_.quorum < 1 || opts_.quorum > w)
    throw ConfigError(fmt::format("quorum {} out of range [1, {}]", opts_.quorum, w));
  if (opts_.adaptive && (opts_.fraction > 0 || opts_.auto_max < 0 || opts_.auto_max > w ||
                         (opts_.auto_max > 0 && opts_.auto_max < opts_.quorum)))
    throw ConfigError(fmt::format("adaptive quorum: bounds [{}, {}] not within 1..{} ranks (or "
                                  "with a fraction)",
                                  opts_.quorum, opts_.auto_max, w));
  if (!(opts_.auto_kappa >= 0) || !std::isfinite(opts_.auto_kappa))
    throw ConfigError(
        fmt::format("adaptive quorum: noise scale {} must be >= 0", opts_.auto_kappa));
  if (opts_.grace.count() < 0) throw ConfigError("quorum grace must be >= 0");
  if (opts_.deadline.count() <= 0) throw ConfigError("quorum hard deadline must be > 0");
  if (opts_.deadline <= opts_.grace)
    throw ConfigError(fmt::format("quorum hard deadline ({} ms) must exceed the grace ({} ms)",
                                  opts_.deadline.count(), opts_.grace.count()));
  if (opts_.late == LatePolicy::kCarry) carry_.assign(count * dtype_size(opts_.type), 0);
  if (w > (1 << 16))
    throw ConfigError(fmt::format("the quorum all-reduce supports up to 65536 ranks, not {}", w));
  if (opts_.join && (!opts_.store || w < 2))
    throw UsageError("quorum: joining a running job needs the rendezvous store and peers");
  const uint32_t instance = opts_.instance >= 0 ? uint32_t(opts_.instance) : comm.next_seq();
  instance_ = int(instance);
  Engine& engine = comm.engine();
  const bool survives = survives_loss(opts_, w);
  steps_ = std::make_shared<StepTable>();
  membership_ = std::make_shared<MembershipBox>(engine, w, survives, opts_.join);
  reports_ = std::make_shared<ReportBox>(engine, w, *membership_);
  agent_io_ = std::make_shared<JoinAgentIo>();
  auto shutdown = std::make_shared<std::atomic<bool>>(false);
  shutdown_ = shutdown;
  if (opts_.store && w > 1 && survives) start_join_agent(instance & 0xFF);
  auto op = std::make_unique<QuorumMember>(
      engine, comm.options(), count, opts_,
      MemberBoxes{steps_, membership_, reports_, agent_io_, shutdown}, instance);
  // When the service fails (its own error, or the communicator's), every waiter is told,
  // after the engine made sure no buffer of theirs is still with the transport.
  service_ = engine.submit(
      std::move(op), true,
      [steps = steps_, membership = membership_, reports = reports_,
       rank = comm.rank()](const std::exception_ptr& err) {
        if (!err) return;
        std::exception_ptr why;
        {
          std::lock_guard<std::mutex> lock(steps->mu);
          why = steps->service_error ? steps->service_error : steps->poison;
        }
        if (!why) {
          std::string what = "unknown error";
          try {
            std::rethrow_exception(err);
          } catch (const std::exception& e) {
            what = e.what();
          }
          why = std::make_exception_ptr(IoError(fmt::format(
              "rank {}: the communicator under the quorum all-reduce failed: {}", rank, what)));
        }
        steps->fail(why);
        membership->fail(why);
        reports->fail(why);
      });
}

// The join agent (QuorumOptions::store): a joiner publishes its address for the members first
// (they fetch it when the coordinator tells them).
void QuorumAllreduce::start_join_agent(uint32_t instance) {
  uint32_t inc = 0;
  std::string address, settings;
  Engine& engine = comm_.engine();
  engine.run([&](net::Endpoint& ep) {
    inc = ep.incarnation();
    address = ep.published_address();
    settings = Communicator::settings_text(ep, comm_.options()) + opts_.agreed;
  });
  if (opts_.join) {
    if (inc == 0) throw UsageError("quorum: joining a running job as incarnation 0");
    JoinValue v;
    v.incarnation = inc;
    v.settings = settings;
    v.address = address;
    std::lock_guard<std::mutex> lock(agent_io_->mu);
    agent_io_->publish.emplace_back(join_key(instance, comm_.rank(), inc, comm_.rank()),
                                    encode_join_value(v));
  }
  agent_ = engine.clock().spawn([io = agent_io_, store = opts_.store, e = &engine,
                                 rank = comm_.rank(), w = comm_.size(), instance, inc] {
    run_join_agent(io, store, e, rank, w, instance, inc);
  });
}

QuorumAllreduce::~QuorumAllreduce() {
  Engine& engine = comm_.engine();
  if (agent_.joinable()) {
    // The job ended well here: a rank that comes back now has nothing to rejoin.
    const bool done = std::uncaught_exceptions() == 0 &&
                      membership_->coordinator() == comm_.rank() && !steps_->failed();
    if (done) record_job_end(join_done_key(uint32_t(instance_) & 0xFF, comm_.rank()), "1");
    // The job was lost here: a rank that comes back now fails at once, saying why.
    if (const std::string why = lost_reason(); !why.empty())
      record_job_end(join_lost_key(uint32_t(instance_) & 0xFF, comm_.rank()), why);
    {
      std::lock_guard<std::mutex> lock(agent_io_->mu);
      agent_io_->stop = true;
    }
    agent_io_->cv.notify_all();
    engine.clock().join(agent_);
  }
  shutdown_->store(true, std::memory_order_release);
  engine.kick();
  // A coordinator serves the members' last recoveries for at most end_grace, then the service
  // drains its sends for at most 2 s. Nothing notifies this wait: on the steady clock it looks
  // every millisecond; the virtual clock looks at `stopped` every round itself, and a clock torn
  // down (a rank frozen for good) ends the one wait at once, not after the limit's 1 ms polls.
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  const auto limit = end_grace(opts_) + std::chrono::seconds(5);
  const auto until = engine.now() + limit;
  auto stopped = [&] { return service_->done(); };
  if (engine.clock().drives_engines()) {
    engine.clock().wait_until(lock, cv, until, stopped);
  } else {
    while (!stopped() && engine.now() < until)
      engine.clock().wait_until(lock, cv, std::min(until, engine.now() + std::chrono::milliseconds(1)),
                                stopped);
  }
  if (!service_->done())
    spdlog::warn("rank {}: quorum service did not stop in {} ms", comm_.rank(), limit.count());
}

void QuorumAllreduce::record_job_end(const std::string& key, const std::string& value) {
  try {
    opts_.store->set(key, value);
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: quorum: cannot record the end of the job in the store: {}", comm_.rank(),
                 e.what());
  }
}

std::string QuorumAllreduce::lost_reason() const {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(steps_->mu);
    e = steps_->service_error ? steps_->service_error : steps_->poison;
  }
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveTimeout& lost) {  // QuorumLost, QuorumTimeout, a ring given up
    return lost.what();
  } catch (...) {
  }
  return "";
}

bool QuorumAllreduce::excluded(uint64_t step) const {
  std::lock_guard<std::mutex> lock(steps_->mu);
  auto it = steps_->steps.find(step);
  return it != steps_->steps.end() && it->second.excluded;
}

QuorumMembership& QuorumAllreduce::membership() { return *membership_; }
const QuorumMembership& QuorumAllreduce::membership() const { return *membership_; }
QuorumReports& QuorumAllreduce::reports() { return *reports_; }

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

void QuorumAllreduce::contribute(uint64_t step, void* buf, size_t count,
                                 std::optional<uint64_t> digest, std::optional<Norms> norms) {
  if (count != count_)
    throw UsageError(
        fmt::format("rank {}: quorum step {}: contribution of {} elements, this "
                    "all-reduce was set up for {}",
                    comm_.rank(), step, count, count_));
  if (!buf && count) throw UsageError("quorum contribute: null buffer");
  // Norms that are no squared norms (a diverged gradient) say nothing: not sent.
  auto sq_ok = [](double v) { return std::isfinite(v) && v >= 0; };
  if (norms && (!sq_ok(norms->contribution_sq) ||
                (norms->prev_result_sq && !sq_ok(*norms->prev_result_sq))))
    norms.reset();
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: contribution for step {}, but step {} is next",
                                 comm_.rank(), step, next_step_));
  {
    std::lock_guard<std::mutex> lock(steps_->mu);
    if (steps_->poison) std::rethrow_exception(steps_->poison);
    if (service_->done()) throw UsageError("quorum all-reduce: the service has stopped");
    StepLocal& s = steps_->steps[step];
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
    std::lock_guard<std::mutex> lock(steps_->mu);
    StepLocal& s = steps_->steps[step];
    s.buf = buf;
    s.digest = digest;
    s.norms = norms;
    s.contributed = true;
    s.contrib_time = comm_.engine().now();
    steps_->contributed.push_back(step);
  }
  // Send READY (and start a speculative ring) from this thread when the engine is free;
  // wake the engine thread only when it is busy elsewhere and might not look soon.
  if (!comm_.engine().try_progress()) comm_.engine().kick();
}

QuorumResult QuorumAllreduce::wait(uint64_t step, void* out) {
  if (!out && count_) throw UsageError("quorum wait: null output buffer");
  return wait_impl(step, out, nullptr);
}

QuorumResult QuorumAllreduce::wait(uint64_t step, View* view) {
  if (!view) throw UsageError("quorum wait: null view");
  return wait_impl(step, nullptr, view);
}

QuorumResult QuorumAllreduce::wait_impl(uint64_t step, void* out, View* view) {
  if (have_next_ && step != next_step_)
    throw UsageError(fmt::format("rank {}: wait for step {}, but step {} is next", comm_.rank(),
                                 step, next_step_));
  Engine& engine = comm_.engine();
  const auto t0 = engine.now();
  // While this rank waits anyway, it drives the engine itself for a bounded time (the decision
  // and the ring then progress without engine wake-ups), then leaves the rest to the engine
  // thread: a long wait for stragglers costs no CPU.
  auto finished = [&] {
    auto it = steps_->steps.find(step);
    return steps_->poison || (it != steps_->steps.end() && (it->second.done || it->second.error));
  };
  engine.drive_until(
      [&] {
        std::lock_guard<std::mutex> lock(steps_->mu);
        return finished();
      },
      Deadline::max(), kHelpBriefly);
  std::unique_lock<std::mutex> lock(steps_->mu);
  StepLocal& s = steps_->steps[step];
  // Last-resort guard; the engine enforces the finer deadlines and reports them first.
  const auto guard =
      (s.contributed ? s.contrib_time : t0) + 2 * opts_.deadline + std::chrono::seconds(5);
  if (!engine.clock().wait_until(lock, steps_->cv, guard, finished)) {
    auto e = std::make_exception_ptr(QuorumTimeout(
        fmt::format("rank {}: quorum step {}: no result within {} ms", comm_.rank(), step,
                    std::chrono::duration_cast<std::chrono::milliseconds>(guard - t0).count()),
        {0}));
    lock.unlock();
    steps_->fail(e);
    membership_->fail(e);
    reports_->fail(e);
    std::rethrow_exception(e);
  }
  if (s.error) std::rethrow_exception(s.error);
  if (!s.done && steps_->poison) std::rethrow_exception(steps_->poison);
  QuorumResult res = std::move(s.result);
  res.joined = std::move(s.joined);
  const size_t bytes = count_ * dtype_size(opts_.type);
  if (s.excluded && s.contributed && opts_.late == LatePolicy::kCarry) {
    // The late gradient (with anything carried into it) counts in the next contribution.
    std::memcpy(carry_.data(), s.buf, bytes);
    carry_pending_ = true;
  }
  if (view) {
    *view = View{};
    if (res.skipped) {
      // No result on any rank: the caller makes no update.
    } else if (s.out) {
      view->data = s.out->data();
      view->hold = std::shared_ptr<const void>(s.out, s.out->data());
    } else {
      view->data = s.buf;
    }
  } else if (res.skipped) {
    // No result on any rank: the caller makes no update.
  } else if (s.out) {
    if (bytes) std::memcpy(out, s.out->data(), bytes);
  } else if (out != s.buf && bytes) {
    std::memcpy(out, s.buf, bytes);
  }
  steps_->steps.erase(step);
  lock.unlock();
  res.wait_ms = ms_between(t0, engine.now());
  have_next_ = true;
  next_step_ = step + 1;
  return res;
}

}  // namespace qring::collectives
