#include "collectives/engine.h"

#include "collectives/shape.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>

namespace qring::collectives {

void Work::finish(std::exception_ptr err) {
  error_ = std::move(err);
  if (on_finish_) on_finish_(error_);
  state_.store(1, std::memory_order_release);
  state_.notify_all();
}

void Work::wait() {
  // Drive the engine from this thread while it is free (no hand-off latency for small
  // operations), then block and let the engine thread finish the work. Pure polling only
  // while this node has a core per rank: on an oversubscribed node every unproductive poll
  // yields, so the rank that has the message to send gets the core.
  auto done_now = [this] { return done(); };
  if (engine_) {
    Help how;
    how.idle_polls = 4000;
    engine_->drive_until(done_now, Deadline::max(), how);
    if (!done() && engine_->clock().drives_engines()) {
      std::mutex mu;
      std::condition_variable cv;
      std::unique_lock<std::mutex> lock(mu);
      engine_->clock().wait_until(lock, cv, Deadline::max(), done_now);
    }
  }
  while (!done()) state_.wait(0, std::memory_order_acquire);
  if (error_) std::rethrow_exception(error_);
}

bool Engine::drive_until(const std::function<bool()>& done, Deadline deadline, const Help& how) {
  if (clock_->drives_engines()) return done();
  begin_help();
  const int spin = oversubscribed_ ? 0 : 100;
  auto last = now();
  bool met = false;
  const bool block = bells_ && oversubscribed_;
  for (int idle = 0;; ++idle) {
    // Traffic after this ends the wait below at once.
    const uint32_t token = block ? ep_->traffic_token() : 0;
    if (try_progress()) {
      if ((met = done())) break;
      idle = 0;
      last = now();
      continue;
    }
    if (idle % how.look_every == how.look_every - 1) {
      if ((met = done())) break;
      if (idle >= how.idle_polls) break;
      const bool timed = how.idle_time != std::chrono::microseconds::max();
      if (timed || deadline != Deadline::max()) {
        const auto t = now();
        if ((timed && t - last > how.idle_time) || t >= deadline) break;
      }
    }
    if (block)
      ep_->wait_traffic(token, kBellWait);  // no core taken from ranks that compute
    else if (idle >= spin)
      sched_yield();
  }
  // Hand unfinished work to the engine thread. Finished: with wake_if_busy, still when other
  // operations that are not passive remain; otherwise the engine reaps what is left on its own
  // pass (end_help's wake-up of the last helper) and the caller keeps its core.
  const bool busy = active_count_.load(std::memory_order_acquire) != 0 &&
                    !all_passive_.load(std::memory_order_acquire);
  end_help(!met || (how.wake_if_busy && busy));
  return met;
}

Engine::Engine(std::unique_ptr<net::Endpoint> ep, const CommOptions& opts)
    : ep_(std::move(ep)),
      rank_(ep_->rank()),
      size_(ep_->world_size()),
      provider_(ep_->provider()),
      traits_(ep_->traits()),
      clock_keep_(opts.clock),
      clock_(clock_keep_ ? clock_keep_.get() : &system_time()),
      prober_(rank_, size_,
              std::clamp(opts.timeout / 4, std::chrono::milliseconds(50),
                         std::chrono::milliseconds(500))),
      ops_(*ep_, *clock_, rank_) {
  reduce_threads_ = opts.reduce_threads;
  oversubscribed_ = opts.local_size > static_cast<int>(std::thread::hardware_concurrency());
  bells_ = ep_->wakes_on_traffic();
  if (reduce_threads_ <= 0) {
    int hw = static_cast<int>(std::thread::hardware_concurrency());
    reduce_threads_ = std::max(1, hw / std::max(1, opts.local_size));
  }
  if (clock_->drives_engines())
    clock_->attach(this, [this] { return try_progress(); });
  else
    thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  notify_engine(true);
  if (thread_.joinable()) {
    thread_.join();
  } else {
    clock_->detach(this);
    shut_down();
  }
  // Close the endpoint (cancelling its posted receives) before the buffers those receives
  // point into — control messages, scratch — are freed with the other members.
  ep_.reset();
}

std::string Engine::broken_reason() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
  return broken_reason_;
}

WorkPtr Engine::submit(std::unique_ptr<EngineOp> op, bool wake,
                       std::function<void(const std::exception_ptr&)> on_finish) {
  auto work = std::make_shared<Work>(this, std::move(on_finish));
  op->work = work;
  op->submitted = now();
  if (pass_thread_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    // From an op's advance: it starts now (a quorum step's reduction right after the
    // decision) and advances at the end of this pass, not one pass later.
    if (broken_.load())
      throw UsageError(fmt::format("rank {}: {} #{} refused: the communicator is broken",
                                   rank_, op->name(), op->seq));
    ops_.spawn(std::move(op));
    return work;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.load()) {
      throw UsageError(fmt::format("rank {}: {} #{} refused: the communicator is broken ({})",
                                   rank_, op->name(), op->seq, broken_reason_));
    }
    if (stop_) throw UsageError("communicator is shutting down");
    incoming_.push_back(std::move(op));
    kicked_ = wake || kicked_;
  }
  if (wake) notify_engine();
  return work;
}

