// Virtual time for tests of the protocols above the endpoint (collectives/clock.h): failover,
// eviction, rejoin and deadlines run in-process, in milliseconds of real time, with no sleeps.
//
// The clock is a deterministic scheduler. It knows its threads (participants): the programs
// run() and start() give it, and the library threads spawned under it (the quorum all-reduce's
// join agent). Exactly one runs at a time, holding the baton. A participant gives the baton up
// when it blocks in wait_until(); whoever gives it up then runs the schedule: a participant
// whose condition holds (or whose deadline came) runs next; else every attached engine makes a
// pass (engines start no thread under this clock); when nothing moved, virtual time advances
// by one quantum (or less, to the next deadline). So a protocol waiting 500 ms for an eviction
// costs two thousand rounds of engine passes, and the order of events depends on nothing but
// the programs: a test run is the same every time.
//
// Processes that stop or die: freeze(group, until) keeps a group's engines and threads still
// (a SIGSTOP until `until`, a SIGKILL with Deadline::max()); its peers see silence. When only
// frozen-for-good groups are left, or the time limit passes, the clock tears down: every
// remaining wait returns at once (its condition as it is), and a thread frozen in freeze()
// itself gets VirtualClock::Teardown, so that every thread ends.
//
// Groups: a participant's group is the one it was given (a rank, or a rank's later
// incarnation); an engine's is the group of the thread that created it, or of a setup scope
// (as_group) for communicators built before run() (their creation exchanges settings with
// every peer, which needs real threads).
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/clock.h"

namespace qring::collectives {

class VirtualClock final : public TimeSource {
 public:
  // Not derived from std::exception: a program's catch of library errors does not stop it.
  struct Teardown {};
  struct Part;  // a participant (virtual_clock.cc)

  explicit VirtualClock(std::chrono::microseconds quantum = std::chrono::microseconds(250));
  ~VirtualClock() override;

  Clock::time_point now() override;
  bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                  Deadline deadline, const std::function<bool()>& pred) override;
  std::thread spawn(std::function<void()> fn) override;
  void join(std::thread& t) override;
  bool drives_engines() const override { return true; }
  void attach(const void* key, std::function<bool()> pass) override;
  void detach(const void* key) override;

  // Runs one participant per program (program i in group i) until every participant has
  // ended (or the clock tore down), then joins them. Throws UsageError when virtual time
  // passed `limit` first (a protocol that hangs), or with a participant's error that is not a
  // std::exception.
  void run(std::vector<std::function<void()>> programs,
           Clock::duration limit = std::chrono::minutes(10));
  // From a participant: a program that starts at `at` in group `group` (a restarted rank).
  void start(int group, std::function<void()> fn, Deadline at);
  // From a participant or an engine pass: the group's engines make no pass and its threads
  // are not scheduled until `until` (Deadline::max(): for good). A participant of that group
  // that calls it waits here; frozen for good, it ends with Teardown.
  void freeze(int group, Deadline until);
  bool frozen(int group);
  // The calling participant's group (-1 outside).
  int group() const;
  // Engines created by this thread while the returned guard lives belong to `group`.
  class Scope {
   public:
    explicit Scope(int group);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    int before_;
  };

 private:
  struct Attached {
    const void* key;
    int group;
    std::function<bool()> pass;
  };
  Part* add(int group, std::function<void()> fn, Deadline at);
  void body(Part* p);
  // The baton holder `me` (null: the thread of run()) lets the next participant run and waits
  // for its own turn (`me` blocked), or leaves (`me` ended).
  void hand_over(Part* me);
  Part* schedule();
  Part* pick();
  bool ready(Part& p);
  bool passes();
  void advance();
  bool live_left();

  const std::chrono::microseconds quantum_;
  std::atomic<int64_t> now_ns_;
  Clock::time_point start_;
  Clock::duration limit_{};
  std::mutex mu_;  // parts_, attached_, frozen_, holder_, ended_ (the baton's hand-off)
  std::condition_variable ended_cv_;  // run()'s wait for the end (each Part has its own turn)
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<Attached> attached_;
  // A copy of attached_ for passes() (null after attach or detach: copied again there).
  std::shared_ptr<const std::vector<Attached>> passes_;
  std::vector<Part*> pick_scratch_;  // the baton holder's: the participants pick() looks at
  std::vector<std::pair<int, Deadline>> frozen_;  // group, until
  Part* holder_ = nullptr;
  bool running_ = false;
  bool ended_ = false;
  bool teardown_ = false;
  std::string timeout_;
  size_t last_pick_ = 0;
};

}  // namespace qring::collectives
