// The coordinator's settings (quorum.* of the run, as the member service derives them from
// QuorumOptions) and the two rules every part of the coordinator reads from them: the quorum
// in force for a view, and the fewest members the job may go on with. Pure values, no state.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>

namespace qring::collectives::qproto {

using Clock = std::chrono::steady_clock;
using Time = Clock::time_point;
using Ms = std::chrono::milliseconds;

struct Config {
  int world = 1;
  int self = 0;           // the coordinator's own rank
  int quorum = 0;         // > 0: a count, kept as given
  double fraction = 0;    // > 0: a fraction of the view, recomputed on every view change
  Ms grace{0};
  Ms deadline{30000};
  Ms evict{5000};
  int evict_steps = 0;    // consecutive missed steps that evict a member; 0 = never
  // A member whose oldest missing result was decided longer ago than this leaves the view
  // ("behind": it rejoins with a live member's state); 0 = never. Only where the job
  // survives the loss.
  Ms max_lag{0};
  int min_world = 0;      // fewest members the job runs with; 0 = the quorum
  uint64_t count = 0;     // elements per contribution (checked on every READY)
  // quorum "auto" (auto_quorum.h): each step's quorum Q(t) is chosen when it opens from the
  // window of recent arrivals, within [quorum, auto_max] (auto_max 0 = the view's size);
  // `quorum` is then the lower bound, the one that membership rules use.
  bool adaptive = false;
  int auto_max = 0;
  double auto_kappa = 0;   // the rule's noise scale in contributions (0 = linear value)
  // The noise scale estimated in the run instead (noise_scale.h), from the norms READYs carry
  // (Up::grad_sq, prev_mean_sq); auto_kappa until the first estimate.
  bool auto_estimate = false;
  Ms join_timeout{30000};  // a join that does not complete in this time is abandoned
  uint32_t layout = 0;    // element type and reduction (layout_of; checked on every READY)
};

// The quorum in force for a view of `view_size` members (a fraction is rounded up).
inline int quorum_for(const Config& c, int view_size) {
  if (c.fraction > 0)
    return std::max(1, int(std::ceil(c.fraction * double(view_size) - 1e-9)));
  return c.quorum;
}
// Fewest members the job may continue with: max(quorum, min_world).
inline int floor_for(const Config& c, int view_size) {
  return std::max(quorum_for(c, view_size), c.min_world);
}

inline double ms_between(Time a, Time b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace qring::collectives::qproto
