// Time for everything above the endpoint: the engine, the collectives' deadlines, the quorum
// all-reduce's heartbeats, evictions, takeovers, rejoins and waits. They read it through a
// TimeSource, never from the steady clock directly, so that tests run those protocols on
// virtual time (collectives/virtual_clock.h: milliseconds of protocol time cost microseconds,
// and no test sleeps), and jobs on the steady clock (system_time()).
//
// A TimeSource answers now(), blocks a thread until a condition holds or a deadline passes,
// and starts the library's helper threads. When it drives_engines() (the virtual clock),
// engines start no thread of their own: they attach their pass, and the clock runs every
// attached pass while the threads it knows are blocked in its waits.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "net/transport/endpoint.h"

namespace qring::collectives {

using net::Clock;     // the time points every TimeSource returns (steady_clock's type)
using net::Deadline;  // a time point on the TimeSource in force

class TimeSource {
 public:
  virtual ~TimeSource() = default;
  virtual Clock::time_point now() = 0;
  // Blocks until pred() holds (called with `lock` held) or `deadline` passes; returns pred().
  // Whoever makes pred() true notifies `cv` (the steady clock waits on it).
  virtual bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                          Deadline deadline, const std::function<bool()>& pred) = 0;
  // Blocks until `t`.
  void sleep_until(Deadline t);
  // Starts a helper thread of the library (the quorum all-reduce's join agent), and waits for
  // one to end.
  virtual std::thread spawn(std::function<void()> fn) { return std::thread(std::move(fn)); }
  virtual void join(std::thread& t) { t.join(); }
  // False: every engine runs its own thread. True: engines attach their pass (`pass` returns
  // whether anything moved) and the clock runs them; `key` names the engine for detach().
  virtual bool drives_engines() const { return false; }
  virtual void attach(const void* /*key*/, std::function<bool()> /*pass*/) {}
  virtual void detach(const void* /*key*/) {}
};

// The steady clock, real waits and real threads.
TimeSource& system_time();

}  // namespace qring::collectives
