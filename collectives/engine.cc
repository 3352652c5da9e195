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
  for (int idle = 0;; ++idle) {
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
    if (idle >= spin) sched_yield();
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
      traits_(ep_->traits()) {
  probe_window_ =
      std::clamp(opts.timeout / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(500));
  reduce_threads_ = opts.reduce_threads;
  oversubscribed_ = opts.local_size > static_cast<int>(std::thread::hardware_concurrency());
  if (reduce_threads_ <= 0) {
    int hw = static_cast<int>(std::thread::hardware_concurrency());
    reduce_threads_ = std::max(1, hw / std::max(1, opts.local_size));
  }
  clock_keep_ = opts.clock;
  clock_ = clock_keep_ ? clock_keep_.get() : &system_time();
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
  cv_.notify_all();
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
    EngineOp& a = *op;
    spawned_.push_back(std::move(op));
    if (a.sequenced) {
      last_started_ = a.seq;
      last_shape_ = a.shape();
    }
    guarded(a, [&] {
      a.start(*ep_);
      return true;
    });
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
  if (wake) cv_.notify_one();
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
  cv_.notify_one();
  done->wait();
}

Engine::Lease Engine::scratch(size_t bytes) {
  // Best fit among free buffers, else grow the largest free one, else a new one.
  size_t best = scratch_free_.size();
  for (size_t i = 0; i < scratch_free_.size(); ++i) {
    if (scratch_free_[i]->size() >= bytes &&
        (best == scratch_free_.size() || scratch_free_[i]->size() < scratch_free_[best]->size()))
      best = i;
  }
  std::unique_ptr<std::vector<char>> buf;
  if (best < scratch_free_.size()) {
    buf = std::move(scratch_free_[best]);
    scratch_free_.erase(scratch_free_.begin() + static_cast<long>(best));
  } else {
    if (!scratch_free_.empty()) {
      buf = std::move(scratch_free_.back());
      scratch_free_.pop_back();
      ep_->deregister_memory(buf->data());
    } else {
      buf = std::make_unique<std::vector<char>>();
    }
    buf->assign(bytes, 0);
    ep_->register_memory(buf->data(), buf->size());
  }
  scratch_used_.push_back(std::move(buf));
  return Lease(this, scratch_used_.back().get());
}

Engine::Lease::~Lease() {
  if (!buf_) return;
  auto& used = engine_->scratch_used_;
  for (auto it = used.begin(); it != used.end(); ++it) {
    if (it->get() == buf_) {
      engine_->scratch_free_.push_back(std::move(*it));
      used.erase(it);
      break;
    }
  }
}

void Engine::fail_all(const std::string& reason, std::exception_ptr err) {
  diag_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.load()) {
      broken_reason_ = reason;
      broken_.store(true, std::memory_order_release);
    }
    for (auto& op : incoming_) active_.push_back(std::move(op));
    incoming_.clear();
  }
  for (auto& op : spawned_) active_.push_back(std::move(op));
  spawned_.clear();
  // First every op withdraws what it posted. A receive the transport does not confirm as
  // cancelled stays posted into its buffer, and a send that never completes keeps reading
  // its buffer; once the op's Work fails its owner may free that memory, so then the
  // endpoint is closed first (the communicator is broken anyway, and refuses new work).
  for (auto& op : active_) {
    if (ep_closed_) break;  // closing ended every request
    try {
      op->abort(*ep_);
      if (op->holds_buffers())
        close_endpoint(fmt::format("{} #{} has sends in flight from its caller's buffers",
                                   op->name(), op->seq));
    } catch (const std::exception& e) {
      spdlog::warn("rank {}: abort of {} #{}: {}", rank_, op->name(), op->seq, e.what());
      close_endpoint(fmt::format("abort of {} #{} failed: {}", op->name(), op->seq, e.what()));
    }
  }
  // Ops that failed alone earlier and still send from their callers' memory: those callers
  // may free it once they hear of this failure.
  if (!ep_closed_ && drain_retired())
    close_endpoint("a failed operation has sends in flight from its caller's buffers");
  std::exception_ptr e = err;
  if (!e) e = std::make_exception_ptr(IoError(reason));
  for (auto& op : active_) op->work->finish(e);
  active_.clear();
  retire_.clear();
}

