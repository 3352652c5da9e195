#include "collectives/quorum/step_ledger.h"

#include <mutex>

#include "collectives/quorum/wire.h"

namespace qring::collectives {

std::vector<uint64_t> StepLedger::take(StepTable& table) {
  std::vector<uint64_t> steps;
  {
    std::lock_guard<std::mutex> lock(table.mu);
    steps.swap(table.contributed);
    for (uint64_t t : steps) {
      auto it = table.steps.find(t);
      if (it != table.steps.end() && it->second.digest) digests_[t] = *it->second.digest;
      if (it != table.steps.end() && it->second.norms) norms_[t] = *it->second.norms;
    }
  }
  for (uint64_t t : steps) awaiting_.insert(t);
  return steps;
}

qproto::Up StepLedger::ready(uint64_t t) const {
  qproto::Up m{qproto::Up::Kind::kReady};
  m.step = t;
  m.count = count_;
  m.layout = layout_;
  auto d = digests_.find(t);
  if (d != digests_.end()) m.digest = d->second;
  if (auto n = norms_.find(t); n != norms_.end()) {
    m.grad_sq = n->second.contribution_sq;
    m.prev_mean_sq = n->second.prev_result_sq;
  }
  return m;
}

void StepLedger::decision(const qproto::Decision& d) {
  const uint64_t t = d.step;
  if (d.settled >= 0)
    decisions_.erase(decisions_.begin(), decisions_.upper_bound(uint64_t(d.settled)));
  if (d.status == qproto::Status::kOk || d.status == qproto::Status::kSkipped) {
    auto& k = decisions_[t];
    // A forward with no contributors (a recovery by a coordinator that did not know S(t))
    // keeps the S(t) this rank was told.
    const bool unknown = d.source >= 0 && d.contributors.empty();
    if (d.attempt >= k.attempt)
      k = {t, d.attempt, d.status == qproto::Status::kSkipped,
           unknown ? k.contributors : d.contributors};
    while (decisions_.size() > qwire::kMaxKnown) decisions_.erase(decisions_.begin());
  }
}

void StepLedger::answered(uint64_t t) {
  awaiting_.erase(t);
  digests_.erase(t);
  norms_.erase(t);
}

std::vector<qproto::Known> StepLedger::known() const {
  std::vector<qproto::Known> k;
  for (auto& [t, d] : decisions_) k.push_back(d);
  return k;
}

}  // namespace qring::collectives
