// Reports of a quorum all-reduce: small sums gathered at the coordinator without a collective
// (the sharded evaluation, the final replica check), and the coordinator's arrival log. One
// per QuorumAllreduce (QuorumAllreduce::reports()); any thread may call it.
//
//   if (m.coordinator() != me) r.report(key, part, parts, {sum, n});       // and go on
//   else auto parts = r.gather_reports(key, parts, my_part, deadline, senders);
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "collectives/clock.h"

namespace qring::collectives {

class QuorumReports {
 public:
  virtual ~QuorumReports() = default;
  // A rank sends part `part` of `parts` of the report `key` (1 to 8 finite float64) and goes
  // on; nothing waits for it. Reports travel on the control stream to the coordinator in
  // force; one sent while the coordinator changes may be lost.
  virtual void report(uint64_t key, int part, int parts, std::vector<double> values) = 0;
  // At the coordinator: waits until parts [0, parts) of `key` other than `skip` (its own;
  // -1 = none) are in, or until `until`, and returns those that arrived (part -> values).
  // With `senders` (the rank that sends each part), it stops waiting for a part as soon as
  // its sender has left the job (a view without it). A part its sender split into another
  // number of parts (it saw other members) does not count. Reports of this key and of older
  // keys are dropped afterwards.
  virtual std::map<int, std::vector<double>> gather_reports(
      uint64_t key, int parts, int skip, Deadline until, const std::vector<int>& senders = {}) = 0;
  // At the coordinator: per step, each rank's contribution time in ms after the step's first
  // (late ones included; -1 = never arrived). Empty elsewhere. Only the newest 16384 steps.
  virtual std::map<uint64_t, std::vector<double>> arrival_log() const = 0;
};

}  // namespace qring::collectives