void Engine::abandon(const WorkPtr& work, Deadline until, const std::string& why) {
  EngineOp* op = nullptr;
  for (auto* ops : {&active_, &spawned_})
    for (auto& o : *ops)
      if (o->work == work) op = o.get();
  if (!op || retiring(*op)) return;
  try {
    op->abandon(*ep_, until);
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: abandoning {} #{}: {}", rank_, op->name(), op->seq, e.what());
    close_endpoint(fmt::format("abandoning {} #{} failed: {}", op->name(), op->seq, e.what()));
  }
  retire_.push_back({work, until, std::make_exception_ptr(IoError(why)), op});
}

bool Engine::holds_failed_buffers() {
  for (const auto& r : retire_)
    if (r.abandoned && r.abandoned->holds_buffers()) return true;
  return drain_retired();
}

void Engine::fail_op(std::unique_ptr<EngineOp> op, Deadline until, std::exception_ptr err,
                     bool abandoned) {
  try {
    if (!abandoned) op->abandon(*ep_, until);
  } catch (const std::exception& e) {
    // A receive the transport did not let go of: only closing the endpoint frees its buffer.
    spdlog::warn("rank {}: abandoning {} #{}: {}", rank_, op->name(), op->seq, e.what());
    close_endpoint(fmt::format("abandoning {} #{} failed: {}", op->name(), op->seq, e.what()));
  }
  WorkPtr work = op->work;
  if (op->holds_buffers() && !ep_closed_) draining_.push_back(std::move(op));
  work->finish(err);
}

// step(): the ops abandoned in this pass (Engine::abandon) and those of kFailsOp that failed
// in it leave the active ones.
void Engine::retire_failed() {
  std::vector<Retire> todo;
  todo.swap(retire_);
  for (auto& r : todo) {
    auto it = std::find_if(active_.begin(), active_.end(),
                           [&](const auto& op) { return op->work == r.work; });
    if (it == active_.end()) continue;  // finished, or retired already
    std::unique_ptr<EngineOp> op = std::move(*it);
    active_.erase(it);
    fail_op(std::move(op), r.until, r.err, r.abandoned != nullptr);
  }
}

// Forgets the failed ops whose sends completed; true when one still holds its buffers.
bool Engine::drain_retired() {
  std::erase_if(draining_, [](const auto& op) { return !op->holds_buffers(); });
  return !draining_.empty();
}

void Engine::close_endpoint(const std::string& why) {
  if (ep_closed_) return;
  spdlog::warn("rank {}: closing the endpoint after a failure ({}): no buffer stays with the "
               "transport",
               rank_, why);
  ep_->close();
  ep_closed_ = true;
}

namespace {
// A mismatch another rank saw (kMismatch notice): the same error here, passed on once.
class MismatchNotice : public UsageError {
 public:
  MismatchNotice(const std::string& msg, int origin, uint64_t seq, int peer, uint64_t mine,
                 uint64_t theirs)
      : UsageError(msg), origin(origin), seq(seq), peer(peer), mine(mine), theirs(theirs) {}
  int origin;
  uint64_t seq;
  int peer;
  uint64_t mine, theirs;
};
constexpr uint32_t kCtlMagic = 0x4C544351;  // "QCTL"
constexpr uint16_t kCtlVersion = 2;
constexpr uint8_t kProbe = 1, kAnswer = 2, kMismatch = 3;
}  // namespace

void Engine::reset_peer(int peer, const std::string& published, uint32_t incarnation) {
  ep_->reset_peer(peer, published, incarnation);
  if (!ctl_posted_) return;  // posted with the right generation when the engine starts
  CtlIn& in = ctl_in_[size_t(peer)];
  in.next = 0;
  post_ctl_recv(peer);
  ctl_out_next_[size_t(peer)] = 0;
}

void Engine::post_ctl_recv(int peer) {
  CtlIn& in = ctl_in_[size_t(peer)];
  in.req = ep_->irecv(peer, net::make_tag(net::Op::kControl, in.next, size_t(peer)), &in.msg,
                      sizeof(in.msg));
}

void Engine::send_ctl(int peer, const Ctl& msg) {
  auto m = std::make_unique<Ctl>(msg);
  m->magic = kCtlMagic;
  m->version = kCtlVersion;
  m->from = uint32_t(rank_);
  auto req = ep_->isend(
      peer, net::make_tag(net::Op::kControl, ctl_out_next_[size_t(peer)]++, size_t(rank_)), m.get(),
      sizeof(Ctl));
  ctl_out_.emplace_back(std::move(req), std::move(m));
}

