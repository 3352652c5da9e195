#include "collectives/quorum/membership_box.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "collectives/engine.h"
#include "collectives/quorum/errors.h"

namespace qring::collectives {

std::vector<ViewChange> views_learned(const std::vector<ViewChange>& views, uint64_t decided_in,
                                      uint64_t* known) {
  std::vector<ViewChange> out;
  if (decided_in <= *known) return out;
  for (const auto& v : views)  // in epoch order, as applied (view_changes())
    if (v.epoch > *known && v.epoch <= decided_in) out.push_back(v);
  *known = decided_in;
  return out;
}

MembershipBox::MembershipBox(Engine& engine, int world, bool survives, bool joining)
    : engine_(engine), world_(world), survives_(survives) {
  if (joining) {
    coordinator_ = -1;  // learned when it is admitted
    return;
  }
  for (int r = 0; r < world; ++r) members_.push_back(r);
  ViewChange v;
  v.members = members_;
  v.seen = engine.now();
  views_.push_back(std::move(v));
}

std::vector<int> MembershipBox::members() const {
  std::lock_guard<std::mutex> lock(mu_);
  return members_;
}

std::vector<ViewChange> MembershipBox::view_changes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return views_;
}

int MembershipBox::coordinator() const {
  std::lock_guard<std::mutex> lock(mu_);
  return coordinator_;
}

bool MembershipBox::gone(int rank, size_t views_before) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (views_.empty()) return false;
  const std::vector<int>& m = views_.back().members;
  if (std::find(m.begin(), m.end(), rank) == m.end()) return true;
  for (size_t i = views_before; i < views_.size(); ++i)
    for (auto& l : views_[i].left)
      if (l.rank == rank) return true;
  return false;
}

size_t MembershipBox::view_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return views_.size();
}

void MembershipBox::view_applied(ViewChange v) {
  std::lock_guard<std::mutex> lock(mu_);
  views_.push_back(std::move(v));
  cv_.notify_all();
}

void MembershipBox::set_members(const std::vector<int>& members) {
  std::lock_guard<std::mutex> lock(mu_);
  members_ = members;
}

void MembershipBox::set_coordinator(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  coordinator_ = rank;
  cv_.notify_all();
}

void MembershipBox::coordinator_finished() {
  std::lock_guard<std::mutex> lock(mu_);
  coordinator_done_ = true;
  cv_.notify_all();
}

bool MembershipBox::await_end(int rank, Deadline until) {
  std::unique_lock<std::mutex> lock(mu_);
  engine_.clock().wait_until(lock, cv_, until, [&] {
    return coordinator_ == rank || coordinator_done_ || poison_ != nullptr;
  });
  return coordinator_ == rank;
}

void MembershipBox::admitted(const JoinInfo& info, const std::vector<int>& members,
                             int coordinator) {
  std::lock_guard<std::mutex> lock(mu_);
  joined_ = info;
  members_ = members;
  coordinator_ = coordinator;
  cv_.notify_all();
}

void MembershipBox::set_join_stage(std::string stage) {
  std::lock_guard<std::mutex> lock(mu_);
  join_stage_ = std::move(stage);
}

void MembershipBox::job_over() {
  std::lock_guard<std::mutex> lock(mu_);
  job_over_ = true;
  cv_.notify_all();
}

bool MembershipBox::is_job_over() const {
  std::lock_guard<std::mutex> lock(mu_);
  return job_over_;
}

void MembershipBox::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!poison_) poison_ = e;
  cv_.notify_all();
}

JoinInfo MembershipBox::join(Deadline until) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto t0 = engine_.now();
  engine_.clock().wait_until(lock, cv_, until,
                             [&] { return joined_ || poison_ || job_over_; });
  if (poison_) std::rethrow_exception(poison_);
  if (!joined_ && job_over_)
    throw JobOver(fmt::format("rank {}: the job finished before this incarnation was admitted",
                              engine_.rank()));
  if (!joined_)
    throw QuorumTimeout(
        fmt::format("rank {}: rejoining the running job: not admitted within {:.0f} ms ({})",
                    engine_.rank(), ms_between(t0, engine_.now()), join_stage_),
        {});
  return *joined_;
}

size_t MembershipBox::receive_state(void* buf, size_t len, Deadline until) {
  if (len == 0 || !buf) throw UsageError("quorum receive_state(): empty buffer");
  int donor;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!joined_) throw UsageError("quorum receive_state() before join()");
    donor = joined_->donor;
    state_len_ = len;
  }
  engine_.kick();
  std::unique_lock<std::mutex> lock(mu_);
  const auto t0 = engine_.now();
  engine_.clock().wait_until(lock, cv_, until,
                             [&] { return state_done_ || poison_ || job_over_; });
  if (poison_) std::rethrow_exception(poison_);
  // Admitted at the very end: the members finished before the donor's next step boundary,
  // where it would have sent the state.
  if (!state_done_ && job_over_)
    throw JobOver(fmt::format("rank {}: the job finished before this incarnation got its state "
                              "from rank {}",
                              engine_.rank(), donor));
  if (!state_done_)
    throw QuorumTimeout(fmt::format("rank {}: rejoining: no state from rank {} (the donor) "
                                    "within {:.0f} ms",
                                    engine_.rank(), donor, ms_between(t0, engine_.now())),
                        {donor});
  std::memcpy(buf, state_in_->data(), state_bytes_);
  state_in_.reset();
  return state_bytes_;
}

void MembershipBox::send_state(int to, uint64_t step,
                               std::shared_ptr<const std::vector<char>> state) {
  if (to < 0 || to >= world_ || to == engine_.rank())
    throw UsageError(fmt::format("quorum send_state(): rank {} out of range", to));
  if (!state) throw UsageError("quorum send_state(): no state");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (poison_) std::rethrow_exception(poison_);
    state_out_.push_back({to, step, std::move(state)});
  }
  engine_.kick();
}

std::vector<MembershipBox::StateOut> MembershipBox::take_state_out() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StateOut> out;
  out.swap(state_out_);
  return out;
}

size_t MembershipBox::state_wanted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_done_ ? 0 : state_len_;
}

void MembershipBox::state_arrived(std::shared_ptr<Bytes> buf, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  state_in_ = std::move(buf);
  state_bytes_ = bytes;
  state_done_ = true;
  cv_.notify_all();
}

bool MembershipBox::state_over() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_done_;
}

}  // namespace qring::collectives