void Engine::run(const std::function<void(net::Endpoint&)>& fn) {
  if (!thread_.joinable()) {
    // No engine thread (the clock drives the engines): the caller is the only one here.
    std::lock_guard<std::mutex> plock(progress_mu_);
    fn(*ep_);
    return;
  }
  auto done = std::make_shared<Work>(nullptr);
  std::function<void(net::Endpoint&)> wrapped = [&fn, done](net::Endpoint& ep) {
    try {
      fn(ep);
      done->finish(nullptr);
    } catch (...) {
      done->finish(std::current_exception());
    }
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back(std::move(wrapped));
    kicked_ = true;
  }
  notify_engine();
  done->wait();
}

void Engine::fail_all(const std::string& reason, std::exception_ptr err) {
  prober_.forget();
  std::vector<std::unique_ptr<EngineOp>> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.load()) {
      broken_reason_ = reason;
      broken_.store(true, std::memory_order_release);
    }
    for (auto& op : incoming_) queued.push_back(std::move(op));
    incoming_.clear();
  }
  ops_.fail_all(std::move(queued), err ? err : std::make_exception_ptr(IoError(reason)));
}

void Engine::reset_peer(int peer, const std::string& published, uint32_t incarnation) {
  ep_->reset_peer(peer, published, incarnation);
  prober_.reset_peer(*ep_, peer);
}

void Engine::end_help(bool hand_over) {
  const bool last = helpers_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  if (hand_over) {
    kick();
  } else if (last && active_count_.load(std::memory_order_acquire) != 0) {
    // Taking the lock orders this with the engine's check of its wait predicate: no lost
    // wake-up.
    { std::lock_guard<std::mutex> lock(mu_); }
    notify_engine();
  }
}

void Engine::kick() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kicked_ = true;
  }
  notify_engine();
}

void Engine::notify_engine(bool all) {
  if (all)
    cv_.notify_all();
  else
    cv_.notify_one();
  if (bells_) ep_->wake();
}

// The engine thread's short sleeps while operations are active: on the condition variable, or
// where the endpoint wakes on traffic (net::Endpoint::wait_traffic) in the kernel until a peer
// sends, a caller kicks (notify_engine rings this process's doorbell too) or `max` passes.
// `token`: the endpoint's traffic token from before the pass that found nothing to do.
template <typename Pred>
void Engine::rest(uint32_t token, std::chrono::nanoseconds max, Pred woken) {
  if (bells_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (woken()) return;
    }
    ep_->wait_traffic(token, max);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, max, woken);
}

// Waiting for peers with operations active: poll, then yield, then sleep with net::Backoff's
// doubling timeouts, but on the condition variable, so new work (kick) wakes the engine at once.
// With a doorbell nothing needs polling: it blocks at once, for at least kBellWait.
void Engine::idle_wait(net::Backoff& backoff, uint32_t token) {
  auto sleep = backoff.next_sleep();
  if (bells_) sleep = std::max<std::chrono::nanoseconds>(sleep, kBellWait);
  if (sleep.count() == 0) {
    sched_yield();
    return;
  }
  rest(token, sleep, [&] { return kicked_ || stop_; });
}

// One pass over everything the engine does. Caller: holds progress_mu_.
bool Engine::step() {
  pass_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  struct Leave {
    std::atomic<std::thread::id>& t;
    ~Leave() { t.store(std::thread::id(), std::memory_order_relaxed); }
  } leave{pass_thread_};
  std::vector<std::function<void(net::Endpoint&)>> calls;
  std::vector<std::unique_ptr<EngineOp>> starting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& op : incoming_) starting.push_back(std::move(op));
    incoming_.clear();
    for (auto& c : calls_) calls.push_back(std::move(c));
    calls_.clear();
  }
  for (auto& c : calls) c(*ep_);

  bool moved = !starting.empty() || !calls.empty();
  if (ops_.closed()) {
    // Broken for good: nothing is sent or received any more.
    if (!starting.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& op : starting) incoming_.push_front(std::move(op));
      }
      fail_all(broken_reason(), nullptr);
    }
    active_count_.store(ops_.size(), std::memory_order_release);
    return moved;
  }
  if (!start_and_advance(starting, moved)) return true;
  diagnose(&moved);
  active_count_.store(ops_.size(), std::memory_order_release);
  all_passive_.store(ops_.all_passive(), std::memory_order_release);
  return moved;
}

// step(): deadlines, failed ops, finished ops, and the liveness probe of an op that timed out:
// the first op past its deadline that breaks the communicator starts one, and its verdict
// fails every op (unless the op finished while the peers answered).
void Engine::diagnose(bool* moved) {
  if (!ops_.empty() && !prober_.probed()) {
    std::string reason;
    if (EngineOp* op = ops_.check_deadlines(now(), &reason)) {
      if (size_ > 1) {
        prober_.probe(*ep_, *op, reason, ops_.last_started(), now());
      } else {
        spdlog::error("{}", reason);
        fail_all(reason, std::make_exception_ptr(CollectiveTimeout(reason)));
        return;
      }
    }
  }
  *moved |= ops_.retire();
  *moved |= ops_.reap();
  if (!prober_.probed()) return;
  if (!ops_.contains(prober_.probed())) {
    prober_.forget();
  } else if (auto verdict = prober_.verdict(now())) {
    spdlog::error("{}", *verdict);
    fail_all(*verdict, std::make_exception_ptr(CollectiveTimeout(*verdict)));
  }
}