bool Engine::poll_ctl() {
  bool moved = false;
  for (int p = 0; p < int(ctl_in_.size()); ++p) {
    CtlIn& in = ctl_in_[size_t(p)];
    if (!in.req || !in.req->done()) continue;
    if (in.req->ok() && in.req->bytes == sizeof(Ctl) && in.msg.magic == kCtlMagic &&
        in.msg.version == kCtlVersion && int(in.msg.from) == p) {
      Ctl m = in.msg;
      if (m.type == kProbe) {
        Ctl a{};
        a.type = kAnswer;
        a.last_started = last_started_;
        a.probe_id = m.probe_id;
        a.shape = last_shape_;
        send_ctl(int(m.from), a);
      } else if (m.type == kAnswer && diag_ && m.probe_id == probe_id_) {
        diag_->answers[m.from] = m.last_started;
        diag_->shapes[m.from] = m.shape;
      } else if (m.type == kMismatch && int(m.peer) >= 0 && int(m.peer) < size_ &&
                 m.probe_id >= 0 && m.probe_id < size_ && !broken_.load()) {
        // Another rank's collective saw a rank call it differently: this communicator fails
        // too, and passes the notice on (step()), since the connection between the two ranks
        // that disagreed may be gone (tcp drops it after a truncated message).
        ++in.next;
        post_ctl_recv(p);
        const int origin = int(m.probe_id);
        throw MismatchNotice(
            fmt::format("rank {}: {} #{} failed on rank {}: ranks disagree on the operation: {}",
                        rank_, shape_kind(m.shape), m.last_started, origin,
                        mismatch_text(origin, int(m.peer), m.shape, m.other)),
            origin, uint64_t(m.last_started), int(m.peer), m.shape, m.other);
      }
    } else if (in.req->state != net::RequestState::kCancelled) {
      spdlog::warn("rank {}: ignored a malformed control message from rank {}", rank_, p);
    }
    ++in.next;
    post_ctl_recv(p);
    --p;  // the next message from this peer may be waiting already
    moved = true;
  }
  while (!ctl_out_.empty() && ctl_out_.front().first->done()) ctl_out_.pop_front();
  return moved;
}

void Engine::start_diagnosis(EngineOp& op, const std::string& reason) {
  diag_ = std::make_unique<Diagnosis>();
  diag_->op = &op;
  diag_->seq = op.seq;
  diag_->op_name = op.name();
  diag_->reason = reason;
  diag_->until = now() + probe_window_;
  diag_->shape = op.shape();
  diag_->answers.assign(size_t(size_), -2);
  diag_->answers[size_t(rank_)] = last_started_;
  diag_->shapes.assign(size_t(size_), 0);
  ++probe_id_;
  Ctl m{};
  m.type = kProbe;
  m.last_started = last_started_;
  m.probe_id = probe_id_;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) send_ctl(p, m);
}

void Engine::tell_mismatch(int origin, uint64_t seq, int peer, uint64_t mine, uint64_t theirs) {
  if (size_ < 2 || !ctl_posted_ || ep_closed_) return;
  Ctl m{};
  m.type = kMismatch;
  m.peer = uint32_t(peer);
  m.probe_id = origin;
  m.last_started = int64_t(seq);
  m.shape = mine;
  m.other = theirs;
  std::vector<net::RequestPtr> sent(static_cast<size_t>(size_));
  auto send = [&](int p) {
    try {
      send_ctl(p, m);
      sent[size_t(p)] = ctl_out_.back().first;
    } catch (const std::exception& e) {
      spdlog::debug("rank {}: could not tell rank {} of the mismatch: {}", rank_, p, e.what());
    }
  };
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && p != origin) send(p);
  // The caller may close this communicator as soon as it hears of the failure: the notices go
  // out first (bounded: a peer that does not take them fails by its own deadline). A notice
  // that failed is sent again: over tcp a message longer than its receive makes the provider
  // drop the connection it came on (the peer it concerns), and the next send connects anew.
  const auto until = now() + std::chrono::seconds(1);
  net::Backoff backoff;
  // Bounded in passes too: on virtual time (a clock that drives the engines) no time passes here.
  for (int pass = 0; now() < until && pass < 100000; ++pass) {
    bool all = true;
    for (int p = 0; p < size_; ++p) {
      const auto& r = sent[size_t(p)];
      if (!r) continue;
      if (r->state == net::RequestState::kError) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        send(p);
        all = false;
      } else if (!r->done()) {
        all = false;
      }
    }
    if (all) break;
    try {
      if (ep_->progress() > 0) {
        backoff.reset();
        continue;
      }
    } catch (const std::exception& e) {
      spdlog::debug("rank {}: while telling the others of the mismatch: {}", rank_, e.what());
      break;
    }
    backoff.idle();
  }
}

