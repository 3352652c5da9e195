#include "collectives/virtual_clock.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "net/base/error.h"

namespace qring::collectives {

struct VirtualClock::Part {
  int group = -1;
  enum class State : uint8_t { kNew, kBlocked, kRunning, kDone } state = State::kNew;
  std::function<void()> fn;
  Deadline start_at{};
  // While blocked: the condition (with its mutex) and the deadline.
  std::mutex* mu = nullptr;
  const std::function<bool()>* pred = nullptr;
  Deadline deadline{};
  std::thread::id thread;
  std::thread owned;  // run() and start() threads (spawn() hands its thread to the caller)
  std::condition_variable turn;  // signalled when the baton comes to this participant
};

namespace {
thread_local VirtualClock::Part* tl_self = nullptr;
thread_local const VirtualClock* tl_clock = nullptr;
thread_local int tl_scope_group = -1;
}  // namespace

VirtualClock::VirtualClock(std::chrono::microseconds quantum)
    : quantum_(quantum),
      now_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(
                  Clock::now().time_since_epoch())
                  .count()) {}

VirtualClock::~VirtualClock() {
  for (auto& p : parts_)
    if (p->owned.joinable()) p->owned.join();
}

Clock::time_point VirtualClock::now() {
  return Clock::time_point(std::chrono::nanoseconds(now_ns_.load(std::memory_order_acquire)));
}

VirtualClock::Scope::Scope(int group) : before_(tl_scope_group) { tl_scope_group = group; }
VirtualClock::Scope::~Scope() { tl_scope_group = before_; }

int VirtualClock::group() const {
  return tl_clock == this && tl_self ? tl_self->group : -1;
}

void VirtualClock::attach(const void* key, std::function<bool()> pass) {
  const int g = tl_clock == this && tl_self ? tl_self->group : tl_scope_group;
  std::lock_guard<std::mutex> lock(mu_);
  attached_.push_back({key, g, std::move(pass)});
  passes_.reset();
}

void VirtualClock::detach(const void* key) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(attached_, [&](const Attached& a) { return a.key == key; });
  passes_.reset();
}

VirtualClock::Part* VirtualClock::add(int group, std::function<void()> fn, Deadline at) {
  auto p = std::make_unique<Part>();
  p->group = group;
  p->fn = std::move(fn);
  p->start_at = at;
  Part* raw = p.get();
  std::lock_guard<std::mutex> lock(mu_);
  parts_.push_back(std::move(p));
  return raw;
}

// A participant's thread: waits for the baton, runs, and hands the baton on.
void VirtualClock::body(Part* p) {
  tl_self = p;
  tl_clock = this;
  {
    std::unique_lock<std::mutex> lock(mu_);
    p->turn.wait(lock, [&] { return holder_ == p; });
    p->state = Part::State::kRunning;
  }
  try {
    p->fn();
  } catch (const Teardown&) {
  } catch (const std::exception& e) {
    spdlog::error("virtual clock: a participant ended with an error: {}", e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    p->state = Part::State::kDone;
  }
  hand_over(p);
}

void VirtualClock::run(std::vector<std::function<void()>> programs, Clock::duration limit) {
  if (tl_self) throw UsageError("VirtualClock::run from one of its own threads");
  start_ = now();
  limit_ = limit;
  for (size_t i = 0; i < programs.size(); ++i) {
    Part* p = add(int(i), std::move(programs[i]), now());
    p->owned = std::thread([this, p] { body(p); });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = true;
    ended_ = false;
  }
  hand_over(nullptr);
  {
    std::unique_lock<std::mutex> lock(mu_);
    ended_cv_.wait(lock, [&] { return ended_; });
    running_ = false;
  }
  for (auto& p : parts_)
    if (p->owned.joinable()) p->owned.join();
  if (!timeout_.empty()) throw UsageError(timeout_);
}

void VirtualClock::start(int group, std::function<void()> fn, Deadline at) {
  Part* p = add(group, std::move(fn), at);
  p->owned = std::thread([this, p] { body(p); });
}

std::thread VirtualClock::spawn(std::function<void()> fn) {
  const int g = tl_clock == this && tl_self ? tl_self->group : tl_scope_group;
  Part* p = add(g, std::move(fn), now());
  std::thread t([this, p] { body(p); });
  p->thread = t.get_id();
  return t;
}

void VirtualClock::join(std::thread& t) {
  Part* part = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : parts_)
      if (p->thread == t.get_id()) part = p.get();
  }
  if (part) {
    std::mutex mu;
    std::condition_variable cv;
    std::unique_lock<std::mutex> lock(mu);
    auto ended = [&] {
      std::lock_guard<std::mutex> g(mu_);
      return part->state == Part::State::kDone;
    };
    // Torn down, a wait returns at once: the thread still needs its turns to end.
    while (!wait_until(lock, cv, Deadline::max(), ended)) {
    }
  }
  t.join();
}

