// The reports of a quorum all-reduce between the callers' threads (QuorumReports) and the
// engine (the member service sends parts up, keeps those it receives as coordinator, logs the
// arrivals): this hand-off, and nothing else, under its mutex. Internal.
#pragma once

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "collectives/quorum/reports.h"

namespace qring::collectives {

class Engine;
class MembershipBox;

class ReportBox final : public QuorumReports {
 public:
  ReportBox(Engine& engine, int world, const MembershipBox& membership);

  void report(uint64_t key, int part, int parts, std::vector<double> values) override;
  std::map<int, std::vector<double>> gather_reports(uint64_t key, int parts, int skip,
                                                    Deadline until,
                                                    const std::vector<int>& senders) override;
  std::map<uint64_t, std::vector<double>> arrival_log() const override;

  // ---- The engine's side.
  struct Part {
    uint64_t key;
    uint32_t part, parts;
    std::vector<double> values;
  };
  std::vector<Part> take_outgoing();
  // A part received (or this rank's own, when it coordinates).
  void keep(uint64_t key, uint32_t part, uint32_t parts, std::vector<double> values);
  // The coordinator's arrival of `rank`'s READY for `step`, `ms` after the step's first.
  void log_arrival(uint64_t step, int rank, double ms);
  void fail(std::exception_ptr e);

 private:
  // Drops the reports of `key` and every older key (the caller holds mu_).
  void drop_through(uint64_t key);

  Engine& engine_;
  const int world_;
  const MembershipBox& membership_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr poison_;
  std::vector<Part> out_;  // report() calls not sent yet
  // Coordinator: reports received, by key, then by the number of parts the sender split the
  // report into and the part. A key waits until the coordinator gathers it (which drops it and
  // every older one), however far the others are ahead: a lagging coordinator still finds its
  // next key's parts. Only a bound on the parts held (a coordinator that never gathers) drops
  // the oldest keys. (A bound of 16 keys once dropped them: a coordinator 16 evaluations
  // behind found no sums, waited its deadline at every evaluation, and fell further behind.)
  static constexpr size_t kMaxParts = size_t(1) << 16;
  std::map<uint64_t, std::map<std::pair<uint32_t, int>, std::vector<double>>> in_;
  size_t parts_in_ = 0;
  // Coordinator only: the newest kKeepArrivals steps, so that a long run's log stays bounded.
  // A step's entry changes while late READYs for it are logged (the coordinator remembers its
  // newest 4096 decided steps); the trainer streams each step into arrivals.jsonl once it is
  // far enough behind to be final (train/trainer.cc).
  static constexpr size_t kKeepArrivals = 16384;
  std::map<uint64_t, std::vector<double>> arrivals_;
};

}  // namespace qring::collectives
