#include "collectives/quorum/witness.h"

#include <mutex>

#include "collectives/quorum/join_agent.h"

namespace qring::collectives {

std::vector<int> deaths_to_watch(const qproto::View& view, int coordinator, int self,
                                 bool gathering) {
  std::vector<int> ranks{coordinator};
  for (int r : view.members)
    if (r != coordinator && r != self && (r < self || gathering)) ranks.push_back(r);
  return ranks;
}

qproto::Up death_event(int rank, uint32_t incarnation) {
  qproto::Up d(qproto::Up::Kind::kDied);
  d.from = rank;
  d.count = incarnation;
  return d;
}

Witness::Witness(int world) : inc_(size_t(world), 0), dead_(size_t(world), 0) {}

void Witness::incarnation(int r, uint32_t inc) {
  if (inc <= inc_[size_t(r)]) return;
  inc_[size_t(r)] = inc;
  dead_[size_t(r)] = 0;  // a new process of the rank
}

std::vector<std::pair<int, uint32_t>> Witness::watch(const std::vector<int>& ranks) const {
  std::vector<std::pair<int, uint32_t>> w;
  for (int r : ranks)
    if (r >= 0 && size_t(r) < dead_.size() && !dead_[size_t(r)]) w.emplace_back(r, inc_[size_t(r)]);
  return w;
}

std::vector<std::pair<int, uint32_t>> Witness::exchange(JoinAgentIo& io,
                                                       const std::vector<int>& ranks) {
  std::vector<std::pair<int, uint32_t>> found;
  {
    std::lock_guard<std::mutex> lock(io.mu);
    io.watch_dead = watch(ranks);
    found.swap(io.dead);
  }
  std::vector<std::pair<int, uint32_t>> fresh;
  for (auto [r, inc] : found) {
    if (r < 0 || size_t(r) >= dead_.size() || dead_[size_t(r)] || inc != inc_[size_t(r)]) continue;
    dead_[size_t(r)] = 1;
    fresh.emplace_back(r, inc);
  }
  return fresh;
}

}  // namespace qring::collectives