bool VirtualClock::wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable&,
                              Deadline deadline, const std::function<bool()>& pred) {
  if (pred()) return true;
  Part* me = tl_clock == this ? tl_self : nullptr;
  if (!me)
    throw UsageError("a wait on virtual time from a thread the clock does not schedule");
  // A wait inside the schedule of another wait of this thread (a fault frozen from an engine
  // pass that this thread's wait runs): that outer wait is restored afterwards.
  Part outer;
  {
    std::lock_guard<std::mutex> g(mu_);
    outer.state = me->state;
    outer.mu = me->mu;
    outer.pred = me->pred;
    outer.deadline = me->deadline;
    me->state = Part::State::kBlocked;
    me->mu = lock.mutex();
    me->pred = &pred;
    me->deadline = deadline;
  }
  lock.unlock();
  hand_over(me);
  {
    std::lock_guard<std::mutex> g(mu_);
    me->state = outer.state;
    me->mu = outer.mu;
    me->pred = outer.pred;
    me->deadline = outer.deadline;
  }
  lock.lock();
  return pred();
}

void VirtualClock::freeze(int group, Deadline until) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    frozen_.emplace_back(group, until);
  }
  Part* me = tl_clock == this ? tl_self : nullptr;
  if (!me || me->group != group) return;
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  wait_until(lock, cv, until, [] { return false; });
  if (until == Deadline::max()) throw Teardown{};
}

bool VirtualClock::frozen(int group) {
  const auto t = now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [g, until] : frozen_)
    if (g == group && t < until) return true;
  return false;
}

void VirtualClock::hand_over(Part* me) {
  Part* next = schedule();
  std::unique_lock<std::mutex> lock(mu_);
  if (!next) {
    ended_ = true;
    holder_ = nullptr;
    ended_cv_.notify_all();
    return;
  }
  if (next == me) {
    me->state = Part::State::kRunning;
    return;
  }
  // Only the next holder wakes: with one condition for all, every hand-off would wake every
  // blocked thread to find the baton is not its own (most of a virtual-time test's CPU).
  holder_ = next;
  next->turn.notify_one();
  if (!me || me->state == Part::State::kDone) return;
  me->turn.wait(lock, [&] { return holder_ == me; });
  me->state = Part::State::kRunning;
}

VirtualClock::Part* VirtualClock::schedule() {
  for (;;) {
    // Torn down, time still goes on by a quantum a turn, so that a wait that polls (a bounded
    // loop of short waits) reaches its deadline.
    if (teardown_)
      now_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(quantum_).count(),
                        std::memory_order_acq_rel);
    if (Part* p = pick()) return p;
    if (!live_left()) {
      std::lock_guard<std::mutex> lock(mu_);
      const bool any = std::any_of(parts_.begin(), parts_.end(), [](const auto& p) {
        return p->state != Part::State::kDone;
      });
      if (!any) return nullptr;
      teardown_ = true;  // only threads frozen for good remain: they end now
      continue;
    }
    if (teardown_) continue;
    if (passes()) continue;
    advance();
  }
}

// Round robin over the participants that may run.
VirtualClock::Part* VirtualClock::pick() {
  std::vector<Part*>& parts = pick_scratch_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parts.clear();
    for (auto& p : parts_) parts.push_back(p.get());
  }
  const size_t n = parts.size();
  for (size_t k = 1; k <= n; ++k) {
    const size_t i = (last_pick_ + k) % n;
    if (ready(*parts[i])) {
      last_pick_ = i;
      return parts[i];
    }
  }
  return nullptr;
}

bool VirtualClock::ready(Part& p) {
  Part::State st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st = p.state;
  }
  if (st == Part::State::kDone || st == Part::State::kRunning) return false;
  if (teardown_) return true;
  if (frozen(p.group)) return false;
  const auto t = now();
  if (st == Part::State::kNew) return t >= p.start_at;
  if (t >= p.deadline) return true;
  std::lock_guard<std::mutex> lock(*p.mu);
  return (*p.pred)();
}

// One pass of every engine that is not frozen; whether any moved.
bool VirtualClock::passes() {
  // Held here: a pass may freeze its group, whose wait runs the schedule and so this
  // function again; an engine made or destroyed meanwhile drops passes_.
  std::shared_ptr<const std::vector<Attached>> engines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!passes_) passes_ = std::make_shared<const std::vector<Attached>>(attached_);
    engines = passes_;
  }
  bool moved = false;
  for (auto& e : *engines)
    if (!frozen(e.group)) moved |= e.pass();
  return moved;
}

void VirtualClock::advance() {
  auto t = now();
  Deadline next = t + quantum_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : parts_) {
      if (p->state == Part::State::kBlocked && p->deadline > t) next = std::min(next, p->deadline);
      if (p->state == Part::State::kNew && p->start_at > t) next = std::min(next, p->start_at);
    }
    for (auto& [g, until] : frozen_)
      if (until > t) next = std::min(next, until);
  }
  if (running_ && next - start_ > limit_) {
    timeout_ = fmt::format("virtual clock: still running after {} ms of virtual time",
                           std::chrono::duration_cast<std::chrono::milliseconds>(limit_).count());
    spdlog::error("{}", timeout_);
    teardown_ = true;
    return;
  }
  now_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(next.time_since_epoch()).count(),
                std::memory_order_release);
}

// Whether a participant that is not frozen for good has not ended.
bool VirtualClock::live_left() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& p : parts_) {
    if (p->state == Part::State::kDone) continue;
    bool dead = false;
    for (auto& [g, until] : frozen_) dead |= g == p->group && until == Deadline::max();
    if (!dead) return true;
  }
  return false;
}

}  // namespace qring::collectives
