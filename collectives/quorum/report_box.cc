#include "collectives/quorum/report_box.h"

#include <fmt/format.h>

#include <cmath>

#include "collectives/engine.h"
#include "collectives/quorum/membership_box.h"
#include "collectives/quorum/wire.h"

namespace qring::collectives {

ReportBox::ReportBox(Engine& engine, int world, const MembershipBox& membership)
    : engine_(engine), world_(world), membership_(membership) {}

void ReportBox::report(uint64_t key, int part, int parts, std::vector<double> values) {
  if (parts < 1 || parts > world_ || part < 0 || part >= parts)
    throw UsageError(fmt::format("quorum report: part {} of {} ({} ranks)", part, parts, world_));
  if (values.empty() || values.size() > qwire::kMaxShardValues)
    throw UsageError(fmt::format("quorum report: {} values (1 to {})", values.size(),
                                 qwire::kMaxShardValues));
  for (double v : values)
    if (!std::isfinite(v)) throw UsageError("quorum report: a value is not finite");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (poison_) std::rethrow_exception(poison_);
    out_.push_back({key, uint32_t(part), uint32_t(parts), std::move(values)});
  }
  if (!engine_.try_progress()) engine_.kick();
}

std::map<int, std::vector<double>> ReportBox::gather_reports(uint64_t key, int parts, int skip,
                                                             Deadline until,
                                                             const std::vector<int>& senders) {
  const size_t views_before = membership_.view_count();
  // Part p's sender has left the job.
  auto gone = [&](int p) {
    return size_t(p) < senders.size() && membership_.gone(senders[size_t(p)], views_before);
  };
  auto have = [&] {
    auto it = in_.find(key);
    for (int p = 0; p < parts; ++p) {
      if (p == skip) continue;
      const bool in = it != in_.end() && it->second.count({uint32_t(parts), p}) > 0;
      if (!in && !gone(p)) return false;
    }
    return true;
  };
  std::unique_lock<std::mutex> lock(mu_);
  // The engine receives the parts (keep notifies); a sender that leaves is seen within 50 ms.
  while (!have() && !poison_ && engine_.now() < until) {
    const Deadline next = std::min(until, engine_.now() + std::chrono::milliseconds(50));
    engine_.clock().wait_until(lock, cv_, next, [&] { return poison_ || have(); });
  }
  if (poison_) std::rethrow_exception(poison_);
  std::map<int, std::vector<double>> out;
  auto it = in_.find(key);
  if (it != in_.end()) {
    for (auto& [at, v] : it->second)
      if (at.first == uint32_t(parts) && at.second != skip) out[at.second] = std::move(v);
  }
  // This key and every older one are done.
  drop_through(key);
  return out;
}

std::map<uint64_t, std::vector<double>> ReportBox::arrival_log() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arrivals_;
}

std::vector<ReportBox::Part> ReportBox::take_outgoing() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Part> out;
  out.swap(out_);
  return out;
}

void ReportBox::keep(uint64_t key, uint32_t part, uint32_t parts, std::vector<double> v) {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_[key].insert_or_assign({parts, int(part)}, std::move(v)).second) ++parts_in_;
  while (parts_in_ > kMaxParts && in_.size() > 1) {
    parts_in_ -= in_.begin()->second.size();
    in_.erase(in_.begin());
  }
  cv_.notify_all();
}

void ReportBox::log_arrival(uint64_t step, int rank, double ms) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& log = arrivals_[step];
  if (log.empty()) log.assign(size_t(world_), -1.0);
  log[size_t(rank)] = ms;
  while (arrivals_.size() > kKeepArrivals) arrivals_.erase(arrivals_.begin());
}

void ReportBox::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!poison_) poison_ = e;
  cv_.notify_all();
}

void ReportBox::drop_through(uint64_t key) {
  const auto end = in_.upper_bound(key);
  for (auto it = in_.begin(); it != end; ++it) parts_in_ -= it->second.size();
  in_.erase(in_.begin(), end);
}

}  // namespace qring::collectives
