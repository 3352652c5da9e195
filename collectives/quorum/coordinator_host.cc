#include "collectives/quorum/coordinator_host.h"

namespace qring::collectives {

CoordinatorHost::CoordinatorHost(std::unique_ptr<qproto::Coordinator> state, Send send,
                                 std::function<void(uint64_t, int, double)> arrival)
    : state_(std::move(state)), send_(std::move(send)) {
  state_->on_arrival(std::move(arrival));
}

bool CoordinatorHost::feed(Clock::time_point now, bool tick) {
  bool fed = false;
  // A message sent may be applied here and make this rank send the coordinator another (a
  // REPORT for a RECOVER): that one comes in the next round.
  while (!inbox_.empty()) {
    std::vector<qproto::Up> batch;
    batch.swap(inbox_);
    for (size_t i = 0; i < batch.size(); ++i)
      for (const auto& m : state_->handle(batch[i], now, /*more=*/i + 1 < batch.size())) send_(m);
    fed = true;
  }
  if (tick && now - last_tick_ >= std::chrono::microseconds(200)) {
    last_tick_ = now;
    for (const auto& m : state_->handle(qproto::Up{}, now)) send_(m);
  }
  return fed;
}

bool CoordinatorHost::serving(Clock::time_point now, bool busy, Clock::duration limit) {
  if (serve_until_ == Clock::time_point{}) serve_until_ = now + limit;
  if (now > serve_until_ || state_->stopped()) return false;
  return busy || state_->recovering();
}

}  // namespace qring::collectives
