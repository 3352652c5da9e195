// Small helpers of the runs' measurements: the seconds since a steady-clock time, and the
// nearest-rank quantile of a sample (its summaries: step times, iteration times).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

namespace qring::train {

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The q-quantile (0 <= q <= 1) of v by nearest rank; 0 for an empty sample.
inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = size_t(std::llround(q * double(v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

}  // namespace qring::train
