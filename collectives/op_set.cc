#include "collectives/op_set.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

namespace qring::collectives {

void OpSet::started(EngineOp& op) {
  if (op.sequenced) {
    last_started_ = op.seq;
    last_shape_ = op.shape();
  }
}

void OpSet::start(std::vector<std::unique_ptr<EngineOp>>& ops) {
  // All of them join first: when one's start() throws (and breaks the communicator), the
  // others are active too and fail with it (fail_all), none is lost.
  const size_t first = active_.size();
  for (auto& op : ops) active_.push_back(std::move(op));
  ops.clear();
  for (size_t i = first; i < active_.size(); ++i) {
    EngineOp& a = *active_[i];
    started(a);
    guarded(a, [&] {
      a.start(ep_);
      return true;
    });
  }
}

void OpSet::spawn(std::unique_ptr<EngineOp> op) {
  EngineOp& a = *op;
  spawned_.push_back(std::move(op));
  started(a);
  guarded(a, [&] {
    a.start(ep_);
    return true;
  });
}

bool OpSet::advance() {
  bool moved = false;
  // Ops may submit others meanwhile (spawn): active_ does not change in this loop.
  for (size_t i = 0; i < active_.size(); ++i) {
    EngineOp& op = *active_[i];
    if (retiring(op)) continue;
    moved |= guarded(op, [&] { return op.advance(ep_); });
  }
  // Ops submitted by the ones above, started at spawn(), advance now.
  while (!spawned_.empty()) {
    std::unique_ptr<EngineOp> op = std::move(spawned_.front());
    spawned_.erase(spawned_.begin());
    active_.push_back(std::move(op));
    EngineOp& a = *active_.back();
    if (!retiring(a)) guarded(a, [&] { return a.advance(ep_); });
    moved = true;
  }
  return moved;
}

bool OpSet::retiring(const EngineOp& op) const {
  return std::any_of(retire_.begin(), retire_.end(),
                     [&](const Retire& r) { return r.work == op.work; });
}

bool OpSet::guarded(EngineOp& op, const std::function<bool()>& fn) {
  if (op.on_failure != EngineOp::OnFailure::kFailsOp) return fn();
  try {
    return fn();
  } catch (const std::exception& e) {
    spdlog::debug("rank {}: {} #{} failed alone: {}", rank_, op.name(), op.seq, e.what());
    const auto budget = op.deadline == Deadline::max() ? Clock::duration(0)
                                                       : op.deadline - op.submitted;
    retire_.push_back({op.work, clock_.now() + budget, std::current_exception()});
    return true;
  }
}

void OpSet::abandon(const WorkPtr& work, Deadline until, const std::string& why) {
  EngineOp* op = nullptr;
  for (auto* ops : {&active_, &spawned_})
    for (auto& o : *ops)
      if (o->work == work) op = o.get();
  if (!op || retiring(*op)) return;
  try {
    op->abandon(ep_, until);
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: abandoning {} #{}: {}", rank_, op->name(), op->seq, e.what());
    close_endpoint(fmt::format("abandoning {} #{} failed: {}", op->name(), op->seq, e.what()));
  }
  retire_.push_back({work, until, std::make_exception_ptr(IoError(why)), op});
}

EngineOp* OpSet::check_deadlines(Clock::time_point now, std::string* reason) {
  for (auto& op : active_) {
    if (now < op->deadline || retiring(*op)) continue;
    auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - op->submitted);
    std::string why = fmt::format("rank {}: {} #{} timed out after {} ms waiting for {}", rank_,
                                  op->name(), op->seq, waited.count(), op->waiting_on());
    if (op->on_failure == EngineOp::OnFailure::kFailsOp) {
      // Its submitter decides what the timeout means: no liveness probes for it.
      retire_.push_back({op->work, now + (op->deadline - op->submitted),
                         std::make_exception_ptr(CollectiveTimeout(why))});
      continue;
    }
    *reason = std::move(why);
    return op.get();
  }
  return nullptr;
}

void OpSet::fail_op(std::unique_ptr<EngineOp> op, const Retire& r) {
  try {
    if (!r.abandoned) op->abandon(ep_, r.until);
  } catch (const std::exception& e) {
    // A receive the transport did not let go of: only closing the endpoint frees its buffer.
    spdlog::warn("rank {}: abandoning {} #{}: {}", rank_, op->name(), op->seq, e.what());
    close_endpoint(fmt::format("abandoning {} #{} failed: {}", op->name(), op->seq, e.what()));
  }
  WorkPtr work = op->work;
  if (op->holds_buffers() && !closed_) draining_.push_back(std::move(op));
  work->finish(r.err);
}

bool OpSet::retire() {
  const bool any = !retire_.empty();
  std::vector<Retire> todo;
  todo.swap(retire_);
  for (auto& r : todo) {
    auto it = std::find_if(active_.begin(), active_.end(),
                           [&](const auto& op) { return op->work == r.work; });
    if (it == active_.end()) continue;  // finished, or retired already
    std::unique_ptr<EngineOp> op = std::move(*it);
    active_.erase(it);
    fail_op(std::move(op), r);
  }
  holds_failed_buffers();
  return any;
}

bool OpSet::reap() {
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

bool OpSet::holds_failed_buffers() {
  for (const auto& r : retire_)
    if (r.abandoned && r.abandoned->holds_buffers()) return true;
  std::erase_if(draining_, [](const auto& op) { return !op->holds_buffers(); });
  return !draining_.empty();
}

void OpSet::fail_all(std::vector<std::unique_ptr<EngineOp>> more, std::exception_ptr err) {
  for (auto& op : more) active_.push_back(std::move(op));
  for (auto& op : spawned_) active_.push_back(std::move(op));
  spawned_.clear();
  // First every op withdraws what it posted. A receive the transport does not confirm as
  // cancelled stays posted into its buffer, and a send that never completes keeps reading
  // its buffer; once the op's Work fails its owner may free that memory, so then the
  // endpoint is closed first (the communicator is broken anyway, and refuses new work).
  for (auto& op : active_) {
    if (closed_) break;  // closing ended every request
    try {
      op->abort(ep_);
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
  if (!closed_ && holds_failed_buffers())
    close_endpoint("a failed operation has sends in flight from its caller's buffers");
  for (auto& op : active_) op->work->finish(err);
  active_.clear();
  retire_.clear();
}

void OpSet::close_endpoint(const std::string& why) {
  if (closed_) return;
  spdlog::warn("rank {}: closing the endpoint after a failure ({}): no buffer stays with the "
               "transport",
               rank_, why);
  ep_.close();
  closed_ = true;
}

bool OpSet::all_passive() const {
  return !active_.empty() &&
         std::all_of(active_.begin(), active_.end(), [](const auto& op) { return op->passive(); });
}

bool OpSet::contains(const EngineOp* op) const {
  return std::any_of(active_.begin(), active_.end(), [&](const auto& o) { return o.get() == op; });
}

}  // namespace qring::collectives