void Engine::finish_diagnosis_if_due() {
  if (!diag_) return;
  bool all =
      std::none_of(diag_->answers.begin(), diag_->answers.end(), [](int64_t a) { return a == -2; });
  if (!all && now() < diag_->until) return;
  std::vector<int> silent, behind, other;
  for (int p = 0; p < size_; ++p) {
    int64_t a = diag_->answers[size_t(p)];
    const uint64_t sh = diag_->shapes[size_t(p)];
    if (a == -2)
      silent.push_back(p);
    else if (a < int64_t(diag_->seq))
      behind.push_back(p);
    else if (a == int64_t(diag_->seq) && p != rank_ && sh && diag_->shape && sh != diag_->shape)
      other.push_back(p);
  }
  std::string reason = diag_->reason;
  if (!silent.empty())
    reason += fmt::format(
        "; no answer to a liveness probe from rank(s) {} (dead, hung, or "
        "communicator closed)",
        fmt::join(silent, ", "));
  if (!behind.empty())
    reason += fmt::format("; rank(s) {} alive but never started {} #{}", fmt::join(behind, ", "),
                          diag_->op_name, diag_->seq);
  for (int p : other)
    reason += fmt::format("; rank {} called #{} as {}, this rank as {}", p, diag_->seq,
                          describe_shape(diag_->shapes[size_t(p)]), describe_shape(diag_->shape));
  if (silent.empty() && behind.empty() && other.empty())
    reason += "; every rank is alive and in this operation (a lost message or a slow link)";
  diag_.reset();
  spdlog::error("{}", reason);
  fail_all(reason, std::make_exception_ptr(CollectiveTimeout(reason)));
}

void Engine::end_help(bool hand_over) {
  const bool last = helpers_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  if (hand_over) {
    kick();
  } else if (last && active_count_.load(std::memory_order_acquire) != 0) {
    // Taking the lock orders this with the engine's check of its wait predicate: no lost
    // wake-up.
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_one();
  }
}

void Engine::kick() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kicked_ = true;
  }
  cv_.notify_one();
}

// Waiting for peers with operations active: poll, then yield, then sleep with net::Backoff's
// doubling timeouts, but on the condition variable, so new work (kick) wakes the engine at once.
void Engine::idle_wait(net::Backoff& backoff) {
  auto sleep = backoff.next_sleep();
  if (sleep.count() == 0) {
    sched_yield();
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, sleep, [&] { return kicked_ || stop_; });
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
  if (ep_closed_) {
    // Broken for good: nothing is sent or received any more.
    if (!starting.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& op : starting) incoming_.push_front(std::move(op));
      }
      fail_all(broken_reason(), nullptr);
    }
    active_count_.store(active_.size(), std::memory_order_release);
    return moved;
  }
  if (!start_and_advance(starting, moved)) return true;
  if (!active_.empty() && !diag_) check_deadlines();
  moved |= !retire_.empty();
  retire_failed();
  drain_retired();
  moved |= reap_finished();
  if (diag_) {
    // The op may still finish while peers answer; then there is nothing to report.
    bool pending = std::any_of(active_.begin(), active_.end(),
                               [&](const auto& op) { return op.get() == diag_->op; });
    if (!pending)
      diag_.reset();
    else
      finish_diagnosis_if_due();
  }
  active_count_.store(active_.size(), std::memory_order_release);
  all_passive_.store(!active_.empty() && std::all_of(active_.begin(), active_.end(),
                                                     [](const auto& op) { return op->passive(); }),
                     std::memory_order_release);
  return moved;
}

bool Engine::retiring(const EngineOp& op) const {
  return std::any_of(retire_.begin(), retire_.end(),
                     [&](const Retire& r) { return r.work == op.work; });
}

// Runs an op's start or advance: an error of a kFailsOp op retires it alone (after the pass),
// any other propagates (start_and_advance fails every op with it).
bool Engine::guarded(EngineOp& op, const std::function<bool()>& fn) {
  if (op.on_failure != EngineOp::OnFailure::kFailsOp) return fn();
  try {
    return fn();
  } catch (const std::exception& e) {
    spdlog::debug("rank {}: {} #{} failed alone: {}", rank_, op.name(), op.seq, e.what());
    const auto budget = op.deadline == Deadline::max() ? Clock::duration(0)
                                                       : op.deadline - op.submitted;
    retire_.push_back({op.work, now() + budget, std::current_exception()});
    return true;
  }
}

