#include "train/full_sync.h"

#include <algorithm>
#include <utility>

namespace qring::train {

FullSyncEstimate::FullSyncEstimate(std::function<double(int, uint64_t)> delay_ms)
    : delay_ms_(std::move(delay_ms)) {}

void FullSyncEstimate::add(uint64_t step, const std::vector<double>& arrivals_ms,
                           double decide_ms, const std::vector<int>& members) {
  // The lags carry over only from the step just before.
  if (int64_t(step) != last_step_ + 1) lag_ms_.clear();
  last_step_ = int64_t(step);
  auto arrival = [&](int r) {
    return size_t(r) < arrivals_ms.size() ? arrivals_ms[size_t(r)] : -1.0;
  };
  int first = -1;
  for (int r : members)
    if (arrival(r) >= 0 && (first < 0 || arrival(r) < arrival(first))) first = r;
  if (first < 0) return;  // nothing arrived: a skipped step
  double last = 0;
  std::map<int, double> lag;
  for (int r : members) {
    const double a = arrival(r);
    double est;
    if (a >= 0) {
      const auto it = lag_ms_.find(r);
      est = std::max(0.0, a - (it == lag_ms_.end() ? 0.0 : it->second));
      if (a > decide_ms) lag[r] = a - decide_ms;  // still computing when the others went on
    } else {
      est = std::max(0.0, delay_ms_(r, step) - delay_ms_(first, step));
    }
    last = std::max(last, est);
  }
  lag_ms_ = std::move(lag);
  saved_ms_ += std::max(0.0, last - decide_ms);
  ++steps_;
}

}  // namespace qring::train
