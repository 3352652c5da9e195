// The errors of the quorum all-reduce and of its membership (quorum.h, membership.h).
#pragma once

#include <string>
#include <vector>

#include "collectives/work.h"
#include "net/base/error.h"

namespace qring::collectives {

class QuorumTimeout : public CollectiveTimeout {
 public:
  QuorumTimeout(const std::string& msg, std::vector<int> missing)
      : CollectiveTimeout(msg), missing_(std::move(missing)) {}
  const std::vector<int>& missing() const { return missing_; }

 private:
  std::vector<int> missing_;
};

// The job cannot go on: fewer live ranks than it needs (quorum, quorum.min_world), or the
// coordinator fell silent. Every rank gets it, naming who left and when each was last heard.
class QuorumLost : public QuorumTimeout {
 public:
  using QuorumTimeout::QuorumTimeout;
};

// A rank that the others evicted while it was alive (paused, or too slow to take its
// results): it learns at its next contact with the coordinator and must leave the job.
class Evicted : public IoError {
 public:
  using IoError::IoError;
};

// An Evicted rank that was alive and heard, but so far behind the others (QuorumOptions::
// max_lag) that it catches up by rejoining with a live member's state.
class Behind : public Evicted {
 public:
  using Evicted::Evicted;
};

// A rank that came back to a job that had finished meanwhile: there is nothing to rejoin.
class JobOver : public IoError {
 public:
  using IoError::IoError;
};

}  // namespace qring::collectives
