// Ranks of a world as threads on virtual time (collectives/virtual_clock.h): communicators over
// the in-process endpoint, each behind a FaultEndpoint (a test can cut a rank off), a memory
// store for rejoins, and the faults a process meets: a stopped rank (SIGSTOP, then SIGCONT)
// and a dead one (SIGKILL) are frozen on the clock, so that their peers see silence while
// virtual time runs on. A fault test of seconds of protocol time runs in milliseconds, with no
// sleeps, and the same way every time.
//
//   SimWorld w(4);
//   w.run([&](int rank, Communicator& comm) {
//     QuorumAllreduce q(comm, n, qo);
//     ... if (rank == 3 && t == 20) w.kill(3); ...     // or from QuorumOptions::on_phase
//   });
//   EXPECT_EQ(w.error(1), "");
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/virtual_clock.h"
#include "net/rendezvous/store.h"
#include "net/transport/fault_endpoint.h"
#include "net/transport/inproc_endpoint.h"

namespace qring::testing {

using collectives::Clock;
using collectives::CommOptions;
using collectives::Communicator;
using collectives::VirtualClock;
using Program = std::function<void(int rank, Communicator& comm)>;

// Sleeps `d` of virtual time, and returns early (true) once `abandon()` holds: a rank's
// computation that stops when its step no longer counts it (QuorumAllreduce::excluded).
inline bool sleep_unless(VirtualClock& clock, std::chrono::microseconds d,
                         const std::function<bool()>& abandon) {
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  return clock.wait_until(lock, cv, clock.now() + d, abandon);
}

// Waits on virtual time until `cond()` holds (another rank sets it).
inline void wait_for(VirtualClock& clock, const std::function<bool()>& cond) {
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  clock.wait_until(lock, cv, collectives::Deadline::max(), cond);
}

class SimWorld {
 public:
  // `rules`: every rank's endpoint delays or drops the messages they match
  // (net/transport/fault_endpoint.h); a killed rank's held messages are never sent.
  explicit SimWorld(int world, CommOptions co = {},
                    std::chrono::microseconds quantum = std::chrono::microseconds(250),
                    const std::vector<net::FaultRule>& rules = {})
      : world_(world),
        clock_(std::make_shared<VirtualClock>(quantum)),
        fabric_(world),
        incarnation_(size_t(world), 0),
        fault_(size_t(world), nullptr) {
    co.clock = clock_;
    if (co.reduce_threads == 0) co.reduce_threads = 1;
    co_ = co;
    // Communicators exchange their settings at creation: real threads, before the clock runs.
    std::vector<std::unique_ptr<net::Endpoint>> eps(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      store_.add(net::incarnation_key(r), 1);
      auto fe = std::make_unique<net::FaultEndpoint>(fabric_.endpoint(r), rules);
      fault_[size_t(r)] = fe.get();
      eps[size_t(r)] = std::move(fe);
    }
    comms_.resize(size_t(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        VirtualClock::Scope scope(r);
        comms_[size_t(r)] = std::make_unique<Communicator>(std::move(eps[size_t(r)]), co_);
      });
    for (auto& t : threads) t.join();
  }

  int size() const { return world_; }
  VirtualClock& clock() { return *clock_; }
  net::MemoryStore& store() { return store_; }

  // Runs program(rank, comm) on every rank until all have ended. An error that escapes a
  // program is kept (error()); a rank that was killed ends when the clock tears down.
  void run(const Program& program, Clock::duration limit = std::chrono::minutes(10)) {
    std::vector<std::function<void()>> programs;
    for (int r = 0; r < world_; ++r)
      programs.push_back([this, r, program] { guarded(r, [&] { program(r, *comms_[size_t(r)]); }); });
    start_ = clock_->now();
    clock_->run(std::move(programs), limit);
  }

  // The error that escaped the program of rank `rank`'s latest incarnation (or of incarnation
  // `inc`), or "".
  std::string error(int rank) const { return error(rank, incarnation_[size_t(rank)]); }
  std::string error(int rank, uint32_t inc) const {
    auto it = errors_.find(rank + world_ * int(inc));
    return it == errors_.end() ? std::string() : it->second;
  }
  double elapsed_ms() const {
    return std::chrono::duration<double, std::milli>(clock_->now() - start_).count();
  }

  // Faults. From the rank's own program (it stops there) or from an engine pass
  // (QuorumOptions::on_phase).
  // Incarnation `inc` of `rank` (its latest when not given).
  void kill(int rank) { kill(rank, incarnation_[size_t(rank)]); }
  void kill(int rank, uint32_t inc) {
    clock_->freeze(rank + world_ * int(inc), collectives::Deadline::max());
  }
  void stop(int rank, std::chrono::milliseconds d) {
    clock_->freeze(group(rank), clock_->now() + d);
  }
  uint32_t incarnation(int rank) const { return incarnation_[size_t(rank)]; }
  // `rank` and the others stop hearing each other (a partition, or a frozen link).
  void cut(int rank) {
    for (int p = 0; p < world_; ++p) {
      if (p == rank) continue;
      fault_[size_t(rank)]->cut(p);
      fault_[size_t(p)]->cut(rank);
    }
  }
  // `rank`'s host is gone (its tcp connections refused): every other rank's sends to it fail at
  // once, and nothing more comes from it.
  void refuse(int rank) {
    for (int p = 0; p < world_; ++p)
      if (p != rank) fault_[size_t(p)]->refuse(rank);
  }
  // Only the link between `a` and `b` is cut (both ways).
  void cut_link(int a, int b) {
    fault_[size_t(a)]->cut(b);
    fault_[size_t(b)]->cut(a);
  }
  // A new incarnation of `rank` starts `after` from now: `program` runs with a communicator of
  // its own that joins the running job (QuorumOptions::join).
  void restart(int rank, std::chrono::milliseconds after, const Program& program) {
    const uint32_t inc = ++incarnation_[size_t(rank)];
    store_.add(net::incarnation_key(rank), 1);
    clock_->start(group(rank), [this, rank, inc, program] {
      guarded(rank + world_ * int(inc), [&] {
        Communicator comm(fabric_.endpoint(rank, inc, /*join=*/true), co_);
        program(rank, comm);
      });
    }, clock_->now() + after);
  }

 private:
  int group(int rank) const { return rank + world_ * int(incarnation_[size_t(rank)]); }
  // Only one participant runs at a time (the clock's baton): no lock for errors_.
  void guarded(int group, const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      errors_.emplace(group, e.what());
    }
  }

  int world_;
  std::shared_ptr<VirtualClock> clock_;
  CommOptions co_;
  net::InprocFabric fabric_;
  net::MemoryStore store_;
  std::vector<uint32_t> incarnation_;
  std::vector<net::FaultEndpoint*> fault_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::map<int, std::string> errors_;  // by group (rank + world * incarnation)
  Clock::time_point start_{};
};

}  // namespace qring::testing