// step(): starts the new ops and advances every active one. Returns false when one failed
// (fail_all has failed them all).
bool Engine::start_and_advance(std::vector<std::unique_ptr<EngineOp>>& starting, bool& moved) {
  try {
    prober_.start(*ep_);
    ops_.start(starting);
    moved |= ep_->progress() > 0;
    moved |= prober_.poll(*ep_, ops_.last_started(), ops_.last_shape(), broken());
    moved |= ops_.advance();
  } catch (const ShapeMismatch& e) {
    // Tell every rank, so that those this rank's ring never talked to fail as well.
    if (!ops_.closed())
      prober_.tell_mismatch(*ep_, *clock_, rank_, e.seq(), e.peer(), e.mine(), e.theirs());
    spdlog::error("{}", e.what());
    fail_all(e.what(), std::current_exception());
    return false;
  } catch (const MismatchNotice& e) {
    if (!ops_.closed())
      prober_.tell_mismatch(*ep_, *clock_, e.origin, e.seq, e.peer, e.mine, e.theirs);
    spdlog::error("{}", e.what());
    fail_all(e.what(), std::current_exception());
    return false;
  } catch (const std::exception& e) {
    // Most errors name this rank already.
    const std::string self = fmt::format("rank {}:", rank_);
    std::string reason = std::string(e.what()).rfind(self, 0) == 0
                             ? std::string(e.what())
                             : fmt::format("{} {}", self, e.what());
    spdlog::error("{}", reason);
    fail_all(reason, std::current_exception());
    return false;
  }
  return true;
}

bool Engine::try_progress() {
  std::unique_lock<std::mutex> lock(progress_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  return step();
}

void Engine::loop() {
  net::Backoff backoff;
  int passive_passes = 0;
  while (true) {
    if (helpers_.load(std::memory_order_acquire) > 0) {
      // A caller drives progress itself (Work::wait); stay out of its way until it leaves.
      // The last caller to leave wakes this wait when something is left to do (end_help,
      // from Work::wait and the quorum's help_progress); the timeout is only a backstop, long
      // enough that its wake-ups do not preempt a rank that copies or reduces on an
      // oversubscribed node (measurements: docs/benchmarks.md, "The numbers behind the defaults").
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20),
                   [&] { return stop_ || helpers_.load(std::memory_order_acquire) == 0; });
      if (stop_) break;
      continue;
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (active_count_.load(std::memory_order_acquire) == 0 && incoming_.empty() &&
          calls_.empty() && !stop_) {
        // Idle: sleep, waking now and then to answer peers' liveness probes.
        // A kick (a caller handing an operation it started back to the engine) or an
        // operation started by a caller ends the sleep too.
        cv_.wait_for(lock, std::chrono::milliseconds(size_ > 1 ? 20 : 1000), [&] {
          return stop_ || kicked_ || !incoming_.empty() || !calls_.empty() ||
                 active_count_.load(std::memory_order_acquire) != 0;
        });
      }
      if (kicked_) {
        backoff.reset();
        passive_passes = 0;
      }
      kicked_ = false;
      if (stop_) break;
    }
    // Traffic from here on ends the rests below (taken before the pass that may find none).
    const uint32_t token = bells_ ? ep_->traffic_token() : 0;
    bool moved;
    {
      std::lock_guard<std::mutex> plock(progress_mu_);
      moved = step();
    }
    if (moved) {
      backoff.reset();
      passive_passes = 0;
    } else if (all_passive_.load(std::memory_order_acquire)) {
      // Only standing receives: look after 250 us, then every 0.5, 1, 2 ms (what the first
      // READY of a step, or a DECIDE, may wait to be noticed while this rank's own thread
      // computes; once a step is open the service is no longer passive). Waking more often
      // costs the computing threads context switches. A kick (new work from this rank's
      // caller) ends the sleep at once.
      backoff.reset();
      auto sleep = std::chrono::microseconds(250 << std::min(passive_passes++, 3));
      rest(token, sleep,
           [&] { return kicked_ || stop_ || !incoming_.empty() || !calls_.empty(); });
    } else if (active_count_.load(std::memory_order_acquire) != 0) {
      idle_wait(backoff, token);
    }
  }
  shut_down();
}

// Fails what is left so no caller waits forever.
void Engine::shut_down() {
  std::lock_guard<std::mutex> plock(progress_mu_);
  bool pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending = !ops_.empty() || !incoming_.empty();
  }
  if (pending)
    fail_all(fmt::format("rank {}: communicator destroyed with operations pending", rank_),
             nullptr);
}

}  // namespace qring::collectives
