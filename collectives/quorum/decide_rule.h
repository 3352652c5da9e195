// When an open step of the quorum all-reduce is decided (DESIGN §3, "Bounded wait"): every
// member that can contribute has arrived, or the quorum has and the grace has passed since it
// did (grace 0: at once, the first Q win as in the paper). A pure function of counts and
// durations: the coordinator (step_decider.cc, StepDecider::decide) applies it on its clock, qring-sim
// (train/sim.cc, sim_decide) on its virtual one, so that the simulator decides as qring does.
#pragma once

#include <chrono>
#include <optional>

namespace qring::collectives::qproto {

using RuleMs = std::chrono::duration<double, std::milli>;

// `arrived` of `eligible` members have contributed; `since_quorum` is the time since the
// quorum was reached (none while fewer than the quorum have arrived).
inline bool step_due(int arrived, int eligible, std::optional<RuleMs> since_quorum, RuleMs grace) {
  return arrived >= eligible || (since_quorum && *since_quorum >= grace);
}

}  // namespace qring::collectives::qproto
