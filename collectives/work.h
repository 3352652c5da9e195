// Work: the handle of an operation submitted to the engine (collectives/engine.h). Below the
// communicator, which hands it out, and the engine, which completes it.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>

#include "net/base/error.h"

namespace qring::collectives {

// An operation that passed its deadline (Work::wait rethrows it).
class CollectiveTimeout : public TimeoutError {
 public:
  using TimeoutError::TimeoutError;
};

class Engine;
class OpSet;

class Work {
 public:
  // `on_finish` (may be empty) runs once, on the thread that completes the operation, with its
  // error (null: success), before any waiter is released.
  explicit Work(Engine* engine, std::function<void(const std::exception_ptr&)> on_finish = {})
      : engine_(engine), on_finish_(std::move(on_finish)) {}
  bool done() const { return state_.load(std::memory_order_acquire) != 0; }
  // Blocks until the operation completes; rethrows its error (CollectiveTimeout, IoError...).
  // The calling thread drives the engine meanwhile while that makes progress
  // (Engine::drive_until), then leaves the rest to the engine thread.
  void wait();
  // The error the operation ended with (null while not done, or on success).
  std::exception_ptr error() const { return done() ? error_ : nullptr; }

 private:
  friend class Engine;  // completes it (the engine's op set, op_set.h, too)
  friend class OpSet;
  void finish(std::exception_ptr err);
  std::atomic<int> state_{0};
  std::exception_ptr error_;
  Engine* engine_ = nullptr;
  std::function<void(const std::exception_ptr&)> on_finish_;
};
using WorkPtr = std::shared_ptr<Work>;

}  // namespace qring::collectives
