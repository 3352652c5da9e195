// Real faults at named phases of a rank's step, for fault tests and benchmarks: the process
// kills itself with SIGKILL, or stops itself with SIGSTOP and is continued (SIGCONT) after a
// pause by a child it forks first. Nothing is simulated: the other ranks see a dead or a
// frozen process.
//
//   kill:RANK:STEP[:PHASE]       SIGKILL at step STEP of rank RANK (or the first step after
//                                it that has PHASE)
//   kill-locked:RANK:STEP[:PHASE]  the same, holding the locks of its shm regions, as a rank
//                                killed inside libfabric's shm receive path (net/transport/shm_region.h)
//   kill-posting:RANK:STEP[:PHASE]  the same, holding the lock of one live peer's shm region,
//                                as a rank killed while it posted a send to that peer
//   stop:RANK:STEP:MS[:PHASE]    SIGSTOP there, SIGCONT MS milliseconds later
//   stop-locked:RANK:STEP:MS[:PHASE]  the same, holding the locks of its shm regions (given
//                                back once continued), as a rank stopped inside libfabric's
//                                shm receive path
//
// PHASE: step (default; before the step's work), ready (right after the contribution was
// handed over), ring (on the engine thread, once the step's reduction has moved), checkpoint
// (a checkpoint written but not yet renamed into place), eval (before an evaluation), donate
// (on the engine thread of a donor, about to send the state to a rank that rejoins at step
// STEP or later: the joiner waits for it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qring::collectives {

class Engine;

struct FaultSpec {
  enum class Action : uint8_t {
    kKill,
    kKillLocked,
    kKillPosting,
    kStop,
    kStopLocked
  } action = Action::kKill;
  int rank = 0;
  uint64_t step = 0;
  int stop_ms = 0;
  std::string phase = "step";

  // The process dies (kill, kill-locked, kill-posting).
  bool kills() const { return action != Action::kStop && action != Action::kStopLocked; }
  // ConfigError on a malformed spec; an empty string is no fault.
  static std::optional<FaultSpec> parse(std::string_view spec);
  // Several faults separated by commas ("kill:1:30,kill:3:60"): a job losing ranks one after
  // the other.
  static std::vector<FaultSpec> parse_list(std::string_view specs);
  std::string spec() const;
  // The first time rank `r` reaches `ph` at or after STEP (a step whose reduction this rank
  // is not part of has no "ring" phase): the caller fires once.
  bool matches(int r, uint64_t t, std::string_view ph) const {
    return r == rank && t >= step && ph == phase;
  }
  // Carries the fault out on this process (does not return for kill). With `engine`, it first
  // takes the engine's progress lock (Engine::hold_progress), so that no thread of this
  // process is inside the endpoint when it stops or dies: over libfabric 1.17's shm a process
  // stopped inside the receive path blocks every rank that sends to it (docs/design.md,
  // Membership, "Limits"). Null from the engine thread's own pass (phase "ring"), which holds
  // that lock already.
  void inject(Engine* engine) const;
};

}  // namespace qring::collectives
