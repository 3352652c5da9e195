// This rank's side of each step's agreement with the coordinator: the contributions its caller
// made (taken from the step table with the digest and norms they carry), the READY that
// announces each (sent again to a coordinator that takes over, until the step is decided),
// and the decisions it saw that may not be settled everywhere yet (a takeover's ACK carries
// them, so that the new coordinator recovers what the old one decided). Engine thread only;
// the member service (member.h) sends what it builds.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "collectives/quorum/messages.h"
#include "collectives/quorum/quorum.h"
#include "collectives/quorum/steps.h"

namespace qring::collectives {

class StepLedger {
 public:
  // `count` elements of `layout` (qproto::layout_of) per contribution.
  StepLedger(uint64_t count, uint32_t layout) : count_(count), layout_(layout) {}
  // The steps the caller contributed to since the last look, in order (now awaiting their
  // decision).
  std::vector<uint64_t> take(StepTable& table);
  // The READY of step t.
  qproto::Up ready(uint64_t t) const;
  // The steps contributed to and not decided yet.
  const std::set<uint64_t>& awaiting() const { return awaiting_; }
  // A DECIDE: forgets the decisions every live rank settled, keeps this one's.
  void decision(const qproto::Decision& d);
  // The first decision of step t was applied: it no longer awaits one.
  void answered(uint64_t t);
  // What a takeover's ACK carries.
  std::vector<qproto::Known> known() const;

 private:
  const uint64_t count_;
  const uint32_t layout_;
  std::map<uint64_t, qproto::Known> decisions_;  // decisions not yet settled everywhere
  std::set<uint64_t> awaiting_;                  // steps this rank contributed to, undecided
  std::map<uint64_t, uint64_t> digests_;         // their READYs' digests
  std::map<uint64_t, QuorumAllreduce::Norms> norms_;  // their READYs' norms
};

}  // namespace qring::collectives
