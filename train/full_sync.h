// What the backup workers saved (summary.json: backup_saved_s, full_sync_estimate_s; docs/
// training.md, "What the backup workers saved"): per step, how much later the step would have
// been decided had it waited for every live rank, from the arrivals that really happened.
//
// The coordinator knows, per step, when each rank's contribution arrived (ms after the step's
// first; late ones included: QuorumAllreduce::arrival_log) and when it decided the step. Had
// the step waited for every rank it would have been decided at the last arrival: the step's
// saving is max(0, last arrival - decision). Two corrections keep the estimate from
// overstating it:
//  - a rank that arrived after the decision of step t-1 (it was still computing t-1) started
//    step t that much after the others; in full sync it would have started with them, so its
//    arrival in step t counts without that lag;
//  - a rank that never contributed gave the step up while it slept its straggler delay (the
//    step was decided without it): its arrival is taken as its delay minus the delay of the
//    step's first arrival (the straggler model is a pure function of seed, rank and step);
//    any other lateness of that rank is not known and not counted.
// With quorum = world every step is decided at its last arrival: the saving is 0. The ring of
// all ranks instead of the quorum's (more members) is not counted either.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

namespace qring::train {

class FullSyncEstimate {
 public:
  // delay_ms(rank, step): the straggler model's delay of that rank at that step.
  explicit FullSyncEstimate(std::function<double(int, uint64_t)> delay_ms);

  // Step `step`, decided `decide_ms` after its first arrival; arrivals_ms[r] = when rank r's
  // contribution arrived (ms after the first; < 0: never); `members`: the ranks of the view
  // that decided it (others are ignored). Steps come in increasing order.
  void add(uint64_t step, const std::vector<double>& arrivals_ms, double decide_ms,
           const std::vector<int>& members);

  double saved_ms() const { return saved_ms_; }  // summed over the steps added
  int64_t steps() const { return steps_; }

 private:
  std::function<double(int, uint64_t)> delay_ms_;
  double saved_ms_ = 0;
  int64_t steps_ = 0;
  // Per rank, how late it started the step after the last one added (its lateness then).
  std::map<int, double> lag_ms_;
  int64_t last_step_ = -2;
};

}  // namespace qring::train