// step(): starts the new ops and advances every active one. Returns false when one failed
// (fail_all has failed them all).
bool Engine::start_and_advance(std::vector<std::unique_ptr<EngineOp>>& starting, bool& moved) {
  try {
    if (!ctl_posted_ && size_ > 1) {
      ctl_in_.resize(size_t(size_));
      ctl_out_next_.assign(size_t(size_), 0);
      for (int p = 0; p < size_; ++p)
        if (p != rank_) post_ctl_recv(p);
      ctl_posted_ = true;
    }
    for (auto& op : starting) {
      active_.push_back(std::move(op));
      EngineOp& a = *active_.back();
      if (a.sequenced) {
        last_started_ = a.seq;
        last_shape_ = a.shape();
      }
      guarded(a, [&] {
        a.start(*ep_);
        return true;
      });
    }
    starting.clear();
    moved |= ep_->progress() > 0;
    moved |= poll_ctl();
    // Ops may submit others meanwhile (into incoming_): active_ does not change in this loop.
    for (size_t i = 0; i < active_.size(); ++i) {
      EngineOp& op = *active_[i];
      if (retiring(op)) continue;
      moved |= guarded(op, [&] { return op.advance(*ep_); });
    }
    // Ops submitted by the ones above start now.
    while (!spawned_.empty()) {
      std::unique_ptr<EngineOp> op = std::move(spawned_.front());
      spawned_.erase(spawned_.begin());
      active_.push_back(std::move(op));
      EngineOp& a = *active_.back();
      if (!retiring(a)) guarded(a, [&] { return a.advance(*ep_); });  // started at submit()
      moved = true;
    }
  } catch (const ShapeMismatch& e) {
    // Tell every rank, so that those this rank's ring never talked to fail as well.
    tell_mismatch(rank_, e.seq(), e.peer(), e.mine(), e.theirs());
    spdlog::error("{}", e.what());
    for (auto& op : starting) active_.push_back(std::move(op));
    fail_all(e.what(), std::current_exception());
    return false;
  } catch (const MismatchNotice& e) {
    tell_mismatch(e.origin, e.seq, e.peer, e.mine, e.theirs);
    spdlog::error("{}", e.what());
    for (auto& op : starting) active_.push_back(std::move(op));
    fail_all(e.what(), std::current_exception());
    return false;
  } catch (const std::exception& e) {
    // Most errors name this rank already.
    const std::string self = fmt::format("rank {}:", rank_);
    std::string reason = std::string(e.what()).rfind(self, 0) == 0
                             ? std::string(e.what())
                             : fmt::format("{} {}", self, e.what());
    spdlog::error("{}", reason);
    for (auto& op : starting) active_.push_back(std::move(op));
    fail_all(reason, std::current_exception());
    return false;
  }
  return true;
}

// step(): completes the finished ops.
bool Engine::reap_finished() {
  bool moved = false;
  for (auto it = active_.begin(); it != active_.end();) {
    if ((*it)->finished()) {
      (*it)->work->finish(nullptr);
      it = active_.erase(it);
      moved = true;
    } else {
      ++it;
    }
  }
  return moved;
}

// step(): the first op past its deadline starts a diagnosis (or fails, alone).
void Engine::check_deadlines() {
  auto now = this->now();
  for (auto& op : active_) {
    if (now >= op->deadline && !retiring(*op)) {
      auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - op->submitted);
      std::string reason =
          fmt::format("rank {}: {} #{} timed out after {} ms waiting for {}", rank_, op->name(),
                      op->seq, waited.count(), op->waiting_on());
      if (op->on_failure == EngineOp::OnFailure::kFailsOp) {
        // Its submitter decides what the timeout means: no liveness probes for it.
        retire_.push_back({op->work, now + (op->deadline - op->submitted),
                           std::make_exception_ptr(CollectiveTimeout(reason))});
        continue;
      }
      if (size_ > 1) {
        start_diagnosis(*op, reason);
      } else {
        spdlog::error("{}", reason);
        fail_all(reason, std::make_exception_ptr(CollectiveTimeout(reason)));
      }
      break;
    }
  }
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
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, sleep,
                   [&] { return kicked_ || stop_ || !incoming_.empty() || !calls_.empty(); });
    } else if (active_count_.load(std::memory_order_acquire) != 0) {
      idle_wait(backoff);
    }
  }
  shut_down();
}

// Fails what is left so no caller waits forever.
void Engine::shut_down() {
  std::lock_guard<std::mutex> plock(progress_mu_);
  if (!active_.empty() || !incoming_.empty())
    fail_all(fmt::format("rank {}: communicator destroyed with operations pending", rank_),
             nullptr);
}

}  // namespace qring::collectives
