// The membership of a quorum all-reduce between the callers' threads (QuorumMembership) and
// the engine (the member service applies views, admits a joiner, moves state transfers): this
// hand-off, and nothing else, under its mutex. Internal to the quorum all-reduce.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/quorum/membership.h"
#include "collectives/quorum/steps.h"

namespace qring::collectives {

class Engine;

class MembershipBox final : public QuorumMembership {
 public:
  // `survives`: the job goes on without a rank; `joining`: this process joins a running job.
  MembershipBox(Engine& engine, int world, bool survives, bool joining);

  std::vector<int> members() const override;
  std::vector<ViewChange> view_changes() const override;
  int coordinator() const override;
  bool survives_loss() const override { return survives_; }
  bool await_end(int rank, Deadline until) override;
  JoinInfo join(Deadline until) override;
  size_t receive_state(void* buf, size_t len, Deadline until) override;
  void send_state(int to, uint64_t step, std::shared_ptr<const std::vector<char>> state) override;

  // Whether `rank` left the job: not in the newest view, or dropped by a view after the
  // first `views_before` (it may be back as a new incarnation). Reports stop waiting for it.
  bool gone(int rank, size_t views_before) const;
  size_t view_count() const;

  // ---- The engine's side.
  void view_applied(ViewChange v);
  void set_members(const std::vector<int>& members);  // as of a completed step
  void set_coordinator(int rank);
  void coordinator_finished();  // the coordinator said goodbye (BYE)
  // The joiner: admitted (join() returns it), or what it waits for (join()'s error).
  void admitted(const JoinInfo& info, const std::vector<int>& members, int coordinator);
  void set_join_stage(std::string stage);
  // The joiner: the job ended before it got in (the join agent saw it).
  void job_over();
  bool is_job_over() const;
  // State transfer. The donor's sends asked for by send_state, and the joiner's receive:
  // how many bytes receive_state() takes at most (0: not asked yet, or done), and its end.
  struct StateOut {
    int to;
    uint64_t step;
    std::shared_ptr<const std::vector<char>> buf;
  };
  std::vector<StateOut> take_state_out();
  size_t state_wanted() const;
  void state_arrived(std::shared_ptr<Bytes> buf, size_t bytes);
  bool state_over() const;
  void fail(std::exception_ptr e);

 private:
  Engine& engine_;
  const int world_;
  const bool survives_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> members_;  // as of the last completed step
  int coordinator_ = 0;
  bool coordinator_done_ = false;
  std::vector<ViewChange> views_;
  std::exception_ptr poison_;
  // The joiner.
  std::optional<JoinInfo> joined_;
  std::string join_stage_ = "waiting for the coordinator to notice this incarnation";
  bool job_over_ = false;
  // State transfer.
  std::vector<StateOut> state_out_;
  size_t state_len_ = 0;
  bool state_done_ = false;
  std::shared_ptr<Bytes> state_in_;
  size_t state_bytes_ = 0;
};

}  // namespace qring::collectives
