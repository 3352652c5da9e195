// The gradient-noise scale of a run, estimated from its own steps (quorum.quorum = "auto"
// without a quorum.noise_scale: the adaptive quorum's value of a step, auto_quorum.h, with no
// per-job constant). A pure accumulator: the coordinator (step_decider.cc) feeds it what READY
// carries (each contributor's squared local gradient norm, and the squared norm of the
// previous step's reduced gradient), qring-sim (train/sim.cc) the same numbers of its virtual
// workers.
//
// B_simple = tr(S) / |G|^2 (McCandlish, Kaplan, Amodei, "An Empirical Model of Large-Batch
// Training", 2018, appendix A, the unbiased two-batch estimates), in contributions (one
// contributor's batch = 1; times the batch per rank it is in samples): from a step's N >= 2
// contributions g_i and their mean g,
//   |G|^2 ~ (N |g|^2 - mean |g_i|^2) / (N - 1),   tr(S) ~ N (mean |g_i|^2 - |g|^2) / (N - 1),
// each averaged over steps (an exponential moving average, weight `alpha` for the newest: the
// noise scale grows as training goes on), the estimate their ratio.
#pragma once

#include <optional>

namespace qring::collectives {

class NoiseScaleEstimate {
 public:
  static constexpr double kAlpha = 0.05;
  explicit NoiseScaleEstimate(double alpha = kAlpha) : alpha_(alpha) {}
  // One step of n contributions: mean_local_sq = the mean over them of |g_i|^2, reduced_sq =
  // |mean of the g_i|^2. Steps of fewer than 2 contributions, and non-finite or negative
  // norms, say nothing and are skipped.
  void add(int n, double mean_local_sq, double reduced_sq);
  // In contributions; none before a step was added or while the |G|^2 average is not positive.
  std::optional<double> value() const;

 private:
  double alpha_;
  bool any_ = false;
  double g2_ = 0, trace_ = 0;
};

}  // namespace qring::collectives
