// The steps of a quorum all-reduce between the callers' thread (contribute, wait, excluded)
// and the engine (the member service and its step runner): this hand-off, and nothing else,
// under its mutex. Internal to the quorum all-reduce.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "collectives/clock.h"
#include "collectives/quorum/quorum.h"
#include "net/base/large_buffer.h"

namespace qring::collectives {

// Results and kept buffers (count elements each): in huge pages, since a rank that falls
// behind, or a joiner catching up, makes the others keep a new one per step.
using Bytes = net::LargeVector<char>;

struct StepLocal {
  void* buf = nullptr;
  std::vector<Rejoined> joined;    // ranks that entered the view at this step
  std::optional<uint64_t> digest;  // sent with the READY
  std::optional<QuorumAllreduce::Norms> norms;  // sent with the READY
  bool contributed = false;
  Clock::time_point contrib_time{};
  bool decided = false;
  bool ring_finished = false;  // speculative ring (quorum = world) done, DECIDE pending
  bool excluded = false;
  bool done = false;
  std::exception_ptr error;
  QuorumResult result;
  // Where the result lands when it is not reduced in place: the excluded rank's copy, and in
  // a job that survives lost ranks every rank's (kept until every live rank has the step).
  std::shared_ptr<Bytes> out;
};

class StepTable {
 public:
  std::mutex mu;
  std::condition_variable cv;  // a step done or failed, the all-reduce failed
  std::map<uint64_t, StepLocal> steps;
  std::vector<uint64_t> contributed;  // steps whose READY the engine has not sent yet
  std::exception_ptr poison;          // the all-reduce failed: every later call rethrows it
  // Why the member service died, when it did (its callers are told this, not the engine's
  // failure it causes: an Evicted stays an Evicted).
  std::exception_ptr service_error;

  // Fails every step not done yet, and the calls to come.
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!poison) poison = e;
    for (auto& [t, s] : steps)
      if (!s.done && !s.error) s.error = e;
    cv.notify_all();
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu);
    return poison != nullptr;
  }
};

// The quorum traffic's tags (net::make_tag): a chunk field with the sender's rank and the
// all-reduce's instance, so that a late message of an earlier instance on the same
// communicator never matches; and a step's sequence per attempt, so that the ring and the
// result sends of a step decided again never match those of an earlier attempt.
inline uint64_t quorum_chunk(int rank, uint32_t instance) {
  return uint64_t(rank) | (uint64_t(instance & 0xFF) << 16);
}
inline uint64_t attempt_seq(uint64_t step, uint32_t attempt) {
  return (step << 3) | (attempt & 7u);
}

inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace qring::collectives
