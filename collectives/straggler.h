// Straggler models shared by qring-bench and qring-train: how long a rank is delayed before
// it contributes to a step. Deterministic for (seed, rank, step); delays sleep, never spin.
//
//   none                 no delay
//   fixed:RANK:MS        rank RANK is MS late every step
//   exp:MEAN_MS          every rank, every step: exponential with mean MEAN_MS
//   lognormal:MU:SIGMA   every rank, every step: exp(MU + SIGMA z) ms, z standard normal
//   shiftexp:SHIFT_MS:MEAN_MS  every rank, every step: SHIFT_MS + an exponential with mean
//                        MEAN_MS (the shifted exponential of Chen et al., "Revisiting
//                        Distributed Synchronous SGD"; the k-th of n arrivals is expected at
//                        SHIFT + MEAN (H(n) - H(n-k)), H the harmonic numbers)
//   tail:P:MS            every rank, every step: MS with probability P, else 0
//   trace:FILE           per (step, rank) delays from FILE: lines "step rank ms" ('#' comments);
//                        pairs absent from the file are not delayed
//   resample:SCALE_MS:FILE  a real job's per-worker step times (FILE: lines "STEP RANK MS", the
//                        same ranks every step, e.g. ../shared/traces), resampled to any world
//                        size and any number of steps: worker w replays column pi_j(w mod R)
//                        of the job's R ranks (pi_j a seeded permutation of the columns for
//                        the j-th block of R workers, j = w div R: each column once per block)
//                        from a seeded step offset o_w, wrapping around the job's S steps; its
//                        delay at step k = MS / (the fastest rank's MS of that job step) x
//                        SCALE_MS: a worker's whole compute time, the fastest taking SCALE_MS
//                        (give the model no compute time of its own, qring-sim --compute-ms 0,
//                        or one small beside SCALE_MS)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qring::collectives {

class StragglerModel {
 public:
  enum class Kind { kNone, kFixed, kExp, kLognormal, kTail, kTrace, kShiftExp, kResample };

  StragglerModel() = default;
  // Throws ConfigError naming the spec (and file:line for traces) on bad input.
  static StragglerModel parse(std::string_view spec);

  std::chrono::microseconds delay(uint64_t seed, int rank, uint64_t step) const;
  const std::string& spec() const { return spec_; }
  Kind kind() const { return kind_; }

 private:
  Kind kind_ = Kind::kNone;
  std::string spec_ = "none";
  int rank_ = -1;
  double a_ = 0, b_ = 0;
  std::map<std::pair<uint64_t, int>, double> trace_;
  // resample: ratio_[s * columns_ + c] = MS / the fastest MS of job step s, for column c.
  std::vector<double> ratio_;
  int columns_ = 0;
  uint64_t steps_ = 0;
};

// Sleeps for `d` in 250 us slices, returning early (true) as soon as `abandon()` is true.
bool sleep_unless(std::chrono::microseconds d, const std::function<bool()>& abandon = {});

}  // namespace qring::collectives
