#include "collectives/quorum/noise_scale.h"

#include <cmath>

namespace qring::collectives {

void NoiseScaleEstimate::add(int n, double mean_local_sq, double reduced_sq) {
  if (n < 2 || !std::isfinite(mean_local_sq) || !std::isfinite(reduced_sq) || mean_local_sq < 0 ||
      reduced_sq < 0)
    return;
  const double k = double(n);
  const double g2 = (k * reduced_sq - mean_local_sq) / (k - 1);
  const double trace = k * (mean_local_sq - reduced_sq) / (k - 1);
  if (!any_) {
    g2_ = g2;
    trace_ = trace;
    any_ = true;
  } else {
    g2_ += alpha_ * (g2 - g2_);
    trace_ += alpha_ * (trace - trace_);
  }
}

std::optional<double> NoiseScaleEstimate::value() const {
  if (!any_ || !(g2_ > 0)) return std::nullopt;
  return trace_ / g2_;
}

}  // namespace qring::collectives
